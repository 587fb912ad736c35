"""Interop script: the published kcoral 0.1.1 CLIENT against OUR server.

Run with the reference virtualenv's python (tests/test_interop_reference_client.py does):

    <reference python> tests/reference_client_script.py http://127.0.0.1:PORT

It prints one line per case ("ok <case>" or "FAIL <case>: ...") and exits non-zero if any
case failed.  It must stay a real file: `@client.function` reads the decorated function's
source from it.
"""

import hashlib
import os
import stat
import sys
import tempfile
import traceback

import httpx
import ml_dtypes
import numpy as np

import kcoral
from kcoral import Client, KCoralError, Program, ProtocolError, RemoteExecutionError, ReturnedFile, ReturnedFolder

URL = sys.argv[1]
client = Client(URL)
CASES = []
POSTS = []  # (part names) of every POST /execute the reference client sends

_send = httpx.Client.send


def counting_send(self, request, *args, **kwargs):
    """Record each /execute POST's multipart part names (httpx is public API, not kcoral code)."""
    if request.url.path == "/execute":
        body = request.read()
        POSTS.append(sorted(part.split(b'"', 1)[0].decode() for part in body.split(b'name="')[1:]))
    return _send(self, request, *args, **kwargs)


httpx.Client.send = counting_send


def case(fn):
    CASES.append(fn)
    return fn


def sha(data):
    return hashlib.sha256(data).hexdigest()


def run_module(source, name, *args, returns=("out",), timeout=60):
    program = Program()
    module = program.upload(kind="module", source=source)
    fn = program.get_function(module=module, name=name)
    out = program.run(fn=fn, args=list(args))
    for key in returns:
        program.return_(key=key, value=out)
    return client.execute(program, timeout_seconds=timeout)


@case
def version_is_the_reference():
    assert kcoral.__version__ == "0.1.1", kcoral.__file__


@case
def health():
    body = client.health()
    assert body["status"] == "ok" and body["gpu_count"] == 0 and body["target"] == {}
    assert set(body["load"]) == {"request_capacity", "requests_in_progress", "requests_waiting"}
    try:
        client.target()
    except ProtocolError:
        pass  # docs/client.md §4.5: a CPU server has no compilation target
    else:
        raise AssertionError("target() should raise on a CPU server")


@case
def every_json_type():
    source = ("def f(x):\n    return {'null': None, 'true': True, 'false': False, 'int': 10**30, 'neg': -7,\n"
              "            'float': 2.5, 'tiny': 2.5e-08, 'str': 'héllo ☃', 'list': [1, [2, 'x']],\n"
              "            'tuple': (1, 2), 'obj': {'k': {'z': False}}, 'empty': {}, 'echo': x}\n")
    arg = {"nested": [None, True, 1.5, "s", {"$ref": "not-a-ref"}]}
    result = run_module(source, "f", arg)
    assert result.completed, result.error
    assert result["out"] == {"null": None, "true": True, "false": False, "int": 10 ** 30, "neg": -7, "float": 2.5,
                             "tiny": 2.5e-08, "str": "héllo ☃", "list": [1, [2, "x"]], "tuple": [1, 2],
                             "obj": {"k": {"z": False}}, "empty": {}, "echo": arg}
    assert result.status == "COMPLETED" and result.error is None
    assert result.lease_wait_ms == 0.0 and result.lease_held_ms == 0.0


@case
def bytes_round_trip_and_cache_miss_retry():
    data = b"\r\n--kcoral-lookalike\r\n" + os.urandom(4096)  # fresh: the server has never seen it
    program = Program()
    module = program.upload(kind="module", source="def f(d):\n    return [d[::-1], d, b'']\n")
    blob = program.upload(kind="bytes", value=data)
    fn = program.get_function(module=module, name="f")
    program.return_(key="out", value=program.run(fn=fn, args=[blob]))
    before = len(POSTS)
    result = client.execute(program)
    assert result.completed, result.error
    assert result["out"] == [data[::-1], data, b""]
    # docs/client.md §4.2: program alone -> CACHE_MISS -> program plus exactly the missing blob
    assert POSTS[before:] == [["program"], ["blob:" + sha(data), "program"]], POSTS[before:]
    before = len(POSTS)
    assert client.execute(program)["out"][1] == data
    assert POSTS[before:] == [["program"]], POSTS[before:]


TENSOR_DTYPES = {
    "bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2,
}
NAN_BITS = {"float16": (np.uint16, [0x7E01, 0xFC00]), "bfloat16": (np.uint16, [0x7FC1, 0xFF80]),
            "float32": (np.uint32, [0x7FC00001, 0x7F800001]), "float64": (np.uint64, [0x7FF8000000000001, 0]),
            "float8_e4m3fn": (np.uint8, [0x7F, 0xFF]), "float8_e5m2": (np.uint8, [0x7D, 0xFE])}


