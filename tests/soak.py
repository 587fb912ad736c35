"""Reliability soak: every item of tests/test_reliability.py, at full size with --long.

    python -m tests.soak --long          # ≥ 5 000 fuzz cases, ≥ 100 faults, 10 000 requests at 16, ...
    python -m tests.soak --long --only hostile   # the hostile-client attacks at full size
    python -m tests.soak                 # the CI sizes (what `pytest tests/test_reliability.py` runs)
    python -m tests.soak --long --only fuzz,load --seed 7

Prints a table of counts per item and exits 1 if any item failed (its first assertion is
printed under the table).  The items are the functions the CI tests call, so the soak and
the CI part can never drift apart.  Figures of a real long run: docs/reliability.md.
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback

from tests import test_hostile as hostile
from tests import test_reliability as rel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ITEMS = [("fuzz", rel.fuzz_item), ("properties", rel.property_item), ("faults", rel.fault_item),
         ("cache faults", rel.cache_item), ("load", rel.load_item), ("shutdown", rel.shutdown_item),
         ("disconnects", rel.disconnect_item), ("hostile", hostile.hostile_item), ("growth", rel.growth_item)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="full size (default: the CI size)")
    parser.add_argument("--only", default="", help="comma-separated item names: " + ", ".join(n for n, _ in ITEMS))
    parser.add_argument("--seed", type=int, default=None, help="fuzz seed (default: random, printed)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    scale = rel.LONG if args.long else rel.CI
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = only - {name for name, _ in ITEMS}
    if unknown:
        parser.error(f"unknown item(s): {sorted(unknown)}")
    print(f"kcoral reliability soak, {scale.name} size: {json.dumps(dataclasses.asdict(scale))}", flush=True)
    rows, failures = [], []
    started = time.monotonic()
    for name, item in ITEMS:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="kcoral-soak-") as workdir:
            try:
                kwargs = {"seed": args.seed} if name == "fuzz" else {}
                counts = item(scale, workdir, **kwargs)
                verdict = "PASS"
            except BaseException as exc:  # report and go on with the other items
                if isinstance(exc, KeyboardInterrupt):
                    raise
                counts, verdict = {}, "FAIL"
                failures.append((name, "".join(traceback.format_exception(exc))[-4000:]))
        seconds = time.monotonic() - t0
        rows.append({"item": name, "result": verdict, "seconds": round(seconds, 1), "counts": counts})
        print(f"  {name:<13} {verdict}  {seconds:7.1f} s  {format_counts(counts)}", flush=True)
    total = time.monotonic() - started
    print()
    print(table(rows, scale, total))
    for name, text in failures:
        print(f"\n--- {name} failed ---\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scale": dataclasses.asdict(scale), "rows": rows, "seconds": round(total, 1),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "host": f"{platform.node()} ({os.cpu_count()} CPUs), Python {platform.python_version()}"},
                      f, indent=1, default=str)
    return 1 if failures else 0


def format_counts(counts):
    return ", ".join(f"{k}: {v}" for k, v in counts.items())


def table(rows, scale, total):
    """A Markdown table, ready for the README."""
    lines = [f"| Item ({scale.name} size) | Result | Time | Counts |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['item']} | {row['result']} | {row['seconds']:.0f} s | "
                     f"{format_counts(row['counts']).replace('|', '/')} |")
    lines.append(f"| **total** | {'PASS' if all(r['result'] == 'PASS' for r in rows) else 'FAIL'} "
                 f"| {total:.0f} s | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
