"""End-to-end checks of the GPU runtime against a real `python -m kcoral` server.

    .venv/bin/python -m bench.gpu_check --device gpu    # on a CUDA box: about 2 minutes
    .venv/bin/python -m bench.gpu_check --device cpu    # what a CPU server allows (CI runs this)

GPU mode starts one server with two workers on GPU 0 that are reused between
requests (`--workers-per-gpu 2 --max-requests-per-worker 0`), so that lease
contention and the replacement of a poisoned worker are both visible, and
checks: pinning, /health target and versions, tensors of all 12 dtypes on
CUDA, a TVM-FFI CUDA library built here with `tvm_ffi.cpp.build` (needs
nvcc), `benchmark` on that kernel, lease timings of two concurrent requests,
cpu_only runs (lease released and CUDA use reported with cupti-python;
`unavailable` without it), compile_tirx, gpu_count, and a device-side fault
that poisons a worker which is then replaced.  CPU mode runs the parts that
need no GPU: tensors on CPU, a C++ library, the host-timer benchmark,
compile_tirx, lease-free timings.

Prints one PASS/FAIL line per case and a final `N passed, M failed`; exits 1
when anything failed.  Requests go over raw HTTP (test_kcoral's helpers), so
the script does not depend on client.py.
"""

import argparse
import concurrent.futures
import hashlib
import os
import re
import sys
import tempfile
import textwrap
import time
import traceback
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import numpy

from tests.support import ServerProcess, post, request

DTYPES = ["bool", "uint8", "int8", "float8_e4m3fn", "float8_e5m2", "int16", "float16", "bfloat16",
          "int32", "float32", "int64", "float64"]
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int16": 2,
            "float16": 2, "bfloat16": 2, "int32": 4, "float32": 4, "int64": 8, "float64": 8}

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


# --- program building ---------------------------------------------------------

class Prog:
    """A tiny program builder: instructions plus the blobs they reference."""

    def __init__(self, options=None):
        self.instructions, self.blobs, self.options = [], [], options or {}

    def blob(self, data):
        if data not in self.blobs:
            self.blobs.append(data)
        return hashlib.sha256(data).hexdigest()

    def add(self, **ins):
        self.instructions.append(ins)
        return {"$ref": ins["id"]} if "id" in ins else None

    def module(self, source):
        return self.add(op="upload", id=f"m{len(self.instructions)}", kind="module", source=textwrap.dedent(source))

    def function(self, module, name, cpu_only=False):
        extra = {"cpu_only": True} if cpu_only else {}
        return self.add(op="get_function", id=f"f{len(self.instructions)}", module=module, name=name, **extra)

    def tensor(self, data, dtype, shape):
        return self.add(op="upload", id=f"t{len(self.instructions)}", kind="tensor", blob=self.blob(data),
                        dtype=dtype, shape=shape)

    def library(self, data):
        return self.add(op="upload", id=f"l{len(self.instructions)}", kind="library", blob=self.blob(data))

    def run(self, fn, *args):
        return self.add(op="run", id=f"r{len(self.instructions)}", fn=fn, args=list(args))

    def ret(self, key, value):
        self.add(op="return", key=key, value=value)

    def send(self, url, request_id=None, timeout=300):
        headers = {"X-Request-ID": request_id} if request_id else {}
        program = {"instructions": self.instructions, "options": self.options}
        status, _, body = post(url, program, self.blobs, headers=headers, timeout=timeout)
        return status, body


def call(url, source, name, *args, cpu_only=False, request_id=None, options=None):
    """module -> get_function -> run(args) -> return "out"; -> (status, body)."""
    prog = Prog(options)
    fn = prog.function(prog.module(source), name, cpu_only)
    prog.ret("out", prog.run(fn, *args))
    return prog.send(url, request_id)


def completed(status, body):
    assert status == 200 and body.get("status") == "COMPLETED", f"{status} {short(body)}"
    return body


def out(status, body):
    """The plain value returned as "out" by a COMPLETED answer."""
    return plain(completed(status, body)["results"]["out"])


def failed(status, body, kind):
    assert status == 200 and body.get("status") == "FAILED", f"{status} {short(body)}"
    assert body["error"]["kind"] == kind, short(body["error"])
    return body["error"]


def short(value):
    return repr(value)[:600]


