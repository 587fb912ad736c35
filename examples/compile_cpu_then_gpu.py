"""Compile on one server, execute on another: a CPU box builds the library for the target
that the GPU server reports, and the GPU server only loads and runs it.

KCORAL_URL is the server that runs the kernel; KCORAL_COMPILE_URL (default: the same
server) the one that compiles it, which needs g++ or nvcc and apache-tvm-ffi of the same
version.  The build step is `kcoral.builtins.build_library` with `load=False`: it compiles
the uploaded source there and leaves the library in the working directory, which
`return_file` brings back.  On a GPU server the kernel is CUDA built with
`nvcc -arch=<its target>`; on a CPU server it is C++.
Prints where it compiled for which target, the library's size, then `y = x + 1` checked
on the executing server: `y[:4] = [0.0, 1.0, 2.0, 3.0]` and `ok: True`.
"""

import os

import numpy

from kcoral import Client, Program

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")
COMPILE_URL = os.environ.get("KCORAL_COMPILE_URL", URL)
BUILDER = """
from kcoral.builtins import build_library

def build(source_path, arch):
    return build_library(source_path, arch, load=False)  # -> the library's path, kernel.so
"""

CPU_SOURCE = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

void add_one(tvm::ffi::TensorView x, tvm::ffi::TensorView y) {
  const float* in = static_cast<const float*>(x.data_ptr());
  float* out = static_cast<float*>(y.data_ptr());
  for (int64_t i = 0; i < x.size(0); ++i) out[i] = in[i] + 1;
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one, add_one);
"""

CUDA_SOURCE = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

__global__ void add_one_kernel(const float* x, float* y, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = x[i] + 1;
}

void add_one(tvm::ffi::TensorView x, tvm::ffi::TensorView y) {
  int64_t n = x.size(0);
  // launch on the stream the caller (torch) is using, so ordering and timing stay right
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(x.device().device_type, x.device().device_id));
  add_one_kernel<<<(n + 255) / 256, 256, 0, stream>>>(static_cast<const float*>(x.data_ptr()),
                                                      static_cast<float*>(y.data_ptr()), n);
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one, add_one);
"""

CHECK = """
from kcoral.builtins import check_close

def check(y, x):
    return check_close(y, x + 1)["ok"]
"""


def compile_remotely(compiler: Client, arch: str | None) -> bytes:
    """Build on the compile server -> the library's bytes."""
    program = Program()
    builder = program.get_function(module=program.upload(kind="module", source=BUILDER), name="build")
    source, path = (CPU_SOURCE, "kernel.cc") if arch is None else (CUDA_SOURCE, "kernel.cu")
    program.upload_file(blob=source.encode(), path=path)
    program.return_file(key="library", path=program.run(fn=builder, args=[path, arch]))
    result = compiler.execute(program, timeout_seconds=300)
    if not result.completed:  # a compiler error is kind "compile", with nvcc's or g++'s diagnostics
        raise SystemExit(f"compilation failed: {result.error['kind']}: {result.error['message']}")
    return result["library"].read_bytes()


def main() -> None:
    with Client(URL) as runner, Client(COMPILE_URL) as compiler:
        arch = runner.health()["target"].get("arch")  # "sm_90a" on an H100 server; absent on CPU
        library = compile_remotely(compiler, arch)
        print(f"compiled on {COMPILE_URL} for {arch or 'the host CPU'}: {len(library)} bytes")

        program = Program()
        add_one = program.get_function(module=program.upload(kind="library", value=library), name="add_one")
        x = program.upload(kind="tensor", value=numpy.arange(1024, dtype="float32") - 1)
        y = program.upload(kind="tensor", value=numpy.zeros(1024, dtype="float32"))
        program.run(fn=add_one, args=[x, y])  # writes y in place; the upload's handle now holds the result
        check = program.get_function(module=program.upload(kind="module", source=CHECK), name="check")
        program.return_(key="ok", value=program.run(fn=check, args=[y, x]))
        program.return_(key="y", value=y)

        result = runner.execute(program)
        if not result.completed:
            raise SystemExit(f"{result.error['kind']}: {result.error['message']}")
        print(f"ran on {URL}: y[:4] = {result['y'][:4].tolist()}")
        print(f"ok: {result['ok']}")


if __name__ == "__main__":
    main()
