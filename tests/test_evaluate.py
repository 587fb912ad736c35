"""kcoral.builtins.evaluate (docs/evaluate.md) against a real CPU server: every cheat of the
threat model caught or flagged, honest candidates measured as `benchmark` measures them, and
the pure parts (statistics, GPU condition flags, the channel's validation) on their own.

Most kernels are NumPy, so a kernel process starts in a fraction of a second (torch is only
imported where an input or the kernel needs it).  Cheats that must show the harness they fool
run in the naive harness too (the candidate called in the evaluating process, then check_close
and benchmark), where they do fool it."""

import json
import math
import mmap
import os
import re
import socket
import struct
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import pytest

import kcoral_worker
from kcoral import Client, Program
from tests.support import PYTHON, ROOT, ServerProcess

HARNESS = '''
import numpy
from kcoral.builtins import benchmark, check_close, evaluate

N = 4096
REFERENCE = """
import numpy

def kernel(x, y):
    return numpy.sqrt(x) * y + 1.0
"""


def make_inputs(seed):
    rng = numpy.random.default_rng(seed)
    return rng.random(N, dtype=numpy.float32), rng.random(N, dtype=numpy.float32)


def judge(candidate, options):
    return evaluate(candidate, REFERENCE, make_inputs, **options)


def naive(candidate):
    """The harness evaluate replaces: the candidate run in this very process."""
    namespace, reference = {}, {}
    exec(REFERENCE, reference)
    x, y = make_inputs(12345)
    expected = reference["kernel"](x, y)
    exec(candidate, namespace)
    out = namespace["kernel"](x, y)
    timing = benchmark(namespace["kernel"], x, y, {"warmup": 2, "repeat": 5, "flush_l2": False})
    return {"ok": check_close(out, expected)["ok"], "latency_ms": timing["latency_ms_median"]}


SUM_REFERENCE = "def kernel(x, scale):\\n    return float((x * scale).sum())\\n"


def judge_sum(candidate):
    """A kernel of a tensor and a JSON number that returns a Python number."""
    return evaluate(candidate, SUM_REFERENCE, lambda seed: (make_inputs(seed)[0].astype(numpy.float64), 2.5),
                    budget_ms=300, min_rounds=5)


def repeated(times):
    """A kernel of `times` units of work, ~0.5 ms each here: compute-bound on 16K floats, so its
    inputs and outputs (64 KiB) cost little to exchange next to it."""
    return (f"import numpy\\n\\ndef kernel(x):\\n    for _ in range({60 * times}):\\n        out = numpy.sin(x)\\n"
            "    return out\\n")


def small_inputs(seed):
    return numpy.random.default_rng(seed).random(1 << 14, dtype=numpy.float32)


def race(times, options):
    """evaluate's `times`-unit candidate against a 2-unit reference, and benchmark's view of both,
    measured here in the worker: in each of 9 rounds the fastest of 10 calls of each, side by side
    (warm cache on both sides; on a loaded machine the least disturbed call is the steadiest
    figure), and the median of the rounds' ratios, so that a slowdown of the machine lasting a few
    rounds (a busy sibling hyperthread) slows both kernels of a round, not one kernel's every call."""
    verdict = evaluate(repeated(times), repeated(2), small_inputs, **options)
    x, config = small_inputs(1), {"warmup": 2, "repeat": 10, "flush_l2": False}
    kernels = {}
    for name, source in (("reference", repeated(2)), ("candidate", repeated(times))):
        namespace = {}
        exec(source, namespace)
        kernels[name] = namespace["kernel"]
    ratios = []
    for _ in range(9):
        fastest = {name: benchmark(kernel, x, config)["latency_ms_min"] for name, kernel in kernels.items()}
        ratios.append(fastest["reference"] / fastest["candidate"])
    return {"verdict": verdict, "benchmark_speedup": sorted(ratios)[len(ratios) // 2], "ratios": ratios}
'''

QUICK = {"warmup_ms": 20, "budget_ms": 300, "min_rounds": 5}  # cheats are caught before timing matters

HONEST = "import numpy\n\ndef kernel(x, y):\n    return numpy.sqrt(x) * y + 1.0\n"

REPLAY = """
import numpy

last = None

def kernel(x, y):
    global last
    if last is None:
        last = numpy.sqrt(x) * y + 1.0
    return last
"""

WRITES_ITS_INPUT = """
import numpy

def kernel(x, y):
    x[:] = numpy.sqrt(x) * y + 1.0  # in a shared harness, where the check reads
    return x
"""

LAZY = """
import numpy

class Lazy:
    def __init__(self, x, y):
        self.x, self.y, self.shape, self.dtype = x, y, x.shape, x.dtype

    def __array__(self, dtype=None, copy=None):
        return numpy.sqrt(self.x) * self.y + 1.0

    def __eq__(self, other):
        return True

def kernel(x, y):
    return Lazy(x, y)
"""

LAZY_SUBCLASS = """
import numpy

class Deferred(numpy.ndarray):
    pass

def kernel(x, y):
    return (numpy.sqrt(x) * y + 1.0).view(Deferred)
"""

ALL_NAN = "import numpy\n\ndef kernel(x, y):\n    return numpy.full_like(x, numpy.nan)\n"

PATCHES_THE_TIMERS = """
import sys
import time

import numpy

time.perf_counter = lambda: 0.0
time.monotonic = lambda: 0.0
time.perf_counter_ns = time.monotonic_ns = lambda: 0
for name in ("kcoral_worker", "kcoral.builtins"):  # and evaluate's own timer, wherever it is loaded
    if hasattr(sys.modules.get(name), "timed_call"):
        sys.modules[name].timed_call = lambda process, inputs, echo=False: (process.call(inputs, echo), 0.0)

def kernel(x, y):
    time.sleep(0.003)  # slow, and says it took no time at all
    return numpy.sqrt(x) * y + 1.0
"""

BACKGROUND_THREAD = """
import threading
import time

import numpy

def kernel(x, y):
    out = numpy.zeros_like(x)

    def finish():
        time.sleep(0.002)
        out[:] = numpy.sqrt(x) * y + 1.0
    threading.Thread(target=finish).start()
    return out  # "done" at once; the work lands later
"""

DETECTS_TIMING = """
import numpy

calls = 0

def kernel(x, y):
    global calls
    calls += 1
    if calls <= {honest_calls}:  # the correctness checks (and warm-up): do the work
        return numpy.sqrt(x) * y + 1.0
    return numpy.empty_like(x)  # what it guesses are the timed calls: skip it
"""

