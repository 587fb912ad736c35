"""Hostile and slow clients against a real server: each attack of docs/reliability-hostile.md, measured through /proc.

Every attack is an *item* taking a Scale; the CI tests below run them small (and with short
deadlines), `python -m tests.soak --long --only hostile` runs them at full size with the
server's default limits.  Each item returns the figures it measured (threads, fds, PSS, seconds);
the test beside it holds the bounds, and the soak runs that same test at its size.
"""

import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import resource
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import kcoral
from tests.support import (
    cpu_seconds,
    join_threads,
    multipart,
    program_parts,
    request,
    sha256,
    simple_program,
    unaccepted_connections,
    wait_for,
)
from tests.test_reliability import Server, descendants


@dataclasses.dataclass(frozen=True)
class Scale:
    name: str
    slow_headers: int       # connections trickling a header
    trickle_every: float    # seconds between their bytes
    header_timeout: float   # the server's --header-timeout-seconds (None: default)
    max_connections: int    # the server's --max-connections for the header attack
    idle_connections: int   # connections opened against an fd limit of 256
    uploads: int            # concurrent uploads of distinct blobs ...
    upload_mib: int         # ... of this size
    cache_mib: int          # --cache-capacity-bytes of that server
    budget_mib: int         # --max-body-bytes-in-flight (0: default)
    big_headers: int        # connections sending 98 header lines of 64 KB
    rate_window: float      # --body-rate-window-seconds
    rate_min: int           # --body-rate-min-bytes
    response_mib: int       # size of the response nobody reads
    send_timeout: float     # --send-timeout-seconds
    mid_header_closes: int  # clients closing mid-header


CI = Scale("ci", slow_headers=40, trickle_every=0.5, header_timeout=2.0, max_connections=24, idle_connections=300,
           uploads=8, upload_mib=24, cache_mib=64, budget_mib=48, big_headers=12, rate_window=2.0,
           rate_min=16 << 10, response_mib=32, send_timeout=2.0, mid_header_closes=200)
LONG = Scale("long", slow_headers=1000, trickle_every=3.0, header_timeout=0, max_connections=0,
             idle_connections=371, uploads=12, upload_mib=200, cache_mib=256, budget_mib=0, big_headers=50,
             rate_window=0, rate_min=0, response_mib=100, send_timeout=0, mid_header_closes=1300)


def flags(**values):
    """Server flags for the values that are set (0/None: the server's default)."""
    out = []
    for name, value in values.items():
        if value:
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


def pss_kib(pids):
    """Proportional set size of processes: shared pages (forked workers) count once overall."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:
            pass
    return total


def tree_pss_kib(server):
    return pss_kib([server.pid, *descendants(server.pid)])


def health_seconds(server, timeout=60):
    started = time.monotonic()
    status, _, _ = request("GET", server.url + "/health", timeout=timeout)
    assert status == 200
    return time.monotonic() - started


def ok_execute(server, value=1, timeout=120):
    started = time.monotonic()
    body, content_type = multipart(program_parts(simple_program("def f(x):\n    return x\n", args=[value])))
    status, _, data = request("POST", server.url + "/execute", body, {"Content-Type": content_type}, timeout)
    assert status == 200 and json.loads(data)["results"]["out"]["value"] == value, data[:300]
    return time.monotonic() - started


def read_response(sock, timeout=30):
    """Everything the server sends until it closes -> bytes (raises on a timeout)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def status_of(data):
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None


def error_kind(data):
    return json.loads(data.partition(b"\r\n\r\n")[2])["error"]["kind"]


def connect(port, timeout=30):
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def log_lines(server, word):
    return [line for line in server.log().splitlines() if word in line]


# --- 1. headers trickling in -----------------------------------------------------------------

