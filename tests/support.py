"""Helpers shared by every test module and by the benchmarks: a real server process,
raw HTTP, multipart bodies, program builders and the assertions on the protocol's shapes.

Import them as `from tests.support import ...` (the repository root is on sys.path when
pytest runs, and for `python -m bench.<script>`).
"""

import ast
import collections
import contextlib
import fcntl
import functools
import hashlib
import http.client
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse

import pytest

from client import Client, KCoralError, Program, TransportError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable


def bound_names(node):
    """The names a top-level statement of a module (or of a class body) binds: a def, a class, an
    assignment's plain targets."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [t.id for t in targets if isinstance(t, ast.Name)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m kcoral` on a free port, CPU workers, no log files, a private disk cache."""

    def __init__(self, *flags, workers=2, env=None, tmp_path=None, device="cpu", ready_timeout=60, port=None,
                 cwd=ROOT):
        self.port = port or free_port()  # a given port: a restart where the last one left off
        self.url = f"http://127.0.0.1:{self.port}"
        cache = os.path.join(str(tmp_path) if tmp_path else f"/tmp/kcoral-test-{self.port}", "disk-cache")
        device_flags = ["--device", device] if device else []  # None: the CLI's own default (auto)
        # unsandboxed unless the test says otherwise: the sandbox's own suites and fixture choose it
        sandbox = [] if any(str(f).startswith("--sandbox") for f in flags) else ["--sandbox", "none"]
        args = [PYTHON, "-m", "kcoral", "--port", str(self.port), *device_flags,
                "--num-workers", str(workers), "--log-dir", "", "--disk-cache-dir", cache, *sandbox, *flags]
        self.stderr_path = os.path.join(os.path.dirname(cache), f"server-{self.port}.log")
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        self.stderr = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(args, cwd=cwd, env={**os.environ, **(env or {})},
                                     stdout=subprocess.DEVNULL, stderr=self.stderr)
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            try:
                status, _, _ = request("GET", self.url + "/health")
                if status in (200, 401):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"server did not become ready: {self.log()}")

    def log(self):
        with open(self.stderr_path, "rb") as f:
            return f.read().decode(errors="replace")

    def health(self):
        status, _, body = request("GET", self.url + "/health")
        assert status == 200
        return json.loads(body)

    def stop(self):
        """SIGTERM and expect a clean exit 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class HAProxyProcess:
    """A real `haproxy` in master-worker mode (as Debian's unit runs it) in front of KCoral nodes,
    configured by `python -m kcoral haproxy-config`, its pidfile and admin socket in `workdir`."""

    def __init__(self, node_urls, workdir, token=None, flags=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = os.path.join(str(workdir), f"haproxy-{self.port}.cfg")
        self.pidfile = self.config_path + ".pid"
        self.socket = self.config_path + ".sock"
        self.token, self.flags = token, list(flags)
        self.configure(node_urls)
        self.stderr = open(self.config_path + ".log", "ab")
        self.proc = subprocess.Popen([HAPROXY, "-W", "-db", "-f", self.config_path],
                                     stdout=subprocess.DEVNULL, stderr=self.stderr)
        deadline = time.monotonic() + 30
        while not (self.accepting() and os.path.exists(self.socket)):
            assert self.proc.poll() is None and time.monotonic() < deadline, "haproxy did not start"
            time.sleep(0.05)

    def configure(self, node_urls):
        """(Re)write the configuration for these nodes, as an operator would: `haproxy-config -o`."""
        token_flags = ["--token", self.token] if self.token else []
        subprocess.run([PYTHON, "-m", "kcoral", "haproxy-config", "--listen", f"127.0.0.1:{self.port}",
                        "--pidfile", self.pidfile, "--stats-socket", self.socket, "-o", self.config_path,
                        *token_flags, *self.flags, *node_urls], cwd=ROOT, capture_output=True, text=True,
                       check=True)

    def admin(self, command):
        """One command on the admin socket -> its answer."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(self.socket)
            sock.sendall(command.encode() + b"\n")
            with sock.makefile("rb") as answer:
                return answer.read().decode()

    def stats(self):
        """`show stat` -> one dict per proxy and server (pxname, svname, scur, qcur, status...)."""
        header, *rows = self.admin("show stat").lstrip("# ").splitlines()
        names = header.split(",")
        return [dict(zip(names, row.split(","), strict=False)) for row in rows if row]

    def row(self, proxy, server="BACKEND"):
        """`show stat`'s row of one server of `proxy` (BACKEND: the proxy as a whole)."""
        return next(row for row in self.stats() if row["pxname"] == proxy and row["svname"] == server)

    def worker_pid(self):
        """The pid of the worker answering the admin socket (None while a reload rebinds it)."""
        try:
            return int(re.search(r"^Pid: (\d+)$", self.admin("show info"), re.M).group(1))
        except OSError:
            return None

    def reload(self):
        """Reload the configuration as docs/operations.md says: SIGUSR2 to the master named by the
        pidfile; returns once a new worker answers on the admin socket and the old one listens on
        nothing (until then it may still accept a connection and serve it by the old configuration)."""
        old = self.worker_pid()
        with open(self.pidfile) as f:
            os.kill(int(f.read().split()[0]), signal.SIGUSR2)
        assert wait_for(lambda: self.worker_pid() not in (None, old), 20), "haproxy did not reload"
        assert wait_for(lambda: not listening_sockets(old), 20), "the old haproxy worker still listens"

    def log(self):
        """HAProxy's request log (one line per request: `kcoral/<NOSRV>` for those it answered itself)."""
        with open(self.config_path + ".log", "rb") as f:
            return f.read().decode(errors="replace")

    def accepting(self):
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


PROMETHEUS = shutil.which("prometheus")


def requests_the_node_logged(log_dir, settle=2.0):
    """(event, tenant) of each request a node (logging under `log_dir`) finished or cancelled, read
    `settle` seconds on: time enough for a proxy to have sent on whatever it still held."""
    time.sleep(settle)
    [run_dir] = run_directories(log_dir)
    return [(r["event"], r.get("tenant")) for r in log_records(run_dir)
            if r["event"] in ("request_finished", "request_cancelled")]


@contextlib.contextmanager
def mounted_ext4(workdir):
    """A fresh 64 MiB ext4 without a journal (as the workspaces' disk here) mounted from an image
    in `workdir`: eight 8 MiB block groups with nothing in them, so where ext4 places a directory
    is not decided by what the host's disk happens to hold.  Skips where it cannot be made or
    mounted; unmounted (which frees the loop device) and removed afterwards."""
    image, mount_point = os.path.join(workdir, "ext4.img"), os.path.join(workdir, "mnt")
    if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        pytest.skip("mkfs.ext4 or mount is missing")
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    os.mkdir(mount_point)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "1024", "-O", "^has_journal,^flex_bg,^sparse_super,^resize_inode", image],
                          capture_output=True, text=True)
    mounted = made.returncode == 0 and subprocess.run(["mount", "-o", "loop", image, mount_point],
                                                      capture_output=True).returncode == 0
    try:
        if not mounted:
            pytest.skip(f"no ext4 image could be made and mounted here: {made.stderr.strip()}")
        yield mount_point
    finally:
        if mounted:
            subprocess.run(["umount", mount_point], check=True)
        os.remove(image)


