"""One-shot check of the GPU runtime against real `python -m kcoral` servers.

    python3 -m bench.gpu_check --device gpu --wheels bench/wheels --out "$OUT"   # a lent GPU machine
    python3 -m bench.gpu_check --device gpu --wheels bench/wheels --only main_server,sandboxed   # a rerun
    .venv/bin/python -m bench.gpu_check --device cpu                               # what CPU allows (CI)

docs/gpu-check.md says how to run it on a lent device and what each phase proves.
It runs in phases (PHASES below), each within its own time budget, each writing
its figures into one JSON report (`gpu_check.json` under --out, rewritten after
every phase, so a run cut short still reports) beside the servers' logs (all in
`servers.log`: a lent device brings back at most 8 files):

  preflight         versions (torch, cuda-bindings, CUPTI, tvm-ffi), persistence mode,
                    which tools exist; on a GPU: whether importing torch and tvm_ffi
                    initialises CUDA (a fork of that state then fails), what a forked
                    CUDA context costs, a CUPTI smoke test
  request_overhead  20 back-to-back trivial requests on fresh workers (the default;
                    the next request's queue_ms is the slot downtime) and on reused ones
  cpu_mode          a --device cpu server on the CUDA host: its forked workers can
                    still use CUDA (the template never called cuInit)
  main_server       two reused workers on GPU 0: the runtime's cases (GPU_CASES)
  cli_tools         `kcoral run python / ncu / compute-sanitizer`, each bounded
  sandboxed         cases again under --sandbox bubblewrap (bwrap from PATH or the
                    carried .deb)
  examples          examples/*.py marked `# requires: gpu`, with KCORAL_URL set

What a machine lacks (a GPU, bwrap, examples) is a SKIP with its reason, never a
FAIL.  With KCORAL_GPU_CHECK_DRY_RUN=1 a --device gpu run is a dry run on CPU
servers (tests/test_gpu_dry_run.py): everything up to the first CUDA call.  Every
request carries a bounded timeout_seconds and the whole run keeps to --budget-s.
Prints PASS/FAIL/SKIP lines and each phase's wall time as it goes and exits 1 when
anything failed.
"""

import argparse
import concurrent.futures
import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(tempfile.gettempdir(), "kcoral-gpu-check-site")
# the CPU dry run (tests/test_gpu_dry_run.py): the GPU run's exact command on a machine without CUDA;
# its servers run --device cpu and every step that needs CUDA SKIPs, so that all before it is proven
DRY_RUN_VARIABLE = "KCORAL_GPU_CHECK_DRY_RUN"


def install_wheels(folder):
    """Install the carried distributions for this interpreter (no index: the device reaches nothing).
    By name, from the folder: pip picks each one's wheel for this Python (the folder may carry
    several, as the CPU dry run's does)."""
    names = sorted({os.path.basename(w).split("-")[0] for w in glob.glob(os.path.join(folder, "*.whl"))})
    if not names:
        raise SystemExit(f"gpu_check: no wheels in {folder} (run bench/fetch_wheels.sh here first)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", folder, "--no-deps",
                    "--no-compile", "--upgrade", "--target", SITE, *names], check=True, timeout=300)
    sys.path.insert(0, SITE)
    os.environ["PYTHONPATH"] = SITE + os.pathsep + os.environ.get("PYTHONPATH", "")  # servers and probes too
    os.environ["PATH"] = os.path.join(SITE, "bin") + os.pathsep + os.environ.get("PATH", "")  # ninja, for our builds


if __name__ == "__main__" and "--wheels" in sys.argv:  # before numpy/tvm_ffi are imported
    install_wheels(sys.argv[sys.argv.index("--wheels") + 1])

import numpy  # noqa: E402  (imports that the carried wheels may provide come after installing them)

from bench.cli_checks import cli_tool_checks  # noqa: E402
from tests.support import ServerProcess, build_add_one, plain, post, request  # noqa: E402

REQUEST_TIMEOUT = 60  # timeout_seconds of every request unless a case says otherwise
DTYPES = ["bool", "uint8", "int8", "float8_e4m3fn", "float8_e5m2", "int16", "float16", "bfloat16",
          "int32", "float32", "int64", "float64"]
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int16": 2,
            "float16": 2, "bfloat16": 2, "int32": 4, "float32": 4, "int64": 8, "float64": 8}


# --- program building ---------------------------------------------------------

class Prog:
    """A tiny program builder: instructions plus the blobs they reference."""

    def __init__(self, options=None):
        self.instructions, self.blobs = [], []
        self.options = {"timeout_seconds": REQUEST_TIMEOUT, **(options or {})}

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

    def send(self, url, request_id=None):
        headers = {"X-Request-ID": request_id} if request_id else {}
        timeout = self.options["timeout_seconds"] + 60  # the server answers 504 well before this
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
    for (dtype, shape, _data, _), (seen_device, seen_dtype, seen_shape) in zip(uploads, plain(results["info"])):
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
    if ctx.device == "gpu" and not ctx.cupti:
        error = failed(*call(ctx.url, "from kcoral.builtins import benchmark\ndef f():\n"
                                      "    return benchmark(lambda: None)\n", "f"), "unavailable")
        assert "cupti" in error["message"], error
        return "CUPTI unusable here: unavailable, as the spec says"
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
    else:
        assert timer is None and counted["activities_stable"] is True, counted
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
    if not ctx.cupti:
        return "CUPTI unusable here: cpu_only answers unavailable (case cpu_only)"
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


POISON = """
import os, time
def pid(device):
    import torch
    time.sleep(0.5)  # holds its worker while the other request takes the other one
    torch.ones(2, device=device).sum().item()
    return os.getpid()
def fault():
    import torch
    print(os.getpid(), flush=True)
    time.sleep(0.5)
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([1 << 20], device="cuda")] = 1.0  # device-side assert: the context is lost
    torch.cuda.synchronize()
"""
OVERLAP_S = 0.2  # the second of two requests leaves after the first took its worker, well before it ends (0.5 s)


