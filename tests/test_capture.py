"""Output capture (docs/server.md §3.2): buffered print() output stays in order with what child
processes write, survives the crashes the docs say it survives, and costs about one write."""

import statistics
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcoral import LONG_TEXT_CHARS, json_bytes, json_pieces
from tests.support import (
    assert_completed,
    assert_error_body,
    assert_failed,
    execute_ok,
    get_fn,
    plain,
    post,
    prog,
    ret,
    run,
    simple_program,
    up_module,
)

LINE_BUDGET = 256  # kcoral_worker.LINE_BUDGET: lines per instruction written through as printed
CHATTY = 1000  # lines printed first so that stdout is past the budget, block-buffered
LINE = "y" * 63  # with its newline, 64 bytes

ORDER_SOURCE = """import os, subprocess, sys
def f(chatty):
    for _ in range(chatty):
        print("n")
    print("a")
    subprocess.run(["echo", "b"])
    print("c")
    os.system("echo d")
    print("e")
    pid = os.fork()
    if pid == 0:
        print("f")
        os._exit(0)
    os.waitpid(pid, 0)
    print("g")
    os.waitpid(os.posix_spawnp("echo", ["echo", "h"], os.environ), 0)
    print("i")
    print("x", file=sys.stderr)
    subprocess.run(["sh", "-c", "echo y >&2"])
    print("z", file=sys.stderr)
"""


@pytest.mark.parametrize("chatty", [0, CHATTY], ids=["line-buffered", "block-buffered"])
def test_prints_interleave_with_child_processes(server, chatty):
    body = execute_ok(server.url, simple_program(ORDER_SOURCE, args=[chatty]))
    assert_completed(body)
    assert body["stdout"] == "n\n" * chatty + "".join(f"{c}\n" for c in "abcdefghi")
    assert body["stderr"] == "x\ny\nz\n"


def test_output_of_an_instruction_precedes_the_next_ones(server):
    source = ("import os\ndef chat(n):\n    for i in range(n):\n        print(i)\n"
              "def raw():\n    os.write(1, b'raw\\n')\n")
    program = prog(up_module("m", source), get_fn("chat", "m", "chat"), get_fn("raw", "m", "raw"),
                   run("c", "chat", CHATTY), run("r", "raw"), ret("out", "r"))
    body = execute_ok(server.url, program)
    assert_completed(body)
    assert body["stdout"] == "".join(f"{i}\n" for i in range(CHATTY)) + "raw\n"


HELD_SOURCE = """import sys
held = {}
def first(n):
    held["text"], held["bytes"] = sys.stdout, sys.stdout.buffer
    for i in range(n):
        print(i)
        if i % 100 == 50:
            held["text"].write(f"t{i}\\n")
            held["bytes"].write(f"b{i}\\n".encode())
    held["late"] = sys.stdout
def second(n):
    for i in range(n):
        print(i)
        if i % 100 == 50:
            held["late"].write(f"l{i}\\n")
"""


def test_streams_held_across_the_line_budget_keep_the_order_of_writes(server):
    """Past the line budget sys.stdout is another stream until the next instruction: writes through
    streams a program took before (or during) that stretch still come out in the order made."""
    program = prog(up_module("m", HELD_SOURCE), get_fn("first", "m", "first"), get_fn("second", "m", "second"),
                   run("a", "first", 3 * LINE_BUDGET), run("b", "second", 3 * LINE_BUDGET))
    body = execute_ok(server.url, program)
    assert_completed(body)

    def expected(n, extra):
        return "".join(f"{i}\n" + ("".join(f"{x}{i}\n" for x in extra) if i % 100 == 50 else "") for i in range(n))
    assert body["stdout"] == expected(3 * LINE_BUDGET, "tb") + expected(3 * LINE_BUDGET, "l")


CRASH_SOURCE = """import ctypes, os, signal
def talk():
    print("earlier-instruction")
def crash(lines):
    for i in range(lines):
        print(f"{{i:08d}}")
    {stmt}
"""
# how the worker dies -> whether print() output past the line budget is flushed first
CRASHES = {"os-exit": ("os._exit(3)", True), "abort": ("os.abort()", True),
           "sigkill": ("os.kill(os.getpid(), signal.SIGKILL)", False), "sigsegv": ("ctypes.string_at(0)", False)}


