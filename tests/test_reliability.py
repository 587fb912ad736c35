"""Reliability: fuzzing, fault injection, cache faults, load, shutdown, client disconnects,
no growth per request.

Every item is a function `<item>_item(scale, workdir) -> {figure: value}` that measures: what it
counted, what went wrong (lists, empty when nothing did), what leaked, the server's exit code.
The pytest tests at the bottom hold the checks; they run at CI size (`CI`), and
`python -m tests.soak --long` runs the same tests at full size (`LONG`) and prints the table
quoted in docs/reliability.md.

"Nothing leaks" is measured from outside the server process:
- processes: the server's descendants (forkserver, resource tracker, one idle worker per slot)
  are as many as before, and no process carrying this run's tag (`sleep 600 <tag>`) is alive;
- temporary directories: each server runs with TMPDIR pointing at a private directory, which
  must hold no `kcoral-program-*` entry afterwards;
- file descriptors: /proc/<server>/fd is back to its earlier count (plus a small slack for
  keep-alive sockets whose handler threads are just finishing; our own clients are closed first).
"""

import collections
import contextlib
import copy
import dataclasses
import gc
import http.client
import json
import os
import random
import select
import shutil
import signal
import socket
import string
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kcoral
from kcoral_worker import ValidationError
from tests.support import (
    ServerProcess,
    assert_error_body,
    decode_response,
    is_alive,
    join_threads,
    multipart,
    post,
    program_parts,
    request,
    server_connections,
    sha256,
    simple_program,
    wait_for,
)


@dataclasses.dataclass(frozen=True)
class Scale:
    name: str
    fuzz: int              # malformed requests
    valid_every: int       # a valid request after this many malformed ones
    fault_rounds: int      # passes over FAULTS
    fill_bytes: int        # bytes one program writes into its workspace
    flood_bytes: int       # bytes one program writes to fd 1 (and to fd 2)
    load: int              # mixed requests ...
    concurrency: int       # ... sent by this many client threads
    disconnects: int       # rounds of aborted requests
    shutdowns: int         # SIGTERM rounds
    examples: int          # hypothesis examples per property
    growth: int            # requests over which the front-end's memory, threads and fds are followed


CI = Scale("ci", fuzz=5000, valid_every=250, fault_rounds=1, fill_bytes=64 << 20, flood_bytes=50 << 20,
           load=1000, concurrency=8, disconnects=8, shutdowns=1, examples=200, growth=300)
LONG = Scale("long", fuzz=20000, valid_every=50, fault_rounds=4, fill_bytes=1 << 30, flood_bytes=50 << 20,
             load=10000, concurrency=16, disconnects=40, shutdowns=3, examples=2000, growth=20000)


# --- the server under test, seen from outside -------------------------------------

def proc_table():
    """{pid: (ppid, pgrp, cmdline)} of every live (not zombie) process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if fields[0] not in (b"Z", b"X"):
            table[int(name)] = (int(fields[1]), int(fields[2]), cmd)
    return table


def descendants(pid, table=None):
    """{pid: cmdline} of every live process below `pid`."""
    table = table if table is not None else proc_table()
    children = collections.defaultdict(list)
    for p, (ppid, _, _) in table.items():
        children[ppid].append(p)
    found, stack = {}, [pid]
    while stack:
        for child in children[stack.pop()]:
            found[child] = table[child][2]
            stack.append(child)
    return found


def tagged(tag):
    """Live processes whose command line carries `tag` (the `sleep 600 <tag>` of a fault)."""
    return {p: cmd for p, (_, _, cmd) in proc_table().items() if tag in cmd}


class Server(ServerProcess):
    """`python -m kcoral` with a private TMPDIR (its workspaces land there), probed through /proc."""

    def __init__(self, workdir, *flags, workers=2):
        # short: the forkserver's AF_UNIX socket lives under TMPDIR (108-byte path limit)
        base = self.base = tempfile.mkdtemp(prefix="kcoral-rel-")
        self.tmpdir = os.path.join(base, "tmp")
        os.makedirs(self.tmpdir)
        self.workers = workers
        self.disk_cache = os.path.join(base, "disk-cache")
        super().__init__("--worker-termination-grace-seconds", "1", *flags, workers=workers,
                         env={"TMPDIR": self.tmpdir}, tmp_path=base)
        self.pid = self.proc.pid

    def stop(self):
        """SIGTERM -> exit code; the scratch directory goes too unless the exit was unclean."""
        code = super().stop()
        if code == 0:
            shutil.rmtree(self.base, ignore_errors=True)
        return code

    def fds(self):
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def status_field(self, name):
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
        return 0

    def threads(self):
        return self.status_field("Threads")

    def rss_kib(self):
        return self.status_field("VmRSS")

    def workspaces(self):
        return [n for n in os.listdir(self.tmpdir) if n.startswith("kcoral-program-")]

    def wait_idle(self, timeout=60):
        """Every slot has a ready worker and nothing runs or waits (docs/protocol.md §3 load fields)."""
        want = {"request_capacity": self.workers, "requests_in_progress": 0, "requests_waiting": 0}
        deadline = time.monotonic() + timeout
        while True:
            load = self.health()["load"]
            if load == want:
                return load
            assert time.monotonic() < deadline, f"server never became idle: {load}"
            time.sleep(0.05)


class Baseline:
    """Processes and fds of an idle server, compared with the same server after the damage."""

    def __init__(self, server):
        server.wait_idle()
        # the /health exchanges of wait_idle are over: their connections closed on the server's
        # side too (their handler threads ending with them), and the counts read the same twice
        assert wait_for(lambda: not server_connections(server.port) and quiet(server), 10), \
            f"the server never went quiet: connections {server_connections(server.port)}"
        self.server = server
        self.procs = descendants(server.pid)
        self.fds = server.fds()
        self.threads = server.threads()

    def leaks(self, tag=None, fd_slack=3, timeout=30):
        """Wait up to `timeout` for the server to be back where it was -> its figures, with under
        "leaks" what is still more than before (empty once nothing is)."""
        server = self.server
        server.wait_idle(timeout)
        deadline = time.monotonic() + timeout
        while True:
            procs, fds, threads = descendants(server.pid), server.fds(), server.threads()
            workspaces, sleeps = server.workspaces(), (tagged(tag) if tag else {})
            back = (len(procs) == len(self.procs) and fds <= self.fds + fd_slack and not workspaces
                    and not sleeps and threads <= self.threads + fd_slack)
            if back or time.monotonic() > deadline:
                return {"server processes": len(procs), "fds before/after": f"{self.fds}/{fds}", "leaks": [] if back else [
                    f"processes {sorted(self.procs.values())} -> {sorted(procs.values())}",
                    f"fds {self.fds} -> {fds} (slack {fd_slack})",
                    f"threads {self.threads} -> {threads} (slack {fd_slack})",
                    f"workspaces {workspaces}", f"tagged processes {sleeps}"]}
            time.sleep(0.2)


def quiet(server):
    """The server's threads and fds read the same twice, 50 ms apart."""
    first = (server.threads(), server.fds())
    time.sleep(0.05)  # the interval of the comparison, not a synchronisation
    return first == (server.threads(), server.fds())


def new_tag():
    """A number `sleep` accepts as an extra operand and nothing else on the machine carries."""
    return "0.000" + "".join(random.choice(string.digits) for _ in range(12))


# --- answers ------------------------------------------------------------------------

ERROR_KIND_BY_STATUS = {413: "request_too_large", 503: "busy", 504: "timeout"}  # any other 4xx: parse


def check_4xx(status, headers, data, expected):
    """A 4xx ERROR answer (docs/protocol.md §9.8): the `expected` status, or with None any 4xx, of
    the kind its status implies."""
    assert 400 <= status < 500, f"HTTP {status}: {data[:400]!r}"
    return assert_error_body(status, headers, data, expected or status, ERROR_KIND_BY_STATUS.get(status, "parse"))


def completed(body, where=""):
    assert body.get("status") == "COMPLETED", f"{where}: {str(body)[:600]}"
    return body["results"]


def valid_request_ok(url):
    """The server still runs programs."""
    status, _, body = post(url, simple_program("def f(a, b):\n    return a * b\n", args=[6, 7]))
    assert status == 200, body
    assert completed(body, "valid request")["out"] == {"type": "integer", "value": 42}


class RawClient:
    """Sends prepared HTTP/1.1 requests over one keep-alive connection, reopened when needed.

    mode "keep": reuse the connection; "close": a fresh connection for this request only;
    "half": a fresh connection, shut for writing after the bytes (a client that stops early).
    """

    def __init__(self, port, timeout=60):
        self.port = port
        self.timeout = timeout
        self.sock = None
        self.connections = 0

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def exchange(self, data, mode="keep"):
        reused = self.sock is not None and mode == "keep"
        try:
            return self._exchange(data, mode)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.close()
            if not reused:
                raise
            return self._exchange(data, mode)  # the server closed an idle keep-alive connection

    def _exchange(self, data, mode):
        if mode != "keep":
            self.close()
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)
            self.connections += 1
        self.sock.sendall(data)
        if mode == "half":
            self.sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(self.sock, method="POST")
        response.begin()
        body = response.read()
        headers = {k.lower(): v for k, v in response.getheaders()}
        if response.will_close or mode != "keep":
            self.close()
        return response.status, headers, body


def http_request(body, content_type="multipart/form-data; boundary=B", headers=(), length=None,
                 path="/execute"):
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1"]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    if length != "omit":
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    lines += list(headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# --- multipart encoding with knobs (fuzz and the round-trip property) -----------------

def part_headers(name, content_type="application/octet-stream", quoted=True):
    value = f'"{name}"' if quoted else name
    return [f"Content-Disposition: form-data; name={value}".encode("utf-8", "surrogateescape"),
            f"Content-Type: {content_type}".encode()]


def encode_parts(parts, boundary, newline=b"\r\n", padding=b"", preamble=b"", epilogue=b"",
                 final_newline=True):
    """[(header lines, payload)] -> a multipart body (docs/protocol.md §4.4)."""
    out = [preamble]
    for headers, payload in parts:
        out.append(b"--" + boundary + padding + newline)
        out.extend(h + newline for h in headers)
        out.append(newline + payload + newline)
    out.append(b"--" + boundary + b"--" + (newline if final_newline else b"") + epilogue)
    return b"".join(out)


def program_body(program, blobs=(), boundary=b"B"):
    data = program if isinstance(program, bytes) else json.dumps(program).encode()
    parts = [(part_headers("program", "application/json"), data)]
    parts += [(part_headers(f"blob:{sha256(b)}"), b) for b in blobs]
    return encode_parts(parts, boundary)


# --- 1. fuzz: malformed requests ---------------------------------------------------------

MODULE = "def f(*args):\n    return len(args)\n"


def base_program(rng, blobs=False):
    """A valid program (and its blob payloads, each referenced exactly once)."""
    ins = [{"op": "upload", "id": "m", "kind": "module", "source": MODULE}]
    payloads = []
    if blobs:
        b1, b2 = b"B" + rng.randbytes(rng.randrange(1, 64)), b"F" + rng.randbytes(rng.randrange(1, 64))
        ins.append({"op": "upload", "id": "b", "kind": "bytes", "blob": sha256(b1)})
        ins.append({"op": "upload", "id": "file", "kind": "file", "blob": sha256(b2), "path": "in/data.bin"})
        payloads = [b1, b2]
    ins += [{"op": "get_function", "id": "fn", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "fn"},
             "args": [1, "two", [3.5, None, True], {"k": {"$ref": "x"}}]},
            {"op": "return", "key": "out", "value": {"$ref": "r"}}]
    if blobs:
        ins.append({"op": "return", "key": "f", "kind": "file", "path": "in/data.bin"})
    return {"instructions": ins, "options": {"timeout_seconds": 30}}, payloads


