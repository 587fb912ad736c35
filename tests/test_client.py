"""Tests for client.py against docs/client.md / docs/protocol.md.

Most tests talk to a scripted stub HTTP server (built on http.server, in a thread) that
records every request and answers with canned responses; the interop tests at the end
run the same client against real servers (the published kcoral 0.1.1 CPU server)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import http.client
import http.server
import json
import math
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

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import client
from client import (
    Client,
    KCoralError,
    Program,
    ProgramResult,
    ProtocolError,
    Register,
    RemoteExecutionError,
    RemoteFunction,
    ReturnedFile,
    ReturnedFolder,
    TransportError,
    ValidationError,
)
from tests.support import (
    HostileServer,
    ServerProcess,
    join_threads,
    program_parts,
    reference_popen_options,
    reference_server_argv,
    sha256,
    wait_for,
)
from tests.support import multipart as support_multipart

REPO = pathlib.Path(__file__).resolve().parents[1]

RID = "4aaf9d21-5934-405f-8a46-d46270796569"


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
    tuple, plus "close" to drop the connection afterwards or "early" to answer without
    reading the body and then close; a callable taking the Recorded request; or raw bytes
    written to the socket before closing it) and records every request, and how many
    connections it has closed."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.responses: collections.deque = collections.deque()
        self.connections_closed = 0
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are separate writes

            def do_GET(self) -> None:
                stub._handle(self)

            do_POST = do_GET

            def log_message(self, *args: object) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
                super().shutdown_request(request)
                stub.connections_closed += 1  # the socket is closed: the client can see its end

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()

    def queue(self, *responses: object) -> None:
        self.responses.extend(responses)

    def _handle(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        response = self.responses.popleft() if self.responses else (404, {}, b'{"detail":"Not Found"}')
        early = isinstance(response, tuple) and response[3:] == ("early",)
        body = b"" if early else handler.rfile.read(int(handler.headers.get("Content-Length", 0)))
        request = Recorded(handler.command, handler.path,
                           {k.lower(): v for k, v in handler.headers.items()}, body,
                           handler.client_address[1])
        self.requests.append(request)
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
               "stdout_truncated": False, "stderr_truncated": False, "results": {} if results is None else results}
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
    return {"type": kind, "part": f"return:{index}", "sha256": sha256(data), **fields}


def module_program(source: str = "def f():\n    return 1\n", *blobs: bytes) -> Program:
    program = Program()
    module = program.upload(kind="module", source=source)
    for data in blobs:
        program.upload(kind="bytes", value=data)
    program.return_(key="x", value=program.run(fn=program.get_function(module=module, name="f")))
    return program


# ---------------------------------------------------------------------------
# Vendoring: one file, standard library and NumPy only


def test_a_vendored_copy_works_alone(tmp_path):
    shutil.copy(REPO / "client.py", tmp_path)
    code = """if True:
        import sys, numpy as np, client
        assert client.__file__.startswith(sys.argv[1]), client.__file__
        assert "torch" not in sys.modules and "ml_dtypes" not in sys.modules
        program = client.Program()
        program.upload(kind="tensor", value=np.zeros(2, np.float32))
        assert "torch" not in sys.modules and "ml_dtypes" not in sys.modules
        client._numpy_dtype("bfloat16")
        assert "ml_dtypes" in sys.modules and "torch" not in sys.modules
        print(",".join(client.__all__))
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0].split(",") == client.__all__


# ---------------------------------------------------------------------------
# Program: ids and keys (docs/client.md §3.1-3.2)


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
    assert list(p._blobs) == [sha256(b"a")] and len(p.instructions) == 1
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
# Program: uploads (docs/client.md §3.3-3.6)


