"""GPU runtime (issue 4), everything whose logic needs no CUDA device.

Over HTTP against a real `python -m kcoral --device cpu`: a TVM-FFI library
built here with tvm_ffi.cpp.build and called on CPU tensors, library load and
export errors, the host-timer benchmark, compile_tirx without tvm.  In
process: the lease arbiter (FIFO, "any n GPUs", history), an Execution
talking to a scripted fake worker over a real pipe (lease timings, a dead
holder's lease freed, poisoned workers retired, gpu_access attribution),
GpuLease's decision table, the cpu_only guard and CUPTI span arithmetic with
a fake `cupti` module.  Finally bench/gpu_check.py in CPU mode.
"""

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import types

import numpy
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import kcoral
import kcoral_worker
from tests.support import ServerProcess, post, sha256


# --- over HTTP: libraries, benchmark, compile_tirx -------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path=tmp_path_factory.mktemp("gpu-runtime")) as srv:
        yield srv


@pytest.fixture(scope="module")
def add_one_library():
    """The C++ add_one kernel built with tvm_ffi.cpp.build (cached under the temp dir)."""
    from bench import gpu_check
    return gpu_check.build_add_one("cpu")


def library_program(library, name="add_one", n=6):
    x = numpy.arange(n, dtype="<f4")
    program = {"instructions": [
        {"op": "upload", "id": "lib", "kind": "library", "blob": sha256(library)},
        {"op": "get_function", "id": "fn", "module": {"$ref": "lib"}, "name": name},
        {"op": "upload", "id": "x", "kind": "tensor", "blob": sha256(x.tobytes()), "dtype": "float32", "shape": [n]},
        {"op": "upload", "id": "y", "kind": "tensor", "blob": sha256(bytes(4 * n)), "dtype": "float32", "shape": [n]},
        {"op": "run", "id": "r", "fn": {"$ref": "fn"}, "args": [{"$ref": "x"}, {"$ref": "y"}]},
        {"op": "return", "key": "y", "value": {"$ref": "y"}}]}
    return program, [library, x.tobytes(), bytes(4 * n)], x


def test_library_called_on_cpu_tensors(server, add_one_library):
    program, blobs, x = library_program(add_one_library)
    status, _, body = post(server.url, program, blobs)
    assert status == 200 and body["status"] == "COMPLETED", body
    encoded = body["results"]["y"]
    assert (encoded["type"], encoded["dtype"], encoded["shape"]) == ("tensor", "float32", [6])
    assert numpy.array_equal(numpy.frombuffer(body["_parts"][encoded["part"]], "<f4"), x + 1)


def test_library_without_the_export_fails_compile(server, add_one_library):
    program, blobs, _ = library_program(add_one_library, name="add_two")
    status, _, body = post(server.url, program, blobs)
    assert body["status"] == "FAILED", body
    error = body["error"]
    assert (error["kind"], error["instruction_op"], error["instruction_id"]) == ("compile", "get_function", "fn")
    assert "add_two" in error["message"]


def test_garbage_library_fails_compile(server):
    garbage = b"\x7fELF\x02\x01\x01" + bytes(200)
    program = {"instructions": [{"op": "upload", "id": "lib", "kind": "library", "blob": sha256(garbage)}]}
    status, _, body = post(server.url, program, [garbage])
    assert body["status"] == "FAILED", body
    assert (body["error"]["kind"], body["error"]["instruction_id"]) == ("compile", "lib")


def run_source(server, source, args=()):
    program = {"instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": source},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": list(args)},
        {"op": "return", "key": "out", "value": {"$ref": "r"}}]}
    status, _, body = post(server.url, program)
    assert status == 200, body
    return body


def plain(encoded):
    if encoded["type"] == "object":
        return {k: plain(v) for k, v in encoded["value"].items()}
    return encoded.get("value")


