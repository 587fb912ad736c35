"""GPU runtime (docs/server.md §1-6), everything whose logic needs no CUDA device.

Over HTTP against a real `python -m kcoral --device cpu`: a TVM-FFI library
built here with tvm_ffi.cpp.build and called on CPU tensors, library load and
export errors, the host-timer benchmark, compile_tirx without tvm.  In
process: the lease arbiter (FIFO, "any n GPUs", history), an Execution
talking to a scripted fake worker over a real pipe (lease timings, a dead
holder's lease freed, poisoned workers retired, gpu_access attribution),
GpuLease's decision table, the cpu_only guard and CUPTI span arithmetic with
a fake `cupti` module.  Then what a desk review predicted would break on a real
GPU (bench/gpu_check.py runs them there), against a fake `torch.cuda` (events on a fake clock, per-device
memory), a fake libcudart and a fake CuTe DSL: the benchmark's count estimate,
CUDA's last error, memory freed before the lease, quarantine, multi-GPU start-up
and shutdown.  Finally bench/gpu_check.py in CPU mode.
"""

import collections
import hashlib
import json
import multiprocessing
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
from multiprocessing import reduction

import numpy
import pytest

import kcoral
import kcoral_worker
from tests.support import (
    ROOT,
    ServerProcess,
    build_add_one,
    in_own_session,
    join_threads,
    plain,
    post,
    sha256,
    wait_for,
)

# --- over HTTP: libraries, benchmark, compile_tirx -------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path=tmp_path_factory.mktemp("gpu-runtime")) as srv:
        yield srv


@pytest.fixture(scope="module")
def add_one_library():
    """The C++ add_one kernel built with tvm_ffi.cpp.build (cached under the temp dir)."""
    return build_add_one("cpu")


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


def test_host_benchmark_times_the_kernel_not_the_pages_glibc_gave_back(server):
    """A kernel with a 16 MiB output and a 16 MiB temporary: glibc's default trims the heap's top
    when the temporary is freed, so every call faulted pages back in (957 faults, 8.5 ms a call
    against 5.2 on this VM), as evaluate's kernel processes, which keep freed memory, never do.
    A page given back costs at least one fault to have again: fewer faults than calls means none."""
    body = run_source(server, "import numpy, resource\n"
                              "from kcoral.builtins import benchmark\n"
                              "def kernel(x):\n"
                              "    out = numpy.multiply(x, 1.5)\n"
                              "    numpy.multiply(x, 1.5)\n"
                              "    return out\n"
                              "def f():\n"
                              "    x = numpy.ones((1024, 4096), dtype=numpy.float32)\n"
                              "    config = {'warmup': 2, 'repeat': 20, 'flush_l2': False}\n"
                              "    benchmark(kernel, x, config)\n"
                              "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
                              "    benchmark(kernel, x, config)\n"
                              "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n")
    assert body["status"] == "COMPLETED", body
    assert plain(body["results"]["out"]) < 22 / 2, "page faults over 22 calls"


def test_host_benchmark_makes_its_flush_buffer_once_a_request(server):
    """The 64 MiB flush buffer was allocated afresh by every benchmark call: 16 384 page faults,
    ~40 ms on a VM, for a call whose own work took 11 ms.  The second call faults none of it."""
    body = run_source(server, "import resource\n"
                              "from kcoral.builtins import benchmark\n"
                              "def f():\n"
                              "    config = {'warmup': 1, 'repeat': 1}\n"
                              "    benchmark(len, [], config)\n"
                              "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
                              "    benchmark(len, [], config)\n"
                              "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n")
    assert body["status"] == "COMPLETED", body
    assert plain(body["results"]["out"]) < (64 << 20) // 4096 // 16, "page faults of the second benchmark call"


def test_the_host_flush_reads_64_mib_of_pages_of_its_own_and_writes_none():
    """The flush evicts the cache by reading its buffer: a buffer never written would be the shared
    zero page (4 KiB, always cached: nothing evicted), and a written one would leave the cache full
    of dirty lines for the timed call to write back."""
    script = ("import kcoral_worker, numpy\n"
              "def rss():\n"
              "    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) << 10\n"
              "before = rss()\n"
              "timer = kcoral_worker.HostTimer(True)\n"
              "grown = rss() - before\n"
              "timer.scratch[::4096] = numpy.arange(0, timer.scratch.size, 4096, dtype=numpy.uint64)\n"
              "copy = timer.scratch.copy()\n"
              "timer.flush()\n"
              "print(grown, timer.scratch.nbytes, bool((timer.scratch == copy).all()))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split()
    grown, size, unchanged = int(out[0]), int(out[1]), out[2] == "True"
    assert size >= 64 << 20 and grown >= size - (4 << 20), f"resident {grown} of {size} bytes"
    assert unchanged, "the flush wrote its buffer"


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


def test_lease_waiters_are_served_in_arrival_order():
    arbiter, order = kcoral.LeaseArbiter([0, 1]), []
    arbiter.acquire("a", [0])
    threads = []
    for n, owner in enumerate(["b", "c", "d"]):
        threads.append(acquire_in_thread(arbiter, owner, order, gpus=[0]))
        assert wait_for(lambda: queued(arbiter) == n + 1, 5)
    arbiter.acquire("other-gpu", [1])  # a different GPU is not held up by GPU 0's queue
    for owner in ["a", "b", "c"]:
        arbiter.release(owner, [0])
        assert wait_for(lambda: arbiter.holder[0] not in (None, owner), 5)
    arbiter.release("d", [0])
    join_threads(threads, 5)
    assert [owner for owner, _ in order] == ["b", "c", "d"]


def test_a_lease_waiter_whose_client_left_leaves_the_queue():
    """client_gone turns true while a request waits for the lease: ClientGone("lease") within the
    check interval, its ticket gone, so the next waiter is served at the release."""
    arbiter, order, gone, raised = kcoral.LeaseArbiter([0]), [], threading.Event(), []

    def abandoned():
        try:
            arbiter.acquire("left", [0], client_gone=gone.is_set)
        except kcoral.ClientGone as exc:
            raised.append((exc.where, time.monotonic()))

    arbiter.acquire("holder", [0])
    waiter = threading.Thread(target=abandoned)
    waiter.start()
    assert wait_for(lambda: queued(arbiter) == 1, 5)
    threads = [acquire_in_thread(arbiter, "next", order, gpus=[0])]
    assert wait_for(lambda: queued(arbiter) == 2, 5)
    left_at = time.monotonic()
    gone.set()
    join_threads([waiter], 5)
    assert raised and raised[0][0] == "lease" and raised[0][1] - left_at < 1.0, raised
    assert queued(arbiter) == 1
    arbiter.release("holder", [0])
    join_threads(threads, 5)
    assert [owner for owner, _ in order] == ["next"]


def test_identical_waiters_do_not_lose_their_tickets():
    arbiter, order = kcoral.LeaseArbiter([0]), []
    arbiter.acquire(kcoral.STARTUP_OWNER, [0])
    threads = [acquire_in_thread(arbiter, kcoral.STARTUP_OWNER, order, gpus=[0])]
    assert wait_for(lambda: queued(arbiter) == 1, 5)
    threads.append(acquire_in_thread(arbiter, kcoral.STARTUP_OWNER, order, gpus=[0]))
    assert wait_for(lambda: queued(arbiter) == 2, 5)
    for served in (1, 2):  # each release hands the lease to the next ticket, never to nobody
        arbiter.release(kcoral.STARTUP_OWNER, [0])
        assert wait_for(lambda served=served: len(order) == served, 5), f"waiter {served} was never served"
    arbiter.release(kcoral.STARTUP_OWNER, [0])
    join_threads(threads, 5)
    assert len(order) == 2 and arbiter.holder[0] is None


def test_any_n_gpus_blocks_later_waiters_until_it_is_served():
    arbiter, order = kcoral.LeaseArbiter([0, 1, 2]), []
    arbiter.acquire("busy", [0])
    big = acquire_in_thread(arbiter, "big", order, count=3)
    assert wait_for(lambda: queued(arbiter) == 1, 5)
    small = acquire_in_thread(arbiter, "small", order, gpus=[2])  # GPU 2 is free, but "big" came first
    assert wait_for(lambda: queued(arbiter) == 2, 5)
    time.sleep(0.1)  # not a synchronisation: the time a wrong grant to "small" would have to show
    assert order == [] and arbiter.holder[2] is None
    arbiter.release("busy", [0])
    join_threads([big], 5)
    assert order == [("big", [0, 1, 2])]
    arbiter.release("big", [0, 1, 2])
    join_threads([small], 5)
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

    def __init__(self, conn, gpus):
        self.conn = conn
        self.gpus = gpus
        self.template = None  # not sandboxed
        self.pid = 4194000  # no such process group: group_members() finds nobody
        self.served = 0
        self.process = FakeProcess()
        self.killed = False
        self.gone = True  # what kill_group reports
        self.exiting = False  # not gone, yet killed: only its exit is left (a busy GPU's teardown)

    def kill(self, grace, orphans=False):
        self.killed = True
        self.conn.close()
        return self.gone

    def halt(self):  # its group SIGKILLed once it exited: nobody is in it
        self.halted = True


def fake_pool(gpus=(0,)):
    """The parts of a Pool an Execution uses; quarantines are recorded and reach the real arbiter."""
    config = kcoral.ServerConfig(max_requests_per_worker=0, worker_termination_grace_seconds=0.1)
    pool = types.SimpleNamespace(config=config, arbiter=kcoral.LeaseArbiter(list(gpus)), quarantined=[],
                                 log=kcoral.EventLog(config), helpers=kcoral.Helpers())

    def quarantine(gpus, reason):
        pool.quarantined.append(list(gpus))
        pool.arbiter.quarantine(gpus)
    pool.quarantine = quarantine
    pool.end_worker = types.MethodType(kcoral.Pool.end_worker, pool)
    return pool


def execution(pool, script, timeout=10.0, request_id="req-1", gpus=(0,), gone=True, blobs=None, exiting=False):
    """Run an Execution whose worker follows `script(conn)` in a thread -> (Outcome, retire, worker)."""
    ours, theirs = multiprocessing.Pipe()
    worker = FakeWorker(ours, list(gpus))
    worker.gone, worker.exiting = gone, exiting
    instructions = [{"op": "upload", "id": "m", "kind": "module", "source": ""},
                    {"op": "run", "id": "r", "fn": {"$ref": "m"}},
                    {"op": "return", "key": "k", "value": {"$ref": "r"}}]
    program = kcoral.ValidProgram(instructions, {}, {}, [])
    job = kcoral.Job(request_id, program, blobs or {}, timeout=timeout, output_limit=0)

    def play():
        request = kcoral_worker.receive_message(theirs)[0]
        if request.progress:  # its pipe's write end follows, as a real worker takes it
            os.close(reduction.recv_handle(theirs))
        try:
            script(theirs)
        except (EOFError, OSError):
            pass
    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    outcome, retire = kcoral.Execution(pool, worker, list(gpus), job, 0.0).run()
    join_threads([thread], 5)
    theirs.close()
    return outcome, retire, worker


def acquire(conn):
    kcoral_worker.send_message(conn, kcoral_worker.AcquireLease())
    assert kcoral_worker.receive_message(conn)[0] == kcoral_worker.LeaseGranted()


def test_lease_timings_add_up_around_a_cpu_only_release():
    pool = fake_pool()
    pool.arbiter.acquire("someone-else", [0])
    threading.Timer(0.5, pool.arbiter.release, ("someone-else", [0])).start()

    def script(conn):
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(0))
        acquire(conn)               # waits ~0.5 s for someone-else
        time.sleep(0.2)
        kcoral_worker.send_message(conn, kcoral_worker.ReleaseLease())  # a cpu_only run: 0.3 s without the lease
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(1))
        time.sleep(0.3)
        acquire(conn)
        time.sleep(0.1)
        kcoral_worker.send_message(conn, kcoral_worker.RequestDone(None, False))

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
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(1))
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
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(0))
        time.sleep(1)  # hangs without the lease (say, in a cpu_only run)

    original_kill = FakeWorker.kill

    def kill(self, grace, orphans=False):
        seen["holder"] = pool.arbiter.holder[0]
        return original_kill(self, grace, orphans)

    FakeWorker.kill = kill
    try:
        outcome, retire, _ = execution(pool, script, timeout=0.2)
    finally:
        FakeWorker.kill = original_kill
    assert outcome.http_status == 504 and retire
    assert seen["holder"] == "req-1" and pool.arbiter.holder[0] is None