def slow_headers_item(scale, workdir):
    """Connections sending their request head a byte at a time -> how many the server closed and
    when, the most of the head one sent, the server's threads before and at the peak, how long
    /health took meanwhile, the tracebacks it logged, its exit code."""
    server = Server(workdir, *flags(header_timeout_seconds=scale.header_timeout,
                                    max_connections=scale.max_connections))
    figures = {}
    try:
        base_threads = server.threads()
        head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 4000 + b"\r\n\r\n"
        socks, sent, closed_at = [], collections.Counter(), {}
        started = time.monotonic()
        for _ in range(scale.slow_headers):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", server.port))
            socks.append(s)
        peak_threads, health_s = 0, None
        deadline = started + 120
        while len(closed_at) < len(socks) and time.monotonic() < deadline:
            for i, s in enumerate(socks):
                if i in closed_at:
                    continue
                try:
                    if s.recv(1 << 16) is not None:  # answered (408) or closed: the connection is over
                        closed_at[i] = time.monotonic() - started
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    closed_at[i] = time.monotonic() - started
                    continue
                try:
                    s.send(head[sent[i]:sent[i] + 1])
                    sent[i] += 1
                except (BlockingIOError, OSError):
                    pass
            peak_threads = max(peak_threads, server.threads())
            if health_s is None and time.monotonic() - started > scale.trickle_every:
                health_s = health_seconds(server)
            time.sleep(scale.trickle_every)  # the trickling client's pace
        for s in socks:
            s.close()
        figures |= {"connections": len(socks), "closed": len(closed_at), "head bytes": len(head),
                    "most head bytes sent": max(sent.values()), "peak threads": peak_threads,
                    "threads before": base_threads, "threads after": server.threads(),
                    "last connection closed after s": max(closed_at.values(), default=None),
                    "/health during attack s": health_s, "tracebacks": log_lines(server, "Traceback")}
    finally:
        figures["exit code"] = server.stop()
    return figures


def test_slow_headers(tmp_path, record_property, scale=CI):
    """Connections sending their request head a byte at a time: cut at the header deadline
    (408), threads bounded by --max-connections, /health answered meanwhile."""
    got = slow_headers_item(scale, str(tmp_path))
    record_property("figures", got)
    assert got["closed"] == got["connections"], f"{got['connections'] - got['closed']} trickling connections still open"
    assert got["most head bytes sent"] < got["head bytes"], "a trickling client finished its head"
    max_connections = scale.max_connections or 1024
    assert got["peak threads"] <= got["threads before"] + max_connections + 4, got
    # each connection is cut at its deadline; those waiting for a slot get theirs after accept
    rounds = -(-got["connections"] // max_connections)
    assert got["last connection closed after s"] <= rounds * ((scale.header_timeout or 20.0) + 2) + 10, got
    assert got["/health during attack s"] is not None, got
    assert got["tracebacks"] == [], got
    assert got["exit code"] == 0, got


# --- 2. fd limit reached ---------------------------------------------------------------------------

def fd_limit_item(scale, workdir):
    """With the fd limit at 256, more idle connections than fds -> the server's share of a core
    over 3 s once every connection was accepted or shed, how long /health and /execute took."""
    server = Server(workdir)
    socks, figures = [], {}
    try:
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (256, 256))
        for _ in range(scale.idle_connections):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", server.port))
            socks.append(s)
        # the accept burst is over once no connection waits to be accepted (in the backlog, or a
        # SYN the full backlog dropped, sent again after 1 s, 3 s, ...): the server took or shed each
        assert wait_for(lambda: unaccepted_connections(server.port) == 0, 60, 0.05), \
            f"{unaccepted_connections(server.port)} connections never accepted"
        cpu0, t0 = cpu_seconds(server.pid), time.monotonic()
        health_s = health_seconds(server)
        execute_s = ok_execute(server)
        # not a synchronisation: the window the CPU share is measured over (a spinning accept loop
        # shows only as CPU time going by)
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
        cpu_share = (cpu_seconds(server.pid) - cpu0) / (time.monotonic() - t0)
        figures |= {"idle connections": len(socks), "fd limit": 256, "server fds": server.fds(),
                    "server CPU share": cpu_share, "/health s": health_s, "/execute s": execute_s}
    finally:
        for s in socks:
            s.close()
        figures["exit code"] = server.stop()
    return figures