def test_host_benchmark_fields(server):
    body = run_source(server, "from kcoral.builtins import benchmark\n"
                              "def f():\n"
                              "    counted = benchmark(lambda a, b: a + b, 1, 2, {'warmup': 3, 'repeat': 7})\n"
                              "    budgeted = benchmark(lambda: sum(range(100)), {'warmup_ms': 2, 'repeat_ms': 10,"
                              " 'flush_l2': False})\n"
                              "    return {'counted': counted, 'budgeted': budgeted}\n")
    assert body["status"] == "COMPLETED", body
    results = plain(body["results"]["out"])
    counted, budgeted = results["counted"], results["budgeted"]
    assert set(counted) == {"latency_ms_median", "latency_ms_mean", "latency_ms_min", "latency_ms_max",
                            "activities_stable", "flush_l2", "warmup", "repeat", "timer"}
    assert 0 < counted["latency_ms_min"] <= counted["latency_ms_median"] <= counted["latency_ms_max"]
    assert counted["latency_ms_min"] <= counted["latency_ms_mean"] <= counted["latency_ms_max"]
    assert (counted["warmup"], counted["repeat"], counted["flush_l2"]) == (3, 7, True)
    assert counted["timer"] == "host" and counted["activities_stable"] is False  # not measured: never claimed
    assert budgeted["flush_l2"] is False and budgeted["warmup"] >= 1 and budgeted["repeat"] >= 1
    assert body["lease_wait_ms"] == 0.0 and body["lease_held_ms"] == 0.0  # CPU servers have no lease


def test_benchmark_rejects_a_non_callable(server):
    body = run_source(server, "from kcoral.builtins import benchmark\ndef f():\n    return benchmark(42)\n")
    assert body["status"] == "FAILED" and body["error"]["kind"] == "runtime", body


@pytest.mark.skipif(__import__("importlib").util.find_spec("tvm") is not None, reason="tvm is installed")
def test_compile_tirx_without_tvm_is_unavailable(server):
    body = run_source(server, "from kcoral.builtins import compile_tirx\ndef f():\n    return compile_tirx(None)\n")
    assert body["status"] == "FAILED", body
    assert body["error"]["kind"] == "unavailable" and "tvm" in body["error"]["message"]


def test_cpu_only_has_no_effect_on_cpu_workers(server):
    program = {"instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": "def f():\n    return 7\n"},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f", "cpu_only": True},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}},
        {"op": "return", "key": "out", "value": {"$ref": "r"}}]}
    status, _, body = post(server.url, program)
    assert body["status"] == "COMPLETED" and body["results"]["out"]["value"] == 7, body


# --- the lease arbiter ---------------------------------------------------------------

def acquire_in_thread(arbiter, owner, order, **kwargs):
    def take():
        granted, _ = arbiter.acquire(owner, **kwargs)
        order.append((owner, granted))
    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


def queued(arbiter):
    with arbiter.cond:
        return len(arbiter.queue)


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_lease_waiters_are_served_in_arrival_order():
    arbiter, order = kcoral.LeaseArbiter([0, 1]), []
    arbiter.acquire("a", [0])
    threads = []
    for n, owner in enumerate(["b", "c", "d"]):
        threads.append(acquire_in_thread(arbiter, owner, order, gpus=[0]))
        wait_until(lambda: queued(arbiter) == n + 1)
    arbiter.acquire("other-gpu", [1])  # a different GPU is not held up by GPU 0's queue
    for owner in ["a", "b", "c"]:
        arbiter.release(owner, [0])
        wait_until(lambda: arbiter.holder[0] not in (None, owner))
    arbiter.release("d", [0])
    for thread in threads:
        thread.join(5)
    assert [owner for owner, _ in order] == ["b", "c", "d"]


def test_identical_waiters_do_not_lose_their_tickets():
    arbiter, order = kcoral.LeaseArbiter([0]), []
    arbiter.acquire(kcoral.STARTUP_OWNER, [0])
    threads = [acquire_in_thread(arbiter, kcoral.STARTUP_OWNER, order, gpus=[0])]
    wait_until(lambda: queued(arbiter) == 1)
    threads.append(acquire_in_thread(arbiter, kcoral.STARTUP_OWNER, order, gpus=[0]))
    wait_until(lambda: queued(arbiter) == 2)
    for _ in range(3):
        arbiter.release(kcoral.STARTUP_OWNER, [0])
        time.sleep(0.05)
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()
    assert len(order) == 2