def test_upload_wire_instructions():
    p = Program()
    p.upload(kind="module", source="x = 1")
    p.upload(kind="bytes", value=bytearray(b"\x01\x02"))
    p.upload(kind="library", value=memoryview(b"lib"))
    p.upload(kind="bytes", value=b"\x01\x02")  # same content: one blob
    assert p.instructions == [
        {"op": "upload", "id": "upload_0", "kind": "module", "source": "x = 1"},
        {"op": "upload", "id": "upload_1", "kind": "bytes", "blob": sha256(b"\x01\x02")},
        {"op": "upload", "id": "upload_2", "kind": "library", "blob": sha256(b"lib")},
        {"op": "upload", "id": "upload_3", "kind": "bytes", "blob": sha256(b"\x01\x02")},
    ]
    assert p._blobs == {sha256(b"\x01\x02"): b"\x01\x02", sha256(b"lib"): b"lib"}


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
    assert instruction == {"op": "upload", "id": "upload_0", "kind": "tensor", "blob": sha256(a.tobytes()),
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
    assert p.instructions[0] == {"op": "upload", "id": "f", "kind": "file", "blob": sha256(b"x"), "path": "a/b"}
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
    assert list(p._blobs) == [sha256(b"H"), sha256(b"A")]  # identical contents share a blob
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
# Program: get_function, run, returns (docs/client.md §3.7-3.10)


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
    p.run(fn=f, args=[m, 1, {"$ref": "m"}, [{"$ref": "m"}], Register("unknown")])
    assert p.instructions[2]["args"] == []
    assert p.instructions[3]["args"] == [{"$ref": "upload_0"}, 1, {"$ref": "m"}, [{"$ref": "m"}], {"$ref": "unknown"}]


@pytest.mark.parametrize("arg,where", [([Register("upload_0")], "args[1][0]"),
                                       ({"x": (1, Register("upload_0"))}, "args[1]['x'][1]")])
def test_run_refuses_a_nested_register_and_says_how_to_pass_it(arg, where):
    """The protocol resolves only top-level references (docs/protocol.md §6.2): a nested Register
    would reach execute() as an object json cannot encode; run() says so, and records nothing."""
    p = Program()
    m = p.upload(kind="module", source="")
    f = p.get_function(module=m, name="f")
    before = p.instructions
    with pytest.raises(TypeError) as caught:
        p.run(fn=f, args=[1, arg])
    assert str(caught.value) == (
        f"run {where} is Register(id='upload_0') inside a list or dict: only a top-level argument can be a "
        "Register; pass it as one of run's own args (args=[..., register, ...]) and build the list or dict "
        "inside the function")
    assert p.instructions == before
    cyclic: list = [1]
    cyclic.append(cyclic)
    p.run(fn=f, args=[cyclic])  # not a Register: json refuses it when execute encodes it, as before


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
# Client: request encoding and options (docs/client.md §4.1)


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
    p.run(fn=f, args=[[object()]])  # JSON-encoded by execute, which refuses it before any request
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
# Client: the CACHE_MISS negotiation (docs/client.md §4.2) and the blob memory


def two_blob_program() -> tuple[Program, str, str]:
    p = module_program("def f():\n    return 1\n", b"first", b"second")
    return p, sha256(b"first"), sha256(b"second")


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


def test_the_attempts_of_one_execute_share_one_client_request_id(stub, cli):
    p, a, b = two_blob_program()
    stub.queue(cache_miss(a), cache_miss(b), completed(), completed())
    cli.execute(p)
    cli.execute(p)
    ids = [r.headers["x-kcoral-client-request-id"] for r in stub.requests]
    assert ids[0] == ids[1] == ids[2] != ids[3]
    assert all(str(uuid.UUID(i)) == i for i in ids)


def test_results_and_exceptions_carry_the_client_request_id(stub, cli):
    """docs/client.md §5.1 and §8: the id the attempts were sent under, for tracing (operations.md)."""
    p, a, b = two_blob_program()
    stub.queue(cache_miss(a), completed())
    assert cli.execute(p).client_request_id == stub.requests[-1].headers["x-kcoral-client-request-id"]
    stub.queue(json_response({"status": "ERROR", "request_id": RID, "error": {"kind": "busy", "message": "server saturated"}}, 503))
    with pytest.raises(KCoralError) as busy:
        cli.execute(Program())
    assert busy.value.client_request_id == stub.requests[-1].headers["x-kcoral-client-request-id"] != RID
    assert busy.value.request_id == RID  # the server's own id of the attempt stays where it was
    stub.queue(b"garbage\r\n\r\n", b"garbage\r\n\r\n")
    with pytest.raises((TransportError, ProtocolError)) as broken:
        cli.execute(Program())
    assert broken.value.client_request_id == stub.requests[-1].headers["x-kcoral-client-request-id"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}") as c, pytest.raises(TransportError) as refused:
        c.execute(Program())
    assert str(uuid.UUID(refused.value.client_request_id)) == refused.value.client_request_id


def finished_lines(server: ServerProcess) -> list[dict[str, str]]:
    """The server's request_finished console lines as key -> value."""
    return [dict(field.split("=", 1) for field in line.split(" request_finished ", 1)[1].split() if "=" in field)
            for line in server.log().splitlines() if " request_finished " in line]


def test_the_server_log_links_the_attempts_of_one_execute(tmp_path):
    """A real server: a cold blob costs a CACHE_MISS and a second POST; both request_finished
    lines carry the client's one id beside their own request ids. A header that is not exactly
    one canonical UUID is not logged (nor is it an error)."""
    with ServerProcess(workers=1, tmp_path=tmp_path) as server, Client(server.url) as c:
        program = module_program("def f():\n    return 1\n", os.urandom(1000))
        assert c.execute(program).completed
        lines = wait_for(lambda: len(finished_lines(server)) == 2 and finished_lines(server))
        assert lines, finished_lines(server)
        assert [line["status"] for line in lines] == ["CACHE_MISS", "COMPLETED"]
        assert lines[0]["client_request_id"] == lines[1]["client_request_id"]
        assert lines[0]["request_id"] != lines[1]["request_id"]
        assert str(uuid.UUID(lines[0]["client_request_id"])) == lines[0]["client_request_id"]
        for bad in ([RID.upper()], [RID + "0"], ["x" * 8000], [f"{RID} {RID}"], [RID, RID]):
            headers = [("X-KCoral-Client-Request-ID", value) for value in bad]
            status, _, _ = post_multipart(server.url, {"instructions": []}, headers)
            assert status == 400  # the empty program: the header changed nothing
        logged = wait_for(lambda: len(finished_lines(server)) == 7 and finished_lines(server))
        assert logged, finished_lines(server)
        assert all("client_request_id" not in line for line in logged[2:]), logged[2:]


def post_multipart(url: str, program: dict, headers: list[tuple[str, str]]) -> tuple[int, dict, bytes]:
    """POST a program with the given (possibly repeated) headers."""
    body, content_type = support_multipart(program_parts(program))
    conn = http.client.HTTPConnection(url.split("//", 1)[1], timeout=30)
    try:
        conn.putrequest("POST", "/execute")
        for name, value in [("Content-Type", content_type), ("Content-Length", str(len(body))), *headers]:
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("missing", [[], ["A" * 64], ["ab"], [sha256(b"first")] * 2, [sha256(b"unknown")], "x"])
def test_invalid_cache_miss_is_protocol_error(stub, cli, missing):
    stub.queue(json_response({"status": "CACHE_MISS", "request_id": RID, "missing_blobs": missing}))
    with pytest.raises(ProtocolError):
        cli.execute(two_blob_program()[0])
    assert len(stub.requests) == 1


def test_cache_miss_with_binary_parts_is_protocol_error(stub, cli):
    stub.queue(multipart({"status": "CACHE_MISS", "request_id": RID, "missing_blobs": [sha256(b"first")]},
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
    assert [r.blob_names() for r in stub.requests[2:]] == [[f"blob:{sha256(b'fresh')}"]]
    stub.queue(completed(headers=instance("i1")))
    cli.execute(p2)
    assert stub.requests[3].blob_names() == []


def test_confirmed_blobs_are_per_cache(stub, cli):
    stub.queue(json_response({"status": "ok"}, headers=instance("i1")), completed(headers=instance("i1")),
               completed(headers=instance("i1")), completed(headers=instance("i1")))
    cli.health()
    as_file = Program()
    as_file.upload_file(blob=b"shared", path="f")
    cli.execute(as_file)
    as_bytes = Program()
    as_bytes.upload(kind="bytes", value=b"shared")
    cli.execute(as_bytes)  # the server's memory cache may lack what its file cache holds
    cli.execute(as_file)
    assert [r.blob_names() for r in stub.requests[1:]] == [[f"blob:{sha256(b'shared')}"]] * 2 + [[]]


def test_large_unknown_blobs_still_ask_first(stub):
    with Client(stub.url, eager_upload_bytes=10) as c:
        stub.queue(json_response({"status": "ok"}, headers=instance("i1")))
        c.health()
        stub.queue(completed(headers=instance("i1")))
        c.execute(module_program("", b"small"))
        stub.queue(cache_miss(sha256(b"x" * 11), headers=instance("i1")), completed(headers=instance("i1")))
        c.execute(module_program("", b"x" * 11))
    assert [r.blob_names() for r in stub.requests[1:]] == [
        [f"blob:{sha256(b'small')}"], [], [f"blob:{sha256(b'x' * 11)}"]]


def test_restart_resets_what_the_server_is_known_to_hold(stub, cli):
    p = module_program("", b"blob")
    blob = [f"blob:{sha256(b'blob')}"]
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
    blob = [f"blob:{sha256(b'blob')}"]
    stub.queue(json_response({"status": "ok"}, headers=instance("i1")), completed(headers=instance("i1")),
               cache_miss(sha256(b"blob"), headers=instance("i2")), completed(headers=instance("i2")),
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
    stub.queue(cache_miss(sha256(b"blob"), headers=instance("i1")), cache_miss(sha256(b"blob"), headers=instance("i1")),
               completed(headers=instance("i1")))
    cli.execute(p)
    assert [r.blob_names() for r in stub.requests[2:]] == [[], [f"blob:{sha256(b'blob')}"]] + [[f"blob:{sha256(b'blob')}"]]
    stub.queue(completed(headers=instance("i1")))
    cli.execute(module_program("", b"blob", b"new"))
    assert stub.requests[-1].blob_names() == [f"blob:{sha256(b'new')}"]


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
# Client: HTTP errors, transport, connections (docs/client.md §4.4-4.6)


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


def test_a_timeouts_instruction_and_output_become_attributes_of_the_right_type_only(stub, cli):
    error = {"kind": "timeout", "message": "execution timed out after 2 s in instruction 2 (run 'r')",
             "instruction_index": 2, "instruction_op": "run", "instruction_id": "r"}
    stub.queue(json_response({"status": "ERROR", "request_id": RID, "error": error, "stdout": "so far\n",
                              "stderr": "", "stdout_truncated": True, "stderr_truncated": False}, status=504))
    with pytest.raises(KCoralError) as info:
        cli.execute(Program())
    got = info.value
    assert (got.instruction_index, got.instruction_op, got.instruction_id) == (2, "run", "r")
    assert (got.stdout, got.stderr, got.stdout_truncated, got.stderr_truncated) == ("so far\n", "", True, False)
    stub.queue(json_response({"status": "ERROR", "error": {**error, "instruction_index": True, "instruction_op": 3},
                              "stdout": 5, "stderr_truncated": "yes"}, status=504))
    with pytest.raises(KCoralError) as info:
        cli.execute(Program())
    got = info.value
    assert (got.instruction_index, got.instruction_op, got.instruction_id) == (None, None, "r")
    assert (got.stdout, got.stderr, got.stdout_truncated, got.stderr_truncated) == ("", "", False, False)


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


def test_an_answer_sent_before_the_body_was_read_is_reported(stub, cli):
    # e.g. 413: the server answers from the headers and closes; the client's send breaks
    stub.queue(json_response({"status": "ERROR", "request_id": RID, "error": {
        "kind": "request_too_large", "message": "request exceeds the configured size limit"}},
        status=413) + ("early",))
    cli._memory.observe("i1")  # so that the blob goes with the first attempt
    with pytest.raises(KCoralError) as info:
        cli.execute(module_program("", os.urandom(64 * 1024 * 1024)))
    assert (info.value.status_code, info.value.kind) == (413, "request_too_large")


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
    assert wait_for(lambda: stub.connections_closed == 1, 10), "the stub never dropped the connection"
    assert cli.execute(Program()).completed
    assert len({r.client_port for r in stub.requests}) == 2


def test_concurrent_use_from_threads(stub, cli):
    stub.queue(*[json_response({"status": "ok", "n": i}) for i in range(16)])
    results = []
    threads = [threading.Thread(target=lambda: results.append(cli.health()["n"])) for _ in range(16)]
    for t in threads:
        t.start()
    join_threads(threads, 60)
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


# ---------------------------------------------------------------------------
# Client: what a hostile server can cost (docs/client.md §4.8)

# A client in a fresh process: its peak RSS growth over one execute against ``url`` (the
# peak is reset just before, so what the imports took cannot hide it).
RSS_PROBE = """
import json, re, sys, time
from client import Client, Program, ProtocolError
def peak_kib():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\\s+(\\d+)", f.read()).group(1))
with Client(sys.argv[1], max_response_bytes=int(sys.argv[2])) as c:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before, started = peak_kib(), time.monotonic()
    try:
        c.execute(Program())
        error = None
    except ProtocolError as exc:
        error = str(exc)
    seconds, grown = time.monotonic() - started, peak_kib() - before
print(json.dumps({"error": error, "seconds": seconds, "rss_growth_mib": grown / 1024}))
"""


def probe_rss(url: str, cap: int) -> dict:
    done = subprocess.run([sys.executable, "-c", RSS_PROBE, url, str(cap)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize("mode", ["endless", "huge"])
def test_an_oversized_answer_is_refused_within_the_cap(mode):
    """A chunked body that never ends, and one that declares a terabyte: the client stops at
    max_response_bytes (16 MiB here) with a ProtocolError, its memory grown by about the cap."""
    cap = 16 << 20
    with HostileServer(mode) as hostile:
        measured = probe_rss(hostile.url, cap)
        sent = hostile.bytes_sent
    print(f"\n{mode}: {measured}, server sent {sent / 2**20:.1f} MiB")
    assert "max_response_bytes (16777216 bytes)" in measured["error"]
    assert measured["seconds"] < 10
    assert measured["rss_growth_mib"] < 3 * cap / 2**20
    if mode == "huge":  # refused on the declared length: nothing of the body is buffered
        assert measured["rss_growth_mib"] < 8


def test_the_size_cap_admits_exactly_max_response_bytes(stub):
    payload = json.dumps(body_fields()).encode()
    for size, ok in ((len(payload), True), (len(payload) - 1, False)):
        with Client(stub.url, max_response_bytes=size) as c:
            stub.queue(completed(), (200, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
                                     b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)))
            for _ in range(2):  # declared length, then chunked
                if ok:
                    assert c.execute(Program()).completed
                else:
                    with pytest.raises(ProtocolError, match=r"max_response_bytes \(\d+ bytes\)"):
                        c.execute(Program())
                    assert c._idle == []  # the unread rest must not meet the next request


def test_stub_sends_chunked_bodies_as_given(stub):
    """(The stub adds Content-Length to every answer; the test above relies on the client
    preferring Transfer-Encoding, as HTTP/1.1 requires.)"""
    stub.queue((200, {"Transfer-Encoding": "chunked"}, b"2\r\nok\r\n0\r\n\r\n"))
    with Client(stub.url) as c:
        with pytest.raises(ProtocolError, match="malformed health response"):
            c.health()


@pytest.mark.parametrize("mode", ["silent", "trickle-head", "trickle-body"])
def test_a_server_that_stalls_or_trickles_is_given_up_at_the_deadline(mode):
    """The deadline bounds the whole exchange: silence, and a byte every 50 ms (which a
    per-read timeout would never catch), end in TransportError at timeout + margin."""
    with HostileServer(mode) as hostile, Client(hostile.url, response_margin_seconds=0.5) as c:
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"no complete answer within 1 s \(the request's timeout"):
            c.execute(Program(), timeout_seconds=0.5)
        took = time.monotonic() - started
        assert c._idle == []
    print(f"\n{mode}: gave up after {took:.2f} s (deadline 1.0 s), server sent {hostile.bytes_sent} bytes")
    assert 0.95 <= took < 3


def test_health_gets_its_own_modest_deadline():
    assert Client("http://127.0.0.1:1")._health_timeout == 30.0
    with HostileServer("silent") as hostile, Client(hostile.url, health_timeout_seconds=0.3) as c:
        started = time.monotonic()
        with pytest.raises(TransportError, match=r"within 0.3 s \(health_timeout_seconds\)"):
            c.health()
        assert 0.28 <= time.monotonic() - started < 2


def test_the_answer_may_take_the_requests_timeout_plus_the_margin(stub):
    """A legitimate slow answer (1.2 s for timeout_seconds=1, margin 0.5) is waited for, and so
    is the same answer to a request without timeout_seconds (the server's default, 300 s);
    the test above gives up on silence at timeout_seconds=0.5 plus the same margin."""
    def slow(request):
        time.sleep(1.2)
        return completed()
    with Client(stub.url, response_margin_seconds=0.5) as c:
        for timeout in (1, None):
            stub.queue(slow)
            assert c.execute(Program(), timeout_seconds=timeout).completed


@pytest.mark.parametrize("kwargs", [{"max_response_bytes": 0}, {"max_response_bytes": 1.5},
                                    {"response_margin_seconds": 0}, {"response_margin_seconds": math.inf},
                                    {"health_timeout_seconds": -1}, {"health_timeout_seconds": True}])
def test_bound_settings_are_validated(kwargs):
    with pytest.raises(ValueError):
        Client("http://127.0.0.1:1", **kwargs)


# ---------------------------------------------------------------------------
# Response decoding (docs/client.md §5)


def run_response(stub: Stub, cli: Client, response: tuple) -> ProgramResult:
    stub.queue(response)
    return cli.execute(Program())


def test_program_result_fields(stub, cli):
    result = run_response(stub, cli, completed({"n": {"type": "integer", "value": 3}},
                                               stdout_truncated=True, gpu_ids=[3, 1], gpu_count=2,
                                               extra_field="tolerated"))
    assert result == ProgramResult(status="COMPLETED", request_id=RID, queue_ms=0.5, elapsed_ms=12.0,
                                   lease_wait_ms=0.0, lease_held_ms=0.0, results={"n": 3}, stdout="out",
                                   stderr="", stdout_truncated=True, stderr_truncated=False,
                                   error=None, gpu_ids=(3, 1))
    assert result.completed and result["n"] == 3 and type(result.elapsed_ms) is float
    with pytest.raises(KeyError):
        result["missing"]
    payload = body_fields()
    del payload["stdout_truncated"], payload["stderr_truncated"]
    assert run_response(stub, cli, json_response(payload)).stdout_truncated is False


def test_failed_result_keeps_error_and_early_returns(stub, cli):
    error = {"kind": "engine", "message": "AssertionError: nope", "instruction_index": 2,
             "instruction_op": "run", "instruction_id": "r0", "traceback": "Traceback..."}
    result = run_response(stub, cli, json_response(body_fields(
        "FAILED", {"early": {"type": "string", "value": "kept"}}, error=error)))
    assert not result.completed and result.error == error and result["early"] == "kept"
    gpu_error = {**error, "kind": "gpu_access", "instruction_id": None, "cuda_call": "cudaMalloc",
                 "location": "<uploaded:ab>:12 in compile", "interfered_request_id": None}
    assert run_response(stub, cli, json_response(body_fields("FAILED", error=gpu_error))).error == gpu_error


def test_value_decoding(stub, cli):
    results = {
        "none": {"type": "null"}, "t": {"type": "boolean", "value": True},
        "big": {"type": "integer", "value": 10**30}, "f": {"type": "number", "value": 1},
        "s": {"type": "string", "value": "é"},
        "nested": {"type": "object", "value": {"list": {"type": "array", "value": [
            {"type": "bytes", "part": "return:0", "sha256": sha256(b"\x01\x02")},
            {"type": "number", "value": 2.5e-08}]}}},
        "file": binary("file", 1, b"HELLO\n", size=6),
        "empty": binary("bytes", 2, b""),
    }
    result = run_response(stub, cli, multipart(body_fields(results=results), [b"\x01\x02", b"HELLO\n", b""]))
    assert result.results == {"none": None, "t": True, "big": 10**30, "f": 1.0, "s": "é",
                              "nested": {"list": [b"\x01\x02", 2.5e-08]},
                              "file": ReturnedFile(b"HELLO\n"), "empty": b""}
    assert type(result["f"]) is float and list(result.results) == list(results)


def test_tensor_decoding(stub, cli):
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(7, dtype=np.int64),
              np.array([1.5, -2], dtype=ml_dtypes.bfloat16), np.zeros((0, 3), np.float16),
              np.array([1, 0], dtype=np.uint8).view(bool), np.arange(3, dtype=ml_dtypes.float8_e5m2)]
    results = {str(i): binary("tensor", i, a.tobytes(), dtype=a.dtype.name, shape=list(a.shape))
               for i, a in enumerate(arrays)}
    result = run_response(stub, cli, multipart(body_fields(results=results), [a.tobytes() for a in arrays]))
    for i, expected in enumerate(arrays):
        decoded = result[str(i)]
        assert decoded.dtype == expected.dtype and decoded.shape == expected.shape
        assert decoded.tobytes() == expected.tobytes()
        assert decoded.flags.owndata and decoded.flags.writeable
    weird_bool = run_response(stub, cli, multipart(body_fields(results={
        "b": binary("tensor", 0, b"\x02\x00", dtype="bool", shape=[2])}), [b"\x02\x00"]))
    assert weird_bool["b"].tolist() == [True, False]


def test_folder_decoding(stub, cli):
    names = [".hid/x", ".hidden", "a.txt", "sub/z.bin"]
    files = {name: binary("file", i, name.encode(), size=len(name)) for i, name in enumerate(names)}
    folder_value = {"type": "folder", "files": files, "directories": [".hid", "sub", "sub/empty"]}
    result = run_response(stub, cli, multipart(body_fields(results={"out": folder_value}),
                                               [n.encode() for n in names]))
    folder = result["out"]
    assert isinstance(folder.files, types.MappingProxyType) and list(folder.files) == names
    assert folder.files["sub/z.bin"].read_bytes() == b"sub/z.bin"
    assert folder.directories == (".hid", "sub", "sub/empty")
    empty = run_response(stub, cli, completed({"e": {"type": "folder", "files": {}, "directories": []}}))
    assert empty["e"] == ReturnedFolder({}, ())


def test_parts_are_decoded_in_depth_first_order(stub, cli):
    results = {"b": {"type": "array", "value": [binary("bytes", 0, b"0"), binary("bytes", 1, b"1")]},
               "a": binary("bytes", 2, b"2")}
    assert run_response(stub, cli, multipart(body_fields(results=results), [b"0", b"1", b"2"])).results == {
        "b": [b"0", b"1"], "a": b"2"}


def malformed_bodies() -> list:
    """(id, response) pairs that must all be ProtocolError."""
    ok = body_fields()
    cases = {
        "stray ERROR": body_fields("ERROR"),
        "no request_id": {k: v for k, v in ok.items() if k != "request_id"},
        "empty request_id": body_fields(request_id=""),
        "number request_id": body_fields(request_id=5),
        "missing timing": {k: v for k, v in ok.items() if k != "queue_ms"},
        "string timing": body_fields(elapsed_ms="1"),
        "bool timing": body_fields(lease_wait_ms=True),
        "null stdout": body_fields(stdout=None),
        "missing stderr": {k: v for k, v in ok.items() if k != "stderr"},
        "string truncated": body_fields(stdout_truncated="no"),
        "gpu_ids alone": body_fields(gpu_ids=[0]),
        "gpu_count alone": body_fields(gpu_count=1),
        "gpu_count mismatch": body_fields(gpu_ids=[0, 1], gpu_count=1),
        "gpu_ids empty": body_fields(gpu_ids=[], gpu_count=0),
        "gpu_ids repeated": body_fields(gpu_ids=[1, 1], gpu_count=2),
        "gpu_ids bool": body_fields(gpu_ids=[True], gpu_count=1),
        "gpu_ids too many": body_fields(gpu_ids=list(range(9)), gpu_count=9),
        "gpu_ids negative": body_fields(gpu_ids=[-1], gpu_count=1),
        "results list": body_fields(results=[]),
        "completed with null error": body_fields(error=None),
        "failed without error": body_fields("FAILED"),
    }
    error = {"kind": "engine", "message": "m", "instruction_index": 0, "instruction_op": "run",
             "instruction_id": None, "traceback": ""}
    for name, bad in {"extra key": {**error, "x": 1}, "missing key": {k: v for k, v in error.items() if k != "traceback"},
                      "unknown kind": {**error, "kind": "weird"}, "bool index": {**error, "instruction_index": True},
                      "bad op": {**error, "instruction_op": "x"}, "int id": {**error, "instruction_id": 3},
                      "gpu_access without fields": {**error, "kind": "gpu_access"},
                      "fields without gpu_access": {**error, "cuda_call": "c", "location": "l",
                                                    "interfered_request_id": None},
                      "not an object": "boom", "number message": {**error, "message": 1}}.items():
        cases[f"error {name}"] = body_fields("FAILED", error=bad)
    for name, value in {
        "no type": {"value": 1}, "int type": {"type": 3}, "unknown type": {"type": "set", "value": []},
        "extra key": {"type": "null", "value": None}, "bool as integer": {"type": "integer", "value": True},
        "float as integer": {"type": "integer", "value": 1.0}, "bool as number": {"type": "number", "value": False},
        "string as number": {"type": "number", "value": "1"}, "int as boolean": {"type": "boolean", "value": 1},
        "int as string": {"type": "string", "value": 1}, "object as array": {"type": "array", "value": {}},
        "array as object": {"type": "object", "value": []}, "missing part": binary("bytes", 0, b"x"),
        "bad child": {"type": "array", "value": [{"type": "null", "x": 1}]},
        "folder non-file child": {"type": "folder", "files": {"a": {"type": "bytes"}}, "directories": []},
        "folder bad directories": {"type": "folder", "files": {}, "directories": {}},
        "folder missing parent": {"type": "folder", "files": {}, "directories": ["a/b"]},
        "folder non-canonical": {"type": "folder", "files": {}, "directories": ["./a"]},
        "folder unsorted": {"type": "folder", "files": {}, "directories": ["b", "a"]},
    }.items():
        cases[f"value {name}"] = body_fields(results={"v": value})
    responses = [(name, json_response(payload)) for name, payload in cases.items()]
    x, x_hash = b"x", sha256(b"x")
    for name, (value, parts) in {
        "leading zero part": ({"type": "bytes", "part": "return:00", "sha256": x_hash}, [x]),
        "part out of order": ({"type": "array", "value": [binary("bytes", 1, x), binary("bytes", 0, x)]}, [x, x]),
        "reused part": ({"type": "array", "value": [binary("bytes", 0, x), binary("bytes", 0, x)]}, [x]),
        "bad part name": ({"type": "bytes", "part": "blob:0", "sha256": x_hash}, [x]),
        "uppercase sha": ({"type": "bytes", "part": "return:0", "sha256": x_hash.upper()}, [x]),
        "wrong sha": ({"type": "bytes", "part": "return:0", "sha256": sha256(b"y")}, [x]),
        "file size mismatch": (binary("file", 0, x, size=2), [x]),
        "file negative size": (binary("file", 0, x, size=-1), [x]),
        "file bool size": (binary("file", 0, x, size=True), [x]),
        "file without size": (binary("file", 0, x), [x]),
        "tensor bad dtype": (binary("tensor", 0, x, dtype="complex64", shape=[1]), [x]),
        "tensor bool shape": (binary("tensor", 0, x, dtype="uint8", shape=[True]), [x]),
        "tensor negative shape": (binary("tensor", 0, x, dtype="uint8", shape=[-1]), [x]),
        "tensor length": (binary("tensor", 0, x, dtype="int16", shape=[1]), [x]),
        "unreferenced part": ({"type": "null"}, [x]),
    }.items():
        responses.append((name, multipart(body_fields(results={"v": value}), parts)))
    for name, text in {"duplicate key": b'{"status":"COMPLETED","status":"COMPLETED"}', "NaN": b"NaN",
                       "array": b"[]", "trailing data": json.dumps(ok).encode() + b" {}",
                       "bom": b"\xef\xbb\xbf" + json.dumps(ok).encode(), "bad utf-8": b'{"a":"\xff"}',
                       "overflowing float": json.dumps(ok).replace('"queue_ms": 0.5', '"queue_ms": 1e400').encode()}.items():
        responses.append((f"json {name}", (200, {"Content-Type": "application/json"}, text)))
    responses.append(("text/plain", (200, {"Content-Type": "text/plain"}, json.dumps(ok).encode())))
    responses.append(("no content type", (200, {}, json.dumps(ok).encode())))
    return responses


@pytest.mark.parametrize("response", [r for _, r in malformed_bodies()], ids=[n for n, _ in malformed_bodies()])
def test_malformed_responses_are_protocol_errors(stub, cli, response):
    with pytest.raises(ProtocolError):
        run_response(stub, cli, response)


# The same rules servers apply to request bodies (docs/protocol.md §4.4-4.5).
RESULT_HEAD = b'Content-Disposition: form-data; name="result"\r\nContent-Type: application/json\r\n\r\n'
OK_JSON = json.dumps(body_fields(results={"v": binary("bytes", 0, b"data")})).encode()
PART_HEAD = b'Content-Disposition: form-data; name="return:0"\r\nContent-Type: application/octet-stream\r\n\r\n'


@pytest.mark.parametrize("body, content_type", [
    (b"--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B\r\n" + PART_HEAD + b"data\r\n--B--\r\n", None),
    (b"preamble\r\n--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B \t\r\n" + PART_HEAD + b"data\r\n--B--\r\nepilogue", None),
    (b"--B\n" + RESULT_HEAD.replace(b"\r\n", b"\n") + OK_JSON + b"\n--B\n" + PART_HEAD.replace(b"\r\n", b"\n")
     + b"data\n--B--", None),
    (b"--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B\r\n" + PART_HEAD.replace(b'name="return:0"', b"name=return:0; filename=x")
     + b"data\r\n--B--", 'MULTIPART/FORM-DATA; charset=x; BOUNDARY="B"'),
    (b"--B\r\n" + RESULT_HEAD.replace(b"application/json", b"Application/JSON; charset=utf-8") + OK_JSON
     + b"\r\n--B\r\nContent-Transfer-Encoding: BINARY\r\n" + PART_HEAD + b"data\r\n--B--", None),
])
def test_multipart_variants_are_accepted(stub, cli, body, content_type):
    response = raw_multipart(body, content_type or "multipart/form-data; boundary=B")
    assert run_response(stub, cli, response)["v"] == b"data"


def test_delimiter_lookalikes_inside_payloads_are_data(stub, cli):
    tricky = b"x--B\r\n--Bx\r\n--B--x\r\n--B \tz\n--B-\r\n"
    result = {"v": binary("bytes", 0, tricky)}
    response = multipart(body_fields(results=result), [tricky], boundary="B")
    assert run_response(stub, cli, response)["v"] == tricky


@pytest.mark.parametrize("body, content_type", [
    (b"", None),
    (b"--B--\r\n", None),
    (b"--B\r\n" + RESULT_HEAD + OK_JSON, None),
    (b"--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B--", "multipart/form-data"),
    (b"--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B--", "multipart/form-data; boundary="),
    (b"--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B--", "multipart/mixed; boundary=B"),
    (b"--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B--", "multipart/form-data; boundary=B; boundary=C"),
    (b"--B\r\nstray line\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B--", None),
    (b"--B\r\n Content-Type: x\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B--", None),
    (b"--B\r\nContent-Type: application/json\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B--", None),
    (b'--B\r\nContent-Disposition: form-data; name="result"\r\n\r\n' + OK_JSON + b"\r\n--B--", None),
    (b"--B\r\n" + RESULT_HEAD.replace(b"form-data", b"attachment") + OK_JSON + b"\r\n--B--", None),
    (b"--B\r\n" + RESULT_HEAD.replace(b'name="result"', b'name="result"; name="x"') + OK_JSON + b"\r\n--B--", None),
    (b"--B\r\n" + RESULT_HEAD.replace(b'name="result"', b'name=""') + OK_JSON + b"\r\n--B--", None),
    (b"--B\r\n" + RESULT_HEAD.replace(b"application/json", b"multipart/mixed") + OK_JSON + b"\r\n--B--", None),
    (b"--B\r\nContent-Transfer-Encoding: base64\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B--", None),
    (b"--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B--", None),
    (b"--B\r\n" + RESULT_HEAD.replace(b"application/json", b"text/plain") + OK_JSON + b"\r\n--B--", None),
    (b"--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B\r\n" + PART_HEAD.replace(b"octet-stream", b"json")
     + b"data\r\n--B--", None),
    (b"--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B\r\n" + PART_HEAD + b"data\r\n--B\r\n" + PART_HEAD
     + b"data\r\n--B--", None),
    (b"--B\r\n" + RESULT_HEAD + b"[1]\r\n--B--", None),
    (b"--B\r\n\r\n--B\r\n" + RESULT_HEAD + OK_JSON + b"\r\n--B--", None),
])
def test_malformed_multipart_is_protocol_error(stub, cli, body, content_type):
    with pytest.raises(ProtocolError):
        run_response(stub, cli, raw_multipart(body, content_type or "multipart/form-data; boundary=B"))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=40) | st.sampled_from([b"\r\n--B", b"\n--B--", b"--B\r\n", b"\r\n"]),
                max_size=6))
