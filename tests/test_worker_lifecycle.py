"""A worker's life between requests, against a real CPU server: a reused worker starts each
request with torch's settings as it started (docs/server.md §3.3)."""

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
