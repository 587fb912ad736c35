"""Scaling out, side by side: our nodes behind HAProxy against the published router.

    .venv/bin/python -m bench.bench_cohort            # about 2 minutes on 2 cores

For 2 and 3 nodes (1 CPU worker each) it builds two cohorts:
- ours: `python -m kcoral` nodes behind `haproxy` running the configuration that
  `python -m kcoral haproxy-config` generates;
- published: kcoral 0.1.1's router with its nodes joined over gRPC
  (`server --router URL --node-id nK`), run from the reference venv.
Both are driven by our client (client.py) through the cohort's single URL:
- sleep-bound throughput: 8 clients send 8 x N requests that sleep 0.5 s (ideal 4.0 s);
- repeated blobs: 8 distinct 9 MiB blobs each executed twice, one after another; the
  latency of the second execution (the blob is cached on some node) and the POSTs it all took.
Prints a Markdown table and writes bench/cohort_results.json.
"""

import json
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time

from bench.bench_servers import CountingClient, Server
from client import Program
from tests.support import (
    HAProxyProcess,
    reference_popen_options,
    reference_router_argv,
    reference_server_argv,
)

SLEEP_S = 0.5
CLIENTS = 8
BLOBS, BLOB_BYTES = 8, 9 << 20
SLEEPER = f"import time\ndef f(x):\n    time.sleep({SLEEP_S!r})\n    return x\n"
DIGEST = "import hashlib\ndef f(data):\n    return hashlib.sha256(data).hexdigest()\n"


def ours(nodes, scratch):
    """-> (url, processes to stop)."""
    servers = [Server(f"ours-n{k}", lambda port, k=k: [
        sys.executable, "-m", "kcoral", "--port", str(port), "--device", "cpu", "--num-workers", "1",
        "--log-dir", "", "--no-log-console", "--sandbox", "none", "--disk-cache-dir", os.path.join(scratch, f"ours-cache-{k}")],
        scratch) for k in range(nodes)]
    for server in servers:
        server.wait_ready()
    proxy = HAProxyProcess([s.url for s in servers], scratch)
    return proxy.url, [proxy, *servers]


def published(nodes, scratch):
    outside = reference_popen_options()  # its own virtualenv, a cwd outside the repository
    router = Server("published-router", reference_router_argv, scratch, **outside)
    servers = [Server(f"published-n{k}", lambda port, k=k: reference_server_argv(
        port, "--num-workers", "1", "--router", router.url, "--node-id", f"n{k}",
        "--disk-cache-dir", os.path.join(scratch, f"pub-cache-{k}")), scratch, **outside) for k in range(nodes)]
    for server in servers:
        server.wait_ready()
    wait_until_every_node_served(router.url, servers)
    return router.url, [router, *servers]


def wait_until_every_node_served(url, servers, timeout=180):
    """Warm-up requests through the router until each node has answered one (all joined)."""
    deadline = time.monotonic() + timeout
    while not all(b"request_finished" in pathlib.Path(s.log_path).read_bytes() for s in servers):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: not every node joined the router")
        try:
            sleep_bound(url, clients=len(servers), requests=len(servers))
        except RuntimeError:  # the router answers 503 until a node has joined
            time.sleep(1)


def sleep_bound(url, clients, requests):
    """-> wall seconds for `requests` sleeping requests from `clients` threads."""
    work, lock, errors = list(range(requests)), threading.Lock(), []

    def loop():
        with CountingClient(url) as client:
            while True:
                with lock:
                    if not work:
                        return
                    value = work.pop()
                program = Program()
                fn = program.get_function(module=program.upload(kind="module", source=SLEEPER), name="f")
                program.return_(key="out", value=program.run(fn=fn, args=[value]))
                try:
                    assert client.execute(program)["out"] == value
                except Exception as exc:  # noqa: BLE001 - reported, the run continues
                    errors.append(repr(exc))

    started = time.monotonic()
    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} failed: {errors[:3]}")
    return time.monotonic() - started


def repeated_blobs(url):
    """-> (median ms of the second executions, POSTs in all)."""
    blobs = [os.urandom(BLOB_BYTES) for _ in range(BLOBS)]
    repeat_ms, posts = [], 0
    with CountingClient(url) as client:
        for round_ in (1, 2):
            for blob in blobs:
                program = Program()
                fn = program.get_function(module=program.upload(kind="module", source=DIGEST), name="f")
                data = program.upload(kind="bytes", value=blob)
                program.return_(key="digest", value=program.run(fn=fn, args=[data]))
                started = time.perf_counter()
                result = client.execute(program)
                elapsed = time.perf_counter() - started
                assert result.completed
                posts += client.posts
                if round_ == 2:
                    repeat_ms.append(elapsed * 1e3)
    return statistics.median(repeat_ms), posts


def measure(start, nodes, scratch):
    url, processes = start(nodes, scratch)
    try:
        wall = sleep_bound(url, CLIENTS, CLIENTS * nodes)
        repeat_ms, posts = repeated_blobs(url)
    finally:
        for process in processes:
            process.stop()
    return {"sleep_wall_s": round(wall, 2), "ideal_s": CLIENTS * nodes * SLEEP_S / nodes,
            "repeat_median_ms": round(repeat_ms, 1), "posts": posts}


def main():
    results = {}
    with tempfile.TemporaryDirectory(prefix="kcoral-bench-cohort-") as scratch:
        for nodes in (2, 3):
            for name, start in (("published router", published), ("ours + HAProxy", ours)):
                workdir = os.path.join(scratch, f"{name.split()[0]}-{nodes}")
                os.mkdir(workdir)
                results[f"{name}, {nodes} nodes"] = measure(start, nodes, workdir)
                print(name, nodes, results[f"{name}, {nodes} nodes"], flush=True)
    lines = [("| cohort | sleep-bound: 8 clients x 0.5 s (ideal 4.0 s) | repeated 9 MiB blob: median latency "
              "| POSTs for 8 blobs x 2 (ideal 24) |"), "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['sleep_wall_s']:.2f} s ({r['sleep_wall_s'] / r['ideal_s']:.2f}x ideal) "
                     f"| {r['repeat_median_ms']:.0f} ms | {r['posts']} |")
    print("\n".join(lines))
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cohort_results.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