@contextlib.contextmanager
def prometheus_server(workdir, scrape_configs, rule_files=()):
    """A real Prometheus (Debian's package) scraping every second with `scrape_configs` (as its YAML
    would hold them) -> a function answering a PromQL query: [(labels, value)...], or None while
    Prometheus does not answer yet; the test skips without it."""
    if PROMETHEUS is None:
        pytest.skip("prometheus (Debian's package) missing")
    port = free_port()
    config = os.path.join(str(workdir), "prometheus.yml")
    with open(config, "w") as f:
        json.dump({"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                   "rule_files": [str(path) for path in rule_files], "scrape_configs": scrape_configs}, f)  # JSON is YAML
    log_path = os.path.join(str(workdir), "prometheus.log")
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
                                   f"--storage.tsdb.path={os.path.join(str(workdir), 'tsdb')}"],
                                  stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))

    def query(promql):
        try:
            status, _, body = request("GET", f"http://127.0.0.1:{port}/api/v1/query?" +
                                      urllib.parse.urlencode({"query": promql}), timeout=5)
        except OSError:
            return None
        if status != 200:
            return None
        return [(r["metric"], float(r["value"][1])) for r in json.loads(body)["data"]["result"]]

    def log():  # its last words, for an assertion's message
        with open(log_path, errors="replace") as f:
            return f.read()[-2000:]

    query.log = log
    try:
        yield query
    finally:
        prometheus.terminate()
        prometheus.wait(30)


def scrapes_after(query, moment, count=1, timeout=30.0):
    """Wait until Prometheus (a `prometheus_server` query) has scraped `count` times since the wall-clock
    `moment`: a sample's timestamp is its scrape's start, so those scrapes read everything done before."""
    for _ in range(count):
        assert wait_for(lambda: (scalar(query, "timestamp(up)") or 0) > moment, timeout), query.log()
        moment = scalar(query, "timestamp(up)")


def scalar(query, promql):
    """The value of a PromQL query answering one sample (None while there is none)."""
    result = query(promql)
    return result[0][1] if result else None


@contextlib.contextmanager
def proxy_in_front(url, workdir):
    """A HAProxy configured by `haproxy-config` in front of one node; the test skips without haproxy."""
    if HAPROXY is None:
        pytest.skip("haproxy is not installed")
    proxy = HAProxyProcess([url], workdir)
    try:
        yield proxy
    finally:
        proxy.stop()


class HostileServer:
    """A TCP listener in a thread that plays a broken or malicious KCoral server to each client:

    * "silent": reads whatever the client sends and never answers;
    * "endless": a 200 with a chunked body that never ends;
    * "huge": a 200 that declares a terabyte and sends bytes until the client hangs up;
    * "trickle-head": a status line, then one header byte every 50 ms, forever;
    * "trickle-body": a 200 declaring 1 MB, then one body byte every 50 ms.

    `bytes_sent` counts what it got out; close() hangs up on every client and joins its threads."""

    HEADS = {"endless": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
             "huge": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n",
             "trickle-head": b"HTTP/1.1 200 OK\r\nX-Slow: ",
             "trickle-body": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"}

    def __init__(self, mode):
        assert mode == "silent" or mode in self.HEADS, mode
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.bytes_sent = 0
        self.connections = []
        self.closed = False
        self.threads = [threading.Thread(target=self.accept, daemon=True)]
        self.threads[0].start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)
            self.threads.append(threading.Thread(target=self.play, args=(conn,), daemon=True))
            self.threads[-1].start()

    def play(self, conn):
        try:
            if self.mode == "silent":
                while conn.recv(1 << 16):
                    pass
                return
            conn.recv(1 << 16)  # the request's head (and perhaps some body): enough to answer
            self.send(conn, self.HEADS[self.mode])
            if self.mode == "endless":
                chunk = b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16))
                while not self.closed:
                    self.send(conn, chunk)
            elif self.mode == "huge":
                while not self.closed:
                    self.send(conn, b"x" * (1 << 16))
            else:
                while not self.closed:
                    self.send(conn, b"x")
                    time.sleep(0.05)  # the pace of the attack, not a synchronisation
        except OSError:  # the client hung up: what these tests wait for
            return

    def send(self, conn, data):
        conn.sendall(data)
        self.bytes_sent += len(data)

    def close(self):
        self.closed = True
        self.hang_up(self.listener)
        join_threads(self.threads[:1], 10)  # accept() has returned: no connection comes after this
        for conn in self.connections:
            self.hang_up(conn)
        join_threads(self.threads, 10)

    @staticmethod
    def hang_up(sock):
        with contextlib.suppress(OSError):  # not connected any more
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


