"""Sharing a box fairly (docs/server.md §1.5, docs/scaling.md): requests whose client left are
stopped, tenants named in --token-file are counted, limited and served in a fair order.

Real servers and a real HAProxy; work is sleep-bound, so wall times measure scheduling.  The
fairness tests use the numbers of the acceptance (tenant A 40 one-second requests, then tenant B
4, 2 slots); A's requests still waiting once B's are done are cancelled by closing their
connections, which keeps each test to a few seconds.
"""

import contextlib
import http.client
import json
import os
import signal
import socket
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
    documented_log_events,
    is_alive,
    join_threads,
    log_records,
    multipart,
    post,
    program_parts,
    proxy_in_front,
    request,
    run_directories,
    scrape_when,
    simple_program,
    wait_for,
)

ALICE, BOB, ANON = "alice-token-1", "bob-token-2", "anonymous-token-3"
TOKENS = f"alice {ALICE}\nbob {BOB}\n{ANON}\n"
OPERATOR = "operator-token-4"  # --metrics-token-file's: /metrics shows every tenant's requests

SLEEPER = """\
import os, subprocess, time
def f(marker, seconds):
    child = subprocess.Popen(["sleep", "120"])
    with open(marker + ".tmp", "w") as out:
        out.write(f"{os.getpid()} {child.pid}")
    os.rename(marker + ".tmp", marker)
    time.sleep(seconds)
    return "slept"
"""
NAP = "import time\ndef f(seconds):\n    time.sleep(seconds)\n    return seconds\n"


def auth(token):
    return {"Authorization": f"Bearer {token}"}


def token_file(tmp_path, text=TOKENS, name="tokens"):
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def operator_flags(tmp_path):
    """The node's --metrics-token-file, holding OPERATOR: the token that reads /metrics."""
    return ["--metrics-token-file", token_file(tmp_path, OPERATOR + "\n", "operator-tokens")]


def open_post(url, program, headers=None):
    """Send a POST /execute on a connection of its own and leave it open -> the socket."""
    body, content_type = multipart(program_parts(program))
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "kcoral", "Content-Type": content_type,
                                                   "Content-Length": str(len(body)), **(headers or {})}.items())
    sock.sendall(f"POST /execute HTTP/1.1\r\n{head}\r\n".encode() + body)
    return sock