def test_fd_limit(tmp_path, record_property, scale=CI):
    """With more idle connections than fds, the accept loop does not spin and /health and /execute
    keep being answered."""
    got = fd_limit_item(scale, str(tmp_path))
    record_property("figures", got)
    assert got["server CPU share"] < 0.5, f"server used {got['server CPU share']:.0%} of a core with idle connections"
    assert got["/health s"] < 20 and got["/execute s"] < 30, got
    assert got["exit code"] == 0, got


# --- 3. many concurrent large uploads --------------------------------------------------------

def uploads_item(scale, workdir):
    """Concurrent uploads of distinct blobs -> their answers, the server tree's peak PSS increase
    over the idle server's, the exit code."""
    budget = scale.budget_mib << 20
    server = Server(workdir, "--cache-capacity-bytes", str(scale.cache_mib << 20),
                    *flags(max_body_bytes_in_flight=budget))
    source = "def f(data):\n    return len(data)\n"
    figures = {}
    try:
        server.wait_idle()  # every worker started: the baseline holds them all
        before = tree_pss_kib(server)
        peak, stop = [before], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], tree_pss_kib(server))
                time.sleep(0.05)  # the sampling rate, not a synchronisation

        answers = []

        def upload(i):
            blob = hashlib.sha256(b"%d" % i).digest() * ((scale.upload_mib << 20) // 32)
            program = {"instructions": [
                {"op": "upload", "id": "m", "kind": "module", "source": source},
                {"op": "upload", "id": "b", "kind": "bytes", "blob": sha256(blob)},
                {"op": "get_function", "id": "fn", "module": {"$ref": "m"}, "name": "f"},
                {"op": "run", "id": "r", "fn": {"$ref": "fn"}, "args": [{"$ref": "b"}]},
                {"op": "return", "key": "out", "value": {"$ref": "r"}}]}
            body, content_type = multipart(program_parts(program, [blob]))
            del blob
            status, _, data = request("POST", server.url + "/execute", body, {"Content-Type": content_type}, 600)
            answers.append((status, json.loads(data).get("results") if status == 200 else data[:200]))

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        threads = [threading.Thread(target=upload, args=(i,)) for i in range(scale.uploads)]
        for t in threads:
            t.start()
        join_threads(threads, 600)  # the uploads' own request timeout
        seconds = time.monotonic() - started
        stop.set()
        join_threads([sampler], 30)
        server.wait_idle()  # the replaced workers are back
        after = tree_pss_kib(server)
        figures |= {"uploads": f"{scale.uploads} x {scale.upload_mib} MiB", "answers": answers,
                    "peak PSS increase MiB": (peak[0] - before) / 1024,
                    "PSS after MiB": round((after - before) / 1024), "seconds": round(seconds, 1)}
    finally:
        figures["exit code"] = server.stop()
    return figures


def test_uploads(tmp_path, record_property, scale=CI):
    """Concurrent uploads of distinct blobs: every request is answered, and the server tree's PSS
    stays bounded by the in-flight body budget (not the number of uploads)."""
    got = uploads_item(scale, str(tmp_path))
    record_property("figures", {**got, "answers": collections.Counter(status for status, _ in got["answers"])})
    size = (scale.upload_mib << 20) // 32 * 32
    assert [a for a in got["answers"] if a != (200, {"out": {"type": "integer", "value": size}})] == [], got["answers"]
    in_flight = ((scale.budget_mib << 20) or 768 << 20) >> 20
    # admitted bodies, the memory cache, one blob per worker (it reads its copy), some slack
    bound = in_flight + scale.cache_mib + 2 * scale.upload_mib + 64
    assert got["peak PSS increase MiB"] <= bound, f"peak PSS +{got['peak PSS increase MiB']:.0f} MiB > {bound} MiB"
    assert got["exit code"] == 0, got


# --- 4. huge header blocks -----------------------------------------------------------------

def big_headers_item(scale, workdir):
    """Connections sending 98 header lines of 64 KB -> the answers' statuses and the error kinds of
    the 431s, the server tree's peak PSS increase, the exit code."""
    server = Server(workdir)
    figures = {}
    try:
        before = tree_pss_kib(server)
        line = b"X-Big: " + b"a" * (64000 - 9) + b"\r\n"
        results, peak = [], [before]

        def attack():
            with connect(server.port) as s:
                s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\n")
                try:
                    for _ in range(98):
                        s.sendall(line)
                except OSError:
                    pass  # the server answered and closed
                results.append(read_response(s))

        threads = [threading.Thread(target=attack) for _ in range(scale.big_headers)]
        started = time.monotonic()
        for t in threads:
            t.start()
        deadline = started + 120
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            peak[0] = max(peak[0], tree_pss_kib(server))
            time.sleep(0.05)  # the sampling rate, not a synchronisation
        join_threads(threads, 10)
        seconds = time.monotonic() - started
        figures |= {"connections": len(threads), "answers": collections.Counter(status_of(r) for r in results),
                    "431 error kinds": collections.Counter(error_kind(r) for r in results if status_of(r) == 431),
                    "peak PSS increase MiB": (peak[0] - before) / 1024, "seconds": round(seconds, 1),
                    "/health after s": health_seconds(server)}
    finally:
        figures["exit code"] = server.stop()
    return figures


def test_big_headers(tmp_path, record_property, scale=CI):
    """431 once 64 KiB of header arrived, little memory held, the server answering after."""
    got = big_headers_item(scale, str(tmp_path))
    record_property("figures", got)
    assert got["answers"][431] >= got["connections"] * 0.9, got  # a reset may eat the odd answer
    assert set(got["431 error kinds"]) <= {"parse"}, got
    assert got["peak PSS increase MiB"] < 64, got
    assert got["exit code"] == 0, got


# --- 5. slow bodies ------------------------------------------------------------------------------

def slow_body_item(scale, workdir):
    """A body trickling at 1 KiB/s, then a slow but honest one (twice the minimum rate) -> the
    first's answer and when it came, the second's answer, the exit code."""
    window = scale.rate_window or 30.0
    minimum = scale.rate_min or 64 << 10
    # the whole-body average at the window's own rate: "twice the minimum" is honest by both rules
    server = Server(workdir, *flags(body_rate_window_seconds=scale.rate_window, body_rate_min_bytes=scale.rate_min,
                                    body_min_average_bytes_per_second=int(minimum / window)))
    figures = {}
    try:
        body, content_type = multipart(program_parts(simple_program("def f(x):\n    return x\n", args=[1])))
        head = (f"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {200 << 20}\r\n\r\n").encode()
        started = time.monotonic()
        with connect(server.port, timeout=5 * window) as s:
            s.sendall(head)
            answer = b""
            while time.monotonic() - started < 3 * window:
                try:
                    s.sendall(b"x" * 1024)
                except OSError:
                    break
                readable, _, _ = select.select([s], [], [], 1.0)
                if readable:
                    answer = read_response(s)
                    break
            cut_s = time.monotonic() - started
        figures |= {"trickle 1 KiB/s answer": status_of(answer), "trickle answer head": answer[:200],
                    "trickle 1 KiB/s cut after s": cut_s}
        # honest: the real request with an epilogue, sent at twice the minimum rate for 1.5 windows
        rate = 2 * minimum / window
        padded = body + b"e" * int(rate * window * 1.5)
        t0 = time.monotonic()
        with connect(server.port, timeout=5 * window) as s:
            head = (f"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(padded)}\r\nConnection: close\r\n\r\n").encode()
            s.sendall(head)
            piece = max(1, int(rate / 4))
            for i in range(0, len(padded), piece):
                s.sendall(padded[i:i + piece])
                time.sleep(0.25)  # the honest client's pace
            honest_answer = read_response(s)
        figures |= {f"honest body at {rate / 1024:.0f} KiB/s": status_of(honest_answer),
                    "honest answer head": honest_answer[:300], "honest answered after s": time.monotonic() - t0}
    finally:
        figures["exit code"] = server.stop()
    return figures


def test_slow_body(tmp_path, record_property, scale=CI):
    """A body trickling at 1 KiB/s is cut with 408 within two rate windows; a slow but honest
    one (well above the minimum rate) is not."""
    got = slow_body_item(scale, str(tmp_path))
    record_property("figures", {name: value for name, value in got.items() if not name.endswith("head")})
    assert got["trickle 1 KiB/s answer"] == 408, got
    assert got["trickle 1 KiB/s cut after s"] <= 2 * (scale.rate_window or 30.0) + 2, got
    honest = [value for name, value in got.items() if name.startswith("honest body at ")]
    assert honest == [200], got
    assert got["exit code"] == 0, got


# --- 6. a response nobody reads ----------------------------------------------------------------

def unread_response_item(scale, workdir):
    """A client that never reads a large response -> when the server dropped it, the lines it
    logged, whether the connection's thread then ended, the exit code."""
    server = Server(workdir, *flags(send_timeout_seconds=scale.send_timeout))
    timeout = scale.send_timeout or 30.0
    figures = {}
    try:
        base_threads = server.threads()
        size = scale.response_mib << 20
        body, content_type = multipart(program_parts(simple_program(
            f"def f():\n    return b'x' * {size}\n")))
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.port))
        s.sendall((f"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        started = time.monotonic()
        while not log_lines(server, "client_disconnected") and time.monotonic() - started < 3 * timeout + 30:
            time.sleep(0.2)
        dropped_s = time.monotonic() - started
        lines = log_lines(server, "client_disconnected")
        s.close()
        figures |= {"response MiB": scale.response_mib, "dropped after s (incl. execution)": dropped_s,
                    "disconnect lines": lines, "log tail": server.log()[-2000:],
                    "200s logged as finished": [line for line in log_lines(server, "request_finished")
                                                if "http_status=200" in line],
                    "thread ended": wait_for(lambda: server.threads() <= base_threads + 1, 10, 0.1),
                    "threads before/after": f"{base_threads}/{server.threads()}"}
    finally:
        figures["exit code"] = server.stop()
    return figures


def test_unread_response(tmp_path, record_property, scale=CI):
    """A client that never reads a large response is dropped within the send timeout and logged
    as a client disconnect, not as a success; the thread goes away."""
    got = unread_response_item(scale, str(tmp_path))
    record_property("figures", {**{k: v for k, v in got.items() if k not in ("log tail", "disconnect lines")},
                                "log": [line.split(" ", 3)[2] for line in got["disconnect lines"]]})
    lines = got["disconnect lines"]
    assert lines and "phase=response" in lines[0] and "http_status=200" in lines[0], got["log tail"]
    assert got["200s logged as finished"] == [], got
    assert got["dropped after s (incl. execution)"] <= 2 * (scale.send_timeout or 30.0) + 15, got
    assert got["thread ended"], f"the dropped connection's thread stayed: {got['threads before/after']} threads"
    assert got["exit code"] == 0, got


# --- 7. framing (RFC 9112) ---------------------------------------------------------------------------

SMUGGLED = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def framing_cases(content_type, body):
    program = (f"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n").encode()
    chunked_body = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    junk_body = body[:-len(b"--\r\n")] + b"--junk\r\n"
    return [
        ("TE chunked + Content-Length", program + b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n"
         % len(chunked_body) + chunked_body + SMUGGLED, 400),
        ("two different Content-Lengths", program + b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
         % (len(body), len(body) + len(SMUGGLED)) + body + SMUGGLED, 400),
        ("two equal Content-Lengths", program + b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
         % (len(body), len(body)) + body + SMUGGLED, 400),
        *[(f"Content-Length: {value.decode() % len(body)}", program + b"Content-Length: " + value % len(body)
           + b"\r\n\r\n" + body + SMUGGLED, 400)
          for value in (b"%d, 5", b"%d ,5", b"+%d", b"-%d", b"0x%x", b"%d 5", b"%d;5", b"%d.0")],
        ("TE: xchunked", program + b"Transfer-Encoding: xchunked\r\n\r\n" + chunked_body + SMUGGLED, 400),
        ("TE: chunked, gzip", program + b"Transfer-Encoding: chunked, gzip\r\n\r\n" + chunked_body + SMUGGLED, 400),
        ("control character in a header value", program + b"X-Bad: a\x01b\r\nContent-Length: %d\r\n\r\n"
         % len(body) + body, 400),
        ("junk after the closing delimiter", program + b"Content-Length: %d\r\nConnection: close\r\n\r\n"
         % len(junk_body) + junk_body, 400),
    ]


def expect_cases(content_type, body):
    def head(path="/execute", length=None, ctype=content_type):
        length = len(body) if length is None else length
        return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {length}\r\n"
                f"Expect: 100-continue\r\n\r\n").encode()
    return [("Content-Length 10^12", head(length=10 ** 12), 413), ("wrong path", head(path="/nope"), 404),
            ("not multipart", head(ctype="text/plain"), 400)]


def framing_item(scale, workdir):
    """Each smuggling attempt, a GET with a body, `Expect: 100-continue` on unacceptable requests and
    on an acceptable one -> per case what came back (status, how many answers, the interim 100)."""
    server = Server(workdir)
    figures = {"smuggling": {}, "expect": {}}
    try:
        body, content_type = multipart(program_parts(simple_program("def f(x):\n    return x\n", args=[1])))
        for name, raw, expected in framing_cases(content_type, body):
            with connect(server.port) as s:
                s.sendall(raw)
                data = read_response(s)
            figures["smuggling"][name] = {"expected": expected, "status": status_of(data),
                                          "answers": data.count(b"HTTP/1.1 "), "closed": b"Connection: close" in data,
                                          "head": data[:300]}
        with connect(server.port) as s:  # a GET with a body: the body is skipped, one answer
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                      % len(SMUGGLED) + SMUGGLED)
            data = read_response(s)
        figures["GET with a body"] = {"status": status_of(data), "answers": data.count(b"HTTP/1.1 "), "head": data[:300]}
        for name, raw, expected in expect_cases(content_type, body):
            with connect(server.port) as s:
                s.sendall(raw)
                data = read_response(s, timeout=10)
            figures["expect"][name] = {"expected": expected, "status": status_of(data),
                                       "100 Continue": b"100 Continue" in data, "head": data[:300]}
        with connect(server.port) as s:  # an acceptable one: 100, then the body, then 200
            s.sendall((f"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                       f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n").encode())
            interim = s.recv(1 << 10)
            if interim.startswith(b"HTTP/1.1 100"):
                s.sendall(body)
                data = read_response(s)
        figures["Expect 100-continue, valid"] = {"interim": interim[:300], "status": status_of(data),
                                                 "head": data[:300]}
        figures["/health after s"] = health_seconds(server)
    finally:
        figures["exit code"] = server.stop()
    return figures


