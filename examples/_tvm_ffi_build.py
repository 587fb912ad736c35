"""Build a C++ or CUDA source into a TVM-FFI shared library, for the examples.

Not an example itself: the examples import it (locally), and compile_cpu_then_gpu.py
uploads this very file as a module, so the same `build_library` runs on a compile server.
It needs only apache-tvm-ffi (for its headers and libtvm_ffi.so) and a compiler: g++ for
CPU code, nvcc for CUDA code.
"""

import os
import subprocess
import tempfile

import tvm_ffi.libinfo
from kcoral.errors import ExecutionError


def compile_command(source_path: str, output_path: str, arch: str | None) -> list[str]:
    """The compiler line: g++ for a CPU library (arch None), nvcc for an `sm_XX` target.

    Linking against libtvm_ffi.so is what makes `TVM_FFI_DLL_EXPORT_TYPED_FUNC` exports
    resolve; the server has that library loaded already when it opens ours."""
    includes = [f"-I{path}" for path in tvm_ffi.libinfo.include_paths()]
    link = ["-shared", f"-L{os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())}", "-ltvm_ffi"]
    if arch is None:
        return ["g++", "-std=c++17", "-O2", "-fPIC", *includes, source_path, "-o", output_path, *link]
    # "sm_90a" -> code for exactly that architecture (the `a` features included), which is
    # what the server reported: a library built for another one fails to load or to launch.
    return ["nvcc", "-std=c++17", "-O2", "-Xcompiler", "-fPIC", f"-arch={arch}", *includes,
            source_path, "-o", output_path, *link, "-lcudart"]


def build_library(source: str, arch: str | None = None) -> bytes:
    """Compile `source` (C++ when arch is None, else CUDA for that `sm_XX`) -> the .so's bytes.

    A compiler error raises ExecutionError("compile", <the compiler's diagnostics>), so on a
    server the program fails with kind `compile`."""
    suffix = ".cc" if arch is None else ".cu"
    with tempfile.TemporaryDirectory(prefix="kcoral-build-") as build_dir:
        source_path = os.path.join(build_dir, "kernel" + suffix)
        output_path = os.path.join(build_dir, "kernel.so")
        with open(source_path, "w") as f:
            f.write(source)
        done = subprocess.run(compile_command(source_path, output_path, arch), capture_output=True, text=True)
        if done.returncode != 0:
            raise ExecutionError("compile", f"{done.args[0]} failed:\n{done.stderr[-4000:]}")
        with open(output_path, "rb") as f:
            return f.read()