def test_multipart_round_trip_of_arbitrary_payloads(payloads):
    results = {str(i): binary("bytes", i, p) for i, p in enumerate(payloads)}
    # a boundary absent from every payload line, as a server must choose it
    _, headers, body = multipart(body_fields(results=results), payloads, boundary="kcoral-0123456789")
    payload, parts = client._response_body(headers["Content-Type"], body)
    assert client._decode_result(payload, parts).results == {str(i): p for i, p in enumerate(payloads)}


# ---------------------------------------------------------------------------
# ReturnedFile / ReturnedFolder (docs/client.md §6)


def mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def leftovers(directory: pathlib.Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".kcoral-")]


def test_returned_file_basics():
    f = ReturnedFile(b"data")
    assert f.read_bytes() == b"data" and f == ReturnedFile(b"data") and f != ReturnedFile(b"other")
    with pytest.raises(TypeError):
        ReturnedFile("text")


def test_returned_file_save(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old_umask = os.umask(0o277)  # even a restrictive umask must not change the mode
    try:
        assert ReturnedFile(b"one").save("out.txt") == pathlib.Path("out.txt")
    finally:
        os.umask(old_umask)
    assert (tmp_path / "out.txt").read_bytes() == b"one" and mode(tmp_path / "out.txt") == 0o600
    with pytest.raises(FileExistsError):
        ReturnedFile(b"two").save(tmp_path / "out.txt")
    assert ReturnedFile(b"two").save(str(tmp_path / "out.txt"), overwrite=True) == tmp_path / "out.txt"
    assert (tmp_path / "out.txt").read_bytes() == b"two"
    assert leftovers(tmp_path) == []


def test_returned_file_save_refuses_links_and_non_files(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        ReturnedFile(b"x").save(tmp_path / "dangling")
    with pytest.raises(ValueError, match="regular file"):
        ReturnedFile(b"x").save(tmp_path / "dangling", overwrite=True)
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError):
        ReturnedFile(b"x").save(tmp_path / "dir", overwrite=True)
    (tmp_path / "dirlink").symlink_to(tmp_path / "dir")
    with pytest.raises(OSError):
        ReturnedFile(b"x").save(tmp_path / "dirlink" / "f")
    assert list((tmp_path / "dir").iterdir()) == []
    with pytest.raises(FileNotFoundError):
        ReturnedFile(b"x").save(tmp_path / "missing" / "f")
    for bad in [f"{tmp_path}/a/../f", f"{tmp_path}/", f"{tmp_path}/.", f"{tmp_path}/..", ""]:
        with pytest.raises(ValueError):
            ReturnedFile(b"x").save(bad)
    assert leftovers(tmp_path) == []


def test_returned_file_save_publishes_atomically(tmp_path, monkeypatch):
    seen = []
    real_link = os.link

    def racing_link(src, dst, **kwargs):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        (tmp_path / "late").write_bytes(b"appeared meanwhile")
        return real_link(src, dst, **kwargs)

    monkeypatch.setattr(os, "link", racing_link)
    with pytest.raises(FileExistsError):
        ReturnedFile(b"x").save(tmp_path / "late")
    assert seen[0][0].startswith(".kcoral-") and len(seen[0][0]) == len(".kcoral-") + 32
    assert (tmp_path / "late").read_bytes() == b"appeared meanwhile" and leftovers(tmp_path) == []


def test_returned_folder_validation():
    f = ReturnedFile(b"")
    folder = ReturnedFolder({"a": f, "d/b": f}, ["d"])
    assert folder.directories == ("d",) and isinstance(folder.files, types.MappingProxyType)
    with pytest.raises(TypeError):
        folder.files["c"] = f
    for files, directories in [({"./a": f}, ()), ({"b": f, "a": f}, ()), ({}, ("b", "a")),
                               ({"a": f}, ("a",)), ({}, ("a", "a")), ({"d/b": f}, ()),
                               ({}, ("d/e",)), ({"/a": f}, ()), ({"a/../b": f}, ())]:
        with pytest.raises(ValueError):
            ReturnedFolder(files, directories)
    with pytest.raises(TypeError):
        ReturnedFolder({"a": b"bytes"})


def test_returned_folder_save(tmp_path):
    folder = ReturnedFolder({".hidden": ReturnedFile(b"h"), "sub/x": ReturnedFile(b"x")},
                            ("sub", "sub/empty"))
    assert folder.save(tmp_path / "out") == tmp_path / "out"
    out = tmp_path / "out"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [".hidden", "sub", "sub/empty", "sub/x"]
    assert (out / "sub/x").read_bytes() == b"x"
    assert [mode(out), mode(out / "sub"), mode(out / "sub/empty"), mode(out / ".hidden")] == [0o700] * 3 + [0o600]
    with pytest.raises(FileExistsError):
        folder.save(out)
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(FileExistsError):
        folder.save(tmp_path / "link")
    with pytest.raises(OSError):
        folder.save(tmp_path / "link" / "inner")
    with pytest.raises(ValueError):
        folder.save(tmp_path / "a" / ".." / "b")


def test_returned_folder_save_removes_partial_output(tmp_path, monkeypatch):
    folder = ReturnedFolder({"a": ReturnedFile(b"a"), "b": ReturnedFile(b"b")}, ())
    real_open = os.open

    def failing_open(path, flags, *args, **kwargs):
        if path == "b":
            raise OSError(28, "No space left on device")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing_open)
    with pytest.raises(OSError, match="No space"):
        folder.save(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# Remote functions (docs/client.md §7)


def add(a, b=2, *rest, scale: float = 1.0, **extra) -> dict:
    """Adds."""
    import math  # noqa: F401
    return {"sum": (a + b) * scale, "rest": list(rest), "extra": extra}


def echo(*values):
    return [len(v) if isinstance(v, bytes) else v for v in values]


def fails(n):
    raise ValueError(f"bad {n}")


def recursive(n):
    def helper(k):
        return k * 2
    return 0 if n == 0 else helper(n) + recursive(n - 1) + len(str(n))


def uses_helper():
    return helper_global() + np.zeros(1)


def declares_global():
    global counter
    counter = 1


def shadows_builtin():
    return open


def helper_global():
    return 1


open = open  # a module-level name bound to the builtin itself is fine  # noqa: A001


def test_remote_function_program_shape(cli):
    fn = RemoteFunction(add, client=cli, cpu_only=True)
    assert (fn.__name__, fn.__doc__, fn.__wrapped__, fn(1)) == ("add", "Adds.", add, add(1))
    program = fn.build_program(1, 3, 7, 8, scale=2.0, k="v")
    instructions = program.instructions
    assert [i.get("id", i.get("key")) for i in instructions] == ["module", "function", "output", "output"]
    assert instructions[1] == {"op": "get_function", "id": "function", "module": {"$ref": "module"},
                               "name": "_kcoral_invoke_add", "cpu_only": True}
    assert instructions[2]["args"] == [4, ["scale", "k"], [True] * 6, {"value": 1}, {"value": 3}, {"value": 7},
                                       {"value": 8}, {"value": 2.0}, {"value": "v"}]
    assert instructions[3] == {"op": "return", "key": "output", "value": {"$ref": "output"}}
    source = instructions[0]["source"]
    assert source.startswith("from __future__ import annotations\n\ndef add(a, b, *rest, scale, **extra):")
    namespace: dict = {}
    exec(compile(source, "<uploaded>", "exec"), namespace)  # the invoker convention, run locally
    assert namespace["_kcoral_invoke_add"](4, ["scale", "k"], [True] * 6, *instructions[2]["args"][3:]) == \
        {"sum": 8.0, "rest": [7, 8], "extra": {"k": "v"}}
    assert fn.build_program(1).instructions[2]["args"][:3] == [2, ["scale"], [True, True, True]]


def test_remote_function_binary_arguments(cli):
    fn = RemoteFunction(echo, client=cli)
    array = np.arange(3, dtype=np.int32)
    program = fn.build_program(b"ab", {"$ref": "module"}, array, bytearray(b"c"), torch.ones(2))
    instructions = program.instructions
    assert [i.get("id") for i in instructions[2:5]] == ["arg_0", "arg_2", "arg_3"]
    assert [i["kind"] for i in instructions[2:6]] == ["bytes", "tensor", "bytes", "tensor"]
    assert instructions[6]["args"][:3] == [5, [], [False, True, False, False, False]]
    assert instructions[6]["args"][3:] == [{"$ref": "arg_0"}, {"value": {"$ref": "module"}}, {"$ref": "arg_2"},
                                           {"$ref": "arg_3"}, {"$ref": "arg_4"}]
    namespace: dict = {}
    exec(instructions[0]["source"], namespace)
    assert namespace["_kcoral_invoke_echo"](5, [], [False, True], b"ab", {"value": {"$ref": "m"}}) == \
        [2, {"$ref": "m"}]


@pytest.mark.parametrize("value, error", [
    ((1, 2), TypeError), ({1, 2}, TypeError), (np.float32(1.0), TypeError), ([b"nested"], TypeError),
    ({1: "x"}, TypeError), (collections.OrderedDict(), TypeError), (float("nan"), ValueError),
    ([float("inf")], ValueError),
])
def test_remote_function_literal_validation(cli, value, error):
    with pytest.raises(error):
        RemoteFunction(echo, client=cli).build_program(value)


def test_remote_function_self_containing_argument(cli):
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError):
        RemoteFunction(echo, client=cli).build_program(loop)
    with pytest.raises(TypeError):
        RemoteFunction(add, client=cli).build_program()