def test_any_n_gpus_blocks_later_waiters_until_it_is_served():
    arbiter, order = kcoral.LeaseArbiter([0, 1, 2]), []
    arbiter.acquire("busy", [0])
    big = acquire_in_thread(arbiter, "big", order, count=3)
    wait_until(lambda: queued(arbiter) == 1)
    small = acquire_in_thread(arbiter, "small", order, gpus=[2])  # GPU 2 is free, but "big" came first
    wait_until(lambda: queued(arbiter) == 2)
    time.sleep(0.1)
    assert order == [] and arbiter.holder[2] is None
    arbiter.release("busy", [0])
    big.join(5)
    assert order == [("big", [0, 1, 2])]
    arbiter.release("big", [0, 1, 2])
    small.join(5)
    assert order[-1] == ("small", [2])


def test_any_n_gpus_takes_the_first_free_ones_in_configured_order():
    arbiter = kcoral.LeaseArbiter([3, 1, 2])
    arbiter.acquire("x", [1])
    granted, wait_ms = arbiter.acquire("y", count=2)
    assert granted == [3, 2] and wait_ms >= 0


def test_holder_at_reads_the_lease_history():
    arbiter = kcoral.LeaseArbiter([0])
    before = time.time()
    arbiter.acquire("r1", [0])
    during = time.time()
    arbiter.release("r1", [0])
    after = time.time() + 1
    assert arbiter.holder_at([0], during) == "r1"
    assert arbiter.holder_at([0], before - 1) is None
    assert arbiter.holder_at([0], after) is None


# --- an Execution against a scripted worker -----------------------------------------

class FakeProcess:
    exitcode = 0

    def join(self, timeout=None):
        pass


class FakeWorker:
    """The front-end's view of a worker whose other pipe end a test thread plays."""

    def __init__(self, conn):
        self.conn = conn
        self.pid = 4194000  # no such process group: group_members() finds nobody
        self.served = 0
        self.process = FakeProcess()
        self.killed = False

    def kill(self, grace, orphans=False):
        self.killed = True
        self.conn.close()


def fake_pool(gpus=(0,)):
    config = kcoral.ServerConfig(max_requests_per_worker=0, worker_termination_grace_seconds=0.1)
    return types.SimpleNamespace(config=config, arbiter=kcoral.LeaseArbiter(list(gpus)))


def execution(pool, script, timeout=10.0, request_id="req-1", gpus=(0,)):
    """Run an Execution whose worker follows `script(conn)` in a thread -> (Outcome, retire, worker)."""
    ours, theirs = multiprocessing.Pipe()
    worker = FakeWorker(ours)
    instructions = [{"op": "upload", "id": "m", "kind": "module", "source": ""},
                    {"op": "run", "id": "r", "fn": {"$ref": "m"}}]
    program = kcoral.ValidProgram(instructions, {}, {}, [])
    job = kcoral.Job(request_id, program, {}, timeout=timeout, output_limit=0)

    def play():
        theirs.recv()  # the request
        try:
            script(theirs)
        except (EOFError, OSError):
            pass
    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    outcome, retire = kcoral.Execution(pool, worker, list(gpus), job, 0.0).run()
    thread.join(5)
    theirs.close()
    return outcome, retire, worker


def acquire(conn):
    conn.send(("lease", "acquire"))
    assert conn.recv() == ("lease", "granted")


def test_lease_timings_add_up_around_a_cpu_only_release():
    pool = fake_pool()
    pool.arbiter.acquire("someone-else", [0])
    threading.Timer(0.5, pool.arbiter.release, ("someone-else", [0])).start()

    def script(conn):
        conn.send(("start", 0))
        acquire(conn)               # waits ~0.5 s for someone-else
        time.sleep(0.2)
        conn.send(("lease", "release"))  # a cpu_only run: 0.3 s without the lease
        conn.send(("start", 1))
        time.sleep(0.3)
        acquire(conn)
        time.sleep(0.1)
        conn.send(("done", None, False))

    outcome, retire, _ = execution(pool, script, timeout=0.85)  # lease waits do not consume the timeout
    body = outcome.body
    assert body["status"] == "COMPLETED" and not retire, outcome
    assert 450 <= body["lease_wait_ms"] <= 900, body
    assert 280 <= body["lease_held_ms"] <= 600, body
    assert body["lease_wait_ms"] + body["lease_held_ms"] <= body["elapsed_ms"], body
    assert body["elapsed_ms"] >= body["lease_wait_ms"] + body["lease_held_ms"] + 250  # the unleased 0.3 s
    assert pool.arbiter.holder[0] is None