def read_answer(sock):
    """The answer on a connection open_post opened -> (status, headers, JSON body)."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())


def hang_up(sock):
    """Close as a client that gives up does (its process exits, say): FIN, nothing more."""
    sock.close()


def sleeper(tmp_path, name, seconds=60):
    marker = str(tmp_path / name)
    return simple_program(SLEEPER, args=[marker, seconds]), marker


def started_pids(marker, timeout=30):
    assert wait_for(lambda: os.path.exists(marker), timeout), "the program never started"
    with open(marker) as f:
        return [int(pid) for pid in f.read().split()]


def load(server, token=BOB):
    status, _, body = request("GET", server.url + "/health", headers=auth(token))
    assert status == 200, body
    return json.loads(body)["load"]


def events(server, name):
    return [line for line in server.log().splitlines() if f" {name} " in line]


def quick_request_seconds(url, headers=None):
    started = time.monotonic()
    status, _, body = post(url, simple_program(NAP, args=[0]), headers=headers, timeout=60)
    assert status == 200 and body["status"] == "COMPLETED", body
    return time.monotonic() - started, body["queue_ms"]


# --- 1. cancel when the client is gone -------------------------------------------------------

def assert_cancelled_while_running(server, url, tmp_path, headers=None):
    """A client hangs up while its program sleeps: within a second its worker tree is gone and
    the next request starts at once on the freed slot."""
    program, marker = sleeper(tmp_path, "running")
    sock = open_post(url, program, headers)
    pids = started_pids(marker)
    hang_up(sock)
    hung_up = time.monotonic()
    assert wait_for(lambda: not any(is_alive(pid) for pid in pids), 5, 0.02), "the worker's processes outlived it"
    gone_after = time.monotonic() - hung_up
    seconds, queue_ms = quick_request_seconds(url, headers)
    print(f"processes gone {gone_after:.2f} s after the hang-up; the next request took {seconds:.2f} s "
          f"(queued {queue_ms:.0f} ms)")
    assert gone_after < 1.5  # within 1 s of the hang-up, plus the kill sweep and this poll
    assert queue_ms < 1000
    assert wait_for(lambda: events(server, "request_cancelled"), 5)
    assert "phase=running" in events(server, "request_cancelled")[0]


def test_disconnect_while_running_stops_the_program(tmp_path):
    with ServerProcess(workers=1, tmp_path=tmp_path) as server:
        assert_cancelled_while_running(server, server.url, tmp_path)
        assert not events(server, "request_finished")[1:]  # only the quick request was answered
        _, _, metrics = request("GET", server.url + "/metrics")
        assert b'kcoral_requests_cancelled_total{phase="running"} 1' in metrics


def test_disconnect_while_queued_never_runs(tmp_path):
    with ServerProcess(workers=1, tmp_path=tmp_path) as server:
        busy, busy_marker = sleeper(tmp_path, "busy", seconds=2)
        first = open_post(server.url, busy)
        started_pids(busy_marker)
        queued, queued_marker = sleeper(tmp_path, "queued")
        second = open_post(server.url, queued)
        assert wait_for(lambda: server.health()["load"]["requests_waiting"] == 1, 10)
        hang_up(second)
        assert wait_for(lambda: server.health()["load"]["requests_waiting"] == 0, 1.5), "still queued"
        assert read_answer(first)[0] == 200
        first.close()
        quick_request_seconds(server.url)
        assert not os.path.exists(queued_marker), "the abandoned request ran"
        assert "phase=queue" in events(server, "request_cancelled")[0]


def test_a_pipelined_request_is_not_a_disconnect(tmp_path):
    """The next request's bytes waiting behind a running one are no end of file: both are answered."""
    with ServerProcess(workers=1, tmp_path=tmp_path) as server:
        sock = open_post(server.url, simple_program(NAP, args=[1.0]))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: kcoral\r\n\r\n")
        answers = b""
        while answers.count(b"HTTP/1.1 200 OK") < 2 or not answers.endswith(b"}"):
            chunk = sock.recv(1 << 16)
            assert chunk, f"the connection closed after {answers!r}"
            answers += chunk
        sock.close()
        assert b'"status":"COMPLETED"' in answers and b'"request_capacity"' in answers
        assert not events(server, "request_cancelled")


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_disconnect_through_haproxy_running_and_queued(tmp_path):
    """Behind the generated HAProxy configuration: a client that leaves while its program runs
    stops it on the node; one that leaves while waiting in HAProxy's queue never reaches a node."""
    with ServerProcess(workers=1, tmp_path=tmp_path) as server, proxy_in_front(server.url, tmp_path) as proxy:
        assert_cancelled_while_running(server, proxy.url, tmp_path)
        busy, busy_marker = sleeper(tmp_path, "busy", seconds=2)
        first = open_post(proxy.url, busy)
        started_pids(busy_marker)
        queued, queued_marker = sleeper(tmp_path, "queued")
        second = open_post(proxy.url, queued)
        queue_length = lambda: sum(int(row["qcur"] or 0) for row in proxy.stats() if row["svname"] == "BACKEND")  # noqa: E731
        assert wait_for(lambda: queue_length() == 1, 10), "the second request is not in HAProxy's queue"
        hang_up(second)
        assert wait_for(lambda: queue_length() == 0, 1.5), "HAProxy kept the abandoned request queued"
        assert read_answer(first)[0] == 200
        first.close()
        quick_request_seconds(proxy.url)
        assert not os.path.exists(queued_marker), "the abandoned request ran"