def worker_pids(ctx, tries=5):
    """The pids of the server's two workers, once both serve.  Pool.acquire hands out the first idle
    slot in configured order (docs/server.md §1.4), so requests sent one after the other all reach
    worker 0; two that overlap reach one worker each.  Tried again while a slot is still being
    replaced (its request then waits for the other worker and reaches it a second time)."""
    device = "cuda" if ctx.device == "gpu" else "cpu"
    seen = []
    for _ in range(tries):
        seen = [out(*answer) for answer in in_parallel((0, lambda: call(ctx.url, POISON, "pid", device)),
                                                       (OVERLAP_S, lambda: call(ctx.url, POISON, "pid", device)))]
        if len(set(seen)) == 2:
            return set(seen)
        time.sleep(0.5)
    raise AssertionError(f"two overlapping requests reached one worker {tries} times: {seen}")


def on_both_workers(ctx, trigger):
    """Run trigger() -> (pid of the worker it reached, summary) on both workers at once: two
    overlapping calls, each of which holds its worker for 0.5 s first -> {pid: summary}."""
    originals = worker_pids(ctx)
    reached = dict(in_parallel((0, trigger), (OVERLAP_S, trigger)))
    assert set(reached) == originals, f"reached workers {sorted(reached)} of {sorted(originals)}"
    return reached


def case_both_workers(ctx):
    """What last_error and poisoned_worker rely on, where a CPU server can show it: overlapping
    requests reach both reused workers, each one once."""
    device = "cuda" if ctx.device == "gpu" else "cpu"

    def trigger():
        pid = out(*call(ctx.url, POISON, "pid", device))
        return pid, "served"
    reached = on_both_workers(ctx, trigger)
    return f"workers {sorted(reached)} each reached once by two overlapping requests"


def case_poisoned_worker(ctx):
    def trigger():
        status, body = call(ctx.url, POISON, "fault")
        assert status == 200 and body["status"] == "FAILED", (status, short(body))
        return int(body["stdout"].split()[0]), body["error"]["kind"]
    reached = on_both_workers(ctx, trigger)
    after = worker_pids(ctx)
    assert not after & set(reached), f"poisoned workers {sorted(reached)} served again: {sorted(after)}"
    return f"workers {sorted(reached)} retired ({sorted(set(reached.values()))}), both slots served again"


# --- the device checks a desk review asked for ----------------------------------------

LAYOUTS = """
import torch
def layouts():
    g = torch.Generator(device="cuda").manual_seed(1)
    base = torch.randn(64, 48, device="cuda", generator=g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(200_000_000)  # keep the side stream busy past the return
        late = base * 3
    return {"base": base, "transposed": base.t(), "expanded": base[0].expand(5, 48), "side": late}
"""


def case_layouts(ctx):
    body = completed(*call(ctx.url, LAYOUTS, "layouts"))
    result = body["results"]["out"]["value"]

    def array(key, shape):
        return numpy.frombuffer(tensor_bytes(body, result[key], "float32", shape), "<f4").reshape(shape)
    base = array("base", [64, 48])
    assert numpy.array_equal(array("transposed", [48, 64]), base.T), "transposed tensor differs"
    assert numpy.array_equal(array("expanded", [5, 48]), numpy.tile(base[0], (5, 1))), "expanded tensor differs"
    assert numpy.array_equal(array("side", [64, 48]), base * 3), "side-stream tensor read before its kernel ended"
    return "transposed, expanded and side-stream results bit-exact"


LAST_ERROR = """
import ctypes, os, time
def set_last_error():
    import torch
    print(os.getpid(), flush=True)
    time.sleep(0.5)  # holds its worker while the other request takes the other one (on_both_workers)
    torch.ones(1, device="cuda").sum().item()
    paths = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line})
    if not paths:
        return "no shared libcudart loaded"
    return ctypes.CDLL(paths[0]).cudaSetDevice(9999)  # invalid device: a last error, no failed synchronize
def fine():
    import torch
    return torch.ones(2, device="cuda").sum().item()
"""


def case_last_error(ctx):
    def trigger():
        status, body = call(ctx.url, LAST_ERROR, "set_last_error")
        assert status == 200, (status, short(body))
        if body["status"] == "COMPLETED":
            raise AssertionError(f"a pending CUDA error went unnoticed: {short(body['results'])}")
        error = body["error"]
        assert error["kind"] == "runtime" and "cudaErrorInvalidDevice" in error["message"], error
        assert error["instruction_index"] == 3, error  # the last instruction started: the return
        return int(body["stdout"].split()[0]), error["message"]
    reached = on_both_workers(ctx, trigger)
    worker_pids(ctx)  # both slots complete CUDA work again: the error was cleared (or its worker replaced)
    return f"on workers {sorted(reached)}: {next(iter(reached.values()))}; both served again"


MEMORY = """
import time
import torch
held = []
def free_bytes():
    torch.ones(1, device="cuda").sum().item()
    return torch.cuda.mem_get_info()[0]
def hog(gib, seconds):
    held.append(torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda"))
    held.append(held)  # module scope, in a reference cycle: only a collection frees it
    time.sleep(seconds)  # so that a request sent meanwhile lands on the other worker
    return torch.cuda.memory_reserved()
"""