def test_a_dead_holders_lease_is_freed():
    pool = fake_pool()

    def script(conn):
        conn.send(("start", 1))
        acquire(conn)
        conn.close()  # the worker dies holding the lease

    outcome, retire, worker = execution(pool, script)
    assert retire and worker.killed
    error = outcome.body["error"]
    assert (error["kind"], error["instruction_index"], error["traceback"]) == ("runtime", 1, "")
    assert pool.arbiter.holder[0] is None
    granted, wait_ms = pool.arbiter.acquire("next", [0])
    assert granted == [0] and wait_ms < 100


def test_a_timed_out_worker_is_killed_under_the_lease():
    pool, seen = fake_pool(), {}

    def script(conn):
        conn.send(("start", 0))
        time.sleep(1)  # hangs without the lease (say, in a cpu_only run)

    original_kill = FakeWorker.kill

    def kill(self, grace, orphans=False):
        seen["holder"] = pool.arbiter.holder[0]
        original_kill(self, grace, orphans)

    FakeWorker.kill = kill
    try:
        outcome, retire, _ = execution(pool, script, timeout=0.2)
    finally:
        FakeWorker.kill = original_kill
    assert outcome.http_status == 504 and retire
    assert seen["holder"] == "req-1" and pool.arbiter.holder[0] is None


def test_a_poisoned_worker_is_retired():
    pool = fake_pool()

    def script(conn):
        conn.send(("start", 0))
        acquire(conn)
        conn.send(("done", None, True))

    outcome, retire, _ = execution(pool, script)
    assert outcome.body["status"] == "COMPLETED" and retire


def gpu_access_error(when):
    return {"kind": "gpu_access", "message": "cpu_only function called cudaMalloc at <uploaded:x>:3 in f",
            "instruction_index": 1, "instruction_op": "run", "instruction_id": "r", "traceback": "...",
            "cuda_call": "cudaMalloc", "location": "<uploaded:x>:3 in f", "lease_time": when}


@pytest.mark.parametrize("holder, expected", [("other-request", "other-request"), (None, None),
                                              ("req-1", None), (kcoral.STARTUP_OWNER, None)])
def test_gpu_access_names_the_request_that_held_the_gpu(holder, expected):
    pool = fake_pool()
    if holder:
        pool.arbiter.acquire(holder, [0])
    when = time.time()
    if holder:
        pool.arbiter.release(holder, [0])

    def script(conn):
        conn.send(("start", 1))
        conn.send(("done", gpu_access_error(when), False))

    outcome, _, _ = execution(pool, script)
    error = outcome.body["error"]
    assert set(error) == {"kind", "message", "instruction_index", "instruction_op", "instruction_id",
                          "traceback", "cuda_call", "location", "interfered_request_id"}
    assert error["interfered_request_id"] == expected


# --- the worker side ----------------------------------------------------------------

class FakeConn:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)

    def recv(self):
        return ("lease", "granted")


LEASE_TABLE = [
    ({"op": "upload", "kind": "file", "id": "u", "path": "a"}, "release"),
    ({"op": "return", "key": "k", "kind": "file", "path": "a"}, "release"),
    ({"op": "return", "key": "k", "kind": "folder", "path": "a"}, "release"),
    ({"op": "run", "id": "r", "fn": {"$ref": "cheap"}}, "release"),
    ({"op": "upload", "kind": "bytes", "id": "u", "blob": "0" * 64}, "unchanged"),
    ({"op": "upload", "kind": "module", "id": "u", "source": ""}, "acquire"),
    ({"op": "upload", "kind": "tensor", "id": "u", "blob": "0" * 64, "dtype": "int8", "shape": []}, "acquire"),
    ({"op": "upload", "kind": "library", "id": "u", "blob": "0" * 64}, "acquire"),
    ({"op": "get_function", "id": "g", "module": {"$ref": "m"}, "name": "f"}, "acquire"),
    ({"op": "get_function", "id": "g", "module": {"$ref": "m"}, "name": "f", "cpu_only": True}, "acquire"),
    ({"op": "run", "id": "r", "fn": {"$ref": "gpu"}}, "acquire"),
    ({"op": "return", "key": "k", "value": {"$ref": "x"}}, "acquire"),
]