def nested(depth, leaf=None):
    value = [] if leaf is None else leaf
    for _ in range(depth):
        value = [value]
    return value


def digits(n):
    return "9" * n


BAD_PATHS = ["", "/abs", "/", "../x", "a/../b", "..", "a/..", "a\\b", "a\0b", ".", "./", "./.", "//",
             "x" * 256, "\u00e9" * 128, "/".join(["d" * 200] * 21), 5, None, [], {"$ref": ""}]
BAD_HASHES = ["A" * 64, "a" * 63, "a" * 65, "g" * 64, "", 64, None, ["a" * 64], "a" * 63 + "\n"]
BAD_REFS = ["m", {"$ref": "m", "x": 1}, {"$ref": ""}, {"$ref": 1}, {"$ref": "nope"}, None, [], {}]


def sem_mutations():
    """Program-level mutations of base_program(blobs=False): m, fn, r, out.

    Each is f(rng, program) -> extra blob payloads; each makes the request a 400.
    """
    M = []

    def top(key, value):
        def f(rng, p):
            p[key] = value
        return f

    def opt(key, value):
        def f(rng, p):
            p["options"][key] = value
        return f

    def field(index, key, value):
        def f(rng, p):
            p["instructions"][index][key] = value
        return f

    def drop(index, key):
        def f(rng, p):
            p["instructions"][index].pop(key, None)
        return f

    def prepend(ins, payloads=()):
        def f(rng, p):
            p["instructions"][:0] = copy.deepcopy(ins)
            return list(payloads)
        return f

    M += [top("extra", 1), top("instructions", []), top("instructions", {}), top("instructions", "x"),
          top("instructions", None), top("options", None), top("options", []), top("options", 7)]

    def no_instructions(rng, p):
        del p["instructions"]
    M.append(no_instructions)
    M += [opt("bogus", 1)]
    M += [opt("timeout_seconds", v) for v in (0, -1, "5", True, None, [], {})]
    M += [opt("output_limit_bytes", v) for v in (-1, 1.5, True, "1", None)]
    M += [opt("gpu_count", v) for v in (0, 9, 1.0, True, "1", 1, 8)]  # 1 and 8: a CPU server has no GPU
    for index in range(4):
        M += [field(index, "op", v) for v in ("uploads", "", None, 1, ["upload"], {"x": 1})]
        M += [drop(index, "op"), field(index, "extra", 1)]

        def not_object(rng, p, index=index):
            p["instructions"][index] = rng.choice([1, [], "x", None, True])
        M.append(not_object)
    for index in range(3):
        M += [drop(index, "id")] + [field(index, "id", v) for v in ("", 1, None, ["m"], {"$ref": "m"})]
    M += [field(1, "id", "m"), field(2, "id", "fn")]  # duplicate ids
    M += [drop(0, "source"), drop(1, "module"), drop(1, "name"), drop(2, "fn"), drop(3, "key"), drop(3, "value")]
    M += [field(0, "kind", v) for v in ("modules", None, [], {}, 1, "")]
    M += [field(0, "source", v) for v in (1, None, [], {})]
    M += [field(1, "module", v) for v in BAD_REFS + [{"$ref": "fn"}, {"$ref": "r"}]]
    M += [field(1, "name", v) for v in ("", 1, None, [])]
    M += [field(1, "cpu_only", v) for v in (1, "true", None, [])]
    M += [field(2, "fn", v) for v in BAD_REFS + [{"$ref": "r"}, {"$ref": "out"}]]
    M += [field(2, "args", v) for v in (None, {}, "x", 1, [{"$ref": "nope"}], [{"$ref": "r"}],
                                        [nested(401)], [nested(700)], [{"a": nested(450)}])]
    M += [field(3, "key", v) for v in ("", 1, None, [])]
    M += [field(3, "value", v) for v in BAD_REFS + [{"$ref": "out"}]]
    M += [field(3, "kind", v) for v in ("file", "blob", None)]  # kind with value: unknown field

    def dup_return(rng, p):
        p["instructions"].append({"op": "return", "key": "out", "value": {"$ref": "r"}})
    M.append(dup_return)

    def file_return(path, kind="file"):
        def f(rng, p):
            p["instructions"].append({"op": "return", "key": "k", "kind": kind, "path": path})
        return f
    M += [file_return(path, kind) for path in BAD_PATHS for kind in ("file", "folder")
          if not (isinstance(path, dict) and kind == "folder")]
    M += [file_return("x", "link"), file_return({"$ref": "nope"})]
    t4 = b"\0" * 4
    M += [prepend([{"op": "upload", "id": "t", "kind": "tensor", "blob": sha256(t4), "dtype": d,
                    "shape": [1]}], [t4]) for d in ("complex64", "uint16", "", 1, None, ["float32"], "Float32")]
    M += [prepend([{"op": "upload", "id": "t", "kind": "tensor", "blob": sha256(t4), "dtype": "float32",
                    "shape": s}], [t4]) for s in (-1, [-1], [1.5], [True], ["3"], None, [[1]], {}, [1.0])]
    t23 = b"\1" * 23
    M += [prepend([{"op": "upload", "id": "t", "kind": "tensor", "blob": sha256(t23), "dtype": "float32",
                    "shape": s}], [t23]) for s in ([2, 3], [1] * 100_000, [2] * 100_000,
                                                     [2 ** 62] * 100_000, [10 ** 4000] * 3, [])]
    M += [prepend([{"op": "upload", "id": "b", "kind": kind, "blob": h}])
          for h in BAD_HASHES for kind in ("bytes", "library", "tensor")]
    M += [prepend([{"op": "upload", "id": "b", "kind": "file", "blob": sha256(b"x"), "path": path}], [b"x"])
          for path in BAD_PATHS]
    x, y = b"x", b"y"
    M += [prepend([{"op": "upload", "id": "a", "kind": "file", "blob": sha256(x), "path": p1},
                   {"op": "upload", "id": "b", "kind": "file", "blob": sha256(y), "path": p2}], [x, y])
          for p1, p2 in (("a/b", "./a//b"), ("a", "a/b"), ("a/b/c", "a"), ("q", "q"))]
    M += [prepend([{"op": "upload", "id": "b", "kind": "bytes", "blob": sha256(x), "path": "p"}], [x]),
          prepend([{"op": "upload", "id": "b", "kind": "library", "blob": sha256(x), "extra": 1}], [x]),
          prepend([{"op": "upload", "id": "b", "kind": "file", "blob": sha256(x)}], [x])]
    return M


SEM_MUTATIONS = sem_mutations()


def random_bad_path(rng):
    parts = [rng.choice(["a", "dir", "x.y", "\u00e9t\u00e9", "-"]) for _ in range(rng.randrange(1, 5))]
    defect = rng.choice(["..", "abs", "backslash", "nul", "long"])
    if defect == "..":
        parts.insert(rng.randrange(len(parts) + 1), "..")
    elif defect == "abs":
        return "/" + "/".join(parts)
    elif defect == "backslash":
        parts[-1] += "\\x"
    elif defect == "nul":
        parts[0] += "\0"
    else:
        parts.append("z" * rng.randrange(256, 300))
    return "/".join(parts)


