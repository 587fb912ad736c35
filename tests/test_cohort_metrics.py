"""The operator's questions answered by a real Prometheus over a real cohort
(docs/operations.md "Monitoring"): three one-slot nodes, a token file of three tenants, the
generated HAProxy configuration (with the proxy's secret and its exporter), steady load from
alice and bob, bursts from carol, some failures and timeouts.  The documented PromQL answers
for failures, errors, rate and latency per tenant equal what the node logs and the clients saw
in the same run: counts exactly (rounded: increase() extrapolates), quantiles within 20 %."""

import collections
import math
import threading
import time
import urllib.parse

import pytest

from tests.support import (
    HAPROXY,
    HAProxyProcess,
    ServerProcess,
    call_program,
    free_port,
    join_threads,
    log_records,
    post,
    prometheus_server,
    run_directories,
    wait_for,
)

TENANTS = {"alice": "alice-token-1", "bob": "bob-token-2", "carol": "carol-token-3", "dave": "dave-token-7"}
OPERATOR, SECRET, CHECKS = "operator-token-4", "proxy-secret-5", "checks-token-6"
NAP = "import time\ndef f(seconds):\n    time.sleep(seconds)\n    return seconds\n"
FAIL = "def f():\n    raise ValueError('no')\n"
EXTRAPOLATED_OVER_SECONDS = 80
NO_WAIT_SECONDS = 0.001  # DURATION_BUCKETS' first bound: a wait below it is none


def auth(token):
    return {"Authorization": f"Bearer {token}"}


def private_file(path, text):
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def quantile(values, q, step=0):
    """The q-quantile by nearest rank, the observation histogram_quantile estimates: it finds the
    bucket holding rank q * n and interpolates within it (so a tenant's one slow request in 15 is
    its p95, as Prometheus reads it).  `step` ranks away from it (clamped): its neighbours."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1 + step))]


class Tenant:
    """One tenant's clients through the proxy: what each of its requests was answered."""

    def __init__(self, name, url):
        self.name, self.url, self.answers = name, url, []
        self.lock = threading.Lock()

    def send(self, program):
        started = time.monotonic()
        status, _, body = post(self.url, program, headers=auth(TENANTS[self.name]), timeout=120)
        with self.lock:
            self.answers.append((status, body.get("status", "ERROR") if isinstance(body, dict) else "ERROR",
                                 time.monotonic() - started))

    def steady(self, threads, count, seconds):
        def loop():
            for _ in range(count):
                self.send(call_program(NAP, "f", seconds))
        return [threading.Thread(target=loop) for _ in range(threads)]

    def failed(self):
        return sum(1 for status, result, _ in self.answers if result in ("FAILED", "ERROR"))