@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("ins, action", LEASE_TABLE)
def test_gpu_lease_before_each_instruction(ins, action, held):
    conn = FakeConn()
    lease = kcoral_worker.GpuLease(conn)
    lease.held = held
    lease.before(ins, cpu_only={"cheap"})
    expected = {("release", True): [("lease", "release")], ("acquire", False): [("lease", "acquire")]}
    assert conn.sent == expected.get((action, held), [])
    assert lease.held == (action == "acquire" or (action == "unchanged" and held))


def test_gpu_lease_finish_reacquires():
    conn = FakeConn()
    lease = kcoral_worker.GpuLease(conn)
    lease.finish()
    assert conn.sent == [("lease", "acquire")] and lease.held


class FakeCupti:
    """Just enough of cupti-python's callback API for CudaCallGuard."""
    ApiCallbackSite = types.SimpleNamespace(API_ENTER=0, API_EXIT=1)
    CallbackDomain = types.SimpleNamespace(RUNTIME_API=3, DRIVER_API=1)

    def __init__(self):
        self.callback, self.subscribed, self.domains = None, False, []

    def subscribe(self, callback, userdata):
        self.callback, self.subscribed = callback, True
        return 7

    def enable_domain(self, enable, subscriber, domain):
        self.domains.append(domain)

    def unsubscribe(self, subscriber):
        self.subscribed = False

    def api(self, name, site=0):
        """CUDA entering API `name` on this thread."""
        if self.subscribed:
            self.callback(None, 3, 0, types.SimpleNamespace(callback_site=site, function_name=name))


@pytest.fixture
def fake_cupti(monkeypatch):
    cupti = FakeCupti()
    package = types.ModuleType("cupti")
    package.cupti = cupti
    monkeypatch.setitem(sys.modules, "cupti", package)
    monkeypatch.setattr(kcoral_worker, "RUNTIME", kcoral_worker.Runtime("cuda"))
    return cupti


def run_cpu_only(source, cpu_only=True):
    """A Program on a "cuda" runtime without a lease: upload, get_function (cpu_only), run."""
    request = {"max_response_bytes": 1 << 20, "instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": source},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f", "cpu_only": cpu_only},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}}]}
    program = kcoral_worker.Program(FakeConn(), request, kcoral_worker.StagedBlobs(None, {}), None, kcoral_worker.NoLease())
    return program.run(), program


def test_cpu_only_guard_reports_the_first_cuda_call(fake_cupti):
    kcoral_worker.FAKE_CUPTI = fake_cupti
    try:
        error, _ = run_cpu_only("import kcoral_worker\n"
                                "def f():\n"
                                "    kcoral_worker.FAKE_CUPTI.api('cudaMalloc_v3020')\n"
                                "    kcoral_worker.FAKE_CUPTI.api('cuLaunchKernel')\n"
                                "    raise ValueError('the call also failed')\n")
    finally:
        del kcoral_worker.FAKE_CUPTI
    assert error["kind"] == "gpu_access" and error["cuda_call"] == "cudaMalloc_v3020"
    assert error["location"].startswith("<uploaded:") and error["location"].endswith(":3 in f")
    assert error["message"] == f"cpu_only function called cudaMalloc_v3020 at {error['location']}"
    assert "kcoral_worker.FAKE_CUPTI.api('cudaMalloc_v3020')" in error["traceback"]
    assert abs(error["lease_time"] - time.time()) < 60
    assert (error["instruction_index"], error["instruction_id"]) == (2, "r")
    assert not fake_cupti.subscribed and set(fake_cupti.domains) == {1, 3}


def test_cpu_only_guard_passes_a_clean_call(fake_cupti):
    error, program = run_cpu_only("def f():\n    return 5\n")
    assert error is None and program.handles["r"] == 5 and not fake_cupti.subscribed


