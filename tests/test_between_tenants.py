"""Between tenants (docs/operations.md, "Between tenants", issue 39 items 5 and 6): each test
performs the attack a tenant could make and measures what it gained.

* /metrics shows every tenant's requests: a tenant's token is refused it (403), the operator's
  (--metrics-token-file) reads it; a node of anonymous tokens alone serves it as before.
* X-Request-Start is believed only beside the proxy's secret (--proxy-secret-file), so a client
  sending straight to a node cannot add hours of queue time (the queue-backlog alert's input).
* A program that kills its own worker is counted apart from the server's crashes (the
  worker-crash alert's input)."""

import signal
import time

import pytest

from tests.support import (
    HAPROXY,
    HAProxyProcess,
    ServerProcess,
    call_program,
    post,
    request,
    scrape_when,
    simple_program,
)
from tests.test_metrics import samples, value

ALICE, BOB, OPERATOR = "alice-token-1", "bob-token-2", "operator-token-3"
SECRET = "proxy-secret-4"


def auth(token):
    return {"Authorization": f"Bearer {token}"}


def private_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def tenants_file(tmp_path):
    return private_file(tmp_path, "tokens", f"alice {ALICE}\nbob {BOB}\n")


def test_a_tenant_cannot_watch_another_tenants_requests(tmp_path):
    """bob polls /metrics while alice's program fails: 403 for him, the numbers for the operator."""
    with ServerProcess("--token-file", tenants_file(tmp_path), "--metrics-token-file",
                       private_file(tmp_path, "operators", OPERATOR + "\n"), workers=1, tmp_path=tmp_path) as node:
        status, _, body = post(node.url, simple_program("def f():\n    raise ValueError('no')\n"), headers=auth(ALICE))
        assert status == 200 and body["status"] == "FAILED"
        status, _, answer = request("GET", node.url + "/metrics", headers=auth(BOB))
        assert status == 403, answer
        assert b"alice" not in answer and b"kcoral_requests_total" not in answer
        assert request("GET", node.url + "/health", headers=auth(BOB))[0] == 200  # his own view stays
        failed = 'kcoral_requests_total{status="FAILED",code="200",kind="engine",tenant="alice"} 1'
        assert failed in scrape_when(node.url, lambda text: failed in text, auth(OPERATOR))
        # the operator's token reads; it runs nothing
        assert post(node.url, simple_program("def f():\n    return 1\n"), headers=auth(OPERATOR))[0] == 401
        refused = value(scrape_when(node.url, lambda text: True, auth(OPERATOR)), "kcoral_reads_refused_total")
        assert refused == 2  # the start-up probe's (no token) and bob's: refused reads, not client requests


def test_without_an_operator_token_no_tenant_reads_metrics(tmp_path):
    with ServerProcess("--token-file", tenants_file(tmp_path), workers=1, tmp_path=tmp_path) as node:
        assert [request("GET", node.url + "/metrics", headers=auth(t))[0] for t in (ALICE, BOB)] == [403, 403]


def test_a_node_of_anonymous_tokens_serves_metrics_as_before(tmp_path):
    with ServerProcess("--token-file", private_file(tmp_path, "tokens", f"{ALICE}\n{BOB}\n"), workers=1,
                       tmp_path=tmp_path) as node:
        assert [request("GET", node.url + "/metrics", headers=auth(t))[0] for t in (ALICE, BOB)] == [200, 200]
    with ServerProcess(workers=1, tmp_path=tmp_path / "open") as node:
        assert request("GET", node.url + "/metrics")[0] == 200


FORGED_SECONDS = 3500


def forged_stamp():
    return f"t={int((time.time() - FORGED_SECONDS) * 1e6)}"


def slow_queue_observations(text):
    """Queue observations above 1000 s: what the queue-backlog alert's p95 would read."""
    found = samples(text)
    total = found.get(("kcoral_request_queue_seconds_count", frozenset()), 0)
    below = found.get(("kcoral_request_queue_seconds_bucket", frozenset({("le", "900")})), 0)
    return total - below