def case_memory_released(ctx):
    """16 GiB held through a reference cycle; a request waiting on the other worker gets the lease
    next and reads free memory at once: it must already be back (freed before the lease went)."""
    gib = 16
    before = out(*call(ctx.url, MEMORY, "free_bytes"))
    hogged, after = in_parallel((0, lambda: call(ctx.url, MEMORY, "hog", gib, 1.0)),
                                (0.3, lambda: call(ctx.url, MEMORY, "free_bytes")))
    assert out(*hogged) >= gib << 30, short(hogged)
    lost = (before - out(*after)) / (1 << 30)
    assert lost < 1.0, f"{lost:.1f} GiB still held when the next request got the lease"
    return f"{gib} GiB hogged; the next lease holder saw free memory within {lost:.2f} GiB of before"


HANG = """
import time
def hang():
    import torch
    torch.ones(1, device="cuda").sum().item()
    time.sleep(600)
"""


def case_hang(ctx):
    started = time.monotonic()
    status, body = call(ctx.url, HANG, "hang", options={"timeout_seconds": 3})
    waited = time.monotonic() - started
    assert status == 504 and body["error"]["kind"] == "timeout", (status, short(body))
    assert waited < 3 + 5 + 30, f"504 after {waited:.1f} s"  # timeout + grace + a replacement
    assert out(*call(ctx.url, LAST_ERROR, "fine")) == 2.0
    return f"504 after {waited:.1f} s; the next request completed"


SPIN = """
import torch
def spin(cycles):
    torch.cuda._sleep(cycles)  # one kernel busy for minutes: still running when the worker is killed
    torch.cuda.synchronize()
def has_sleep():
    return hasattr(torch.cuda, "_sleep")
"""


def case_spinning_kernel(ctx):
    """docs/server.md §2.1: a worker killed at its timeout while its kernel still spins may take
    the driver a while to end; its slot is replaced (its next worker's CUDA start under the lease
    is the probe), the GPU is not quarantined, and the next request completes."""
    if not out(*call(ctx.url, SPIN, "has_sleep")):
        raise Skip("this torch has no torch.cuda._sleep to keep a kernel busy")
    started = time.monotonic()
    status, body = call(ctx.url, SPIN, "spin", 1 << 38, options={"timeout_seconds": 3})  # ~2 min at 2 GHz
    answered = time.monotonic() - started
    assert status == 504 and body["error"]["kind"] == "timeout", (status, short(body))
    assert out(*call(ctx.url, LAST_ERROR, "fine")) == 2.0, "the next request did not complete"
    served = time.monotonic() - started
    capacity = json.loads(request("GET", ctx.url + "/health")[2])["load"]["request_capacity"]
    assert capacity == 2, f"the server's capacity fell to {capacity}: the GPU was quarantined"
    ctx.data["spinning_kernel"] = {"answer_s": round(answered, 1), "next_request_s": round(served, 1)}
    return f"504 after {answered:.1f} s; the next request completed {served:.1f} s after the spin began"


FAULT = """
import torch
def fault_then_tensor():
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([1 << 30], device="cuda")] = 1.0  # device-side assert, reported asynchronously
    return x
def fault_in_benchmark():
    from kcoral.builtins import benchmark
    x = torch.zeros(4, device="cuda")
    index = torch.tensor([1 << 30], device="cuda")
    def step():
        x[index] = 1.0
    return benchmark(step, {"warmup": 2, "repeat": 3})
"""


def case_device_faults(ctx):
    seen = []
    for name, kinds in (("fault_then_tensor", {"runtime", "serialization"}),
                        ("fault_in_benchmark", {"runtime"} if ctx.cupti else {"unavailable"})):
        started = time.monotonic()
        status, body = call(ctx.url, FAULT, name)
        assert status == 200 and body["status"] == "FAILED", (name, status, short(body))
        assert body["error"]["kind"] in kinds, (name, body["error"])
        seen.append(f"{name}: {body['error']['kind']} in {time.monotonic() - started:.1f} s")
        assert out(*call(ctx.url, LAST_ERROR, "fine")) == 2.0, "the server did not recover"
    return "; ".join(seen)


FORMULA = """
import time
import torch
from kcoral.builtins import benchmark
def formula(device):
    x = torch.zeros(1 << 12, device=device)
    def step():
        x.add_(1)
    started = time.perf_counter()
    result = benchmark(step)  # no configuration: docs/server.md §5.2 passes an empty dict on to step
    result["seconds"] = time.perf_counter() - started
    if device == "cpu":
        return result
    # docs/server.md §5.2's estimate, made here: one untimed call, then 5 x (flush + call) between two events
    scratch = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.int8, device="cuda")
    scratch.zero_(); step(); torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        scratch.zero_(); step()
    end.record(); end.synchronize()
    estimate = start.elapsed_time(end) / 5
    result.update(estimate_ms=estimate, expected_warmup=max(1, int(25 / estimate)),
                  expected_repeat=max(1, int(100 / estimate)))
    return result
"""


def case_benchmark_formula(ctx):
    if ctx.device == "cpu":  # the same call on the host timer, where the estimate is not ours to repeat
        result = out(*call(ctx.url, FORMULA, "formula", "cpu"))
        warmup, repeat = result["warmup"], result["repeat"]
        # one estimate e gives warmup max(1, int(25 / e)) and repeat max(1, int(100 / e)), whatever e is
        consistent = 4 * warmup <= repeat <= 4 * warmup + 3 if repeat >= 4 else warmup == 1
        assert consistent, f"warmup {warmup} and repeat {repeat} come from no one estimate"
        return f"default budgets on the host timer: warmup {warmup}, repeat {repeat}"
    if not ctx.cupti:
        return "CUPTI unusable here: benchmark answers unavailable (case benchmark)"
    result = out(*call(ctx.url, FORMULA, "formula", "cuda"))
    ctx.data["benchmark_formula"] = result
    for key in ("warmup", "repeat"):
        ratio = result[key] / result[f"expected_{key}"]
        assert 0.5 <= ratio <= 2.0, f"{key} {result[key]} vs the formula's {result[f'expected_{key}']}"
    return (f"estimate {result['estimate_ms'] * 1e3:.1f} us/(flush+call): warmup {result['warmup']} "
            f"(formula {result['expected_warmup']}), repeat {result['repeat']} (formula "
            f"{result['expected_repeat']}), {result['seconds']:.2f} s in benchmark")


