"""GET /metrics (docs/operations.md, "Monitoring"): the Prometheus text format, checked by
`promtool` and scraped by a real Prometheus server; counters that say what the test did;
bounded label cardinality; the proxy's X-Request-Start counted in queue_ms."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import uuid

import pytest

import kcoral
from tests.support import (
    ROOT,
    ServerProcess,
    call_program,
    join_threads,
    post,
    prog,
    prometheus_server,
    request,
    scalar,
    scrape_when,
    scrapes_after,
    simple_program,
    up_blob,
    wait_for,
)

TOKEN = "metrics-token-5d1c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) missing")


PROXY_SECRET = "proxy-secret-8a41"  # what the generated HAProxy config sends beside its X-Request-Start


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("metrics")
    secret = tmp_path / "proxy-secret"
    secret.write_text(PROXY_SECRET)
    secret.chmod(0o600)
    with ServerProcess("--token", TOKEN, "--proxy-secret-file", str(secret), workers=1, tmp_path=tmp_path) as srv:
        yield srv


def scrape(url, headers=AUTH):
    status, headers, body = request("GET", url + "/metrics", headers=headers)
    assert status == 200, body
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    return body.decode()


def samples(text):
    """{(name, frozenset of label pairs): value} of an exposition text."""
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
            assert match, f"not a sample line: {line!r}"
            labels = frozenset(re.findall(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"', match[2] or ""))
            found[match[1], labels] = float(match[3])
    return found


def value(text, name, **labels):
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def requests_of(url, status, code, kind=""):
    return value(scrape(url), "kcoral_requests_total", status=status, code=str(code), kind=kind)


def test_metrics_need_the_token_like_every_endpoint(node):
    assert request("GET", node.url + "/metrics")[0] == 401
    status, headers, _ = request("POST", node.url + "/metrics", headers=AUTH)
    assert status == 405 and headers["allow"] == "GET"


def test_counters_say_what_the_test_did(node):
    before = scrape(node.url)
    ok = simple_program("def f():\n    return 1\n")
    failed = simple_program("def f():\n    raise ValueError('no')\n")
    for program, expected in ((ok, "COMPLETED"), (ok, "COMPLETED"), (failed, "FAILED")):
        status, _, body = post(node.url, program, headers=AUTH)
        assert (status, body["status"]) == (200, expected)
    blob = os.urandom(64)
    miss = prog(up_blob("b", "bytes", blob))
    assert post(node.url, miss, headers=AUTH)[2]["status"] == "CACHE_MISS"  # referenced, not sent
    assert post(node.url, miss, [blob], headers=AUTH)[2]["status"] == "COMPLETED"
    assert post(node.url, miss, headers=AUTH)[2]["status"] == "COMPLETED"  # now a memory-cache hit
    assert post(node.url, {"instructions": "nope"}, headers=AUTH)[0] == 400
    assert post(node.url, ok)[0] == 401  # no token: refused before anything is read
    refused = {"status": "ERROR", "code": "401", "kind": "unauthorized"}
    counted = value(before, "kcoral_requests_total", **refused) + 1
    after = scrape_when(node.url, lambda text: value(text, "kcoral_requests_total", **refused) >= counted, AUTH)

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("kcoral_requests_total", status="COMPLETED", code="200", kind="") == 4
    assert grew("kcoral_requests_total", status="FAILED", code="200", kind="engine") == 1  # a plain exception
    assert grew("kcoral_requests_total", status="CACHE_MISS", code="200", kind="") == 1
    assert grew("kcoral_requests_total", status="ERROR", code="400", kind="parse") == 1
    assert grew("kcoral_requests_total", status="ERROR", code="401", kind="unauthorized") == 1
    assert grew("kcoral_cache_misses_total", cache="memory") == 1
    assert grew("kcoral_cache_hits_total", cache="memory") == 1
    assert grew("kcoral_request_duration_seconds_count") == 8  # every answered POST, the 401 too
    assert grew("kcoral_request_queue_seconds_count") == 5  # the five that reached a worker
    replaced = value(before, "kcoral_worker_replacements_total") + 5  # a fresh worker after each run
    assert wait_for(lambda: value(scrape(node.url), "kcoral_worker_replacements_total") >= replaced, timeout=20)
    assert grew("kcoral_request_body_bytes_total") >= len(blob)
    assert value(after, "kcoral_capacity") == 1
    assert value(after, "kcoral_info", version=kcoral.__version__, device="cpu", sandbox="none") == 1


@needs_promtool
def test_promtool_accepts_the_exposition(node):
    post(node.url, simple_program("def f():\n    return 1\n"), headers=AUTH)
    checked = subprocess.run(["promtool", "check", "metrics"], input=scrape(node.url), capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_label_values_stay_bounded_whatever_clients_send(node):
    """Request ids, client ids and bodies of every kind never become label values."""
    def series():
        return len(samples(scrape(node.url)))

    program = simple_program("def f():\n    return 1\n")
    for _ in range(3):  # every kind of answer once, so each series exists
        post(node.url, program, headers={**AUTH, "X-Request-ID": str(uuid.uuid4())})
        post(node.url, {"instructions": str(uuid.uuid4())}, headers=AUTH)
    settled = series()
    sent = [str(uuid.uuid4()) for _ in range(20)]
    for unique in sent:
        post(node.url, program, headers={**AUTH, "X-Request-ID": unique, "X-KCoral-Client-Request-ID": unique})
        post(node.url, {"instructions": unique}, headers=AUTH)
        request("GET", node.url + "/" + unique, headers=AUTH)
    assert series() == settled
    exposed = scrape(node.url)
    assert [unique for unique in sent if unique[:8] in exposed] == []


def test_the_proxy_queue_stamp_counts_in_queue_ms(node):
    program = simple_program("def f():\n    return 1\n")
    proxy = {**AUTH, "X-KCoral-Proxy": PROXY_SECRET}  # the proxy's stamps only (tests/test_between_tenants.py)
    stamp = f"t={int((time.time() - 0.75) * 1e6)}"  # as HAProxy writes it, 750 ms ago
    _, _, body = post(node.url, program, headers={**proxy, "X-Request-Start": stamp})
    assert 750 <= body["queue_ms"] < 60_000
    for bogus in (f"t={int((time.time() + 30) * 1e6)}", "t=1", "750", "t=abc"):  # future, ancient, malformed
        _, _, body = post(node.url, program, headers={**proxy, "X-Request-Start": bogus})
        assert body["queue_ms"] < 750, bogus


needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus (Debian's package) missing")


@contextlib.contextmanager
def prometheus_scraping(url, tmp_path, rule_files=()):
    """A real Prometheus scraping the node at `url` every second with the token (and evaluating
    `rule_files` every second) -> a function answering a PromQL query: [(labels, value)...], or None
    while Prometheus does not answer yet."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    scrape = [{"job_name": "kcoral", "static_configs": [{"targets": [urllib.parse.urlsplit(url).netloc]}],
               "authorization": {"type": "Bearer", "credentials_file": str(token_file)}}]
    with prometheus_server(tmp_path, scrape, rule_files) as query:
        yield query


