"""The user's path, against real servers, sandboxed and not: build and load a library in
one program, import an uploaded package, a correctness report that points at the bug, output cut
at the limit that says so and keeps its end, a crash that names its cause, a refused instruction
named by index; `kcoral run`'s words for a timeout and a truncation."""

import os
import subprocess
import sys

import pytest

from kcoral import Client, KCoralError, Program
from tests.support import (
    ROOT,
    ServerProcess,
    assert_completed,
    assert_failed,
    call_program,
    execute_ok,
    get_fn,
    plain,
    prog,
    ret,
    run,
    simple_program,
    up_blob,
    up_module,
)

KERNEL = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
void scale(double alpha, tvm::ffi::TensorView x, tvm::ffi::TensorView out) {
  for (int64_t i = 0; i < x.size(0); ++i)
    static_cast<float*>(out.data_ptr())[i] = alpha * static_cast<const float*>(x.data_ptr())[i];
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(scale, scale);
"""
BUILD = """
import torch
from kcoral.builtins import build_library

def build(path):
    return build_library(path)

def call(kernel):
    x = torch.arange(4, dtype=torch.float32)
    out = torch.empty_like(x)
    kernel(2.0, x, out)
    return out.tolist()
"""


def build_program(source: bytes) -> Program:
    program = Program()
    harness = program.upload(kind="module", source=BUILD)
    program.upload_file(blob=source, path="src/kernel.cc")
    library = program.run(id="build", fn=program.get_function(module=harness, name="build"), args=["src/kernel.cc"])
    kernel = program.get_function(module=library, name="scale")
    program.return_(key="out", value=program.run(fn=program.get_function(module=harness, name="call"), args=[kernel]))
    program.return_file(key="so", path="src/kernel.so")
    return program


def test_build_library_compiles_and_loads_in_one_program(server):
    with Client(server.url) as client:
        result = client.execute(build_program(KERNEL.encode()), timeout_seconds=120)
    assert result.completed, result.error
    assert result["out"] == [0.0, 2.0, 4.0, 6.0]
    assert result["so"].read_bytes()[:4] == b"\x7fELF"  # left in the working directory for return_file


def test_a_compiler_error_is_kind_compile_with_the_diagnostics(server):
    with Client(server.url) as client:
        result = client.execute(build_program(b"int broken( {\n"), timeout_seconds=120)
    assert (result.error["kind"], result.error["instruction_id"]) == ("compile", "build")
    assert result.error["message"].startswith("g++ failed (exit status 1):\n")
    assert "src/kernel.cc:1:" in result.error["message"] and "error:" in result.error["message"]


PACKAGE = {"mypkg/__init__.py": b"from mypkg.core import answer\n", "mypkg/core.py": b"def answer():\n    return 42\n"}


def test_an_uploaded_package_imports_from_the_working_directory(server):
    source = "def f():\n    import mypkg\n    return [mypkg.answer(), mypkg.__file__.endswith('mypkg/__init__.py')]\n"
    program = prog(*(up_blob(f"file{i}", "file", data, path=path) for i, (path, data) in enumerate(PACKAGE.items())),
                   *simple_program(source)["instructions"])
    body = execute_ok(server.url, program, blobs=list(PACKAGE.values()))
    assert plain(assert_completed(body)["out"]) == [42, True]


def test_a_package_uploaded_after_an_import_ran_still_imports(server):
    """The import system caches a directory's listing: files written after an import looked are seen."""
    first = "def probe():\n    try:\n        import mypkg\n    except ImportError:\n        return 'absent'\n"
    second = "def f():\n    import mypkg\n    return mypkg.answer()\n"
    program = prog(up_module("a", first), get_fn("probe", "a", "probe"), run("p", "probe"), ret("before", "p"),
                   *(up_blob(f"file{i}", "file", data, path=path) for i, (path, data) in enumerate(PACKAGE.items())),
                   up_module("b", second), get_fn("f", "b", "f"), run("r", "f"), ret("after", "r"))
    results = assert_completed(execute_ok(server.url, program, blobs=list(PACKAGE.values())))
    assert (plain(results["before"]), plain(results["after"])) == ("absent", 42)


SOFTMAX_CHECK = """
import numpy as np
from kcoral.builtins import check_close

def check(shift):
    rng = np.random.default_rng(0)
    logits = rng.random((64, 128))
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    actual = (expected * (1 + 1e-4)).astype(np.float32)  # float32 rounding: many tiny mismatches
    actual[:, -1] = 0.0                                   # the bug: the last column never written
    actual[5, 3] = float("nan") if shift else actual[5, 3]
    check_close(actual, expected, raise_on_mismatch=True)
"""


def test_a_correctness_failure_points_at_the_worst_element(server):
    body = execute_ok(server.url, call_program(SOFTMAX_CHECK, "check", False))
    message = assert_failed(body, "correctness", 2, "run", "r")["message"]
    assert message.startswith("check_close: 8192 of 8192 elements differ (rtol=1e-05, atol=1e-08), 100.000%; worst [")
    worst = message.split("worst ")[1].split(":")[0]
    assert worst.endswith(", 127]"), message  # in the unwritten column, not the first tiny mismatch
    assert "rel error 1.0)" in message and "; at [0, 0]: " in message and "[63, 127]: 0.0 vs " in message
    with_nan = assert_failed(execute_ok(server.url, call_program(SOFTMAX_CHECK, "check", True)),
                             "correctness", 2, "run", "r")["message"]
    assert "worst [5, 3]: nan vs " in with_nan and "of the actual values, 1 is nan" in with_nan


CHATTY = """
import os, sys
def f(mib):
    for i in range(mib):
        os.write(1, (f"line {i} " + "x" * 1000 + "\\n").encode() * 1024)
    print("the error at the end", file=sys.stdout)
    return mib
"""


def chatty_bytes(mib):
    return sum(1024 * len(f"line {i} " + "x" * 1000 + "\n") for i in range(mib)) + len("the error at the end\n")


def test_truncated_output_says_how_much_and_keeps_its_end(server):
    limit = 64 << 10
    body = execute_ok(server.url, call_program(CHATTY, "f", 3, options={"output_limit_bytes": limit}))
    assert plain(assert_completed(body)["out"]) == 3
    produced = chatty_bytes(3)
    assert (body["stdout_truncated"], body["stdout_bytes"], len(body["stdout"])) == (True, produced, limit)
    assert body["stdout_tail"].endswith("xx\nthe error at the end\n") and len(body["stdout_tail"]) <= limit
    assert (body["output_limit_bytes"], body["max_output_limit_bytes"]) == (limit, 16 << 20)
    assert "stderr_bytes" not in body and "stderr_tail" not in body  # only a stream that was cut
    with Client(server.url) as client:
        program = Program()
        module = program.upload(kind="module", source=CHATTY)
        program.run(fn=program.get_function(module=module, name="f"), args=[17])
        result = client.execute(program, output_limit_bytes=1 << 30)  # above the server's cap: the cap applies
    produced = chatty_bytes(17)
    assert (result.stdout_bytes, len(result.stdout), result.stderr_bytes) == (produced, 16 << 20, None)
    assert result.stdout_tail.endswith("xx\nthe error at the end\n")
    assert result.truncation == (f"output cut: stdout produced {produced} bytes: the first {16 << 20} and the last "
                                 f"{64 << 10} are kept (output_limit_bytes {16 << 20}, the server's cap; "
                                 "write large output to a file and return_file it)")


def test_output_within_the_limit_adds_no_field(server):
    body = execute_ok(server.url, call_program(CHATTY, "f", 0))
    assert "stdout_bytes" not in body and "output_limit_bytes" not in body
    assert body["stdout"] == "the error at the end\n"


CRASHES = {
    "segfault": ("import ctypes\n    ctypes.string_at(0)", "killed by signal 11 (SIGSEGV, Segmentation fault); "
                 'the Python frames it crashed in are in stderr, under "Stack (most recent call first)"'),
    "sigkill": ("os.kill(os.getpid(), signal.SIGKILL)", "killed by signal 9 (SIGKILL, Killed)"),
    "exit": ("os._exit(3)", "it exited with status 3 (os._exit, sys.exit or a native exit())"),
}


@pytest.mark.parametrize("case", sorted(CRASHES))
def test_a_crash_names_its_cause_and_the_python_frames(server, case):
    statement, cause = CRASHES[case]
    source = f"import os, signal\n\ndef helper():\n    {statement}\n\ndef f():\n    helper()\n"
    body = execute_ok(server.url, simple_program(source))
    error = assert_failed(body, "runtime", 2, "run", "r")
    assert error["message"] == f"worker exited while executing the instruction: {cause}"
    if case == "segfault":  # faulthandler's dump: the uploaded code's frames, innermost first
        assert "Fatal Python error: Segmentation fault" in body["stderr"], body["stderr"]
        frames = body["stderr"].split("Stack (most recent call first):")[1]
        assert 'line 5 in helper' in frames and 'line 8 in f' in frames, frames
        assert frames.index("in helper") < frames.index("in f\n")


def test_a_bad_reference_names_its_instruction_as_fields(front_end_server):
    program = Program()
    echo = program.get_function(module=program.upload(kind="module", source="def f(x):\n    return x\n"), name="f")
    program.run(id="call", fn=echo, args=[{"$ref": "nowhere"}])
    with Client(front_end_server.url) as client, pytest.raises(KCoralError) as caught:
        client.execute(program)
    error = caught.value
    assert (error.status_code, error.kind) == (400, "parse")
    assert (error.instruction_index, error.instruction_op, error.instruction_id) == (2, "run", "call")
    assert "instruction 2" in error.message


def kcoral_run(url, *argv, timeout=120):
    return subprocess.run([sys.executable, os.path.join(ROOT, "client.py"), "run", *argv], capture_output=True,
                          text=True, env={**os.environ, "KCORAL_URL": url}, timeout=timeout)


def test_kcoral_run_names_the_tool_and_the_timeout(front_end_server, tmp_path):
    (tmp_path / "slow.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    done = kcoral_run(front_end_server.url, "python", "--send", str(tmp_path / "slow.py"), "--timeout", "2", "--",
                      "slow.py")
    assert done.returncode == 124 and done.stdout == "started\n"
    assert done.stderr.strip().splitlines()[-1] == \
        "kcoral run python: python timed out: still running after --timeout 2 s (its output so far is above)"
    assert "run_" not in done.stderr


def test_kcoral_run_keeps_the_end_of_cut_output_and_names_the_cap(front_end_server, tmp_path):
    (tmp_path / "loud.py").write_text("import sys\nsys.stdout.write('y' * 100000)\nprint('\\nlast line')\n"
                                      "sys.exit(4)\n")
    done = kcoral_run(front_end_server.url, "python", "--send", str(tmp_path / "loud.py"),
                      "--output-limit-bytes", "1000", "--", "loud.py")
    assert done.returncode == 4, done.stderr
    head, marker, tail = done.stdout.partition("\n[kcoral: stdout cut here; its last 1000 bytes follow]\n")
    assert (head, marker) == ("y" * 1000, "\n[kcoral: stdout cut here; its last 1000 bytes follow]\n")
    assert tail.endswith("y\nlast line\n") and len(tail) == 1000
    assert "kcoral: output cut: stdout produced 100011 bytes: the first 1000 and the last 1000 are kept " \
           f"(output_limit_bytes 1000, this server allows up to {16 << 20}; " in done.stderr



def test_a_vendored_client_without_ml_dtypes_says_what_a_bfloat16_result_needs(front_end_server, monkeypatch):
    program = Program()
    module = program.upload(kind="module", source="import torch\ndef f():\n    return torch.ones(2, dtype=torch.bfloat16)\n")
    program.return_(key="x", value=program.run(fn=program.get_function(module=module, name="f")))
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # as in a numpy-only environment: the import fails
    with Client(front_end_server.url) as client, pytest.raises(ImportError) as caught:
        client.execute(program)
    assert str(caught.value) == "a returned bfloat16 tensor needs ml_dtypes to decode: pip install ml_dtypes"


# --- `kcoral run` explains a failure (docs/cli.md, "Exit status") ---------------------------

@pytest.fixture(scope="module")
def tight_server(tmp_path_factory):
    """Sandboxed, with small request limits, so that a script runs into each of them quickly."""
    with ServerProcess("--sandbox", "bubblewrap", "--disk-limit-bytes", str(8 << 20), "--file-limit", "200",
                       "--process-limit", "64", "--memory-limit-bytes", str(768 << 20), workers=1,
                       tmp_path=tmp_path_factory.mktemp("tight")) as srv:
        yield srv


def kcoral_run_script(url, tmp_path, script, *options, timeout=120):
    (tmp_path / "job.py").write_text(script)
    return kcoral_run(url, "python", "--send", str(tmp_path / "job.py"), *options, "--", "job.py", timeout=timeout)


def test_kcoral_run_names_the_signal_that_killed_the_tool(front_end_server, tmp_path):
    done = kcoral_run_script(front_end_server.url, tmp_path, "import ctypes\nprint('before', flush=True)\n"
                             "ctypes.string_at(0)\n")
    assert (done.returncode, done.stdout) == (139, "before\n")
    assert done.stderr.splitlines()[-1] == \
        "kcoral run python: python was killed by signal 11 (SIGSEGV, Segmentation fault)"


def test_kcoral_run_names_the_disk_limit_a_tool_filled(tight_server, tmp_path):
    done = kcoral_run_script(tight_server.url, tmp_path, "with open('big', 'wb') as f:\n"
                             "    f.write(bytes(16 << 20))\n")
    assert done.returncode == 1
    assert "OSError: [Errno 28] No space left on device" in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"kcoral run python: the request's disk limit, {8 << 20} bytes in its workspace, /tmp and /dev/shm "
        "together, is reached: --disk-limit-bytes")


