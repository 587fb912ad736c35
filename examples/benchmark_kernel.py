"""Benchmark a kernel on the server with `kcoral.builtins.benchmark`.

`benchmark(fn, *args, config)` calls fn(*args) repeatedly on the worker and reports the
per-call latency (median, mean, min, max, in ms) and how many calls it made.  The kernel
here is torch's element-wise add into a preallocated output, on the worker's device (CUDA
on a GPU server, the CPU otherwise).  Three runs show what the configuration changes:

* defaults: 25 ms warm-up and 100 ms measurement *budgets*, turned into call counts.  Each
  call is preceded by an untimed cache flush, and the budgets pay for it too: on a CPU
  server the flush (a 64 MiB memset, a millisecond or more) dominates a microsecond kernel,
  so the default measures only a hundred calls or fewer;
* explicit counts (`warmup`, `repeat`) override the budgets: 500 calls however long;
* `flush_l2: False` measures warm-cache latency, and the same budget buys far more calls.

Prints one line per run: its configuration, the median latency, the call count and the
timer used ("host" on CPU; CUPTI activity spans on GPU).
"""

import os

from kcoral import Client, Program

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")

HARNESS = """
import torch
from kcoral.builtins import benchmark

def add_into(x, y, out):
    torch.add(x, y, out=out)

def bench(n, config):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, y = torch.rand(n, device=device), torch.rand(n, device=device)
    # A trailing non-empty dict is the configuration; an empty one would be passed to the kernel.
    return benchmark(add_into, x, y, torch.empty_like(x), *([config] if config else []))
"""

CONFIGS = {
    "defaults": {},
    "explicit counts": {"warmup": 50, "repeat": 500},
    "no cache flush": {"flush_l2": False},
}


def main() -> None:
    program = Program()
    bench = program.get_function(module=program.upload(kind="module", source=HARNESS), name="bench")
    for key, config in CONFIGS.items():  # one program, one worker: the three runs see the same machine
        program.return_(key=key, value=program.run(fn=bench, args=[4096, config]))
    with Client(URL) as client:
        result = client.execute(program)
    if not result.completed:
        raise SystemExit(f"{result.error['kind']}: {result.error['message']}")
    for key, config in CONFIGS.items():
        report = result[key]
        print(f"{key} {config}: median {report['latency_ms_median'] * 1e3:.1f} us over "
              f"{report['repeat']} calls (warmup {report['warmup']}, timer {report.get('timer', 'cupti')}, "
              f"flush_l2 {report['flush_l2']})")


if __name__ == "__main__":
    main()
