"""Tests for client.py against CLIENT.md / PROTOCOL.md.

Most tests talk to a scripted stub HTTP server (built on http.server, in a thread) that
records every request and answers with canned responses; the interop tests at the end
run the same client against real servers (the published kcoral 0.1.1 CPU server)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
import types
import uuid
import http.server

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import client  # noqa: E402
from client import (  # noqa: E402
    Client, KCoralError, Program, ProgramResult, ProtocolError, Register, RemoteExecutionError,
    RemoteFunction, ReturnedFile, ReturnedFolder, TransportError, ValidationError,
)

RID = "4aaf9d21-5934-405f-8a46-d46270796569"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------
# The stub server


@dataclasses.dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    client_port: int

    def parts(self) -> dict[str, bytes]:
        """The request's multipart parts by name, in body order."""
        boundary = client._multipart_boundary(self.headers["content-type"])
        return {name: bytes(payload) for name, _, payload in client._parse_multipart(self.body, boundary)}

    def program(self) -> dict:
        return json.loads(self.parts()["program"])

    def blob_names(self) -> list[str]:
        return [name for name in self.parts() if name != "program"]


class Stub:
    """Answers each request with the next queued response (a (status, headers, body)
    tuple, plus "close" to drop the connection afterwards; a callable taking the Recorded
    request; or raw bytes written to the socket before closing it) and records every request."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.responses: collections.deque = collections.deque()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                stub._handle(self)

            do_POST = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def queue(self, *responses: object) -> None:
        self.responses.extend(responses)

    def _handle(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length", 0)))
        request = Recorded(handler.command, handler.path,
                           {k.lower(): v for k, v in handler.headers.items()}, body,
                           handler.client_address[1])
        self.requests.append(request)
        response = self.responses.popleft() if self.responses else (404, {}, b'{"detail":"Not Found"}')
        if callable(response):
            response = response(request)
        if isinstance(response, bytes):
            handler.wfile.write(response)
            handler.close_connection = True
            return
        status, headers, payload, *close = response
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)
        handler.close_connection = bool(close)  # without saying so: like an idle timeout

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    server = Stub()
    yield server
    server.close()


@pytest.fixture
def cli(stub):
    with Client(stub.url) as c:
        yield c


def json_response(payload: object, status: int = 200, headers: dict | None = None) -> tuple:
    return status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(payload).encode()


def body_fields(status: str = "COMPLETED", results: dict | None = None, **fields: object) -> dict:
    payload = {"status": status, "request_id": RID, "queue_ms": 0.5, "elapsed_ms": 12,
               "lease_wait_ms": 0.0, "lease_held_ms": 0.0, "stdout": "out", "stderr": "",
               "stdout_truncated": False, "stderr_truncated": False, "results": results or {}}
    payload.update(fields)
    return payload


def completed(results: dict | None = None, headers: dict | None = None, **fields: object) -> tuple:
    return json_response(body_fields("COMPLETED", results, **fields), headers=headers)


def cache_miss(*hashes: str, headers: dict | None = None) -> tuple:
    return json_response({"status": "CACHE_MISS", "request_id": RID, "missing_blobs": list(hashes)},
                         headers=headers)


def multipart(result: object, parts: list[bytes], boundary: str = "kcoral-b0undary",
              result_text: bytes | None = None) -> tuple:
    chunks = [f'--{boundary}\r\nContent-Disposition: form-data; name="result"\r\n'
              f"Content-Type: application/json\r\n\r\n".encode()
              + (result_text if result_text is not None else json.dumps(result).encode())]
    for index, data in enumerate(parts):
        chunks.append(f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="return:{index}"\r\n'
                      f"Content-Type: application/octet-stream\r\n\r\n".encode() + data)
    chunks.append(f"\r\n--{boundary}--\r\n".encode())
    return 200, {"Content-Type": f"multipart/form-data; boundary={boundary}"}, b"".join(chunks)


def raw_multipart(body: bytes, content_type: str = "multipart/form-data; boundary=B") -> tuple:
    return 200, {"Content-Type": content_type}, body


def binary(kind: str, index: int, data: bytes, **fields: object) -> dict:
    return {"type": kind, "part": f"return:{index}", "sha256": sha(data), **fields}


def module_program(source: str = "def f():\n    return 1\n", *blobs: bytes) -> Program:
    program = Program()
    module = program.upload(kind="module", source=source)
    for data in blobs:
        program.upload(kind="bytes", value=data)
    program.return_(key="x", value=program.run(fn=program.get_function(module=module, name="f")))
    return program


# ---------------------------------------------------------------------------
# Program: ids and keys (CLIENT.md §3.1-3.2)


def ids(program: Program) -> list[str]:
    return [i.get("id") for i in program.instructions]


def test_auto_ids_share_one_counter():
    p = Program()
    m = p.upload(kind="module", source="")
    f = p.get_function(module=m, name="f")
    r = p.run(fn=f)
    assert (m, f, r) == (Register("upload_0"), Register("get_function_1"), Register("run_2"))
    p.upload(kind="module", source="", id="custom")
    p.get_function(module=m, name="f")
    assert ids(p) == ["upload_0", "get_function_1", "run_2", "custom", "get_function_3"]
    assert repr(m) == "Register(id='upload_0')"


def test_auto_ids_skip_ids_taken_by_custom_ids():
    p = Program()
    m = p.upload(kind="module", source="", id="get_function_1")
    p.upload(kind="module", source="")
    p.get_function(module=m, name="f")
    assert ids(p) == ["get_function_1", "upload_0", "get_function_2"]
    q = Program()
    q.upload(kind="module", source="", id="upload_0")
    q.upload(kind="module", source="")
    assert ids(q) == ["upload_0", "upload_1"]


@pytest.mark.parametrize("bad_id", ["", 3, b"x"])
def test_bad_custom_id_is_value_error(bad_id):
    with pytest.raises(ValueError):
        Program().upload(kind="module", source="", id=bad_id)


def test_failed_upload_records_nothing():
    p = Program()
    p.upload(kind="bytes", value=b"a", id="x")
    for call in (lambda: p.upload(kind="bytes", value=b"orphan", id="x"),
                 lambda: p.upload_file(blob=b"orphan", path="f", id="x"),
                 lambda: p.upload(kind="tensor", value=np.zeros(2, np.float32), id="x")):
        with pytest.raises(ValueError, match="duplicate"):
            call()
    assert list(p._blobs) == [sha(b"a")] and len(p.instructions) == 1
    p.upload(kind="bytes", value=b"b")
    assert ids(p) == ["x", "upload_0"]  # failed calls did not advance the counter


def test_return_keys_are_validated_and_separate_from_ids():
    p = Program()
    m = p.upload(kind="module", source="", id="k")
    p.return_(key="k", value=m)
    with pytest.raises(ValueError):
        p.return_(key="k", value=m)
    with pytest.raises(ValueError):
        p.return_file(key="", path="a")
    with pytest.raises(ValueError):
        p.return_folder(key=None, path="a")


def test_instructions_is_a_shallow_copy():
    p = Program()
    p.upload(kind="module", source="")
    copy = p.instructions
    copy.append({})
    assert len(p.instructions) == 1 and p.instructions[0] is copy[0]


# ---------------------------------------------------------------------------
# Program: uploads (CLIENT.md §3.3-3.6)


def test_upload_wire_instructions():
    p = Program()
    p.upload(kind="module", source="x = 1")
    p.upload(kind="bytes", value=bytearray(b"\x01\x02"))
    p.upload(kind="library", value=memoryview(b"lib"))
    p.upload(kind="bytes", value=b"\x01\x02")  # same content: one blob
    assert p.instructions == [
        {"op": "upload", "id": "upload_0", "kind": "module", "source": "x = 1"},
        {"op": "upload", "id": "upload_1", "kind": "bytes", "blob": sha(b"\x01\x02")},
        {"op": "upload", "id": "upload_2", "kind": "library", "blob": sha(b"lib")},
        {"op": "upload", "id": "upload_3", "kind": "bytes", "blob": sha(b"\x01\x02")},
    ]
    assert p._blobs == {sha(b"\x01\x02"): b"\x01\x02", sha(b"lib"): b"lib"}


def test_upload_copies_mutable_bytes():
    data = bytearray(b"abc")
    p = Program()
    p.upload(kind="bytes", value=data)
    data[0] = ord("z")
    assert list(p._blobs.values()) == [b"abc"]


@pytest.mark.parametrize("kwargs, error", [
    ({"kind": "module", "source": b"x"}, TypeError),
    ({"kind": "module", "source": "x", "value": b""}, TypeError),
    ({"kind": "module", "source": "x", "dtype": "int8"}, TypeError),
    ({"kind": "tensor", "source": "x", "value": np.zeros(1)}, TypeError),
    ({"kind": "bytes", "value": "text"}, TypeError),
    ({"kind": "bytes", "value": b"x", "source": "s"}, TypeError),
    ({"kind": "bytes", "value": b"x", "shape": [1]}, TypeError),
    ({"kind": "library", "value": None}, TypeError),
    ({"kind": "library", "value": "lib"}, TypeError),
    ({"kind": "file", "value": b"x"}, ValueError),
    ({"kind": "blob", "value": b"x"}, ValueError),
])
def test_upload_argument_errors(kwargs, error):
    p = Program()
    with pytest.raises(error):
        p.upload(**kwargs)
    assert p.instructions == [] and p._blobs == {}


def tensor_upload(value, **kwargs) -> tuple[dict, bytes]:
    p = Program()
    p.upload(kind="tensor", value=value, **kwargs)
    instruction = p.instructions[0]
    return instruction, p._blobs[instruction["blob"]]


def test_numpy_tensor_upload():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    instruction, data = tensor_upload(a)
    assert instruction == {"op": "upload", "id": "upload_0", "kind": "tensor", "blob": sha(a.tobytes()),
                           "dtype": "float32", "shape": [2, 3]}
    assert data == a.tobytes()
    assert tensor_upload(a.T)[1] == np.ascontiguousarray(a.T).tobytes()  # C order
    assert tensor_upload(np.array([True, False]))[0]["dtype"] == "bool"


def test_numpy_tensor_conversion_quirks():
    assert tensor_upload(np.array(5))[0]["shape"] == [1]  # ascontiguousarray makes 0-d 1-d
    scalar, data = tensor_upload(np.int64(3))  # duck-typed path
    assert (scalar["dtype"], scalar["shape"], data) == ("int64", [], (3).to_bytes(8, "little"))


def test_big_endian_arrays_are_sent_little_endian():
    instruction, data = tensor_upload(np.array([1, 2], dtype=">i4"))
    assert instruction["dtype"] == "int32" and data == b"\x01\0\0\0\x02\0\0\0"


def test_ml_dtypes_tensor_upload():
    a = np.array([1.0, -2.0], dtype=ml_dtypes.bfloat16)
    instruction, data = tensor_upload(a)
    assert (instruction["dtype"], data) == ("bfloat16", a.tobytes())
    assert tensor_upload(np.zeros(3, ml_dtypes.float8_e4m3fn))[0]["dtype"] == "float8_e4m3fn"


def test_torch_tensor_upload():
    t = torch.arange(6, dtype=torch.float32, requires_grad=True).reshape(3, 2)
    instruction, data = tensor_upload(t.t())
    assert (instruction["dtype"], instruction["shape"]) == ("float32", [2, 3])
    assert data == t.detach().t().contiguous().numpy().tobytes()
    b = torch.tensor([1.5, 2.0], dtype=torch.bfloat16)
    instruction, data = tensor_upload(b)
    assert instruction["dtype"] == "bfloat16"
    assert np.frombuffer(data, ml_dtypes.bfloat16).tolist() == [1.5, 2.0]
    assert tensor_upload(torch.tensor(3.0))[0]["shape"] == []
    assert tensor_upload(torch.zeros(2, dtype=torch.float8_e5m2))[0]["dtype"] == "float8_e5m2"


def test_dlpack_and_duck_typed_tensor_upload():
    class DLPackOnly:
        def __init__(self, array):
            self._array = array

        def __dlpack__(self, **kwargs):
            return self._array.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._array.__dlpack_device__()

    a = np.arange(4, dtype=np.int16)
    assert tensor_upload(DLPackOnly(a))[0]["dtype"] == "int16"

    class Duck:
        dtype, shape = "uint8", (2,)

        def tobytes(self):
            return b"\x01\x02"

    assert tensor_upload(Duck())[0]["shape"] == [2]


def test_raw_tensor_bytes():
    instruction, data = tensor_upload(b"\0" * 8, dtype="float32", shape=(2,))
    assert (instruction["dtype"], instruction["shape"], data) == ("float32", [2], b"\0" * 8)
    with pytest.raises(TypeError, match="require 'dtype' and 'shape'"):
        tensor_upload(b"\0" * 8, dtype="float32")
    with pytest.raises(ValueError):
        tensor_upload(b"\0" * 8, dtype="float32", shape=[-1, -2])
    with pytest.raises(ValueError):
        tensor_upload(b"\0" * 8, dtype="float32", shape=[3])


@pytest.mark.parametrize("value, kwargs", [
    (np.zeros(2, np.complex64), {}),
    (np.zeros(2, np.uint16), {}),
    (np.zeros(2, ml_dtypes.float8_e4m3fnuz), {}),
    (np.zeros(2, np.float32), {"dtype": "float64"}),
    (np.zeros(2, np.float32), {"shape": [1, 2]}),
    (b"\0\0", {"dtype": "uint16", "shape": [1]}),
])
def test_tensor_value_errors(value, kwargs):
    with pytest.raises(ValueError):
        tensor_upload(value, **kwargs)


def test_tensor_type_errors():
    with pytest.raises(TypeError, match="cannot upload 'list' as a tensor"):
        tensor_upload([1, 2])
    assert tensor_upload(np.zeros(2, np.float32), dtype="float32", shape=(2,))[0]["shape"] == [2]


@pytest.mark.parametrize("raw, normalised", [
    ("./a//b/", "a/b"), ("a/./b", "a/b"), ("inputs/config.txt", "inputs/config.txt"),
    ("é" * 127, "é" * 127),
])
def test_path_normalisation(raw, normalised):
    p = Program()
    p.upload_file(blob=b"x", path=raw)
    assert p.instructions[0]["path"] == normalised


@pytest.mark.parametrize("raw", ["", "../x", "a/../b", "/abs", "a\\b", ".", "./", "a\0b",
                                 "x" * 256, "é" * 128, "a/" * 2048 + "b", "\ud800", 5, None])
def test_invalid_paths(raw):
    with pytest.raises(ValidationError):
        Program().upload_file(blob=b"x", path=raw)
    with pytest.raises(ValueError):
        Program().return_file(key="k", path=raw)


def test_upload_file_rules():
    p = Program()
    assert p.upload_file(blob=b"x", path="a/b", id="f") == Register("f")
    assert p.instructions[0] == {"op": "upload", "id": "f", "kind": "file", "blob": sha(b"x"), "path": "a/b"}
    with pytest.raises(TypeError, match="bytes-like 'blob'"):
        p.upload_file(blob="text", path="c")
    for conflict in ["./a//b", "a", "a/b/c"]:
        with pytest.raises(ValueError):
            p.upload_file(blob=b"y", path=conflict)
    for fine in ["a-b", "ab", "a/c"]:
        p.upload_file(blob=b"y", path=fine)
    q = Program()
    q.upload_file(blob=b"x", path="a/b/c")
    with pytest.raises(ValueError, match="conflicting"):
        q.upload_file(blob=b"x", path="a")
    assert len(q.instructions) == 1


def make_tree(root: pathlib.Path, files: dict[str, bytes]) -> pathlib.Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_upload_folder_snapshot(tmp_path):
    assets = make_tree(tmp_path / "assets", {"a.bin": b"A", ".hidden": b"H", "sub/x": b"A"})
    (assets / "empty").mkdir()
    p = Program()
    p.upload(kind="module", source="")
    p.upload_folder(assets, path="./inputs//")
    assert [(i["id"], i["path"]) for i in p.instructions[1:]] == [
        ("upload_1", "inputs/.hidden"), ("upload_2", "inputs/a.bin"), ("upload_3", "inputs/sub/x")]
    assert list(p._blobs) == [sha(b"H"), sha(b"A")]  # identical contents share a blob
    (assets / "a.bin").write_bytes(b"changed later")
    assert p._blobs[p.instructions[2]["blob"]] == b"A"
    empty = Program()
    empty.upload_folder(assets / "empty", path="e")
    assert empty.instructions == []


def test_upload_folder_is_all_or_nothing(tmp_path):
    assets = make_tree(tmp_path / "assets", {"a": b"1", "b/c": b"2"})
    p = Program()
    p.upload_file(blob=b"0", path="in/b")  # conflicts with in/b/c
    with pytest.raises(ValueError):
        p.upload_folder(assets, path="in")
    assert len(p.instructions) == 1 and len(p._blobs) == 1
    p.upload_folder(assets, path="other")
    with pytest.raises(ValueError):
        p.upload_folder(assets, path="other")
    assert len(p.instructions) == 3


def test_upload_folder_refuses_links_and_special_files(tmp_path):
    assets = make_tree(tmp_path / "assets", {"a": b"1"})
    (tmp_path / "link").symlink_to(assets)
    with pytest.raises(ValueError):
        Program().upload_folder(tmp_path / "link", path="x")
    with pytest.raises(FileNotFoundError):
        Program().upload_folder(tmp_path / "missing", path="x")
    with pytest.raises(NotADirectoryError):
        Program().upload_folder(assets / "a", path="x")
    (assets / "to_file").symlink_to(assets / "a")
    with pytest.raises(ValueError, match="symbolic link"):
        Program().upload_folder(assets, path="x")
    (assets / "to_file").unlink()
    os.mkfifo(assets / "fifo")
    with pytest.raises(ValueError, match="special"):
        Program().upload_folder(assets, path="x")
    with pytest.raises(ValidationError):
        Program().upload_folder(tmp_path, path="../x")


def test_upload_folder_rejects_names_that_are_not_protocol_paths(tmp_path):
    make_tree(tmp_path / "assets", {"back\\slash": b"1"})
    with pytest.raises(ValueError):
        Program().upload_folder(tmp_path / "assets", path="x")


# ---------------------------------------------------------------------------
# Program: get_function, run, returns (CLIENT.md §3.7-3.10)


def test_get_function_checks_in_order():
    p = Program()
    m = p.upload(kind="module", source="", id="m")
    with pytest.raises(TypeError):
        p.get_function(module="m", name="")
    with pytest.raises(TypeError):
        p.get_function(module={"$ref": "m", "x": 1}, name="f")
    with pytest.raises(ValueError):
        p.get_function(module=Register("nope"), name="f", cpu_only="yes")
    with pytest.raises(ValueError):
        p.get_function(module=m, name="", cpu_only="yes")
    with pytest.raises(TypeError):
        p.get_function(module=m, name="f", cpu_only="yes", id="")
    with pytest.raises(ValueError):
        p.get_function(module=m, name="f", id="m")
    p.get_function(module={"$ref": "m"}, name="f")
    p.get_function(module=m, name="g", cpu_only=True)
    assert p.instructions[1:] == [
        {"op": "get_function", "id": "get_function_0", "module": {"$ref": "m"}, "name": "f"},
        {"op": "get_function", "id": "get_function_1", "module": {"$ref": "m"}, "name": "g", "cpu_only": True}]


def test_run_rules():
    p = Program()
    m = p.upload(kind="module", source="")
    f = p.get_function(module=m, name="f")
    with pytest.raises(TypeError):
        p.run(fn={"$ref": f.id})
    with pytest.raises(ValueError):
        p.run(fn=Register("nope"))
    p.run(fn=f)
    nested = [Register("upload_0")]
    p.run(fn=f, args=[m, 1, {"$ref": "m"}, nested, Register("unknown")])
    assert p.instructions[2]["args"] == []
    assert p.instructions[3]["args"] == [{"$ref": "upload_0"}, 1, {"$ref": "m"}, nested, {"$ref": "unknown"}]


def test_returns():
    p = Program()
    m = p.upload(kind="module", source="")
    p.return_(key="a", value=m)
    p.return_(key="b", value={"$ref": "upload_0"})
    p.return_file(key="c", path="./out//f.txt")
    p.return_folder(key="d", path=m)
    assert p.instructions[1:] == [
        {"op": "return", "key": "a", "value": {"$ref": "upload_0"}},
        {"op": "return", "key": "b", "value": {"$ref": "upload_0"}},
        {"op": "return", "key": "c", "kind": "file", "path": "out/f.txt"},
        {"op": "return", "key": "d", "kind": "folder", "path": {"$ref": "upload_0"}}]
    with pytest.raises(TypeError):
        p.return_(key="e", value="upload_0")
    with pytest.raises(ValueError):
        p.return_(key="e", value=Register("nope"))
    with pytest.raises(ValueError):
        p.return_file(key="e", path=Register("nope"))
    with pytest.raises(ValueError):
        p.return_folder(key="e", path=".")
    assert len(p.instructions) == 5


# ---------------------------------------------------------------------------
# Client: request encoding and options (CLIENT.md §4.1)


def test_request_encoding(stub, cli):
    stub.queue(completed())
    p = module_program("def f():\n    return 'é'\n")
    cli.execute(p)
    request = stub.requests[0]
    assert (request.method, request.path) == ("POST", "/execute")
    assert request.headers["content-type"].startswith("multipart/form-data; boundary=kcoral-")
    assert request.headers["content-length"] == str(len(request.body))
    assert list(request.parts()) == ["program"]
    program_text = request.parts()["program"].decode("utf-8")
    assert "é" in program_text and ", " not in program_text  # compact, non-ASCII literal
    assert json.loads(program_text) == {"instructions": p.instructions}
    boundary = request.headers["content-type"].split("boundary=")[1]
    assert request.body.startswith(f'--{boundary}\r\nContent-Disposition: form-data; name="program"\r\n'
                                   f"Content-Type: application/json\r\n\r\n".encode())
    assert request.body.endswith(f"\r\n--{boundary}--\r\n".encode())


def test_options_are_sent_only_when_given(stub, cli):
    stub.queue(completed(), completed())
    cli.execute(Program())
    cli.execute(Program(), timeout_seconds=0.5, gpu_count=2, output_limit_bytes=0)
    assert "options" not in stub.requests[0].program()
    assert stub.requests[1].program()["options"] == {"timeout_seconds": 0.5, "gpu_count": 2,
                                                     "output_limit_bytes": 0}


def test_execute_local_checks(stub, cli):
    with pytest.raises(TypeError, match="execute expects a Program"):
        cli.execute({"instructions": []})
    for bad in (0, 9, True, 1.0, "1"):
        with pytest.raises(ValueError):
            cli.execute(Program(), gpu_count=bad)
    with pytest.raises(ValueError):
        cli.execute(Program(), timeout_seconds=float("nan"))
    p = Program()
    f = p.get_function(module=p.upload(kind="module", source=""), name="f")
    p.run(fn=f, args=[[Register("upload_0")]])
    with pytest.raises(TypeError):
        cli.execute(p)
    assert stub.requests == []


def test_options_are_not_validated_locally(stub, cli):
    stub.queue(json_response({"status": "ERROR", "request_id": RID,
                              "error": {"kind": "parse", "message": "bad timeout"}}, status=400))
    with pytest.raises(KCoralError) as info:
        cli.execute(Program(), timeout_seconds="soon")
    assert stub.requests[0].program()["options"] == {"timeout_seconds": "soon"}
    assert (info.value.status_code, info.value.kind, info.value.message) == (400, "parse", "bad timeout")


def test_headers_and_base_url(stub):
    stub.queue(completed(), json_response({"status": "ok", "target": {}}))
    with Client(stub.url + "/", headers={"Authorization": "Bearer t", "Content-Type": "text/plain"}) as c:
        c.execute(Program())
        c.health()
    assert [r.path for r in stub.requests] == ["/execute", "/health"]
    assert all(r.headers["authorization"] == "Bearer t" for r in stub.requests)
    assert stub.requests[0].headers["content-type"].startswith("multipart/form-data")
    with pytest.raises(ValueError):
        Client("localhost:8000")


# ---------------------------------------------------------------------------
# Client: the CACHE_MISS negotiation (CLIENT.md §4.2) and the blob memory


def two_blob_program() -> tuple[Program, str, str]:
    p = module_program("def f():\n    return 1\n", b"first", b"second")
    return p, sha(b"first"), sha(b"second")


def test_cache_miss_three_attempts_then_protocol_error(stub, cli):
    p, a, b = two_blob_program()
    stub.queue(cache_miss(a), cache_miss(b), cache_miss(a))
    with pytest.raises(ProtocolError):
        cli.execute(p)
    assert [r.blob_names() for r in stub.requests] == [[], [f"blob:{a}"], [f"blob:{a}", f"blob:{b}"]]
    assert stub.requests[2].parts()[f"blob:{b}"] == b"second"
    assert len({json.dumps(r.program()) for r in stub.requests}) == 1  # identical program JSON


def test_cache_miss_then_completed(stub, cli):
    p, a, b = two_blob_program()
    stub.queue(cache_miss(b, a), completed())
    assert cli.execute(p).completed
    assert [r.blob_names() for r in stub.requests] == [[], [f"blob:{a}", f"blob:{b}"]]


@pytest.mark.parametrize("missing", [[], ["A" * 64], ["ab"], [sha(b"first")] * 2, [sha(b"unknown")], "x"])
def test_invalid_cache_miss_is_protocol_error(stub, cli, missing):
    stub.queue(json_response({"status": "CACHE_MISS", "request_id": RID, "missing_blobs": missing}))
    with pytest.raises(ProtocolError):
        cli.execute(two_blob_program()[0])
    assert len(stub.requests) == 1


def test_cache_miss_with_binary_parts_is_protocol_error(stub, cli):
    stub.queue(multipart({"status": "CACHE_MISS", "request_id": RID, "missing_blobs": [sha(b"first")]},
                         [b"x"]))
    with pytest.raises(ProtocolError):
        cli.execute(two_blob_program()[0])


def test_router_node_is_echoed_on_the_next_attempt(stub, cli):
    p, a, b = two_blob_program()
    stub.queue(cache_miss(a, headers={"X-KCoral-Node": "node-7"}), completed())
    cli.execute(p)
    assert "x-kcoral-node" not in stub.requests[0].headers
    assert stub.requests[1].headers["x-kcoral-node"] == "node-7"


def test_without_instance_header_the_client_always_asks_first(stub, cli):
    p, a, b = two_blob_program()
    stub.queue(cache_miss(a, b), completed(), completed())
    cli.execute(p)
    cli.execute(module_program("def f():\n    return 2\n", b"fresh"))
    assert [r.blob_names() for r in stub.requests] == [[], [f"blob:{a}", f"blob:{b}"], []]


def instance(name: str) -> dict:
    return {"X-KCoral-Instance": name}


def test_known_instance_gets_small_unknown_blobs_with_the_first_attempt(stub, cli):
    p, a, b = two_blob_program()
    stub.queue(cache_miss(a, b, headers=instance("i1")), completed(headers=instance("i1")))
    cli.execute(p)  # the instance is not known yet: ask first
    stub.queue(completed(headers=instance("i1")))
    p2 = module_program("def f():\n    return 2\n", b"first", b"fresh")
    cli.execute(p2)  # one round trip, sending only what i1 is not known to hold
    assert [r.blob_names() for r in stub.requests[2:]] == [[f"blob:{sha(b'fresh')}"]]
    stub.queue(completed(headers=instance("i1")))
    cli.execute(p2)
    assert stub.requests[3].blob_names() == []


def test_confirmed_blobs_are_per_cache(stub, cli):
    stub.queue(completed(headers=instance("i1")), completed(headers=instance("i1")),
               completed(headers=instance("i1")))
    as_file = Program()
    as_file.upload_file(blob=b"shared", path="f")
    cli.execute(as_file)
    as_bytes = Program()
    as_bytes.upload(kind="bytes", value=b"shared")
    cli.execute(as_bytes)  # the server's memory cache may lack what its file cache holds
    cli.execute(as_file)
    assert [r.blob_names() for r in stub.requests] == [[f"blob:{sha(b'shared')}"]] * 2 + [[]]


def test_large_unknown_blobs_still_ask_first(stub):
    with Client(stub.url, eager_upload_bytes=10) as c:
        stub.queue(json_response({"status": "ok"}, headers=instance("i1")))
        c.health()
        stub.queue(completed(headers=instance("i1")))
        c.execute(module_program("", b"small"))
        stub.queue(cache_miss(sha(b"x" * 11), headers=instance("i1")), completed(headers=instance("i1")))
        c.execute(module_program("", b"x" * 11))
    assert [r.blob_names() for r in stub.requests[1:]] == [
        [f"blob:{sha(b'small')}"], [], [f"blob:{sha(b'x' * 11)}"]]


def test_restart_resets_what_the_server_is_known_to_hold(stub, cli):
    p = module_program("", b"blob")
    blob = [f"blob:{sha(b'blob')}"]
    stub.queue(json_response({"status": "ok"}, headers=instance("i1")),
               completed(headers=instance("i1")), completed(headers=instance("i1")),
               json_response({"status": "ok"}, headers=instance("i2")), completed(headers=instance("i2")))
    cli.health()
    cli.execute(p)  # sent with the first attempt; afterwards i1 is known to hold it
    cli.execute(p)  # nothing to send
    cli.health()    # the server restarted as i2
    cli.execute(p)  # i2 is not known to hold anything: sent again
    assert [r.blob_names() for r in stub.requests if r.method == "POST"] == [blob, [], blob]


def test_restart_noticed_by_a_cache_miss(stub, cli):
    p = module_program("", b"blob")
    blob = [f"blob:{sha(b'blob')}"]
    stub.queue(json_response({"status": "ok"}, headers=instance("i1")), completed(headers=instance("i1")),
               cache_miss(sha(b"blob"), headers=instance("i2")), completed(headers=instance("i2")),
               completed(headers=instance("i2")))
    cli.health()
    cli.execute(p)
    cli.execute(p)  # believed held by i1, but i2 answers: the reference steps follow
    cli.execute(p)  # i2 now holds it
    assert [r.blob_names() for r in stub.requests if r.method == "POST"] == [blob, [], blob, []]


def test_eviction_falls_back_to_the_negotiation(stub, cli):
    p = module_program("", b"blob")
    stub.queue(json_response({"status": "ok"}, headers=instance("i1")), completed(headers=instance("i1")))
    cli.health()
    cli.execute(p)
    # the server evicted the blob; the client believed it held: the reference steps follow
    stub.queue(cache_miss(sha(b"blob"), headers=instance("i1")), cache_miss(sha(b"blob"), headers=instance("i1")),
               completed(headers=instance("i1")))
    cli.execute(p)
    assert [r.blob_names() for r in stub.requests[2:]] == [[], [f"blob:{sha(b'blob')}"]] + [[f"blob:{sha(b'blob')}"]]
    stub.queue(completed(headers=instance("i1")))
    cli.execute(module_program("", b"blob", b"new"))
    assert stub.requests[-1].blob_names() == [f"blob:{sha(b'new')}"]


def test_blob_memory_is_bounded():
    memory = client._BlobMemory()
    needs = {f"{i:064x}": {"memory"} for i in range(client._REMEMBERED_BLOBS_PER_INSTANCE + 10)}
    for name in range(client._REMEMBERED_INSTANCES + 3):
        memory.confirm(str(name), needs, needs)
    assert len(memory._held) == client._REMEMBERED_INSTANCES
    assert all(len(held) == client._REMEMBERED_BLOBS_PER_INSTANCE for held in memory._held.values())
    memory.observe(str(client._REMEMBERED_INSTANCES + 2))
    assert memory.not_held(needs) == {f"{i:064x}" for i in range(10)}  # the oldest were dropped


# ---------------------------------------------------------------------------
# Client: HTTP errors, transport, connections (CLIENT.md §4.4-4.6)


@pytest.mark.parametrize("status, body, expected", [
    (504, {"status": "ERROR", "request_id": RID, "error": {"kind": "timeout", "message": "execution timed out"}},
     (504, "timeout", "execution timed out", RID)),
    (405, {"detail": "Method Not Allowed"}, (405, None, "HTTP 405", None)),
    (500, {"error": "plain text"}, (500, None, "plain text", None)),
    (503, {"error": {"kind": "busy"}}, (503, "busy", "server error", None)),
    (502, ["not", "an", "object"], (502, None, "HTTP 502", None)),
])
def test_http_errors(stub, cli, status, body, expected):
    stub.queue(json_response(body, status=status))
    with pytest.raises(KCoralError) as info:
        cli.execute(Program())
    error = info.value
    assert (error.status_code, error.kind, error.message, error.request_id) == expected
    assert str(error) == f"HTTP {expected[0]}: {expected[2]}"


def test_http_error_with_a_non_json_body(stub, cli):
    stub.queue((502, {"Content-Type": "text/html"}, b"<html>bad gateway</html>"))
    with pytest.raises(KCoralError, match="HTTP 502: HTTP 502"):
        cli.health()


def test_kcoral_error_constructor():
    error = KCoralError(413, "too large", kind="request_too_large", request_id=RID)
    assert (str(error), error.status_code, error.kind, error.request_id) == (
        "HTTP 413: too large", 413, "request_too_large", RID)


def test_connection_refused_is_transport_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}") as c:
        with pytest.raises(TransportError):
            c.execute(Program())
        with pytest.raises(TransportError):
            c.health()


def test_broken_responses_are_transport_errors(stub, cli):
    stub.queue(b"", b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", b"garbage\r\n\r\n")
    for _ in range(3):
        with pytest.raises(TransportError):
            cli.execute(Program())


def test_keep_alive_connections_are_reused(stub, cli):
    stub.queue(completed(), completed(), completed())
    for _ in range(3):
        cli.execute(Program())
    assert len({r.client_port for r in stub.requests}) == 1


def test_a_connection_closed_by_the_server_is_not_reused(stub, cli):
    stub.queue((200, {"Connection": "close", "Content-Type": "application/json"},
                json.dumps(body_fields()).encode()), completed())
    cli.execute(Program())
    cli.execute(Program())
    assert len({r.client_port for r in stub.requests}) == 2


def test_an_idle_connection_dropped_by_the_server_is_replaced(stub, cli):
    stub.queue(completed() + ("close",), completed())  # the server drops the connection later
    cli.execute(Program())
    time.sleep(0.05)
    assert cli.execute(Program()).completed
    assert len({r.client_port for r in stub.requests}) == 2


def test_concurrent_use_from_threads(stub, cli):
    stub.queue(*[json_response({"status": "ok", "n": i}) for i in range(16)])
    results = []
    threads = [threading.Thread(target=lambda: results.append(cli.health()["n"])) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(16))
    assert len(cli._idle) <= client._MAX_IDLE_CONNECTIONS


def test_closed_client_raises_runtime_error(stub):
    with Client(stub.url) as c:
        pass
    with pytest.raises(RuntimeError):
        c.health()
    with pytest.raises(RuntimeError):
        c.execute(Program())
    assert stub.requests == []


def test_only_connecting_is_limited_by_the_connect_timeout(stub):
    def slow(request):
        time.sleep(0.6)
        return completed()[0], completed()[1], completed()[2]
    stub.queue(slow)
    with Client(stub.url, connect_timeout_seconds=0.2) as c:
        assert c.execute(Program()).completed


def test_health_and_target(stub, cli):
    body = {"status": "ok", "instance_id": "x", "target": {"arch": "sm_90a"}, "load": {}}
    stub.queue(json_response(body), json_response(body))
    assert cli.health() == body
    assert cli.target() == {"arch": "sm_90a"}
    for bad in ({"status": "ok", "target": {}}, {"status": "ok"}):
        stub.queue(json_response(bad))
        with pytest.raises(ProtocolError, match="no compilation target"):
            cli.target()
    for bad in (json_response({"status": "unavailable"}), json_response([1]),
                (200, {}, b"{nope"), (200, {}, b'{"status":"ok","status":"ok"}')):
        stub.queue(bad)
        with pytest.raises(ProtocolError):
            cli.health()
    stub.queue(json_response({"detail": "Not Found"}, status=404))
    with pytest.raises(KCoralError):
        cli.health()