def test_framing(tmp_path, record_property, scale=CI):
    """Each smuggling attempt is refused with 400 and the connection closed: the request
    hidden behind it is never answered.  A GET body is drained, not read as a request.
    `Expect: 100-continue` gets the final answer at once when the request is unacceptable."""
    got = framing_item(scale, str(tmp_path))
    record_property("figures", {**{name: case["status"] for group in ("smuggling", "expect") for name, case in got[group].items()},
                                **{name: got[name]["status"] for name in ("GET with a body", "Expect 100-continue, valid")},
                                "exit code": got["exit code"]})
    assert len(got["smuggling"]) == 15 and len(got["expect"]) == 3, got
    for name, case in got["smuggling"].items():
        assert case["status"] == case["expected"], (name, case)
        assert case["answers"] == 1, (name, "the smuggled request was answered", case)
        assert case["closed"], (name, case)
    assert got["GET with a body"]["status"] == 200 and got["GET with a body"]["answers"] == 1, got["GET with a body"]
    for name, case in got["expect"].items():
        assert case["status"] == case["expected"] and not case["100 Continue"], (name, case)
    valid = got["Expect 100-continue, valid"]
    assert valid["interim"].startswith(b"HTTP/1.1 100"), valid
    assert valid["status"] == 200, valid
    assert got["exit code"] == 0, got