@pytest.mark.parametrize("lines", [LINE_BUDGET, 4 * CHATTY], ids=["within-budget", "past-budget"])
@pytest.mark.parametrize("how", list(CRASHES))
def test_crash_keeps_the_output_the_docs_promise(server, how, lines):
    stmt, flushed_first = CRASHES[how]
    program = prog(up_module("m", CRASH_SOURCE.format(stmt=stmt)), get_fn("talk", "m", "talk"),
                   get_fn("crash", "m", "crash"), run("t", "talk"), run("c", "crash", lines))
    body = execute_ok(server.url, program)
    assert_failed(body, "runtime", 4, "run", "c", "worker exited")
    printed = "earlier-instruction\n" + "".join(f"{i:08d}\n" for i in range(lines))
    stdout = body["stdout"]
    assert printed.startswith(stdout)
    if flushed_first or lines <= LINE_BUDGET:
        assert stdout == printed
    else:  # the lines past the budget are lost at most as far as the buffers reach (2 x 8 KiB)
        assert len(stdout) >= len("earlier-instruction\n") + 9 * LINE_BUDGET
        assert len(printed) - len(stdout) <= 16 << 10


def test_timeout_answers_without_output(server):
    """docs/protocol.md §8.8: a timed-out request's answer carries no partial results."""
    source = "import time\ndef f():\n    print('before the timeout')\n    time.sleep(30)\n"
    status, headers, body = post(server.url, simple_program(source, options={"timeout_seconds": 1}))
    assert_error_body(status, headers, body, 504, "timeout")  # no "stdout" among its fields


def test_many_prints_cost_about_one_write(server):
    """65 536 print() lines (4 MiB) against one 4 MiB write, whole requests alternating."""
    sources = {"prints": f"def f():\n    for _ in range(65536):\n        print({LINE!r})\n",
               "write": "import sys\ndef f():\n    sys.stdout.write('x' * (1 << 22))\n"}
    samples = {name: [] for name in sources}
    for _ in range(5):
        for name, source in sources.items():
            started = time.perf_counter()
            body = execute_ok(server.url, simple_program(source, options={"output_limit_bytes": 8 << 20}))
            samples[name].append(time.perf_counter() - started)
            assert_completed(body)
            assert len(body["stdout"]) == 1 << 22
    ratio = statistics.median(samples["prints"]) / statistics.median(samples["write"])
    assert ratio < 3, samples


PRINT_COST_SOURCE = f"""import os, sys, time
def f():
    times = {{"captured": [], "devnull": []}}
    with open(os.devnull, "w") as devnull:
        for _ in range(3):
            for name, stream in (("captured", sys.stdout), ("devnull", devnull)):
                started = time.perf_counter()
                for _ in range(65536):
                    print({LINE!r}, file=stream)
                stream.flush()
                times[name].append(time.perf_counter() - started)
    return [min(times["captured"]), min(times["devnull"])]
"""


def test_captured_prints_cost_about_what_printing_to_a_file_costs(server):
    """The capture's own cost per line, measured in the worker: a write syscall per line made the
    captured prints 5-9x slower than the same prints into a block-buffered file."""
    body = execute_ok(server.url, simple_program(PRINT_COST_SOURCE, options={"output_limit_bytes": 16 << 20}))
    captured, devnull = plain(assert_completed(body)["out"])
    assert len(body["stdout"]) == 3 << 22
    assert captured / devnull < 3, (captured, devnull)


@settings(max_examples=300, deadline=None)
@given(st.text(), st.text(), st.sampled_from([(0, 0), (1, 0), (0, 1), (1, 1)]))
def test_long_output_is_encoded_byte_for_byte_as_json_encodes_it(out, err, long):
    """The answer's captured output, escaped apart (json_pieces), gives exactly json_bytes' JSON, whatever
    the text holds: quotes, backslashes, every control character, non-ASCII, lone surrogates."""
    out, err = ((text * (LONG_TEXT_CHARS // max(len(text), 1) + 1) if text and grow else text)
                for text, grow in zip((out, err), long))
    body = {"status": "COMPLETED", "stdout": out, "stderr": err, "results": {"stdout": out[:40], "x": [err[:9]]}}
    assert b"".join(json_pieces(body)) == json_bytes(body)


def test_long_output_is_escaped_apart():
    body = {"status": "COMPLETED", "stdout": (LINE + "\n") * 65536, "stderr": 'a "quoted" \\ \x01\n' * 5000}
    pieces = json_pieces(body)
    assert len(pieces) == 9 and b"".join(pieces) == json_bytes(body)  # each text's JSON a piece of its own
