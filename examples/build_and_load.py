"""Build a C++ kernel on the server and call it, in one program: no compiler, no apache-tvm-ffi
here, only the client (a vendored client.py will do).

The source is uploaded as a file of the request's working directory; in the program,
`kcoral.builtins.build_library` compiles it with g++ against the server's apache-tvm-ffi
(a `.cu` file would go through nvcc for the server's GPU) and loads it, and `get_function`
binds its export as it would an uploaded library's.  Then the same source with a typo: the
program fails at the build with kind `compile` and g++'s diagnostics.
Prints `scale(2, [0, 1, 2, 3]) = [0.0, 2.0, 4.0, 6.0]`, then `compile error at instruction 3
(build):` and g++'s first error line (`kernel.cc:7:…: error: … has no member named 'data_pointer'`).
"""

import os

from kcoral import Client, Program

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")

KERNEL = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

void scale(double alpha, tvm::ffi::TensorView x, tvm::ffi::TensorView out) {
  for (int64_t i = 0; i < x.size(0); ++i)
    static_cast<float*>(out.data_ptr())[i] = alpha * static_cast<const float*>(x.data_ptr())[i];
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(scale, scale);
"""

HARNESS = """
import torch
from kcoral.builtins import build_library

def build(path):
    return build_library(path)  # g++ for .cc; the loaded module, whose exports get_function binds

def call(scale):
    x = torch.arange(4, dtype=torch.float32)  # host memory: this kernel is CPU code
    out = torch.empty_like(x)
    scale(2.0, x, out)
    return out.tolist()
"""


def build_and_call(client: Client, source: str):
    program = Program()
    harness = program.upload(kind="module", source=HARNESS)
    program.upload_file(blob=source.encode(), path="kernel.cc")
    library = program.run(id="build", fn=program.get_function(module=harness, name="build"), args=["kernel.cc"])
    scale = program.get_function(module=library, name="scale")
    program.return_(key="out", value=program.run(fn=program.get_function(module=harness, name="call"),
                                                 args=[scale]))
    return client.execute(program, timeout_seconds=120)


def main() -> None:
    with Client(URL) as client:
        result = build_and_call(client, KERNEL)
        if not result.completed:
            raise SystemExit(f"{result.error['kind']}: {result.error['message']}")
        print(f"scale(2, [0, 1, 2, 3]) = {result['out']}")

        broken = build_and_call(client, KERNEL.replace("out.data_ptr()", "out.data_pointer()"))
        error = broken.error
        print(f"{error['kind']} error at instruction {error['instruction_index']} ({error['instruction_id']}):")
        print(next(line for line in error["message"].splitlines() if "error:" in line))


if __name__ == "__main__":
    main()