def one(query, promql, labels=None):
    """The value of the series of `promql`'s answer whose labels include `labels` (0 if none)."""
    for found, number in query(promql) or []:
        if all(found.get(k) == v for k, v in (labels or {}).items()):
            return number
    return 0.0


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_the_documented_queries_equal_the_logs_and_the_clients(tmp_path):
    tokens = private_file(tmp_path / "tokens", f"checks {CHECKS}\n" +
                          "".join(f"{name} {token}\n" for name, token in TENANTS.items()))
    operators = private_file(tmp_path / "operators", OPERATOR + "\n")
    secret = private_file(tmp_path / "secret", SECRET + "\n")
    node_flags = ("--token-file", tokens, "--metrics-token-file", operators, "--proxy-secret-file", secret)
    nodes = [ServerProcess(*node_flags, "--log-dir", str(tmp_path / f"logs{i}"), workers=1,
                           tmp_path=tmp_path / f"node{i}") for i in range(3)]
    stats_port = free_port()
    proxy = HAProxyProcess([f"{n.url}=1" for n in nodes], tmp_path, flags=[
        "--token-file", tokens, "--proxy-secret-file", secret, "--stats-listen", f"127.0.0.1:{stats_port}"])
    operator_token = tmp_path / "prometheus-token"
    operator_token.write_text(OPERATOR)
    scrape_configs = [
        {"job_name": "kcoral", "authorization": {"type": "Bearer", "credentials_file": str(operator_token)},
         "static_configs": [{"targets": [urllib.parse.urlsplit(n.url).netloc for n in nodes]}]},
        {"job_name": "haproxy", "static_configs": [{"targets": [f"127.0.0.1:{stats_port}"]}]}]
    try:
        with prometheus_server(tmp_path, scrape_configs) as query:
            assert wait_for(lambda: one(query, 'sum(up{job="kcoral"})') == 3, 60)
            scraping_since = time.monotonic()
            alice, bob, carol, dave = (Tenant(name, proxy.url) for name in TENANTS)
            threads = alice.steady(3, 6, 0.3) + bob.steady(2, 6, 0.3)
            for thread in threads:
                thread.start()
            for _ in range(3):  # carol's bursts: 4 at once, then a pause
                burst = carol.steady(4, 1, 0.3)
                for thread in burst:
                    thread.start()
                join_threads(burst)
                time.sleep(0.5)
            for tenant, source in ((alice, FAIL), (bob, FAIL), (carol, FAIL), (carol, FAIL)):
                tenant.send(call_program(source, "f"))
            # dave's two programs over their time limit: 504 timeout, a server-side error (code 5..); a
            # tenant of their own, so that the others' p95 is no lone outlier's (a rank on a bucket edge)
            for _ in range(2):
                dave.send(call_program(NAP, "f", 5, options={"timeout_seconds": 1}))
            join_threads(threads)

            def finished():
                return [(i, r) for i in range(3) for r in log_records(run_directories(tmp_path / f"logs{i}")[0])
                        if r["event"] == "request_finished"]
            answered = sum(len(t.answers) for t in (alice, bob, carol, dave))
            # a node logs a request once its answer is sent: the client may read it a moment before
            assert wait_for(lambda: len(finished()) >= answered, 10)
            records = finished()
            assert len(records) == answered
            total = len(records)
            assert wait_for(lambda: one(query, "sum(kcoral_request_duration_seconds_count)") == total, 30)
            # increase() extrapolates each series' average slope to the window's end, up to a scrape
            # interval past its last sample: over 80 s of samples that adds at most 1/80 of a count,
            # under 0.5 for the largest sum here (about 25), so round() gives the count exactly
            time.sleep(max(2.0, scraping_since + EXTRAPOLATED_OVER_SECONDS - time.monotonic()))

            report = compare(query, records, nodes, (alice, bob, carol, dave))
        assert "tenant=carol" in proxy.log() and "tenant=alice" in proxy.log()  # HAProxy's log names the tenant
    finally:
        proxy.stop()
        for node in nodes:
            node.stop()
    print("\n" + "\n".join(report))