class Fuzzer:
    """Structure-aware malformed requests, each a 4xx by construction (docs/protocol.md §4-6).

    case(i) -> (category, description, raw HTTP request, expected status, mode).
    Categories rotate so every family is covered at any size.
    """

    def __init__(self, seed, max_request_bytes):
        self.rng = random.Random(seed)
        self.limit = max_request_bytes
        self.families = [self.content_type, self.framing, self.part_header, self.part_name, self.json_text,
                         self.program, self.path, self.hashes, self.sizes, self.truncated, self.byte_mutation,
                         self.http_headers, self.chunked]

    def breakers(self):
        """The inputs that broke the published server (and some that broke ours), always sent."""
        rng = self.rng
        program, blobs = base_program(rng, blobs=True)
        ct = "multipart/form-data; boundary=B"
        ok_body = program_body(program, blobs)
        text = json.dumps(program).encode()
        cases = [("JSON nested 10 000 deep", program_body(b'{"instructions": ' + b"[" * 10000 + b"]" * 10000 + b"}")),
                 ("args literal nested 10 000 deep",
                  program_body(text.replace(b'"two"', b"[" * 10000 + b"]" * 10000), blobs)),
                 ("args literal nested 900 deep", program_body(text.replace(b'"two"', b"[" * 900 + b"]" * 900), blobs)),
                 ("integer of 5 000 digits", program_body(text.replace(b'"two"', digits(5000).encode()), blobs)),
                 ("timeout of 5 000 digits", program_body(text.replace(b"30", digits(5000).encode(), 1), blobs)),
                 ("args literal 1e400", program_body(text.replace(b"3.5", b"1e400"), blobs))]
        for label, shape in (("100 000 dimensions of 1", [1] * 100_000), ("100 000 dimensions of 2**62", [2 ** 62] * 100_000),
                             ("3 dimensions of 10**4000", [10 ** 4000] * 3)):
            data = b"\0" * 3
            tensor = copy.deepcopy(program)
            tensor["instructions"].insert(1, {"op": "upload", "id": "t", "kind": "tensor", "blob": sha256(data),
                                              "dtype": "float32", "shape": shape})
            cases.append((f"tensor with {label}, 3-byte blob", program_body(tensor, blobs + [data])))
        out = [(label, http_request(body, ct), 400, "keep") for label, body in cases]
        for value in ("1" + "0" * 30, str(2 ** 70), digits(5000), str(self.limit + 1)):
            out.append((f"Content-Length {value[:12]}… ({len(value)} digits)", http_request(b"", ct, length=value),
                        413, "keep"))
        for value in ("\u00b2", "-1", "1_0"):
            out.append((f"Content-Length {value!r}", http_request(b"", ct, length=value), 400, "close"))
        out.append(("chunk size -5", http_request(b"", ct, length="omit", headers=["Transfer-Encoding: chunked"])
                    + b"-5\r\nabcde\r\n0\r\n\r\n", 400, "close"))
        out.append(("header line without a colon before Content-Length",
                    http_request(ok_body, ct, headers=[]).replace(b"Content-Length", b"Garbage\r\nContent-Length", 1),
                    400, "close"))
        out.append(("bare CR in Content-Type", http_request(ok_body, ct + '; x="\r"'), 400, "close"))
        return [("breaker", label, data, expected, mode) for label, data, expected, mode in out]

    def case(self, i):
        family = self.families[i % len(self.families)]
        result = family()
        name, description, data = result[:3]
        expected = result[3] if len(result) > 3 else 400
        mode = result[4] if len(result) > 4 else "keep"
        return name, description, data, expected, mode

    def boundary(self):
        return self.rng.choice([b"B", b"kcoral-" + self.rng.randbytes(8).hex().encode(), b"x" * 70, b"'()+_,-./:=?"])

    def envelope(self, body, boundary, content_type=None, **kw):
        ct = content_type or f"multipart/form-data; boundary=\"{boundary.decode()}\""
        return http_request(body, ct, **kw)

    # -- families --------------------------------------------------------------------------

    def content_type(self):
        rng = self.rng
        program, blobs = base_program(rng, blobs=rng.random() < 0.5)
        b = self.boundary()
        body = program_body(program, blobs, b)
        choices = [None, "application/json", f"multipart/mixed; boundary={b.decode()}", "multipart/form-data",
                   "multipart/form-data; boundary=", 'multipart/form-data; boundary="unterminated',
                   f"multipart/form-data; boundary=\"{b.decode()}\"; boundary=\"{b.decode()}\"",
                   f"multipart/form-datax; boundary=\"{b.decode()}\"", "text/plain",
                   "multipart/form-data; boundary=other-boundary", f"multipart/form-data; =x; boundary={b.decode()}",
                   f"multipart/form-data; boundary=\"{b.decode()}\r\"",
                   "".join(rng.choice(string.printable[:94]) for _ in range(rng.randrange(1, 40))).replace(
                       "multipart", "mp")]
        ct = rng.choice(choices)
        return "content-type", repr(ct)[:60], http_request(body, ct)

    def framing(self):
        rng = self.rng
        program, blobs = base_program(rng, blobs=rng.random() < 0.5)
        b = self.boundary()
        body = program_body(program, blobs, b)
        closing = b"--" + b + b"--"
        end = body.rindex(closing) + len(closing)
        kind = rng.choice(["no-closing", "truncated", "empty", "only-closing", "no-delimiter",
                           "delimiter-junk", "no-blank-line", "garbage"])
        if kind == "no-closing":
            body = body[:body.rindex(closing)]
        elif kind == "truncated":
            body = body[:rng.randrange(0, end - 1)]
        elif kind == "empty":
            body = b""
        elif kind == "only-closing":
            body = closing + rng.choice([b"", b"\r\n"])
        elif kind == "no-delimiter":
            body = body.replace(b"--" + b, b"--" + b[:-1] + b"#")
        elif kind == "delimiter-junk":
            first = body.index(b"--" + b) + len(b) + 2
            body = body[:first] + b"junk" + body[first:]
        elif kind == "no-blank-line":
            body = body.replace(b"application/json\r\n\r\n", b"application/json\r\n", 1)
        else:
            body = rng.randbytes(rng.randrange(1, 400))
        return "framing", kind, self.envelope(body, b)

    def part_header(self):
        rng = self.rng
        program, blobs = base_program(rng, blobs=rng.random() < 0.5)
        b = self.boundary()
        data = json.dumps(program).encode()
        parts = [(part_headers("program", "application/json"), data)]
        parts += [(part_headers(f"blob:{sha256(x)}"), x) for x in blobs]
        target = rng.randrange(len(parts))
        headers = list(parts[target][0])
        disposition, ctype = headers
        name = b"program" if target == 0 else f"blob:{sha256(blobs[target - 1])}".encode()
        kind = rng.choice(["no-disposition", "two-dispositions", "no-type", "two-types", "attachment",
                           "no-name", "empty-name", "two-names", "nested-multipart", "encoding",
                           "two-encodings", "no-colon", "bad-header-name", "unterminated-quote",
                           "continuation-first", "bad-param"])
        if kind == "no-disposition":
            headers = [ctype]
        elif kind == "two-dispositions":
            headers = [disposition, disposition, ctype]
        elif kind == "no-type":
            headers = [disposition]
        elif kind == "two-types":
            headers = [disposition, ctype, ctype]
        elif kind == "attachment":
            headers = [disposition.replace(b"form-data", rng.choice([b"attachment", b"inline", b"form-datax"])), ctype]
        elif kind == "no-name":
            headers = [b"Content-Disposition: form-data; filename=\"x\"", ctype]
        elif kind == "empty-name":
            headers = [b"Content-Disposition: form-data; name=\"\"", ctype]
        elif kind == "two-names":
            headers = [disposition + b"; name=\"" + name + b"\"", ctype]
        elif kind == "nested-multipart":
            headers = [disposition, b"Content-Type: multipart/mixed; boundary=inner"]
        elif kind == "encoding":
            cte = rng.choice([b"base64", b"quoted-printable", b"7bit", b"gzip", b"", b"binary, 8bit"])
            headers = [disposition, ctype, b"Content-Transfer-Encoding: " + cte]
        elif kind == "two-encodings":
            headers = [disposition, ctype, b"Content-Transfer-Encoding: binary", b"Content-Transfer-Encoding: 8bit"]
        elif kind == "no-colon":
            headers = [disposition, b"Garbage line without colon", ctype]
        elif kind == "bad-header-name":
            headers = [disposition, b"Content Type: application/json", ctype]
        elif kind == "unterminated-quote":
            headers = [b"Content-Disposition: form-data; name=\"" + name, ctype]
        elif kind == "continuation-first":
            headers = [b" folded: x", disposition, ctype]
        else:
            headers = [disposition + b"; =x", ctype]
        parts[target] = (headers, parts[target][1])
        return "part-header", f"{kind} on part {target}", self.envelope(encode_parts(parts, b), b)

    def part_name(self):
        rng = self.rng
        program, blobs = base_program(rng, blobs=True)
        b = self.boundary()
        data = json.dumps(program).encode()
        prog = (part_headers("program", "application/json"), data)
        blob_parts = [(part_headers(f"blob:{sha256(x)}"), x) for x in blobs]
        h = sha256(blobs[0])
        kind = rng.choice(["second-program", "no-program", "program-type", "unknown-name", "uppercase-hash",
                           "short-hash", "long-hash", "duplicate-blob", "blob-type", "hash-mismatch",
                           "unreferenced", "non-hex"])
        parts = [prog] + blob_parts
        if kind == "second-program":
            parts.append(prog)
        elif kind == "no-program":
            parts = blob_parts
        elif kind == "program-type":
            parts[0] = (part_headers("program", rng.choice(["text/plain", "application/octet-stream",
                                                           "application/jsonx", "json"])), data)
        elif kind == "unknown-name":
            parts.append((part_headers(rng.choice(["programs", "blob", "blob:", "file:x", "Program", "x"])), b"1"))
        elif kind in ("uppercase-hash", "short-hash", "long-hash", "non-hex"):
            bad = {"uppercase-hash": h.upper(), "short-hash": h[:-1], "long-hash": h + "0",
                   "non-hex": h[:-1] + "g"}[kind]
            parts[1] = (part_headers(f"blob:{bad}"), blobs[0])
        elif kind == "duplicate-blob":
            parts.append(parts[1])
        elif kind == "blob-type":
            parts[1] = (part_headers(f"blob:{h}", rng.choice(["application/json", "text/plain"])), blobs[0])
        elif kind == "hash-mismatch":
            flipped = bytearray(blobs[0])
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            parts[1] = (parts[1][0], bytes(flipped))
        elif kind == "unreferenced":
            extra = rng.randbytes(16)
            parts.append((part_headers(f"blob:{sha256(extra)}"), extra))
        else:
            raise AssertionError(kind)
        rng.shuffle(parts)
        return "part-name", kind, self.envelope(encode_parts(parts, b), b)

    def json_text(self):
        rng = self.rng
        program, _ = base_program(rng)
        text = json.dumps(program).encode()
        kind = rng.choice(["invalid-utf8", "bom", "trailing", "duplicate-key", "nan", "truncated", "deep-10000",
                           "deep-args", "int-5000-digits", "random", "not-object", "empty", "js-syntax",
                           "huge-float-arg", "huge-float-timeout"])
        if kind == "invalid-utf8":
            bad = rng.choice([b"\xff", b"\xc3\x28", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
            at = text.index(b"return len") + rng.randrange(5)
            text = text[:at] + bad + text[at:]
        elif kind == "bom":
            text = b"\xef\xbb\xbf" + text
        elif kind == "trailing":
            text += rng.choice([b" x", b"{}", b"\x00", b",", b"]"])
        elif kind == "duplicate-key":
            target = rng.choice([program, program["options"], program["instructions"][0],
                                 program["instructions"][2]["args"][3], program["instructions"][2]])
            target["__dup__"] = 1
            text = json.dumps(program).encode().replace(b'"__dup__": 1', b'"z": 1, "z": 2')
        elif kind == "nan":
            program["instructions"][2]["args"].append("__NAN__")
            text = json.dumps(program).encode().replace(b'"__NAN__"', rng.choice([b"NaN", b"Infinity", b"-Infinity"]))
        elif kind == "truncated":
            text = text[:rng.randrange(1, len(text))]
        elif kind == "deep-10000":
            text = b'{"instructions": ' + b"[" * 10000 + b"]" * 10000 + b"}"
        elif kind == "deep-args":
            depth = rng.randrange(1000, 20000)
            text = text.replace(b'"two"', b"[" * depth + b"]" * depth)
        elif kind == "int-5000-digits":
            where = rng.choice([b'"two"', b"30"])  # an args literal or timeout_seconds
            text = text.replace(where, digits(rng.randrange(4301, 6000)).encode(), 1)
        elif kind == "random":
            text = rng.randbytes(rng.randrange(0, 300))
            if text.strip().startswith(b"{"):
                text = b"]" + text
        elif kind == "not-object":
            text = rng.choice([b"[]", b'"x"', b"1", b"null", b"true", json.dumps(program["instructions"]).encode()])
        elif kind == "empty":
            text = rng.choice([b"", b" ", b"\r\n"])
        elif kind == "js-syntax":
            text = rng.choice([text.replace(b'"op"', b"op", 1), text.replace(b'"', b"'"),
                               text[:-1] + b",}", b"/* c */" + text])
        elif kind == "huge-float-arg":
            text = text.replace(b"3.5", rng.choice([b"1e400", b"-1e999"]), 1)
        else:
            text = text.replace(b"30", b"1e400", 1)
        b = self.boundary()
        return "json", kind, self.envelope(program_body(text, (), b), b)

    def program(self):
        rng = self.rng
        index = rng.randrange(len(SEM_MUTATIONS))
        program, _ = base_program(rng)
        payloads = SEM_MUTATIONS[index](rng, program) or []
        b = self.boundary()
        return "program", f"mutation #{index}", self.envelope(program_body(program, payloads, b), b)

    def path(self):
        rng = self.rng
        program, blobs = base_program(rng, blobs=True)
        bad = rng.choice(BAD_PATHS + [random_bad_path(rng)] * 6)
        if rng.random() < 0.5:
            program["instructions"][2]["path"] = bad
        else:
            program["instructions"][-1]["path"] = bad
            if isinstance(bad, dict) and rng.random() < 0.5:
                program["instructions"][-1]["kind"] = "folder"
        b = self.boundary()
        return "path", repr(bad)[:60], self.envelope(program_body(program, blobs, b), b)

    def hashes(self):
        rng = self.rng
        program, blobs = base_program(rng, blobs=True)
        bad = rng.choice(BAD_HASHES)
        target = rng.choice([1, 2])
        program["instructions"][target]["blob"] = bad
        b = self.boundary()
        return "hash", f"{bad!r}"[:40], self.envelope(program_body(program, [blobs[2 - target]], b), b)

    def sizes(self):
        rng = self.rng
        program, blobs = base_program(rng, blobs=True)
        b = self.boundary()
        ct = f"multipart/form-data; boundary=\"{b.decode()}\""
        kind = rng.choice(["over-limit", "10**30", "2**70", "5000-digits", "limit+1", "bad-length",
                           "tensor-length"])
        if kind == "bad-length":
            length = rng.choice(["abc", "-1", "1e3", "\u00b2", "0x10", "1.0", "+5", "1_000"])
            return "size", f"Content-Length {length!r}", http_request(b"", ct, length=length), 400, "close"
        if kind == "tensor-length":
            data = rng.randbytes(rng.choice([3, 5, 7, 15]))
            program["instructions"].insert(1, {"op": "upload", "id": "t", "kind": "tensor", "blob": sha256(data),
                                               "dtype": rng.choice(["float32", "int16", "float64"]),
                                               "shape": [rng.randrange(2, 9), 2]})
            return "size", kind, self.envelope(program_body(program, blobs + [data], b), b)
        length = {"over-limit": self.limit * rng.randrange(2, 1000), "10**30": 10 ** 30, "2**70": 2 ** 70,
                  "5000-digits": digits(5000), "limit+1": self.limit + 1}[kind]
        # the body is never read; send only the headers so no unread data can reset the answer
        return "size", kind, http_request(b"", ct, length=str(length)), 413, "keep"

    def truncated(self):
        rng = self.rng
        program, blobs = base_program(rng, blobs=rng.random() < 0.5)
        b = self.boundary()
        body = program_body(program, blobs, b)
        if rng.random() < 0.5:  # the client stops sending and half-closes: answered, then closed
            cut = rng.randrange(0, len(body))
            return "truncated", f"body {cut}/{len(body)} then EOF", \
                self.envelope(body[:cut], b, length=len(body)), 400, "half"
        cut = rng.randrange(1, len(body) - 10)  # a complete HTTP body holding a cut multipart body
        return "truncated", f"multipart cut at {cut} of {len(body)}", self.envelope(body[:cut], b)

    def byte_mutation(self):
        """Random byte-level damage to a request the server must reject anyway (gpu_count on CPU).

        Each blob is referenced once, so no mutation can turn it into a CACHE_MISS."""
        rng = self.rng
        program, blobs = base_program(rng, blobs=rng.random() < 0.5)
        program["options"]["gpu_count"] = 1
        b = self.boundary()
        while True:  # until gpu_count survived: deleting exactly ', "gpu_count": 1' would leave a valid program
            body, ops = self.mutate(bytearray(program_body(program, blobs, b)))
            if b'"gpu_count": 1' in body:
                return "byte-mutation", " ".join(ops), self.envelope(bytes(body), b)

    def mutate(self, body):
        rng = self.rng
        ops = []
        for _ in range(rng.randrange(1, 6)):
            op = rng.choice(["flip", "insert", "delete", "duplicate", "truncate"])
            at = rng.randrange(len(body))
            if op == "flip":
                body[at] ^= 1 << rng.randrange(8)
            elif op == "insert":
                body[at:at] = rng.randbytes(rng.randrange(1, 8))
            elif op == "delete":
                del body[at:at + rng.randrange(1, 16)]
            elif op == "duplicate":
                body[at:at] = body[at:at + rng.randrange(1, 64)]
            else:
                del body[at:]
            ops.append(f"{op}@{at}")
            if not body:
                body = bytearray(b"-")
        return body, ops

    def http_headers(self):
        rng = self.rng
        program, blobs = base_program(rng)
        b = self.boundary()
        body = program_body(program, blobs, b)
        # only what the server reads before refusing is sent: unread bytes would make its close a reset
        head = self.envelope(body, b)[:-len(body) - 2]
        if rng.random() < 0.5:
            kind, junk = "header line over 64 KiB", b"X-Junk: " + b"a" * (65537 - 10) + b"\r\n"
        else:
            kind, junk = "more than 100 headers", b"".join(b"X-Junk-%d: %d\r\n" % (i, i) for i in range(98))
        return "http-headers", kind, head + junk, 431, "close"

    def chunked(self):
        rng = self.rng
        program, blobs = base_program(rng, blobs=rng.random() < 0.5)
        b = self.boundary()
        body = program_body(program, blobs, b)
        ct = f"multipart/form-data; boundary=\"{b.decode()}\""
        kind = rng.choice(["bad-size", "over-limit", "truncated-multipart"])
        if kind == "bad-size":
            size = rng.choice([b"-5", b"+5", b"0x5", b"zz", b"", b"5 5", b"\xb2"])
            chunks = size + b"\r\nabcde\r\n0\r\n\r\n"
            expected = 400
        elif kind == "over-limit":  # refused at the chunk header that crosses the limit, nothing unread
            first = rng.choice([0, self.limit // 2])
            chunks = (b"%x\r\n" % first + b"x" * first + b"\r\n" if first else b"") + b"%x\r\n" % (self.limit + 1)
            return "chunked", kind, http_request(b"", ct, length="omit",
                                                 headers=["Transfer-Encoding: chunked"]) + chunks, 413, "close"
        else:
            cut = body[:rng.randrange(1, len(body) - 10)]
            chunks = b"%x\r\n" % len(cut) + cut + b"\r\n0\r\n\r\n"
            expected = 400
        return "chunked", kind, http_request(b"", ct, length="omit", headers=["Transfer-Encoding: chunked"]) + chunks, \
            expected, "close"


FUZZ_LIMIT = 4 << 20  # --max-request-bytes of the fuzzed server, so oversized bodies stay cheap


def fuzz_item(scale, workdir, seed=None):
    seed = random.randrange(1 << 30) if seed is None else seed
    server = Server(workdir, "--max-request-bytes", str(FUZZ_LIMIT))
    counts = collections.Counter()
    failures, figures = [], {}
    try:
        baseline = Baseline(server)
        fuzzer = Fuzzer(seed, FUZZ_LIMIT)
        breakers = fuzzer.breakers()
        client = RawClient(server.port)
        started = time.monotonic()
        for i in range(scale.fuzz):
            name, description, data, expected, mode = breakers[i] if i < len(breakers) else fuzzer.case(i)
            try:
                status, headers, body = client.exchange(data, mode)
                check_4xx(status, headers, body, expected)
                counts[f"status {status}"] += 1
            except Exception as exc:  # keep going: report every input that broke
                client.close()
                failures.append(f"#{i} {name} [{description}] mode={mode}: {type(exc).__name__}: {str(exc)[:300]}")
            counts[name] += 1
            if (i + 1) % scale.valid_every == 0:
                valid_request_ok(server.url)
                counts["valid requests in between"] += 1
        elapsed = time.monotonic() - started
        client.close()
        valid_request_ok(server.url)
        figures |= {"requests": scale.fuzz, "seed": seed, "rate/s": round(scale.fuzz / elapsed),
                    "connections": client.connections, **dict(sorted(counts.items())),
                    "not answered 4xx": failures, **baseline.leaks()}
    finally:
        figures["exit code"] = server.stop()
    return figures


# --- 1b. properties of the parser and the validator (hypothesis) -------------------------

BCHARS = string.ascii_letters + string.digits + "'()+_,-./:=?"
NAME_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n\0")


@st.composite
def multipart_bodies(draw):
    """(body, boundary, [(name, media, payload)]) encoded with the framing variations docs/protocol.md §4.4 allows."""
    boundary = draw(st.text(BCHARS, min_size=1, max_size=70)).encode()
    parts = draw(st.lists(st.tuples(st.text(NAME_CHARS, min_size=1, max_size=12),
                                    st.sampled_from(["application/json", "application/octet-stream",
                                                     "text/plain; charset=utf-8", "APPLICATION/JSON"]),
                                    st.binary(max_size=300)), min_size=1, max_size=6))
    newline = draw(st.sampled_from([b"\r\n", b"\n"]))
    for _, _, payload in parts:  # a payload may not contain a delimiter, nor end in an ambiguous CR
        assume(b"--" + boundary not in payload and not (newline == b"\n" and payload.endswith(b"\r")))
    encoded = []
    for name, media, payload in parts:
        escaped = name.replace("\\", "\\\\").replace('"', '\\"')
        disp_name = draw(st.sampled_from(["Content-Disposition", "content-disposition", "CONTENT-DISPOSITION"]))
        extra = draw(st.sampled_from(["", '; filename="f.bin"', "; filename=x"]))
        headers = [f'{disp_name}: form-data; name="{escaped}"{extra}'.encode(),
                   f"{draw(st.sampled_from(['Content-Type', 'content-type']))}: {media}".encode()]
        if draw(st.booleans()):
            headers.append(b"Content-Transfer-Encoding: " + draw(st.sampled_from([b"binary", b"8bit", b"BINARY"])))
        if draw(st.booleans()):
            headers.reverse()
        encoded.append((headers, payload))
    padding = draw(st.sampled_from([b"", b" ", b"\t ", b"  \t"]))
    preamble = draw(st.sampled_from([b"", b"preamble text" + newline, b"\r\n"]))
    epilogue = draw(st.sampled_from([b"", b"epilogue", b"\r\n--" + boundary + b"--\r\n"]))
    # the epilogue starts on the line after the close delimiter: `--B--epilogue` is refused (RFC 2046)
    final_newline = draw(st.booleans()) or epilogue == b"epilogue"
    body = encode_parts(encoded, boundary, newline, padding, preamble, epilogue, final_newline)
    return body, boundary, [(name, media.split(";")[0].lower(), payload) for name, media, payload in parts]


def property_multipart_round_trip(examples):
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(multipart_bodies())
    def prop(case):
        body, boundary, parts = case
        parsed = [(headers, body[start:end]) for headers, start, end in kcoral.multipart_ranges(body, boundary)]
        assert len(parsed) == len(parts)
        for (headers, payload), (name, media, original) in zip(parsed, parts):
            assert bytes(payload) == original
            assert kcoral.check_part_headers(headers) == (name, media)
    prop()


def property_split_request_round_trip(examples):
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=200), st.lists(st.binary(max_size=200), max_size=4, unique_by=sha256),
           st.text(BCHARS, min_size=1, max_size=70), st.randoms(use_true_random=False),
           st.sampled_from(["multipart/form-data; boundary={}", 'multipart/form-data; boundary="{}"',
                            'Multipart/Form-Data; charset=utf-8; BOUNDARY="{}"']))
    def prop(program, blobs, boundary, rnd, content_type):
        b = boundary.encode()
        assume(all(b"--" + b not in x for x in [program] + blobs))
        if "{}" in content_type and '"' not in content_type:
            assume(kcoral.TOKEN.fullmatch(boundary))
        parts = [(part_headers("program", "application/json"), program)]
        parts += [(part_headers(f"blob:{sha256(x)}"), x) for x in blobs]
        rnd.shuffle(parts)
        split = kcoral.split_request(encode_parts(parts, b), content_type.format(boundary))
        assert bytes(split.program_json) == program
        assert {h: bytes(v) for h, v in split.supplied.items()} == {sha256(x): x for x in blobs}
    prop()


def property_multipart_garbage(examples):
    """Whatever the bytes, the parser answers with parts or ValidationError (400), nothing else."""
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(st.binary(max_size=600), multipart_bodies().map(lambda c: c[0])),
           st.lists(st.tuples(st.integers(0, 10 ** 6), st.binary(min_size=0, max_size=4)), max_size=6),
           st.one_of(st.text(max_size=60), st.just("multipart/form-data; boundary=B")))
    def prop(body, edits, content_type):
        body = bytearray(body)
        for at, data in edits:
            at = at % (len(body) + 1)
            body[at:at + len(data) // 2] = data
        for call in (lambda: list(kcoral.multipart_ranges(bytes(body), b"B")),
                     lambda: kcoral.split_request(bytes(body), content_type)):
            try:
                call()
            except ValidationError:
                pass
    prop()


VOCABULARY = ["instructions", "options", "op", "id", "kind", "source", "blob", "dtype", "shape", "path",
              "module", "name", "cpu_only", "fn", "args", "key", "value", "$ref", "timeout_seconds",
              "output_limit_bytes", "gpu_count", "upload", "get_function", "run", "return", "module", "tensor",
              "bytes", "library", "file", "folder", "float32", "bool", "m", "fn", "r", "a" * 64, "./a//b", "..",
              "/abs", ""]
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2 ** 70, 2 ** 70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=10),
                    st.sampled_from(VOCABULARY), st.integers(300, 900).map(nested),
                    st.just(float("inf")), st.just(10 ** 4000))
