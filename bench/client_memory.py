"""Peak client memory for large uploads and downloads with client.py.

    .venv/bin/python -m bench.client_memory [--url URL] [--mib 256]

Without --url it starts the published reference server with request/response limits
raised above the payload. Each case runs in a fresh process,
because ru_maxrss only ever grows; it reports peak RSS growth relative to the payload:

* upload-bytes:  program.upload(kind="bytes", value=<bytes>) -> execute
* upload-tensor: program.upload(kind="tensor", value=<float32 array>) -> execute
                 (the program keeps its own snapshot of the array, as the contract says)
* download:      the server returns a bytes value of the same size
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support import reference_popen_options, reference_server_argv

REPO = Path(__file__).resolve().parents[1]
SIZE_SOURCE = "def size(b):\n    return len(b)\ndef make(n):\n    return bytes(n)\n"


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_case(case: str, url: str, mib: int) -> dict:
    import numpy as np

    import client

    size = mib * 1024 * 1024
    with client.Client(url) as c:
        c.health()
        baseline = max_rss_mib()
        program = client.Program()
        module = program.upload(kind="module", source=SIZE_SOURCE)
        if case == "download":
            payload = None
            call = program.run(fn=program.get_function(module=module, name="make"), args=[size])
        else:
            payload = (os.urandom(size) if case == "upload-bytes"
                       else np.frombuffer(os.urandom(size), dtype=np.float32).copy())
            kind = "bytes" if case == "upload-bytes" else "tensor"
            value = program.upload(kind=kind, value=payload)
            call = program.run(fn=program.get_function(module=module, name="size"), args=[value])
        after_payload = max_rss_mib()
        program.return_(key="out", value=call)
        started = time.perf_counter()
        result = c.execute(program, timeout_seconds=600)
        seconds = time.perf_counter() - started
        peak = max_rss_mib()
    if case == "upload-bytes":
        assert result["out"] == size, result
    if case == "download":
        assert len(result["out"]) == size, result
    # upload-tensor: the published CPU server answers FAILED "unavailable"; the upload
    # (and so the client's memory use) happened all the same.
    return {"case": case, "payload_mib": mib, "execute_seconds": round(seconds, 2),
            "payload_and_snapshot_mib": round(after_payload - baseline, 1),
            "peak_growth_mib": round(peak - baseline, 1),
            "peak_over_payload": round((peak - baseline) / mib, 2),
            "execute_overhead_mib": round(peak - after_payload, 1), "status": result.status}


def start_reference(mib: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    limit = str((2 * mib + 64) * 1024 * 1024)
    process = subprocess.Popen(
        reference_server_argv(port, "--num-workers", "1", "--disk-cache-dir", "", "--max-request-bytes", limit,
                              "--max-response-bytes", limit, "--no-log-console"),
        **reference_popen_options(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import client
    for _ in range(300):
        try:
            client.Client(url).health()
            return process, url
        except client.TransportError:
            time.sleep(0.1)
    process.terminate()
    raise SystemExit("the reference server did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--case")
    args = parser.parse_args()
    if args.case:  # child process: one measurement
        print(json.dumps(run_case(args.case, args.url, args.mib)))
        return
    process, url = (None, args.url) if args.url else start_reference(args.mib)
    try:
        for case in ("upload-bytes", "upload-tensor", "download"):
            child = subprocess.run([sys.executable, "-m", "bench.client_memory", "--case", case, "--url", url,
                                    "--mib", str(args.mib)], cwd=REPO, capture_output=True, text=True)
            print(child.stdout.strip() or child.stderr[-2000:])
    finally:
        if process is not None:
            process.terminate()
            process.wait()


if __name__ == "__main__":
    main()
