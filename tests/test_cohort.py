"""A cohort: three real nodes (1 CPU worker each, bearer token on) behind a real HAProxy that
runs the configuration `python -m kcoral haproxy-config` generates.  Each test measures one
promise of that configuration: scaling, queueing instead of refusal, failover when a node is
killed, drain on SIGTERM, rejoin, blob affinity, token pass-through.

Work is sleep-bound (the box has two shared cores), so wall times measure scheduling, not CPU.
"""

import collections
import hashlib
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import threading
import time

import pytest

from client import Client, KCoralError, Program
from tests.support import (
    HAPROXY,
    PYTHON,
    ROOT,
    HAProxyProcess,
    ServerProcess,
    assert_proxy_error_body,
    echo_program,
    free_port,
    join_threads,
    ledger_runs,
    multipart,
    prog,
    program_parts,
    request,
    run_echo,
    wait_for,
)

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")

TOKEN = "cohort-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NODES = 3
class Cohort:
    """The nodes, the proxy, and the per-node count of POSTs each node has answered."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.ledger = str(workdir / "ledger")
        self.nodes = [self.start_node(free_port()) for _ in range(NODES)]
        self.proxy = HAProxyProcess([n.url for n in self.nodes], workdir, token=TOKEN)
        assert wait_for(self.all_up, 20, 0.1), "the proxy never saw every node up"

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
            join_threads(threads, 60)
        return all(after > b for after, b in zip(self.posts(), before, strict=True))

    def close(self):
        self.proxy.stop()
        for node in self.nodes:
            node.stop()




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
    deadline = started + 300
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        if during:
            during(time.monotonic() - started)
        time.sleep(0.05)  # the pace of `during`'s chaos and sampling, not a synchronisation
    join_threads(threads, 10)
    wall = time.monotonic() - started
    return outcomes, wall, ledger_runs(cohort.ledger, tag)


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
    assert wait_for(lambda: cohort.all_up() and cohort.posts()[victim] > events["posts at restart"], 10, 0.1), \
        "the restarted node never served"
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
    assert wait_for(cohort.all_up, 15, 0.1), "the drained node did not rejoin"


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


def test_unauthenticated_requests_are_refused_at_the_proxy(cohort):
    """No token, a wrong one, a right one behind a wrong first header: 401 unauthorized from
    HAProxy itself (its log says <NOSRV>; a node's answer would name its instance), and no
    node saw them. The same request sent to a node directly shows what a node's 401 looks like."""
    program, content_type = multipart(program_parts(prog()))
    attempts = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"bearer {TOKEN}"}]
    before, proxied_before = cohort.posts(), cohort.proxy.log().count("kcoral/<NOSRV>")
    answers = [request("POST", cohort.proxy.url + "/execute", program, {"Content-Type": content_type, **headers})
               for headers in attempts]
    answers.append(raw_request(cohort.proxy.port, "GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer no\r\n"
                                                  f"Authorization: Bearer {TOKEN}\r\n\r\n"))
    for status, headers, body in answers:
        assert_proxy_error_body(status, headers, body, 401, "unauthorized", "bearer token")
        assert headers["www-authenticate"] == "Bearer"
    assert wait_for(lambda: cohort.proxy.log().count("kcoral/<NOSRV>") >= proxied_before + 4, 5, 0.1), \
        "HAProxy logged no refusal"
    assert cohort.posts() == before
    node_status, node_headers, _ = request("POST", cohort.nodes[0].url + "/execute", program,
                                           {"Content-Type": content_type})
    assert node_status == 401 and "x-kcoral-instance" in node_headers