json_values = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=5),
    st.dictionaries(st.one_of(st.sampled_from(VOCABULARY), st.text(max_size=6)), children, max_size=5),
    st.builds(lambda v: {"$ref": v}, st.sampled_from(["m", "fn", "r", "x", ""]))), max_leaves=25)


def rich_program():
    program, _ = base_program(random.Random(0), blobs=True)
    program["instructions"][2:2] = [
        {"op": "upload", "id": "t", "kind": "tensor", "blob": "b" * 64, "dtype": "float32", "shape": [2, 3]},
        {"op": "upload", "id": "l", "kind": "library", "blob": "c" * 64},
        {"op": "get_function", "id": "g", "module": {"$ref": "m"}, "name": "f", "cpu_only": True}]
    program["instructions"].append({"op": "return", "key": "dir", "kind": "folder", "path": {"$ref": "file"}})
    program["options"].update(output_limit_bytes=10, gpu_count=1)
    return program


BASE_PROGRAMS = [base_program(random.Random(0))[0], base_program(random.Random(0), blobs=True)[0], rich_program()]


def slots_of(value):
    """Every (container, key-or-index) below `value`."""
    found, stack = [], [value]
    while stack:
        v = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, child in items:
            found.append((v, k))
            stack.append(child)
    return found


def property_program_validator(examples):
    """parse_program raises only ValidationError, for any JSON and for mutated valid programs."""
    def only_validation_errors(value):
        try:
            kcoral.parse_program(value)
        except ValidationError:
            pass
        try:
            text = json.dumps(value).encode()
        except (ValueError, RecursionError):
            return
        try:
            kcoral.parse_program(kcoral.strict_json(text))
        except ValidationError:
            pass

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(json_values)
    def arbitrary(value):
        only_validation_errors(value)
        only_validation_errors({"instructions": value})
        only_validation_errors({"instructions": [value]})

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def mutated(data):
        program = copy.deepcopy(data.draw(st.sampled_from(BASE_PROGRAMS)))
        for _ in range(data.draw(st.integers(1, 4))):
            slots = slots_of(program)
            if not slots:
                break
            container, key = data.draw(st.sampled_from(slots))
            action = data.draw(st.sampled_from(["replace", "replace", "delete", "insert"]))
            if action == "replace":
                container[key] = data.draw(json_values)
            elif action == "delete":
                del container[key]
            elif isinstance(container, dict):
                container[data.draw(st.sampled_from(VOCABULARY))] = data.draw(json_values)
            else:
                container.insert(key, data.draw(json_values))
        only_validation_errors(program)

    arbitrary()
    mutated()


