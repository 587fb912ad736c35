"""kcoral.builtins.check_close (docs/server.md §5.3): called directly, as a harness does when it
is tried locally, and once inside a server program."""

import json
import math

import numpy as np
import pytest
import torch
from kcoral.builtins import check_close
from kcoral.errors import ExecutionError

import kcoral
from kcoral import Client, Program
from tests.support import ServerProcess, run_python

REPORT_KEYS = {"ok", "shape", "expected_shape", "dtype", "expected_dtype", "total", "mismatches", "mismatch_fraction",
               "max_abs_error", "max_rel_error", "rtol", "atol", "worst", "nonfinite_mismatches", "first_mismatches",
               "spread_mismatches", "summary"}


def strict_json(report):
    """The report survives JSON without NaN or Infinity: a program can return it."""
    return json.loads(json.dumps(report, allow_nan=False))


def test_equal_tensor_and_array_are_close():
    report = check_close(torch.arange(6, dtype=torch.float32).reshape(2, 3), np.arange(6.0).reshape(2, 3))
    assert set(report) == REPORT_KEYS
    assert report["ok"] is True and report["mismatches"] == 0 and report["total"] == 6
    assert report["shape"] == report["expected_shape"] == [2, 3]
    assert (report["dtype"], report["expected_dtype"]) == ("float32", "float64")
    assert report["max_abs_error"] == report["max_rel_error"] == 0.0 and report["first_mismatches"] == []
    assert strict_json(report) == report


def test_mismatches_are_counted_located_and_measured():
    expected = np.arange(12.0).reshape(3, 4) + 1
    actual = expected.copy()
    actual[0, 1], actual[2, 3] = 4.0, 0.0  # 2 -> 4 (rel error 1.0), 12 -> 0 (abs error 12)
    report = check_close(actual, expected)
    assert report["ok"] is False and report["mismatches"] == 2 and report["total"] == 12
    assert report["first_mismatches"] == [
        {"index": [0, 1], "actual": 4.0, "expected": 2.0, "abs_error": 2.0},
        {"index": [2, 3], "actual": 0.0, "expected": 12.0, "abs_error": 12.0}]
    assert report["max_abs_error"] == 12.0 and report["max_rel_error"] == 1.0
    assert report["summary"].startswith("check_close: 2 of 12 elements differ (rtol=1e-05, atol=1e-08)")
    assert "[0, 1]: 4.0 vs 2.0; [2, 3]: 0.0 vs 12.0" in report["summary"]


def test_tolerance_is_atol_plus_rtol_times_expected():
    expected = np.array([1.0, 1.0])
    assert check_close(np.array([1.75, 0.25]), expected, rtol=0.5, atol=0.25)["ok"]  # exactly at the bound
    report = check_close(np.array([1.75, 0.24]), expected, rtol=0.5, atol=0.25)
    assert report["mismatches"] == 1 and report["first_mismatches"][0]["index"] == [1]


def test_only_the_first_mismatches_are_listed_but_all_are_counted():
    report = check_close(np.zeros(100), np.ones(100), max_reported=3)
    assert report["mismatches"] == 100
    assert [m["index"] for m in report["first_mismatches"]] == [[0], [1], [2]]


def test_shapes_must_be_equal_not_broadcast():
    report = check_close(np.ones(1), np.ones(3))
    assert report["ok"] is False and report["mismatches"] is None and report["max_abs_error"] is None
    assert report["summary"] == "check_close: shape [1] differs from the expected [3]"


def test_non_finite_values_are_judged_and_reported_as_strings():
    nan, inf = math.nan, math.inf
    report = strict_json(check_close(np.array([nan, inf, 1.0]), np.array([1.0, inf, 1.0])))
    assert report["mismatches"] == 1 and report["max_abs_error"] == "nan"  # inf == inf is close
    assert report["first_mismatches"] == [{"index": [0], "actual": "nan", "expected": 1.0, "abs_error": "nan"}]
    assert check_close(np.array([nan]), np.array([nan]))["ok"] is False
    both_nan = check_close(np.array([nan, 2.0]), np.array([nan, 2.0]), equal_nan=True)
    assert both_nan["ok"] is True and both_nan["max_abs_error"] == both_nan["max_rel_error"] == 0.0


def test_bfloat16_and_integer_inputs_are_compared_as_float64():
    report = check_close(torch.tensor([1.0, 2.5], dtype=torch.bfloat16), np.array([1, 3], dtype=np.int32), atol=0.6)
    assert report["ok"] is True and (report["dtype"], report["expected_dtype"]) == ("bfloat16", "int32")
    assert report["max_abs_error"] == 0.5


