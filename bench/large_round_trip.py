"""A 1 GiB tensor uploaded, used and returned on a server with its default limits: time and peak memory.

    .venv/bin/python -m bench.large_round_trip [--url URL --server-pid PID] [--mib 1024]

Without --url it starts our server with its defaults (unsandboxed, one CPU worker). The tensor is
one 8192 x 65536 float16 weight (1 GiB); the program sums its last column and returns it whole.
It runs twice: first the blob is sent (a cache miss), then the server holds it (a hit). The
client runs in a process of its own, so that its ru_maxrss is this transfer's; the server's
process tree (front-end, template, worker) is sampled every 10 ms while the client runs.
tests/test_large_inputs.py runs it and bounds what it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = "def last_column_sum(x):\n    return float(x[:, -1].float().sum())\n"

CLIENT = """
import json, resource, sys, time
import numpy as np
from client import Client, Program

url, rows = sys.argv[1], int(sys.argv[2])
weight = np.full((rows, 65536), 0.5, dtype=np.float16)
weight[:, -1] = 1.0
runs = []
with Client(url) as client:
    for attempt in ("miss", "hit"):
        program = Program()
        module = program.upload(kind="module", source=SOURCE)
        uploaded = program.upload(kind="tensor", value=weight)
        total = program.run(fn=program.get_function(module=module, name="last_column_sum"), args=[uploaded])
        program.return_(key="sum", value=total)
        program.return_(key="weight", value=uploaded)
        started = time.perf_counter()
        result = client.execute(program, timeout_seconds=600)
        seconds = time.perf_counter() - started
        assert result.completed, result.error
        assert result["sum"] == rows and np.array_equal(result["weight"], weight)
        del result.results["weight"]
        runs.append({"run": attempt, "seconds": round(seconds, 2), "blob_bytes_sent": result.blob_bytes_sent,
                     "blobs_cached": result.blobs_cached, "round_trips": result.round_trips})
print(json.dumps({"runs": runs, "client_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "payload_bytes": weight.nbytes}))
"""


def measure(url: str, server_pid: int, mib: int = 1024) -> dict:
    """Run the client against a server whose process tree is rooted at ``server_pid``."""
    from bench.bench_servers import TreeSampler, tree_memory

    idle_rss, _ = tree_memory(server_pid)
    with TreeSampler(server_pid) as sampler:
        started = time.perf_counter()
        child = subprocess.run([sys.executable, "-c", f"SOURCE = {SOURCE!r}\n" + CLIENT, url, str(mib * 8)],
                               cwd=REPO, capture_output=True, text=True, timeout=1200)
        seconds = time.perf_counter() - started
    if child.returncode != 0:
        raise RuntimeError(f"the client failed:\n{child.stderr[-4000:]}")
    report = json.loads(child.stdout)
    report.update(client_process_seconds=round(seconds, 2), server_idle_rss_bytes=idle_rss,
                  server_peak_rss_bytes=sampler.peaks["rss"], server_peak_pss_bytes=sampler.peaks["pss"])
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (then --server-pid names its front-end)")
    parser.add_argument("--server-pid", type=int)
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    if args.url:
        print(json.dumps(measure(args.url, args.server_pid, args.mib), indent=1))
        return
    from tests.support import ServerProcess

    with ServerProcess(workers=1, tmp_path=f"/tmp/kcoral-large-{os.getpid()}") as server:
        print(json.dumps(measure(server.url, server.proc.pid, args.mib), indent=1))


if __name__ == "__main__":
    main()