@needs_prometheus
def test_a_real_prometheus_scrapes_the_node_with_its_token(node, tmp_path):
    """Prometheus scrapes with the bearer token; a PromQL query returns what the test did."""
    marker_count = 3
    before = requests_of(node.url, "FAILED", 200, "correctness")
    for _ in range(marker_count):  # a kind nothing else in this module produces
        source = "from kcoral.errors import ExecutionError\ndef f():\n    raise ExecutionError('correctness', 'off')\n"
        assert post(node.url, simple_program(source), headers=AUTH)[2]["status"] == "FAILED"
    expected = before + marker_count
    promql = 'sum(kcoral_requests_total{job="kcoral",status="FAILED",kind="correctness"})'
    with prometheus_scraping(node.url, tmp_path) as query:
        assert wait_for(lambda: scalar(query, promql) == expected, timeout=60), \
            f"PromQL gave {scalar(query, promql)}, expected {expected}: {query.log()}"
        assert [v for _, v in query("up")] == [1]  # scraped with the token


@needs_prometheus
def test_prometheus_keeps_scraping_through_a_token_rotation(tmp_path):
    """docs/operations.md's token rotation, Prometheus's step: once the node accepts NEW and OLD,
    Prometheus's credentials file gets NEW (read at every scrape: no reload), then the node drops
    OLD.  No scrape is refused: `up` stays 1 and kcoral_reads_refused_total does not move."""
    node_tokens = tmp_path / "node-tokens"

    def node_accepts(*tokens):
        with open(os.open(node_tokens, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write("\n".join(tokens) + "\n")

    node_accepts(TOKEN)
    with ServerProcess("--token-file", str(node_tokens), workers=1, tmp_path=tmp_path / "node") as fresh, \
            prometheus_scraping(fresh.url, tmp_path) as query:
        def reload_tokens():
            reloaded = fresh.log().count("tokens_reloaded")
            fresh.proc.send_signal(signal.SIGHUP)
            assert wait_for(lambda: fresh.log().count("tokens_reloaded") > reloaded, 10)

        assert wait_for(lambda: [v for _, v in query("up") or []] == [1], 60), query.log()
        refused = scalar(query, "kcoral_reads_refused_total")  # the start-up probe's, without a token
        node_accepts("rotated-token-9c2e", TOKEN)
        reload_tokens()
        (tmp_path / "token").write_text("rotated-token-9c2e")  # prometheus_scraping's credentials file
        scrapes_after(query, time.time(), 2)  # Prometheus reads the file at each scrape: NEW from now on
        node_accepts("rotated-token-9c2e")
        reload_tokens()
        started = time.monotonic()
        scrapes_after(query, time.time(), 4)  # with OLD gone
        assert request("GET", fresh.url + "/metrics", headers=AUTH)[0] == 401  # OLD is refused now
        window = f"{int(time.monotonic() - started) + 8}s"
        assert scalar(query, f"min_over_time(up[{window}])") == 1
        assert scalar(query, f"count_over_time(up[{window}])") >= 5  # scraped all along
        # the OLD-token request above, once scraped, and nothing else
        assert wait_for(lambda: scalar(query, "kcoral_reads_refused_total") == refused + 1, 10)


CLIENT_OVERHEAD = 0.05  # seconds a client's own measurement may exceed the node's for one request


def bucket_of(value):
    """(lower, upper) bounds of the histogram bucket holding `value`."""
    bounds = (0.0,) + kcoral.DURATION_BUCKETS + (float("inf"),)
    index = kcoral.bucket_index(kcoral.DURATION_BUCKETS, value)
    return bounds[index], bounds[index + 1]


def quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@needs_prometheus
def test_prometheus_quantiles_match_the_measured_latencies(tmp_path):
    """On a node of one worker, 4 clients each send 4 programs sleeping 0.4 s: requests queue for
    0 to about 1.2 s and take 0.4 to about 1.7 s.  histogram_quantile over what Prometheus scraped
    lands in the bucket of the measured p50 and p95 (the queue waits the answers report; the
    durations the clients measured), within that bucket's width of them.  Meanwhile the example
    alerts, evaluated by the same Prometheus, stay silent: the node is healthy."""
    sleeper = call_program("import time\ndef f():\n    time.sleep(0.4)\n    return 1\n", "f")
    queued, durations = [], []

    def client():
        for _ in range(4):
            started = time.monotonic()
            status, _, body = post(fresh.url, sleeper, headers=AUTH)
            durations.append(time.monotonic() - started)
            assert status == 200
            queued.append(body["queue_ms"] / 1e3)

    rules = [os.path.join(ROOT, "docs", "kcoral-alerts.yml")]
    with ServerProcess("--token", TOKEN, workers=1, tmp_path=tmp_path / "node") as fresh, \
            prometheus_scraping(fresh.url, tmp_path, rules) as query:
        threads = [threading.Thread(target=client) for _ in range(4)]
        for thread in threads:
            thread.start()
        join_threads(threads)
        assert len(durations) == 16
        count = 'sum(kcoral_request_duration_seconds_count{job="kcoral"})'
        assert wait_for(lambda: (scalar(query, count) or 0) >= 16, timeout=60), query.log()
        scrapes_after(query, time.time())  # every histogram of the last request is in
        for name, measured in (("kcoral_request_queue_seconds", queued),
                               ("kcoral_request_duration_seconds", durations)):
            for q in (0.5, 0.95):
                expected = quantile(measured, q)
                answered = scalar(query, f'histogram_quantile({q}, sum by (le) ({name}_bucket{{job="kcoral"}}))')
                # the client measures a little more than the node observes (connection, transfer): the
                # node's observation lies in the buckets from CLIENT_OVERHEAD below the client's figure
                lower, upper = bucket_of(max(0.0, expected - CLIENT_OVERHEAD))[0], bucket_of(expected)[1]
                assert answered is not None and lower <= answered <= upper, \
                    (name, q, answered, expected, sorted(measured))
                assert abs(answered - expected) <= upper - lower
                assert abs(answered - expected) <= 0.2 * expected, (name, q, answered, expected)  # within 20 %
                print(f"\n{name} p{int(q * 100)}: measured {expected:.3f} s, Prometheus {answered:.3f} s "
                      f"(bucket {lower:g}-{upper:g} s)", end="")
        assert query("ALERTS") == [], query("ALERTS")  # neither pending nor firing


def test_gpu_lease_metrics_are_absent_on_cpu(node):
    assert "kcoral_gpu_lease_busy_seconds_total{" not in scrape(node.url)


def test_requests_in_progress_while_one_runs(node):
    sleeper = call_program("import time\ndef f():\n    time.sleep(1.5)\n    return 1\n", "f")
    done = []
    thread = threading.Thread(target=lambda: done.append(post(node.url, sleeper, headers=AUTH)[0]))
    thread.start()
    try:
        assert wait_for(lambda: value(scrape(node.url), "kcoral_requests_in_progress") == 1, timeout=10)
    finally:
        thread.join(30)
    assert not thread.is_alive() and done == [200]
    # it counts until the answer is out, a moment after the client has it
    assert wait_for(lambda: value(scrape(node.url), "kcoral_requests_in_progress") == 0, timeout=10)


@needs_promtool
def test_the_example_alert_rules_are_valid_and_name_real_metrics():
    rules = os.path.join(ROOT, "docs", "kcoral-alerts.yml")
    checked = subprocess.run(["promtool", "check", "rules", rules], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with open(rules) as f, open(os.path.join(ROOT, "docs", "operations.md")) as g:
        named = set(re.findall(r"\bkcoral_[a-z_]+", f.read() + g.read()))
    exposed = set(kcoral.METRIC_HELP) | {f"{n}_bucket" for n, (kind, _) in kcoral.METRIC_HELP.items()
                                         if kind == "histogram"}
    with open(os.path.join(ROOT, "kcoral.py")) as f:  # the generated HAProxy config's sections
        proxies = set(re.findall(r"^(?:frontend|backend|listen) (kcoral_\w+)", f.read(), re.M))
    assert {"kcoral_spread", "kcoral_affinity"} <= proxies
    assert named - exposed <= proxies, named - exposed - proxies


def histograms(text):
    """{name: ([(upper bound, cumulative count)...] in exposition order, _sum, _count)} of an exposition text."""
    found = {}
    for name in re.findall(r"^# TYPE (\S+) histogram$", text, re.M):
        buckets = [(float(le), float(n)) for le, n in
                   re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)]
        total = float(re.search(rf"^{name}_sum (\S+)$", text, re.M)[1])
        count = float(re.search(rf"^{name}_count (\S+)$", text, re.M)[1])
        found[name] = (buckets, total, count)
    return found


def assert_well_formed(name, buckets, count):
    bounds = [le for le, _ in buckets]
    assert bounds == sorted(bounds) and bounds[-1] == float("inf"), (name, bounds)
    counts = [n for _, n in buckets]
    assert counts == sorted(counts), f"{name}: buckets not cumulative: {counts}"
    assert counts[-1] == count, f"{name}: +Inf holds {counts[-1]}, _count {count}"


def test_histogram_buckets_are_cumulative_and_inf_is_the_count(node):
    """Each bucket counts every observation at or below its bound; +Inf equals _count, whatever the
    sum of the observations (the +Inf bucket once held count plus sum)."""
    sleeper = call_program("import time\ndef f():\n    time.sleep(0.3)\n    return 1\n", "f")
    counted = value(scrape(node.url), "kcoral_request_duration_seconds_count") + 3
    for _ in range(3):
        assert post(node.url, sleeper, headers=AUTH)[0] == 200
    found = histograms(scrape_when(
        node.url, lambda text: value(text, "kcoral_request_duration_seconds_count") >= counted, AUTH))
    assert set(found) == {n for n, (kind, _) in kcoral.METRIC_HELP.items() if kind == "histogram"}
    for name, (buckets, _, count) in found.items():
        assert_well_formed(name, buckets, count)
    buckets, total, count = found["kcoral_request_duration_seconds"]
    assert count >= 3 and total >= 0.9
    below = max(le for le, _ in buckets if le <= 0.25)
    assert dict(buckets)[below] <= count - 3  # the three sleepers (0.3 s each): above the last bound under 0.25 s


def test_an_observation_beyond_the_last_bound_counts_in_inf_only():
    metrics = kcoral.Metrics()
    for total_ms in (2.0, 400.0, 1_000_000.0):  # 2 ms, 0.4 s, and 1000 s: beyond the last bound (900 s)
        metrics.record("request_finished", "INFO", {"http_status": 200, "status": "COMPLETED", "total_ms": total_ms})
    buckets, total, count = histograms(metrics.render([]))["kcoral_request_duration_seconds"]
    assert_well_formed("kcoral_request_duration_seconds", buckets, count)
    counts = dict(buckets)
    first_at_least = lambda seconds: min(le for le in counts if le >= seconds)  # noqa: E731
    last_below = lambda seconds: max(le for le in counts if le < seconds)  # noqa: E731
    assert (counts[0.001], counts[first_at_least(0.002)], counts[last_below(0.4)], counts[first_at_least(0.4)],
            counts[900], counts[float("inf")]) == (0, 1, 1, 2, 2, 3)
    assert (total, count) == (1000.402, 3)


def test_every_answer_and_alerted_event_is_a_series_from_the_start(tmp_path):
    """A node that answered nothing yet already exposes each (status, code, kind) it can answer and
    each ERROR event alerts count, at 0: error ratios and increase() have a value from the start."""
    with ServerProcess("--token", TOKEN, workers=1, tmp_path=tmp_path) as fresh:
        found = samples(scrape(fresh.url))
        for status, code, kind in kcoral.ANSWERS:
            key = ("kcoral_requests_total", frozenset({("status", status), ("code", code), ("kind", kind)}))
            assert found.get(key) == 0, key
        for event in kcoral.ALERTED_EVENTS:
            assert found.get(("kcoral_events_total", frozenset({("event", event), ("level", "ERROR")}))) == 0, event
        assert found.get(("kcoral_worker_crashes_total", frozenset())) == 0
        # and the answers a node gives are among them: no series appears later that a ratio would miss
        post(fresh.url, simple_program("def f():\n    return 1\n"), headers=AUTH)
        post(fresh.url, simple_program("def f():\n    raise ValueError('no')\n"), headers=AUTH)
        post(fresh.url, {"instructions": "nope"}, headers=AUTH)
        post(fresh.url, simple_program("def f():\n    return 1\n"))
        answered = {tuple(dict(labels)[k] for k in ("status", "code", "kind"))
                    for (name, labels), _ in samples(scrape(fresh.url)).items() if name == "kcoral_requests_total"}
        assert answered == set(kcoral.ANSWERS)


def test_refused_scrapes_are_not_counted_as_client_requests(node):
    before = scrape(node.url)
    assert request("GET", node.url + "/metrics", headers={"Authorization": "Bearer old-token"})[0] == 401
    assert request("GET", node.url + "/health")[0] == 401
    counted = value(before, "kcoral_reads_refused_total") + 2
    after = scrape_when(node.url, lambda text: value(text, "kcoral_reads_refused_total") >= counted, AUTH)
    assert value(after, "kcoral_reads_refused_total") - value(before, "kcoral_reads_refused_total") == 2
    assert value(after, "kcoral_requests_total", status="ERROR", code="401", kind="unauthorized") == \
        value(before, "kcoral_requests_total", status="ERROR", code="401", kind="unauthorized")