def test_source_capture_rules(cli):
    def closure_maker():
        captured = 1

        def inner():
            return captured
        return inner

    async def coroutine():
        pass

    def generator():
        yield 1

    @functools.wraps(add)
    def wrapper(*args, **kwargs):
        return add(*args, **kwargs)

    for bad in (len, functools.partial(add, 1), coroutine, generator, cli.health, print):
        with pytest.raises(TypeError):
            RemoteFunction(bad, client=cli)
    with pytest.raises(ValueError, match="capture"):
        RemoteFunction(closure_maker(), client=cli)
    with pytest.raises(ValueError):
        RemoteFunction(wrapper, client=cli)
    with pytest.raises(ValueError):
        RemoteFunction(lambda: 1, client=cli)
    with pytest.raises(ValueError):
        RemoteFunction(eval("lambda: 1"), client=cli)
    with pytest.raises(TypeError):
        RemoteFunction(add, client=cli, cpu_only=1)


def test_free_name_check(cli):
    RemoteFunction(recursive, client=cli)
    RemoteFunction(shadows_builtin, client=cli)  # `open` is bound to the builtin itself
    with pytest.raises(ValueError, match="external globals: helper_global, np;"):
        RemoteFunction(uses_helper, client=cli)
    with pytest.raises(ValueError, match="counter"):
        RemoteFunction(declares_global, client=cli)
    shadowed = types.FunctionType(shadows_builtin.__code__, {"open": lambda: None}, "shadows_builtin")
    with pytest.raises(ValueError, match="open"):
        RemoteFunction(shadowed, client=cli)