def test_an_unexpected_worker_message_is_a_crash():
    """A message the protocol does not define (here a frame naming no known type) is a crashed worker: killed,
    retired, the lease freed, the failure attributed to the instruction it had started."""
    pool = fake_pool()

    def script(conn):
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(1))
        acquire(conn)
        kcoral_worker.send_raw(conn, kcoral_worker.MESSAGE_HEADER.pack(19) + b'{"type":"Release"} ')  # no such message
        time.sleep(1)

    started = time.monotonic()
    outcome, retire, worker = execution(pool, script)
    assert time.monotonic() - started < 5  # not the 10 s timeout
    assert retire and worker.killed
    error = outcome.body["error"]
    assert (error["kind"], error["instruction_index"]) == ("runtime", 1)
    assert pool.arbiter.holder[0] is None


def test_a_staged_blob_returned_unchanged_is_answered_from_the_front_ends_copy():
    """ReturnValue.parts names a staged blob by hash instead of sending its bytes again: the
    answer carries the job's own buffer (no copy), and raw parts around it still follow in order."""
    pool, staged = fake_pool(), memoryview(b"staged blob " * 4096)
    digest = hashlib.sha256(staged).hexdigest()

    def script(conn):
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(0))
        kcoral_worker.send_message(conn, kcoral_worker.ReturnValue("k", {"type": "array", "value": []}, [3, digest, 2]))
        kcoral_worker.send_raw(conn, b"abc")
        kcoral_worker.send_raw(conn, b"de")
        kcoral_worker.send_message(conn, kcoral_worker.RequestDone(None, False))

    outcome, retire, worker = execution(pool, script, blobs={digest: staged})
    assert outcome.body["status"] == "COMPLETED" and not retire and not worker.killed
    assert [bytes(p) for p in outcome.parts] == [b"abc", bytes(staged), b"de"]
    assert outcome.parts[1] is staged



def test_write_batches_keeps_the_order_whatever_each_write_takes():
    """Each call may write any prefix of what it is given (a pipe or socket with little room):
    the bytes still go out once each, in order, buffers of any size mixed."""
    rng = random.Random(7)
    buffers = [os.urandom(n) for n in (0, 3, 5 << 20, 1, 0, 70_000, 2)] + [bytes([i % 256]) * 100 for i in range(600)]
    out = bytearray()

    def stingy(views):
        room = rng.choice([1, 7, 4096, 1 << 20, 1 << 30])
        taken = 0
        for view in views:
            piece = bytes(view[:room - taken])
            out.extend(piece)
            taken += len(piece)
            if taken == room:
                break
        return taken

    kcoral_worker.write_batches(stingy, buffers)
    assert out == b"".join(buffers)


def test_a_returned_values_parts_arrive_intact_in_one_read():
    """The worker sends a value's raw parts back to back (send_raw batches them); the front-end
    reads them at once and cuts them apart by the sizes announced."""
    pool = fake_pool()
    big, small = os.urandom((9 << 20) + 5), b"xyz"

    def script(conn):
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(0))
        frame = kcoral_worker.encode_message(
            kcoral_worker.ReturnValue("k", {"type": "array", "value": []}, [len(big), len(small), 0]))
        kcoral_worker.send_raw(conn, frame, big, small, b"")
        kcoral_worker.send_message(conn, kcoral_worker.RequestDone(None, False))

    outcome, retire, worker = execution(pool, script)
    assert outcome.body["status"] == "COMPLETED" and not retire and not worker.killed
    assert [bytes(p) for p in outcome.parts] == [big, small, b""]

@pytest.mark.parametrize("name", ["0" * 64, 12.5, ["list"]])
def test_a_returned_blob_the_job_does_not_hold_is_a_crash(name):
    """A program that forges a ReturnValue cannot make the front-end answer with another blob."""
    pool, staged = fake_pool(), b"the job's only blob"
    digest = hashlib.sha256(staged).hexdigest()

    def script(conn):
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(1))
        kcoral_worker.send_message(conn, kcoral_worker.ReturnValue("k", {"type": "array", "value": []}, [name]))
        time.sleep(1)

    started = time.monotonic()
    outcome, retire, worker = execution(pool, script, blobs={digest: staged})
    assert time.monotonic() - started < 5
    assert retire and worker.killed and outcome.parts == []
    error = outcome.body["error"]
    assert (error["kind"], error["instruction_index"]) == ("runtime", 1)


@pytest.mark.parametrize("blobs", [{}, {hashlib.sha256(b"one").hexdigest(): b"one"}], ids=["no-blobs", "twice"])
def test_blobs_asked_for_twice_or_by_a_job_without_any_is_a_crash(blobs):
    """StageBlobs is answered once per job that has blobs (with their memfd); a second one, or one
    from a job without blobs, is a forged message: the worker is killed, nothing more is staged."""
    pool, received = fake_pool(), []

    def script(conn):
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(1))
        if blobs:
            kcoral_worker.send_message(conn, kcoral_worker.StageBlobs())
            fd = reduction.recv_handle(conn)
            received.append(os.pread(fd, 16, 0))
            os.close(fd)
        kcoral_worker.send_message(conn, kcoral_worker.StageBlobs())
        time.sleep(1)

    started = time.monotonic()
    outcome, retire, worker = execution(pool, script, blobs=blobs)
    assert time.monotonic() - started < 5
    assert retire and worker.killed
    assert received == list(blobs.values())
    error = outcome.body["error"]
    assert (error["kind"], error["instruction_index"]) == ("runtime", 1)

def test_a_poisoned_worker_is_retired():
    pool = fake_pool()

    def script(conn):
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(0))
        acquire(conn)
        kcoral_worker.send_message(conn, kcoral_worker.RequestDone(None, True))

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
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(1))
        kcoral_worker.send_message(conn, kcoral_worker.RequestDone(gpu_access_error(when), False))

    outcome, _, _ = execution(pool, script)
    error = outcome.body["error"]
    assert set(error) == {"kind", "message", "instruction_index", "instruction_op", "instruction_id",
                          "traceback", "cuda_call", "location", "interfered_request_id"}
    assert error["interfered_request_id"] == expected