READS_THE_REFERENCE = """
import gc
import sys

import numpy

def found(x, y):
    frame = sys._getframe(2)
    while frame is not None:  # the harness's frames: its locals
        yield from list(frame.f_locals.values())
        frame = frame.f_back
    for obj in gc.get_objects():  # every container: module globals, the harness's lists
        if isinstance(obj, dict):
            yield from list(obj.values())
        elif isinstance(obj, list):
            yield from list(obj)

def kernel(x, y):
    for value in found(x, y):
        if (isinstance(value, numpy.ndarray) and value.shape == x.shape and value is not x and value is not y
                and value.min() >= 1.0):  # the reference's answer: sqrt(x) * y + 1
            return value.copy()
    return numpy.zeros_like(x)
"""

FIRST_INPUT_SET_ONLY = """
import numpy

calls = 0

def kernel(x, y):
    global calls
    calls += 1
    out = numpy.sqrt(x) * y + 1.0
    if calls > 1:
        out[len(out) // 2:] = 1.0  # half the work once the first check has passed
    return out
"""

KNOWS_A_SEED = """
import numpy

N = 4096
rng = numpy.random.default_rng(0)  # a harness that always uses seed 0
x0, y0 = rng.random(N, dtype=numpy.float32), rng.random(N, dtype=numpy.float32)
answer = numpy.sqrt(x0) * y0 + 1.0

def kernel(x, y):
    return answer
"""

FORGES_A_FRAME = """
import json
import os
import struct
import subprocess
import sys
import time

SHAPE, ADDRESSES = [1 << 40], struct.pack("<Q", 4096).hex()

def kernel(x, y):
    frame = json.dumps({"type": "EvalDone", "error": None, "forms": [{"kind": "numpy", "dtype": "float32",
                        "shape": SHAPE, "device": "cpu"}], "calls": [[0]], "addresses": ADDRESSES}).encode()
    os.write(int(sys.argv[2]), struct.pack("!I", len(frame)) + frame)  # the channel's descriptor
    time.sleep(60)
"""

KILLS_ITSELF = "import os, signal\n\ndef kernel(x, y):\n    os.kill(os.getpid(), signal.SIGKILL)\n"

HANGS = "import time\n\ndef kernel(x, y):\n    time.sleep(60)\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess("--sandbox", "none", workers=2, tmp_path=tmp_path_factory.mktemp("evaluate")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url) as client:
        yield client


def call(client, name, *args):
    """HARNESS's `name`(*args) in a fresh worker -> what it returned."""
    program = Program()
    harness = program.upload(kind="module", source=HARNESS)
    program.return_(key="out", value=program.run(fn=program.get_function(module=harness, name=name), args=list(args)))
    result = client.execute(program, timeout_seconds=120)
    assert result.completed, result.error
    return result["out"]


def judge(client, candidate, **options):
    return call(client, "judge", candidate, {**QUICK, **options})


def assert_fails(verdict, status, *phrases):
    assert verdict["status"] == status and verdict["correct"] is False, verdict
    assert verdict["timing"] is None, "a failing candidate is never timed"
    for phrase in phrases:
        assert phrase in verdict["message"], verdict["message"]


# --- the cheats -------------------------------------------------------------------------------

def test_an_honest_candidate_passes(client):
    verdict = judge(client, HONEST)
    assert verdict["status"] == "correct" and verdict["correct"] is True, verdict
    assert len(verdict["seeds"]) == len(verdict["checks"]) == 3 and len(set(verdict["seeds"])) == 3
    assert all(check["ok"] and check["outputs"][0]["mismatches"] == 0 for check in verdict["checks"])
    assert verdict["checks"][0]["outputs"][0]["rtol"] == 1.3e-6  # float32's default tolerance
    timing = verdict["timing"]  # microsecond kernels: the speedup may be below the harness's resolution (None)
    assert timing["rounds"] >= 3 and len(timing["samples_ms"]["reference"]) == timing["rounds"]
    assert (timing["speedup"] is None) == ("below_resolution" in verdict["flags"])
    assert "foreign_processes" not in verdict["flags"]  # the worker's own descendants are the two kernels


def test_replaying_the_previous_output_is_caught(client):
    assert_fails(judge(client, REPLAY), "incorrect", "output 0 on input set 2", "; worst [")


def test_writing_the_answer_into_an_input_is_caught(client):
    assert_fails(judge(client, WRITES_ITS_INPUT), "incorrect", "the candidate modified its tensor argument 0")


@pytest.mark.parametrize("source, name", [(LAZY, "a Lazy"), (LAZY_SUBCLASS, "a Deferred")], ids=["object", "subclass"])
def test_a_lazy_output_is_refused(client, source, name):
    assert_fails(judge(client, source), "error", f"output 0 is {name}, not a torch.Tensor, a numpy.ndarray")


def test_nan_everywhere_is_caught(client):
    verdict = judge(client, ALL_NAN)
    assert_fails(verdict, "incorrect", "4096 of 4096 elements differ")
    assert verdict["mismatch"]["worst"]["actual"] == "nan" and verdict["message"].count("worst") == 1


def test_patching_the_timers_forges_nothing(client):
    """It fools the naive harness (benchmark reads the patched clock: 0 ms); evaluate's clock is in
    another process, so the 3 ms sleep shows."""
    assert call(client, "naive", PATCHES_THE_TIMERS) == {"ok": True, "latency_ms": 0.0}
    verdict = judge(client, PATCHES_THE_TIMERS, budget_ms=1000, min_rounds=10)
    assert verdict["status"] == "correct", verdict
    timing = verdict["timing"]  # the reference takes microseconds: on a loaded machine, below the echo's noise
    assert timing["candidate_ms"] > 2 and (timing["speedup"] is None or timing["speedup"] < 1), timing


def test_finishing_on_a_background_thread_is_caught(client):
    """Its outputs are read as the call returns, so they are zeros; if the thread ever wins that race
    (a loaded machine), its work landed before the outputs left, inside the timed window."""
    verdict = judge(client, BACKGROUND_THREAD)
    if verdict["status"] == "correct":
        assert verdict["timing"]["candidate_ms"] > 1.5, verdict["timing"]
    else:
        assert verdict["status"] == "incorrect" and "elements differ" in verdict["message"], verdict


@pytest.mark.parametrize("honest_calls", [3, 6], ids=["after-the-checks", "in-the-race"])
def test_behaving_differently_when_timed_is_caught(client, honest_calls):
    """Every call of the race is checked against the reference's on the same inputs, and a warm-up
    call is indistinguishable from a timed one.  (A race has at least 2 warm-up and 3 timed rounds:
    the 7th call is in it.)"""
    verdict = judge(client, DETECTS_TIMING.format(honest_calls=honest_calls))
    assert verdict["status"] == "incorrect" and verdict["timing"] is None, verdict
    assert " round " in verdict["message"] and "against the reference on the same inputs" in verdict["message"]


def test_reading_the_reference_answer_from_memory_is_caught(client):
    """Through frames and gc it finds the answer in the naive harness; in its own process there is none."""
    assert call(client, "naive", READS_THE_REFERENCE)["ok"] is True
    assert_fails(judge(client, READS_THE_REFERENCE), "incorrect", "on input set 1")