# Each execution appends its value to a ledger first, so a request run twice would show.
ECHO_AFTER = ("import time\ndef f(x, seconds, ledger):\n    with open(ledger, 'a') as f:\n        f.write(f'{x}\\n')\n"
              "    time.sleep(seconds)\n    return x\n")


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


def ledger_runs(ledger, tag):
    """How many times each request whose value starts with `tag` ran, from the echo ledger."""
    with open(ledger) as f:
        return collections.Counter(line.strip() for line in f if line.startswith(tag))


class SteadyLoad:
    """`clients` threads each sending echo requests of `seconds` through `url`, one after another,
    until stop(); `outcomes` maps each request's value to what became of it."""

    def __init__(self, url, ledger, headers=None, clients=6, seconds=0.3):
        self.url, self.ledger, self.headers, self.seconds = url, ledger, headers or {}, seconds
        self.tag = f"load-{time.monotonic_ns()}-"
        self.outcomes = {}
        self.numbers = itertools.count()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.client_loop) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def client_loop(self):
        with Client(self.url, headers=self.headers) as client:
            while not self.stopping.is_set():
                run_echo(client, f"{self.tag}{next(self.numbers)}", self.seconds, self.outcomes, self.ledger)

    def stop(self):
        """Let the requests under way finish -> how many times each request ran."""
        self.stopping.set()
        for thread in self.threads:
            thread.join()
        return ledger_runs(self.ledger, self.tag)


HAPROXY = shutil.which("haproxy", path=os.environ.get("PATH", "") + os.pathsep + "/usr/sbin")


def request(method, url, body=b"", headers=None, timeout=120):
    """One HTTP exchange -> (status, headers dict lower-cased, body bytes)."""
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    path = "/" + url.split("//", 1)[1].split("/", 1)[1] if "/" in url.split("//", 1)[1] else "/"
    conn = http.client.HTTPConnection(host_port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data
    finally:
        conn.close()


def multipart(parts, boundary="test-boundary-7f3a"):
    """[(name, content_type, payload bytes)] -> (body, Content-Type header value)."""
    chunks = []
    for name, content_type, payload in parts:
        chunks.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n'
                      f"Content-Type: {content_type}\r\n\r\n".encode() + payload + b"\r\n")
    chunks.append(f"--{boundary}--\r\n".encode())
    return b"".join(chunks), f"multipart/form-data; boundary={boundary}"


def program_parts(program, blobs=()):
    data = program if isinstance(program, bytes) else json.dumps(program).encode()
    parts = [("program", "application/json", data)]
    parts += [(f"blob:{sha256(b)}", "application/octet-stream", b) for b in blobs]
    return parts


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def post(url, program, blobs=(), headers=None, timeout=120):
    """POST a program with the given blob payloads -> (status, headers, decoded result)."""
    body, content_type = multipart(program_parts(program, blobs))
    status, hdrs, data = request("POST", url + "/execute", body,
                                 {"Content-Type": content_type, **(headers or {})}, timeout)
    return status, hdrs, decode_response(hdrs, data)


def decode_response(headers, data):
    """JSON body as a dict; a multipart body as the result dict with '_parts' {name: bytes}."""
    content_type = headers.get("content-type", "")
    if content_type.startswith("application/json"):
        return json.loads(data)
    return parse_multipart_response(data, content_type.split("boundary=", 1)[1])


def parse_multipart_response(data, boundary):
    delimiter = b"\r\n--" + boundary.encode()
    chunks = (b"\r\n" + data).split(delimiter)
    assert chunks[-1] in (b"--\r\n", b"--"), chunks[-1][:40]
    result, parts = None, {}
    for chunk in chunks[1:-1]:
        head, _, payload = chunk[2:].partition(b"\r\n\r\n")
        name = head.split(b'name="', 1)[1].split(b'"', 1)[0].decode()
        if name == "result":
            result = json.loads(payload)
        else:
            parts[name] = payload
    result["_parts"] = parts
    return result


def simple_program(source, name="f", args=(), options=None):
    """upload module -> get_function -> run(args) -> return 'out'."""
    program = {"instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": source},
        {"op": "get_function", "id": "fn", "module": {"$ref": "m"}, "name": name},
        {"op": "run", "id": "r", "fn": {"$ref": "fn"}, "args": list(args)},
        {"op": "return", "key": "out", "value": {"$ref": "r"}}]}
    if options:
        program["options"] = options
    return program


def one_call(source, name="f"):
    """A client Program that runs `name` of a module, returning nothing."""
    from kcoral import Program
    program = Program()
    program.run(fn=program.get_function(module=program.upload(kind="module", source=source), name=name))
    return program