# --- phases ---------------------------------------------------------------------------

PROBE = r"""
import json, os, statistics, sys, time
started = time.perf_counter()
import torch
torch_s = time.perf_counter() - started
started = time.perf_counter()
import tvm_ffi
tvm_ffi_s = time.perf_counter() - started
report = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
          "tvm_ffi": tvm_ffi.__version__, "torch_import_s": round(torch_s, 2), "tvm_ffi_import_s": round(tvm_ffi_s, 2),
          "dlpack_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
          "torch_cuda_initialized_after_imports": torch.cuda.is_initialized()}


def forked_context():
    # what a fresh worker costs: a fork of this state, torch.cuda.init() and a tiny op (timed in
    # the child), then its exit, which destroys the context (the rest of the parent's wait)
    read, write = os.pipe()
    forked = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            started = time.perf_counter()
            torch.cuda.init()
            torch.ones(1, device="cuda").sum().item()
            os.write(write, repr(time.perf_counter() - started).encode())
        finally:
            os._exit(0)
    os.close(write)
    created = os.read(read, 64)
    os.close(read)
    os.waitpid(pid, 0)
    total = time.perf_counter() - forked
    return (float(created), total) if created else None


if torch.cuda.is_initialized():
    report["fork_can_use_cuda"] = False
else:
    runs = [forked_context() for _ in range(5)]
    report["fork_can_use_cuda"] = all(runs)
    if all(runs):
        report["forked_context_ms"] = {
            "create_median": round(statistics.median(c for c, _ in runs) * 1e3, 1),
            "fork_to_exit_median": round(statistics.median(t for _, t in runs) * 1e3, 1),
            "exit_median": round(statistics.median(t - c for c, t in runs) * 1e3, 1)}
started = time.perf_counter()
torch.ones(1, device="cuda").sum().item()
report["cuda_context_s"] = round(time.perf_counter() - started, 2)
props = torch.cuda.get_device_properties(0)
report.update(device=props.name, capability=list(torch.cuda.get_device_capability(0)), l2_bytes=props.L2_cache_size,
              devices=torch.cuda.device_count())
print(json.dumps(report))
"""

CUPTI_PROBE = r"""
import importlib.metadata, json
import torch  # first, as in a worker: torch's own libcupti (nvidia-cuda-cupti) is the one loaded
from cupti import cupti
x = torch.ones(1 << 20, device="cuda"); torch.cuda.synchronize()
kinds = []
cupti.activity_register_callbacks(lambda: (8 << 20, 0), lambda activities: kinds.extend(int(a.kind) for a in activities))
cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
(x * 2).sum().item()
cupti.activity_flush_all(1)
cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
cupti.finalize()
print(json.dumps({"cupti_python": importlib.metadata.version("cupti-python"), "cupti_api": getattr(cupti, "get_version", lambda: None)(),
                  "kernel_records": len(kinds)}))
"""

# distributions whose versions explain a device's behaviour (absent ones are reported as such)
DISTRIBUTIONS = ("torch", "cuda-bindings", "cuda-python", "nvidia-cuda-cupti", "nvidia-cuda-cupti-cu13",
                 "nvidia-cuda-cupti-cu12", "cupti-python", "apache-tvm-ffi", "numpy", "ml_dtypes")
TOOLS = ("nvidia-smi", "bwrap", "ncu", "compute-sanitizer", "nvcc", "dpkg")


CUDA_TOOLKITS = ("/usr/local/cuda",)  # where a CUDA toolkit is installed whole


def cuda_home(environ=os.environ, toolkits=CUDA_TOOLKITS):
    """The CUDA toolkit folder to build with -> a path or None.  tvm_ffi.cpp.build takes CUDA_HOME,
    else the folder above `which nvcc`'s, which cannot link -lcudart where nvcc is a wrapper script
    (as on some lent machines).  So: CUDA_HOME as set, else the first of /usr/local/cuda and nvcc's
    real location whose libraries hold libcudart."""
    if environ.get("CUDA_HOME"):
        return environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    found = list(toolkits) + ([os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else [])
    return next((home for home in found if links_cudart(home)), None)


def links_cudart(home):
    return any(glob.glob(os.path.join(home, lib, "libcudart.so*")) for lib in ("lib64", "lib", "targets/*/lib"))


def probe(code, env=None, timeout=120):
    """Run `code` in a fresh interpreter -> (its JSON report or None, stderr tail)."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, **(env or {})}, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    lines = done.stdout.strip().splitlines()
    return (json.loads(lines[-1]) if done.returncode == 0 and lines else None), done.stderr[-1500:]


def distribution_versions():
    """{distribution: version or None} as this interpreter (with the carried wheels) sees them."""
    import importlib.metadata
    versions = {}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def nvidia_smi():
    """The GPUs' name, driver, memory and persistence mode (off: every first CUDA use pays the driver's init)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    return subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,persistence_mode",
                           "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
                          check=False).stdout.strip()


def ensure_cupti(ctx):
    """Whether CUPTI records kernels here, probed once (also for an --only run without preflight)."""
    if ctx.cupti is None:
        cupti_probe, error = probe(CUPTI_PROBE) if ctx.device == "gpu" else (None, "CPU mode")
        ctx.cupti_report = cupti_probe or error
        ctx.cupti = bool(cupti_probe and cupti_probe["kernel_records"] > 0)
    return ctx.cupti