def test_raise_on_mismatch_fails_with_kind_correctness_and_the_summary():
    with pytest.raises(ExecutionError) as caught:
        check_close(np.array([1.0, 5.0]), np.array([1.0, 2.0]), raise_on_mismatch=True)
    assert caught.value.kind == "correctness"
    assert caught.value.message == check_close(np.array([1.0, 5.0]), np.array([1.0, 2.0]))["summary"]
    assert check_close(np.ones(2), np.ones(2), raise_on_mismatch=True)["ok"] is True  # passing: the report


def test_client_side_import_is_the_workers_function():
    """`import kcoral` publishes kcoral.builtins in an ordinary process, with check_close in it."""
    import kcoral_worker
    assert kcoral.builtins.check_close is kcoral_worker.check_close is check_close
    assert "check_close" in kcoral.builtins.__all__
    done = run_python("http://unused", "-c", "from kcoral.builtins import check_close\n"
                      "print(check_close([1.0], [1.0])['ok'])", cwd="/")
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr  # a fresh process, nothing imported first


HARNESS = """
from kcoral.builtins import check_close

def report(actual, expected):
    return check_close(actual, expected)

def gate(actual, expected):
    check_close(actual, expected, raise_on_mismatch=True)
"""


def test_in_a_server_program_the_report_returns_and_the_gate_fails(tmp_path):
    actual, expected = np.array([[1.0, 2.0], [3.0, 9.0]], dtype=np.float32), np.arange(1.0, 5.0).reshape(2, 2)
    program = Program()
    module = program.upload(kind="module", source=HARNESS)
    args = [program.upload(kind="tensor", value=actual), program.upload(kind="tensor", value=expected)]
    program.return_(key="report", value=program.run(fn=program.get_function(module=module, name="report"), args=args))
    program.run(id="gate", fn=program.get_function(module=module, name="gate"), args=args)
    with ServerProcess(workers=1, tmp_path=tmp_path) as srv, Client(srv.url) as client:
        result = client.execute(program)
    assert result.status == "FAILED"
    assert (result.error["kind"], result.error["instruction_id"]) == ("correctness", "gate")
    local = check_close(actual, expected)
    assert result["report"] == local  # uploaded tensors arrive as torch tensors: the same report
    assert result["report"]["first_mismatches"] == [{"index": [1, 1], "actual": 9.0, "expected": 4.0,
                                                     "abs_error": 5.0}]
    assert result.error["message"] == local["summary"]


def test_integers_are_compared_exactly_above_two_to_the_53():
    """A 64-bit hash that keeps only the 53 bits a float64 holds: as floats every element looks equal."""
    rng = np.random.default_rng(7)
    expected = rng.integers(1 << 62, 1 << 63, size=4096, dtype=np.int64)
    rounded = expected.astype(np.float64).astype(np.int64)  # the top 53 bits, the rest lost
    assert (rounded != expected).sum() > 4000 and np.array_equal(rounded.astype(np.float64), expected.astype(np.float64))
    report = strict_json(check_close(rounded, expected, rtol=1e-3, atol=1.0))
    assert report["ok"] is False and report["mismatches"] == int((rounded != expected).sum())
    assert (report["rtol"], report["atol"]) == (0.0, 0.0) and "differ (exact)" in report["summary"]
    first = int(np.flatnonzero(rounded != expected)[0])
    assert report["first_mismatches"][0] == {"index": [first], "actual": int(rounded[first]),
                                             "expected": int(expected[first]),
                                             "abs_error": abs(int(rounded[first]) - int(expected[first]))}
    assert report["max_abs_error"] == max(abs(int(x) - int(y)) for x, y in zip(rounded, expected))
    assert check_close(torch.from_numpy(expected), expected)["ok"] is True


def test_uint64_against_int64_is_exact_with_no_float_promotion():
    big = np.array([(1 << 64) - 1, 1 << 63, (1 << 53) + 1, 5], dtype=np.uint64)
    report = check_close(big, np.array([-1, -(1 << 63), 1 << 53, 5], dtype=np.int64))
    assert report["mismatches"] == 3 and [m["index"] for m in report["first_mismatches"]] == [[0], [1], [2]]
    assert report["first_mismatches"][2]["abs_error"] == 1
    assert report["worst"]["abs_error"] == (1 << 64)  # 2^64 - 1 against -1: no wrap-around
    assert check_close(torch.tensor([(1 << 60) + 1], dtype=torch.uint64), np.array([(1 << 60) + 1]))["ok"] is True


def test_bool_is_compared_exactly():
    report = check_close(torch.tensor([True, False, True]), np.array([True, True, True]), atol=1.0)
    assert report["mismatches"] == 1 and report["first_mismatches"][0] == {"index": [1], "actual": False,
                                                                           "expected": True, "abs_error": 1}


