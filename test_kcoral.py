"""Server tests: the wire contract (shared/spec/PROTOCOL.md) end to end on CPU workers.

Servers run as real `python -m kcoral` processes on free loopback ports, so
these tests see exactly what a client sees.  The helpers at the top
(`ServerProcess`, `post`, `multipart`, `parse_multipart_response`, ...) are
shared with the suites under tests/.
"""

import contextlib
import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))
PYTHON = sys.executable


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m kcoral` on a free port, CPU workers, no log files, a private disk cache."""

    def __init__(self, *flags, workers=2, env=None, tmp_path=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cache = os.path.join(str(tmp_path) if tmp_path else f"/tmp/kcoral-test-{self.port}", "disk-cache")
        args = [PYTHON, "-m", "kcoral", "--port", str(self.port), "--device", "cpu",
                "--num-workers", str(workers), "--log-dir", "", "--disk-cache-dir", cache, *flags]
        self.stderr_path = os.path.join(os.path.dirname(cache), f"server-{self.port}.log")
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        self.stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **(env or {})},
                                     stdout=subprocess.DEVNULL, stderr=self.stderr)
        self.wait_ready()

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path=tmp_path_factory.mktemp("server")) as srv:
        yield srv


def test_trivial_program_completes(server):
    status, headers, body = post(server.url, simple_program("def f(a, b):\n    return a + b\n", args=[2, 3]))
    assert status == 200
    assert body["status"] == "COMPLETED"
    assert body["results"] == {"out": {"type": "integer", "value": 5}}
    assert headers["x-request-id"] == body["request_id"]
    assert headers["x-kcoral-instance"] == server.health()["instance_id"]