def phase_preflight(ctx):
    """The environment itself, so its failures are not mistaken for server bugs: versions, tools,
    and (GPU) whether a fork after our imports can use CUDA, its context's cost, CUPTI."""
    ctx.data["versions"] = distribution_versions()
    ctx.data["tools"] = {tool: shutil.which(tool) for tool in TOOLS}
    ctx.data["carried_debs"] = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ctx.wheels, "*.deb")))
    ctx.data["nvidia_smi"] = nvidia_smi()
    ctx.data["python"] = sys.version.split()[0]
    ctx.data["cuda_home"] = os.environ.get("CUDA_HOME")
    found = ", ".join(tool for tool, path in ctx.data["tools"].items() if path) or "none"
    versions = ", ".join(f"{name} {version}" for name, version in ctx.data["versions"].items() if version)
    recorded = f"Python {ctx.data['python']}; recorded {versions}; tools found: {found}; CUDA_HOME {ctx.data['cuda_home']}"
    if ctx.dry_run:
        raise Skip(f"dry run: stops before its first CUDA call (the torch/tvm_ffi fork probe); {recorded}")
    if ctx.device == "cpu":
        raise Skip(f"CUDA probes need a GPU; {recorded}")
    # as a user's script would import them; a cold tvm-ffi cache may build its torch add-on here (cached after)
    plain_probe, error = probe(PROBE, timeout=120)
    ctx.data["imports_plain"] = plain_probe or error
    nvml_probe, error = probe(PROBE, {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}, timeout=60)  # as our templates do
    ctx.data["imports_as_template"] = nvml_probe or error
    assert nvml_probe, f"torch/tvm_ffi probe failed: {error}"
    assert nvml_probe["fork_can_use_cuda"] and not nvml_probe["torch_cuda_initialized_after_imports"], nvml_probe
    ensure_cupti(ctx)
    ctx.data["cupti"] = ctx.cupti_report
    return (f"{nvml_probe['device']} ({ctx.data['nvidia_smi']}); {versions}; tools: {found}; "
            f"imports {nvml_probe['torch_import_s']} + {nvml_probe['tvm_ffi_import_s']} s; "
            f"forked context {nvml_probe['forked_context_ms']} ms "
            f"(without NVML check a fork can use CUDA: {plain_probe and plain_probe['fork_can_use_cuda']}); "
            f"CUPTI {'ok' if ctx.cupti else 'UNUSABLE: ' + str(ctx.cupti_report)[-200:]}")


TINY = {"gpu": "def f():\n    import torch\n    return torch.ones(1, device='cuda').sum().item()\n",
        "cpu": "def f():\n    return 1.0\n"}


def back_to_back(ctx, name, *flags, count=20):
    """`count` trivial requests, each sent as soon as the last one answered -> medians.  With a fresh
    worker per request the slot is down while its replacement starts (off the answer's path), so
    the next request's queue_ms is that slot downtime; the first request found its worker ready."""
    rows = []
    with started_server(ctx, name, *flags, device=ctx.device, workers=1) as server:  # one slot, as one GPU has
        for _ in range(count):
            sent = time.monotonic()
            body = completed(*call(server.url, TINY[ctx.device], "f"))
            rows.append({"client_ms": (time.monotonic() - sent) * 1e3, "queue_ms": body["queue_ms"],
                         "elapsed_ms": body["elapsed_ms"], "lease_held_ms": body["lease_held_ms"]})
    medians = {key: round(statistics.median(row[key] for row in rows[1:]), 1) for key in rows[0]}
    medians["slot_downtime_ms_max"] = round(max(row["queue_ms"] for row in rows[1:]), 1)
    ctx.data[name] = {"median_after_first": medians, "requests": rows}
    return medians


def phase_request_overhead(ctx):
    """20 back-to-back trivial requests on fresh workers (the default) and on reused ones."""
    fresh = back_to_back(ctx, "fresh_workers")
    reused = back_to_back(ctx, "reused_workers", "--max-requests-per-worker", "0")
    return (f"medians: fresh workers client {fresh['client_ms']} ms, elapsed {fresh['elapsed_ms']} ms, "
            f"slot downtime (next queue_ms) {fresh['queue_ms']} ms (max {fresh['slot_downtime_ms_max']}); "
            f"reused workers client {reused['client_ms']} ms, elapsed {reused['elapsed_ms']} ms, "
            f"queue {reused['queue_ms']} ms")


def phase_cpu_mode(ctx):
    """A CPU server on a CUDA host: its template never called cuInit, so workers can still use CUDA."""
    source = ("import os\n"
              "def f():\n"
              "    import torch\n"
              "    before = torch.cuda.is_initialized()\n"
              "    return [before, torch.cuda.is_available(), torch.ones(2, device='cuda').sum().item()]\n")
    with started_server(ctx, "cpu", device="cpu") as server:
        result = out(*call(server.url, source, "f"))
    assert result == [False, True, 2.0], result
    return "a CPU worker forked from the template used CUDA"


def build_library(ctx):
    """The add_one TVM-FFI library for the server's target (CUDA: compiled by this machine's nvcc), once."""
    if ctx.library is not None or ctx.library_error:
        return
    compiler = "nvcc" if ctx.device == "gpu" else os.environ.get("CXX", "c++")  # what tvm_ffi.cpp.build runs
    home = os.environ.get("CUDA_HOME")
    if not (shutil.which(compiler) or compiler == "nvcc" and home and os.path.exists(os.path.join(home, "bin", "nvcc"))):
        ctx.library_error = Skip(f"no {compiler} here to build the TVM-FFI library")
        return
    try:
        ctx.library = build_add_one(ctx.device, ctx.health["target"].get("arch"))
    except Exception as exc:
        ctx.library = None
        ctx.library_error = f"building the library failed: {type(exc).__name__}: {str(exc)[-400:]}"