# --- 8. shutdown with slow clients ---------------------------------------------------------------

def shutdown_item(scale, workdir):
    """SIGTERM with a slow upload and an execution in flight -> the exit code and how long the
    exit took, what the execution and the upload got."""
    server = Server(workdir)
    figures = {}
    try:
        body, content_type = multipart(program_parts(simple_program(
            "import time\ndef f(x):\n    time.sleep(2)\n    return x\n", args=[5])))
        answer = []
        runner = threading.Thread(target=lambda: answer.append(
            request("POST", server.url + "/execute", body, {"Content-Type": content_type}, 60)))
        runner.start()
        slow = connect(server.port)
        slow.sendall((f"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                      f"Content-Length: {100 << 20}\r\n\r\n").encode() + b"x" * 1000)
        assert wait_for(lambda: server.health()["load"]["requests_in_progress"] >= 1, 30), "the execution never started"
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        exit_s = time.monotonic() - started
        join_threads([runner], 60)
        slow_answer = read_response(slow, timeout=5)
        slow.close()
        figures |= {"exit code": code, "exit after SIGTERM s": exit_s,
                    "in-flight execution": answer[0][0] if answer else None,
                    "slow upload got": status_of(slow_answer) or "closed"}
    finally:
        server.stop()
    return figures


def test_shutdown(tmp_path, record_property, scale=CI):
    """SIGTERM with a slow upload and an execution in flight: the execution is answered,
    the upload cut, the server gone within the worker grace plus a few seconds."""
    got = shutdown_item(scale, str(tmp_path))
    record_property("figures", got)
    assert got["exit code"] == 0, got
    assert got["in-flight execution"] == 200, got
    assert got["exit after SIGTERM s"] <= 1 + 5, got  # --worker-termination-grace-seconds 1 (Server), a few s more


# --- 9. clients closing mid-header ---------------------------------------------------------------

def mid_header_item(scale, workdir):
    """Clients that close mid-header -> the lines the server logged meanwhile, its exit code."""
    server = Server(workdir)
    figures = {}
    try:
        before = len(server.log().splitlines())
        for i in range(scale.mid_header_closes):
            with connect(server.port) as s:
                s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Ty")
                if i % 2:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # reset
        health_seconds(server)
        time.sleep(0.5)  # not a synchronisation: the time a late line or traceback would have to show
        figures |= {"clients": scale.mid_header_closes, "log lines": server.log().splitlines()[before:]}
    finally:
        figures["exit code"] = server.stop()
    return figures


def test_mid_header_closes(tmp_path, record_property, scale=CI):
    """Clients that close mid-header: at most one log line each, never a traceback."""
    got = mid_header_item(scale, str(tmp_path))
    lines = got["log lines"]
    record_property("figures", {"clients": got["clients"], "log lines": len(lines), "exit code": got["exit code"]})
    assert not [line for line in lines if "Traceback" in line], lines[:20]
    assert len(lines) <= got["clients"], len(lines)
    assert got["exit code"] == 0, got["exit code"]


# --- 10. workspaces after a hard kill ---------------------------------------------------------------

def workspaces_item(scale, workdir):
    """A server SIGKILLed while a program runs, and a live workspace beside its dead ones -> the
    workspaces the dead server left, the live one, and what is left once a new server started."""
    server = Server(workdir)
    tmpdir = server.tmpdir
    body, content_type = multipart(program_parts(simple_program(
        "import time\ndef f():\n    time.sleep(30)\n")))
    sleeper = threading.Thread(target=lambda: _quiet_request(server.url, body, content_type), daemon=True)
    sleeper.start()
    assert wait_for(server.workspaces, 30, 0.05), "no workspace appeared"
    tree = [server.pid, *descendants(server.pid)]
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.proc.wait()
    server.stderr.close()
    join_threads([sleeper], 30)  # its connection died with the server
    dead = [n for n in os.listdir(tmpdir) if n.startswith("kcoral-program-")]
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        ticks = int(f.read().rpartition(b")")[2].split()[19])
    live = os.path.join(tmpdir, f"kcoral-program-{os.getpid()}.{ticks}-live")
    os.mkdir(live)
    second = subprocess.Popen(  # a new server on the same TMPDIR
        [*server.proc.args[:server.proc.args.index("--port") + 1], "0", *server.proc.args[
            server.proc.args.index("--port") + 2:]], env={**os.environ, "TMPDIR": tmpdir},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))

    def left():
        return [n for n in os.listdir(tmpdir) if n.startswith("kcoral-program-")]

    try:
        wait_for(lambda: left() == [os.path.basename(live)], 60, 0.1)
        return {"dead workspaces": dead, "live workspace": os.path.basename(live), "left": left()}
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(60)
        shutil.rmtree(server.base, ignore_errors=True)


def test_workspaces_after_a_hard_kill(tmp_path, record_property, scale=CI):
    """After SIGKILL, the next start removes the dead server's workspaces, never a live one's."""
    got = workspaces_item(scale, str(tmp_path))
    record_property("figures", got)
    assert got["dead workspaces"], got  # the dead server did leave some
    assert got["left"] == [got["live workspace"]], got


def _quiet_request(url, body, content_type):
    try:
        request("POST", url + "/execute", body, {"Content-Type": content_type}, 60)
    except OSError:
        pass


CHECKS = [("slow headers", test_slow_headers), ("fd limit", test_fd_limit), ("uploads", test_uploads),
          ("big headers", test_big_headers), ("slow body", test_slow_body),
          ("unread response", test_unread_response), ("framing", test_framing), ("shutdown", test_shutdown),
          ("mid-header closes", test_mid_header_closes), ("workspaces", test_workspaces_after_a_hard_kill)]


def hostile_item(scale, workdir):
    """tests.soak's entry: every attack's test at its size -> {attack: figures}; each attack's
    figures are printed as it finishes, and a failed one does not stop the others."""
    own = LONG if scale.name == "long" else CI
    figures, failed = {}, []
    for name, check in CHECKS:
        started = time.monotonic()
        try:
            check(pathlib.Path(tempfile.mkdtemp(dir=workdir)), lambda _, got: figures.__setitem__(name, got), own)
        except (AssertionError, OSError, RuntimeError, subprocess.SubprocessError) as exc:  # reported below
            figures[name] = f"FAILED: {str(exc)[:300]}"
            failed.append(name)
        print(f"    {name} ({time.monotonic() - started:.0f} s): {figures.get(name)}", flush=True)
    assert not failed, f"failed attacks: {failed}: {figures}"
    return figures


class CutRecorder:
    """What ConnectionGuard needs of a handler: its connection, and where it says why it cut it."""

    def __init__(self, connection):
        self.connection = connection
        self.cut_reason = None


def test_a_body_reaching_its_read_after_shutdown_began_is_cut():
    """The race behind a 30 s exit: an upload admitted before SIGTERM whose thread reaches its body
    read only after the shutdown cut the bodies then arriving.  It is cut all the same, not left
    to the body rate rule's window (30 s by default)."""
    guard = kcoral.ConnectionGuard(kcoral.ServerConfig())
    ours, theirs = socket.socketpair()
    handler = CutRecorder(ours)
    try:
        guard.cut_phase("body", "shutdown")
        guard.enter(handler, "header")
        assert handler.cut_reason is None  # headers still arriving are not bodies
        guard.enter(handler, "body")
        assert handler.cut_reason == "shutdown"
        ours.settimeout(5)
        assert ours.recv(1) == b""  # its read side is shut: the handler's read ends at once
    finally:
        guard.stop()
        ours.close()
        theirs.close()
