"""The floor: what a client and loopback cost by themselves, for every scenario of bench/scenarios.py.

Standard library only (bench/published_client_driver.py imports it in the published client's
virtualenv).  `FloorServer(upstream)` forks a process that listens on two loopback ports:

- `record_url`: a transparent proxy to `upstream` (our server).  It passes each request on and
  each answer back, and keeps every answer that ran a program (anything but a CACHE_MISS) under
  the request's program part: the recording.  The benchmark records a program through it, off
  the clock, just before the floor's sample of that program.
- `url`: the floor itself.  It reads each request whole, splits its parts (as every server must,
  to learn which blobs came with it), and sends the recorded answer to its program at once, in
  one buffer.  Like a server it remembers which blobs it was sent (their names only: it never
  needs their bytes again) and answers CACHE_MISS, naming the upstream's instance as the recorded
  answers do, for the ones it was not sent yet: a client goes through the same round trips as
  against our server.  A program it holds no recording of is a 400; it runs no code.

A client's time against `url` is what that client itself spends on framing, sending, receiving
and checking the very bytes our server answers: the lowest time any server can give that client.
"""

import http.client
import json
import os
import re
import signal
import socket
import threading
import urllib.parse
import uuid

WORKERS = 2  # what its /health reports, like the benchmarked servers
DISPOSITION_NAME = re.compile(rb'name="([^"]*)"')
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class FloorServer:
    """A forked process replaying on `url`, recording from `upstream` on `record_url`, until stop()."""

    name = "floor"

    def __init__(self, upstream):
        listeners = [socket.socket(), socket.socket()]
        for listener in listeners:
            listener.bind(("127.0.0.1", 0))
            listener.listen(16)
        self.url, self.record_url = (f"http://127.0.0.1:{s.getsockname()[1]}" for s in listeners)
        self.pid = os.fork()
        if self.pid == 0:  # the child serves until killed, never returning into the caller's code
            try:
                Floor(upstream).serve(*listeners)
            finally:
                os._exit(0)
        for listener in listeners:
            listener.close()

    def stop(self):
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


class Floor:
    """The recordings and the blob names received, shared by every connection's thread."""

    def __init__(self, upstream):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.recordings = {}  # program part bytes -> (the whole answer, the blob hashes it references)
        self.known = set()  # hashes of the blobs received on `url`
        self.instance = str(uuid.uuid4())  # until the first recording names the upstream's

    def serve(self, replay_listener, record_listener):
        threading.Thread(target=self.accept, args=(record_listener, self.record), daemon=True).start()
        self.accept(replay_listener, self.replay)

    def accept(self, listener, handle):
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=self.serve_connection, args=(conn, handle), daemon=True).start()

    def serve_connection(self, conn, handle):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = conn.makefile("rb")
        upstream = None
        with conn, reader:
            while True:
                request_line = reader.readline()
                if not request_line:
                    break
                headers = read_headers(reader)
                body = bytearray(int(headers.get("content-length", 0)))
                if body:
                    reader.readinto(body)
                if request_line.startswith(b"GET /health"):
                    conn.sendall(health_answer(self.instance))
                    continue
                if upstream is None and handle == self.record:
                    upstream = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port)
                conn.sendall(handle(request_line, headers, body, upstream))
        if upstream is not None:
            upstream.close()

    def record(self, request_line, headers, body, upstream):
        """Pass the request to the upstream and its answer back, keeping the answer to a program run."""
        method, path, _ = request_line.decode("latin-1").split(" ", 2)
        upstream.request(method, path, body=bytes(body),
                         headers={k: v for k, v in headers.items() if k not in HOP_BY_HOP})
        response = upstream.getresponse()
        payload = response.read()
        answer = raw_answer(response.status, response.reason,
                            [(k, v) for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP], payload)
        content_type = response.getheader("Content-Type", "")
        self.instance = response.getheader("X-KCoral-Instance") or self.instance
        if response.status == 200 and not is_cache_miss(content_type, payload):
            program = split_parts(memoryview(body), boundary_of(headers))[0]
            self.recordings[bytes(program)] = (answer, referenced_blobs(json.loads(bytes(program))))
        return answer

    def replay(self, request_line, headers, body, upstream):
        """The recorded answer to the request's program, or CACHE_MISS for the blobs not sent yet."""
        program, blobs = split_parts(memoryview(body), boundary_of(headers))
        self.known.update(blobs)
        recorded = self.recordings.get(bytes(program))
        if recorded is None:
            return json_answer("400 Bad Request", {"status": "ERROR", "error": {
                "kind": "parse", "message": "the floor holds no recording of this program"}}, self.instance)
        answer, referenced = recorded
        missing = [digest for digest in referenced if digest not in self.known]
        if missing:
            return json_answer("200 OK", {"status": "CACHE_MISS", "request_id": str(uuid.uuid4()),
                                          "missing_blobs": missing}, self.instance)
        return answer


def read_headers(reader):
    headers = {}
    while True:
        line = reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


def raw_answer(status, reason, headers, payload):
    head = "".join(f"{name}: {value}\r\n" for name, value in headers)
    return (f"HTTP/1.1 {status} {reason}\r\n{head}Content-Length: {len(payload)}\r\n\r\n").encode("latin-1") + payload


def json_answer(status, value, instance):
    code, _, reason = status.partition(" ")
    return raw_answer(code, reason, [("Content-Type", "application/json"), ("X-KCoral-Instance", instance)],
                      json.dumps(value).encode())


def health_answer(instance):
    load = {"request_capacity": WORKERS, "requests_in_progress": 0, "requests_waiting": 0}
    return json_answer("200 OK", {"status": "ok", "load": load}, instance)


def is_cache_miss(content_type, payload):
    return content_type.startswith("application/json") and json.loads(payload).get("status") == "CACHE_MISS"


def boundary_of(headers):
    return headers.get("content-type", "").partition("boundary=")[2].strip('"').encode()


def split_parts(body, boundary):
    """(program part, [blob hashes]) of a well-formed multipart body (both clients write one)."""
    delimiter = b"\r\n--" + boundary
    program, blobs = None, []
    start = body.obj.find(b"--" + boundary) + len(boundary) + 2
    while bytes(body[start:start + 2]) != b"--":
        header_end = body.obj.find(b"\r\n\r\n", start)
        end = body.obj.find(delimiter, header_end)
        name = DISPOSITION_NAME.search(bytes(body[start:header_end])).group(1).decode()
        if name == "program":
            program = body[header_end + 4:end]
        else:
            blobs.append(name.removeprefix("blob:"))
        start = end + len(delimiter)
    return program, blobs


def referenced_blobs(program):
    return list(dict.fromkeys(ins["blob"] for ins in program["instructions"]
                              if ins["op"] == "upload" and "blob" in ins))
