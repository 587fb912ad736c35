"""Upload a compiled TVM-FFI library and call its exported functions on the server.

The library is C++ built here with g++ against the local apache-tvm-ffi (see
_tvm_ffi_build.py); its functions take and return plain values, so the host code runs on
any server, GPU or CPU, of the same CPU architecture and tvm-ffi ABI.  That is why the
example first compares the server's tvm-ffi version (GET /health) with the local one.
Prints the version check, then `add(40, 2) = 42` and `greet = hello, kcoral`, both
computed by the uploaded library.
"""

import os

import tvm_ffi
from _tvm_ffi_build import build_library

from kcoral import Client, Program

URL = os.environ.get("KCORAL_URL", "http://127.0.0.1:8000")

SOURCE = r"""
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

int64_t add(int64_t a, int64_t b) { return a + b; }

tvm::ffi::String greet(tvm::ffi::String name) { return "hello, " + std::string(name); }

// Each export is looked up by this name with get_function(module=<the library>, name=...).
TVM_FFI_DLL_EXPORT_TYPED_FUNC(add, add);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(greet, greet);
"""


def main() -> None:
    with Client(URL) as client:
        remote_version = client.health()["versions"].get("tvm_ffi")
        # A library built against another tvm-ffi may not load there: build with the server's version.
        print(f"tvm_ffi: local {tvm_ffi.__version__}, server {remote_version}"
              f" ({'match' if remote_version == tvm_ffi.__version__ else 'MISMATCH: rebuild with the server version'})")

        program = Program()
        library = program.upload(kind="library", value=build_library(SOURCE))  # cached by hash: sent once
        add = program.get_function(module=library, name="add")
        greet = program.get_function(module=library, name="greet")
        program.return_(key="add", value=program.run(fn=add, args=[40, 2]))
        program.return_(key="greet", value=program.run(fn=greet, args=["kcoral"]))

        result = client.execute(program)
        if not result.completed:
            raise SystemExit(f"{result.error['kind']}: {result.error['message']}")
        print(f"add(40, 2) = {result['add']}")
        print(f"greet = {result['greet']}")


if __name__ == "__main__":
    main()
