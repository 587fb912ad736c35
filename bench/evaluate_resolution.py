"""evaluate's resolution on this machine: the reference itself, and candidates doing 1.3x and 2x its
work, for a ~1 ms kernel with 16 MiB in and 16 MiB out and a ~50 us one with 352 KiB each way;
with benchmark's ratio (best of interleaved runs, same process) beside each.

    .venv/bin/python -m bench.evaluate_resolution            # about 1 minute on 2 cores
    .venv/bin/python -m bench.evaluate_resolution --budget-ms 4000

Prints a Markdown table.  The kernels are NumPy, so extra work is extra rows: a candidate of
work w computes the reference's output and the same operation again on (w - 1) of the rows."""

import argparse
import os
import sys

import numpy

sys.path.insert(0, os.getcwd())  # the checkout it is run from (so an older one can be measured too)
import kcoral_worker  # noqa: E402

KERNELS = {  # name -> (shape, the operation)
    "1 ms, 16 MiB in/out": ((1024, 4096), "numpy.multiply(x, 1.5)"),
    "50 us, 352 KiB in/out": ((90112,), "numpy.sin(x)"),
}
WORK = (1.0, 1.3, 2.0)


def source(shape: tuple[int, ...], op: str, work: float) -> str:
    extra = round((work - 1) * shape[0])
    body = f"    out = {op}\n" + (f"    {op.replace('(x', f'(x[:{extra}]')}\n" if extra else "")
    return f"import numpy\n\ndef kernel(x):\n{body}    return out\n"


def inputs_for(shape: tuple[int, ...]):
    pool = numpy.random.default_rng(0).random(shape, dtype=numpy.float32)

    def make_inputs(seed: int):  # fresh values per seed, cheaply: the pool rolled by a seeded amount
        return numpy.roll(pool, seed % pool.size)
    return make_inputs


def benchmark_ratio(reference: str, candidate: str, x) -> float:
    kernels = []
    for text in (reference, candidate):
        namespace: dict = {}
        exec(text, namespace)
        kernels.append(namespace["kernel"])
    best = [[], []]
    for _ in range(5):
        for i, kernel in enumerate(kernels):
            best[i].append(kcoral_worker.benchmark(kernel, x, {"warmup_ms": 10, "repeat_ms": 60})["latency_ms_median"])
    return min(best[0]) / min(best[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-ms", type=float, default=2000)
    args = parser.parse_args()
    print("| kernel | candidate work | speedup (95% interval) | flags | kernel ms (ref) | overhead ms/call "
          "| calls/round x rounds | benchmark ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (shape, op) in KERNELS.items():
        reference, make_inputs = source(shape, op, 1.0), inputs_for(shape)
        for work in WORK:
            candidate = source(shape, op, work)
            verdict = kcoral_worker.evaluate(candidate, reference, make_inputs, budget_ms=args.budget_ms)
            timing = verdict["timing"]
            if timing is None or timing["speedup"] is None:
                print(f"| {name} | {work}x | {verdict['message']} | {', '.join(verdict['flags'])} | | | | |")
                continue
            low, high = timing["speedup_ci"]
            overhead = timing.get("overhead_ms_per_call", numpy.median(timing["samples_ms"]["echo"]))
            print(f"| {name} | {work}x | {timing['speedup']:.3f} ({low:.3f}-{high if high is None else f'{high:.3f}'}) "
                  f"| {', '.join(verdict['flags']) or '-'} | {timing['reference_ms']:.4f} | {overhead:.4f} "
                  f"| {timing.get('calls_per_round', 1)} x {timing['rounds']} "
                  f"| {benchmark_ratio(reference, candidate, make_inputs(1)):.3f} |", flush=True)


if __name__ == "__main__":
    main()
