"""A cohort: three real nodes (1 CPU worker each, bearer token on) behind a real HAProxy that
runs the configuration `python -m kcoral haproxy-config` generates.  Each test measures one
promise of that configuration: scaling, queueing instead of refusal, failover when a node is
killed, drain on SIGTERM, rejoin, blob affinity, token pass-through.

Work is sleep-bound (the box has two shared cores), so wall times measure scheduling, not CPU.
"""

import collections
import hashlib
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from client import Client, KCoralError, Program, TransportError
from tests.support import (
    HAPROXY,
    PYTHON,
    ROOT,
    HAProxyProcess,
    ServerProcess,
    free_port,
    request,
)

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")

TOKEN = "cohort-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NODES = 3
# Each execution appends its value to a ledger first, so a request run twice would show.
ECHO_AFTER = ("import time\ndef f(x, seconds, ledger):\n    with open(ledger, 'a') as f:\n        f.write(f'{x}\\n')\n"
              "    time.sleep(seconds)\n    return x\n")


class Cohort:
    """The nodes, the proxy, and the per-node count of POSTs each node has answered."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.ledger = str(workdir / "ledger")
        self.nodes = [self.start_node(free_port()) for _ in range(NODES)]
        self.proxy = HAProxyProcess([n.url for n in self.nodes], workdir, token=TOKEN)
        wait_until(lambda: self.all_up(), 20, "the proxy never saw every node up")

    def start_node(self, port):
        return ServerProcess("--token", TOKEN, workers=1, tmp_path=self.workdir / f"node-{port}", port=port)

    def restart(self, index):
        """A fresh process on the dead node's port (its disk cache survives, its memory does not)."""
        old = self.nodes[index]
        old.stop()
        self.nodes[index] = self.start_node(old.port)

    def posts(self):
        """POSTs answered per node, read from the nodes' own request log (restarts included)."""
        return [n.log().count(" request_finished ") for n in self.nodes]

    def all_up(self):
        """Every node answered at least one of a burst of spread requests."""
        before = self.posts()
        with Client(self.proxy.url, headers=AUTH) as client:
            threads = [threading.Thread(target=run_echo, args=(client, f"up-{k}", 0.2, {}, self.ledger))
                       for k in range(2 * NODES)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return all(after > b for after, b in zip(self.posts(), before, strict=True))

    def close(self):
        self.proxy.stop()
        for node in self.nodes:
            node.stop()


def wait_until(predicate, timeout, message):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, message
        time.sleep(0.1)


def echo_program(value, seconds, ledger):
    program = Program()
    fn = program.get_function(module=program.upload(kind="module", source=ECHO_AFTER), name="f")
    program.return_(key="out", value=program.run(fn=fn, args=[value, seconds, ledger]))
    return program


def run_echo(client, value, seconds, outcomes, ledger):
    """One request; records 'ok', 'wrong' or the error it failed with."""
    try:
        result = client.execute(echo_program(value, seconds, ledger))
        outcomes[value] = "ok" if result.completed and result["out"] == value else f"wrong: {result}"
    except (KCoralError, TransportError) as exc:
        outcomes[value] = f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    group = Cohort(tmp_path_factory.mktemp("cohort"))
    try:
        yield group
    finally:
        group.close()


def load(cohort, clients, requests, seconds, during=None):
    """`requests` echo requests from `clients` threads through the proxy -> (outcomes, wall seconds,
    how many times each ran). `during(elapsed)` is called every 50 ms while they run."""
    tag = f"{time.monotonic_ns()}-"
    outcomes, work = {}, [f"{tag}{k}" for k in range(requests)]
    lock = threading.Lock()

    def client_loop():
        with Client(cohort.proxy.url, headers=AUTH) as client:
            while True:
                with lock:
                    if not work:
                        return
                    value = work.pop(0)
                run_echo(client, value, seconds, outcomes, cohort.ledger)

    started = time.monotonic()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if during:
            during(time.monotonic() - started)
        time.sleep(0.05)
    wall = time.monotonic() - started
    with open(cohort.ledger) as f:
        runs = collections.Counter(line.strip() for line in f if line.startswith(tag))
    return outcomes, wall, runs


def watch_nodes(cohort, peaks):
    """Record each node's peak of requests it holds (running or waiting for its worker)."""
    def sample(_elapsed):
        for index, node in enumerate(cohort.nodes):
            status, _, body = request("GET", node.url + "/health", headers=AUTH, timeout=5)
            if status == 200:
                held = json.loads(body)["load"]
                peaks[index] = max(peaks[index], held["requests_in_progress"] + held["requests_waiting"])
    return sample


def test_sleep_bound_work_scales_to_the_cohort(cohort):
    """12 requests sleeping 1 s from 6 clients on 3 one-worker nodes: ideal 4.0 s."""
    outcomes, wall, runs = load(cohort, clients=6, requests=12, seconds=1.0)
    ideal = 12 * 1.0 / NODES
    print(f"\nscaling: {wall:.2f} s for an ideal {ideal:.2f} s ({wall / ideal:.2f}x)")
    assert collections.Counter(outcomes.values()) == {"ok": 12}
    assert set(runs.values()) == {1} and len(runs) == 12
    assert wall <= 1.3 * ideal


def test_beyond_capacity_requests_queue_in_the_proxy_never_503(cohort):
    """24 simultaneous requests for 3 slots: each node holds at most its 1 slot's worth, the
    rest wait in HAProxy's queue, and every request completes."""
    peaks = [0] * NODES
    before = cohort.posts()
    outcomes, wall, runs = load(cohort, clients=24, requests=24, seconds=0.3, during=watch_nodes(cohort, peaks))
    served = [after - b for after, b in zip(cohort.posts(), before, strict=True)]
    print(f"\nqueueing: 24 requests in {wall:.2f} s, per node {served}, peak held per node {peaks}")
    assert collections.Counter(outcomes.values()) == {"ok": 24}
    assert set(runs.values()) == {1} and len(runs) == 24
    assert max(peaks) <= 1, peaks
    assert sum(served) == 24 and min(served) >= 4, served


def test_killed_node_fails_only_its_running_request_and_rejoins(cohort):
    """SIGKILL a node under load, restart it: no wrong result, at most its one running request
    fails (clearly), the others go elsewhere, and the restarted node serves again within seconds."""
    victim = 1
    events = {}

    def chaos(elapsed):
        if elapsed > 1.5 and "killed" not in events:
            cohort.nodes[victim].proc.send_signal(signal.SIGKILL)
            events["killed"] = elapsed
        elif elapsed > 3.0 and "restarted" not in events:
            cohort.restart(victim)
            events["restarted"], events["posts at restart"] = time.monotonic(), cohort.posts()[victim]

    outcomes, wall, runs = load(cohort, clients=6, requests=60, seconds=0.25, during=chaos)
    # The load may be over before HAProxy sees the node up again: send the bursts that show it.
    wait_until(lambda: cohort.all_up() and cohort.posts()[victim] > events["posts at restart"], 10,
               "the restarted node never served")
    rejoined = time.monotonic() - events["restarted"]
    counts = collections.Counter("ok" if v == "ok" else v.split(":")[0] for v in outcomes.values())
    failures = [f"{v} (ran {runs[k]}x)" for k, v in outcomes.items() if v != "ok"]
    print(f"\nkill: {dict(counts)} in {wall:.2f} s; failures {failures}; rejoined {rejoined:.1f} s after restart")
    assert not [v for v in outcomes.values() if v.startswith("wrong")]
    # Lost: the one request executing there (ran once), and at most one more that HAProxy had
    # handed to the dying process as its slot freed (its port still accepts while the kernel
    # tears it down); that one never ran.  Nothing is retried once sent, so nothing runs twice.
    assert len(outcomes) == 60 and len(failures) <= 2, failures
    assert sum(1 for k, v in outcomes.items() if v != "ok" and runs[k]) <= 1, failures
    assert max(runs.values()) == 1, "a request ran twice"
    assert all(runs[v] == 1 for v, outcome in outcomes.items() if outcome == "ok")
    # HAProxy answers 502 (our JSON error), or, on a kept-alive client connection, closes it
    # without an answer as a server would: the client raises TransportError and never re-sends.
    assert all(("KCoralError" in f and "not retried" in f) or "TransportError" in f for f in failures), failures
    assert rejoined < 8


def test_drained_node_finishes_its_work_and_nothing_fails(cohort):
    """SIGTERM a node under load: its running request completes, requests it refuses (503 busy,
    nothing ran) are retried elsewhere by HAProxy, it exits 0; restarted, it rejoins."""
    victim = 2
    events = {}

    def drain(elapsed):
        if elapsed > 1.5 and "signalled" not in events:
            cohort.nodes[victim].proc.send_signal(signal.SIGTERM)
            events["signalled"] = elapsed

    before = cohort.posts()[victim]
    outcomes, wall, runs = load(cohort, clients=6, requests=48, seconds=0.3, during=drain)
    code = cohort.nodes[victim].proc.wait(30)
    log = cohort.nodes[victim].log()
    refused = log.count("http_status=503")
    print(f"\ndrain: {len(outcomes)} requests in {wall:.2f} s, exit {code}, "
          f"{cohort.posts()[victim] - before} answered by the drained node of which {refused} 503 (retried)")
    assert collections.Counter(outcomes.values()) == {"ok": 48}
    assert set(runs.values()) == {1} and len(runs) == 48, "a request ran twice, or not at all"
    assert code == 0
    cohort.restart(victim)
    wait_until(cohort.all_up, 15, "the drained node did not rejoin")


def test_repeated_blobs_land_where_they_are_cached(cohort):
    """8 distinct 9 MiB blobs, each executed twice: with affinity, 24 POSTs (a CACHE_MISS and the
    upload the first time, one POST the second); without it about 32."""
    blobs = [os.urandom(9 << 20) for _ in range(8)]
    source = "import hashlib\ndef f(data):\n    return hashlib.sha256(data).hexdigest()\n"
    before = cohort.posts()
    with Client(cohort.proxy.url, headers=AUTH) as client:
        for blob in blobs * 2:
            program = Program()
            fn = program.get_function(module=program.upload(kind="module", source=source), name="f")
            program.return_(key="digest", value=program.run(fn=fn, args=[program.upload(kind="bytes", value=blob)]))
            result = client.execute(program)
            assert result.completed and result["digest"] == hashlib.sha256(blob).hexdigest()
    per_node = [after - b for after, b in zip(cohort.posts(), before, strict=True)]
    print(f"\naffinity: {sum(per_node)} POSTs for 16 executions of 8 blobs (per node {per_node})")
    assert sum(per_node) <= 26, per_node
    assert sum(1 for n in per_node if n) >= 2, "every blob hashed to one node"


def test_token_passes_through_and_health_is_one_nodes(cohort):
    with Client(cohort.proxy.url, headers=AUTH) as client:
        health = client.health()
        assert client.execute(echo_program("t", 0, cohort.ledger)).completed
    node_ids = set()
    for node in cohort.nodes:
        _, _, body = request("GET", node.url + "/health", headers=AUTH)
        node_ids.add(json.loads(body)["instance_id"])
    assert health["instance_id"] in node_ids
    assert health["load"]["request_capacity"] == 1  # one node's, not the cohort's
    with Client(cohort.proxy.url) as client, pytest.raises(KCoralError) as refused:
        client.execute(echo_program("t", 0, cohort.ledger))
    assert refused.value.status_code == 401 and refused.value.kind == "unauthorized"
    status, _, _ = request("GET", cohort.proxy.url + "/health", headers={"Authorization": "Bearer wrong"})
    assert status == 401


def haproxy_config(*args):
    return subprocess.run([PYTHON, "-m", "kcoral", "haproxy-config", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def test_generated_config_is_valid_and_bad_nodes_are_refused(cohort, tmp_path):
    generated = haproxy_config("--listen", "0.0.0.0:8080", "http://10.0.0.5:8000=4", "http://10.0.0.6:8000=2")
    assert generated.returncode == 0, generated.stderr
    path = tmp_path / "haproxy.cfg"
    path.write_text(generated.stdout)
    check = subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert generated.stdout.count("maxconn 4\n") == 2 and generated.stdout.count("maxconn 2\n") == 2
    dead = f"http://127.0.0.1:{free_port()}"
    unreachable = haproxy_config("--listen", "127.0.0.1:8080", dead)
    assert unreachable.returncode == 2 and f"cannot read {dead}/health" in unreachable.stderr
    assert f"{dead}=SLOTS" in unreachable.stderr
    for bad in ("https://10.0.0.5:8000", "http://10.0.0.5", "http://10.0.0.5:8000/x", "http://10.0.0.5:8000=0"):
        refused = haproxy_config("--listen", "127.0.0.1:8080", bad)
        assert refused.returncode == 2 and "node" in refused.stderr, (bad, refused.stderr)
    for flags, message in ((["--listen", "8080"], "expected HOST:PORT"),
                           (["--listen", ":8080", "--token", 'to"ken'], "bearer token"),
                           (["--listen", ":8080", "--queue-timeout", "0"], "positive"),
                           (["--listen", ":8080", "http://10.0.0.5:8000=1"], "listed twice")):
        refused = haproxy_config(*flags, "http://10.0.0.5:8000=1")
        assert refused.returncode == 2 and message in refused.stderr, (flags, refused.stderr)
    from_health = haproxy_config("--listen", "127.0.0.1:8080", "--token", TOKEN, cohort.nodes[0].url)
    assert from_health.returncode == 0 and "maxconn 1\n" in from_health.stdout
    assert f'hdr Authorization "Bearer {TOKEN}"' in from_health.stdout


def test_client_marks_only_requests_with_blobs_by_their_largest_blob(cohort, monkeypatch):
    sent = []
    with Client(cohort.nodes[0].url, headers=AUTH) as client:  # a node directly: it ignores the header
        real = client._request

        def recording(method, path, headers=None, chunks=None, **deadline):
            sent.append((headers or {}).get("X-KCoral-Affinity"))
            return real(method, path, headers, chunks, **deadline)

        monkeypatch.setattr(client, "_request", recording)
        assert client.execute(echo_program("plain", 0, cohort.ledger)).completed
        small, large = os.urandom(1000), os.urandom(3000)
        program = Program()
        source = "def f(a, b):\n    return len(a) + len(b)\n"
        fn = program.get_function(module=program.upload(kind="module", source=source), name="f")
        args = [program.upload(kind="bytes", value=small), program.upload(kind="bytes", value=large)]
        program.return_(key="n", value=program.run(fn=fn, args=args))
        assert client.execute(program)["n"] == 4000
    assert sent[0] is None
    assert sent[1:] and set(sent[1:]) == {hashlib.sha256(large).hexdigest()}, sent