def plain(encoded):
    """A decoded JSON result value (no binary parts) -> Python."""
    kind = encoded["type"]
    if kind == "null":
        return None
    if kind == "array":
        return [plain(v) for v in encoded["value"]]
    if kind == "object":
        return {k: plain(v) for k, v in encoded["value"].items()}
    return encoded["value"]


def tensor_bytes(body, encoded, dtype, shape):
    assert encoded["type"] == "tensor", encoded
    assert encoded["dtype"] == dtype and encoded["shape"] == shape, encoded
    return body["_parts"][encoded["part"]]


# --- cases ------------------------------------------------------------------------

def case_pinning(ctx):
    src = """
    import os
    def env():
        import torch
        return [os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(),
                [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if k in os.environ],
                os.environ.get("TVM_FFI_CUDA_ARCH_LIST")]
    """
    visible, count, leaked, arch_list = out(*call(ctx.url, src, "env"))
    assert re.fullmatch(r"GPU-[0-9a-fA-F-]+|\d+", visible), visible
    assert count == 1, count
    assert not leaked, f"torchrun variables reached the worker: {leaked}"
    arch = ctx.health["target"]["arch"]
    digits, suffix = re.fullmatch(r"sm_(\d+)(a?)", arch).groups()
    expected = ctx.arch_list_env or f"{digits[:-1]}.{digits[-1]}{suffix}"  # only set when not set already
    assert arch_list == expected, (arch_list, arch)
    return f"CUDA_VISIBLE_DEVICES={visible}"


def case_health(ctx):
    health = ctx.health
    if ctx.device == "cpu":
        assert health["target"] == {} and health["gpu_count"] == 0, health
        assert set(health["versions"]) <= {"tvm_ffi"}, health["versions"]
        return "target {}"
    arch = health["target"]["arch"]
    major = int(re.fullmatch(r"sm_(\d+)a?", arch).group(1)[:-1])
    assert arch.endswith("a") == (major >= 9), arch
    assert {"torch", "cuda", "tvm_ffi"} <= set(health["versions"]), health["versions"]
    assert health["gpu_count"] == 1 and health["load"]["request_capacity"] == 2, health
    return f"{arch} {health['versions']}"


def case_tensors(ctx):
    rng = numpy.random.default_rng(4)
    prog, uploads = Prog(), []
    for dtype in DTYPES:
        shape = [3, 5]
        data = rng.integers(0, 2, 15, dtype=numpy.uint8).tobytes() if dtype == "bool" else \
            rng.bytes(15 * ITEMSIZE[dtype])
        uploads.append((dtype, shape, data, prog.tensor(data, dtype, shape)))
    for dtype, shape, data in (("float32", [], numpy.float32(2.5).tobytes()), ("int64", [0, 4], b"")):
        uploads.append((dtype, shape, data, prog.tensor(data, dtype, shape)))  # 0-d and empty
    module = prog.module("""
    def info(*tensors):
        return [[str(t.device), str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    def double(t):
        return t * 2
    """)
    prog.ret("info", prog.run(prog.function(module, "info"), *[ref for *_, ref in uploads]))
    for i, (_, _, _, ref) in enumerate(uploads):
        prog.ret(f"t{i}", ref)
    halves = numpy.arange(15, dtype="<f4") / 2
    computed = prog.run(prog.function(module, "double"), prog.tensor(halves.tobytes(), "float32", [3, 5]))
    prog.ret("doubled", computed)  # computed on the worker's device, copied back
    body = completed(*prog.send(ctx.url))
    results = body["results"]
    device = "cuda:0" if ctx.device == "gpu" else "cpu"
    for (dtype, shape, data, _), (seen_device, seen_dtype, seen_shape) in zip(uploads, plain(results["info"])):
        assert (seen_device, seen_dtype, seen_shape) == (device, dtype, shape), (seen_device, seen_dtype, dtype)
    for i, (dtype, shape, data, _) in enumerate(uploads):
        got = tensor_bytes(body, results[f"t{i}"], dtype, shape)
        assert got == data, f"{dtype} {shape} not bit-exact"
    doubled = numpy.frombuffer(tensor_bytes(body, results["doubled"], "float32", [3, 5]), "<f4")
    assert numpy.array_equal(doubled, halves * 2), "t * 2 on the device differs"
    return f"{len(uploads)} tensors bit-exact on {device}"


