"""Where a self-race's bias comes from: the 1 ms kernel (bench/evaluate_resolution.py's) raced against
itself, each turn's CPU (the one its process last ran on, read while it is stopped) and its
process's huge pages recorded; then the median ratio per quarter of the rounds (a lasting
difference between the two processes holds in every quarter) and per placement (both turns on one
CPU, or on two, where a busy core decides).

    .venv/bin/python -m bench.evaluate_self_race --repeat 4     # about 15 s a race on 2 cores

docs/evaluate.md ("After: one input region for both kernels") has the figures."""

import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.getcwd())  # the checkout it is run from (so an older one can be measured too)
import kcoral_worker  # noqa: E402
from bench.evaluate_resolution import KERNELS, inputs_for, source  # noqa: E402


def last_cpu(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def huge_pages_mib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("AnonHugePages"))


GO = kcoral_worker.KernelProcess.go


def recording(turns: list[dict]):
    """KernelProcess.go, recording each turn: its role (echo: the empty round trip), ms, CPU, huge pages."""
    def recorded(self, call: bool):
        done, ms = GO(self, call)
        turns.append({"role": self.role if call else "echo", "ms": ms, "cpu": last_cpu(self.proc.pid),
                      "huge_mib": huge_pages_mib(self.proc.pid)})
        return done, ms
    return recorded


def rounds_of(turns: list[dict]) -> list[dict]:
    """The raced rounds (both turns, then the echo), warm-up rounds included; the checks' lone calls not."""
    rounds, current = [], {}
    for turn in turns:
        if turn["role"] != "echo":
            current[turn["role"]] = turn
            continue
        if len(current) == 2:
            rounds.append({**current, "echo": turn})
        current = {}
    return rounds


def summary(rounds: list[dict]) -> str:
    echo = statistics.median(r["echo"]["ms"] for r in rounds)
    ratios = [math.log((r["reference"]["ms"] - echo) / (r["candidate"]["ms"] - echo)) for r in rounds]
    quarter = len(rounds) // 4
    quarters = [math.exp(statistics.median(ratios[i * quarter:(i + 1) * quarter])) for i in range(4)] if quarter else []
    same = [x for x, r in zip(ratios, rounds) if r["reference"]["cpu"] == r["candidate"]["cpu"]]
    split = [x for x, r in zip(ratios, rounds) if r["reference"]["cpu"] != r["candidate"]["cpu"]]
    placed = ", ".join(f"{name} CPU: {len(xs)} rounds, {math.exp(statistics.median(xs)):.3f}"
                       for name, xs in (("one", same), ("two", split)) if xs)
    huge = {role: rounds[-1][role]["huge_mib"] for role in ("reference", "candidate")}
    return (f"quarters {' '.join(f'{q:.3f}' for q in quarters)}; {placed}; huge pages MiB {huge}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-ms", type=float, default=10000)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    shape, op, _ = KERNELS["1 ms, 16 MiB in/out"]
    for _ in range(args.repeat):
        turns: list[dict] = []
        kcoral_worker.KernelProcess.go = recording(turns)
        verdict = kcoral_worker.evaluate(source(shape, op, 1.0), source(shape, op, 1.0), inputs_for(shape),
                                         budget_ms=args.budget_ms)
        timing = verdict["timing"]
        low, high = timing["speedup_ci"]
        print(f"load {os.getloadavg()[0]:.1f}: {timing['speedup']:.3f} ({low:.3f}-{high if high is None else f'{high:.3f}'}) "
              f"{', '.join(verdict['flags']) or '-'}; {summary(rounds_of(turns))}", flush=True)


if __name__ == "__main__":
    main()