def test_other_decorators_are_refused(cli, tmp_path, monkeypatch):
    module = tmp_path / "decorated_module.py"
    module.write_text("import functools\n\ndef deco(f):\n    return f\n\n@deco\n@deco\ndef twice():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import decorated_module
    with pytest.raises(ValueError, match="other decorators"):
        RemoteFunction(decorated_module.twice, client=cli)


def test_client_function_decorator_and_remote(stub, cli):
    remote_add = cli.function(timeout=30, output_limit_bytes=100)(add)
    stub.queue(completed({"output": {"type": "integer", "value": 5}}))
    assert remote_add.remote(2, 3) == 5
    assert stub.requests[0].program()["options"] == {"timeout_seconds": 30, "output_limit_bytes": 100}
    error = {"kind": "engine", "message": "ValueError: bad 7", "instruction_index": 3,
             "instruction_op": "run", "instruction_id": "output", "traceback": ""}
    stub.queue(json_response(body_fields("FAILED", error=error)))
    with pytest.raises(RemoteExecutionError) as info:
        remote_add.remote(7)
    assert str(info.value) == f"Remote execution {RID} failed: engine: ValueError: bad 7"
    assert isinstance(info.value, RuntimeError) and info.value.result.error == error
    stub.queue(completed({}))
    with pytest.raises(ProtocolError):
        remote_add.remote(1)
    stub.queue(completed({}))
    assert remote_add.execute(1).completed


# ---------------------------------------------------------------------------
# Large payloads: the request body is streamed from the blobs' own buffers


def test_large_upload_is_not_copied(stub, cli):
    payload = os.urandom(32 * 1024 * 1024)
    program = module_program("", payload)
    stub.queue(completed())
    tracemalloc.start()
    try:
        cli.execute(program)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The stub's read of the request (in this process) is one payload-sized allocation;
    # the client itself must add only framing.
    assert peak < 1.2 * len(payload)
    assert stub.requests[0].blob_names() == []  # (the stub never asked for it)


def test_large_response_parts_are_views_until_decoded(stub, cli):
    data = os.urandom(16 * 1024 * 1024)
    stub.queue(multipart(body_fields(results={"v": binary("bytes", 0, data)}), [data]))
    assert cli.execute(Program())["v"] == data


# ---------------------------------------------------------------------------
# Interop: the same programs against real servers, started once per session.

INTEROP_SERVERS = ["reference", "ours"]


def server_command(name: str, port: int) -> tuple[list[str], dict]:
    """-> (argv, Popen options) of the published server (its own cached venv) or ours."""
    if name == "reference":
        return reference_server_argv(port, "--num-workers", "2"), reference_popen_options()
    return ([sys.executable, "-m", "kcoral", "--port", str(port), "--device", "cpu", "--num-workers", "2",
             "--log-dir", "", "--sandbox", "none"], {"cwd": REPO})  # as the published one


@dataclasses.dataclass
class Server:
    name: str
    url: str


@pytest.fixture(scope="session", params=INTEROP_SERVERS)
def server(request, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command, options = server_command(request.param, port)
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, **options, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with Client(url, connect_timeout_seconds=1) as probe:
            deadline = time.monotonic() + 60
            while True:
                try:
                    probe.health()
                    break
                except TransportError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        pytest.fail(f"{request.param} server did not start:\n{log_path.read_text()[-3000:]}")
                    time.sleep(0.1)
        yield Server(request.param, url)
    finally:
        # SIGTERM to the server alone: it shuts its workers down (they live in their own
        # process groups); signalling them too only slows the shutdown down.
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def live(server):
    with Client(server.url) as c:
        yield c


def count_attempts(monkeypatch, c: Client) -> list[list[str]]:
    """Record the blob hashes sent by each /execute attempt of ``c``."""
    attempts: list[list[str]] = []
    real = c._post_execute

    def recording(program_json, blobs, *routing):
        attempts.append([h for h, _ in blobs])
        return real(program_json, blobs, *routing)

    monkeypatch.setattr(c, "_post_execute", recording)
    return attempts


WORKED_EXAMPLE = '''import os
def scale(data, path, factor):
    text = open(path).read()
    print("read", len(text), "chars")
    os.makedirs("out/sub/empty", exist_ok=True)
    with open("out/report.txt", "w") as f:
        f.write(text.upper())
    open("out/.hidden", "wb").write(b"h")
    return {"n": len(data) * factor, "head": data[:2]}
'''


def test_interop_health(live):
    health = live.health()
    assert health["status"] == "ok" and str(uuid.UUID(health["instance_id"])) == health["instance_id"]
    assert set(health) >= {"started_at", "gpu_count", "load", "target", "versions"}
    assert health["gpu_count"] == 0 and health["target"] == {}
    with pytest.raises(ProtocolError, match="no compilation target"):
        live.target()


def test_interop_worked_example_and_cache_negotiation(live, monkeypatch, tmp_path):
    live.health()  # lets a client that can remember blobs learn the server instance
    attempts = count_attempts(monkeypatch, live)
    fresh = os.urandom(16)  # blobs the server cannot hold yet
    p = Program()
    mod = p.upload(kind="module", source=WORKED_EXAMPLE, id="mod")
    data = p.upload(kind="bytes", value=b"\x01\x02\x03\x04" + fresh, id="data")
    cfg = p.upload_file(blob=b"hello kcoral\n" + fresh.hex().encode(), path="./inputs//config.txt", id="cfg")
    out = p.run(fn=p.get_function(module=mod, name="scale", id="fn"), args=[data, cfg, 3], id="out")
    p.return_(key="summary", value=out)
    p.return_file(key="report", path="out/report.txt")
    p.return_folder(key="folder", path="out")
    p.return_(key="path", value=cfg)
    result = live.execute(p, timeout_seconds=60)
    assert result.completed and result.error is None, result.error
    assert result["summary"] == {"n": 60, "head": b"\x01\x02"}
    assert result["report"].read_bytes() == b"HELLO KCORAL\n" + fresh.hex().upper().encode()
    assert result["path"] == "inputs/config.txt" and result.stdout == "read 45 chars\n"
    folder = result["folder"]
    assert list(folder.files) == [".hidden", "report.txt"] and folder.directories == ("sub", "sub/empty")
    folder.save(tmp_path / "saved")
    assert (tmp_path / "saved" / "report.txt").read_bytes() == result["report"].read_bytes()
    knows_instance = live._memory._current is not None
    # one round trip if the server names its instance (the blobs go unasked), else ask first
    assert attempts == ([list(p._blobs)] if knows_instance else [[], list(p._blobs)])
    assert live.execute(p).completed and attempts[-1] == []  # now cached: one attempt, nothing sent


def test_interop_failure_keeps_early_returns(live):
    p = Program()
    mod = p.upload(kind="module", source="def ok():\n    return 'early'\ndef bad():\n    assert 1 == 2, 'nope'\n")
    p.return_(key="early", value=p.run(fn=p.get_function(module=mod, name="ok")))
    p.run(fn=p.get_function(module=mod, name="bad"), id="r0")
    result = live.execute(p)
    assert result.status == "FAILED" and result["early"] == "early"
    assert (result.error["kind"], result.error["instruction_id"], result.error["instruction_op"]) == ("engine", "r0", "run")
    assert result.error["message"] == "AssertionError: nope"


def test_interop_remote_functions(live):
    assert RemoteFunction(add, client=live).remote(1, 3, 7, 8, scale=2.0, k="v") == \
        {"sum": 8.0, "rest": [7, 8], "extra": {"k": "v"}}
    assert RemoteFunction(echo, client=live).remote(b"abc", {"$ref": "module"}, [1, {"x": None}]) == \
        [3, {"$ref": "module"}, [1, {"x": None}]]
    assert RemoteFunction(recursive, client=live).remote(3) == 15
    with pytest.raises(RemoteExecutionError, match=r"failed: engine: ValueError: bad 7"):
        RemoteFunction(fails, client=live).remote(7)


def test_interop_tensor_upload(live, server):
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    p = Program()
    p.return_(key="t", value=p.upload(kind="tensor", value=array))
    result = live.execute(p)
    if server.name == "reference":  # the published CPU server has no tensor support
        assert result.error["kind"] == "unavailable" and result.error["instruction_op"] == "upload"
    else:  # ours: CPU workers accept and return tensors
        assert result.completed and np.array_equal(result["t"], array)


def test_interop_output_capture_and_limit(live):
    p = Program()
    mod = p.upload(kind="module", source="import os\ndef f():\n    os.system('echo fd-level; echo from-child')\n")
    p.run(fn=p.get_function(module=mod, name="f"))
    result = live.execute(p, output_limit_bytes=12)
    assert (result.stdout, result.stdout_truncated) == ("fd-level\nfro", True)


def test_interop_http_errors(live):
    p = Program()
    mod = p.upload(kind="module", source="import time\ndef f(x=None):\n    time.sleep(5)\n")
    f = p.get_function(module=mod, name="f")
    bad = Program()
    bad.run(fn=bad.get_function(module=bad.upload(kind="module", source=""), name="f"), args=[Register("nope")])
    with pytest.raises(KCoralError) as info:
        live.execute(bad)
    assert (info.value.status_code, info.value.kind) == (400, "parse") and info.value.request_id
    with pytest.raises(KCoralError) as info:
        live.execute(module_program(), gpu_count=1)
    assert info.value.status_code == 400
    with pytest.raises(KCoralError) as info:
        live.execute(module_program(), timeout_seconds=0)
    assert info.value.status_code == 400
    p.run(fn=f)
    with pytest.raises(KCoralError) as info:
        live.execute(p, timeout_seconds=0.5)
    assert (info.value.status_code, info.value.kind) == (504, "timeout")


def test_interop_large_blob_and_concurrency(live):
    big = os.urandom(24 * 1024 * 1024)
    p = Program()
    mod = p.upload(kind="module", source="import hashlib\ndef f(b):\n    return hashlib.sha256(b).hexdigest()\n")
    p.return_(key="h", value=p.run(fn=p.get_function(module=mod, name="f"), args=[p.upload(kind="bytes", value=big)]))
    outcomes = []
    threads = [threading.Thread(target=lambda: outcomes.append(live.execute(p)["h"])) for _ in range(3)]
    for t in threads:
        t.start()
    join_threads(threads, 240)
    assert outcomes == [sha256(big)] * 3


# --- busy answers retried when asked (docs/client.md §4.10) ---------------------------------

def busy(status: int, retry_after: str | None) -> tuple:
    return json_response({"status": "ERROR", "request_id": RID, "error": {"kind": "busy", "message": "full"}},
                         status=status, headers={"Retry-After": retry_after} if retry_after is not None else None)


def test_a_429_with_retry_after_is_retried_when_asked(stub):
    stub.queue(busy(429, "1"), busy(503, "0"), completed({"x": {"type": "integer", "value": 1}}))
    with Client(stub.url, retry_busy_seconds=5) as c:
        started = time.monotonic()
        result = c.execute(Program())
    assert time.monotonic() - started >= 1.0  # the wait the server named
    assert result["x"] == 1 and len(stub.requests) == 3 and result.round_trips == 3
    assert len({r.headers["x-kcoral-client-request-id"] for r in stub.requests}) == 1  # one call, one id


@pytest.mark.parametrize("retry_busy_seconds,answer", [(0, busy(429, "1")), (5, busy(503, None)),
                                                       (5, busy(503, "Wed, 21 Oct 2015 07:28:00 GMT")),
                                                       (5, busy(429, "6"))],
                         ids=["not-asked", "no-retry-after", "an-http-date", "beyond-the-budget"])
def test_a_busy_answer_is_raised_at_once_unless_a_retry_is_asked_for_and_fits(stub, retry_busy_seconds, answer):
    stub.queue(answer, completed())
    with Client(stub.url, retry_busy_seconds=retry_busy_seconds) as c, pytest.raises(KCoralError) as caught:
        c.execute(Program())
    assert caught.value.kind == "busy" and len(stub.requests) == 1


def test_retry_busy_seconds_is_checked():
    for bad in (-1, math.inf, True, "5"):
        with pytest.raises(ValueError, match="retry_busy_seconds"):
            Client("http://127.0.0.1:1", retry_busy_seconds=bad)


def test_blobs_are_packed_into_caching_requests_under_the_limit():
    """docs/client.md §4.10: every blob in exactly one group, each group's request (measured as sent)
    within the limit, fewer groups as the limit grows; a blob too large alone packs nothing."""
    rng = np.random.default_rng(7)
    blobs = [(hashlib.sha256(data).hexdigest(), data) for data in (bytes(rng.integers(0, 256, int(n), dtype=np.uint8))
                                                        for n in rng.integers(1, 5000, 200))]
    needs = {digest: [{"memory"}, {"file"}, {"memory", "file"}][i % 3] for i, (digest, _) in enumerate(blobs)}
    counts = []
    for limit in (6000, 20000, 100000, 10 ** 7):
        groups = client._pack_blobs(blobs, needs, limit)
        assert sorted(h for group in groups for h in group) == sorted(h for h, _ in blobs)
        data = dict(blobs)
        sizes = [client._caching_request_size([(h, data[h]) for h in group], needs) for group in groups]
        assert max(sizes) <= limit and (len(groups) == 1 or max(sizes) > limit * 0.9), (limit, max(sizes))
        counts.append(len(groups))
    assert counts == sorted(counts, reverse=True) and counts[-1] == 1
    assert client._pack_blobs(blobs, needs, 3000) is None