# --- the worker side ----------------------------------------------------------------

class FakeConn:
    """The worker's end of its pipe: what it writes lands in a file, read back as messages (`sent`);
    every lease request is answered with `reply`."""

    def __init__(self, reply=None):
        self.file = tempfile.TemporaryFile()
        self.reply = reply or kcoral_worker.LeaseGranted()

    def fileno(self):
        return self.file.fileno()

    @property
    def sent(self):
        """The messages written so far (a ReturnValue's raw parts skipped)."""
        data, messages, at = os.pread(self.fileno(), 1 << 30, 0), [], 0
        while at < len(data):
            (size,) = kcoral_worker.MESSAGE_HEADER.unpack_from(data, at)
            at += kcoral_worker.MESSAGE_HEADER.size
            messages.append(kcoral_worker.decode_message(data[at:at + size]))
            at += size
            if isinstance(messages[-1], kcoral_worker.ReturnValue):
                at += sum(p for p in messages[-1].parts if isinstance(p, int))
        return messages


@pytest.fixture(autouse=True)
def lease_replies(monkeypatch):
    """GpuLease reads its answer off the pipe: a FakeConn gives its `reply` instead."""
    real = kcoral_worker.receive_message

    def receive(conn, *args, **kwargs):
        if isinstance(conn, FakeConn):
            return conn.reply, 0
        return real(conn, *args, **kwargs)
    monkeypatch.setattr(kcoral_worker, "receive_message", receive)


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
    lease = kcoral_worker.GpuLease(conn, kcoral_worker.Runtime("cuda"))
    lease.held = held
    lease.before(ins, cpu_only={"cheap"})
    expected = {("release", True): [kcoral_worker.ReleaseLease()], ("acquire", False): [kcoral_worker.AcquireLease()]}
    assert conn.sent == expected.get((action, held), [])
    assert lease.held == (action == "acquire" or (action == "unchanged" and held))


def test_gpu_lease_refuses_an_answer_other_than_granted():
    conn = FakeConn(reply=kcoral_worker.ReleaseLease())
    lease = kcoral_worker.GpuLease(conn, kcoral_worker.Runtime("cuda"))
    with pytest.raises(kcoral_worker.UnexpectedMessage, match="LeaseGranted"):
        lease.acquire()
    assert conn.sent == [kcoral_worker.AcquireLease()] and not lease.held


def test_gpu_lease_finish_reacquires():
    conn = FakeConn()
    lease = kcoral_worker.GpuLease(conn, kcoral_worker.Runtime("cuda"))
    lease.finish()
    assert conn.sent == [kcoral_worker.AcquireLease()] and lease.held


class FakeCupti:
    """Just enough of cupti-python's callback API for CudaCallGuard."""
    ApiCallbackSite = types.SimpleNamespace(API_ENTER=0, API_EXIT=1)
    CallbackDomain = types.SimpleNamespace(RUNTIME_API=3, DRIVER_API=1)

    def __init__(self):
        self.callback, self.subscribed, self.domains, self.disabled = None, False, [], []

    def subscribe(self, callback, userdata):
        self.callback, self.subscribed = callback, True
        return 7

    def enable_domain(self, enable, subscriber, domain):
        (self.domains if enable else self.disabled).append(domain)

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
    return cupti


def job_request(instructions, workspace="", retire=False):
    return kcoral_worker.JobRequest(instructions=instructions, retire=retire, workspace=workspace,
                                    blob_index={}, capture=False, grace=0.1, max_response_bytes=1 << 20,
                                    max_response_parts=1000, progress=False)