PROPERTIES = [property_multipart_round_trip, property_split_request_round_trip, property_multipart_garbage,
              property_program_validator]


def property_item(scale, workdir):
    """Each property with `scale.examples` examples -> those falsified, with the error."""
    started = time.monotonic()
    n = scale.examples
    falsified = {}
    for prop in PROPERTIES:
        ok, result = capture(prop, n)
        if not ok:
            falsified[prop.__name__] = result
    return {"properties": len(PROPERTIES), "examples each": n, "seconds": round(time.monotonic() - started, 1),
            "falsified": falsified}


# --- 2. faults -------------------------------------------------------------------------

def crashed(index=2, op="run"):
    """docs/protocol.md §10: the worker died while an instruction index was known."""
    def check(status, headers, body, tag):
        assert status == 200 and body["status"] == "FAILED", body
        error = body["error"]
        assert error["kind"] == "runtime", error
        assert error["message"].startswith("worker exited while executing the instruction: "), error  # and why
        assert (error["instruction_index"], error["instruction_op"]) == (index, op), error
    return check


def timed_out(status, headers, body, tag):
    body = assert_error_body(status, headers, body, 504, "timeout")
    assert body["error"]["message"].startswith("execution timed out after "), body


def left_background(status, headers, body, tag):
    assert status == 200 and body["status"] == "FAILED", body
    error = body["error"]
    assert error["kind"] == "runtime", error
    assert error["message"] == "program left background processes running; they were terminated", error
    assert body["results"]["out"] == {"type": "integer", "value": 1}, body  # results are kept


def returns(value):
    def check(status, headers, body, tag):
        assert status == 200, body
        assert completed(body)["out"] == value, body
    return check


def failed(kind, text=""):
    def check(status, headers, body, tag):
        assert status == 200 and body["status"] == "FAILED", body
        assert body["error"]["kind"] == kind and text in body["error"]["message"], body["error"]
    return check


def flooded(stream):
    def check(status, headers, body, tag):
        assert status == 200, body
        completed(body)
        assert body[stream] == "x" * 1000 and body[f"{stream}_truncated"] is True, body[stream][:50]
    return check


def replaced_output(status, headers, body, tag):
    assert status == 200 and completed(body)["out"]["value"] == 1, body
    assert body["stdout"] == "ok\ufffd\ufffd", body["stdout"]


def surrogate_id(status, headers, body, tag):
    assert status == 200 and body["status"] == "FAILED", body
    assert body["error"]["instruction_id"] == "\ud800" and body["error"]["kind"] == "engine", body["error"]


def too_large(status, headers, body, tag):
    assert_error_body(status, headers, body, 500, "response_too_large")  # docs/protocol.md §9.8


def nested_400(status, headers, body, tag):
    assert status == 200, body
    value, depth = completed(body)["out"], 0
    while value["value"]:
        value, depth = value["value"][0], depth + 1
    assert depth == 399, depth


def survived(status, headers, body, tag):
    assert status == 200 and body["status"] in ("COMPLETED", "FAILED"), body


def file_after_chdir(status, headers, body, tag):
    assert status == 200, body
    results = completed(body)
    assert results["report"]["type"] == "file", results
    assert body["_parts"][results["report"]["part"]] == f"payload {tag}".encode()


def folder_after_chdir(status, headers, body, tag):
    assert status == 200, body
    results = completed(body)
    assert set(results["report"]["files"]) == {"a.txt", "sub/b.txt"}, results


def faults(scale):
    """[(name, program, check)]: each injected fault and the answer the spec requires."""
    flood = scale.flood_bytes
    loop = "def f():\n    while True:\n        pass\n"
    fill = ("def f():\n    chunk = b'\\0' * (8 << 20)\n    with open('fill.bin', 'wb') as out:\n"
            f"        for _ in range({scale.fill_bytes} // len(chunk)):\n            out.write(chunk)\n"
            "    import os\n    return os.path.getsize('fill.bin')\n")
    chdir = ("import os\ndef f(tag):\n    with open('out.txt', 'w') as out:\n        out.write('payload ' + tag)\n"
             "    os.makedirs('d/sub')\n    open('d/a.txt', 'w').close()\n    open('d/sub/b.txt', 'w').close()\n"
             "    os.chdir('/')\n    return 1\n")
    T = "{tag}"
    return [
        ("os._exit(3)", "import os\ndef f():\n    os._exit(3)\n", None, crashed()),
        ("os._exit(0)", "import os\ndef f():\n    os._exit(0)\n", None, crashed()),
        ("SIGKILL to itself", "import os, signal\ndef f():\n    os.kill(os.getpid(), signal.SIGKILL)\n", None, crashed()),
        ("SIGSEGV (ctypes.string_at(0))", "import ctypes\ndef f():\n    ctypes.string_at(0)\n", None, crashed()),
        ("abort()", "import os\ndef f():\n    os.abort()\n", None, crashed()),
        ("C stack overflow", "import sys\ndef f():\n    sys.setrecursionlimit(10 ** 8)\n    v = []\n"
                             "    for _ in range(10 ** 6):\n        v = [v]\n    return repr(v)\n", None, crashed()),
        ("SIGKILL to its process group", "import os, signal\ndef f():\n    os.killpg(0, signal.SIGKILL)\n",
         None, crashed()),
        ("SystemExit", "def f():\n    raise SystemExit(3)\n", None, crashed()),
        ("KeyboardInterrupt", "def f():\n    raise KeyboardInterrupt\n", None, crashed()),
        ("os._exit in module top level", "import os\nos._exit(1)\n", None, crashed(0, "upload")),
        ("infinite loop past the timeout", loop, {"timeout_seconds": 1}, timed_out),
        ("sleep past the timeout", "import time\ndef f():\n    time.sleep(120)\n", {"timeout_seconds": 1}, timed_out),
        ("loop ignoring SIGTERM past the timeout", "import signal\n" + loop.replace(
            "def f():\n", "def f():\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"), {"timeout_seconds": 1},
         timed_out),
        ("SIGSTOP to itself past the timeout", "import os, signal\ndef f():\n    os.kill(os.getpid(), signal.SIGSTOP)\n",
         {"timeout_seconds": 1}, timed_out),
        ("sleep 600 left running, then timeout", "import subprocess\ndef f():\n"
         f"    subprocess.Popen(['sleep', '600', '{T}'])\n    while True:\n        pass\n", {"timeout_seconds": 1},
         timed_out),
        ("sleep 600 left running", "import subprocess\ndef f():\n"
         f"    subprocess.Popen(['sleep', '600', '{T}'])\n    return 1\n", None, left_background),
        ("sleep 600 ignoring SIGTERM left running", "import subprocess\ndef f():\n"
         f"    subprocess.Popen(['sh', '-c', 'trap \"\" TERM; sleep 600 {T}'])\n    return 1\n", None, left_background),
        ("orphaned grandchild (sleep 600 &)", "import subprocess\ndef f():\n"
         f"    subprocess.run('sleep 600 {T} &', shell=True)\n    return 1\n", None, left_background),
        ("50 children left running", "import subprocess\ndef f():\n    for _ in range(50):\n"
         f"        subprocess.Popen(['sleep', '600', '{T}'])\n    return 1\n", None, left_background),
        ("sleep 600 in a new session (setsid)", "import subprocess\ndef f():\n"
         f"    subprocess.Popen(['sleep', '600', '{T}'], start_new_session=True)\n    return 1\n", None, left_background),
        ("sleep 600 in a new session, then crash", "import os, subprocess\ndef f():\n"
         f"    subprocess.Popen(['sleep', '600', '{T}'], start_new_session=True)\n    os._exit(1)\n", None, crashed()),
        ("sleep 600 in a new session, then timeout", "import subprocess\ndef f():\n"
         f"    subprocess.Popen(['sleep', '600', '{T}'], start_new_session=True)\n    while True:\n        pass\n",
         {"timeout_seconds": 1}, timed_out),
        (f"{flood >> 20} MB to fd 1, output limit 1000", "import os\ndef f():\n    chunk = b'x' * (1 << 20)\n"
         f"    for _ in range({flood} >> 20):\n        os.write(1, chunk)\n    return 1\n",
         {"output_limit_bytes": 1000}, flooded("stdout")),
        (f"{flood >> 20} MB to fd 2, output limit 1000", "import os\ndef f():\n    chunk = b'x' * (1 << 20)\n"
         f"    for _ in range({flood} >> 20):\n        os.write(2, chunk)\n    return 1\n",
         {"output_limit_bytes": 1000}, flooded("stderr")),
        (f"{flood >> 20} MB to stdout from a subprocess", "import subprocess\ndef f():\n"
         f"    subprocess.run('head -c {flood} /dev/zero | tr \"\\\\0\" x', shell=True)\n    return 1\n",
         {"output_limit_bytes": 1000}, flooded("stdout")),
        (f"{flood >> 20} MB to stdout, capture off", "import os\ndef f():\n    chunk = b'x' * (1 << 20)\n"
         f"    for _ in range({flood} >> 20):\n        os.write(1, chunk)\n    return 1\n",
         {"output_limit_bytes": 0}, returns({"type": "integer", "value": 1})),
        ("invalid UTF-8 on stdout", "import os\ndef f():\n    os.write(1, b'ok\\xff\\xfe')\n    return 1\n", None,
         replaced_output),
        (f"workspace filled with {scale.fill_bytes >> 20} MiB", fill, {"timeout_seconds": 120},
         returns({"type": "integer", "value": scale.fill_bytes})),
        ("fd 1 and 2 closed", "import os\ndef f():\n    os.close(1)\n    os.close(2)\n    return 1\n", None,
         returns({"type": "integer", "value": 1})),
        ("fd 1 and 2 closed, then print", "import os\ndef f():\n    os.close(1)\n    os.close(2)\n"
         "    print('lost' * 10000)\n    return 1\n", None, survived),
        ("every fd closed", "import os\ndef f():\n    os.closerange(0, 4096)\n    return 1\n", None, survived),
        ("fd table exhausted", "def f():\n    files = []\n    try:\n        while True:\n"
         "            files.append(open('/dev/null'))\n    except OSError:\n        return 1\n", None,
         returns({"type": "integer", "value": 1})),
        ("os.chdir('/') before a file return", chdir, None, file_after_chdir),
        ("os.chdir('/') before a folder return", chdir, None, folder_after_chdir),
        ("workspace deleted", "import os, shutil\ndef f():\n    shutil.rmtree(os.getcwd())\n    return 1\n", None,
         returns({"type": "integer", "value": 1})),
        ("MemoryError", "def f():\n    return bytearray(1 << 52)\n", None, failed("engine", "MemoryError")),
        ("RecursionError", "def f(n=0):\n    return f(n + 1)\n", None, failed("engine", "RecursionError")),
        ("value return over max_response_bytes", "def f():\n    return b'x' * (40 << 20)\n", None,
         too_large),
        ("file return over max_response_bytes", "def f():\n    with open('big', 'wb') as out:\n"
         "        out.truncate(40 << 20)\n    return 'big'\n", None, failed("serialization")),
        # beyond the encoder's 400 levels (docs/protocol.md §9.5); 400 itself returns
        ("return nested 401 deep", "def f():\n    v = []\n    for _ in range(401):\n        v = [v]\n    return v\n",
         None, failed("serialization")),
        ("return nested 400 deep", "def f():\n    v = []\n    for _ in range(399):\n        v = [v]\n    return v\n",
         None, nested_400),
        ("return 10**5000", "def f():\n    return 10 ** 5000\n", None, failed("serialization")),
        ("return a lone surrogate", "def f():\n    return '\\ud800'\n", None,
         returns({"type": "string", "value": "\ud800"})),
        ("lone surrogate in a failing instruction's id", "def f():\n    raise ValueError('\\udcff')\n", None,
         surrogate_id),
        ("SIGKILL to its parent (the forkserver)", "import os, signal\ndef f():\n"
         "    os.kill(os.getppid(), signal.SIGKILL)\n    return 1\n", None, failed("runtime")),
        ("non-daemon thread left running", "import threading, time\ndef f():\n"
         "    threading.Thread(target=time.sleep, args=(600,)).start()\n    return 1\n", None,
         returns({"type": "integer", "value": 1})),
    ]