# --- the published kcoral 0.1.1: interop peer and benchmark baseline ----------------

REFERENCE_VERSION = "0.1.1"
REFERENCE_DEPENDENCIES = ("httpx", "numpy", "ml_dtypes", "fastapi", "uvicorn", "pydantic", "grpcio", "protobuf")


def reference_venv() -> str:
    """A virtualenv holding the published kcoral 0.1.1, created on first use, then reused.

    Its package is also named `kcoral`, so it never enters this project's environment, and
    its programs run with a cwd outside the repository (`reference_popen_options`), where
    our kcoral.py would shadow it.  A file lock lets concurrent test processes share one
    installation; `KCORAL_REFERENCE_VENV` names another place for it.
    """
    return cached_venv(os.environ.get("KCORAL_REFERENCE_VENV") or kcoral_test_cache(f"reference-{REFERENCE_VERSION}"),
                       install_reference)


def kcoral_test_cache(name: str) -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "kcoral-test", name)


def cached_venv(venv: str, install) -> str:
    """`venv`, made by `install(venv)` on first use, then reused; a file lock lets concurrent test
    processes share one installation."""
    ready = os.path.join(venv, ".kcoral-reference-ready")
    if os.path.exists(ready):
        return venv
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    with open(venv + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not os.path.exists(ready):
            install(venv)
            open(ready, "w").close()
    return venv


def numpy_only_python() -> str:
    """The python of a virtualenv holding NumPy alone: a project that vendors client.py, with no
    kcoral, torch or ml_dtypes to import."""
    venv = cached_venv(kcoral_test_cache(f"numpy-only-py{sys.version_info[0]}.{sys.version_info[1]}"),
                       install_numpy_only)
    return os.path.join(venv, "bin", "python")


def install_numpy_only(venv: str) -> None:
    shutil.rmtree(venv, ignore_errors=True)  # a half-made one from an interrupted run
    python = os.path.join(venv, "bin", "python")
    for argv in ([PYTHON, "-m", "venv", venv],
                 [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "numpy"]):
        result = subprocess.run(argv, cwd=tempfile.gettempdir(), env=reference_env(), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"making a numpy-only virtualenv failed: {argv}\n{result.stdout}{result.stderr}")


def install_reference(venv: str) -> None:
    shutil.rmtree(venv, ignore_errors=True)  # a half-made one from an interrupted run
    outside = tempfile.gettempdir()
    python = os.path.join(venv, "bin", "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for argv in ([PYTHON, "-m", "venv", venv],
                 [*pip, "--no-deps", f"kcoral=={REFERENCE_VERSION}"],
                 [*pip, *REFERENCE_DEPENDENCIES],
                 [python, "-c", f"import kcoral; assert kcoral.__version__ == {REFERENCE_VERSION!r}, "
                                "kcoral.__version__"]):
        result = subprocess.run(argv, cwd=outside, env=reference_env(), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"installing the reference kcoral failed: {argv}\n{result.stdout}{result.stderr}")


def reference_env() -> dict:
    """Our environment without what would point the reference's python at another one."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def reference_popen_options() -> dict:
    """cwd outside the repository (our kcoral.py would shadow its package) and a clean env."""
    return {"cwd": reference_venv(), "env": reference_env()}


def reference_python() -> str:
    return os.path.join(reference_venv(), "bin", "python")


def reference_server_argv(port: int, *flags: str) -> list:
    """Its CPU server without sandbox or log files (flags are appended and may override)."""
    kcoral = os.path.join(reference_venv(), "bin", "kcoral")
    return [kcoral, "server", "--device", "cpu", "--sandbox", "none", "--log-dir", "", "--port", str(port), *flags]


def reference_router_argv(port: int, *flags: str) -> list:
    return [os.path.join(reference_venv(), "bin", "kcoral"), "router", "--port", str(port), *flags]


@pytest.fixture(scope="module", params=["none", "bubblewrap"], ids=["unsandboxed", "sandboxed"])
def server(request, tmp_path_factory):
    """The shared default server for tests that run programs, once without and once with the
    sandbox (where a worker runs the code, the sandbox can change the outcome).  Unsandboxed,
    it is the module's front_end_server: one server process fewer to start."""
    if request.param == "none":
        yield request.getfixturevalue("front_end_server")
    else:
        yield from shared_server(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def front_end_server(tmp_path_factory):
    """The module's unsandboxed server, alone for tests whose requests never reach a worker
    (envelope, JSON and program validation, CACHE_MISS): the sandbox cannot change what they
    check, so they run once."""
    yield from shared_server("none", tmp_path_factory)


def shared_server(sandbox, tmp_path_factory):
    """A module's server with a private TMPDIR, so that workspace leaks are visible."""
    base = tmp_path_factory.mktemp("server")
    tmpdir = base / "tmp"
    tmpdir.mkdir()
    with ServerProcess("--sandbox", sandbox, tmp_path=base, env={"TMPDIR": str(tmpdir)}) as srv:
        srv.tmpdir = str(tmpdir)
        srv.sandbox = sandbox
        yield srv


UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ERROR_FIELDS = {"kind", "message", "instruction_index", "instruction_op", "instruction_id", "traceback"}
RESULT_FIELDS = {"status", "request_id", "queue_ms", "elapsed_ms", "lease_wait_ms", "lease_held_ms",
                 "stdout", "stderr", "stdout_truncated", "stderr_truncated", "results"}
BOUNDARY = "test-boundary-7f3a"
H = "a" * 64  # a well-formed blob hash no test ever supplies


def ref(ident):
    return {"$ref": ident}


def up_module(ident, source):
    return {"op": "upload", "id": ident, "kind": "module", "source": source}


def up_blob(ident, kind, data, **fields):
    """An upload of `data` (bytes, or an already computed hash string)."""
    digest = data if isinstance(data, str) else sha256(data)
    return {"op": "upload", "id": ident, "kind": kind, "blob": digest, **fields}


def get_fn(ident, module, name, **fields):
    return {"op": "get_function", "id": ident, "module": ref(module), "name": name, **fields}


def run(ident, fn, *args):
    return {"op": "run", "id": ident, "fn": ref(fn), "args": list(args)}


def ret(key, ident):
    return {"op": "return", "key": key, "value": ref(ident)}


def ret_path(key, kind, path):
    return {"op": "return", "key": key, "kind": kind, "path": path}


def prog(*instructions, options=None):
    program = {"instructions": list(instructions)}
    if options is not None:
        program["options"] = options
    return program


def call_program(source, name, *args, options=None):
    """Like simple_program, with any instruction objects (refs) allowed as args."""
    return prog(up_module("m", source), get_fn("fn", "m", name), run("r", "fn", *args), ret("out", "r"),
                options=options)


def post_raw(url, body, content_type, headers=None, timeout=60):
    """POST an arbitrary body -> (status, headers, decoded body)."""
    hdrs = dict(headers or {})
    if content_type is not None:
        hdrs["Content-Type"] = content_type
    status, rh, data = request("POST", url + "/execute", body, hdrs, timeout)
    return status, rh, decode_response(rh, data) if data else None


def raw_part(name, content_type, payload, nl=b"\r\n"):
    return (f'Content-Disposition: form-data; name="{name}"'.encode() + nl +
            f"Content-Type: {content_type}".encode() + nl + nl + payload)


def raw_body(parts, nl=b"\r\n", boundary=BOUNDARY, preamble=b"", epilogue=b"\r\n"):
    """Header-block-and-payload byte strings -> a multipart body with the given line ending."""
    delimiter = b"--" + boundary.encode()
    chunks = [preamble]
    for part in parts:
        chunks.append(delimiter + nl + part + nl)
    chunks.append(delimiter + b"--" + epilogue)
    return b"".join(chunks)


CT = f"multipart/form-data; boundary={BOUNDARY}"
EMPTY_MODULE = prog(up_module("m", ""))
EMPTY_MODULE_JSON = json.dumps(EMPTY_MODULE).encode()


def assert_error_body(status, headers, body, http_status, kind, *fragments):
    """The exact ERROR shape of docs/protocol.md §9.8, its headers, and message fragments (case-insensitive);
    `body` decoded or its bytes.  -> the body dict."""
    body = json.loads(body) if isinstance(body, (bytes, bytearray)) else body
    assert status == http_status, body
    assert headers["content-type"] == "application/json"
    if http_status == 504:  # our extension's fields (docs/protocol.md §9.8): checked, then set aside
        body = without_timeout_fields(body)
    if http_status == 400:
        body = without_refused_instruction(body)
    assert set(body) == {"status", "request_id", "error"}, body
    assert body["status"] == "ERROR"
    assert set(body["error"]) == {"kind", "message"}, body
    assert body["error"]["kind"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert headers["x-request-id"] == body["request_id"]
    assert UUID_RE.fullmatch(body["request_id"]), body
    assert UUID_RE.fullmatch(headers["x-kcoral-instance"])
    message = body["error"]["message"].lower()
    for fragment in fragments:
        assert fragment.lower() in message, (fragment, body["error"]["message"])
    return body


TIMEOUT_BODY_FIELDS = {"stdout": str, "stderr": str, "stdout_truncated": bool, "stderr_truncated": bool}
TIMEOUT_ERROR_FIELDS = {"instruction_index": int, "instruction_op": str, "instruction_id": (str, type(None))}


def without_timeout_fields(body):
    """A worker's 504 body minus the fields it adds to §9.8's shape, after checking their types:
    all four output fields, and the instruction's three whenever one had started."""
    body, error = without_truncation_fields(body), dict(body["error"])
    for fields, where in ((TIMEOUT_BODY_FIELDS, body), (TIMEOUT_ERROR_FIELDS, error)):
        present = set(fields) & set(where)
        assert present in (set(), set(fields)), where
        for name in present:
            assert isinstance(where.pop(name), fields[name]), (name, body)
    body["error"] = error
    return body


REFUSED_INSTRUCTION_FIELDS = {"instruction_index": int, "instruction_op": (str, type(None)),
                              "instruction_id": (str, type(None))}


def without_refused_instruction(body):
    """A 400 body minus the instruction it names (docs/protocol.md §9.8), all three fields or none,
    after checking their types and that the message names the same instruction."""
    body, error = dict(body), dict(body["error"])
    present = set(REFUSED_INSTRUCTION_FIELDS) & set(error)
    assert present in (set(), set(REFUSED_INSTRUCTION_FIELDS)), error
    if present:
        assert f"instruction {error['instruction_index']}" in error["message"], error
    for name in present:
        assert type(error[name]) is not bool and isinstance(error.pop(name), REFUSED_INSTRUCTION_FIELDS[name]), body
    body["error"] = error
    return body


def assert_proxy_error_body(status, headers, body, http_status, kind, *fragments):
    """The ERROR shape from HAProxy itself (`haproxy-config`): as a node's, but no node named it."""
    body = json.loads(body)
    assert status == http_status, body
    assert headers["content-type"] == "application/json"
    assert set(body) == {"status", "request_id", "error"} and body["status"] == "ERROR", body
    assert set(body["error"]) == {"kind", "message"} and body["error"]["kind"] == kind, body
    assert UUID_RE.fullmatch(body["request_id"]), body
    assert "x-kcoral-instance" not in headers, headers
    for fragment in fragments:
        assert fragment.lower() in body["error"]["message"].lower(), (fragment, body["error"]["message"])


def assert_parse_error(response, *fragments):
    status, headers, body = response
    assert_error_body(status, headers, body, 400, "parse", *fragments)


def without_truncation_fields(body):
    """A body minus the fields our server adds for a stream cut at its limit (docs/protocol.md §8.7),
    after checking them: `<stream>_bytes` and `<stream>_tail` exactly for each truncated stream, the
    limit and the server's cap when either was."""
    body = dict(body)
    cut = [name for name in ("stdout", "stderr") if body.get(f"{name}_truncated") is True]
    for name in cut:
        assert type(body.pop(f"{name}_bytes")) is int and isinstance(body.pop(f"{name}_tail"), str), body
    for name in ("output_limit_bytes", "max_output_limit_bytes") if cut else ():
        assert type(body.pop(name)) is int, body
    return body


def assert_completed(body):
    assert body["status"] == "COMPLETED", body.get("error")
    assert set(without_truncation_fields(body)) - {"_parts"} == RESULT_FIELDS, body
    return body["results"]


def assert_failed(body, kind, index, op, ident, *fragments):
    """FAILED with the exact error field set of docs/protocol.md §9.7; returns the error object."""
    assert body["status"] == "FAILED", body
    assert set(without_truncation_fields(body)) - {"_parts"} == RESULT_FIELDS | {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_FIELDS, error
    assert (error["kind"], error["instruction_index"], error["instruction_op"], error["instruction_id"]) == \
        (kind, index, op, ident), error
    assert isinstance(error["traceback"], str)
    for fragment in fragments:
        assert fragment in error["message"], (fragment, error["message"])
    return error


def plain(encoded):
    """Decode the JSON value types of docs/protocol.md §9.5 (bytes, tensors and files keep their encoding)."""
    kind = encoded["type"]
    if kind == "null":
        return None
    if kind == "array":
        return [plain(v) for v in encoded["value"]]
    if kind == "object":
        return {k: plain(v) for k, v in encoded["value"].items()}
    return encoded.get("value", encoded)


def execute_ok(url, program, blobs=(), **kw):
    status, headers, body = post(url, program, blobs, **kw)
    assert status == 200, body
    return body


def workspaces(srv, settle=10.0):
    """What requests left in the server's TMPDIR once it settled: unsandboxed workspaces (removed
    just after the answer).  A sandboxed request writes to a tmpfs of its own, so no directory of
    it may be there at all."""
    return wait_for(lambda: left_in_tmpdir(srv) == [], settle) and [] or left_in_tmpdir(srv)


def left_in_tmpdir(srv):
    return sorted(name for name in os.listdir(srv.tmpdir) if name.startswith(("kcoral-program-", "kcoral-sandbox-")))


def join_threads(threads, timeout=60.0):
    """Join every thread within one shared deadline: a thread still alive (a hung client, say) fails
    the test instead of letting it go on, or pass, without that thread's outcome."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [thread.name for thread in threads if thread.is_alive()]
    assert not hung, f"still running after {timeout} s: {hung}"


def in_own_session(test, timeout=60.0):
    """Decorate a test to run it in a forked child that leads a session of its own.

    A worker's serve_request ends by sweeping its escaped descendants (those outside its process
    group).  Called in the test process, it would find the workers of any server another test
    still runs, and kill them; in the child, it sees only what the test's program started.  The
    child inherits the test's fixtures and monkeypatches; its failure fails the test."""
    @functools.wraps(test)
    def run_in_child(*args, **kwargs):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report "passed" or the traceback, and never return into pytest
            os.close(read_end)
            os.setsid()
            outcome = "passed"
            try:
                test(*args, **kwargs)
            except BaseException:
                outcome = traceback.format_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.write(write_end, outcome.encode())
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as report:
            answered = select.select([report], [], [], timeout)[0]
            if not answered:
                os.kill(pid, signal.SIGKILL)
            outcome = report.read().decode(errors="replace") if answered else ""
        _, status = os.waitpid(pid, 0)
        assert answered, f"the test did not end within {timeout} s in its own session"
        assert outcome == "passed", f"in its own session (wait status {status}):\n{outcome}"
    return run_in_child


def wait_for(predicate, timeout=10.0, interval=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def scrape_when(url, ready, headers=None, timeout=10.0):
    """GET /metrics until `ready(text)` -> that text (the last one read if it never is: the caller's
    asserts then say what is missing).  A request is counted when its log record is written, just
    after its answer went out (docs/operations.md): a scrape made the instant the answer arrived
    may not count it yet."""
    def scrape():
        status, _, body = request("GET", url + "/metrics", headers=headers)
        assert status == 200, body
        return body.decode()
    return wait_for(lambda: text if ready(text := scrape()) else None, timeout) or scrape()


def run_directories(log_dir):
    """The run directories a server made under its --log-dir, oldest first."""
    runs = os.path.join(str(log_dir), "runs")
    return [os.path.join(runs, name) for name in sorted(os.listdir(runs))] if os.path.isdir(runs) else []


def log_records(path):
    """The records of an events.jsonl file (or of a run directory's), [] while it does not exist."""
    if os.path.isdir(path):
        path = os.path.join(path, "events.jsonl")
    try:
        with open(path, "rb") as f:
            return [json.loads(line) for line in f.read().splitlines()]
    except FileNotFoundError:
        return []


def marked_pids(marker):
    """Host pids of the processes whose command line carries `marker` (a sandboxed program
    cannot tell us its children's pids: it sees its own PID namespace)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found


def is_alive(pid):
    """Running or stopped, not a zombie: an orphan zombie nobody reaps (this test process may be a
    subreaper, after an embedded server) runs nothing, and a process may end while /proc is read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def ok_run(url, answer=7):
    body = execute_ok(url, simple_program("def f(x):\n    return x\n", args=[answer]))
    assert assert_completed(body) == {"out": {"type": "integer", "value": answer}}


# --- a TVM-FFI library to upload (tests and bench/gpu_check.py) ---------------------

ADD_ONE_CPU = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

void add_one(tvm::ffi::TensorView x, tvm::ffi::TensorView y) {
  DLDataType f32{kDLFloat, 32, 1};
  TVM_FFI_ICHECK(x.ndim() == 1 && y.ndim() == 1 && x.size(0) == y.size(0)) << "1-d tensors of one length";
  TVM_FFI_ICHECK(x.dtype() == f32 && y.dtype() == f32) << "float32 only";
  for (int64_t i = 0; i < x.size(0); ++i)
    static_cast<float*>(y.data_ptr())[i] = static_cast<float*>(x.data_ptr())[i] + 1;
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one, add_one);
"""

ADD_ONE_CUDA = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

__global__ void add_one_kernel(const float* x, float* y, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = x[i] + 1;
}

void add_one(tvm::ffi::TensorView x, tvm::ffi::TensorView y) {
  DLDataType f32{kDLFloat, 32, 1};
  TVM_FFI_ICHECK(x.ndim() == 1 && y.ndim() == 1 && x.size(0) == y.size(0)) << "1-d tensors of one length";
  TVM_FFI_ICHECK(x.dtype() == f32 && y.dtype() == f32) << "float32 only";
  TVM_FFI_ICHECK(x.device().device_type == kDLCUDA) << "CUDA tensors only";
  int64_t n = x.size(0);
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(x.device().device_type, x.device().device_id));
  add_one_kernel<<<(n + 255) / 256, 256, 0, stream>>>(static_cast<const float*>(x.data_ptr()),
                                                      static_cast<float*>(y.data_ptr()), n);
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one, add_one);
"""


def build_add_one(device, arch=None):
    """Build the add_one library with tvm_ffi.cpp.build (cached by source under the temp dir) -> bytes."""
    import tvm_ffi.cpp
    source = ADD_ONE_CUDA if device == "gpu" else ADD_ONE_CPU
    if arch:  # build for the server's target, as a client would: "sm_90a" -> "9.0a"
        digits, suffix = re.fullmatch(r"sm_(\d+)(a?)", arch).groups()
        os.environ["TVM_FFI_CUDA_ARCH_LIST"] = f"{digits[:-1]}.{digits[-1]}{suffix}"
    key = hashlib.sha256((source + str(arch)).encode()).hexdigest()[:16]
    build_dir = os.path.join(tempfile.gettempdir(), "kcoral-add-one", key)
    os.makedirs(build_dir, exist_ok=True)
    source_path = os.path.join(build_dir, "add_one.cu" if device == "gpu" else "add_one.cc")
    with open(source_path, "w") as f:
        f.write(source)
    bin_dir = os.path.dirname(sys.executable)  # a pip-installed ninja lives beside the interpreter
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    with open(tvm_ffi.cpp.build(name="add_one", sources=[source_path], build_directory=build_dir), "rb") as f:
        return f.read()


# --- measuring a server process through /proc -----------------------------------------------

def rss_kib(pid):
    """Resident set size of one process (VmRSS in /proc/PID/status), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid):
    """User plus system CPU time of one process so far (/proc/PID/stat): unlike wall time, it does not
    grow while other processes hold the cores."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """Calls `probe()` in a loop on a thread while the `with` block runs; `.values` holds the results."""

    def __init__(self, probe, interval=0.01):
        self.probe, self.interval, self.values = probe, interval, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            self.values.append(self.probe())
            self.stop.wait(self.interval)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        join_threads([self.thread], 30)
        self.values.append(self.probe())


def health_latency(url, timeout=30):
    """Seconds /health takes to answer 200 (`timeout` if it does not)."""
    started = time.monotonic()
    try:
        status, _, _ = request("GET", url + "/health", timeout=timeout)
    except OSError:
        return timeout
    return time.monotonic() - started if status == 200 else timeout


def unread_bytes(server_port, client_port):
    """Bytes a client sent on 127.0.0.1 that the server's socket has not read yet (its receive queue
    in /proc/net/tcp), or None while no such connection shows."""
    wanted_local, wanted_remote = f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}"
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == wanted_local and fields[2] == wanted_remote:
                return int(fields[4].split(":")[1], 16)
    return None


def server_connections(port):
    """The server's side of the TCP connections to 127.0.0.1:port still open (/proc/net/tcp;
    neither the listening socket nor TIME_WAIT): a handler thread may still hold each."""
    with open("/proc/net/tcp") as f:
        return [line.split()[3] for line in f.readlines()[1:]
                if line.split()[1].endswith(f":{port:04X}") and line.split()[3] not in ("0A", "06")]


def listening_sockets(pid):
    """The TCP sockets a process holds in the LISTEN state (its fds' inodes among /proc/net/tcp's and
    tcp6's); none once it is gone."""
    inodes = set()
    with contextlib.suppress(OSError):  # gone (or going): it holds none
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            found |= {fields[9] for fields in map(str.split, f.readlines()[1:]) if fields[3] == "0A"}
    return inodes & found


def thread_count(pid):
    """The threads of a process, from /proc."""
    return len(os.listdir(f"/proc/{pid}/task"))


def unaccepted_connections(server_port):
    """Connections to 127.0.0.1:server_port the server has not accepted yet (/proc/net/tcp): those
    in its listening socket's accept queue, those half open, and SYNs a full backlog dropped (the
    client sends them again after 1 s, 3 s, ...)."""
    port = f":{server_port:04X}"
    waiting = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, remote, state, queues = line.split()[1:5]
            if local.endswith(port) and state == "0A":  # LISTEN: rx_queue is the accept queue
                waiting += int(queues.split(":")[1], 16)
            elif (local.endswith(port) and state == "03") or (remote.endswith(port) and state == "02"):
                waiting += 1  # SYN_RECV on the server's side, SYN_SENT on the client's
    return waiting


# --- examples/ and the skill's code blocks, run as a user runs them ---------------------------

EXAMPLES_DIR = os.path.join(ROOT, "examples")
GPU_MARKER = "# requires: gpu"


def example_paths():
    """Every runnable example (a leading `_` marks a module the examples import)."""
    return sorted(os.path.join(EXAMPLES_DIR, name) for name in os.listdir(EXAMPLES_DIR)
                  if name.endswith(".py") and not name.startswith("_"))


def requires_gpu(source):
    """Whether a program's text says it must run on a GPU server: its first line is the marker."""
    return source.lstrip("\ufeff").split("\n", 1)[0].strip() == GPU_MARKER


def run_python(url, *argv, timeout=300, cwd=ROOT):
    """`python ARGV...` with KCORAL_URL set and this checkout importable -> CompletedProcess (text)."""
    env = {**os.environ, "KCORAL_URL": url, "PYTHONPATH": ROOT}
    env.pop("KCORAL_COMPILE_URL", None)
    return subprocess.run([PYTHON, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def python_blocks(markdown_path):
    """The ```python blocks of a Markdown file -> [(line number of the fence, code)]."""
    with open(markdown_path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks, start = [], None
    for number, line in enumerate(lines, 1):
        if start is None and line.strip() == "```python":
            start = number
        elif start is not None and line.strip() == "```":
            blocks.append((start, "\n".join(lines[start:number - 1]) + "\n"))
            start = None
    assert start is None, f"{markdown_path}: the block opened on line {start} is never closed"
    return blocks


def documented_log_events(server_doc):
    """docs/server.md §10's event table -> {event: (levels, fields, optional fields)}; a
    parenthesis in a cell explains and names no field."""
    with open(server_doc, encoding="utf-8") as f:
        section = f.read().split("## 10. ", 1)[1].split("\n## ", 1)[0]
    events = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            names = [set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", cell))) for cell in cells]
            events[cells[0].strip("`")] = (set(re.findall(r"[A-Z]+", cells[1])), names[2], names[3])
    return events


def mem_available():
    """The host's MemAvailable, in bytes."""
    return meminfo()["MemAvailable"]


@functools.cache
def huge_pages_collapse():
    """Whether this kernel collapses anonymous memory into huge pages on request (MADV_COLLAPSE,
    Linux 6.1, THP not "never"): tried on a region of this process's own, freed after."""
    import ctypes
    import mmap
    region = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.write(b"\1" * len(region))
    cells = (ctypes.c_char * len(region)).from_buffer(region)
    try:
        start = -(-ctypes.addressof(cells) // HUGE_PAGE) * HUGE_PAGE
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return madvise(start, HUGE_PAGE, 25) == 0  # MADV_COLLAPSE
    finally:
        del cells
        region.close()


HUGE_PAGE = 2 << 20


def meminfo():
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[-1] == "kB"}


def memory_held():
    """What the host's processes hold, in bytes: anonymous memory, shared memory (memfd, shared
    anonymous maps, System V, tmpfs) and page tables, with no page cache (which other work on the
    host fills and the kernel drops as it likes)."""
    info = meminfo()
    return info["AnonPages"] + info["Shmem"] + info["PageTables"]


class HostMemoryPeak:
    """Samples `memory_held` every 2 ms while in use -> `peak`, the most it rose above what it was
    before: all the memory an attack held, whatever its form (the host's truth, which no
    per-process count can miss; other work on the host only ever adds to it)."""

    def __init__(self):
        self.before = self.highest = memory_held()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self):
        while not self.done.wait(0.002):
            self.highest = max(self.highest, memory_held())

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    @property
    def peak(self):
        return self.highest - self.before

    def back_within(self, seconds, slack=128 << 20):
        """Whether the memory held came back to within `slack` of where it was, within `seconds`."""
        return wait_for(lambda: memory_held() <= self.before + slack, seconds, 0.01)


def skip_without_memory(needed):
    """Skip a memory attack the host has no room for (it must never push the host into its OOM killer)."""
    if mem_available() < needed + (1 << 30):
        pytest.skip(f"the host has {mem_available() >> 20} MiB available, the attack needs {needed >> 20} MiB more")