def library_program(ctx, n=1000):
    prog = Prog()
    x = numpy.arange(n, dtype=numpy.float32)
    fn = prog.function(prog.library(ctx.library), "add_one")
    xs = prog.tensor(x.tobytes(), "float32", [n])
    ys = prog.tensor(numpy.zeros(n, numpy.float32).tobytes(), "float32", [n])
    return prog, fn, xs, ys, x


def case_library(ctx):
    prog, fn, xs, ys, x = library_program(ctx)
    prog.run(fn, xs, ys)
    prog.ret("y", ys)
    body = completed(*prog.send(ctx.url))
    y = numpy.frombuffer(tensor_bytes(body, body["results"]["y"], "float32", [len(x)]), "<f4")
    assert numpy.array_equal(y, x + 1), y[:5]
    return f"add_one over {len(x)} float32 ({len(ctx.library)} byte library)"


def case_library_errors(ctx):
    prog = Prog()
    prog.function(prog.library(ctx.library), "no_such_function")
    error = failed(*prog.send(ctx.url), "compile")
    assert error["instruction_op"] == "get_function", error
    prog = Prog()
    prog.library(b"\x7fELF not really a shared library")
    error = failed(*prog.send(ctx.url), "compile")
    assert error["instruction_op"] == "upload", error
    return "missing export and garbage bytes -> compile"


def case_benchmark(ctx):
    prog, fn, xs, ys, _ = library_program(ctx, 1 << 20)
    module = prog.module("""
    from kcoral.builtins import benchmark
    def counted(fn, x, y):
        return benchmark(fn, x, y, {"warmup": 3, "repeat": 20})
    def budgeted(fn, x, y):
        return benchmark(fn, x, y, {"warmup_ms": 2, "repeat_ms": 10, "flush_l2": False})
    """)
    prog.ret("counted", prog.run(prog.function(module, "counted"), fn, xs, ys))
    prog.ret("budgeted", prog.run(prog.function(module, "budgeted"), fn, xs, ys))
    results = completed(*prog.send(ctx.url))["results"]
    counted, budgeted = plain(results["counted"]), plain(results["budgeted"])
    fields = {"latency_ms_median", "latency_ms_mean", "latency_ms_min", "latency_ms_max",
              "activities_stable", "flush_l2", "warmup", "repeat"}
    for result in (counted, budgeted):
        assert fields <= set(result), result
        assert 0 < result["latency_ms_min"] <= result["latency_ms_median"] <= result["latency_ms_max"], result
        assert isinstance(result["activities_stable"], bool), result
    assert (counted["warmup"], counted["repeat"], counted["flush_l2"]) == (3, 20, True), counted
    assert budgeted["flush_l2"] is False and budgeted["repeat"] >= 1, budgeted
    timer = counted.get("timer")
    if ctx.device == "cpu":
        assert timer == "host" and counted["activities_stable"] is False, counted
    elif ctx.cupti:
        assert timer is None and counted["activities_stable"] is True, counted
    else:
        assert timer == "cuda_events" and counted["activities_stable"] is False, counted
    return f"median {counted['latency_ms_median']:.4f} ms, timer {timer or 'cupti'}"


def case_compile_tirx(ctx):
    status, body = call(ctx.url, """
    from kcoral.builtins import compile_tirx
    def f():
        return compile_tirx(42)
    """, "f")
    if "tvm" in ctx.health["versions"] or ctx.device == "cpu" and tvm_installed():
        failed(status, body, "compile")
        return "tvm installed: a non-kernel -> compile"
    error = failed(status, body, "unavailable")
    assert "tvm" in error["message"], error
    return "no tvm -> unavailable"


def tvm_installed():
    import importlib.util
    return importlib.util.find_spec("tvm") is not None


HOLD = """
import time
def hold(seconds):
    import torch
    torch.ones(8, device="cuda").sum().item()
    time.sleep(seconds)
def gpu():
    import torch
    return torch.ones(8, device="cuda").sum().item()
def sleeper(seconds):
    time.sleep(seconds)
    return "slept"
def intruder(seconds):
    time.sleep(seconds)
    import torch
    return torch.zeros(4, device="cuda").sum().item()
"""


