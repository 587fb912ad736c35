"""evaluate's resolution on this machine: the reference itself, and candidates doing 1.3x and 2x its
work, for a ~1 ms kernel with 16 MiB in and 16 MiB out and a ~50 us one with 352 KiB each way
(on a 2-core VM they take 2.7 ms and 90 us: a kernel of 6 MiB each way, which takes ~1.1 ms there,
against itself shows the overhead per call a 1 ms kernel sees);
with benchmark's ratio (best of interleaved runs, same process) beside each, flushed before every
call (its default: every call's inputs cold) and warm (flush_l2 False: like evaluate's calls, which
run back to back with the cache flushed once a round); and an empty kernel
(it returns its input) against itself, whose time per call is what the harness's call loop adds
to a kernel's and does not subtract.

    .venv/bin/python -m bench.evaluate_resolution                          # 2-3 minutes on 2 cores
    .venv/bin/python -m bench.evaluate_resolution --budget-ms 10000 --repeat 2  # the docs' table: 10 minutes

Prints a Markdown table, a row per evaluate call, then with --repeat a summary per row: the spread
of the speedups over the repeats, and how many met the goal (the reference against itself:
within_noise with a 95% interval inside 0.9-1.1; 1.3x and 2x the work: an interval below 1).
The kernels are NumPy, so extra work is extra rows: a candidate of work w computes the
reference's output and the same operation again on (w - 1) of the rows.  Run from another
checkout (`cd ../old && python /path/to/bench/evaluate_resolution.py`) to measure its evaluate."""

import argparse
import os
import statistics
import sys

import numpy

sys.path.insert(0, os.getcwd())  # the checkout it is run from (so an older one can be measured too)
import kcoral_worker  # noqa: E402

KERNELS = {  # name -> (shape, the operation, the candidates' work)
    "1 ms, 16 MiB in/out": ((1024, 4096), "numpy.multiply(x, 1.5)", (1.0, 1.3, 2.0)),
    "50 us, 352 KiB in/out": ((90112,), "numpy.sin(x)", (1.0, 1.3, 2.0)),
    "~1 ms here, 6 MiB in/out": ((384, 4096), "numpy.multiply(x, 1.5)", (1.0,)),  # the overhead a call of 1 ms sees
    "empty, 352 KiB in/out": ((90112,), "x", (1.0,)),
}


def source(shape: tuple[int, ...], op: str, work: float) -> str:
    extra = round((work - 1) * shape[0])
    body = f"    out = {op}\n" + (f"    {op.replace('(x', f'(x[:{extra}]')}\n" if extra else "")
    return f"import numpy\n\ndef kernel(x):\n{body}    return out\n"


def inputs_for(shape: tuple[int, ...]):
    pool = numpy.random.default_rng(0).random(shape, dtype=numpy.float32)

    def make_inputs(seed: int):  # fresh values per seed, cheaply: the pool rolled by a seeded amount
        return numpy.roll(pool, seed % pool.size)
    return make_inputs


def benchmark_ratio(reference: str, candidate: str, x, flush_l2: bool) -> float:
    kernels = []
    for text in (reference, candidate):
        namespace: dict = {}
        exec(text, namespace)
        kernels.append(namespace["kernel"])
    best: list[list[float]] = [[], []]
    for _ in range(5):
        for i, kernel in enumerate(kernels):
            best[i].append(kcoral_worker.benchmark(kernel, x, {"warmup_ms": 10, "repeat_ms": 60,
                                                                        "flush_l2": flush_l2})["latency_ms_median"])
    return min(best[0]) / min(best[1])


def met(work: float, speedup: float, low: float, high: float | None) -> bool:
    """The goal for this row: the reference against itself within_noise, its interval inside
    +-10%; more work, an interval below 1."""
    if work == 1.0:
        return high is not None and 0.9 <= low <= 1 <= high <= 1.1
    return high is not None and high < 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-ms", type=float, default=2000)
    parser.add_argument("--round-ms", type=float, default=None, help="evaluate's round_ms (its default unset)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", default="", help="kernels whose name starts with this")
    args = parser.parse_args()
    options = {"budget_ms": args.budget_ms} | ({"round_ms": args.round_ms} if args.round_ms is not None else {})
    print(f"budget_ms={args.budget_ms:g} round_ms={args.round_ms or 'default'}; load average {os.getloadavg()}")
    print("| kernel | candidate work | speedup (95% interval) | flags | kernel ms (ref) | overhead ms/call "
          "| calls/round x rounds | benchmark ratio, flushed | benchmark ratio, warm | goal met |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    outcomes: dict[tuple[str, float], list[tuple[float, bool]]] = {}
    for _ in range(args.repeat):
        for name, (shape, op, works) in KERNELS.items():
            if not name.startswith(args.only):
                continue
            reference, make_inputs = source(shape, op, 1.0), inputs_for(shape)
            for work in works:
                candidate = source(shape, op, work)
                verdict = kcoral_worker.evaluate(candidate, reference, make_inputs, **options)
                timing = verdict["timing"]
                if timing is None or timing["speedup"] is None:  # an empty kernel: its time is what the loop adds
                    numbers = ("| | | |" if timing is None else f"| {timing['reference_ms']:.4f} "
                               f"| {timing['overhead_ms_per_call']:.4f} | {timing['calls_per_round']} x {timing['rounds']} |")
                    print(f"| {name} | {work}x | {verdict['message']} | {', '.join(verdict['flags'])} {numbers} - | - | no |")
                    outcomes.setdefault((name, work), []).append((float("nan"), False))
                    continue
                low, high = timing["speedup_ci"]
                ok = met(work, timing["speedup"], low, high)
                outcomes.setdefault((name, work), []).append((timing["speedup"], ok))
                overhead = timing.get("overhead_ms_per_call", numpy.median(timing["samples_ms"]["echo"]))
                flushed, warm = (benchmark_ratio(reference, candidate, make_inputs(1), flush) for flush in (True, False))
                print(f"| {name} | {work}x | {timing['speedup']:.3f} ({low:.3f}-{high if high is None else f'{high:.3f}'}) "
                      f"| {', '.join(verdict['flags']) or '-'} | {timing['reference_ms']:.4f} | {overhead:.4f} "
                      f"| {timing.get('calls_per_round', 1)} x {timing['rounds']} | {flushed:.3f} | {warm:.3f} "
                      f"| {'yes' if ok else 'no'} |", flush=True)
    if args.repeat > 1:
        print("\n| kernel | candidate work | speedups over the repeats (min / median / max) | goal met |")
        print("|---|---|---|---|")
        for (name, work), results in outcomes.items():
            speedups = [s for s, _ in results]
            print(f"| {name} | {work}x | {min(speedups):.3f} / {statistics.median(speedups):.3f} / "
                  f"{max(speedups):.3f} | {sum(ok for _, ok in results)} of {len(results)} |")


if __name__ == "__main__":
    main()