def test_a_client_cannot_forge_its_queue_time(tmp_path):
    """X-Request-Start an hour old, sent straight to a node: no queue time, with or without a guessed
    secret; the same stamp beside the proxy's secret is believed (HAProxy's)."""
    secret = private_file(tmp_path, "secret", SECRET + "\n")
    with ServerProcess("--token", ALICE, "--proxy-secret-file", secret, workers=1, tmp_path=tmp_path) as node:
        program = simple_program("def f():\n    return 1\n")
        for headers in ({"X-Request-Start": forged_stamp()},
                        {"X-Request-Start": forged_stamp(), "X-KCoral-Proxy": "guessed"}):
            status, _, body = post(node.url, program, headers={**auth(ALICE), **headers})
            assert status == 200 and body["queue_ms"] < 1000, body
        text = scrape_when(node.url, lambda t: value(t, "kcoral_request_queue_seconds_count") >= 2, auth(ALICE))
        assert slow_queue_observations(text) == 0
        status, _, body = post(node.url, program, headers={**auth(ALICE), "X-Request-Start": forged_stamp(),
                                                           "X-KCoral-Proxy": SECRET})
        assert status == 200 and body["queue_ms"] >= FORGED_SECONDS * 1e3


def test_a_node_without_the_proxy_secret_believes_no_stamp(tmp_path):
    with ServerProcess("--token", ALICE, workers=1, tmp_path=tmp_path) as node:
        status, _, body = post(node.url, simple_program("def f():\n    return 1\n"),
                               headers={**auth(ALICE), "X-Request-Start": forged_stamp()})
        assert status == 200 and body["queue_ms"] < 1000, body


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_the_generated_proxy_sends_its_secret_and_a_client_stamp_is_replaced(tmp_path):
    secret = private_file(tmp_path, "secret", SECRET + "\n")
    with ServerProcess("--token", ALICE, "--proxy-secret-file", secret, workers=1, tmp_path=tmp_path) as node:
        proxy = HAProxyProcess([f"{node.url}=1"], tmp_path, token=ALICE, flags=["--proxy-secret-file", secret])
        try:
            with open(proxy.config_path) as f:
                assert f"set-header X-KCoral-Proxy {SECRET}" in f.read()
            status, _, body = post(proxy.url, simple_program("def f():\n    return 1\n"),
                                   headers={**auth(ALICE), "X-Request-Start": forged_stamp(),
                                            "X-KCoral-Proxy": "guessed"})
            assert status == 200 and body["queue_ms"] < 1000, body  # HAProxy's own stamp, believed
        finally:
            proxy.stop()


SELF_KILL = f"import os\ndef f():\n    os.kill(os.getpid(), {int(signal.SIGKILL)})\n"


def test_programs_killing_their_own_worker_raise_no_crash_alert(tmp_path):
    """11 programs that SIGKILL their worker (the worker-crash alert: more than 10 in 15 minutes):
    each fails, and each is counted as the program's, not as a server crash."""
    with ServerProcess("--token", ALICE, workers=1, tmp_path=tmp_path) as node:
        for _ in range(11):
            status, _, body = post(node.url, call_program(SELF_KILL, "f"), headers=auth(ALICE))
            assert status == 200 and body["status"] == "FAILED", body
            assert "killed by signal 9" in body["error"]["message"]
        failed = {"status": "FAILED", "code": "200", "kind": "runtime"}
        text = scrape_when(node.url, lambda t: value(t, "kcoral_requests_total", **failed) >= 11, auth(ALICE))
        assert value(text, "kcoral_requests_total", **failed) == 11
        assert value(text, "kcoral_worker_crashes_total") == 0  # the alert's input: no server fault
        assert value(text, "kcoral_program_crashes_total", cause="signal") == 11


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_one_tenants_burst_does_not_lock_out_another_behind_the_same_address(tmp_path):
    """issue 41: alice's /health calls used up the per-address limit for bob behind the same address.
    With named tenants the limit counts per tenant: alice is answered 429 past it, bob is served;
    HAProxy's log names the tenant of each line."""
    tokens = tenants_file(tmp_path)
    with ServerProcess("--token-file", tokens, workers=1, tmp_path=tmp_path) as node:
        proxy = HAProxyProcess([f"{node.url}=1"], tmp_path, flags=["--token-file", tokens,
                                                                   "--max-requests-per-source", "10"])
        try:
            statuses = [request("GET", proxy.url + "/health", headers=auth(ALICE))[0] for _ in range(15)]
            assert statuses.count(429) >= 5 and statuses[-1] == 429, statuses
            assert [request("GET", proxy.url + "/health", headers=auth(BOB))[0] for _ in range(3)] == [200] * 3
            log = proxy.log()
            assert " 429 " in log and "tenant=alice" in log and "tenant=bob" in log
        finally:
            proxy.stop()