def in_parallel(*calls):
    """Start each (delay, fn) after its delay; -> their results in order."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = []
        for delay, fn in calls:
            time.sleep(delay)
            futures.append(pool.submit(fn))
        return [f.result() for f in futures]


def case_lease_timings(ctx):
    if ctx.device == "cpu":
        status, body = call(ctx.url, "def f():\n    return 1\n", "f")
        completed(status, body)
        assert body["lease_wait_ms"] == 0.0 and body["lease_held_ms"] == 0.0, body
        return "CPU server: 0.0 and 0.0"
    first, second = in_parallel((0, lambda: call(ctx.url, HOLD, "hold", 1.0)),
                                (0.3, lambda: call(ctx.url, HOLD, "hold", 1.0)))
    for status, body in (first, second):
        completed(status, body)
        assert body["lease_held_ms"] >= 1000, body["lease_held_ms"]
        assert body["lease_wait_ms"] + body["lease_held_ms"] <= body["elapsed_ms"] + 1, body
    waits = sorted(body["lease_wait_ms"] for _, body in (first, second))
    assert waits[1] >= 500, f"the second request did not wait for the lease: {waits}"
    return f"waits {waits[0]:.0f}/{waits[1]:.0f} ms, held {first[1]['lease_held_ms']:.0f} ms"


def case_cpu_only(ctx):
    if ctx.device == "cpu":
        completed(*call(ctx.url, HOLD, "sleeper", 0, cpu_only=True))
        return "no effect on a CPU server"
    if not ctx.cupti:
        error = failed(*call(ctx.url, HOLD, "sleeper", 0, cpu_only=True), "unavailable")
        assert "cupti" in error["message"], error
        return "cupti-python not installed: unavailable, like the reference"
    sleeper, gpu = in_parallel((0, lambda: call(ctx.url, HOLD, "sleeper", 2.0, cpu_only=True)),
                               (0.5, lambda: call(ctx.url, HOLD, "gpu")))
    completed(*sleeper)
    completed(*gpu)
    assert gpu[1]["lease_wait_ms"] < 1000, f"the lease was not released: {gpu[1]['lease_wait_ms']}"
    assert sleeper[1]["lease_held_ms"] < 1500, sleeper[1]["lease_held_ms"]
    return f"other request waited {gpu[1]['lease_wait_ms']:.0f} ms during a 2 s cpu_only run"


def case_gpu_access(ctx):
    holder_id = str(uuid.uuid4())
    intruder, holder = in_parallel(
        (0, lambda: call(ctx.url, HOLD, "intruder", 1.5, cpu_only=True)),
        (0.5, lambda: call(ctx.url, HOLD, "hold", 2.5, request_id=holder_id)))
    completed(*holder)
    error = failed(*intruder, "gpu_access")
    assert set(error) == {"kind", "message", "instruction_index", "instruction_op", "instruction_id",
                          "traceback", "cuda_call", "location", "interfered_request_id"}, set(error)
    assert error["cuda_call"] and "<uploaded:" in error["location"], error
    assert error["interfered_request_id"] == holder_id, (error["interfered_request_id"], holder_id)
    return f"{error['cuda_call']} at {error['location']}"


def case_gpu_count(ctx):
    too_many = ctx.health["gpu_count"] + 1
    status, body = call(ctx.url, "def f():\n    return 1\n", "f", options={"gpu_count": too_many})
    assert status == 400 and body["error"]["kind"] == "parse", (status, body)
    if ctx.device == "cpu":
        return "gpu_count on a CPU server -> 400"
    status, body = call(ctx.url, HOLD, "gpu", options={"gpu_count": 1})
    completed(status, body)
    assert body["gpu_ids"] == [0] and body["gpu_count"] == 1, body
    return "gpu_count 1 -> gpu_ids [0]; too many -> 400"


def case_poisoned_worker(ctx):
    pid_src = """
    import os
    def pid():
        import torch
        torch.ones(2, device="cuda").sum().item()
        return os.getpid()
    def fault():
        import torch
        print(os.getpid(), flush=True)
        x = torch.zeros(4, device="cuda")
        x[torch.tensor([1 << 20], device="cuda")] = 1.0  # device-side assert: the context is lost
        torch.cuda.synchronize()
    """
    before = {out(*call(ctx.url, pid_src, "pid")) for _ in range(4)}
    status, body = call(ctx.url, pid_src, "fault")
    assert status == 200 and body["status"] == "FAILED", (status, short(body))
    poisoned = int(body["stdout"].split()[0])
    assert poisoned in before, (poisoned, before)
    time.sleep(1)
    after = {out(*call(ctx.url, pid_src, "pid")) for _ in range(6)}
    assert poisoned not in after, f"poisoned worker {poisoned} served again: {after}"
    assert after - before, f"no replacement worker served: {before} -> {after}"
    return f"worker {poisoned} retired ({body['error']['kind']}), replaced by {sorted(after - before)}"


GPU_CASES = [case_pinning, case_health, case_tensors, case_library, case_library_errors, case_benchmark,
             case_compile_tirx, case_lease_timings, case_cpu_only, case_gpu_access, case_gpu_count,
             case_poisoned_worker]
CPU_CASES = [case_health, case_tensors, case_library, case_library_errors, case_benchmark, case_compile_tirx,
             case_lease_timings, case_cpu_only, case_gpu_count]


class Context:
    pass


SANDBOX_NODES = """
import os
def nodes():
    return sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