def whole_array_report(a, e, rtol, atol, equal_nan):
    """The fields check_close reports, computed over the whole arrays at once (its formulas before it
    compared in chunks): the oracle for the chunked comparison."""
    a, e = a.astype("float64"), e.astype("float64")
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        close = np.isclose(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan)
        abs_error = np.abs(a - e)
        rel_error = np.where(e != 0, abs_error / np.abs(e), 0.0)
        abs_error, rel_error = (np.where(close & ~np.isfinite(x), 0.0, x) for x in (abs_error, rel_error))
        excess = abs_error / (atol + rtol * np.abs(e))
    wrong = np.flatnonzero(~close)
    flat_excess = np.where(np.isfinite(excess), excess, np.inf).reshape(-1)
    worst = int(wrong[np.argmax(flat_excess[wrong])]) if wrong.size else None
    return {"mismatches": int(wrong.size), "max_abs_error": repr_number(abs_error.max(initial=0.0)),
            "max_rel_error": repr_number(rel_error.max(initial=0.0)),
            "worst": None if worst is None else [int(i) for i in np.unravel_index(worst, a.shape)],
            "worst_rel": None if worst is None else repr_number(rel_error.reshape(-1)[worst]),
            "first": [[int(i) for i in np.unravel_index(int(k), a.shape)] for k in wrong[:5]],
            "nan": int(np.isnan(a.reshape(-1)[wrong]).sum()), "inf": int(np.isinf(a.reshape(-1)[wrong]).sum())}


def repr_number(x):
    return float(x) if math.isfinite(x) else repr(float(x))


@pytest.mark.parametrize("chunk", [7, 64, 1 << 16])
@pytest.mark.parametrize("seed", range(6))
def test_a_comparison_in_chunks_reports_what_the_whole_arrays_do(monkeypatch, chunk, seed):
    """Chunk boundaries anywhere (7 elements, 64, more than the array): the same count, maxima (a NaN
    error as NaN), worst element (the first of several infinitely far), its rel error, first
    mismatches and non-finite counts as over the whole arrays."""
    import kcoral_worker
    monkeypatch.setattr(kcoral_worker, "CHECK_CHUNK", chunk)
    rng = np.random.default_rng(seed)
    expected = rng.normal(size=(37, 29)).astype(np.float32)
    actual = expected + rng.normal(scale=1e-6, size=expected.shape).astype(np.float32)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, 1e30], dtype=np.float32)
    for target in (actual, expected):
        where = rng.choice(actual.size, size=40, replace=False)
        target.reshape(-1)[where] = rng.choice(specials, size=40)
    for equal_nan in (False, True):
        report = check_close(actual, expected, rtol=1e-5, atol=1e-6, equal_nan=equal_nan, max_reported=5)
        oracle = whole_array_report(actual, expected, 1e-5, 1e-6, equal_nan)
        assert oracle["mismatches"] > 0, "the arrays should differ somewhere"
        got = {"mismatches": report["mismatches"], "max_abs_error": report["max_abs_error"],
               "max_rel_error": report["max_rel_error"], "worst": report["worst"]["index"],
               "worst_rel": report["worst"]["rel_error"], "first": [m["index"] for m in report["first_mismatches"]],
               "nan": report["nonfinite_mismatches"]["nan"], "inf": report["nonfinite_mismatches"]["inf"]}
        assert got == oracle, (equal_nan, got, oracle)
        assert strict_json(report) == report


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_comparing_two_16_mib_arrays_needs_little_more_memory_than_they_hold(kind):
    """In a fresh process: the peak RSS that check_close adds to two float32 arrays (or host
    tensors) of 16 MiB, each with a mismatch: less than one more copy of either.  Whole-array
    float64 temporaries added 40-200 MiB (as much as glibc did not hand back between them), and
    a tensor was copied as float64 first; chunks over views of the tensors add ~3 MiB."""
    script = (
        "import resource, numpy, torch\n"
        "from kcoral.builtins import check_close\n"
        "x = numpy.random.default_rng(0).random((1024, 4096), dtype=numpy.float32)\n"
        "y = x.copy(); y[5, 7] += 1; y[1000, 4000] = numpy.nan\n"
        f"x, y = {'(torch.from_numpy(x), torch.from_numpy(y))' if kind == 'torch' else '(x, y)'}\n"
        "check_close(x[:2], y[:2])  # its imports, before the baseline\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "report = check_close(x, y)\n"
        "assert report['mismatches'] == 2 and report['dtype'] == 'float32', report['summary']\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    done = run_python("http://unused", "-c", script)
    assert done.returncode == 0, done.stderr
    added_kib = int(done.stdout.split()[-1])
    assert added_kib < 16 * 1024, f"check_close added {added_kib} KiB of peak RSS to two 16 MiB {kind} arrays"