def phase_main_server(ctx):
    cases = GPU_CASES if ctx.device == "gpu" else CPU_CASES
    # two reused workers: cases reach each of them by overlapping two requests (worker_pids)
    flags = ["--max-requests-per-worker", "0"] + (["--workers-per-gpu", "2"] if ctx.device == "gpu" else [])
    ensure_cupti(ctx)
    # torchrun variables in the server's environment must not reach GPU workers
    with started_server(ctx, "main", *flags, device=ctx.device,
                        env={"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1"}) as server:
        ctx.url, ctx.health = server.url, server.health()
        build_library(ctx)
        failures = [case.__name__.removeprefix("case_") for case in cases if not run_case(ctx, case)]
    assert not failures, f"failed: {failures}"
    return f"{len(cases)} cases"


CLI_COMMAND_TIMEOUT = 40  # seconds per `kcoral run` command: one stuck tool cannot take the run


def phase_cli_tools(ctx):
    """`kcoral run python`, `ncu` and `compute-sanitizer` as a user types them (a tool missing on
    this box must give its one-line answer instead), each bounded by CLI_COMMAND_TIMEOUT."""
    scratch = tempfile.mkdtemp(prefix="kcoral-cli-")
    with started_server(ctx, "cli", device=ctx.device) as server:
        checks = cli_tool_checks(server.url, scratch, timeout=CLI_COMMAND_TIMEOUT)
    for name, ok, detail in checks:
        ctx.cases[name] = {"result": PASS if ok else FAIL, "detail": detail[:2000]}
        print(f"{PASS if ok else FAIL} {name}: {detail[:300]}", flush=True)
    failed = [name for name, ok, _ in checks if not ok]
    assert not failed, f"failed: {failed}"
    return f"{len(checks)} kcoral run checks"


SANDBOX_NODES = """
import os
def nodes():
    return sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
def proc_gpus():
    gpus = "/proc/driver/nvidia/gpus"
    return sorted(os.listdir(gpus)) if os.path.isdir(gpus) else None
"""

BWRAP_LIBRARIES = ("libcap2", "libselinux1", "libpcre2-8-0")  # what bwrap links beyond libc (see fetch_wheels.sh)


def unpacked_bwrap(folder):
    """bwrap from the carried bubblewrap.deb, unpacked with `dpkg -x` -> a bin folder holding `bwrap`.
    When the machine lacks a library bwrap links, `bwrap` is instead a wrapper that starts the real
    one through the dynamic loader with the carried libraries: only bwrap sees them, not the
    programs it starts (LD_LIBRARY_PATH would reach those)."""
    deb = os.path.join(folder, "bubblewrap.deb")
    if not os.path.isfile(deb):
        raise Skip(f"no bwrap on PATH and no {deb} (run bench/fetch_wheels.sh here, carry bench/wheels)")
    if not shutil.which("dpkg"):
        raise Skip(f"no bwrap on PATH, and no dpkg to unpack {deb}")
    root = tempfile.mkdtemp(prefix="kcoral-bwrap-")
    subprocess.run(["dpkg", "-x", deb, root], check=True, timeout=60)
    binary = os.path.join(root, "usr", "bin", "bwrap")
    missing = [line.split()[0] for line in linked(binary) if "not found" in line]
    if not missing:
        return os.path.dirname(binary)
    for package in BWRAP_LIBRARIES:
        library = os.path.join(folder, f"{package}.deb")
        if os.path.isfile(library):
            subprocess.run(["dpkg", "-x", library, root], check=True, timeout=60)
    libraries = ":".join(os.path.join(root, d) for d in ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"))
    loader = "/lib64/ld-linux-x86-64.so.2"
    wrapper_dir = os.path.join(root, "wrapped")
    os.makedirs(wrapper_dir)
    with open(os.path.join(wrapper_dir, "bwrap"), "w") as f:
        f.write(f'#!/bin/sh\nexec {loader} --library-path {libraries} {binary} "$@"\n')
    os.chmod(os.path.join(wrapper_dir, "bwrap"), 0o755)
    return wrapper_dir


def linked(binary):
    """ldd's lines for `binary` (none when there is no ldd: then only trying it tells)."""
    if not shutil.which("ldd"):
        return []
    return subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=30, check=False).stdout.splitlines()


def bwrap_folder(ctx):
    """The folder whose `bwrap` the sandboxed server uses (--bwrap says where from), or Skip."""
    if ctx.bwrap == "none":
        raise Skip("no bwrap (--bwrap none)")
    system = shutil.which("bwrap")
    folder = os.path.dirname(system) if system and ctx.bwrap == "auto" else unpacked_bwrap(ctx.wheels)
    ctx.data["bwrap"] = os.path.join(folder, "bwrap")
    # the least any container needs; failing it is this machine's limit (user namespaces), not ours
    tried = subprocess.run([ctx.data["bwrap"], "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/",
                            "true"], capture_output=True, text=True, timeout=30, check=False)
    if tried.returncode != 0:
        raise Skip(f"{ctx.data['bwrap']} cannot create a container here: {tried.stderr.strip()[-300:]}")
    return folder