def compare(query, records, nodes, tenants):
    """Each documented question asked of Prometheus, next to the logs' and the clients' answers."""
    report = []
    by_tenant = collections.defaultdict(list)
    for _, record in records:
        by_tenant[record["tenant"]].append(record)
    for tenant in tenants:
        report += compare_tenant(query, tenant, by_tenant[tenant.name])
    for index, node in enumerate(nodes):
        instance = urllib.parse.urlsplit(node.url).netloc
        logged = [r for n, r in records if n == index]
        answered = one(query, "round(sum by (instance) (increase(kcoral_requests_total[5m])))", {"instance": instance})
        errors = one(query, 'round(sum by (instance) (increase(kcoral_requests_total{code=~"5.."}[1h])))',
                     {"instance": instance})
        errors_logged = sum(1 for r in logged if r["http_status"] >= 500)
        assert (answered, errors) == (len(logged), errors_logged), (instance, answered, errors, errors_logged)
        rate = one(query, "sum by (instance) (rate(kcoral_requests_total[5m]))", {"instance": instance})
        report.append(f"node {instance}: {answered:.0f} requests (logs {len(logged)}, rate {rate:.3f}/s), "
                      f"{errors:.0f} server errors (logs {errors_logged})")
    busy = one(query, "sum(increase(kcoral_busy_seconds_total[5m]))")
    executed = sum(r["elapsed_ms"] or 0 for _, r in records) / 1e3
    report.append(f"busy seconds: Prometheus {busy:.2f}, the logs' execution times {executed:.2f} (busy fraction "
                  f"over 5 m: {one(query, 'sum(rate(kcoral_busy_seconds_total[5m])) / sum(kcoral_capacity)'):.3f})")
    assert executed <= busy <= 1.2 * executed + 0.2 * len(records)  # a slot is held a little longer than it runs
    deepest = one(query, "max_over_time(sum(kcoral_requests_waiting)[5m:1s])")
    proxy_deepest = one(query, 'max_over_time(sum(haproxy_backend_current_queue{proxy=~"kcoral_spread|kcoral_affinity"})'
                               '[5m:1s])')
    report.append(f"queue depth, deepest: {deepest:.0f} in the nodes, {proxy_deepest:.0f} in HAProxy")
    starved = query('sum by (tenant) (kcoral_tenant_requests_waiting) > 0 and on() '
                    '(sum(kcoral_capacity) - sum(kcoral_requests_in_progress) > 0)')
    assert starved == [], starved  # nobody waits while a slot is free
    report.append("starvation (a tenant waiting while a slot is free): none")
    return report


def compare_tenant(query, tenant, logged):
    """Requests, failures and latency quantiles of one tenant: Prometheus, the nodes' logs, the clients."""
    answered = one(query, "round(sum by (tenant) (increase(kcoral_requests_total[5m])))", {"tenant": tenant.name})
    assert answered == len(logged) == len(tenant.answers), (tenant.name, answered, len(logged))
    failed_promql = 'round(sum by (tenant) (increase(kcoral_requests_total{status=~"FAILED|ERROR"}[1h])))'
    failed = one(query, failed_promql, {"tenant": tenant.name})
    failed_logged = sum(1 for r in logged if r["status"] in ("FAILED", "ERROR"))
    assert failed == failed_logged == tenant.failed(), (tenant.name, failed, failed_logged, tenant.failed())
    rate = one(query, "sum by (tenant) (rate(kcoral_requests_total[5m]))", {"tenant": tenant.name})
    report = [f"{tenant.name}: {len(logged)} requests (clients {len(tenant.answers)}, rate {rate:.3f}/s over 5 m), "
              f"{failed:.0f} failed (logs {failed_logged}, clients {tenant.failed()})"]
    for name, field in (("kcoral_request_duration_seconds", "total_ms"), ("kcoral_request_queue_seconds", "queue_ms")):
        values = [r[field] / 1e3 for r in logged if r.get(field) is not None]
        if not values:  # a timed-out request's record has no queue_ms, nor its histogram an observation
            report.append(f"  {name}: no observation (logs: none)")
            continue
        for q in (0.5, 0.95):
            promql = f"histogram_quantile({q}, sum by (tenant, le) (rate({name}_bucket[5m])))"
            answered = one(query, promql, {"tenant": tenant.name})
            expected = quantile(values, q)
            report.append(f"  {name} p{int(q * 100)}: Prometheus {answered:.3f} s, logs {expected:.3f} s")
            print(report[-1])
            # within 20 % of the observation at that rank or of a neighbour: with ~15 requests a tenant's
            # waits can jump at the rank from under a millisecond (a slot was free) to seconds, and
            # the rank a histogram reads from counts extrapolated over its window may fall on either
            # side; a wait under a millisecond lies in the first bucket, whose width is the tolerance
            low, high = quantile(values, q, -1), quantile(values, q, 1)
            assert low - max(0.2 * low, NO_WAIT_SECONDS) <= answered <= high + max(0.2 * high, NO_WAIT_SECONDS), \
                (tenant.name, name, q, answered, expected, low, high)
    return report