def build_fault(name, source, options, tag):
    source = source.replace("{tag}", tag)
    if "udcff" in source:
        program = simple_program(source, options=options)
        program["instructions"][2]["id"] = "\ud800"
        program["instructions"][3]["value"] = {"$ref": "\ud800"}
        return program
    if "open('big'" in source:
        program = simple_program(source, options=options)
        program["instructions"][-1] = {"op": "return", "key": "out", "kind": "file", "path": {"$ref": "r"}}
        return program
    if "os.chdir('/')" in source:
        kind = "folder" if "folder" in name else "file"
        path = "d" if kind == "folder" else "out.txt"
        program = simple_program(source, args=[tag], options=options)
        program["instructions"][-1] = {"op": "return", "key": "report", "kind": kind, "path": path}
        return program
    return simple_program(source, options=options)


def fault_item(scale, workdir):
    server = Server(workdir, "--max-response-bytes", str(32 << 20))
    tag = new_tag()
    counts = collections.Counter()
    failures, figures = [], {}
    try:
        baseline = Baseline(server)
        table = faults(scale)
        rss_before = server.rss_kib()
        for round_ in range(scale.fault_rounds):
            for name, source, options, check in table:
                try:
                    status, headers, body = post(server.url, build_fault(name, source, options, tag), timeout=300)
                    check(status, headers, body, tag)
                    valid_request_ok(server.url)
                    deadline = time.monotonic() + 10
                    while tagged(tag) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    assert not tagged(tag), f"left running: {tagged(tag)}"
                    counts["answered as specified"] += 1
                except Exception as exc:
                    failures.append(f"round {round_} {name}: {type(exc).__name__}: {str(exc)[:400]}")
                    for pid in tagged(tag):  # don't let one failure spoil the following checks
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
                counts["fault requests"] += 1
        figures |= {"requests": counts["fault requests"] * 2, **dict(counts), "fault kinds": len(table),
                    "not answered as specified": failures,
                    "server RSS growth MiB": (server.rss_kib() - rss_before) >> 10, **baseline.leaks(tag)}
    finally:
        figures["exit code"] = server.stop()
        for pid in tagged(tag):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return figures


# --- 3. cache faults -----------------------------------------------------------------------

FILE_SHA = ("import hashlib\ndef f(path):\n    with open(path, 'rb') as src:\n"
            "        return hashlib.sha256(src.read()).hexdigest()\n")


def file_program(digest):
    return {"instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": FILE_SHA},
        {"op": "upload", "id": "data", "kind": "file", "blob": digest, "path": "in/data.bin"},
        {"op": "get_function", "id": "fn", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "fn"}, "args": [{"$ref": "data"}]},
        {"op": "return", "key": "out", "value": {"$ref": "r"}}]}


def bytes_program(digest, until=None):
    """Returns len(blob); with `until`, first waits (≤ 60 s) for that file to exist."""
    source = ("import os, time\ndef f(data, until):\n    deadline = time.monotonic() + 60\n"
              "    while until and not os.path.exists(until) and time.monotonic() < deadline:\n"
              "        time.sleep(0.02)\n    return len(data)\n")
    return {"instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": source},
        {"op": "upload", "id": "data", "kind": "bytes", "blob": digest},
        {"op": "get_function", "id": "fn", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "fn"}, "args": [{"$ref": "data"}, until]},
        {"op": "return", "key": "out", "value": {"$ref": "r"}}]}


def expect_miss(url, program, digest, what):
    status, _, body = post(url, program)
    assert status == 200 and body == {"status": "CACHE_MISS", "request_id": body["request_id"],
                                      "missing_blobs": [digest]}, f"{what}: {body}"


def expect_file_ok(url, program, blob, what, supply=True):
    status, _, body = post(url, program, [blob] if supply else [])
    assert status == 200, f"{what}: {body}"
    assert completed(body, what)["out"] == {"type": "string", "value": sha256(blob)}, f"{what}: {body}"


def corrupt_entry(path, how):
    if how == "flipped byte":
        with open(path, "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0x40]))
    elif how == "truncated":
        os.truncate(path, 7)
    elif how == "symlink":
        os.replace(path, path + ".real")
        os.symlink(path + ".real", path)
    elif how == "directory":
        os.unlink(path)
        os.mkdir(path)
    else:
        raise AssertionError(how)


def cache_corruption(workdir, counts):
    """A damaged disk-cache entry is a miss, and the resend repairs it (docs/protocol.md §7.5)."""
    server = Server(workdir)
    try:
        for how in ("flipped byte", "truncated", "symlink", "directory"):
            blob = os.urandom(4096)
            digest = sha256(blob)
            program = file_program(digest)
            expect_miss(server.url, program, digest, "first request")
            expect_file_ok(server.url, program, blob, "resend")
            expect_file_ok(server.url, program, blob, "cached", supply=False)
            entry = os.path.join(server.disk_cache, "v1", digest[:2], digest)
            # the answer does not wait for the disk write: the entry lands just after it
            assert wait_for(lambda entry=entry: os.path.isfile(entry), 10), f"{how}: never written"
            corrupt_entry(entry, how)
            expect_miss(server.url, program, digest, f"after {how}")
            expect_file_ok(server.url, program, blob, f"resend after {how}")
            expect_file_ok(server.url, program, blob, f"cached again after {how}", supply=False)
            assert wait_for(lambda entry=entry: os.path.isfile(entry) and not os.path.islink(entry)
                            and sha256(open(entry, "rb").read()) == digest, 10), f"{how}: entry not repaired"
            counts[f"corrupted entry ({how})"] += 1
            counts["requests"] += 6
    finally:
        assert server.stop() == 0


def cache_unwritable(workdir, counts):
    """Requests run whatever state the disk cache directory is in."""
    blocker = os.path.join(workdir, "a-regular-file")
    with open(blocker, "w") as f:
        f.write("not a directory")
    for label, flags, damage in [
            ("dir under a regular file", ["--disk-cache-dir", os.path.join(blocker, "cache")], None),
            ("dir chmod 0500", [], "chmod"),
            ("v1/<ab> is a regular file", [], "file")]:
        server = Server(workdir, *flags)
        try:
            blob = os.urandom(2048)
            digest = sha256(blob)
            program = file_program(digest)
            if damage == "chmod":
                os.chmod(os.path.join(server.disk_cache, "v1"), 0o500)
                os.chmod(server.disk_cache, 0o500)
            elif damage == "file":
                with open(os.path.join(server.disk_cache, "v1", digest[:2]), "w") as f:
                    f.write("x")
            expect_miss(server.url, program, digest, label)
            expect_file_ok(server.url, program, blob, label)
            if damage != "chmod" or os.geteuid() != 0:  # root writes through 0500 anyway
                # the blob is served from the request body until its disk write ends (it fails here):
                # from then on it is a miss, never a stale or partial entry
                def missed():
                    return post(server.url, program)[2]["status"] == "CACHE_MISS"
                assert wait_for(missed, 10), f"{label}: still served after its disk write failed"
            expect_file_ok(server.url, program, blob, label)
            valid_request_ok(server.url)
            counts[f"unwritable cache ({label})"] += 1
            counts["requests"] += 5
        finally:
            with contextlib.suppress(OSError):
                os.chmod(server.disk_cache, 0o700)
                os.chmod(os.path.join(server.disk_cache, "v1"), 0o700)
            assert server.stop() == 0


def cache_pinning(workdir, counts, pressure=24):
    """docs/protocol.md §7.4: a blob pinned by a running request survives eviction pressure from concurrent uploads."""
    size = 900 << 10
    server = Server(workdir, "--cache-capacity-bytes", str(4 << 20))  # room for 4 such blobs
    try:
        blob_a = os.urandom(size)
        a = sha256(blob_a)
        slow = {}
        release = os.path.join(workdir, f"release-{uuid.uuid4().hex}")

        def run_slow():  # holds A pinned until `release` exists
            slow["answer"] = post(server.url, bytes_program(a, until=release), [blob_a])

        thread = threading.Thread(target=run_slow)
        thread.start()
        deadline = time.monotonic() + 30
        while server.health()["load"]["requests_in_progress"] < 1:
            assert time.monotonic() < deadline, "slow request never started"
            time.sleep(0.02)
        others = [os.urandom(size) for _ in range(pressure)]

        def upload(blob):
            status, _, body = post(server.url, bytes_program(sha256(blob)), [blob])
            assert status == 200 and completed(body)["out"]["value"] == size, body

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(upload, others))
        status, _, body = post(server.url, bytes_program(sha256(others[0])))
        assert body["status"] == "CACHE_MISS", f"no eviction pressure? {body}"
        status, _, body = post(server.url, bytes_program(a))  # A not supplied: must come from the cache
        assert thread.is_alive(), "the slow request ended before the probe; cannot conclude"
        assert status == 200 and completed(body, "pinned blob")["out"]["value"] == size, body
        with open(release, "w"):
            pass
        join_threads([thread], 120)
        status, _, body = slow["answer"]
        assert status == 200 and completed(body, "slow request")["out"]["value"] == size, body
        with ThreadPoolExecutor(4) as pool:  # unpinned now: more pressure evicts it
            list(pool.map(upload, [os.urandom(size) for _ in range(6)]))
        status, _, body = post(server.url, bytes_program(a))
        assert body["status"] == "CACHE_MISS", f"A was never evicted after unpinning: {body}"
        counts["pinned blob kept under pressure"] += 1
        counts["requests"] += pressure + 10
    finally:
        assert server.stop() == 0


