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


TENANT_LIMIT_CASE = """
import sys
from kcoral import Client, KCoralError, Program
program = Program()
module = program.upload(kind="module", source="def f():\\n    return 1\\n")
program.return_(key="out", value=program.run(fn=program.get_function(module=module, name="f")))
try:
    Client(sys.argv[1]).execute(program)
except KCoralError as exc:
    print(type(exc).__name__, exc.status_code, exc.kind, exc)
"""


def test_reference_client_reports_a_tenant_limit_as_an_http_error(tmp_path):
    """429 (over --max-waiting-per-tenant) reaches the published client as the KCoralError it raises for 503."""
    from tests.test_tenants import NAP, open_post, simple_program, wait_for
    with ServerProcess("--max-waiting-per-tenant", "1", workers=1, tmp_path=tmp_path) as server:
        held = [open_post(server.url, simple_program(NAP, args=[30])) for _ in range(2)]  # one runs, one waits
        assert wait_for(lambda: server.health()["load"]["requests_waiting"] == 1, 20)
        result = subprocess.run([reference_python(), "-c", TENANT_LIMIT_CASE, server.url], **reference_popen_options(),
                                capture_output=True, text=True, timeout=120)
        for sock in held:  # cancelled: their client is gone
            sock.close()
    assert result.stdout.startswith("KCoralError 429 busy HTTP 429: "), result.stdout + result.stderr
    assert "--max-waiting-per-tenant" in result.stdout