"""


def sandboxed_pass(device, library, library_error=""):
    """The main program kinds again inside `--sandbox bubblewrap` (docs/sandbox.md), and the
    device nodes a sandboxed GPU worker sees: its GPU's and the control nodes, nothing else."""
    ctx, results = Context(), []
    ctx.device, ctx.library, ctx.cupti = device, library, False
    ctx.arch_list_env = os.environ.get("TVM_FFI_CUDA_ARCH_LIST")
    server = ServerProcess("--sandbox", "bubblewrap", device=device)
    try:
        ctx.url, ctx.health = server.url, server.health()
        cases = [case_tensors, case_library, case_benchmark, case_gpu_count]
        for case in ([case_pinning] if device == "gpu" else []) + cases:
            name = "sandboxed " + case.__name__.removeprefix("case_")
            try:
                if library is None and case in (case_library, case_benchmark):
                    raise AssertionError(library_error)
                detail = case(ctx)
                results.append(True)
                print(f"PASS {name}: {detail}", flush=True)
            except Exception as exc:
                results.append(False)
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        nodes = out(*call(ctx.url, SANDBOX_NODES, "nodes"))
        gpus = [n for n in nodes if re.fullmatch(r"nvidia\d+", n)]
        ok = len(gpus) == (1 if device == "gpu" else 0) and set(nodes) - set(gpus) <= {
            "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps"}
        results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'} sandboxed device nodes: {nodes}", flush=True)
    finally:
        server.stop()
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    args = parser.parse_args(argv)
    ctx, results = Context(), []
    ctx.device, ctx.arch_list_env = args.device, os.environ.get("TVM_FFI_CUDA_ARCH_LIST")
    started = time.monotonic()
    flags = ["--workers-per-gpu", "2", "--max-requests-per-worker", "0"] if args.device == "gpu" else []
    # torchrun variables in the server's environment must not reach GPU workers
    server = ServerProcess(*flags, device=args.device,
                           env={"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"})
    try:
        ctx.url, ctx.health = server.url, server.health()
        ctx.cupti = False
        if args.device == "gpu":
            ctx.cupti = out(*call(ctx.url, """
            def has_cupti():
                try:
                    from cupti import cupti
                    return True
                except (ImportError, OSError):
                    return False
            """, "has_cupti"))
        try:
            ctx.library = build_add_one(args.device, ctx.health["target"].get("arch"))
        except Exception as exc:
            ctx.library = None
            ctx.library_error = f"building the library failed: {type(exc).__name__}: {str(exc)[-400:]}"
        for case in GPU_CASES if args.device == "gpu" else CPU_CASES:
            name = case.__name__.removeprefix("case_")
            try:
                if ctx.library is None and name in ("library", "library_errors", "benchmark"):
                    raise AssertionError(ctx.library_error)
                detail = case(ctx)
                results.append(True)
                print(f"PASS {name}: {detail}", flush=True)
            except Exception as exc:
                results.append(False)
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
                if not isinstance(exc, AssertionError):
                    traceback.print_exc(limit=3)
    finally:
        server.stop()
    results += sandboxed_pass(args.device, ctx.library, getattr(ctx, "library_error", ""))
    passed = sum(results)
    print(f"({args.device} mode, {time.monotonic() - started:.0f} s)")
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