def cache_item(scale, workdir):
    """Each cache scenario in turn -> what it counted, and the scenarios that failed, with the error."""
    counts, failed = collections.Counter(), {}
    for scenario in (cache_corruption, cache_unwritable, cache_pinning):
        ok, result = capture(scenario, workdir, counts)
        if not ok:
            failed[scenario.__name__] = result
    return {**dict(counts), "failed": failed}


# --- 4. load -----------------------------------------------------------------------------

ECHO = "def f(x):\n    return x\n"
REVERSE = "def f(data):\n    return data[::-1]\n"
UPPER = ("def f(path):\n    with open(path) as src, open('out.txt', 'w') as out:\n"
         "        out.write(src.read().upper())\n    return 'out.txt'\n")
RAISE = "def f(x):\n    raise ValueError(x)\n"
PRINT = "def f(x):\n    print(x)\n    return 0\n"
LOAD_KINDS = ("echo", "bytes", "file", "fail", "invalid", "cache_miss", "stdout")


def upload_run(source, upload, args, returns_file=False):
    ins = [{"op": "upload", "id": "m", "kind": "module", "source": source}, upload,
           {"op": "get_function", "id": "fn", "module": {"$ref": "m"}, "name": "f"},
           {"op": "run", "id": "r", "fn": {"$ref": "fn"}, "args": args}]
    if returns_file:
        ins.append({"op": "return", "key": "out", "kind": "file", "path": {"$ref": "r"}})
    else:
        ins.append({"op": "return", "key": "out", "value": {"$ref": "r"}})
    return {"instructions": ins}


def load_request(i):
    """(program, blobs, check(status, body)) for request i; every answer must carry its nonce."""
    nonce = f"n{i}-{uuid.uuid4().hex}"
    kind = LOAD_KINDS[i % len(LOAD_KINDS)]
    if kind == "echo":
        def check(status, body):
            assert completed(body)["out"] == {"type": "string", "value": nonce}
        return simple_program(ECHO, args=[nonce]), [], check
    if kind == "bytes":
        blob = nonce.encode() * 37
        program = upload_run(REVERSE, {"op": "upload", "id": "b", "kind": "bytes", "blob": sha256(blob)},
                             [{"$ref": "b"}])

        def check(status, body):
            out = completed(body)["out"]
            assert body["_parts"][out["part"]] == blob[::-1] and out["sha256"] == sha256(blob[::-1])
        return program, [blob], check
    if kind == "file":
        blob = nonce.encode()
        program = upload_run(UPPER, {"op": "upload", "id": "b", "kind": "file", "blob": sha256(blob),
                                     "path": f"in/{nonce}.txt"}, [{"$ref": "b"}], returns_file=True)

        def check(status, body):
            out = completed(body)["out"]
            assert body["_parts"][out["part"]] == nonce.upper().encode() and out["size"] == len(nonce)
        return program, [blob], check
    if kind == "fail":
        def check(status, body):
            assert body["status"] == "FAILED" and body["error"]["message"] == f"ValueError: {nonce}", body
        return simple_program(RAISE, args=[nonce]), [], check
    if kind == "invalid":
        program = simple_program(ECHO, args=[nonce])
        program["instructions"][1]["op"] = nonce

        def check(status, body):
            assert status == 400 and body["error"]["kind"] == "parse" and nonce in body["error"]["message"], body
        return program, [], check
    if kind == "cache_miss":
        digest = sha256(nonce.encode())
        program = upload_run(ECHO, {"op": "upload", "id": "b", "kind": "bytes", "blob": digest}, [{"$ref": "b"}])

        def check(status, body):
            assert body == {"status": "CACHE_MISS", "request_id": body["request_id"], "missing_blobs": [digest]}
        return program, [], check

    def check(status, body):
        assert completed(body)["out"]["value"] == 0 and body["stdout"] == nonce + "\n", body
    return simple_program(PRINT, args=[nonce]), [], check


def load_item(scale, workdir):
    server = Server(workdir)
    local = threading.local()
    connections = []
    lock = threading.Lock()
    figures = {}
    try:
        baseline = Baseline(server)

        def one(i):
            conn = getattr(local, "conn", None)
            if conn is None:
                conn = local.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
                with lock:
                    connections.append(conn)
            program, blobs, check = load_request(i)
            body, content_type = multipart(program_parts(program, blobs))
            headers = {"Content-Type": content_type}
            sent_id = str(uuid.uuid4()) if i % 3 == 0 else None
            if sent_id:
                headers["X-Request-ID"] = sent_id
            conn.request("POST", "/execute", body, headers)
            response = conn.getresponse()
            data = response.read()
            hdrs = {k.lower(): v for k, v in response.getheaders()}
            decoded = decode_response(hdrs, data)
            try:
                check(response.status, decoded)
                assert hdrs["x-request-id"] == decoded["request_id"]
                assert sent_id is None or decoded["request_id"] == sent_id
            except (AssertionError, KeyError) as exc:
                raise AssertionError(f"request {i} ({LOAD_KINDS[i % len(LOAD_KINDS)]}): "
                                     f"HTTP {response.status} {str(decoded)[:500]}") from exc
            return decoded["request_id"]

        started = time.monotonic()
        with ThreadPoolExecutor(scale.concurrency) as pool:
            outcomes = list(pool.map(lambda i: (i, capture(one, i)), range(scale.load)))
        elapsed = time.monotonic() - started
        for conn in connections:
            conn.close()
        errors = [f"{i}: {result}" for i, (ok, result) in outcomes if not ok]
        ids = [result for _, (ok, result) in outcomes if ok]
        figures |= {"requests": scale.load, "concurrency": scale.concurrency, "lost or wrong": errors,
                    "answered": len(ids), "distinct request ids": len(set(ids)),
                    "rate/s": round(scale.load / elapsed, 1), "health after": server.wait_idle(), **baseline.leaks()}
    finally:
        figures["exit code"] = server.stop()
    return figures


def capture(fn, *args):
    try:
        return True, fn(*args)
    except Exception as exc:
        return False, f"{type(exc).__name__}: {str(exc)[:600]}"


# --- 5. graceful shutdown ---------------------------------------------------------------------

SLEEPY = "import time\ndef f(x):\n    time.sleep(2)\n    return x\n"


def shutting_down(url):
    """Whether a server has begun its shutdown: /health says it takes no more, or nobody listens."""
    try:
        status, _, data = request("GET", url + "/health", timeout=30)
    except (ConnectionError, http.client.RemoteDisconnected):
        return True
    return status == 200 and json.loads(data)["load"]["request_capacity"] == 0


