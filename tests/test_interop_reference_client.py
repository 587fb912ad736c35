"""Interop: the published kcoral 0.1.1 client (its own virtualenv) against our server.

The reference package is also named `kcoral`, so it never enters this project's
environment: tests/support.py installs it in a cached virtualenv of its own on first
use, whose python runs tests/reference_client_script.py against a server started here.
The script prints one line per case and exits non-zero on any failure.
"""

import os
import subprocess

from tests.support import ROOT, ServerProcess, reference_popen_options, reference_python

SCRIPT = os.path.join(ROOT, "tests", "reference_client_script.py")


def test_reference_client_against_our_server(tmp_path):
    python = reference_python()
    with ServerProcess(tmp_path=tmp_path) as server:
        # outside the repository, without PYTHONPATH: `import kcoral` must find the reference package
        result = subprocess.run([python, SCRIPT, server.url], **reference_popen_options(),
                                capture_output=True, text=True, timeout=600)
        log = server.log()
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"reference client cases failed:\n{output}\n--- server log ---\n{log[-4000:]}"
    assert "FAIL" not in result.stdout, output
    assert result.stdout.strip().splitlines()[-1].endswith("cases passed"), output
