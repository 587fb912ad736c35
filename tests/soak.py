"""Reliability soak: every item of tests/test_reliability.py, at full size with --long.

    python -m tests.soak --long          # ≥ 5 000 fuzz cases, ≥ 100 faults, 10 000 requests at 16, ...
    python -m tests.soak --long --only hostile   # the hostile-client attacks at full size
    python -m tests.soak                 # the CI sizes (what `pytest tests/test_reliability.py` runs)
    python -m tests.soak --long --only fuzz,load --seed 7

Prints a table of counts per item and exits 1 if any item failed (its first assertion is
printed under the table).  Each item is the CI test itself, run at the soak's size: the same
measurement and the same checks, so the soak and the CI part can never drift apart.  Figures of a real long run: docs/reliability.md.
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



def hostile_attacks(workdir, record_property, scale):
    """Every test of tests/test_hostile.py, at its own size for this one (hostile.hostile_item)."""
    record_property("figures", hostile.hostile_item(scale, workdir))


# each called as pytest calls it, plus the size: check(workdir, record_property, scale)
ITEMS = [("fuzz", rel.test_fuzz_malformed_requests_get_4xx_error_bodies),
         ("properties", rel.test_multipart_and_program_properties), ("faults", rel.test_fault_injection),
         ("cache faults", rel.test_cache_faults), ("load", rel.test_load_mixed_requests),
         ("shutdown", rel.test_graceful_shutdown), ("disconnects", rel.test_client_disconnects),
         ("hostile", hostile_attacks), ("growth", rel.test_nothing_grows_per_request)]


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
    for name, check in ITEMS:
        if only and name not in only:
            continue
        t0 = time.monotonic()
        counts = {}
        with tempfile.TemporaryDirectory(prefix="kcoral-soak-") as workdir:
            try:
                kwargs = {"seed": args.seed} if name == "fuzz" else {}
                check(workdir, lambda _, figures: counts.update(figures), scale, **kwargs)
                verdict = "PASS"
            except BaseException as exc:  # report and go on with the other items
                if isinstance(exc, KeyboardInterrupt):
                    raise
                verdict = "FAIL"
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
