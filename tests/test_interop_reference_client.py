"""Interop: the published kcoral 0.1.1 client (its own virtualenv) against our server.

The reference package is also named `kcoral`, so it never enters this project's
environment: `shared/tools/reference-kcoral.sh setup` installs it in a separate venv and
prints that venv's python, which runs tests/reference_client_script.py against a server
started here.  The script prints one line per case and exits non-zero on any failure.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from tests.support import ServerProcess

TOOL = os.path.join(ROOT, "..", "shared", "tools", "reference-kcoral.sh")
SCRIPT = os.path.join(ROOT, "tests", "reference_client_script.py")


@pytest.fixture(scope="module")
def reference_python():
    if not os.path.exists(TOOL):
        pytest.skip(f"reference client tool not found at {os.path.normpath(TOOL)} (shared/ is not beside the repo)")
    result = subprocess.run(["bash", TOOL, "setup"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"reference-kcoral.sh setup failed:\n{result.stderr}"
    python = result.stdout.strip().splitlines()[-1]
    assert os.path.exists(python), result.stdout
    return python


def test_reference_client_against_our_server(reference_python, tmp_path):
    with ServerProcess(tmp_path=tmp_path) as server:
        # run outside the repo and without PYTHONPATH: `import kcoral` must find the reference package
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        result = subprocess.run([reference_python, SCRIPT, server.url], cwd=str(tmp_path), env=env,
                                capture_output=True, text=True, timeout=600)
        log = server.log()
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"reference client cases failed:\n{output}\n--- server log ---\n{log[-4000:]}"
    assert "FAIL" not in result.stdout, output
    assert result.stdout.strip().splitlines()[-1].endswith("cases passed"), output