def sample(dtype_name):
    dtype = np.dtype(TENSOR_DTYPES[dtype_name])
    if dtype_name == "bool":
        return (np.frombuffer(os.urandom(6), np.uint8) & 1).astype(np.bool_).reshape(2, 3)
    raw = np.frombuffer(os.urandom(6 * dtype.itemsize), np.uint8).copy()
    if dtype_name in NAN_BITS:
        bits_type, bits = NAN_BITS[dtype_name]
        raw[:2 * dtype.itemsize] = np.array(bits, dtype=bits_type).view(np.uint8)
    return raw.view(dtype).reshape(2, 3)


@case
def tensors_all_dtypes_bit_exact():
    source = "def f(*xs):\n    return [x.clone() for x in xs]\n"
    arrays = [sample(name) for name in TENSOR_DTYPES]
    program = Program()
    module = program.upload(kind="module", source=source)
    regs = [program.upload(kind="tensor", value=a) for a in arrays]
    fn = program.get_function(module=module, name="f")
    program.return_(key="out", value=program.run(fn=fn, args=regs))
    for name, reg in zip(TENSOR_DTYPES, regs):
        program.return_(key=name, value=reg)
    result = client.execute(program)
    assert result.completed, result.error
    for name, original, back, raw in zip(TENSOR_DTYPES, arrays, result["out"], [result[n] for n in TENSOR_DTYPES]):
        for got in (back, raw):
            assert got.dtype == original.dtype, (name, got.dtype)
            assert got.shape == (2, 3), (name, got.shape)
            assert got.tobytes() == original.tobytes(), name


@case
def numpy_arrays_returned_from_the_server():
    result = run_module("import numpy\ndef f():\n    return [numpy.arange(6, dtype=numpy.int16).reshape(2, 3),"
                        " numpy.int64(7)]\n", "f")
    assert result.completed, result.error
    array, scalar = result["out"]
    assert array.dtype == np.int16 and array.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert scalar.shape == () and int(scalar) == 7


@case
def upload_file_and_return_file_with_save():
    data = b"hello kcoral\n" + os.urandom(16)
    program = Program()
    module = program.upload(kind="module", source="def f(p):\n    open('out.txt', 'wb').write(open(p, 'rb').read()[::-1])\n    return p\n")
    cfg = program.upload_file(blob=data, path="./inputs//config.txt")
    fn = program.get_function(module=module, name="f")
    program.return_(key="path", value=program.run(fn=fn, args=[cfg]))
    program.return_file(key="same", path=cfg)
    program.return_file(key="reversed", path="out.txt")
    result = client.execute(program)
    assert result.completed, result.error
    assert result["path"] == "inputs/config.txt"
    assert isinstance(result["same"], ReturnedFile) and result["same"].read_bytes() == data
    with tempfile.TemporaryDirectory() as tmp:
        saved = result["reversed"].save(os.path.join(tmp, "r.txt"))
        assert open(saved, "rb").read() == data[::-1]
        assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600


@case
def upload_folder_and_return_folder_with_save():
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "assets")
        os.makedirs(os.path.join(src, "sub"))
        files = {"a.bin": os.urandom(10), ".hidden": b"h", "sub/x": b"", "sub/y.txt": b"why"}
        for rel, data in files.items():
            with open(os.path.join(src, rel), "wb") as f:
                f.write(data)
        program = Program()
        program.upload_folder(src, path="./inputs//")
        module = program.upload(kind="module", source="import os\ndef f():\n    os.makedirs('inputs/empty')\n"
                                                       "    return sorted(os.listdir('inputs'))\n")
        fn = program.get_function(module=module, name="f")
        program.return_(key="listing", value=program.run(fn=fn))
        program.return_folder(key="tree", path="inputs")
        result = client.execute(program)
        assert result.completed, result.error
        assert result["listing"] == [".hidden", "a.bin", "empty", "sub"]
        tree = result["tree"]
        assert isinstance(tree, ReturnedFolder)
        assert list(tree.files) == sorted(files)
        assert {k: v.read_bytes() for k, v in tree.files.items()} == files
        assert tree.directories == ("empty", "sub")
        dest = tree.save(os.path.join(tmp, "copy"))
        for rel, data in files.items():
            assert open(os.path.join(dest, rel), "rb").read() == data
        assert os.path.isdir(os.path.join(dest, "empty"))


@case
def failed_program_keeps_earlier_returns():
    program = Program()
    module = program.upload(kind="module", source="def ok():\n    return b'kept'\ndef bad():\n    raise ValueError('late')\n")
    ok = program.get_function(module=module, name="ok")
    bad = program.get_function(module=module, name="bad")
    program.return_(key="early", value=program.run(fn=ok))
    program.return_(key="late", value=program.run(fn=bad))
    result = client.execute(program)
    assert not result.completed and result.status == "FAILED"
    assert result.results == {"early": b"kept"}
    assert result.error["kind"] == "engine" and result.error["message"] == "ValueError: late"
    assert result.error["instruction_index"] == 5 and result.error["instruction_op"] == "run"