def raw_request(port, head, source="127.0.0.1"):
    """Send a request head byte for byte (repeated headers included) -> (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as sock:
        sock.sendall(head.encode())
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def test_a_connection_flood_from_one_address_is_cut_at_its_limit_and_others_are_served(cohort):
    """300 connections from 127.0.0.2 against the default limit of 256 per address: 44 are
    closed on arrival, the 256 kept are served, and meanwhile a normal client (127.0.0.1)
    runs a program as fast as ever."""
    limit, flood = 256, 300
    alone = timed_echo(cohort, "alone")
    made = [connect_from("127.0.0.2", cohort.proxy.port) for _ in range(flood)]
    sockets = [sock for sock in made if sock is not None]

    def refused():
        return flood - len(sockets) + len(closed_by_peer(sockets))

    try:
        assert wait_for(lambda: refused() >= flood - limit, 10), f"{refused()} of {flood} connections closed on arrival"
        assert refused() == flood - limit, f"{refused()} of {flood} connections closed on arrival"
        kept = [sock for sock in sockets if sock not in closed_by_peer(sockets)]
        normal = timed_echo(cohort, "meanwhile")
        for sock in kept:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        served = collections.Counter(read_status(sock) for sock in kept)
        one_more = connect_from("127.0.0.2", cohort.proxy.port)
        if one_more is not None:
            sockets.append(one_more)
            assert wait_for(lambda: closed_by_peer([one_more]), 10), "a connection beyond the limit was kept"
        print(f"\nflood: {flood - len(kept)} of {flood} connections from one address closed on arrival, "
              f"the {len(kept)} kept answered {dict(served)}; a normal client's execute took {normal * 1000:.0f} ms "
              f"({alone * 1000:.0f} ms before the flood)")
        assert served == {200: limit}
        assert normal < 5
    finally:
        for sock in sockets:
            sock.close()


def timed_echo(cohort, value):
    """Seconds one authenticated client (127.0.0.1) takes to run an echo through the proxy."""
    started = time.monotonic()
    with Client(cohort.proxy.url, headers=AUTH) as client:
        assert client.execute(echo_program(value, 0, cohort.ledger))["out"] == value
    return time.monotonic() - started


def connect_from(source, port):
    """A connection from address ``source`` to the proxy, or None when the proxy reset it
    before connect() returned (a refusal, as much as a close right after it)."""
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    except ConnectionResetError:
        return None


def closed_by_peer(sockets):
    """The sockets the other end has closed (readable, with nothing to read)."""
    poller = select.poll()
    by_fd = {s.fileno(): s for s in sockets}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    found = []
    for fd, _ in poller.poll(0):
        try:
            if by_fd[fd].recv(1, socket.MSG_PEEK) == b"":
                found.append(by_fd[fd])
        except ConnectionResetError:
            found.append(by_fd[fd])
    return found


def read_status(sock):
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response.status


@pytest.fixture
def strict_proxy(cohort):
    """A second HAProxy in front of the same nodes with small limits, to reach them quickly."""
    proxy = HAProxyProcess([n.url for n in cohort.nodes], cohort.workdir, token=TOKEN,
                           flags=["--max-requests-per-source", "20", "--header-timeout", "1"])
    assert wait_for(lambda: request("GET", proxy.url + "/health", headers=AUTH, timeout=5)[0] == 200, 20, 0.1), \
        "the strict proxy never saw a node up"
    try:
        yield proxy
    finally:
        proxy.stop()


def test_requests_beyond_the_rate_limit_get_429_and_other_addresses_do_not(strict_proxy):
    """40 health requests in a burst from 127.0.0.2, with a limit of 20 per 10 s: 20 are served,
    the rest answered 429 busy by the proxy; a client on 127.0.0.1 is still served."""
    head = f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    answers = [raw_request(strict_proxy.port, head, source="127.0.0.2") for _ in range(40)]
    statuses = collections.Counter(status for status, _, _ in answers)
    print(f"\nrate: 40 requests in a burst from one address with a limit of 20 per 10 s: {dict(statuses)}")
    assert statuses == {200: 20, 429: 20}
    status, headers, body = answers[-1]
    assert_proxy_error_body(status, headers, body, 429, "busy", "more than 20 requests in 10 s")
    assert headers["retry-after"] == "10"
    with Client(strict_proxy.url, headers=AUTH) as client:
        assert client.health()["status"] == "ok"


@pytest.mark.parametrize("pace", [None, 0.2])
def test_a_request_head_must_arrive_within_the_header_timeout(strict_proxy, pace):
    """A head never finished, or trickled a byte every 200 ms (which an inactivity timeout would
    never end): closed with 408 after the 1 s header timeout."""
    with socket.create_connection(("127.0.0.1", strict_proxy.port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        if pace:
            sock.setblocking(False)
            while not select.select([sock], [], [], pace)[0]:  # paces the attack, and watches for the answer
                sock.send(b"X")
            sock.setblocking(True)
        answer = sock.recv(65536)
        took = time.monotonic() - started
    print(f"\nheader timeout (trickle {pace}): answered {answer[:12]!r} after {took:.2f} s")
    assert answer.startswith(b"HTTP/1.1 408")  # (HAProxy's own page: its H1 layer sends no custom 408 body)
    assert 0.9 < took < 3


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
    assert "warning: no token" in generated.stderr and "http-request return status 401" not in generated.stdout
    for line in ("timeout http-request 20s", "timeout http-keep-alive 15s", "sc_conn_cur(0) gt 256",
                 "sc_http_req_rate(2) gt 1000"):
        assert line in generated.stdout, line
    tuned = haproxy_config("--listen", "0.0.0.0:8080", "--token", TOKEN, "--header-timeout", "2.5",
                           "--max-connections-per-source", "9", "--max-requests-per-source", "70",
                           "http://10.0.0.5:8000=4")
    assert tuned.returncode == 0 and tuned.stderr == "", tuned.stderr
    path.write_text(tuned.stdout)
    check = subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    for line in ("timeout http-request 2500ms", "sc_conn_cur(0) gt 9", "sc_http_req_rate(2) gt 70",
                 f'req.fhdr(authorization,1) -m str "Bearer {TOKEN}"'):
        assert line in tuned.stdout, line
    dead = f"http://127.0.0.1:{free_port()}"
    unreachable = haproxy_config("--listen", "127.0.0.1:8080", dead)
    assert unreachable.returncode == 2 and f"cannot read {dead}/health" in unreachable.stderr
    assert "no node answered" in unreachable.stderr and "NODE_URL=SLOTS (with the nodes' token" in unreachable.stderr
    for bad in ("https://10.0.0.5:8000", "http://10.0.0.5", "http://10.0.0.5:8000/x", "http://10.0.0.5:8000=0"):
        refused = haproxy_config("--listen", "127.0.0.1:8080", bad)
        assert refused.returncode == 2 and "node" in refused.stderr, (bad, refused.stderr)
    for flags, message in ((["--listen", "8080"], "expected HOST:PORT"),
                           (["--listen", ":8080", "--token", 'to"ken'], "bearer token"),
                           (["--listen", ":8080", "--queue-timeout", "0"], "positive"),
                           (["--listen", ":8080", "--header-timeout", "-1"], "positive"),
                           (["--listen", ":8080", "--max-connections-per-source", "0"], "at least 1"),
                           (["--listen", ":8080", "--max-requests-per-source", "0"], "at least 1"),
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