def run_cpu_only(source, cpu_only=True):
    """A Program on a "cuda" runtime without a lease: upload, get_function (cpu_only), run."""
    request = job_request([
        {"op": "upload", "id": "m", "kind": "module", "source": source},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f", "cpu_only": cpu_only},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}}])
    program = kcoral_worker.ProgramRun(FakeConn(), request, kcoral_worker.StagedBlobs(FakeConn(), {}), None,
                                       kcoral_worker.NoLease(), kcoral_worker.Runtime("cuda"), None)
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


# --- the sandbox on a GPU host: what it shows of the driver, the server's import path ---------

def fake_driver_folders(tmp_path, minors=(0, 1, 2)):
    """A /proc/driver/nvidia/gpus stand-in: one folder per GPU, named by PCI address, with its minor."""
    folder = tmp_path / "nvidia-gpus"
    for minor in minors:
        entry = folder / f"0000:{minor + 1:02x}:00.0"
        entry.mkdir(parents=True)
        (entry / "information").write_text(f"Model: \t\t NVIDIA H200\nDevice Minor: \t {minor}\n")
    return folder


def test_the_sandbox_command_hides_other_gpus_driver_folders(monkeypatch, tmp_path):
    folder = fake_driver_folders(tmp_path)
    monkeypatch.setattr(kcoral_worker, "NVIDIA_PROC_GPUS", str(folder))
    monkeypatch.setattr(kcoral, "gpu_device_node", lambda gpu: f"/dev/nvidia{gpu}")
    args = kcoral.bwrap_command(kcoral.ServerConfig(), [1])
    own = str(folder / "0000:02:00.0")
    start = args.index("--tmpfs", args.index("--proc"))  # over the container's own /proc
    assert args[start:start + 7] == ["--tmpfs", str(folder), "--ro-bind", own, own, "--remount-ro", str(folder)]
    assert kcoral.nvidia_proc_args([]) == []  # CPU slots: nothing of the driver to hide
    monkeypatch.setattr(kcoral_worker, "NVIDIA_PROC_GPUS", str(tmp_path / "no-driver"))
    assert kcoral.nvidia_proc_args([0]) == []


@pytest.fixture
def outside_the_sandboxs_mounts():
    """A host folder that no later mount of the container covers (the temporary folder is hidden)."""
    folder = tempfile.mkdtemp(prefix=".test-driver-", dir=ROOT)
    yield pathlib.Path(folder)
    shutil.rmtree(folder)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_container_sees_only_its_gpus_driver_folder(monkeypatch, outside_the_sandboxs_mounts):
    folder = fake_driver_folders(outside_the_sandboxs_mounts)
    monkeypatch.setattr(kcoral_worker, "NVIDIA_PROC_GPUS", str(folder))
    monkeypatch.setattr(kcoral, "gpu_device_node", lambda gpu: f"/dev/nvidia{gpu}")
    script = f"ls {folder}; cat {folder}/*/information; touch {folder}/new 2>/dev/null && echo WRITABLE || true"
    seen = subprocess.run(kcoral.bwrap_command(kcoral.ServerConfig(), [2]) + ["/bin/sh", "-c", script],
                          env=kcoral.sandbox_environment(), capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.split("\n")[0] == "0000:03:00.0" and "Device Minor: \t 2" in seen.stdout, seen.stdout
    assert "WRITABLE" not in seen.stdout and "Device Minor: \t 0" not in seen.stdout


HIDE_IN_A_FRESH_PROC = """
import json, os, sys
import kcoral_worker
folder, own = sys.argv[1], sys.argv[2]
kcoral_worker.hide_other_gpu_folders([own], folder)
try:
    open(os.path.join(folder, "new"), "w").close()
    writable = True
except OSError:
    writable = False
print(json.dumps([os.listdir(folder), open(os.path.join(folder, own, "information")).read(), writable]))
"""


def test_a_requests_fresh_proc_shows_only_the_gpu_folders_its_container_did(tmp_path):
    """Each sandboxed request mounts a /proc of its own, where the driver lists every GPU again:
    its worker covers the folder as the container's /proc had it (kcoral_worker.enter_request_space)."""
    folder = fake_driver_folders(tmp_path)
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace for this user (unshare -m)")
    seen = subprocess.run([unshare, "-m", "--propagation", "private", sys.executable, "-c", HIDE_IN_A_FRESH_PROC,
                           str(folder), "0000:02:00.0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0, seen.stderr
    names, information, writable = json.loads(seen.stdout)
    assert names == ["0000:02:00.0"] and "Device Minor: \t 1" in information and not writable
    assert len(os.listdir(folder)) == 3  # the host's folder is as it was


PYTHONPATH_PROBE = """
import os
import kcoral_pythonpath_probe
def f():
    here = os.path.dirname(kcoral_pythonpath_probe.__file__)
    return [kcoral_pythonpath_probe.VALUE, os.access(here, os.W_OK)]
"""


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_sandboxed_worker_imports_from_the_servers_pythonpath(tmp_path):
    """The sandbox's template runs `python -I`, which ignores PYTHONPATH: a server whose packages
    (tvm_ffi, say) come from PYTHONPATH must still hand them to its workers, read-only."""
    packages = tmp_path / "packages"
    packages.mkdir()
    (packages / "kcoral_pythonpath_probe.py").write_text("VALUE = 42\n")
    with ServerProcess("--sandbox", "bubblewrap", tmp_path=tmp_path, workers=1,
                       env={"PYTHONPATH": str(packages)}) as srv:
        status, _, body = post(srv.url, {"instructions": [
            {"op": "upload", "id": "m", "kind": "module", "source": PYTHONPATH_PROBE},
            {"op": "get_function", "id": "fn", "module": {"$ref": "m"}, "name": "f"},
            {"op": "run", "id": "r", "fn": {"$ref": "fn"}, "args": []},
            {"op": "return", "key": "out", "value": {"$ref": "r"}}]}, [])
    assert status == 200 and body["status"] == "COMPLETED", body.get("error")
    assert plain(body["results"]["out"]) == [42, False]


# --- bench/gpu_check.py --------------------------------------------------------------

def gpu_check(*args, out_dir):
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--out", str(out_dir), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_gpu_check_cpu_mode(tmp_path):
    out = gpu_check(out_dir=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ", 0 failed, " in out.stdout.splitlines()[-1], out.stdout
    phases = json.loads((tmp_path / "gpu_check.json").read_text())["phases"]
    assert phases["cpu_mode"]["result"] == "SKIP" and "needs a CUDA device" in phases["cpu_mode"]["detail"]
    assert all({"seconds", "budget_s"} <= set(phase) for phase in phases.values())  # soft budgets: timed, not enforced here
    fresh = phases["request_overhead"]["data"]["fresh_workers"]
    assert len(fresh["requests"]) == 20 and fresh["median_after_first"]["queue_ms"] >= 0
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.json", "servers.log"]  # a device brings back 8 files at most
    headers = re.findall(r"^===== server (\w+) ", (tmp_path / "servers.log").read_text(), re.M)
    sandboxed = [] if phases["sandboxed"]["result"] == "SKIP" else ["sandboxed"]  # no bwrap here
    assert headers == ["fresh_workers", "reused_workers", "main", "cli", *sandboxed]


def test_gpu_check_without_bwrap_skips_the_sandboxed_phase(tmp_path):
    out = gpu_check("--only", "sandboxed", "--bwrap", "none", out_dir=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SKIP phase sandboxed: no bwrap (--bwrap none)" in out.stdout.splitlines()
    assert out.stdout.splitlines()[-1] == "0 passed, 0 failed, 1 skipped"


def test_gpu_check_builds_with_a_real_cuda_toolkit_where_nvcc_is_a_wrapper(tmp_path):
    from bench.gpu_check import cuda_home

    def executable(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    wrapped = tmp_path / "wrapper" / "bin"
    executable(wrapped / "nvcc")  # a script: the folder above it holds no CUDA libraries
    toolkit = tmp_path / "cuda"
    (toolkit / "lib64").mkdir(parents=True)
    (toolkit / "lib64" / "libcudart.so.13").touch()
    assert cuda_home({"PATH": str(wrapped)}, toolkits=(str(toolkit),)) == str(toolkit)
    assert cuda_home({"PATH": str(wrapped)}, toolkits=()) is None  # tvm_ffi's guess would fail to link
    assert cuda_home({"PATH": str(wrapped), "CUDA_HOME": "/opt/mine"}, toolkits=(str(toolkit),)) == "/opt/mine"
    real = tmp_path / "real-cuda"  # nvcc reached through a link: the toolkit it lies in
    executable(real / "bin" / "nvcc")
    (real / "targets" / "x86_64-linux" / "lib").mkdir(parents=True)
    (real / "targets" / "x86_64-linux" / "lib" / "libcudart.so").touch()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "nvcc").symlink_to(real / "bin" / "nvcc")
    assert cuda_home({"PATH": str(linked)}, toolkits=(str(tmp_path / "none"),)) == str(real)


def test_gpu_check_refuses_an_unknown_phase(tmp_path):
    out = gpu_check("--only", "main_server,nonesuch", out_dir=tmp_path)
    assert out.returncode != 0 and "unknown phase(s) ['nonesuch']" in out.stderr


# --- what a desk review predicted would break on a real GPU ----------------

class FakeClock:
    """GPU time in ms: the L2 flush and the kernel advance it, CUDA events read it."""

    def __init__(self):
        self.now = 0.0


class FakeEvent:
    def __init__(self, clock):
        self.clock, self.at = clock, None

    def record(self):
        self.at = self.clock.now

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


class FakeFlushBuffer:
    def __init__(self, clock, cost_ms):
        self.clock, self.cost_ms = clock, cost_ms

    def zero_(self):
        self.clock.now += self.cost_ms


class FakeOutOfMemory(RuntimeError):
    """torch.cuda.OutOfMemoryError is a RuntimeError."""


def fake_torch(log, clock=None, flush_ms=0.040, devices=2, reserved=(512, 0), oom=False):
    """Enough of `torch` for the CUDA paths of the worker: events, the flush buffer, per-device memory."""
    clock = clock or FakeClock()
    current = [0]

    @__import__("contextlib").contextmanager
    def device(index):
        before, current[0] = current[0], index
        yield
        current[0] = before

    def empty(n, dtype, device):
        if oom:
            raise FakeOutOfMemory(f"CUDA out of memory. Tried to allocate {n} bytes")
        log.append(("flush buffer", n))
        return FakeFlushBuffer(clock, flush_ms)

    cuda = types.SimpleNamespace(
        Event=lambda enable_timing: FakeEvent(clock),
        synchronize=lambda index=None: log.append(("synchronize", index)),
        get_device_properties=lambda index: types.SimpleNamespace(L2_cache_size=60 << 20),
        device_count=lambda: devices, device=device,
        memory_reserved=lambda index: reserved[index], memory_allocated=lambda index: 0,
        empty_cache=lambda: log.append(("empty_cache", current[0])),
        is_initialized=lambda: False, _is_in_bad_fork=lambda: False)
    torch = types.ModuleType("torch")
    torch.cuda, torch.int8, torch.empty, torch.Tensor = cuda, "int8", empty, type("Tensor", (), {})
    return torch, clock


@pytest.fixture
def cuda_worker(monkeypatch):
    """A worker holding a CUDA context, whose torch is a fake that logs what the worker asks of it."""
    log = []
    torch, clock = fake_torch(log)
    torch.cuda.is_initialized = lambda: True
    monkeypatch.setitem(sys.modules, "torch", torch)
    return types.SimpleNamespace(log=log, clock=clock, torch=torch)


FAKE_ACTIVITY_API = types.SimpleNamespace(ActivityKind=types.SimpleNamespace(
    RUNTIME=1, DRIVER=2, CONCURRENT_KERNEL=3, MEMCPY=4, MEMSET=5))  # what CuptiTimer reads when built


def test_count_estimate_times_the_flush_with_the_call(cuda_worker):
    """The count estimate times 5 x (flush + call) inside one pair of CUDA events; the budgets bound flushes too."""
    clock = cuda_worker.clock

    def kernel():
        clock.now += 0.005  # a 5 us kernel after a 40 us flush

    timer = kcoral_worker.CuptiTimer(True, FAKE_ACTIVITY_API)
    assert cuda_worker.log[0] == ("flush buffer", 2 * (60 << 20))  # 2 x the device's L2
    estimate = timer.estimate(kernel, ())
    assert estimate == pytest.approx(0.045)
    warmup, repeat = kcoral_worker.benchmark_counts(timer, kernel, (), {})
    assert (warmup, repeat) == (int(25 / estimate), int(100 / estimate))  # about 555, 2222; not 5000, 20000
    assert kcoral_worker.benchmark_counts(timer, kernel, (), {"repeat": 7, "warmup_ms": 9}) == (int(9 / estimate), 7)
    assert kcoral_worker.benchmark_counts(timer, kernel, (), {"warmup": 0, "repeat": 3}) == (1, 3)
    unflushed = kcoral_worker.CuptiTimer(False, FAKE_ACTIVITY_API)
    estimate = unflushed.estimate(kernel, ())
    assert estimate == pytest.approx(0.005)
    assert kcoral_worker.benchmark_counts(unflushed, kernel, (), {}) == (int(25 / estimate), int(100 / estimate))


def test_benchmark_without_cupti_is_unavailable(cuda_worker, monkeypatch):
    """Unusable cupti-python degrades as the spec says (docs/server.md §5.2)."""
    monkeypatch.setitem(sys.modules, "cupti", None)
    with pytest.raises(kcoral_worker.ExecutionError) as info:
        kcoral_worker.benchmark(lambda: None, {"warmup": 1, "repeat": 1})
    assert info.value.kind == "unavailable" and "cupti-python" in info.value.message


def test_flush_buffer_out_of_memory_is_runtime(monkeypatch):
    """An OOM allocating the flush buffer is a torch RuntimeError: kind runtime, not engine."""
    torch, _ = fake_torch([], oom=True)
    torch.cuda.is_initialized = lambda: True
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "cupti", types.SimpleNamespace(cupti=FakeCupti()))
    with pytest.raises(kcoral_worker.ExecutionError) as info:
        kcoral_worker.benchmark(lambda: None)
    assert info.value.kind == "runtime" and "out of memory" in info.value.message


def test_unknown_benchmark_keys_are_ignored():
    result = kcoral_worker.benchmark(lambda: None, {"warmup": 2, "repeat": 3, "flush_l2": False, "bogus": 1})
    assert (result["warmup"], result["repeat"], result["timer"]) == (2, 3, "host")


class FakeCudart:
    """A libcudart as ctypes shows it: the last error is read and cleared by cudaGetLastError."""

    def __init__(self, pending=0):
        self.pending = pending

    def cudaGetLastError(self):
        code, self.pending = self.pending, 0
        return code

    def cudaGetErrorName(self, code):
        return b"cudaErrorInvalidConfiguration"

    def cudaGetErrorString(self, code):
        return b"invalid configuration argument"


def serve(tmp_path, source, retire=False, cpu_only=False):
    """serve_request on a scripted pipe, as a GPU worker: upload a module, run f, return its result -> (done
    message, sent).  Only in a test decorated @in_own_session: its sweep of escaped descendants would find
    other tests' workers."""
    conn = FakeConn()
    request = job_request([
        {"op": "upload", "id": "m", "kind": "module", "source": source},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f", "cpu_only": cpu_only},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}},
        {"op": "return", "key": "out", "value": {"$ref": "r"}}], workspace=str(tmp_path), retire=retire)
    cwd = os.getcwd()
    try:
        kcoral_worker.serve_request(conn, request, kcoral_worker.Runtime("cuda"))
    finally:
        os.chdir(cwd)
    return conn.sent[-1], conn.sent


@in_own_session
def test_pending_cuda_error_fails_a_completed_request_and_is_cleared(cuda_worker, monkeypatch, tmp_path):
    """A pending CUDA error (docs/server.md §3.4 step 3) is read and cleared through libcudart."""
    cudarts = [FakeCudart(), FakeCudart(pending=9)]
    monkeypatch.setattr(kcoral_worker, "loaded_cudarts", lambda: cudarts)
    done, _ = serve(tmp_path, "def f():\n    return 1\n")
    error = done.error
    assert isinstance(done, kcoral_worker.RequestDone) and not done.poisoned
    assert error["kind"] == "runtime" and error["instruction_index"] == 3 and error["instruction_id"] is None
    assert error["message"] == "CUDA error cudaErrorInvalidConfiguration (9): invalid configuration argument"
    assert [c.pending for c in cudarts] == [0, 0]  # cleared: the next request starts clean
    done, _ = serve(tmp_path, "def f():\n    return 1\n")
    assert done.error is None


@in_own_session
def test_pending_cuda_error_is_appended_to_a_gpu_access_error(cuda_worker, monkeypatch, tmp_path, fake_cupti):
    monkeypatch.setattr(kcoral_worker, "loaded_cudarts", lambda: [FakeCudart(pending=9)])
    kcoral_worker.FAKE_CUPTI = fake_cupti
    try:
        done, _ = serve(tmp_path, "import kcoral_worker\ndef f():\n"
                                 "    kcoral_worker.FAKE_CUPTI.api('cudaMalloc')\n", cpu_only=True)
    finally:
        del kcoral_worker.FAKE_CUPTI
    error = done.error
    assert error["kind"] == "gpu_access" and error["cuda_call"] == "cudaMalloc"
    assert error["message"].endswith("; CUDA also reports CUDA error cudaErrorInvalidConfiguration (9): "
                                     "invalid configuration argument")


def test_cudart_paths_come_from_the_memory_map():
    maps = ("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
            "7f20-7f30 r--p 00000000 08:01 2 /site/nvidia/cuda_runtime/lib/libcudart.so.13\n"
            "7f30-7f40 r-xp 00001000 08:01 2 /site/nvidia/cuda_runtime/lib/libcudart.so.13\n"
            "7f50-7f60 rw-p 00000000 00:00 0 \n")
    assert kcoral_worker.cudart_paths(maps) == ["/site/nvidia/cuda_runtime/lib/libcudart.so.13"]
    assert kcoral_worker.Runtime("cpu").take_last_error() is None  # CPU workers never look
    assert kcoral_worker.loaded_cudarts() == []  # this test process has no CUDA runtime


@in_own_session
def test_reused_worker_frees_gpu_memory_before_the_lease_goes(cuda_worker, monkeypatch, tmp_path):
    """A reused worker gives GPU memory back: handles dropped, garbage collected, every device
    synchronized and each one's cache emptied, all before RequestDone lets the front-end release the lease."""
    monkeypatch.setattr(kcoral_worker, "loaded_cudarts", list)
    log = cuda_worker.log
    kcoral_worker.EVENTS = log
    try:
        message, sent = serve(tmp_path, "import kcoral_worker, weakref\n"
                              "class Big:\n    pass\n"
                              "def f():\n"
                              "    big = Big()\n"
                              "    big.cycle = big  # only a collection frees it\n"
                              "    weakref.finalize(big, kcoral_worker.EVENTS.append, ('freed',))\n"
                              "    return 1\n")
    finally:
        del kcoral_worker.EVENTS
    assert message == kcoral_worker.RequestDone(None, False)
    cleanup = log[log.index(("freed",)):]
    assert cleanup == [("freed",), ("synchronize", 0), ("synchronize", 1), ("empty_cache", 0)]  # device 1: nothing cached
    assert isinstance(sent[-1], kcoral_worker.RequestDone)


@in_own_session
def test_retiring_worker_leaves_memory_to_the_exit(cuda_worker, monkeypatch, tmp_path):
    monkeypatch.setattr(kcoral_worker, "loaded_cudarts", list)
    serve(tmp_path, "def f():\n    return 1\n", retire=True)
    assert ("empty_cache", 0) not in cuda_worker.log


def test_cpu_only_release_empties_the_cache_on_every_device(monkeypatch):
    log = []
    torch, _ = fake_torch(log, reserved=(512, 256))
    monkeypatch.setitem(sys.modules, "torch", torch)
    conn = FakeConn()
    lease = kcoral_worker.GpuLease(conn, kcoral_worker.Runtime("cuda"))
    lease.held = True
    lease.release()
    assert log == [("synchronize", 0), ("synchronize", 1), ("empty_cache", 0), ("empty_cache", 1)]
    assert conn.sent == [kcoral_worker.ReleaseLease()]


def test_devices_without_a_context_are_neither_synchronized_nor_emptied(monkeypatch):
    """A multi-GPU worker whose program used device 1 only: touching device 0 would create a context."""
    log = []
    torch, _ = fake_torch(log, reserved=(0, 512))
    torch._C = types.SimpleNamespace(_cuda_hasPrimaryContext=lambda index: index == 1)
    monkeypatch.setitem(sys.modules, "torch", torch)
    conn = FakeConn()
    lease = kcoral_worker.GpuLease(conn, kcoral_worker.Runtime("cuda"))
    lease.held = True
    lease.release()
    lease.finish()
    assert log == [("synchronize", 1), ("empty_cache", 1), ("synchronize", 1)]


def test_cpu_only_guard_disables_its_domains_and_cupti_is_finalized(fake_cupti):
    finalized = []
    fake_cupti.finalize = lambda: finalized.append(True)
    error, _ = run_cpu_only("def f():\n    return 5\n")
    assert error is None
    assert fake_cupti.domains == [3, 1] and fake_cupti.disabled == [3, 1] and not fake_cupti.subscribed
    kcoral_worker.finalize_cupti()
    kcoral_worker.finalize_cupti()  # once per use
    assert finalized == [True]


def test_tensor_export_synchronizes_first(monkeypatch):
    """A side-stream kernel may still be writing the tensor when it is copied out."""
    import torch

    class OnDevice(torch.Tensor):
        is_cuda = True

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    tensor = torch.Tensor._make_subclass(OnDevice, torch.arange(4, dtype=torch.int32))
    dtype, shape, data = kcoral_worker.tensor_bytes(tensor)
    assert (dtype, shape, bytes(data)) == ("int32", [4], numpy.arange(4, dtype="<i4").tobytes())
    assert synced == [tensor.device]


def test_numpy_arrays_encode_as_tensors_on_gpu_workers_too(monkeypatch):
    """Our extension 1 (numpy arrays are tensors on any server) holds on GPU servers too."""
    encoded = kcoral_worker.Encoder(0, 1 << 20).value(numpy.arange(3, dtype="<f4"))
    assert (encoded["type"], encoded["dtype"], encoded["shape"]) == ("tensor", "float32", [3])


def test_cute_dsl_runtime_is_preloaded_once_before_libraries(monkeypatch):
    """docs/server.md §4.2, guarded: an absent CuTe DSL is a no-op."""
    loaded, asked = [], []

    def find_runtime_libraries(enable_tvm_ffi):
        asked.append(enable_tvm_ffi)
        return ["/opt/cute/libcute_dsl_runtime.so"]

    runtime = types.ModuleType("cutlass.cute.runtime")
    runtime.find_runtime_libraries = find_runtime_libraries
    for name, module in (("cutlass", types.ModuleType("cutlass")), ("cutlass.cute", types.ModuleType("cutlass.cute")),
                         ("cutlass.cute.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(kcoral_worker.ctypes, "CDLL", lambda path, mode=0: loaded.append((path, mode)))
    monkeypatch.setattr(kcoral_worker, "_cute_preloaded", False)
    kcoral_worker.preload_cute_dsl_runtime()
    kcoral_worker.preload_cute_dsl_runtime()
    assert asked == [True] and loaded == [("/opt/cute/libcute_dsl_runtime.so", kcoral_worker.ctypes.RTLD_GLOBAL)]
    monkeypatch.setitem(sys.modules, "cutlass.cute.runtime", None)  # not installed
    monkeypatch.setattr(kcoral_worker, "_cute_preloaded", False)
    kcoral_worker.preload_cute_dsl_runtime()
    assert len(loaded) == 1


def test_cute_dsl_preload_comes_before_the_first_gpu_library_load(monkeypatch, add_one_library):
    order = []
    monkeypatch.setattr(kcoral_worker, "preload_cute_dsl_runtime", lambda: order.append("cute"))
    monkeypatch.setattr(kcoral_worker, "_library_runtimes_loaded", False)  # a worker that skipped prepare_gpu
    import tvm_ffi
    real_load = tvm_ffi.load_module
    monkeypatch.setattr(tvm_ffi, "load_module", lambda path: order.append("load") or real_load(path))
    runtime = kcoral_worker.Runtime("cuda")
    module = runtime.load_library("ab" * 32, add_one_library)
    assert order == ["cute", "load"] and module.implements_function("add_one")


def test_gpu_workers_load_tvm_and_the_cute_dsl_runtime_before_they_are_ready(monkeypatch, tmp_path):
    """Off the lease and off the request: `import tvm` and CuTe DSL's runtime load while the
    worker starts (prepare_gpu), not at a request's first library load under the lease."""
    import tvm_ffi  # noqa: F401  preloaded with the real torch, as in the template
    record = tmp_path / "loaded"
    (tmp_path / "tvm").mkdir()
    (tmp_path / "tvm" / "__init__.py").write_text(f"open({str(record)!r}, 'a').write('tvm ')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    runtime = types.ModuleType("cutlass.cute.runtime")
    runtime.find_runtime_libraries = lambda enable_tvm_ffi: open(record, "a").write("cute ") and []
    for name, module in (("cutlass", types.ModuleType("cutlass")), ("cutlass.cute", types.ModuleType("cutlass.cute")),
                         ("cutlass.cute.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "torch", fake_torch([])[0])
    monkeypatch.setattr(kcoral_worker, "_library_runtimes_loaded", False, raising=False)
    monkeypatch.setattr(kcoral_worker, "_cute_preloaded", False)
    process, conn, message = start_forked_worker("cuda", ["GPU-00000000-0000-0000-0000-000000000000"])
    try:
        assert isinstance(message, kcoral_worker.WorkerReady), message
        assert record.read_text() == "tvm cute "  # before WorkerReady, so before InitGpu and any lease
    finally:
        stop_forked_worker(process, conn)


def test_template_with_cuda_state_is_refused(monkeypatch):
    """A worker forked from a template that initialised CUDA must not start."""
    log = []
    torch, _ = fake_torch(log)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert kcoral_worker.template_cuda_problem("cuda") is None
    torch.cuda.is_initialized = lambda: True
    assert "initialised CUDA" in kcoral_worker.template_cuda_problem("cuda")
    torch.cuda.is_initialized, torch.cuda._is_in_bad_fork = (lambda: False), (lambda: True)
    assert "initialised CUDA" in kcoral_worker.template_cuda_problem("cuda")


def torch_without_nvml(log):
    """A CUDA build of torch on a host without NVML: with PYTORCH_NVML_BASED_CUDA_CHECK=1 its
    availability check fails over to cudaGetDeviceCount, which poisons every later fork."""
    torch, _ = fake_torch(log)
    poisoned = []

    def is_available():
        if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1":
            poisoned.append(True)  # NVML failed: torch._C._cuda_getDeviceCount() -> poison_fork()
        return False
    torch.cuda.is_available, torch.cuda._is_in_bad_fork = is_available, lambda: bool(poisoned)
    return torch


def start_forked_worker(device, visible=()):
    """worker_main forked from this process (the template, with whatever sys.modules holds)
    -> (process, the front-end's end of its pipe, its first message)."""
    ours, theirs = multiprocessing.Pipe()
    process = multiprocessing.get_context("fork").Process(target=kcoral_worker.worker_main,
                                                          args=(theirs, device, list(visible)), daemon=True)
    process.start()
    theirs.close()
    message, _ = kcoral_worker.receive_message(ours, deadline=time.monotonic() + 30)
    return process, ours, message


def stop_forked_worker(process, conn):
    with __import__("contextlib").suppress(OSError):
        kcoral_worker.send_message(conn, kcoral_worker.StopWorker())
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


def test_cpu_workers_start_from_a_template_whose_torch_had_no_nvml(monkeypatch):
    """A CPU compile server with the default (CUDA) torch wheel: the template's availability check
    poisoned forks, which must not stop CPU workers (GPU workers are still refused)."""
    torch = torch_without_nvml([])
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    torch.cuda.is_available()  # what `import tvm_ffi` does in the template
    process, conn, message = start_forked_worker("cpu")
    try:
        assert isinstance(message, kcoral_worker.WorkerReady), message
    finally:
        stop_forked_worker(process, conn)
    assert "initialised CUDA" in kcoral_worker.template_cuda_problem("cuda")


def test_workers_come_from_a_template_with_torch_loaded_and_cuda_untouched(server):
    """Risks 6 and 7, on the real server: torch and tvm_ffi arrive preloaded (so a fresh process per
    request costs a fork), CUDA was never initialised, and availability checks go through NVML."""
    body = run_source(server, "import os, sys, time\n"
                              "loaded = {m: m in sys.modules for m in ('torch', 'tvm_ffi')}\n"
                              "def f():\n"
                              "    import torch\n"
                              "    return {**loaded, 'initialized': torch.cuda.is_initialized(),\n"
                              "            'nvml': os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK')}\n")
    assert body["status"] == "COMPLETED", body
    assert plain(body["results"]["out"]) == {"torch": True, "tvm_ffi": True, "initialized": False, "nvml": "1"}


def test_a_reused_gpu_worker_gets_its_cuda_device_and_default_stream_back(monkeypatch):
    """docs/server.md §3.3: a program that switched the current device or stream does not leave
    that to the next request (the rest of torch's settings: tests/test_worker_lifecycle.py)."""
    import torch
    current, streams = {"device": 0}, {0: "default-0", 1: "default-1"}
    fake = {"current_device": lambda: current["device"],
            "set_device": lambda device: current.update(device=device),
            "default_stream": lambda device: f"default-{device}",
            "current_stream": lambda device: streams[device],
            "set_stream": lambda stream: streams.update({int(stream[-1]): stream})}
    for name, function in fake.items():
        monkeypatch.setattr(torch.cuda, name, function)
    settings = kcoral_worker.TorchSettings.capture()
    settings.capture_cuda()  # at InitGpu
    current["device"], streams[0] = 1, "side-stream"  # what the first request left
    kcoral_worker.reset_process_state(dict(os.environ), settings)
    assert current == {"device": 0} and streams[0] == "default-0"


def test_tvm_ffi_preparation_is_bounded_and_disables_the_slow_path(monkeypatch):
    """The add-on build runs once before the pool with its own timeout; past it, disabled."""
    monkeypatch.delenv("TVM_FFI_DISABLE_TORCH_C_DLPACK", raising=False)
    monkeypatch.setattr(kcoral, "torch_has_dlpack_exchange_api", lambda: False)
    started = time.monotonic()
    assert kcoral.prepare_template_imports(0.5, warm="import time; time.sleep(30)") == "disabled"
    assert time.monotonic() - started < 10
    assert os.environ["TVM_FFI_DISABLE_TORCH_C_DLPACK"] == "1"
    assert kcoral.prepare_template_imports(0.5) == "native"  # disabled: nothing left to build
    monkeypatch.delenv("TVM_FFI_DISABLE_TORCH_C_DLPACK")
    assert kcoral.prepare_template_imports(60, warm="pass") == "warmed"
    assert "TVM_FFI_DISABLE_TORCH_C_DLPACK" not in os.environ
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"


def test_a_tvm_ffi_build_failure_it_only_warned_about_is_not_called_warmed(monkeypatch):
    """tvm_ffi catches a failed JIT of its torch add-on and warns: the warm-up looks at the result."""
    monkeypatch.delenv("TVM_FFI_DISABLE_TORCH_C_DLPACK", raising=False)
    monkeypatch.setattr(kcoral, "torch_has_dlpack_exchange_api", lambda: False)
    events = []
    log = types.SimpleNamespace(event=lambda name, level="INFO", **fields: events.append((name, level, fields)))
    swallowed = ("import sys, torch\n"
                 "torch.Tensor = type('Tensor', (), {})  # the add-on never set its attribute\n"
                 "print('UserWarning: Failed to JIT torch c dlpack extension', file=sys.stderr)")
    assert kcoral.prepare_template_imports(60, warm=swallowed, log=log) == "disabled"
    assert os.environ["TVM_FFI_DISABLE_TORCH_C_DLPACK"] == "1"
    [(name, level, fields)] = events
    assert (name, level, fields["tvm_ffi_torch_addon"]) == ("template_prepared", "WARNING", "disabled")
    assert "not built" in fields["error"] and "Failed to JIT" in fields["error"]


def test_this_torch_exports_the_dlpack_exchange_api_itself():
    import torch
    assert kcoral.torch_has_dlpack_exchange_api() == (hasattr(torch.Tensor, "__dlpack_c_exchange_api__") or
                                                     hasattr(torch.Tensor, "__c_dlpack_exchange_api__"))


def recording_log():
    events = []
    return events, types.SimpleNamespace(event=lambda name, level="INFO", **fields: events.append((name, level, fields)))


def test_a_missing_nvidia_uvm_node_is_created_or_warned_about(monkeypatch, tmp_path):
    """A freshly booted host has no /dev/nvidia-uvm yet; the sandbox would silently show none."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").touch()
    nodes = {str(dev / "nvidiactl"): "CUDA cannot initialise", str(dev / "nvidia-uvm"): "managed memory fails"}
    monkeypatch.setattr(kcoral, "REQUIRED_GPU_NODES", nodes)
    touch = shutil.which("touch")
    monkeypatch.setenv("PATH", str(tmp_path / "no-driver-tools"))
    events, log = recording_log()
    assert kcoral.ensure_gpu_control_nodes(log) == [str(dev / "nvidia-uvm")]
    [(name, level, fields)] = events
    assert (name, level, fields["node"]) == ("gpu_device_node_missing", "WARNING", str(dev / "nvidia-uvm"))
    assert "managed memory" in fields["effect"] and "nvidia-modprobe -u -c=0" in fields["remedy"]
    tools = tmp_path / "driver-tools"  # nvidia-modprobe, as the driver runs it, creates the node
    tools.mkdir()
    (tools / "nvidia-modprobe").write_text(f"#!/bin/sh\n[ \"$1 $2\" = '-u -c=0' ] && {touch} {dev / 'nvidia-uvm'}\n")
    (tools / "nvidia-modprobe").chmod(0o755)
    monkeypatch.setenv("PATH", str(tools))
    events.clear()
    assert kcoral.ensure_gpu_control_nodes(log) == [] and events == []
    assert (dev / "nvidia-uvm").exists()


# --- quarantine, multi-GPU start-up, shutdown --------------------------------------

def test_kill_group_reports_a_tree_it_cannot_confirm_gone(monkeypatch):
    monkeypatch.setattr(kcoral_worker, "group_members", lambda pgid, exclude=(): [4194001])  # never goes away
    started = time.monotonic()
    assert kcoral_worker.kill_group(4194001, 0.05, kill_wait=0.1) is False
    assert time.monotonic() - started < 5
    monkeypatch.setattr(kcoral_worker, "group_members", lambda pgid, exclude=(): [])
    assert kcoral_worker.kill_group(4194001, 0.05) is True


def test_unconfirmed_kill_quarantines_the_gpu():
    """docs/server.md §2.1: after a kill it cannot confirm, the GPU is never lent again (the request: 500 engine)."""
    pool = fake_pool()

    def script(conn):
        kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(0))
        time.sleep(1)

    outcome, retire, _ = execution(pool, script, timeout=0.2, gone=False)
    assert (outcome.http_status, outcome.kind, retire) == (500, "engine", True)
    assert pool.quarantined == [[0]] and pool.arbiter.holder[0] is None
    with pytest.raises(kcoral.LeaseRefused, match="quarantined"):
        pool.arbiter.acquire("next", [0])


def test_a_killed_process_still_in_its_exit_runs_no_code_again(monkeypatch):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert not kcoral_worker.killed_already(sleeper.pid)  # alive, nothing pending
        stat = kcoral_worker.proc_stat(sleeper.pid)
        exiting = stat[:6] + [str(int(stat[6]) | kcoral_worker.PF_EXITING).encode()] + stat[7:]
        monkeypatch.setattr(kcoral_worker, "proc_stat", lambda pid: exiting)  # as the kernel shows one in its exit
        assert kcoral_worker.killed_already(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    monkeypatch.undo()
    assert kcoral_worker.killed_already(sleeper.pid)  # gone


def test_a_worker_left_only_in_its_exit_is_marked_and_not_waited_for_twice(monkeypatch):
    """Worker.kill: past kill_wait, survivors all killed already -> `exiting`; its disposal after
    the answer then kills (and waits) no more."""
    waits, survivors = [], [4194001]
    monkeypatch.setattr(kcoral, "kill_group", lambda pgid, grace, orphans=False: waits.append(pgid) or False)
    monkeypatch.setattr(kcoral, "tree_members", lambda pgid, exclude=(), orphans=False: survivors)
    monkeypatch.setattr(kcoral, "killed_already", lambda pid: pid == 4194001)
    worker = object.__new__(kcoral.Worker)
    worker.pid, worker.template, worker.exiting, worker.process = 4194000, None, False, FakeProcess()
    worker.halted = False  # not halted before its kill
    worker.conn = types.SimpleNamespace(close=lambda: None)
    assert worker.kill(0.1, orphans=True) is False and worker.exiting
    assert worker.kill(0) is False and waits == [4194000]  # the second kill did not wait again
    survivors.append(4194002)  # one that could still run code: no slow exit, but a lost tree
    fresh = object.__new__(kcoral.Worker)
    fresh.pid, fresh.template, fresh.exiting, fresh.process, fresh.conn = 4194000, None, False, FakeProcess(), worker.conn
    fresh.halted = False
    assert fresh.kill(0) is False and not fresh.exiting


def spinning_kernel(conn):
    kcoral_worker.send_message(conn, kcoral_worker.InstructionStarted(0))
    time.sleep(1)  # busy past the timeout


def test_a_worker_still_in_its_exit_after_the_kill_is_a_timeout_not_a_quarantine():
    """A kernel spinning at the kill keeps the driver tearing the context down past kill_wait: the
    request gets its 504 and the GPU stays in service (the replacement's start probes it)."""
    pool = fake_pool()
    outcome, retire, _ = execution(pool, spinning_kernel, timeout=0.2, gone=False, exiting=True)
    assert (outcome.http_status, outcome.kind, retire) == (504, "timeout", True)
    assert pool.quarantined == [] and pool.arbiter.acquire("next", [0])[0] == [0]


@pytest.mark.parametrize("exiting, probe_fails, quarantined, replaced",
                         [(True, False, [], True),  # slow exit, the GPU answers: the slot is replaced
                          (True, True, [[0]], False),  # slow exit, the GPU fails its probe: quarantined
                          (False, False, [[0]], False)])  # a tree that outlived SIGKILL: quarantined, no probe
def test_after_a_slow_exit_the_next_workers_start_probes_the_gpu(monkeypatch, exiting, probe_fails, quarantined,
                                                                  replaced):
    pool, slot = spare_pool(monkeypatch)
    pool.end_worker = types.MethodType(kcoral.Pool.end_worker, pool)
    if probe_fails:
        def initialize(self, expected_uuid, step_timeout=60.0):
            raise kcoral.WorkerCrashed("GPU worker failed to initialize: CUDA error: unknown error")
        monkeypatch.setattr(FakeSlotWorker, "initialize", initialize)
    retired = slot.worker
    retired.gone, retired.exiting = False, exiting
    pool.release(slot, True)
    assert wait_for(lambda: slot in pool.idle, 5)
    assert pool.quarantined == quarantined and retired.killed
    assert (slot.worker is not None and slot.worker is not retired) == replaced
    if replaced:  # its CUDA start ran under the GPU's lease
        assert pool.inits == [{0: kcoral.STARTUP_OWNER}]


def test_quarantine_refuses_waiters_already_queued():
    arbiter, refused = kcoral.LeaseArbiter([0, 1]), []
    arbiter.acquire("holder", [0])

    def wait(**kwargs):
        try:
            arbiter.acquire("waiter", **kwargs)
        except kcoral.LeaseRefused as exc:
            refused.append(str(exc))
    threads = [threading.Thread(target=wait, kwargs=k, daemon=True) for k in ({"gpus": [0]}, {"count": 2})]
    for n, thread in enumerate(threads):
        thread.start()
        assert wait_for(lambda n=n: queued(arbiter) == n + 1, 5)
    arbiter.quarantine([0])
    join_threads(threads, 5)
    assert len(refused) == 2 and queued(arbiter) == 0
    assert arbiter.acquire("other", [1])[0] == [1]  # the healthy GPU still serves


def test_waits_for_n_gpus_run_at_shutdown_and_end_at_a_quarantine(monkeypatch):
    """A graceful shutdown lets an admitted request waiting for "any n" GPUs run once the leases
    before it are released (no client sees a 503 for a request the node took); a quarantine's
    drain refuses such a wait (503 busy: its GPUs may never be free again)."""
    for refuse_queued in (False, True):
        pool = object.__new__(kcoral.Pool)
        pool.arbiter, pool.cond = kcoral.LeaseArbiter([0, 1]), threading.Condition()
        pool.closing = pool.refusing = False
        pool.config = kcoral.ServerConfig()
        monkeypatch.setattr(pool, "run_dedicated_worker",
                            lambda job, gpus, wait_ms, queue_ms, template: kcoral.Outcome(body={"gpus": gpus}))
        pool.arbiter.acquire("busy", [0])
        job = kcoral.Job("big", kcoral.ValidProgram([], {"gpu_count": 2}, {}, []), {}, timeout=10.0, output_limit=0)
        outcomes = []
        thread = threading.Thread(target=lambda: outcomes.append(pool.run_multi_gpu(None, job, 2, 0.0)), daemon=True)
        thread.start()
        assert wait_for(lambda: queued(pool.arbiter) == 1, 5)
        pool.drain(refuse_queued=refuse_queued)
        if refuse_queued:
            join_threads([thread], 5)
            assert (outcomes[0].http_status, outcomes[0].kind) == (503, "busy")
            assert pool.arbiter.acquire("in-flight", [1])[0] == [1]  # a running request's own lease still works
        else:
            time.sleep(0.3)  # not a synchronisation: the time a wrong refusal would have to show
            assert thread.is_alive() and not outcomes  # still waiting, not refused
            pool.arbiter.release("busy", [0])
            join_threads([thread], 5)
            assert (outcomes[0].http_status, sorted(outcomes[0].body["gpus"])) == (200, [0, 1])


@pytest.mark.parametrize("failure, status, kind", [(kcoral.WorkerStartTimeout, 504, "timeout"),
                                                   (kcoral.WorkerCrashed, 500, "engine")])
def test_multi_gpu_start_up_failures(monkeypatch, failure, status, kind):
    pool = object.__new__(kcoral.Pool)
    pool.arbiter, pool.gpu_names = kcoral.LeaseArbiter([0, 1]), {0: "0", 1: "1"}
    pool.config = kcoral.ServerConfig()
    phases = []

    def worker(pool_, gpus, step_timeout, template=None):
        phases.append(step_timeout)
        raise failure("did not start")
    monkeypatch.setattr(kcoral, "Worker", worker)
    job = kcoral.Job("r", kcoral.ValidProgram([], {"gpu_count": 2}, {}, []), {}, timeout=3.0, output_limit=0)
    outcome = pool.run_multi_gpu(None, job, 2, 0.0)
    assert (outcome.http_status, outcome.kind) == (status, kind)
    assert phases == [3.0]  # bounded by the request's timeout, not 60 s
    assert pool.arbiter.holder == {0: None, 1: None}


class FakeSandboxTemplate:
    """Records which GPUs a container was started for, and who held their leases then."""
    started = []

    def __init__(self, config, device, gpus):
        self.gpus, self.killed = list(gpus), False
        self.started.append((self, dict(self.arbiter.holder)))

    def kill(self):
        self.killed = True


@pytest.mark.parametrize("held, release, expected, granted", [([0], (), [1, 2], [1, 2]),
                                                              ([0, 1, 2], (2, 1), [0, 1], [1, 2])])
def test_a_multi_gpu_sandbox_starts_before_the_leases_are_waited_for(monkeypatch, held, release, expected, granted):
    """The container's start (seconds) must not happen under n leases that other requests wait for."""
    pool = object.__new__(kcoral.Pool)
    pool.arbiter, pool.gpu_names = kcoral.LeaseArbiter([0, 1, 2]), {0: "0", 1: "1", 2: "2"}
    pool.config, pool.device = kcoral.ServerConfig(sandbox="bubblewrap"), "cuda"
    for g in held:
        pool.arbiter.acquire(f"busy-{g}", [g])
    for g in release:  # the GPUs expected busy free up after others
        threading.Timer(0.3, pool.arbiter.release, (f"busy-{g}", [g])).start()
    monkeypatch.setattr(FakeSandboxTemplate, "started", [])
    monkeypatch.setattr(FakeSandboxTemplate, "arbiter", pool.arbiter, raising=False)
    monkeypatch.setattr(kcoral, "SandboxTemplate", FakeSandboxTemplate)
    workers = []

    def worker(pool_, gpus, step_timeout, template=None):
        workers.append((list(gpus), template))
        raise kcoral.WorkerCrashed("did not start")
    monkeypatch.setattr(kcoral, "Worker", worker)
    job = kcoral.Job("r", kcoral.ValidProgram([], {"gpu_count": 2}, {}, []), {}, timeout=10.0, output_limit=0)
    outcome = pool.run_multi_gpu(None, job, 2, 0.0)
    assert (outcome.http_status, outcome.kind) == (500, "engine")
    first, holders = FakeSandboxTemplate.started[0]
    assert first.gpus == expected and all(holders[g] != "r" for g in expected)  # before any lease of ours
    used_gpus, used = workers[0]
    assert used_gpus == granted and used.gpus == granted  # the container shows the granted GPUs
    assert all(t.killed for t, _ in FakeSandboxTemplate.started)


class FakeSlotWorker:
    """A started worker as the pool sees it: initialize() records who held the GPU's lease then."""

    def __init__(self, pool, gpus, step_timeout=60.0, template=None):
        self.pool, self.gpus, self.template, self.served, self.killed = pool, gpus, template, 0, False
        self.gone, self.exiting = True, False

    def initialize(self, expected_uuid, step_timeout=60.0):
        self.pool.inits.append(dict(self.pool.arbiter.holder))

    def kill(self, grace, orphans=False):
        self.killed = True
        return self.gone


def spare_pool(monkeypatch):
    monkeypatch.setattr(kcoral, "Worker", FakeSlotWorker)
    pool = object.__new__(kcoral.Pool)
    pool.config = kcoral.ServerConfig(sandbox="none")
    pool.arbiter, pool.gpu_names, pool.inits, pool.closing = kcoral.LeaseArbiter([0]), {0: "0"}, [], False
    pool.cond, pool.idle, pool.replacing, pool.quarantined = threading.Condition(), [], set(), []
    pool.helpers = kcoral.Helpers()
    pool.waiters = kcoral.FairQueue()
    pool.in_progress, pool.running = 1, collections.Counter({"": 1})  # the request whose slot is released
    pool.log = types.SimpleNamespace(event=lambda *a, **k: None, metrics=kcoral.Metrics())
    pool.quarantine = lambda gpus, reason: pool.quarantined.append(list(gpus))
    slot = kcoral.Slot("gpu0/w0", [0])
    slot.worker = FakeSlotWorker(pool, [0])
    return pool, slot


def test_a_spare_gpu_worker_creates_its_context_once_the_request_is_done_with_the_gpu(monkeypatch):
    """docs/server.md §1.3: the spare starts with the request; its CUDA context waits for the GPU."""
    pool, slot = spare_pool(monkeypatch)
    pool.start_spare(slot, threading.Event())  # its answer not written: the fork waits SPARE_DELAY_SECONDS
    assert slot.spare is not None
    pool.arbiter.acquire("the-request", [0])  # the running request uses its GPU
    # started (host work), and now waiting for the GPU: a waiter on the event the request sets (CPython's Event)
    assert wait_for(lambda: slot.spare.request_done._cond._waiters, 5), "the spare never waited for the GPU"
    assert pool.inits == []  # context not yet
    pool.arbiter.release("the-request", [0])
    slot.spare.request_done.set()  # Pool.run_job, once the request's execution is over
    spare = slot.spare.take()
    assert pool.inits == [{0: kcoral.STARTUP_OWNER}]
    retired = slot.worker
    pool.release(slot, True)
    assert wait_for(lambda: slot in pool.idle, 5)
    assert retired.killed and slot.worker is spare and not spare.killed


def test_a_retired_gpu_worker_not_confirmed_gone_leaves_its_slot_without_the_spare(monkeypatch):
    pool, slot = spare_pool(monkeypatch)
    pool.start_spare(slot, threading.Event())  # its answer not written: the fork waits SPARE_DELAY_SECONDS
    slot.spare.request_done.set()
    spare = slot.spare.take()
    slot.worker.gone = False  # its tree outlived SIGKILL
    pool.end_worker = types.MethodType(kcoral.Pool.end_worker, pool)
    pool.release(slot, True)
    assert wait_for(lambda: slot in pool.idle, 5)
    assert pool.quarantined == [[0]] and slot.worker is None and spare.killed


def cpu_spare_pool(monkeypatch):
    """spare_pool's pool without GPUs: a CPU server's slot and its spare."""
    pool, _ = spare_pool(monkeypatch)
    pool.arbiter, pool.gpu_names = None, {}
    slot = kcoral.Slot("cpu/w0", [])
    slot.worker = FakeSlotWorker(pool, [])
    return pool, slot


def test_a_cpu_slot_serves_with_its_spare_while_the_retired_worker_is_disposed_of(monkeypatch):
    """docs/server.md §1.3: on CPU no GPU waits on the disposal's verdict, so the retired worker's exit
    does not hold its slot; on GPU it does (the test above)."""
    pool, slot = cpu_spare_pool(monkeypatch)
    pool.start_spare(slot, threading.Event())
    spare, retired, exited = slot.spare.take(), slot.worker, threading.Event()

    def slow_exit(grace, orphans=False):
        exited.wait(30)
        retired.killed = True
        return True
    retired.kill = slow_exit
    pool.release(slot, True)
    assert wait_for(lambda: slot in pool.idle, 5), "the slot waited for the retired worker's exit"
    assert slot.worker is spare and not retired.killed and pool.replacing  # the disposal still under way
    exited.set()
    assert wait_for(lambda: not pool.replacing, 5)
    assert retired.killed and not spare.killed


def test_a_spare_forks_at_once_when_a_request_is_queued(monkeypatch):
    """docs/server.md §1.3: alone, a spare waits for its request's answer before it forks; with a request
    queued for a slot, the next request is certain and the spare forks at once."""
    monkeypatch.setattr(kcoral, "SPARE_DELAY_SECONDS", 30.0)
    pool, slot = cpu_spare_pool(monkeypatch)
    answered = threading.Event()
    pool.start_spare(slot, answered)
    time.sleep(0.2)
    assert slot.spare.worker is None  # waiting for the answer
    answered.set()
    assert slot.spare.take() is not None
    pool.waiters.add("someone", 0)
    queued_slot = kcoral.Slot("cpu/w1", [])
    queued_slot.worker = FakeSlotWorker(pool, [])
    pool.start_spare(queued_slot, threading.Event())  # its answer never written
    assert wait_for(lambda: queued_slot.spare.worker is not None, 5), "the spare waited for the answer"
