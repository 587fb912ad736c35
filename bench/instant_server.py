"""What a client costs by itself: a stand-in server that answers the benchmark's echo programs
at once, so that the time a client spends on a request against it is that client's own floor.

Standard library only (bench/published_client_driver.py imports it in the published client's
virtualenv).  `InstantServer()` forks a process that listens on loopback and speaks just
enough of the protocol for the programs of bench/scenarios.py that only move data: a `bytes`
upload returned as it is, and a folder of `file` uploads returned as a folder.  It keeps
every blob it receives (its cache), answers `CACHE_MISS` for the ones it lacks, trusts the
hashes it is given (it checks nothing: no server may do less), and sends the answer with
`sendmsg` from the request bodies it kept.  Anything else is a 400: it runs no code.
A client's time against it is what the client itself spends on framing, checking and copying
the same bytes a real server sends: the lowest time any server can give that client.
"""

import json
import os
import re
import signal
import socket
import threading
import uuid

WORKERS = 2  # what its /health reports, like the benchmarked servers
IOV_BATCH = 512  # buffers per sendmsg call (Linux accepts up to 1024)
DISPOSITION_NAME = re.compile(rb'name="([^"]*)"')


class InstantServer:
    """A forked process answering on a free loopback port until stop()."""

    name = "client alone"

    def __init__(self):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self.pid = os.fork()
        if self.pid == 0:  # the child serves until killed, never returning into the caller's code
            try:
                serve(listener)
            finally:
                os._exit(0)
        listener.close()

    def stop(self):
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def serve(listener):
    blobs = {}  # hash -> memoryview of the request body that carried it
    instance = str(uuid.uuid4())
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve_connection, args=(conn, blobs, instance), daemon=True).start()


def serve_connection(conn, blobs, instance):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = conn.makefile("rb")
    with conn, reader:
        while True:
            request_line = reader.readline()
            if not request_line:
                return
            headers = read_headers(reader)
            body = bytearray(int(headers.get("content-length", 0)))
            if body:
                reader.readinto(body)
            if request_line.startswith(b"GET /health"):
                load = {"request_capacity": WORKERS, "requests_in_progress": 0, "requests_waiting": 0}
                send(conn, instance, "200 OK", "application/json", [json.dumps({"status": "ok", "load": load}).encode()])
                continue
            send(conn, instance, *answer(headers.get("content-type", ""), memoryview(body), blobs))


def read_headers(reader):
    headers = {}
    while True:
        line = reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


def send(conn, instance, status, content_type, pieces, request_id=""):
    """The answer, naming the instance as our server does (our client then sends small blobs at once)."""
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nX-Request-ID: {request_id}\r\n"
            f"X-KCoral-Instance: {instance}\r\n"
            f"Content-Length: {sum(len(p) for p in pieces)}\r\n\r\n").encode()
    buffers = [memoryview(head), *map(memoryview, pieces)]
    while buffers:
        sent = conn.sendmsg(buffers[:IOV_BATCH])
        while buffers and sent >= len(buffers[0]):
            sent -= len(buffers.pop(0))
        if sent:
            buffers[0] = buffers[0][sent:]


def split_parts(body, boundary):
    """{part name: payload view} of a multipart body (well formed: both clients write it)."""
    delimiter = b"\r\n--" + boundary
    parts, start = {}, body.obj.find(b"--" + boundary) + len(boundary) + 2
    while bytes(body[start:start + 2]) != b"--":
        header_end = body.obj.find(b"\r\n\r\n", start)
        end = body.obj.find(delimiter, header_end)
        name = DISPOSITION_NAME.search(bytes(body[start:header_end])).group(1).decode()
        parts[name] = body[header_end + 4:end]
        start = end + len(delimiter)
    return parts


def answer(content_type, body, blobs):
    """-> (status, content type, response pieces, request id) for one POST /execute.  The answer
    reuses the request's boundary: the client chose it absent from the payloads it sent back."""
    boundary = content_type.partition("boundary=")[2].strip('"').encode()
    parts = split_parts(body, boundary)
    program = json.loads(bytes(parts.pop("program")))
    for name, payload in parts.items():
        blobs[name.removeprefix("blob:")] = payload
    request_id = str(uuid.uuid4())
    referenced = [ins["blob"] for ins in program["instructions"] if ins["op"] == "upload" and "blob" in ins]
    missing = list(dict.fromkeys(digest for digest in referenced if digest not in blobs))
    if missing:
        body = {"status": "CACHE_MISS", "request_id": request_id, "missing_blobs": missing}
        return "200 OK", "application/json", [json.dumps(body).encode()], request_id
    try:
        results, returned = run_echo(program["instructions"])
    except (KeyError, ValueError) as exc:
        error = {"status": "ERROR", "request_id": request_id, "error": {"kind": "parse", "message": str(exc)}}
        return "400 Bad Request", "application/json", [json.dumps(error).encode()], request_id
    result = {"status": "COMPLETED", "request_id": request_id, "queue_ms": 0.0, "elapsed_ms": 0.0,
              "lease_wait_ms": 0.0, "lease_held_ms": 0.0, "stdout": "", "stderr": "",
              "stdout_truncated": False, "stderr_truncated": False, "results": results}
    pieces = multipart(boundary, result, [blobs[digest] for digest in returned])
    return "200 OK", f"multipart/form-data; boundary={boundary.decode()}", pieces, request_id


def run_echo(instructions):
    """The echo programs only -> (results, hashes of the parts in order)."""
    uploads, results, returned = {}, {}, []
    for ins in instructions:
        if ins["op"] == "upload" and ins["kind"] == "bytes":
            uploads[ins["id"]] = ins["blob"]
        elif ins["op"] == "upload" and ins["kind"] == "file":
            uploads[ins["path"]] = ins["blob"]
        elif ins["op"] == "return" and "value" in ins:
            digest = uploads[ins["value"]["$ref"]]
            results[ins["key"]] = {"type": "bytes", "part": f"return:{len(returned)}", "sha256": digest}
            returned.append(digest)
        elif ins["op"] == "return" and ins.get("kind") == "folder":
            prefix = ins["path"] + "/"
            files, directories = {}, set()
            for path in sorted(p for p in uploads if p.startswith(prefix)):
                relative = path[len(prefix):]
                directories.update("/".join(relative.split("/")[:n]) for n in range(1, relative.count("/") + 1))
                files[relative] = {"type": "file", "part": f"return:{len(returned)}", "sha256": uploads[path],
                                   "size": None}
                returned.append(uploads[path])
            results[ins["key"]] = {"type": "folder", "files": files, "directories": sorted(directories)}
        else:
            raise ValueError(f"the instant server only echoes uploads, not {ins['op']} {ins.get('kind')}")
    return results, returned


def multipart(boundary, result, payloads):
    """The response pieces: the result part, then one part per payload (sizes filled in)."""
    for value in result["results"].values():
        for file in value.get("files", {}).values():
            file["size"] = len(payloads[int(file["part"].removeprefix("return:"))])
    b = boundary.decode()
    pieces = [f'--{b}\r\nContent-Disposition: form-data; name="result"\r\nContent-Type: application/json\r\n\r\n'
              .encode(), json.dumps(result, separators=(",", ":")).encode(), b"\r\n"]
    for n, payload in enumerate(payloads):
        pieces += [f'--{b}\r\nContent-Disposition: form-data; name="return:{n}"\r\n'
                   f'Content-Type: application/octet-stream\r\n\r\n'.encode(), payload, b"\r\n"]
    pieces.append(f"--{b}--\r\n".encode())
    return pieces