@case
def crash_keeps_earlier_returns_and_output():
    program = Program()
    module = program.upload(kind="module", source="import os\ndef ok():\n    print('before')\n    return 1\n"
                                                   "def die():\n    os._exit(3)\n")
    ok = program.get_function(module=module, name="ok")
    die = program.get_function(module=module, name="die")
    program.return_(key="early", value=program.run(fn=ok))
    program.run(fn=die)
    result = client.execute(program)
    assert result.status == "FAILED" and result.results == {"early": 1} and "before" in result.stdout
    assert result.error["kind"] == "runtime" and result.error["traceback"] == ""


@case
def unknown_execution_error_kind_stays_decodable():
    result = run_module("from kcoral.errors import ExecutionError\ndef f():\n    raise ExecutionError('weird', 'x')\n", "f")
    assert result.error["kind"] == "engine" and "weird" in result.error["message"]
    result = run_module("from kcoral.errors import ExecutionError\ndef f():\n    raise ExecutionError('correctness', 'off by 1')\n", "f")
    assert result.error["kind"] == "correctness" and result.error["message"] == "off by 1"


@case
def output_capture():
    result = run_module("import subprocess\ndef f():\n    print('py')\n    subprocess.run(['echo', 'child'])\n", "f")
    assert result.completed and "py\n" in result.stdout and "child\n" in result.stdout
    program = Program()
    module = program.upload(kind="module", source="def f():\n    print('x' * 100)\n")
    program.run(fn=program.get_function(module=module, name="f"))
    result = client.execute(program, output_limit_bytes=10)
    assert result.stdout == "x" * 10 and result.stdout_truncated is True


@client.function(timeout=60)
def add(a, b=2, *rest, scale=1.0, **extra):
    return {"sum": (a + b) * scale, "rest": list(rest), "extra": extra}


@client.function()
def digest(data, array, label):
    import hashlib
    return {"sha": hashlib.sha256(data).hexdigest(), "label": label, "doubled": array * 2}


@client.function()
def fails(n):
    raise RuntimeError(f"bad {n}")


@case
def remote_functions():
    assert add(1) == {"sum": 3, "rest": [], "extra": {}}  # local call
    assert add.remote(1, 3, 7, 8, scale=2.0, k="v") == {"sum": 8.0, "rest": [7, 8], "extra": {"k": "v"}}
    data, array = os.urandom(100), np.arange(4, dtype=np.float32)
    out = digest.remote(data, array, {"$ref": "module"})
    assert out["sha"] == sha(data) and out["label"] == {"$ref": "module"}
    assert out["doubled"].dtype == np.float32 and out["doubled"].tolist() == [0.0, 2.0, 4.0, 6.0]
    try:
        fails.remote(7)
    except RemoteExecutionError as exc:
        assert "engine: RuntimeError: bad 7" in str(exc), str(exc)
        assert exc.result.error["kind"] == "engine" and exc.result.status == "FAILED"
    else:
        raise AssertionError("RemoteExecutionError expected")


@case
def http_errors():
    program = Program()
    module = program.upload(kind="module", source="import time\ndef f():\n    time.sleep(30)\n")
    program.run(fn=program.get_function(module=module, name="f"))
    try:
        client.execute(program, timeout_seconds=1)
    except KCoralError as exc:
        assert (exc.status_code, exc.kind) == (504, "timeout"), (exc.status_code, exc.kind)
        assert isinstance(exc.request_id, str) and len(exc.request_id) == 36
        assert str(exc).startswith("HTTP 504: ")
    else:
        raise AssertionError("KCoralError 504 expected")
    try:
        client.execute(_bad_program())
    except KCoralError as exc:
        assert (exc.status_code, exc.kind) == (400, "parse"), (exc.status_code, exc.kind)
    else:
        raise AssertionError("KCoralError 400 expected")
    for bad_option in ({"timeout_seconds": 0}, {"output_limit_bytes": -1}, {"gpu_count": 1}):
        try:
            run_program = Program()
            run_program.upload(kind="module", source="")
            client.execute(run_program, **bad_option)
        except KCoralError as exc:
            assert (exc.status_code, exc.kind) == (400, "parse"), bad_option
        else:
            raise AssertionError(f"KCoralError 400 expected for {bad_option}")


def _bad_program():
    """A top-level Register with an id the program does not define: only the server can tell."""
    from kcoral import Register
    program = Program()
    module = program.upload(kind="module", source="def f(x):\n    return x\n")
    program.run(fn=program.get_function(module=module, name="f"), args=[Register("nope")])
    return program


def main():
    failed = 0
    for fn in CASES:
        try:
            fn()
        except BaseException:
            failed += 1
            print(f"FAIL {fn.__name__}: {traceback.format_exc()}", flush=True)
        else:
            print(f"ok {fn.__name__}", flush=True)
    client.close()
    print(f"{len(CASES) - failed}/{len(CASES)} cases passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