def test_correct_only_for_the_first_input_set_is_caught(client):
    assert_fails(judge(client, FIRST_INPUT_SET_ONLY), "incorrect", "on input set 2")


def test_knowing_a_seed_in_advance_is_useless(client):
    assert call(client, "naive", KNOWS_A_SEED)["ok"] is False  # the naive harness's seed, 12345, is not 0 either
    assert_fails(judge(client, KNOWS_A_SEED), "incorrect", "on input set 1")


@pytest.mark.parametrize("shape, addresses, why", [
    ("[1 << 40]", 'struct.pack("<Q", 4096).hex()', "values of more than 1073741824 bytes"),
    ("[4]", '"zz"', "results described as [[0]] at 'zz'"),
    ("[4]", 'struct.pack("<2Q", 4096, 8192).hex()', "results described as [[0]] at '0010"),
], ids=["too-large", "not-hex", "two-addresses-for-one-result"])
def test_a_forged_frame_on_the_channel_is_refused(client, shape, addresses, why):
    forged = FORGES_A_FRAME.replace("SHAPE, ADDRESSES = ", f"SHAPE, ADDRESSES = {shape}, {addresses}  # ", 1)
    assert_fails(judge(client, forged), "error", "the candidate's process broke the channel", why)


def test_a_candidate_that_dies_or_hangs_is_an_error_and_the_server_carries_on(client):
    assert_fails(judge(client, KILLS_ITSELF), "error", "the candidate's process died (killed by signal 9)")
    assert_fails(judge(client, HANGS, call_timeout_s=1), "error", "the candidate did not answer within 1 s")
    assert judge(client, HONEST, timing=False)["status"] == "correct"


def test_json_arguments_and_a_number_returned(client):
    honest = call(client, "judge_sum", "import numpy\n\ndef kernel(x, scale):\n    return float(numpy.sum(x) * scale)\n")
    assert honest["status"] == "correct", honest
    assert honest["checks"][0]["outputs"][0]["shape"] == [] and honest["checks"][0]["outputs"][0]["dtype"] == "float64"
    off = call(client, "judge_sum", "def kernel(x, scale):\n    return float(x.sum() * scale) + 1.0\n")
    assert off["status"] == "incorrect" and "1 of 1 elements differ" in off["message"], off


def test_a_candidate_that_does_not_load_is_an_error(client):
    assert_fails(judge(client, "def kernel(:\n"), "error", "the candidate raised syntax error")
    assert_fails(judge(client, "def other(x, y):\n    return x\n"), "error", "no function 'kernel'")


def test_cuda_graph_mode_needs_cuda_tensors(client):
    assert_fails(judge(client, HONEST, cuda_graph=True), "error", "cuda_graph needs CUDA tensors")


def test_a_function_object_is_refused_as_candidate(client):
    program = Program()
    source = "from kcoral.builtins import evaluate\n\ndef f():\n    return evaluate(f, 'x', lambda seed: 1)\n"
    program.run(fn=program.get_function(module=program.upload(kind="module", source=source), name="f"))
    result = client.execute(program)
    assert result.error["kind"] == "engine" and "source text" in result.error["message"]


# --- honest candidates: the race against benchmark ---------------------------------------------

MARGIN = 1.25  # how far outside evaluate's interval a ratio may lie: benchmark's calls lack a fixed ~0.1 ms of evaluate's


@pytest.mark.parametrize("times", [2, 1, 4], ids=["equal", "faster", "slower"])
def test_honest_speedups_agree_with_benchmark(client, times):
    """A candidate of 1, 2 or 4 units of work against a 2-unit reference: benchmark's speedup (the
    median of side-by-side rounds, in the same worker) lies in evaluate's interval, widened by
    MARGIN, and the estimate says which is faster.  How narrow the interval gets depends on the
    machine's load: the race runs until its relative standard error is 2%, or 3 s."""
    out = call(client, "race", times, {"budget_ms": 3000, "target_rse": 0.02})
    verdict, measured = out["verdict"], out["benchmark_speedup"]
    assert verdict["status"] == "correct", verdict
    timing = verdict["timing"]
    low, high = timing["speedup_ci"]
    high = math.inf if high is None else high
    shown = (measured, timing["speedup"], low, high, timing["rounds"], timing["stopped"], out["ratios"])
    assert low / MARGIN <= measured <= high * MARGIN, shown
    assert {2: 0.5 < timing["speedup"] < 2, 1: timing["speedup"] > 1, 4: timing["speedup"] < 1}[times], shown
    assert ("within_noise" in verdict["flags"]) == (low <= 1 <= high), verdict["flags"]
    assert len(timing["samples_ms"]["candidate"]) == len(timing["samples_ms"]["echo"]) == timing["rounds"]
    assert timing["timer"] == "host" and timing["device"] == "cpu" and "gpu" not in timing


def test_an_implausible_speedup_is_flagged(client):
    verdict = call(client, "race", 1, {"budget_ms": 500, "implausible_speedup": 1.0})["verdict"]  # 2x faster, so "implausible"
    assert "implausible_speedup" in verdict["flags"] and verdict["status"] == "correct", verdict


def test_in_the_sandbox(tmp_path):
    """Kernel processes start inside a request's container too (python -I, the server's files
    read-only), and catch what they catch unsandboxed."""
    with ServerProcess("--sandbox", "bubblewrap", workers=1, tmp_path=tmp_path) as srv, Client(srv.url) as sandboxed:
        honest = judge(sandboxed, HONEST)
        assert honest["status"] == "correct" and "foreign_processes" not in honest["flags"], honest
        assert judge(sandboxed, READS_THE_REFERENCE)["status"] == "incorrect"


def judge_script():
    """The script docs/cli.md shows for `kcoral run python`, as it is written there."""
    with open(os.path.join(ROOT, "docs", "cli.md"), encoding="utf-8") as f:
        return re.search(r"```\n(# judge\.py, run on the server\n.*?)```", f.read(), re.S).group(1)


