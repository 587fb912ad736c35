"""Per-tenant limits held by the proxy for the whole cohort (docs/scaling.md "Per-tenant limits"),
and reloading the proxy under load from several tenants without a 429.

Real nodes (started without per-tenant limits, as docs/scaling.md says) behind a real HAProxy in
master-worker mode, configured by `haproxy-config --max-running-per-tenant/--max-waiting-per-tenant`.
Each execution appends its start and end to a ledger, so the test sees how many of a tenant's
requests ran at once across the nodes.
"""

import re
import subprocess
import threading
import time

import pytest

from tests.support import (
    HAPROXY,
    PYTHON,
    ROOT,
    HAProxyProcess,
    ServerProcess,
    SteadyLoad,
    join_threads,
    requests_the_node_logged,
    simple_program,
    wait_for,
)
from tests.test_tenants import ALICE, ANON, BOB, NAP, auth, open_post, read_answer, token_file

TIMED = """\
import time
def f(tenant, seconds, ledger):
    with open(ledger, "a") as out:
        out.write(f"{tenant} start {time.time()}\\n")
    time.sleep(seconds)
    with open(ledger, "a") as out:
        out.write(f"{tenant} end {time.time()}\\n")
    return tenant
"""


def most_at_once(ledger, tenant):
    """The most of `tenant`'s executions the ledger shows running at one time, across the nodes."""
    with open(ledger) as f:
        events = sorted((float(at), kind == "start") for name, kind, at in (line.split() for line in f)
                        if name == tenant)
    running = most = 0
    for _, started in events:  # an end and a start at the same instant: the end first (False sorts first)
        running += 1 if started else -1
        most = max(most, running)
    return most