def test_cpu_only_without_cupti_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupti", None)  # import fails
    monkeypatch.setattr(kcoral_worker, "RUNTIME", kcoral_worker.Runtime("cuda"))
    error, _ = run_cpu_only("def f():\n    return 5\n")
    assert error["kind"] == "unavailable" and "cupti-python" in error["message"]
    error, _ = run_cpu_only("def f():\n    return 5\n", cpu_only=False)
    assert error is None


def test_call_site_prefers_uploaded_code():
    frame = kcoral_worker.traceback.FrameSummary
    stack = [frame("/srv/kcoral_worker.py", 10, "op_run"), frame("<uploaded:ab>", 4, "compile"),
             frame("/lib/torch/cuda.py", 99, "init"), frame("/srv/kcoral_worker.py", 20, "on_api")]
    assert kcoral_worker.call_site(stack) == "<uploaded:ab>:4 in compile"
    assert kcoral_worker.call_site(stack[2:]) == "/lib/torch/cuda.py:99 in init"
    assert kcoral_worker.call_site(stack[3:]) == "an unknown call site"


def kernel(correlation, start, end, name="k"):
    identity = (10, name, None, None, None)
    return 10, start, end, correlation, identity


def test_activity_spans_attribute_gpu_work_to_calls():
    windows = [(100, 200), (300, 400)]
    records = [(5, 150, 160, 1, None), (5, 350, 352, 2, None), (5, 250, 260, 9, None),  # 9: between calls
               kernel(1, 170, 190), (8, 195, 230, 1, (8, None, 1, 64, None)),  # a copy after the kernel
               kernel(2, 360, 380), (8, 381, 400, 2, (8, None, 1, 64, None)), kernel(9, 500, 600)]
    samples, stable = kcoral_worker.activity_spans(records, windows, {5})
    assert samples == [60 / 1e6, 40 / 1e6] and stable is True
    records[-3] = kernel(2, 360, 380, name="other")
    assert kcoral_worker.activity_spans(records, windows, {5})[1] is False


def test_activity_spans_without_gpu_work_are_unavailable():
    with pytest.raises(kcoral_worker.ExecutionError) as info:
        kcoral_worker.activity_spans([(5, 150, 160, 1, None)], [(100, 200)], {5})
    assert info.value.kind == "unavailable"


# --- start-up ------------------------------------------------------------------------

def test_gpus_that_disagree_on_the_target_refuse_to_start():
    workers = [types.SimpleNamespace(arch="sm_90a"), types.SimpleNamespace(arch="sm_90a")]
    assert kcoral.common_target(workers) == "sm_90a"
    workers.append(types.SimpleNamespace(arch="sm_80"))
    with pytest.raises(SystemExit, match="disagree"):
        kcoral.common_target(workers)


def test_device_uuids_compare_without_prefix_or_case():
    assert kcoral.same_gpu("58a8e1b6-67e4-3e5d-a3c1-aaaa", "GPU-58A8E1B6-67e4-3e5d-a3c1-AAAA")
    assert not kcoral.same_gpu("58a8e1b6-0000", "GPU-58a8e1b6-1111")
    assert kcoral.same_gpu("", "GPU-58a8e1b6-1111") and kcoral.same_gpu("58a8", "3")  # unknown passes


def test_gpu_workers_pin_before_torch_is_imported():
    code = ("import os, sys\n"
            "import kcoral, kcoral_worker\n"
            "assert 'torch' not in sys.modules, 'the front-end imported torch'\n"
            "kcoral_worker.prepare_gpu(['GPU-1234', 'GPU-5678'])\n"
            "import json\n"
            "print(json.dumps([os.environ['CUDA_VISIBLE_DEVICES'], sorted(k for k in ('RANK', 'MASTER_PORT',"
            " 'TORCHELASTIC_RUN_ID') if k in os.environ), 'torch' in sys.modules]))\n")
    env = {**os.environ, "RANK": "1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["GPU-1234,GPU-5678", [], True]


# --- bench/gpu_check.py --------------------------------------------------------------

def test_gpu_check_cpu_mode():
    out = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 failed" in out.stdout.splitlines()[-1], out.stdout
