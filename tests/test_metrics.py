"""GET /metrics (docs/operations.md, "Monitoring"): the Prometheus text format, checked by
`promtool` and scraped by a real Prometheus server; counters that say what the test did;
bounded label cardinality; the proxy's X-Request-Start counted in queue_ms."""

import json
import os
import re
import shutil
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
    free_port,
    post,
    prog,
    request,
    simple_program,
    up_blob,
    wait_for,
)

TOKEN = "metrics-token-5d1c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) missing")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with ServerProcess("--token", TOKEN, workers=1, tmp_path=tmp_path_factory.mktemp("metrics")) as srv:
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
    after = scrape(node.url)

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
    for _ in range(20):
        unique = str(uuid.uuid4())
        post(node.url, program, headers={**AUTH, "X-Request-ID": unique, "X-KCoral-Client-Request-ID": unique})
        post(node.url, {"instructions": unique}, headers=AUTH)
        request("GET", node.url + "/" + unique, headers=AUTH)
    assert series() == settled
    assert str(uuid.uuid4())[:8] not in scrape(node.url)


def test_the_proxy_queue_stamp_counts_in_queue_ms(node):
    program = simple_program("def f():\n    return 1\n")
    stamp = f"t={int((time.time() - 0.75) * 1e6)}"  # as HAProxy writes it, 750 ms ago
    _, _, body = post(node.url, program, headers={**AUTH, "X-Request-Start": stamp})
    assert 750 <= body["queue_ms"] < 60_000
    for bogus in (f"t={int((time.time() + 30) * 1e6)}", "t=1", "750", "t=abc"):  # future, ancient, malformed
        _, _, body = post(node.url, program, headers={**AUTH, "X-Request-Start": bogus})
        assert body["queue_ms"] < 750, bogus


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus (Debian's package) missing")
def test_a_real_prometheus_scrapes_the_node_with_its_token(node, tmp_path):
    """Prometheus scrapes with the bearer token; a PromQL query returns what the test did."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    target = urllib.parse.urlsplit(node.url).netloc
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{"job_name": "kcoral", "static_configs": [{"targets": [target]}],
                            "authorization": {"type": "Bearer", "credentials_file": str(token_file)}}]}))
    marker_count = 3
    before = requests_of(node.url, "FAILED", 200, "correctness")
    for _ in range(marker_count):  # a kind nothing else in this module produces
        source = "from kcoral.errors import ExecutionError\ndef f():\n    raise ExecutionError('correctness', 'off')\n"
        assert post(node.url, simple_program(source), headers=AUTH)[2]["status"] == "FAILED"
    expected = before + marker_count
    prometheus = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    query = 'sum(kcoral_requests_total{job="kcoral",status="FAILED",kind="correctness"})'

    def answered():
        try:
            status, _, body = request("GET", f"http://127.0.0.1:{port}/api/v1/query?" +
                                      urllib.parse.urlencode({"query": query}), timeout=5)
        except OSError:
            return None
        result = json.loads(body)["data"]["result"] if status == 200 else []
        return float(result[0]["value"][1]) if result else None

    try:
        assert wait_for(lambda: answered() == expected, timeout=60), \
            f"PromQL gave {answered()}, expected {expected}: {(tmp_path / 'prometheus.log').read_text()[-2000:]}"
        status, _, body = request("GET", f"http://127.0.0.1:{port}/api/v1/query?query=up", timeout=5)
        assert [r["value"][1] for r in json.loads(body)["data"]["result"]] == ["1"]  # scraped with the token
    finally:
        prometheus.terminate()
        prometheus.wait(30)


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
    assert value(scrape(node.url), "kcoral_requests_in_progress") == 0


@needs_promtool
def test_the_example_alert_rules_are_valid_and_name_real_metrics():
    rules = os.path.join(ROOT, "docs", "kcoral-alerts.yml")
    checked = subprocess.run(["promtool", "check", "rules", rules], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with open(rules) as f, open(os.path.join(ROOT, "docs", "operations.md")) as g:
        named = set(re.findall(r"\bkcoral_[a-z_]+", f.read() + g.read()))
    exposed = set(kcoral.METRIC_HELP) | {f"{n}_bucket" for n, (kind, _) in kcoral.METRIC_HELP.items()
                                         if kind == "histogram"}
    assert named - exposed <= {"kcoral_stats", "kcoral_affinity", "kcoral_spread"}, named - exposed  # HAProxy names