def shutdown_round(workdir, counts):
    server = Server(workdir)
    answers = {}
    try:
        server.wait_idle()
        before = descendants(server.pid)
        assert before, "no worker processes?"
        keep_alive = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        keep_alive.request("GET", "/health")
        keep_alive.getresponse().read()

        def in_flight(nonce):
            answers[nonce] = post(server.url, simple_program(SLEEPY, args=[nonce]))

        threads = [threading.Thread(target=in_flight, args=(f"in-flight-{k}",)) for k in range(server.workers)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server.health()["load"]["requests_in_progress"] < server.workers:
            assert time.monotonic() < deadline, "in-flight requests never started"
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: shutting_down(server.url), 30), "the server never began its shutdown"
        late = collections.Counter()
        body, content_type = multipart(program_parts(simple_program(ECHO, args=["late"])))
        try:  # a request on a connection opened before SIGTERM
            keep_alive.request("POST", "/execute", body, {"Content-Type": content_type})
            response = keep_alive.getresponse()
            data = response.read()
            assert_error_body(response.status, {k.lower(): v for k, v in response.getheaders()}, data, 503, "busy")
            assert response.getheader("Retry-After") == "1"
            late["503 on an open connection"] += 1
        except (ConnectionError, http.client.RemoteDisconnected):
            late["connection closed"] += 1
        finally:
            keep_alive.close()
        while any(t.is_alive() for t in threads):
            try:
                status, headers, data = request("POST", server.url + "/execute", body,
                                                {"Content-Type": content_type}, timeout=30)
                assert_error_body(status, headers, data, 503, "busy")
                assert headers.get("retry-after") == "1"
                late["503"] += 1
                status, headers, data = request("GET", server.url + "/health", timeout=30)
                if status == 200:
                    assert json.loads(data)["load"]["request_capacity"] == 0, data
                    late["health capacity 0"] += 1
            except (ConnectionError, http.client.RemoteDisconnected):
                late["refused"] += 1
            time.sleep(0.1)
        join_threads(threads, 60)
        for nonce, (status, _, body) in answers.items():
            assert status == 200 and completed(body, nonce)["out"]["value"] == nonce, body
        code = server.proc.wait(60)
        assert code == 0, f"exit code {code}"
        with pytest.raises(ConnectionRefusedError):
            request("GET", server.url + "/health", timeout=10)
        deadline = time.monotonic() + 10
        while [p for p in before if is_alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        orphans = {p: cmd for p, cmd in before.items() if is_alive(p)}
        assert not orphans, f"orphans after shutdown: {orphans}"
        assert not server.workspaces(), server.workspaces()
        counts["in-flight completed"] += len(answers)
        counts["late requests 503"] += late["503"] + late["503 on an open connection"]
        counts["late requests refused"] += late["refused"] + late["connection closed"]
        counts["refused after exit"] += 1
        counts["rounds, exit 0, no orphans"] += 1
    finally:
        server.stop()


def shutdown_item(scale, workdir):
    """`scale.shutdowns` rounds of SIGTERM under load -> what they counted, and the rounds that
    failed, with the error."""
    counts, failed = collections.Counter(), {}
    for round_ in range(scale.shutdowns):
        ok, result = capture(shutdown_round, workdir, counts)
        if not ok:
            failed[round_] = result
    return {**dict(counts), "failed rounds": failed}


# --- 6. client disconnects ----------------------------------------------------------------------

def disconnect_item(scale, workdir):
    server = Server(workdir)
    counts = collections.Counter()
    stalled, figures = [], {}
    try:
        baseline = Baseline(server)
        big = os.urandom(1 << 20)
        upload = bytes_program(sha256(big))
        upload_body, content_type = multipart(program_parts(upload, [big]))
        slow_body, _ = multipart(program_parts(simple_program(
            "import time\ndef f():\n    time.sleep(0.3)\n    return 1\n")))

        def head(body, length=None):
            return (f"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode()

        for i in range(scale.disconnects):
            with socket.create_connection(("127.0.0.1", server.port)) as s:  # upload half sent, then closed
                s.sendall(head(upload_body) + upload_body[:len(upload_body) // 2])
            counts["half upload, then closed"] += 1
            with socket.create_connection(("127.0.0.1", server.port)) as s:  # headers only, then closed
                s.sendall(head(upload_body))
            counts["headers only, then closed"] += 1
            with socket.create_connection(("127.0.0.1", server.port)) as s:  # answer never read
                s.sendall(head(slow_body) + slow_body)
            counts["response never read (closed at once)"] += 1
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(head(slow_body) + slow_body)
            answered = select.select([s], [], [], 60)[0]  # the program ran and its answer reached the socket: then RST
            assert answered, "the answer to the unread request never came"
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            s.close()
            counts["response never read (reset after it ran)"] += 1
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:  # half-closed early
                s.sendall(head(upload_body) + upload_body[:1000])
                s.shutdown(socket.SHUT_WR)
                response = http.client.HTTPResponse(s, method="POST")
                response.begin()
                check_4xx(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read(), 400)
            counts["half-closed mid-body: 400"] += 1
            if i < 4:  # clients that stall mid-body and keep the socket open
                s = socket.create_connection(("127.0.0.1", server.port))
                s.sendall(head(upload_body) + upload_body[:4096])
                stalled.append(s)
                counts["stalled mid-body"] += 1
            valid_request_ok(server.url)
        for s in stalled:
            s.close()
        valid_request_ok(server.url)
        figures |= baseline.leaks(fd_slack=3)
        figures |= {"requests": sum(counts.values()) + scale.disconnects + 1, **dict(counts),
                    "server threads after": server.threads()}
    finally:
        for s in stalled:
            s.close()
        figures["exit code"] = server.stop()
    return figures


# --- 7. nothing grows per request ----------------------------------------------------------------

ECHO_ONE = simple_program("def f(x):\n    return x\n", args=[1])


def slope(points):
    """The least-squares slope of [(x, y)]."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    return (sum((x - mean_x) * (y - mean_y) for x, y in points) /
            sum((x - mean_x) ** 2 for x, _ in points))


def echo_requests(url, count, concurrency=2):
    """`count` echo requests, each on a new connection (a new handler thread) -> none lost."""
    def one(_):
        status, _, body = post(url, ECHO_ONE)
        assert status == 200 and body["status"] == "COMPLETED", body
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(count)))


def process_growth(requests, workdir):
    """A real server's RSS, threads and fds, read from /proc every so often over `requests`
    requests -> the RSS slope (bytes per request) past a warm-up quarter, what did not come back
    to where it started (Baseline.leaks), the exit code."""
    server = Server(workdir)
    samples, leaks = [], {}
    try:
        baseline = Baseline(server)
        step = max(10, requests // 40)
        for done in range(step, requests + step, step):
            echo_requests(server.url, step)
            samples.append((done, server.rss_kib() << 10, server.threads(), server.fds()))
        leaks |= baseline.leaks()
    finally:
        leaks["exit code"] = server.stop()
    warm = samples[len(samples) // 4:]  # the first quarter fills the allocator's arenas and the caches
    return {"requests": samples[-1][0], "RSS slope bytes/request": round(slope([(n, rss) for n, rss, _, _ in warm]), 1),
            "RSS MiB first/last": f"{samples[0][1] / 2**20:.1f}/{samples[-1][1] / 2**20:.1f}",
            "threads max": max(t for _, _, t, _ in samples), "fds max": max(f for _, _, _, f in samples), **leaks}


def held_sizes(root, depth=3):
    """len() of every list, set, dict and deque that the server's own objects hold, by path
    (`app.pool.replacing`, `app.httpd.guard.watched`, ...)."""
    sizes, seen = {}, set()

    def visit(obj, path, level):
        if id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        for name, value in vars(obj).items():
            if isinstance(value, (list, set, dict, collections.deque)):
                sizes[f"{path}.{name}"] = len(value)
            elif type(value).__module__ == "kcoral" and hasattr(value, "__dict__"):
                visit(value, f"{path}.{name}", level + 1)
    visit(root, "app", 0)
    return sizes


def settled(app, workers, threads):
    """Object counts by type and held container sizes of an embedded server once it is idle:
    every slot has its worker back, and this process runs no more than `threads` threads (the
    handler threads of finished connections and the replacing threads are gone)."""
    want = {"request_capacity": workers, "requests_in_progress": 0, "requests_waiting": 0}
    deadline = time.monotonic() + 60
    while app.pool.load() != want or len(app.pool.idle) != workers or threading.active_count() > threads:
        assert time.monotonic() < deadline, \
            f"embedded server never settled: {app.pool.load()}, {threading.active_count()} threads > {threads}"
        time.sleep(0.05)
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects()), held_sizes(app)


def embedded_growth(requests):
    """An embedded server in this process (`create_app`): after `requests` more requests -> the
    types of object and the containers its objects hold that grew with them."""
    workers = 2
    config = kcoral.ServerConfig(port=0, device="cpu", num_workers=workers, log_dir=None, disk_cache_dir="",
                                 log_console=False)
    app = kcoral.create_app(config).start()
    threads = threading.active_count()
    try:
        echo_requests(app.url, 20)  # first-use allocations: connection classes, caches
        objects_before, held_before = settled(app, workers, threads)
        echo_requests(app.url, requests)
        objects_after, held_after = settled(app, workers, threads)
    finally:
        app.stop()
    grown = {name: objects_after[name] - objects_before[name] for name in objects_after
             if objects_after[name] - objects_before[name] > requests // 10}  # the bound: one in ten requests
    held = {path: (held_before.get(path, 0), size) for path, size in held_after.items()
            if size > held_before.get(path, 0) + 2}
    growth = max((objects_after[n] - objects_before[n] for n in objects_after), default=0)
    return {"embedded requests": requests, "containers followed": len(held_after),
            "most grown object type": growth, "grown containers": held, "grown object types": grown}


def growth_item(scale, workdir):
    """What the front-end keeps per request: from outside, RSS, threads and fds over
    `scale.growth` requests; from inside, object counts and held containers."""
    return {**process_growth(scale.growth, workdir), **embedded_growth(max(200, scale.growth // 10))}


# --- the CI part -----------------------------------------------------------------------------------

@pytest.fixture
def workdir(tmp_path):
    return str(tmp_path)


def test_fuzz_malformed_requests_get_4xx_error_bodies(workdir, record_property, scale=CI, seed=None):
    """Every malformed request gets a 4xx ERROR body (a valid one now and then is still served);
    nothing leaks."""
    got = fuzz_item(scale, workdir, seed)
    record_property("figures", got)
    failures = got["not answered 4xx"]
    assert failures == [], f"seed {got['seed']}: {len(failures)} of {scale.fuzz} malformed requests " \
                           f"not answered 4xx ERROR:\n" + "\n".join(failures[:15])
    assert got["leaks"] == [], got["leaks"]
    assert got["exit code"] == 0, got


def test_multipart_and_program_properties(workdir, record_property, scale=CI):
    """The multipart parser round-trips what it is given and refuses garbage with a ValidationError;
    the program validator accepts or refuses every mutated program as its rules say."""
    got = property_item(scale, workdir)
    record_property("figures", got)
    assert got["falsified"] == {}, got["falsified"]


def test_fault_injection(workdir, record_property, scale=CI):
    """Every fault is answered as specified, leaves nothing running, and the server serves on, its
    RSS growing by less than 200 MiB; nothing leaks."""
    got = fault_item(scale, workdir)
    record_property("figures", got)
    failures = got["not answered as specified"]
    assert failures == [], f"{len(failures)} faults not answered as specified:\n" + "\n".join(failures)
    assert got["server RSS growth MiB"] < 200, f"server RSS grew by {got['server RSS growth MiB']} MiB"
    assert got["leaks"] == [], got["leaks"]
    assert got["exit code"] == 0, got


def test_cache_faults(workdir, record_property, scale=CI):
    """Corrupted, unwritable and pinned cache entries: a corrupt entry is a miss, never wrong bytes;
    an unwritable cache still serves; a blob a running request uses is not evicted until it ends."""
    got = cache_item(scale, workdir)
    record_property("figures", got)
    assert got["failed"] == {}, got["failed"]


def test_load_mixed_requests(workdir, record_property, scale=CI):
    """Mixed requests at `scale.concurrency`: none lost or wrong, every request id distinct and the
    one sent when sent; the server idle after, nothing leaked."""
    got = load_item(scale, workdir)
    record_property("figures", got)
    errors = got["lost or wrong"]
    assert errors == [], f"{len(errors)} of {scale.load} requests lost or wrong:\n" + "\n".join(errors[:10])
    assert got["answered"] == scale.load, "lost answers"
    assert got["distinct request ids"] == got["answered"], "duplicated request ids"
    assert got["leaks"] == [], got["leaks"]
    assert got["exit code"] == 0, got


def test_graceful_shutdown(workdir, record_property, scale=CI):
    """SIGTERM under load: in-flight requests answered, new ones refused 503 busy, exit 0, no orphan
    process or workspace left."""
    got = shutdown_item(scale, workdir)
    record_property("figures", got)
    assert got["failed rounds"] == {}, got["failed rounds"]


def test_client_disconnects(workdir, record_property, scale=CI):
    """Clients closing, stalling or resetting at every phase: the server serves on and nothing leaks."""
    got = disconnect_item(scale, workdir)
    record_property("figures", got)
    assert got["leaks"] == [], got["leaks"]
    assert got["exit code"] == 0, got


def test_nothing_grows_per_request(workdir, record_property, scale=CI):
    """The front-end keeps nothing per request: threads, fds and processes come back, and no type
    of object (beyond one in ten requests) nor container of the server's grows with the requests."""
    got = growth_item(scale, workdir)
    record_property("figures", got)
    assert got["leaks"] == [], got["leaks"]
    assert got["exit code"] == 0, got
    assert got["grown containers"] == {}, f"containers grew over {got['embedded requests']} requests"
    assert got["grown object types"] == {}, f"objects grew over {got['embedded requests']} requests"