@pytest.mark.parametrize("candidate, status, code", [
    ("import numpy\n\ndef kernel(x):\n    return numpy.sort(x, kind='mergesort')\n", "correct", 0),
    ("import numpy\n\ndef kernel(x):\n    return x\n", "incorrect", 1),
], ids=["honest", "unsorted"])
def test_from_a_kcoral_run_script(server, tmp_path, candidate, status, code):
    (tmp_path / "judge.py").write_text(judge_script())
    (tmp_path / "candidate.py").write_text(candidate)
    done = subprocess.run([PYTHON, os.path.join(ROOT, "client.py"), "run", "python", "--url", server.url,
                           "--send", "judge.py", "--send", "candidate.py", "--fetch", "verdict.json", "--out", "results",
                           "--", "judge.py", "candidate.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == code and done.stdout.startswith(f"{status} "), done.stdout + done.stderr
    assert json.loads((tmp_path / "results" / "verdict.json").read_text())["status"] == status


# --- the pure parts, in this process ------------------------------------------------------------

@pytest.mark.parametrize("outputs", [
    lambda x: [x * 2],
    lambda x: [x[::-1] * 2, (x[:3] + 1).astype("int64")],
], ids=["one-array", "two-arrays-of-two-forms"])
def test_a_round_of_same_form_arrays_is_described_as_result_by_result(monkeypatch, outputs):
    """same_form_columns, the C-loop description of a kernel's usual round, says exactly what
    result_location says result by result: the same forms, indexes and addresses."""
    import numpy
    kernel = kcoral_worker.KernelUnderTest.__new__(kcoral_worker.KernelUnderTest)
    kernel.results = [outputs(numpy.arange(8, dtype=numpy.float32) + seed) for seed in range(5)]
    fast = kernel.describe()
    assert kcoral_worker.same_form_columns(kernel.results) is not None
    monkeypatch.setattr(kcoral_worker, "same_form_columns", lambda results: None)
    assert kernel.describe() == fast
    forms, calls, addresses = fast
    located = iter(struct.unpack(f"<{sum(map(len, calls))}Q", bytes.fromhex(addresses)))
    for results, indexes in zip(kernel.results, calls):
        for result, index in zip(results, indexes):
            assert forms[index]["shape"] == list(result.shape) and next(located) == result.ctypes.data


@pytest.mark.parametrize("results", [
    "[[zeros(4)], [zeros(5)]]",  # shapes differ
    "[[zeros(4)], [zeros(4, dtype='float32')]]",  # dtypes differ
    "[[zeros(4)], [zeros(4), zeros(4)]]",  # not as many results per call
    "[[zeros((4, 4))[:, 0]]]",  # not contiguous
    "[[zeros(4)], [1.0]]",  # not an array
], ids=["shapes", "dtypes", "counts", "strided", "number"])
def test_a_round_of_mixed_results_is_left_to_result_location(results):
    from numpy import zeros
    assert kcoral_worker.same_form_columns(eval(results, {"zeros": zeros})) is None


def test_the_speedup_and_its_interval_are_over_kernel_times():
    samples = {"reference": [3.0] * 20, "candidate": [2.0] * 20, "echo": [1.0] * 20}  # kernels: 2 ms and 1 ms
    result = kcoral_worker.race_statistics(samples, 0.95)
    assert (result["reference_ms"], result["candidate_ms"], result["speedup"]) == (2.0, 1.0, 2.0)
    assert result["speedup_ci"] == [2.0, 2.0]
    assert kcoral_worker.race_flags(result, 10.0) == {}
    assert "implausible_speedup" in kcoral_worker.race_flags(result, 1.5)
    noisy = kcoral_worker.race_statistics({"reference": [3.0, 1.2] * 10, "candidate": [1.2, 3.0] * 10,
                                           "echo": [1.0] * 20}, 0.95)
    assert "within_noise" in kcoral_worker.race_flags(noisy, 10.0)
    short = dict(kcoral_worker.race_statistics({"reference": [3.0] * 20, "candidate": [2.2] * 20, "echo": [2.0] * 20},
                                               0.95), overhead_ms_per_call=2.0)  # rounds of one call, under load
    assert "harness_dominates" in kcoral_worker.race_flags(short, 10.0)
    assert "harness_dominates" not in kcoral_worker.race_flags(dict(result, overhead_ms_per_call=0.5), 10.0)
    below = kcoral_worker.race_statistics({"reference": [1.0] * 5, "candidate": [1.0] * 5, "echo": [1.0] * 5}, 0.95)
    assert below["speedup"] is None and "below_resolution" in kcoral_worker.race_flags(below, 10.0)
    json.dumps(below, allow_nan=False)  # returnable


def self_race(rng, rounds):
    """Windows of a kernel raced against itself on a loaded machine: a round's load (a factor
    between 1 and 3) hits both turns alike; on top, each turn's own noise, and a third of the turns
    descheduled for up to 10 ms (1 ms kernels, 0.2 ms empty round trip)."""
    load = rng.uniform(1, 3, rounds)

    def turn():
        return 0.2 + load * rng.lognormal(0, 0.05, rounds) + rng.exponential(3, rounds) * (rng.random(rounds) < 1 / 3)
    return {"reference": list(turn()), "candidate": list(turn()), "echo": [0.2] * rounds}


def test_the_interval_of_a_self_race_contains_1_as_often_as_it_claims():
    """The interval is the distribution-free one of the median of the rounds' own ratios: over
    many synthetic self-races of 12 rounds (where a bootstrap of medians claims more than it
    holds), it contains 1 at least 95% of the time less the simulation's error."""
    import numpy
    rng = numpy.random.default_rng(7)
    results = [kcoral_worker.race_statistics(self_race(rng, 12), 0.95) for _ in range(400)]
    covered = sum(r["speedup_ci"][0] <= 1 <= r["speedup_ci"][1] for r in results)
    assert covered >= 0.94 * len(results), covered


def test_the_speedup_pairs_each_rounds_turns():
    """A candidate 1.3x slower than the reference in every round, under a load that triples some
    rounds: each round's ratio is 1/1.3, so the interval is that alone; so it stays with a load
    that drifts and the candidate descheduled in a few early rounds (where the ratio of each
    kernel's median is far off); an order effect (the turn timed second 10% slower), in
    alternating order, leaves the reference against itself at 1."""
    load = [1, 3, 1.5, 2.5, 1, 2] * 4
    slower = {"reference": [0.2 + f for f in load], "candidate": [0.2 + 1.3 * f for f in load], "echo": [0.2] * 24}
    result = kcoral_worker.race_statistics(slower, 0.95)
    assert result["speedup"] == pytest.approx(1 / 1.3) and result["speedup_ci"] == pytest.approx([1 / 1.3] * 2)
    drift = [1 + i / 10 for i in range(20)]  # a load growing through the race, and the candidate
    descheduled = {"reference": [0.2 + f for f in drift],  # descheduled for 5 ms in 8 of its early rounds
                   "candidate": [0.2 + 1.3 * f + (5 if i < 8 else 0) for i, f in enumerate(drift)],
                   "echo": [0.2] * 20}
    result = kcoral_worker.race_statistics(descheduled, 0.95)  # the two medians' ratio would read 0.54
    assert result["speedup"] == pytest.approx(1 / 1.3) and result["speedup_ci"][1] == pytest.approx(1 / 1.3)
    assert kcoral_worker.speedup_standard_error(slower) == 0.0  # the load cancels in each round's ratio,
    assert kcoral_worker.relative_standard_error(slower["candidate"], slower["echo"]) > 0.1  # not in a kernel's
    second = [1.1 if i % 2 else 1.0 for i in range(24)]  # rounds alternate AB, BA: the second turn is slower
    ordered = {"reference": [0.2 + s for s in second], "candidate": [0.2 + (2.1 - s) for s in second],
               "echo": [0.2] * 24}
    result = kcoral_worker.race_statistics(ordered, 0.95)
    assert result["speedup"] == pytest.approx(1.0) and result["speedup_ci"] == pytest.approx([1 / 1.1, 1.1])


def test_the_median_interval_ranks_are_the_sign_tests():
    assert kcoral_worker.sign_test_ranks(5, 0.95) == (None, None)  # 2/32 > 5%: no interval
    assert kcoral_worker.sign_test_ranks(6, 0.95) == (0, 5)
    assert kcoral_worker.sign_test_ranks(20, 0.95) == (5, 14)  # the 6th smallest and largest
    for n in (6, 12, 40, 200, 2000):
        low, high = kcoral_worker.sign_test_ranks(n, 0.95)
        outside = sum(math.comb(n, j) for j in range(low + 1)) / 2 ** n  # P(median below the low rank)
        tighter = sum(math.comb(n, j) for j in range(low + 2)) / 2 ** n
        assert high == n - 1 - low and outside <= 0.025 < tighter
    few = kcoral_worker.race_statistics({"reference": [2.0] * 4, "candidate": [1.5] * 4, "echo": [1.0] * 4}, 0.95)
    assert few["speedup"] == 2.0 and few["speedup_ci"] == [0.0, None]  # 4 rounds bound nothing


SLEEPER = """
import time

def kernel(x):
    time.sleep(0.002)
    return x * 2
"""


def test_a_spent_budget_still_races_the_rounds_an_interval_needs():
    """The median's interval needs 6 rounds at 95%: a race out of budget at once runs those."""
    import numpy
    verdict = kcoral_worker.evaluate(SLEEPER, SLEEPER, lambda seed: numpy.full(4, seed % 7, numpy.float32),
                                     seeds=1, warmup_ms=0, budget_ms=0, round_ms=0)
    timing = verdict["timing"]
    assert timing["stopped"] == "budget" and timing["rounds"] == 6, timing
    assert timing["speedup_ci"][1] is not None and timing["speedup_ci"][0] > 0, timing


def test_results_are_described_in_place_where_their_bytes_are_as_sent():
    """On the clock, a contiguous little-endian CPU array or tensor is described where it lies; any
    other result is copied as before: either way the bytes at the address are eval_value's."""
    import ml_dtypes
    import numpy
    import torch
    cases = [(numpy.arange(6, dtype=numpy.float32), True), (numpy.ones(4, ml_dtypes.bfloat16), True),
             (numpy.array([True, False]), True), (torch.arange(5, dtype=torch.int64), True),
             (numpy.arange(6, dtype=">f4"), False), (numpy.ones((3, 2)).T, False), (torch.ones(3, 2).t(), False),
             (numpy.float32(2.5), False), (7, False)]
    for value, in_place in cases:
        (kind, dtype, shape, device), address, keep = kcoral_worker.result_location(value, "output 0")
        expected = kcoral_worker.eval_value(value, "output 0", copy=False, output=True)
        spec = {"kind": kind, "dtype": dtype, "shape": list(shape), "device": device}
        size = kcoral_worker.value_size(spec)
        assert spec == expected.spec() and (keep is value) == in_place, (value, spec)
        assert kcoral_worker.read_process_memory(os.getpid(), address, size) == bytes(expected.data)


def test_a_race_rounds_inputs_start_at_a_shift():
    args = [kcoral_worker.EvalValue("numpy", "float32", [3], data=bytes(12)), kcoral_worker.EvalValue("json", data=2)]
    specs, placed, size = kcoral_worker.staged_layout([args, args], shift=128)
    assert [offset for offset, _ in placed] == [128, 192] and size == 204
    assert specs[1] == [{"kind": "numpy", "dtype": "float32", "shape": [3], "device": "cpu", "offset": 192},
                        {"kind": "json", "value": 2}]


def test_gpu_condition_flags():
    steady = {"sm_clock_mhz": 1980, "memory_clock_mhz": 2619, "temperature_c": 40, "throttle_reasons": 0x1}
    assert kcoral_worker.gpu_flags(steady, dict(steady, sm_clock_mhz=1950, temperature_c=48)) == {}
    moved = kcoral_worker.gpu_flags(steady, dict(steady, sm_clock_mhz=1500, temperature_c=55, throttle_reasons=0x20))
    assert moved == {"gpu_conditions_moved": "sm_clock_mhz 1980 -> 1500; temperature 40 C -> 55 C; "
                                             "throttled: software thermal slowdown"}
    assert "gpu_conditions_unrecorded" in kcoral_worker.gpu_flags(None, None)


def test_default_tolerances_follow_the_output_dtype():
    unset = {"rtol": None, "atol": None}
    assert kcoral_worker.tolerance("float32", unset) == (1.3e-6, 1e-5)
    assert kcoral_worker.tolerance("bfloat16", unset) == (1.6e-2, 1e-5)
    assert kcoral_worker.tolerance("int32", unset) == (0.0, 0.0)
    assert kcoral_worker.tolerance("float16", {"rtol": 0.1, "atol": None}) == (0.1, 1e-5)


@pytest.mark.parametrize("spec", [
    {"kind": "numpy", "dtype": "float32", "shape": [1 << 40], "device": "cpu"},   # beyond the byte budget
    {"kind": "numpy", "dtype": "object", "shape": [1], "device": "cpu"},          # no such dtype
    {"kind": "pickle", "dtype": "float32", "shape": [1], "device": "cpu"},         # no such kind
    {"kind": "numpy", "dtype": "float32", "shape": [-1], "device": "cpu"},         # negative size
    {"kind": "numpy", "dtype": "float32", "shape": [1], "device": "cpu", "x": 1},  # extra key
    {"kind": "json", "value": 1},                                                 # outputs are tensors only
], ids=["huge", "dtype", "kind", "negative", "extra-key", "json-output"])
def test_the_channel_refuses_a_bad_output_spec(spec):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        with pytest.raises(kcoral_worker.UnexpectedMessage):
            kcoral_worker.read_values(Connection(os.dup(ours.fileno())), [spec], None)


@pytest.mark.parametrize("calls, fits", [
    ([[0, 1], [], [2]], True),
    ([[0, True]], False),        # a bool is not an int
    ([[0], 1], False),           # a call that is not a list
    ([[0], [[1]]], False),       # a result that is a list
    ([[0], ["1"]], False),
    ([[0], [1.0]], False),
])
def test_a_long_message_is_checked_element_by_element(calls, fits):
    """EvalDone's list of lists and EvalStage's list of lists of dicts, checked in C loops, refuse
    what the element-by-element check refused, wherever in a long list it lies."""
    done = {"type": "EvalDone", "forms": [], "calls": [[0]] * 999 + calls, "addresses": "", "error": None}
    as_specs = [[{} if type(i) is int else i for i in call] if type(call) is list else call for call in calls]
    stage = {"type": "EvalStage", "calls": [[{}]] * 999 + as_specs, "region_bytes": 0}
    for message in (done, stage):
        frame = json.dumps(message).encode()
        if fits:
            assert type(kcoral_worker.decode_message(frame)).__name__ == message["type"]
        else:
            with pytest.raises(kcoral_worker.UnexpectedMessage, match="calls is not"):
                kcoral_worker.decode_message(frame)


def test_values_round_trip_with_their_bytes():
    import numpy
    import torch
    values = [numpy.arange(6, dtype=numpy.float32).reshape(2, 3), torch.arange(4, dtype=torch.bfloat16), 2.5]
    encoded = [kcoral_worker.eval_value(v, "value") for v in values]
    ours, theirs = socket.socketpair()
    with ours, theirs:
        kcoral_worker.send_values(Connection(os.dup(theirs.fileno())), encoded[:2])
        header = ours.recv(4)
        frame = json.loads(ours.recv(struct.unpack("!I", header)[0]))
        back = kcoral_worker.read_values(Connection(os.dup(ours.fileno())), frame["values"], None)
    assert numpy.array_equal(back[0].build(), values[0]) and torch.equal(back[1].build(), values[1])
    assert encoded[2].spec() == {"kind": "json", "value": 2.5}
    with pytest.raises(TypeError, match="value is a list, not a torch.Tensor, a numpy.ndarray or a JSON scalar"):
        kcoral_worker.eval_value([1.0], "value")
    number = kcoral_worker.eval_value(3.5, "output 0", output=True)  # a kernel may return a Python number
    assert (number.kind, number.dtype, number.shape, number.build()) == ("numpy", "float64", [], 3.5)
    with pytest.raises(TypeError, match="output 0 is a str, not a torch.Tensor, a numpy.ndarray or a number"):
        kcoral_worker.eval_value("3.5", "output 0", output=True)


def test_same_bytes_finds_a_difference_anywhere_and_in_length():
    """The race's check that inputs came back unchanged and outputs equal the reference's byte for
    byte: memcmp over every byte of either kind of buffer the race holds (a mapping, bytes)."""
    data = bytes(range(256)) * 4096
    region = mmap.mmap(-1, len(data))
    region[:] = data
    view = memoryview(region)
    try:
        assert kcoral_worker.same_bytes(view, data) and kcoral_worker.same_bytes(b"", bytearray())
        for where in (0, len(data) // 2, len(data) - 1):
            changed = bytearray(data)
            changed[where] ^= 1
            assert not kcoral_worker.same_bytes(view, changed), where
        assert not kcoral_worker.same_bytes(view, data[:-1]) and not kcoral_worker.same_bytes(view[:-1], data)
    finally:
        view.release()
        region.close()


def test_the_worst_element_is_check_closes_a_nan_first_then_the_furthest_out():
    import numpy
    expected = [kcoral_worker.eval_value(numpy.array([1.0, 2.0, 3.0, 4.0]), "reference output 0", output=True)]
    options = {"rtol": None, "atol": None}
    for actual, index in (([1.0, 2.5, numpy.nan, 4.0], [2]), ([1.0, 2.5, 3.0, 9.0], [3])):
        with pytest.raises(kcoral_worker.Incorrect) as failed:
            kcoral_worker.compare_outputs([kcoral_worker.eval_value(numpy.array(actual), "output 0", output=True)],
                                          expected, options, "here")
        assert failed.value.report["worst"]["index"] == index
        assert str(failed.value).count("worst") == 1 and f"worst {index}:" in str(failed.value)


def test_a_captured_graph_takes_new_tensors_but_not_new_python_values():
    """cuda_graph's input handling, with tensors on the CPU standing in for the captured buffers."""
    import torch
    kernel = kcoral_worker.KernelUnderTest(kcoral_worker.EvalLoad("def kernel(x, s):\n    return x * s\n", "kernel", True,
                                                                    False, False))
    static = torch.zeros(3)
    kernel.set_inputs([static, 2.0])
    kernel.graph = "captured"  # from now on the inputs are copied into the captured buffers
    kernel.set_inputs([torch.ones(3), 2.0])
    assert kernel.inputs[0] is static and static.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="argument 1 changed from 2.0 to 3.0"):
        kernel.set_inputs([torch.ones(3), 3.0])


def test_the_gpu_flush_zeroes_twice_the_l2_then_waits(monkeypatch):
    """evaluate's flush on CUDA, with test_gpu_runtime's fake torch: benchmark's buffer, zeroed by
    the evaluating process (the L2 is the device's, shared with the kernel processes), then a
    synchronisation so the clock starts on an idle device.  Without flush_l2, nothing at all."""
    from tests.test_gpu_runtime import fake_torch
    log = []
    torch, clock = fake_torch(log, flush_ms=0.04)
    monkeypatch.setitem(sys.modules, "torch", torch)
    flush = kcoral_worker.cache_flush("cuda", True)
    assert log == [("flush buffer", 2 * (60 << 20))]
    flush()
    assert clock.now == pytest.approx(0.04) and log[-1] == ("synchronize", None)
    kcoral_worker.cache_flush("cuda", False)()
    assert len(log) == 2


SPAWNS_A_SPINNER = """
import subprocess
import sys

spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # would eat a core while the reference runs

def kernel(x):
    return x
"""


def test_the_other_kernels_whole_group_is_stopped_while_one_runs():
    """What keeps a candidate's busy helper from slowing the reference: its process group is
    stopped (the helper too, waited for) while the reference runs, and continued afterwards."""
    process = kcoral_worker.KernelProcess("candidate", SPAWNS_A_SPINNER, "kernel", False, 30)
    try:
        process.loaded()  # and stopped, as a kernel process is outside its turns
        process.resume()
        with open(f"/proc/{process.proc.pid}/task/{process.proc.pid}/children") as f:
            (spinner,) = map(int, f.read().split())

        def states():
            return [kcoral_worker.proc_stat(pid)[0] for pid in (process.proc.pid, spinner)]
        assert states()[1] in (b"R", b"S")
        process.halt()
        assert states()[0] == b"T"
        deadline = time.monotonic() + 5  # the helper's stop is delivered, not awaited: it follows at once
        while states()[1] != b"T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert states()[1] == b"T"
        process.resume()
        assert b"T" not in states()
    finally:
        process.close()  # SIGKILL to the group: the helper dies too, once it next runs
    deadline = time.monotonic() + 5
    while (kcoral_worker.proc_stat(spinner) or [b"X"])[0] not in (b"Z", b"X") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (kcoral_worker.proc_stat(spinner) or [b"X"])[0] in (b"Z", b"X")


def test_gpu_conditions_read_nvml_for_the_workers_device(monkeypatch):
    """NVML found by the UUID torch reports for cuda:0 (the worker's GPU, whatever its index on the
    host); the readings the verdict records.  Without NVML: None, never an error."""
    import types
    calls = []
    nvml = types.SimpleNamespace(
        NVML_CLOCK_SM=0, NVML_CLOCK_MEM=1, NVML_TEMPERATURE_GPU=0, nvmlInit=lambda: calls.append("init"),
        nvmlDeviceGetHandleByUUID=lambda uuid: calls.append(uuid) or "handle",
        nvmlDeviceGetClockInfo=lambda handle, clock: (1980, 2619)[clock],
        nvmlDeviceGetTemperature=lambda handle, sensor: 41,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda handle: 0x1)
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_device_properties=lambda index: types.SimpleNamespace(uuid="8f2e-01")))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert kcoral_worker.gpu_conditions() == {"sm_clock_mhz": 1980, "memory_clock_mhz": 2619, "temperature_c": 41,
                                              "throttle_reasons": 1}
    assert calls == ["init", "GPU-8f2e-01"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert kcoral_worker.gpu_conditions() is None


LEAVES_ITS_SESSION = """
import subprocess
import sys

import numpy

helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
with open({pid_file!r}, "w") as f:
    f.write(str(helper.pid))

def kernel(x, y):
    return numpy.sqrt(x) * y + 1.0
"""


def test_a_helper_outside_the_candidates_group_is_flagged(tmp_path):
    """A process the candidate moved to a session of its own is not stopped while the reference
    runs (it could spin, or signal the reference): the verdict flags the race.  Run here, in the
    test's process, since the server would fail the request for the helper left behind."""
    import numpy
    pid_file = tmp_path / "helper"

    def make_inputs(seed):
        rng = numpy.random.default_rng(seed)
        return rng.random(256), rng.random(256)
    verdict = kcoral_worker.evaluate(LEAVES_ITS_SESSION.format(pid_file=str(pid_file)), HONEST, make_inputs,
                                     warmup_ms=0, budget_ms=50, min_rounds=3)
    helper = int(pid_file.read_text())
    try:
        assert verdict["status"] == "correct", verdict
        assert str(helper) in verdict["flags"]["foreign_processes"], verdict["flags"]
    finally:
        os.kill(helper, 9)


# --- round 2: exact integers, cheats aimed at the shared-memory rounds, likely causes ---------------

HASH_REFERENCE = """
import numpy

def kernel(x):
    return x * numpy.int64(0x5851F42D4C957F2D) ^ (x >> numpy.int64(29))  # wraps: a 64-bit hash
"""

HASH_IN_FLOAT64 = """
import numpy

def kernel(x):  # the same hash, but through float64: only 53 bits survive
    exact = x * numpy.int64(0x5851F42D4C957F2D) ^ (x >> numpy.int64(29))
    return exact.astype(numpy.float64).astype(numpy.int64)
"""

WRITES_AFTER_DONE = """
import threading
import time

import numpy

def kernel(x, y):
    out = numpy.zeros_like(x)

    def finish():
        time.sleep({delay})
        out[:] = numpy.sqrt(x) * y + 1.0
    threading.Thread(target=finish).start()
    return out  # "done" at once: the work lands after the answer
"""

CACHED_BY_POINTER = """
import numpy

cache = {}

def kernel(x, y):
    key = (x.ctypes.data, y.ctypes.data)  # the same buffer, so the same answer: not in a fresh round
    if key not in cache:
        cache[key] = numpy.sqrt(x) * y + 1.0
    return cache[key]
"""

KEEPS_A_MAPPING = """
import threading
import time

import numpy

kept, answers = [], {}

def precompute():  # watches the buffers of its first call for the next inputs, to answer before it is asked
    while True:
        x, y = kept[0]
        key = x[:8].tobytes()
        if key not in answers:
            answer = numpy.sqrt(x) * y + 1.0
            time.sleep(0.002)  # longer than the path from the go message to the call
            answers[key] = answer
        time.sleep(0.0001)

def kernel(x, y):
    if not kept:
        kept.append((x, y))
        threading.Thread(target=precompute, daemon=True).start()
        return numpy.sqrt(x) * y + 1.0
    return answers.get(x[:8].tobytes(), numpy.zeros_like(x))
"""


def make_pair(seed):
    import numpy
    rng = numpy.random.default_rng(seed)
    return rng.random(4096, dtype=numpy.float32), rng.random(4096, dtype=numpy.float32)


def evaluate_here(candidate, reference=HONEST, make_inputs=make_pair, **options):
    """evaluate in this test's process (no server): the cheats aimed at its rounds."""
    return kcoral_worker.evaluate(candidate, reference, make_inputs, **{**QUICK, **options})


def test_a_64_bit_hash_that_keeps_53_bits_is_incorrect():
    """Integers compare exactly: through float64 4 078 of 4 096 elements differ, and the verdict says so."""
    import numpy

    def make_keys(seed):
        return numpy.random.default_rng(seed).integers(0, 1 << 62, size=4096, dtype=numpy.int64)
    verdict = evaluate_here(HASH_IN_FLOAT64, HASH_REFERENCE, make_keys, timing=False)
    assert verdict["status"] == "incorrect", verdict["message"]
    assert "elements differ (exact)" in verdict["message"] and verdict["mismatch"]["mismatches"] > 4000
    assert evaluate_here(HASH_REFERENCE, HASH_REFERENCE, make_keys, timing=False)["status"] == "correct"


def test_writing_the_outputs_after_done_is_caught_and_named():
    """The clock stops once the candidate is stopped, and its results are read while it is: work that
    lands after its answer is not there.  The verdict says so, having let it run on and read again."""
    verdict = evaluate_here(WRITES_AFTER_DONE.format(delay=0.01))
    assert_fails(verdict, "incorrect", "elements differ", "most likely work still running after it said it was done")


def test_racing_the_stop_wins_nothing():
    """A thread that starts at once may finish before the stop lands: then its work was inside the
    window (the clock runs until the process is stopped); otherwise it is caught."""
    verdict = evaluate_here(WRITES_AFTER_DONE.format(delay=0), budget_ms=500)
    if verdict["status"] == "correct":
        timing = verdict["timing"]
        assert timing["candidate_ms"] > 0.5 * timing["reference_ms"], timing
    else:
        assert verdict["status"] == "incorrect" and "elements differ" in verdict["message"], verdict


def test_a_result_cached_by_data_pointer_is_caught_and_named():
    """The region is reused, so the pointer repeats; the inputs do not."""
    assert_fails(evaluate_here(CACHED_BY_POINTER), "incorrect", "on input set 2",
                 "most likely a result kept from an earlier call")


def test_keeping_a_mapping_of_earlier_buffers_sees_no_input_before_the_clock():
    """Its kept views show each round's inputs, but those are written while it is stopped, and it
    runs again only on the clock: its watcher never answers first."""
    assert_fails(evaluate_here(KEEPS_A_MAPPING), "incorrect", "elements differ")


def test_a_wrong_answer_after_right_ones_says_so():
    verdict = evaluate_here(FIRST_INPUT_SET_ONLY)
    assert_fails(verdict, "incorrect", "on input set 2", "the call checked before was right: most likely it behaves")


def sines(rows):
    """~50 us of work here: numpy.sin over 90 112 floats, and again over `rows` of them."""
    extra = f"    numpy.sin(x[:{rows}])\n" if rows else ""
    return f"import numpy\n\ndef kernel(x):\n    out = numpy.sin(x)\n{extra}    return out\n"


def test_a_50_us_kernel_is_resolved():
    """Rounds of many calls: twice the reference's work reads about 0.5x with an interval below 1,
    the reference against itself about 1x; the harness's cost per call is reported, and well under
    the kernel's.  Bands are generous: the machine is shared (docs/evaluate.md has the figures)."""
    import numpy
    pool = numpy.random.default_rng(0).random(90112, dtype=numpy.float32)

    def make_inputs(seed):
        return numpy.roll(pool, seed % pool.size)
    slower = kcoral_worker.evaluate(sines(90112), sines(0), make_inputs, budget_ms=3000)
    timing = slower["timing"]
    assert slower["status"] == "correct" and timing["calls_per_round"] > 10, timing
    assert 0.3 < timing["speedup"] < 0.8 and timing["speedup_ci"][1] < 1, (timing["speedup"], timing["speedup_ci"])
    assert timing["overhead_ms_per_call"] < timing["reference_ms"], timing
    same = kcoral_worker.evaluate(sines(0), sines(0), make_inputs, budget_ms=3000)["timing"]
    assert 0.75 < same["speedup"] < 1.33, (same["speedup"], same["speedup_ci"])


REPORTS_WHERE_ITS_INPUT_LIES = """
import os

import numpy

def kernel(x, y):  # appends: its process, the file its input lies in, and the offset there
    address = x.ctypes.data
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(v, 16) for v in fields[0].split("-"))
            if low <= address < high:
                with open("where.txt", "a") as out:
                    out.write(f"{os.getpid()} {fields[4]} {int(fields[2], 16) + address - low}\\n")
    return numpy.sqrt(x) * y + 1.0
"""


def test_both_kernels_read_their_inputs_from_the_same_pages(tmp_path, monkeypatch):
    """A round's inputs lie in one region at the same offsets for both kernels: two regions, one
    per process, gave one of two identical kernels a lasting edge (docs/evaluate.md)."""
    monkeypatch.chdir(tmp_path)
    verdict = evaluate_here(REPORTS_WHERE_ITS_INPUT_LIES, REPORTS_WHERE_ITS_INPUT_LIES, seeds=1)
    assert verdict["status"] == "correct", verdict["message"]
    seen: dict[str, set[tuple[str, str]]] = {}
    for line in (tmp_path / "where.txt").read_text().splitlines():
        pid, inode, offset = line.split()
        if int(pid) != os.getpid():  # this process runs the reference too, on copies of the inputs
            seen.setdefault(pid, set()).add((inode, offset))
    assert len(seen) == 2, seen.keys()
    reference, candidate = sorted(seen.values(), key=len)  # the candidate also ran the correctness calls
    assert reference and reference <= candidate, (reference, candidate)


ADDS_ZERO_TO_ITS_INPUT = "import numpy\n\ndef kernel(x, y):\n    x += 0.0\n    return numpy.sqrt(x) * y + 1.0\n"


def test_a_reference_that_writes_its_inputs_is_an_error():
    """The candidate's inputs are the reference's too, which its process maps read-only: a reference
    writing them would otherwise change what the candidate is checked on."""
    verdict = evaluate_here(HONEST, ADDS_ZERO_TO_ITS_INPUT)
    assert verdict["status"] == "error" and "the reference raised" in verdict["message"], verdict["message"]
    assert "read-only" in verdict["message"], verdict["message"]


WRITES_THE_SHARED_INPUT = """
import numpy

calls = 0

def kernel(x, y):
    global calls
    calls += 1
    if calls > 4:  # 3 input sets, warm-up round 1 (1 call), then warm-up round 2, where it runs first
        x[:] = 0.0  # the reference, next, would compute on zeros: the answer it returns
    return numpy.sqrt(x) * y + 1.0
"""


def test_writing_the_inputs_shared_with_the_reference_is_caught():
    """Its answer matches what the reference computed after it on the zeroed inputs; the region, read
    back after both turns, shows the change (the reference's mapping is read-only: it is the candidate's)."""
    assert_fails(evaluate_here(WRITES_THE_SHARED_INPUT), "incorrect", "the candidate modified its tensor argument 0",
                 "in warm-up round 2")


def test_an_honest_kernel_process_stops_itself_after_every_answer(monkeypatch):
    """evaluate's own stop is for a process that runs on after answering; an honest race never needs it
    (its stop is the kernel process's, right after its answer: two wake-ups fewer on the clock)."""
    forced = []
    real_halt = kcoral_worker.KernelProcess.halt
    monkeypatch.setattr(kcoral_worker.KernelProcess, "halt", lambda self: forced.append(self.role) or real_halt(self))
    verdict = evaluate_here(HONEST)
    assert verdict["status"] == "correct" and verdict["timing"]["rounds"] >= 3, verdict
    assert forced == []


SLOW_TO_STOP = """
import os
import time

import numpy

real_killpg = os.killpg

def late_killpg(group, sig):  # the harness's own stop after each answer, 250 ms late (a thread holding the GIL)
    time.sleep(0.25)
    real_killpg(group, sig)

os.killpg = late_killpg

def kernel(x, y):
    return numpy.sqrt(x) * y + 1.0
"""


def test_a_process_slow_to_stop_itself_is_stopped_and_its_late_stop_absorbed(monkeypatch):
    """Stopped by evaluate before its own stop (due 250 ms after each answer, the grace 50 ms here: an
    honest process stops itself within it even on a loaded machine, where 5 ms was once too short),
    the process stops itself once more as soon as it is continued; the next resume absorbs that, and
    the race goes on to its verdict instead of waiting for an answer that never comes."""
    monkeypatch.setattr(kcoral_worker, "EVAL_STOP_GRACE", 0.05)
    forced = []
    real_halt = kcoral_worker.KernelProcess.halt
    monkeypatch.setattr(kcoral_worker.KernelProcess, "halt", lambda self: forced.append(self.role) or real_halt(self))
    verdict = evaluate_here(SLOW_TO_STOP, call_timeout_s=5)
    assert verdict["status"] == "correct" and verdict["timing"]["rounds"] >= 3, verdict
    assert forced and set(forced) == {"candidate"}
