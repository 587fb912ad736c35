"""Per-tenant limits in a cohort: on the nodes (each node's own, as before) or at the proxy.

    .venv/bin/python -m bench.bench_tenant_limits [ROUNDS]     # about 1 minute a round on 2 cores

Two two-slot nodes behind the generated HAProxy, tenants alice, bob and an anonymous one. Each
round runs both variants, interleaved:
- per-node: the nodes run with --max-running-per-tenant 1 --max-waiting-per-tenant 1 (alice's 2
  across the two nodes), the proxy without per-tenant limits;
- proxy: the nodes run without, the proxy with --max-running-per-tenant 2 --max-waiting-per-tenant 2.
Two scenarios each:
- idle slots: alice sends 4 requests of 2 s, then bob 2 of 0.5 s: how long bob's took, and how many
  slots idled (on average) while bob's requests waited;
- reload: the three tenants, three clients each, send 0.3 s requests back to back, 4.5 s as they
  are, then 4.5 s while HAProxy is reloaded three times: how many requests were not answered 200
  in each phase.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.support import HAProxyProcess, ServerProcess, SteadyLoad, simple_program
from tests.test_cohort_tenant_limits import TIMED, Answers
from tests.test_tenants import ALICE, ANON, BOB, auth, token_file

SLOTS = 4
VARIANTS = {"per-node": (["--max-running-per-tenant", "1", "--max-waiting-per-tenant", "1"], []),
            "proxy": ([], ["--max-running-per-tenant", "2", "--max-waiting-per-tenant", "2"])}


def running_between(ledger, start, end):
    """Average executions running over [start, end] (wall-clock seconds), from the ledger."""
    spans, opened = [], {}
    with open(ledger) as f:
        for name, kind, at in (line.split() for line in f):
            if kind == "start":
                opened.setdefault(name, []).append(float(at))
            else:
                spans.append((opened[name].pop(0), float(at)))
    covered = sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans)
    return covered / (end - start) if end > start else float(SLOTS)


def idle_slots(workdir, url):
    """Alice's 4 x 2 s, then bob's 2 x 0.5 s -> (seconds bob's took, slots idle while they waited)."""
    ledger = str(workdir / "ledger")
    alice = Answers(url, ALICE, [simple_program(TIMED, args=["alice", 2.0, ledger]) for _ in range(4)])
    time.sleep(0.5)
    sent, sent_wall = time.monotonic(), time.time()
    bob = Answers(url, BOB, [simple_program(TIMED, args=["bob", 0.5, ledger]) for _ in range(2)])
    bob.statuses()
    took = time.monotonic() - sent
    alice.statuses()
    with open(ledger) as f:
        bob_started = min(float(at) for name, kind, at in (line.split() for line in f) if name == "bob" and kind == "start")
    return took, SLOTS - running_between(ledger, sent_wall, bob_started) if bob_started > sent_wall + 0.05 else 0.0


def refused_across_reloads(workdir, url, proxy):
    """Three tenants' steady load for 4.5 s, then as long across three reloads -> for each phase
    (requests answered in it, those not answered 200)."""
    loads = [SteadyLoad(url, str(workdir / "echo-ledger"), headers=auth(token), clients=3) for token in (ALICE, BOB, ANON)]
    time.sleep(4.5)
    steady = {value for load in loads for value in load.outcomes}
    for _ in range(3):
        proxy.reload()
        time.sleep(1.5)
    for load in loads:
        load.stop()
    outcomes = {value: outcome for load in loads for value, outcome in load.outcomes.items()}
    phases = ({v: o for v, o in outcomes.items() if v in steady}, {v: o for v, o in outcomes.items() if v not in steady})
    return [(len(phase), [o for o in phase.values() if o != "ok"]) for phase in phases]


def one_variant(workdir, node_flags, proxy_flags):
    tokens = token_file(workdir)
    nodes = [ServerProcess("--token-file", tokens, *node_flags, workers=2, tmp_path=workdir / f"node{i}")
             for i in range(2)]
    proxy = HAProxyProcess([f"{n.url}=2" for n in nodes], workdir, flags=["--token-file", tokens, *proxy_flags])
    try:
        return idle_slots(workdir, proxy.url), refused_across_reloads(workdir, proxy.url, proxy)
    finally:
        proxy.stop()
        for node in nodes:
            node.stop()


def main(rounds):
    results = {name: [] for name in VARIANTS}
    for number in range(rounds):
        for name, (node_flags, proxy_flags) in VARIANTS.items():
            with tempfile.TemporaryDirectory() as workdir:
                (took, idle), phases = one_variant(Path(workdir), node_flags, proxy_flags)
            (steady, steady_refused), (reloaded, reload_refused) = phases
            print(f"round {number + 1}, {name}: bob's 2 x 0.5 s took {took:.2f} s, {idle:.1f} slots idle while they "
                  f"waited; not 200: {len(steady_refused)} of {steady} without reloads, {len(reload_refused)} of "
                  f"{reloaded} across 3 reloads {sorted(set(reload_refused))[:1]}", flush=True)
            results[name].append((took, idle, len(steady_refused), steady, len(reload_refused), reloaded))
    print("\n| limits | bob's 2 x 0.5 s (median) | slots idle while bob waited | not 200, 4.5 s without reloads "
          "| not 200, 4.5 s with 3 reloads |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        print(f"| {name} | {statistics.median(r[0] for r in rows):.2f} s | {statistics.median(r[1] for r in rows):.1f} "
              f"of {SLOTS} | {sum(r[2] for r in rows)} of {sum(r[3] for r in rows)} "
              f"| {sum(r[4] for r in rows)} of {sum(r[5] for r in rows)} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