class Answers:
    """Requests of one tenant, each on its own connection, each answer read on a thread of its own."""

    def __init__(self, url, token, programs, arrived=None):
        """`arrived(n)`, if given, is waited for once the n-th request is sent: two requests reaching a
        gate in the same millisecond can both pass it (docs/scaling.md)."""
        self.results = {}
        self.threads = []
        for number, program in enumerate(programs):
            sock = open_post(url, program, auth(token))
            if arrived is not None:
                assert wait_for(lambda: arrived(number + 1), 10), f"request {number + 1} did not arrive"
            self.threads.append(threading.Thread(target=self.read, args=(number, sock)))
        for thread in self.threads:
            thread.start()

    def read(self, number, sock):
        with sock:
            self.results[number] = read_answer(sock)

    def statuses(self):
        join_threads(self.threads, 60)
        return [self.results[number][0] for number in sorted(self.results)]


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_a_tenant_limit_holds_across_the_cohort_and_leaves_no_slot_idle(tmp_path):
    """Two two-slot nodes, --max-running-per-tenant 2 --max-waiting-per-tenant 2 at the proxy.  Alice
    sends 4 requests of 2 s: 2 run (on whichever nodes), 2 wait at her gate, a 5th is answered 429
    by the proxy with Retry-After.  Bob's 2 requests, sent meanwhile, take the 2 slots Alice may not
    use at once: no slot idles while a tenant under its limit waits.  Alice's wait at her gate
    counts in her queue_ms (the proxy stamps the request before the gate)."""
    ledger = str(tmp_path / "ledger")
    tokens = token_file(tmp_path)
    secret = token_file(tmp_path, "proxy-secret-1\n", "proxy-secret")
    nodes = [ServerProcess("--token-file", tokens, "--proxy-secret-file", secret, workers=2,
                           tmp_path=tmp_path / f"node{i}") for i in range(2)]
    proxy = HAProxyProcess([f"{n.url}=2" for n in nodes], tmp_path, flags=[
        "--token-file", tokens, "--proxy-secret-file", secret, "--max-running-per-tenant", "2",
        "--max-waiting-per-tenant", "2"])
    try:
        def timed(tenant, seconds):
            return simple_program(TIMED, args=[tenant, seconds, ledger])
        def at_alices_gate(count):
            row = proxy.row("kcoral_tenant_limits", "alice")
            return int(row["scur"] or 0) + int(row["qcur"] or 0) >= count

        alice = Answers(proxy.url, ALICE, [timed("alice", 2.0) for _ in range(4)], arrived=at_alices_gate)
        assert wait_for(lambda: proxy.row("kcoral_tenant_limits", "alice")["qcur"] == "2", 10), proxy.row("kcoral_tenant_limits", "alice")
        refused = Answers(proxy.url, ALICE, [timed("alice", 0)])
        started = time.monotonic()
        bob = Answers(proxy.url, BOB, [timed("bob", 0.5) for _ in range(2)])
        assert bob.statuses() == [200, 200]
        bob_seconds = time.monotonic() - started
        assert refused.statuses() == [429]
        _, headers, body = refused.results[0]
        assert (body["error"]["kind"], headers.get("retry-after")) == ("busy", "1"), body
        assert "alice" in body["error"]["message"] and "--max-waiting-per-tenant" in body["error"]["message"]
        assert alice.statuses() == [200] * 4
        waits = sorted(round(result[2]["queue_ms"] / 1e3, 1) for result in alice.results.values())
        print(f"alice's queue_ms: {waits} s")
        assert waits[1] < 0.5 and waits[2] > 1.5, waits  # two ran at once, two waited ~2 s at her gate
        print(f"bob's 2 requests of 0.5 s answered in {bob_seconds:.2f} s while alice's waited at her gate; "
              f"bob's queue_ms {[r[2]['queue_ms'] for r in bob.results.values()]}")
        assert bob_seconds < 1.5, bob_seconds  # not behind alice's 2 s requests
        assert all(r[2]["queue_ms"] < 500 for r in bob.results.values()), bob.results
        assert most_at_once(ledger, "alice") == 2 and most_at_once(ledger, "bob") == 2
        assert "kcoral_tenant_limits/alice" in proxy.log() and "kcoral_spread/127.0.0.1" in proxy.log()
    finally:
        proxy.stop()
        for node in nodes:
            node.stop()


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_reloading_the_proxy_under_load_from_several_tenants_refuses_nothing(tmp_path):
    """Two two-slot nodes and the tenants' limits at the proxy (2 running, 2 waiting each); three
    tenants, three clients each, send 0.3 s requests back to back while HAProxy is reloaded three
    times.  After each reload the new process counts from zero while the old one still has its
    requests at the nodes, so nodes are sent more than their slots and tenants more than their
    limit: the nodes' queues absorb it.  Every request is answered 200 and runs once."""
    ledger = str(tmp_path / "ledger")
    tokens = token_file(tmp_path)
    nodes = [ServerProcess("--token-file", tokens, workers=2, tmp_path=tmp_path / f"node{i}") for i in range(2)]
    proxy = HAProxyProcess([f"{n.url}=2" for n in nodes], tmp_path, flags=[
        "--token-file", tokens, "--max-running-per-tenant", "2", "--max-waiting-per-tenant", "2"])
    loads = []
    try:
        loads = [SteadyLoad(proxy.url, ledger, headers=auth(token), clients=3) for token in (ALICE, BOB, ANON)]
        time.sleep(2)
        for _ in range(3):
            proxy.reload()
            time.sleep(1.5)
        runs = [load.stop() for load in loads]
        outcomes = {value: outcome for load in loads for value, outcome in load.outcomes.items()}
        failed = {value: outcome for value, outcome in outcomes.items() if outcome != "ok"}
        node_waits = [float(wait) for node in nodes for wait in re.findall(r" request_finished .*queue_ms=([\d.]+)",
                                                                             node.log())]
        print(f"{len(outcomes)} requests across 3 reloads, {len(failed)} failed; the nodes queued "
              f"{sum(wait > 200 for wait in node_waits)} over 0.2 s (longest {max(node_waits, default=0):.0f} ms)")
        assert not failed, failed
        assert len(outcomes) > 30 and all(count == 1 for run in runs for count in run.values()), runs
    finally:
        for load in loads:
            load.stop()
        proxy.stop()
        for node in nodes:
            node.stop()


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_a_request_left_at_its_gate_or_past_it_never_reaches_a_node(tmp_path):
    """One one-slot node, --max-running-per-tenant 1 at the proxy: alice's 3 s request holds the
    slot; her second waits at her gate, bob's passes his and waits in the cohort's queue.  Both
    clients leave: the node logs alice's first request alone."""
    tokens = token_file(tmp_path)
    with ServerProcess("--token-file", tokens, "--log-dir", str(tmp_path / "logs"), workers=1,
                       tmp_path=tmp_path) as node:
        proxy = HAProxyProcess([f"{node.url}=1"], tmp_path, flags=["--token-file", tokens,
                                                                   "--max-running-per-tenant", "1"])
        try:
            busy = open_post(proxy.url, simple_program(NAP, args=[3.0]), auth(ALICE))
            # past her gate before the second comes: two arriving in the same millisecond can both pass
            # it (HAProxy's threads; docs/scaling.md), and this test is about leaving, not that race
            assert wait_for(lambda: proxy.row("kcoral_tenant_limits", "alice")["scur"] == "1", 5), proxy.row("kcoral_tenant_limits", "alice")
            at_gate = open_post(proxy.url, simple_program(NAP, args=[0.1]), auth(ALICE))
            assert wait_for(lambda: proxy.row("kcoral_tenant_limits", "alice")["qcur"] == "1", 5), proxy.row("kcoral_tenant_limits", "alice")
            past_gate = open_post(proxy.url, simple_program(NAP, args=[0.1]), auth(BOB))
            assert wait_for(lambda: proxy.row("kcoral_spread")["qcur"] == "1", 5)
            at_gate.close()
            past_gate.close()
            assert read_answer(busy)[0] == 200
            busy.close()
            assert requests_the_node_logged(tmp_path / "logs") == [("request_finished", "alice")]
        finally:
            proxy.stop()


def test_generated_tenant_limits(tmp_path):
    """The gates only with --max-running-per-tenant: one per named tenant and one for bare tokens, the
    socket owned by --user; --max-waiting-per-tenant alone is refused."""
    def generate(*flags):
        return subprocess.run([PYTHON, "-m", "kcoral", "haproxy-config", "--listen", "127.0.0.1:8080",
                               "--token-file", token_file(tmp_path), "--stats-socket", "/run/h/admin.sock",
                               *flags, "http://10.0.0.5:8000=2"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, check=False)
    assert "kcoral_tenant_limits" not in generate().stdout
    limited = generate("--max-running-per-tenant", "3", "--max-waiting-per-tenant", "5", "--user", "kc").stdout
    for line in ("server alice unix@/run/h/admin.sock.tenants maxconn 3", "use-server bob if { var(txn.tenant) -m str -- bob }",
                 "server - unix@/run/h/admin.sock.tenants maxconn 3", "bind unix@/run/h/admin.sock.tenants mode 600 user kc",
                 "srv_queue ge 5 }", "default_backend kcoral_tenant_limits"):
        assert line in limited, line
    refused = generate("--max-waiting-per-tenant", "2")
    assert refused.returncode == 2 and "give both" in refused.stderr