def test_kcoral_run_names_the_file_limit_a_tool_reached(tight_server, tmp_path):
    done = kcoral_run_script(tight_server.url, tmp_path, "for i in range(400):\n    open(f'f{i}', 'w').close()\n")
    assert done.returncode == 1 and "No space left on device" in done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("kcoral run python: the request's file limit, ") and last.endswith(
        " files and directories, is reached: --file-limit"), done.stderr


def test_kcoral_run_says_a_fork_bomb_timed_out_at_the_process_limit(tight_server, tmp_path):
    bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.05)\n"
    done = kcoral_run_script(tight_server.url, tmp_path, bomb, "--timeout", "5")
    assert done.returncode == 124, done.stderr
    assert "kcoral: the request's processes and threads reached its process limit (--process-limit): " \
           "new ones fail with EAGAIN\n" in done.stderr
    assert done.stderr.splitlines()[-1] == (
        "kcoral run python: python timed out: still running after --timeout 5 s; it was at its process limit, "
        "where new processes fail with EAGAIN: --process-limit (its output so far is above)")


def test_kcoral_run_says_the_memory_limit_stopped_the_tool(tight_server, tmp_path):
    # grown step by step, as the sampler sees it: one 1.5 GiB burst is refused at once by the
    # sandbox's RLIMIT_DATA (a MemoryError in the tool's own stderr, exit 1)
    grow = "import time\nheld = []\nfor _ in range(48):\n    held.append(b'x' * (32 << 20))\n    time.sleep(0.02)\ntime.sleep(30)\n"
    done = kcoral_run_script(tight_server.url, tmp_path, grow)
    assert done.returncode == 137, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("kcoral run python: runtime: the request's processes used ") and last.endswith(
        f" bytes of memory, over the {768 << 20} of --memory-limit-bytes; they were stopped"), done.stderr