def test_kcoral_run_interrupted_stops_the_remote_program(tmp_path):
    with ServerProcess(workers=1, tmp_path=tmp_path) as server:
        marker = str(tmp_path / "remote")
        script = tmp_path / "job.py"
        script.write_text(f"import os, subprocess, time\nchild = subprocess.Popen(['sleep', '120'])\n"
                          f"open({marker!r} + '.tmp', 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
                          f"print('started', flush=True)\n"  # the streamed answer has begun
                          f"os.rename({marker!r} + '.tmp', {marker!r})\ntime.sleep(60)\n")
        threads = len(os.listdir(f"/proc/{server.proc.pid}/task"))
        # as from a terminal: a suite started in the background (`&`) inherits SIGINT ignored, and
        # Python keeps an ignored SIGINT ignored, which would make this Ctrl+C a no-op
        run = subprocess.Popen([PYTHON, "-m", "kcoral", "run", "python", "--url", server.url, "--send", str(script),
                                "--", "job.py"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        pids = started_pids(marker)
        run.send_signal(signal.SIGINT)  # Ctrl+C
        _, stderr = run.communicate(timeout=30)
        interrupted = time.monotonic()
        assert run.returncode == 130 and "interrupted" in stderr, stderr
        assert wait_for(lambda: not any(is_alive(pid) for pid in pids), 5, 0.02), "the remote program outlived kcoral run"
        print(f"remote processes gone {time.monotonic() - interrupted:.2f} s after kcoral run exited")
        assert time.monotonic() - interrupted < 1.5
        assert wait_for(lambda: events(server, "request_cancelled"), 5)
        # the streamed answer's sender thread, among others, is gone too
        assert wait_for(lambda: len(os.listdir(f"/proc/{server.proc.pid}/task")) <= threads, 10)


# --- 2. tenants: named tokens, their counts and limits ------------------------------------------

def test_named_tokens_tenant_counts_and_labels(tmp_path):
    log_dir = tmp_path / "logs"
    with ServerProcess("--token-file", token_file(tmp_path), "--log-dir", str(log_dir), *operator_flags(tmp_path),
                       workers=1, tmp_path=tmp_path) as server:
        # a name is a label, never a token
        assert request("GET", server.url + "/health", headers=auth("alice"))[0] == 401
        sock = open_post(server.url, simple_program(NAP, args=[1.0]), auth(ALICE))
        assert wait_for(lambda: load(server, ALICE)["tenant"] == {"name": "alice", "requests_running": 1,
                                                                  "requests_waiting": 0}, 10)
        bob_health = json.loads(request("GET", server.url + "/health", headers=auth(BOB))[2])
        assert bob_health["load"]["tenant"] == {"name": "bob", "requests_running": 0, "requests_waiting": 0}
        assert "tenant" not in json.loads(request("GET", server.url + "/health", headers=auth(ANON))[2])["load"]
        _, _, metrics = request("GET", server.url + "/metrics", headers=auth(OPERATOR))
        assert b'kcoral_tenant_requests_running{tenant="alice"} 1' in metrics
        assert b'kcoral_tenant_requests_waiting{tenant="bob"} 0' in metrics
        assert read_answer(sock)[0] == 200
        sock.close()
        quick_request_seconds(server.url, auth(ANON))
        anonymous = 'kcoral_requests_total{status="COMPLETED",code="200",kind=""} 1'
        metrics = scrape_when(server.url, lambda text: anonymous in text, auth(OPERATOR))
        assert 'kcoral_requests_total{status="COMPLETED",code="200",kind="",tenant="alice"} 1' in metrics
        assert anonymous in metrics
        left = open_post(server.url, simple_program(NAP, args=[30]), auth(BOB))
        assert wait_for(lambda: load(server)["tenant"]["requests_running"] == 1, 10)
        hang_up(left)
        [run_dir] = run_directories(log_dir)
        assert wait_for(lambda: [r for r in log_records(run_dir) if r["event"] == "request_cancelled"], 5)
    records = {event: [r for r in log_records(run_dir) if r["event"] == event]
               for event in ("request_finished", "request_cancelled")}
    assert [record["tenant"] for record in records["request_finished"]] == ["alice", None]
    assert [(r["tenant"], r["phase"]) for r in records["request_cancelled"]] == [("bob", "running")]
    documented = documented_log_events(os.path.join(ROOT, "docs", "server.md"))
    for record in records["request_finished"] + records["request_cancelled"]:
        levels, fields, optional = documented[record["event"]]
        assert record["level"] in levels and fields <= set(record) - {"timestamp", "level", "event"} <= fields | optional


def test_bare_token_file_serves_as_before(tmp_path):
    """No names: no tenant in /health, no tenant label, one first-come queue."""
    with ServerProcess("--token-file", token_file(tmp_path, f"{ALICE}\n{BOB}\n"), workers=1,
                       tmp_path=tmp_path) as server:
        quick_request_seconds(server.url, auth(ALICE))
        assert "tenant" not in json.loads(request("GET", server.url + "/health", headers=auth(BOB))[2])["load"]
        counted = 'kcoral_requests_total{status="COMPLETED",code="200",kind=""} 1'
        metrics = scrape_when(server.url, lambda text: counted in text, auth(BOB))
        assert counted in metrics
        assert "tenant=" not in metrics


@pytest.mark.parametrize("text, fragment", [
    ("alice tok-1 extra\n", "line 1: expected TOKEN or NAME TOKEN"),
    ("9lives tok-1\n", "line 1: expected TOKEN or NAME TOKEN"),
    ("alice tok-1\nbob tok-1\n", "line 2: the token is given twice, with different names"),
    ("alice tok-1\ntok-2\nalice\n", "a tenant's name in --token-file is also a token"),
    ("alice bad,token\n", "line 1: not a bearer token"),
    ("\n\n", "holds no token"),
])
def test_token_file_errors_name_the_line(tmp_path, text, fragment):
    result = subprocess.run([PYTHON, "-m", "kcoral", "--token-file", token_file(tmp_path, text), "--device", "cpu",
                             "--port", "0", "--log-dir", ""],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and fragment in result.stderr, result.stderr
    assert "tok-1" not in result.stderr  # the file's secrets are never echoed


def test_per_tenant_limits(tmp_path):
    """--max-waiting-per-tenant: 429 with Retry-After naming the flag; --max-running-per-tenant:
    a tenant at its limit waits while another tenant's request takes the free slot."""
    with ServerProcess("--token-file", token_file(tmp_path), "--max-waiting-per-tenant", "1",
                       "--max-running-per-tenant", "1", *operator_flags(tmp_path), workers=2, tmp_path=tmp_path) as server:
        running, marker = sleeper(tmp_path, "alice-running", seconds=2)
        first = open_post(server.url, running, auth(ALICE))
        started_pids(marker)
        waiting = open_post(server.url, simple_program(NAP, args=[0]), auth(ALICE))
        assert wait_for(lambda: load(server)["requests_waiting"] == 1, 10)  # a free slot, but alice's limit
        status, headers, body = post(server.url, simple_program(NAP, args=[0]), headers=auth(ALICE))
        assert (status, body["error"]["kind"], headers.get("retry-after")) == (429, "busy", "1"), body
        assert "--max-waiting-per-tenant" in body["error"]["message"] and "alice" in body["error"]["message"]
        seconds, queue_ms = quick_request_seconds(server.url, auth(BOB))  # bob takes the second slot at once
        assert queue_ms < 500, queue_ms
        assert read_answer(first)[0] == 200
        status, _, body = read_answer(waiting)
        assert status == 200 and body["queue_ms"] > 1000  # it waited for alice's first request
        first.close()
        waiting.close()
        _, _, metrics = request("GET", server.url + "/metrics", headers=auth(OPERATOR))
        assert b'kcoral_requests_total{status="ERROR",code="429",kind="busy",tenant="alice"} 1' in metrics


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_generated_proxy_config_orders_tenants_only_when_named(tmp_path):
    def generate(text):
        result = subprocess.run([PYTHON, "-m", "kcoral", "haproxy-config", "--listen", "127.0.0.1:8080",
                                 "--token-file", token_file(tmp_path, text), "http://10.0.0.5:8000=2"],
                                cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
        path = tmp_path / "haproxy.cfg"
        path.write_text(result.stdout)
        check = subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        return result.stdout
    named = generate(TOKENS)
    for line in (f'set-var(txn.tenant) str(alice) if {{ req.fhdr(authorization,1) -m str "Bearer {ALICE}" }}',
                 f'set-var(txn.tenant) str(bob) if {{ req.fhdr(authorization,1) -m str "Bearer {BOB}" }}',
                 "set-var(txn.tenant) str(-) unless { var(txn.tenant) -m found }",
                 "track-sc1 var(txn.tenant) table kcoral_tenants", "set-priority-class sc1_trackers",
                 "backend kcoral_tenants", "option abortonclose"):
        assert line in named, line
    assert f'"Bearer {ANON}"' in named  # accepted, anonymous
    bare = generate(f"{ALICE}\n{BOB}\n")
    assert "option abortonclose" in bare
    # no tenant rules without names (the log line's tenant= then reads "-")
    assert "set-var(txn.tenant)" not in bare and "kcoral_tenants" not in bare and "priority" not in bare


# --- 3. fair order, measured ---------------------------------------------------------------

def test_fair_queue_order():
    """The pool's queue on its own: a backlog's later requests wait behind a newcomer's first ones,
    each tenant stays first come, first served, and a tenant at its running limit is passed over."""
    from kcoral import FairQueue
    queue, running = FairQueue(), {"a": 2, "b": 0}
    a = [queue.add("a", running["a"]) for _ in range(5)]  # ranks 2..6
    b = [queue.add("b", running["b"]) for _ in range(3)]  # ranks 0..2
    served = []
    while len(queue):
        ticket = queue.first(lambda tenant: True)
        served.append(ticket)
        queue.remove(ticket)
    assert served == [b[0], b[1], a[0], b[2], *a[1:]]
    queue = FairQueue()
    c = queue.add("c", 0)
    d = queue.add("d", 1)
    assert queue.first(lambda tenant: True) is c and queue.first(lambda tenant: tenant != "c") is d
    assert (queue.waiting("c"), queue.waiting("e"), len(queue)) == (1, 0, 2)


class Submitter:
    """Requests of one tenant, each on a connection of its own, timed from submission to answer."""

    def __init__(self, url, token, count, seconds):
        self.url, self.headers = url, auth(token)
        self.sockets, self.results, self.threads = [], {}, []
        self.submitted = time.monotonic()
        for number in range(count):
            sock = open_post(url, simple_program(NAP, args=[seconds]), self.headers)
            sent = time.monotonic()
            self.sockets.append(sock)
            thread = threading.Thread(target=self.wait, args=(number, sock, sent), daemon=True)
            thread.start()
            self.threads.append(thread)

    def wait(self, number, sock, sent):
        try:
            status, _, body = read_answer(sock)
            self.results[number] = (status, body.get("queue_ms"), time.monotonic() - sent)
        except (OSError, http.client.HTTPException):
            pass

    def finish_times(self):
        return sorted(result[2] for result in self.results.values())

    def queue_seconds(self):
        return [round(result[1] / 1e3, 1) for _, result in sorted(self.results.items())]

    def cancel(self):
        """Give up on the requests still unanswered: close each connection (a reader thread still
        holds its file, so close() alone would leave it open)."""
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def measure_fairness(url, health):
    """Tenant A sends 40 one-second requests, then (once they are queued) tenant B sends 4 ->
    (B's HTTP statuses, B's finish times in seconds from each one's submission); prints the
    waits of each tenant."""
    a = Submitter(url, ALICE, 40, 1.0)
    assert wait_for(lambda: health() >= 38, 20), "alice's requests did not all arrive"
    b = Submitter(url, BOB, 4, 1.0)
    try:
        join_threads(b.threads, 60)
    finally:
        a.cancel()
    print(f"A (40 x 1 s): {len(a.results)} answered while B ran, waits {a.queue_seconds()} s")
    print(f"B (4 x 1 s): finished {[round(t, 2) for t in b.finish_times()]} s after submission, "
          f"waits {b.queue_seconds()} s")
    return [result[0] for result in b.results.values()], b.finish_times()


def test_fair_order_on_one_node(tmp_path):
    with ServerProcess("--token-file", token_file(tmp_path), workers=2, tmp_path=tmp_path) as server:
        def in_flight():
            alice = load(server, ALICE)["tenant"]
            return alice["requests_running"] + alice["requests_waiting"]
        statuses, finished = measure_fairness(server.url, in_flight)
        assert statuses == [200] * 4
        assert len(finished) == 4 and finished[0] < 3, finished  # B's first: behind one request per slot at most
        assert finished[-1] < 6, finished  # and all of them long before A's 20 s
        assert wait_for(lambda: load(server)["requests_waiting"] == 0, 3)  # A's gave up: cancelled
        # each logged by its own handler thread once out of the queue: the last ones may lag
        assert wait_for(lambda: len(events(server, "request_cancelled")) >= 30, 10), events(server, "request_cancelled")


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_fair_order_through_a_cohort(tmp_path):
    """Two one-slot nodes behind the generated HAProxy: its queue orders by the tenant's requests in
    flight (set-priority-class), so B's requests pass A's queued ones there too."""
    tokens = token_file(tmp_path)
    nodes = [ServerProcess("--token-file", tokens, workers=1, tmp_path=tmp_path / f"node{i}") for i in range(2)]
    proxy = HAProxyProcess([f"{n.url}=1" for n in nodes], tmp_path, flags=["--token-file", tokens])
    try:
        def in_proxy():
            backend = proxy.row("kcoral_spread")
            return int(backend["scur"] or 0) + int(backend["qcur"] or 0)
        statuses, finished = measure_fairness(proxy.url, in_proxy)
        assert statuses == [200] * 4
        assert len(finished) == 4 and finished[0] < 3, finished  # B's first: behind one request per slot at most
        assert finished[-1] < 6, finished  # and all of them long before A's 20 s
    finally:
        proxy.stop()
        for node in nodes:
            node.stop()
