"""The kernel loop end to end: build a C++ kernel locally, check it against a Python
reference on the server, and benchmark it only when the check passed.

This is the loop a coding agent runs: write the kernel, compile it, check it, benchmark it
when it is right, read the result, revise.  The kernel is axpy (out = alpha * x + y,
float32) as a TVM-FFI library built with g++ for the server's target (a CPU server:
/health reports no `arch`; kernel_loop_cuda.py is the GPU variant).  Everything after the
build is one program, in this order:

1. run the kernel on uploaded inputs;
2. `check_close` its output against the reference computed here with NumPy, and *return
   that report*;
3. the gate: `check_close(..., raise_on_mismatch=True)` fails the program with kind
   `correctness` when the output is wrong;
4. benchmark, and return the timings.

A FAILED program keeps the returns made before the failing instruction, so a wrong kernel
still brings back its report (which elements differ, by how much) and is never
benchmarked.  `--broken` builds a kernel with an off-by-one bug (it skips the last
element) to show that path.

Prints the build, the check's summary, then either the benchmark's median latency
(exit status 0) or `FAILED correctness`, the first mismatches and `benchmark: skipped`
(exit status 1, so a script or an agent can branch on it).
"""

import os
import sys

import numpy
from _tvm_ffi_build import build_library

from kcoral import Client, Program

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")
N = 1 << 16
ALPHA = 2.0

SOURCE = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

void axpy(double alpha, tvm::ffi::TensorView x, tvm::ffi::TensorView y, tvm::ffi::TensorView out) {
  // A failed ICHECK raises on the server: the run fails with its message instead of crashing.
  TVM_FFI_ICHECK(x.ndim() == 1 && x.size(0) == y.size(0) && x.size(0) == out.size(0)) << "1-d, one length";
  DLDataType f32{kDLFloat, 32, 1};
  TVM_FFI_ICHECK(x.dtype() == f32 && y.dtype() == f32 && out.dtype() == f32) << "float32 only";
  const float* xs = static_cast<const float*>(x.data_ptr());
  const float* ys = static_cast<const float*>(y.data_ptr());
  float* result = static_cast<float*>(out.data_ptr());
  int64_t n = x.size(0);
  for (int64_t i = 0; i < n; ++i) result[i] = static_cast<float>(alpha) * xs[i] + ys[i];
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(axpy, axpy);
"""
BROKEN_SOURCE = SOURCE.replace("i < n;", "i < n - 1;")  # the off-by-one an agent might write

# Runs on the server: the kernel is whatever library function the program passes in.
HARNESS = """
import torch
from kcoral.builtins import benchmark, check_close

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # float32 arithmetic against a float64 reference

def run_kernel(kernel, alpha, x, y):
    out = torch.zeros_like(x)
    kernel(alpha, x, y, out)
    return out

def check(out, expected):
    return check_close(out, expected, **TOLERANCE)

def gate(out, expected):
    check_close(out, expected, raise_on_mismatch=True, **TOLERANCE)

def bench(kernel, alpha, x, y, out):
    # Explicit counts: on a CPU server each call's cache flush costs milliseconds, and the
    # default 100 ms budget would buy only a hundred calls or fewer (docs/guide.md, "Benchmarking").
    return benchmark(kernel, alpha, x, y, out, {"warmup": 10, "repeat": 100})
"""


def kernel_program(library: bytes) -> Program:
    """Run, check (returned), gate, benchmark (returned): one program, one worker."""
    rng = numpy.random.default_rng(0)
    x, y = rng.random(N, dtype=numpy.float32), rng.random(N, dtype=numpy.float32)
    expected = ALPHA * x.astype(numpy.float64) + y  # the Python reference, computed here

    program = Program()
    kernel = program.get_function(module=program.upload(kind="library", value=library), name="axpy")
    harness = program.upload(kind="module", source=HARNESS)
    run_kernel, check, gate, bench = (program.get_function(module=harness, name=name)
                                      for name in ("run_kernel", "check", "gate", "bench"))
    inputs = [program.upload(kind="tensor", value=x), program.upload(kind="tensor", value=y)]
    reference = program.upload(kind="tensor", value=expected)
    out = program.run(fn=run_kernel, args=[kernel, ALPHA, *inputs])
    program.return_(key="check", value=program.run(fn=check, args=[out, reference]))
    program.run(id="gate", fn=gate, args=[out, reference])
    program.return_(key="benchmark", value=program.run(fn=bench, args=[kernel, ALPHA, *inputs, out]))
    return program


def run_loop(client: Client, library: bytes) -> int:
    """Execute the program and report like an agent would read it -> the exit status."""
    result = client.execute(kernel_program(library), timeout_seconds=120)
    report = result.results.get("check")  # there even when the program FAILED at the gate
    if report is not None:
        print(f"check: {report['summary']}")
    if result.completed:
        timing = result["benchmark"]
        print(f"benchmark: median {timing['latency_ms_median'] * 1e3:.1f} us, min "
              f"{timing['latency_ms_min'] * 1e3:.1f} us over {timing['repeat']} calls")
        return 0
    error = result.error
    print(f"FAILED {error['kind']} at instruction {error['instruction_index']} ({error['instruction_id']})")
    if report is None:  # it failed before the check: the kernel raised, say; the message says why
        print(f"  {error['message']}")
    else:
        for mismatch in report["first_mismatches"]:
            print(f"  out{mismatch['index']} = {mismatch['actual']}, expected {mismatch['expected']}")
    print("benchmark: skipped")
    return 1


def main() -> int:
    broken = "--broken" in sys.argv[1:]
    with Client(URL) as client:
        arch = client.health()["target"].get("arch")
        if arch is not None:  # a host-code kernel would be handed CUDA tensors there
            print(f"{URL} is a GPU server ({arch}): run kernel_loop_cuda.py instead", file=sys.stderr)
            return 2
        library = build_library(BROKEN_SOURCE if broken else SOURCE)
        print(f"built axpy{' (broken)' if broken else ''} for the host CPU: {len(library)} bytes, n={N}")
        return run_loop(client, library)


if __name__ == "__main__":
    sys.exit(main())
