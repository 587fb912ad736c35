# requires: gpu
"""The kernel loop of kernel_loop.py with a CUDA kernel: built here with nvcc for exactly
the architecture the server reports in /health (`target.arch`, e.g. sm_90a), then run,
checked against the NumPy reference, gated and benchmarked in one program on the GPU.

Needs a GPU server, and nvcc plus apache-tvm-ffi (the server's version) here; without a
local nvcc, build on a compile server instead (compile_cpu_then_gpu.py).  On the GPU the
benchmark's cache flush costs microseconds, and CUPTI times each call from its first to
its last GPU activity.  `--broken` builds the off-by-one kernel.  Prints the same lines as
kernel_loop.py; exit status 0 when the check passed, 1 when it failed.
"""

import os
import sys

import tvm_ffi
from _tvm_ffi_build import build_library
from kernel_loop import N, run_loop

from kcoral import Client

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")

SOURCE = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

__global__ void axpy_kernel(float alpha, const float* x, const float* y, float* out, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = alpha * x[i] + y[i];
}

void axpy(double alpha, tvm::ffi::TensorView x, tvm::ffi::TensorView y, tvm::ffi::TensorView out) {
  TVM_FFI_ICHECK(x.ndim() == 1 && x.size(0) == y.size(0) && x.size(0) == out.size(0)) << "1-d, one length";
  DLDataType f32{kDLFloat, 32, 1};
  TVM_FFI_ICHECK(x.dtype() == f32 && y.dtype() == f32 && out.dtype() == f32) << "float32 only";
  TVM_FFI_ICHECK(x.device().device_type == kDLCUDA) << "CUDA tensors only";
  int64_t n = x.size(0);
  // torch's current stream: the launch is ordered with the harness's tensors and timed by CUPTI
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(x.device().device_type, x.device().device_id));
  axpy_kernel<<<(n + 255) / 256, 256, 0, stream>>>(static_cast<float>(alpha), static_cast<const float*>(x.data_ptr()),
                                                   static_cast<const float*>(y.data_ptr()),
                                                   static_cast<float*>(out.data_ptr()), n);
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(axpy, axpy);
"""
BROKEN_SOURCE = SOURCE.replace("if (i < n)", "if (i < n - 1)")  # skips the last element


def main() -> int:
    broken = "--broken" in sys.argv[1:]
    with Client(URL) as client:
        health = client.health()
        arch = health["target"].get("arch")
        if arch is None:
            print(f"{URL} is a CPU server: run kernel_loop.py instead", file=sys.stderr)
            return 2
        if health["versions"].get("tvm_ffi") != tvm_ffi.__version__:
            print(f"warning: tvm_ffi {tvm_ffi.__version__} here, {health['versions'].get('tvm_ffi')} on the server")
        library = build_library(BROKEN_SOURCE if broken else SOURCE, arch)
        print(f"built axpy{' (broken)' if broken else ''} for {arch}: {len(library)} bytes, n={N}")
        return run_loop(client, library)


if __name__ == "__main__":
    sys.exit(main())