def phase_sandboxed(ctx):
    """The main program kinds again under `--sandbox bubblewrap` (docs/sandbox.md), and the device
    nodes a sandboxed worker sees: its own GPU's and the control nodes, nothing else."""
    folder = bwrap_folder(ctx)
    cases = ([case_pinning] if ctx.device == "gpu" else []) + [case_tensors, case_library, case_benchmark,
                                                                case_gpu_count]
    ensure_cupti(ctx)
    path = folder + os.pathsep + os.environ.get("PATH", "")  # this server's only: others stay unsandboxed
    with started_server(ctx, "sandboxed", "--sandbox", "bubblewrap", device=ctx.device, env={"PATH": path}) as server:
        ctx.url, ctx.health = server.url, server.health()
        build_library(ctx)
        failures = [case.__name__.removeprefix("case_") for case in cases if not run_case(ctx, case)]
        nodes = out(*call(server.url, SANDBOX_NODES, "nodes"))
        proc_gpus = out(*call(server.url, SANDBOX_NODES, "proc_gpus"))
    gpus = [n for n in nodes if re.fullmatch(r"nvidia\d+", n)]
    control = {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps"}
    assert len(gpus) == (1 if ctx.device == "gpu" else 0) and set(nodes) - set(gpus) <= control, nodes
    if ctx.device == "gpu":  # the driver's view of other GPUs is hidden as their nodes are
        assert proc_gpus is not None and len(proc_gpus) == 1, f"/proc/driver/nvidia/gpus inside: {proc_gpus}"
    assert not failures, f"failed: {failures}"
    return (f"bwrap {ctx.data['bwrap']}; {len(cases)} cases; device nodes inside: {nodes}; "
            f"/proc/driver/nvidia/gpus inside: {proc_gpus}")


EXAMPLE_TIMEOUT = 60  # seconds per example script


def gpu_examples():
    """examples/*.py whose first comment line is `# requires: gpu`."""
    chosen = []
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            comments = [line.strip() for line in f if line.startswith("#") and not line.startswith("#!")]
        if comments and comments[0] == "# requires: gpu":
            chosen.append(path)
    return chosen


def phase_examples(ctx):
    """Every GPU example run as a user would, against a default server named by KCORAL_URL."""
    examples = gpu_examples()
    if not examples:
        raise Skip("no examples/*.py whose first comment line is `# requires: gpu`")
    if ctx.device != "gpu":
        raise Skip(f"{len(examples)} example(s) need a GPU")
    with started_server(ctx, "examples", device=ctx.device) as server:
        env = {**os.environ, "KCORAL_URL": server.url, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for path in examples:
            run_case(ctx, example_case(path, env))
    failures = [name for name, case in ctx.cases.items() if case["result"] == FAIL]
    assert not failures, f"failed: {failures}"
    return f"{len(examples)} example(s)"


def example_case(path, env):
    """A case that runs one example script; its name is the file's."""
    def case(ctx):
        try:
            done = subprocess.run([sys.executable, path], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=EXAMPLE_TIMEOUT, check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {EXAMPLE_TIMEOUT} s") from None
        tail = (done.stdout + done.stderr).strip()[-300:]
        assert done.returncode == 0, f"exit {done.returncode}: {tail}"
        return tail.splitlines()[-1] if tail else "exit 0"
    case.__name__ = "case_" + os.path.relpath(path, ROOT)
    return case


def run_case(ctx, case):
    """Run one case unless the phase is out of time; its outcome goes to ctx.cases -> passed (or skipped)."""
    name = case.__name__.removeprefix("case_")
    started = time.monotonic()
    if started > ctx.deadline:
        ctx.cases[name] = {"result": SKIP, "detail": "out of the phase's time budget"}
        print(f"SKIP {name}: out of the phase's time budget", flush=True)
        return True

    def work():
        if name in ("library", "library_errors", "benchmark") and ctx.library is None:
            raise ctx.library_error if isinstance(ctx.library_error, Skip) else AssertionError(ctx.library_error)
        return case(ctx)

    detail, result = attempt(name, work, traceback_limit=3)
    ctx.cases[name] = {"result": result, "detail": str(detail)[:2000], "seconds": round(time.monotonic() - started, 1)}
    return result != FAIL


PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class Skip(Exception):
    """What this machine cannot check (no GPU, no bwrap, no examples): reported with its reason, never a failure."""


def attempt(label, work, traceback_limit):
    """Run one case or phase and print its PASS/FAIL/SKIP line -> (detail, result); a failed
    assertion is a finding, any other exception also gets its traceback."""
    try:
        detail = work()
        print(f"{PASS} {label}: {detail}", flush=True)
        return detail, PASS
    except Skip as exc:
        print(f"{SKIP} {label}: {exc}", flush=True)
        return str(exc), SKIP
    except Exception as exc:
        print(f"{FAIL} {label}: {type(exc).__name__}: {exc}", flush=True)
        if not isinstance(exc, AssertionError):
            traceback.print_exc(limit=traceback_limit)
        return f"{type(exc).__name__}: {exc}", FAIL


SERVER_LOGS = "servers.log"  # every server's log in one file: a lent device brings back at most 8


class started_server:
    """A ServerProcess whose log is appended to --out's servers.log, under a line naming it."""

    def __init__(self, ctx, name, *flags, **kwargs):
        self.ctx, self.name = ctx, name
        # the template's one-time preparation is bounded well inside the run's 7 minutes
        self.server = ServerProcess("--prepare-timeout-seconds", "120", *flags, ready_timeout=180, **kwargs)

    def __enter__(self):
        return self.server

    def __exit__(self, *exc):
        self.server.stop()
        if self.ctx.out:
            with open(self.server.stderr_path, "rb") as log, open(os.path.join(self.ctx.out, SERVER_LOGS), "ab") as f:
                f.write(f"===== server {self.name} ({self.server.url}) =====\n".encode())
                shutil.copyfileobj(log, f)


GPU_CASES = [case_pinning, case_health, case_tensors, case_layouts, case_library, case_library_errors,
             case_benchmark, case_benchmark_formula, case_compile_tirx, case_lease_timings, case_cpu_only,
             case_gpu_access, case_gpu_count, case_last_error, case_memory_released, case_hang,
             case_device_faults, case_poisoned_worker, case_spinning_kernel]  # last: a quarantine would end the server
CPU_CASES = [case_health, case_tensors, case_library, case_library_errors, case_benchmark, case_benchmark_formula,
             case_compile_tirx, case_lease_timings, case_cpu_only, case_gpu_count, case_both_workers]

# (name, function, devices it runs on, seconds after which it starts no further case).  On an
# H200 the budgets add up to the run's default --budget-s, so a full run ends within 6 minutes.
PHASES = [
    ("preflight", phase_preflight, ("gpu", "cpu"), 40),
    ("request_overhead", phase_request_overhead, ("gpu", "cpu"), 50),
    ("cpu_mode", phase_cpu_mode, ("gpu",), 15),
    ("main_server", phase_main_server, ("gpu", "cpu"), 110),
    ("cli_tools", phase_cli_tools, ("gpu", "cpu"), 40),
    ("sandboxed", phase_sandboxed, ("gpu", "cpu"), 30),
    ("examples", phase_examples, ("gpu", "cpu"), 15),
]
PHASE_NAMES = [name for name, *_ in PHASES]


class Context:
    """What phases share: the device, CUPTI's state, the current server, figures for the report."""

    def __init__(self, device, out, wheels, bwrap, dry_run=False):
        self.device, self.out, self.wheels, self.bwrap = device, out, wheels, bwrap
        self.dry_run = dry_run  # a --device gpu run simulated on CPU: device is "cpu"
        self.deadline = float("inf")  # the running phase's: no case starts after it
        self.cupti = None  # None until probed (preflight, or the first phase that needs to know)
        self.library, self.library_error = None, None  # built once, by the first phase with a server
        self.arch_list_env = os.environ.get("TVM_FFI_CUDA_ARCH_LIST")
        self.data, self.cases = {}, {}


def write_report(ctx, report):
    if ctx.out:
        with open(os.path.join(ctx.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)


def chosen_phases(only):
    """--only's comma-separated names, checked, in PHASES order (all phases without it)."""
    if not only:
        return PHASE_NAMES
    names = only.split(",")
    unknown = sorted(set(names) - set(PHASE_NAMES))
    if unknown:
        raise SystemExit(f"gpu_check: unknown phase(s) {unknown}; phases: {','.join(PHASE_NAMES)}")
    return [name for name in PHASE_NAMES if name in names]


def run_phase(ctx, name, phase, devices, budget, run_deadline):
    """One phase within its budget (and the run's) -> its report entry; prints its wall time."""
    started = time.monotonic()
    ctx.data, ctx.cases = {}, {}
    ctx.deadline = min(started + budget, run_deadline)
    label = f"phase {name}"

    def work():
        if ctx.device not in devices:
            raise Skip("dry run: needs a CUDA device" if ctx.dry_run else
                       f"needs a CUDA device (this is a --device {ctx.device} run)")
        if started >= run_deadline:
            raise Skip("out of the run's time budget (--budget-s)")
        return phase(ctx)

    detail, result = attempt(label, work, traceback_limit=5)
    seconds = round(time.monotonic() - started, 1)
    over = " -- OVER BUDGET" if seconds > budget else ""
    print(f"  {label}: {seconds} s of its {budget} s budget{over}", flush=True)
    return {"result": result, "detail": str(detail)[:2000], "data": ctx.data, "cases": ctx.cases,
            "seconds": seconds, "budget_s": budget}


def tally(report):
    """Counts of PASS/FAIL/SKIP over cases, and over phases that have none (or failed outside them)."""
    counts = {PASS: 0, FAIL: 0, SKIP: 0}
    for phase in report["phases"].values():
        results = [case["result"] for case in phase["cases"].values()]
        if not results or phase["result"] == FAIL and FAIL not in results:
            results.append(phase["result"])
        for result in results:
            counts[result] += 1
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json and server logs")
    parser.add_argument("--wheels", help="folder of wheels to install first (done before imports), and of the "
                                         "bubblewrap .debs the sandboxed phase unpacks when bwrap is not on PATH")
    parser.add_argument("--only", help=f"comma-separated phases to run, of {','.join(PHASE_NAMES)}")
    parser.add_argument("--bwrap", choices=("auto", "carried", "none"), default="auto",
                        help="the sandboxed phase's bwrap: PATH's, else the carried .deb (auto); only the .deb "
                             "(carried); none, so that the phase skips (checks the skip)")
    parser.add_argument("--budget-s", type=float, default=300,
                        help="start no phase or case after this many seconds (the whole run stays within 6 minutes)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    phases = chosen_phases(args.only)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # this run's servers only
            os.remove(os.path.join(args.out, SERVER_LOGS))
    dry_run = args.device == "gpu" and os.environ.get(DRY_RUN_VARIABLE) == "1"
    if dry_run:
        print(f"DRY RUN ({DRY_RUN_VARIABLE}=1): a --device gpu run on CPU servers; it makes no CUDA call", flush=True)
    if args.device == "gpu" and cuda_home():  # inherited by the servers, their workers and our builds
        os.environ["CUDA_HOME"] = cuda_home()
    ctx = Context("cpu" if dry_run else args.device, args.out, args.wheels or os.path.join(ROOT, "bench", "wheels"),
                  args.bwrap, dry_run)
    report = {"device": args.device, "dry_run": dry_run, "phases": {}}
    for name, phase, devices, budget in PHASES:
        if name in phases:
            report["phases"][name] = run_phase(ctx, name, phase, devices, budget, started + args.budget_s)
            report["seconds"] = round(time.monotonic() - started, 1)
            write_report(ctx, report)
    counts = tally(report)
    report.update(passed=counts[PASS], failed=counts[FAIL], skipped=counts[SKIP])
    write_report(ctx, report)
    print("per-phase wall time: " + ", ".join(f"{name} {entry['seconds']} s" for name, entry in report["phases"].items()))
    print(f"({args.device} mode{', DRY RUN on CPU' if dry_run else ''}, {time.monotonic() - started:.0f} s)")
    print(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped")
    return 1 if counts[FAIL] else 0


if __name__ == "__main__":
    sys.exit(main())
