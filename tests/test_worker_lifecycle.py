"""A worker's life between requests, against a real CPU server: a reused worker starts each
request with torch's settings as it started (docs/server.md §3.3)."""

import time

from tests.support import ServerProcess, plain, post

TORCH_STATE = ("import torch\n"
               "def f(change):\n"
               "    seen = {'dtype': str(torch.get_default_dtype()),\n"
               "            'deterministic': torch.are_deterministic_algorithms_enabled(),\n"
               "            'warn_only': torch.is_deterministic_algorithms_warn_only_enabled(),\n"
               "            'matmul': torch.get_float32_matmul_precision(),\n"
               "            'cudnn_benchmark': torch.backends.cudnn.benchmark}\n"
               "    if change:\n"
               "        torch.set_default_dtype(torch.float64)\n"
               "        torch.use_deterministic_algorithms(True, warn_only=True)\n"
               "        torch.set_float32_matmul_precision('medium')\n"
               "        torch.backends.cudnn.benchmark = True\n"
               "    return {'pid': __import__('os').getpid(), **seen}\n")
DEFAULTS = {"dtype": "torch.float32", "deterministic": False, "warn_only": False, "matmul": "highest",
            "cudnn_benchmark": False}


def torch_state(server, change):
    program = {"instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": TORCH_STATE},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [change]},
        {"op": "return", "key": "out", "value": {"$ref": "r"}}]}
    status, _, body = post(server.url, program)
    assert status == 200 and body["status"] == "COMPLETED", body
    return plain(body["results"]["out"])


def test_a_reused_worker_puts_torch_settings_back(tmp_path):
    with ServerProcess("--max-requests-per-worker", "0", workers=1, tmp_path=tmp_path) as server:
        first = torch_state(server, change=True)
        second = torch_state(server, change=False)
    assert first.pop("pid") == second.pop("pid")  # the same process served both
    assert first == DEFAULTS and second == DEFAULTS


# Every worker forked from the template sleeps this long before it can report ready: a stand-in
# for a slow start (on a GPU server, process start plus imports plus CUDA initialisation).
SLOW_START_SECONDS = 1.0
SLOW_START = f"""
import os, sys, time
if sys.argv == ["-c"]:  # only the workers' template (the forkserver), not the server itself
    os.register_at_fork(after_in_child=lambda: time.sleep({SLOW_START_SECONDS}))
"""


def timed_sleep(server, seconds):
    """One request whose program sleeps -> (what the client waited, what the server reports it ran) in s."""
    program = {"instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": f"import time\ndef f():\n    time.sleep({seconds})\n"},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}}]}
    started = time.monotonic()
    status, _, body = post(server.url, program)
    assert status == 200 and body["status"] == "COMPLETED", body
    return time.monotonic() - started, body["elapsed_ms"] / 1e3


def test_the_next_fresh_worker_starts_while_the_request_runs(tmp_path):
    """docs/server.md §1.3: with a fresh worker per request, the next one starts when a request
    begins, so a request running longer than a worker's start-up leaves the next one nothing to
    wait for (before: each waited for the whole start of a worker begun after the last answer)."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_START)
    with ServerProcess(workers=1, tmp_path=tmp_path, env={"PYTHONPATH": str(tmp_path)}) as server:
        overheads = []
        for _ in range(3):  # back to back
            waited, ran = timed_sleep(server, SLOW_START_SECONDS * 1.5)
            overheads.append(waited - ran)
    assert max(overheads[1:]) < SLOW_START_SECONDS / 2, overheads
