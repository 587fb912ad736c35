"""Messages that say what to fix: each test quotes what a user reads when a program goes wrong.

A syntax error shows the line and a caret (docs/protocol.md §8.3); a program's traceback shows
its own frames, not the worker's (§9.7); a timeout names the instruction and keeps the output
(§9.8); a value that cannot be returned is named by its return key and its path (§9.5).
"""

import contextlib
import os
import types
from multiprocessing.connection import Connection

import pytest

import kcoral
import kcoral_worker
from client import Client, KCoralError, Program
from tests.support import ServerProcess, post, simple_program


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with ServerProcess(tmp_path=tmp_path_factory.mktemp("messages")) as srv, Client(srv.url) as client:
        yield client


def failed(client, program, **options):
    result = client.execute(program, **options)
    assert not result.completed, result
    return result.error


def calling(source, name, args=()):
    """upload -> get_function -> run -> return "out"."""
    program = Program()
    fn = program.get_function(module=program.upload(kind="module", source=source, id="m"), name=name, id="fn")
    program.return_(key="out", value=program.run(fn=fn, args=list(args), id="r"))
    return program


def test_a_syntax_error_shows_the_line_and_a_caret_under_the_column(client):
    program = Program()
    program.upload(kind="module", source="def f(x):\n    return x\n\ndef g(x:\n    pass\n")
    error = failed(client, program)
    assert error["kind"] == "parse"
    first, line, caret = error["message"].splitlines()
    assert first.startswith("syntax error: ") and first.endswith(", line 4)"), first
    assert (line, caret) == ("    def g(x:", "         ^"), error["message"]


def test_an_indentation_error_shows_the_line(client):
    program = Program()
    program.upload(kind="module", source="x = 1\n    y = 2\n")
    message = failed(client, program)["message"]
    assert message.splitlines()[0].startswith("syntax error: unexpected indent (<uploaded:"), message
    assert message.splitlines()[1:] == ["    y = 2"], message


def test_a_programs_traceback_has_its_frames_and_none_of_the_servers(client):
    source = "def f():\n    return helper()\n\ndef helper():\n    raise ValueError('boom')\n"
    error = failed(client, calling(source, "f"))
    assert (error["kind"], error["message"]) == ("engine", "ValueError: boom")
    lines = error["traceback"].splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert [line.split(",")[1:] for line in lines if line.startswith("  File")] == \
        [[" line 2", " in f"], [" line 5", " in helper"]], error["traceback"]
    assert "kcoral" not in error["traceback"] and lines[-1] == "ValueError: boom"


def test_a_call_with_the_wrong_arguments_is_the_programs_error_without_server_frames(client):
    error = failed(client, calling("def f(a):\n    return a\n", "f", [1, 2]))
    assert error["message"] == "TypeError: f() takes 1 positional argument but 2 were given"
    assert error["traceback"] == "TypeError: f() takes 1 positional argument but 2 were given\n"


def test_a_top_level_exception_keeps_the_modules_frame_only(client):
    program = Program()
    program.upload(kind="module", source="import json\nvalue = json.loads('{')\n")
    error = failed(client, program)
    assert error["kind"] == "parse" and error["message"].startswith("JSONDecodeError: "), error
    assert ', line 2, in <module>' in error["traceback"]
    assert "kcoral_worker.py" not in error["traceback"] and "kcoral.py" not in error["traceback"]


@pytest.mark.parametrize("body, message", [
    ("return {'a': [1, 2, {3}]}",
     'return "out": value["a"][2] is a set, which cannot be returned (None, bool, int, float, str, bytes, list, '
     "tuple, dict with str keys and tensors can)"),
    ("return [0.5, {'t': float('nan')}]",
     'return "out": value[1]["t"] is a non-finite number (nan), which JSON cannot carry'),
    ("return {'m': {1: 'one'}}",
     'return "out": value["m"] is a dict with a key that is not a string (1); returned dicts need string keys'),
    ("return print",
     'return "out": value is a builtin_function_or_method, which cannot be returned (None, bool, int, float, '
     "str, bytes, list, tuple, dict with str keys and tensors can)"),
    ("return [10 ** 5000]", 'return "out": value[0] is an integer of more than 4300 digits'),
])
def test_an_unreturnable_value_is_named_by_its_key_and_path(client, body, message):
    error = failed(client, calling(f"def f():\n    {body}\n", "f"))
    assert (error["kind"], error["instruction_op"], error["instruction_id"]) == ("serialization", "return", None)
    assert error["message"] == message


def test_a_value_nested_too_deeply_names_the_first_and_last_steps(client):
    error = failed(client, calling("def f():\n    v = 1\n    for _ in range(500):\n        v = [v]\n    return v\n",
                                   "f"))
    assert error["message"] == ('return "out": value[0][0][0][0][0][0][...][0][0][0][0][0][0] is nested more '
                                "than 400 levels deep"), error["message"]


SLOW = "import os, sys, time\ndef f():\n    print('started')\n    os.write(2, b'warming up\\n')\n    time.sleep(60)\n"


def test_a_timeout_names_the_instruction_and_the_limit_and_keeps_the_output(client):
    with pytest.raises(KCoralError) as info:
        client.execute(calling(SLOW, "f"), timeout_seconds=2)
    error = info.value
    assert (error.status_code, error.kind) == (504, "timeout")
    assert error.message == "execution timed out after 2 s in instruction 2 (run 'r')"
    assert (error.instruction_index, error.instruction_op, error.instruction_id) == (2, "run", "r")
    assert (error.stdout, error.stderr, error.stdout_truncated, error.stderr_truncated) == \
        ("started\n", "warming up\n", False, False)


def test_the_timeout_body_keeps_the_published_shape_and_adds_fields_beside_it(client):
    status, headers, body = post(client.base_url, simple_program(SLOW, options={"timeout_seconds": 1.5}))
    assert (status, headers["content-type"]) == (504, "application/json")
    assert body == {"status": "ERROR", "request_id": headers["x-request-id"],
                    "stdout": "started\n", "stderr": "warming up\n", "stdout_truncated": False,
                    "stderr_truncated": False,
                    "error": {"kind": "timeout", "message": "execution timed out after 1.5 s in instruction 2 "
                                                            "(run 'r')",
                              "instruction_index": 2, "instruction_op": "run", "instruction_id": "r"}}


def test_a_timeout_in_a_return_names_its_key(client):
    program = Program()
    source = "import time\nclass Slow(dict):\n    def items(self):\n        time.sleep(60)\n" \
             "def f():\n    return Slow()\n"  # the encoder reads a dict's items
    fn = program.get_function(module=program.upload(kind="module", source=source), name="f")
    program.return_(key="late", value=program.run(fn=fn))
    with pytest.raises(KCoralError) as info:
        client.execute(program, timeout_seconds=1)
    assert info.value.message == "execution timed out after 1 s in instruction 3 (return 'late')"
    assert (info.value.instruction_op, info.value.instruction_id) == ("return", None)


def file_uploads_then(program, count):
    for i in range(count):
        program.upload_file(path=f"in/f{i}.txt", blob=b"x%d" % i)
    return program


def test_a_timeout_after_a_run_of_file_uploads_names_the_instruction_running(client):
    program = file_uploads_then(Program(), 40)
    fn = program.get_function(module=program.upload(kind="module", source=SLOW, id="m"), name="f", id="fn")
    program.run(fn=fn, id="r")
    with pytest.raises(KCoralError) as info:
        client.execute(program, timeout_seconds=2)
    assert info.value.message == "execution timed out after 2 s in instruction 42 (run 'r')"
    assert info.value.instruction_index == 42


FILES = [{"op": "upload", "id": f"f{i}", "kind": "file", "path": f"f{i}", "blob": "0" * 64} for i in range(3)]
MODULE = {"op": "upload", "id": "m", "kind": "module", "source": ""}


def announced(instructions, progress_full=False):
    """(indices sent as InstructionStarted, indices written to the progress pipe) by ProgramRun.announce_start."""
    conn_r, conn_w = os.pipe()
    progress_r, progress_w = os.pipe()
    os.set_blocking(progress_w, False)
    with Connection(conn_r) as conn, Connection(conn_w) as conn_writer, open(progress_r, "rb", closefd=True) as pipe:
        with contextlib.suppress(BlockingIOError):
            while progress_full:
                os.write(progress_w, b"\0" * 4096)
        request = kcoral_worker.JobRequest(instructions=instructions, retire=False, workspace="", blob_index={},
                                           capture=False, grace=0.1, max_response_bytes=1 << 20,
                                           max_response_parts=1000, progress=True)
        run = kcoral_worker.ProgramRun(conn_writer, request, None, None, kcoral_worker.NoLease(), None, progress_w)
        for index in range(len(instructions)):
            run.announce_start(index)
        os.close(progress_w)
        messages = []
        while conn.poll(0):
            messages.append(kcoral_worker.receive_message(conn)[0].index)
        records = pipe.read() if not progress_full else b""
    return messages, [kcoral_worker.PROGRESS_RECORD.unpack_from(records, i)[0] for i in range(0, len(records), 4)]


def test_every_instruction_but_the_first_is_announced_on_the_progress_pipe_without_a_message():
    assert announced([*FILES, MODULE, *FILES]) == ([0], [1, 2, 3, 4, 5, 6])
    assert announced([MODULE]) == ([0], [])


def test_a_full_progress_pipe_falls_back_to_messages():
    assert announced([*FILES, MODULE], progress_full=True)[0] == [0, 1, 2, 3]


def reported(records, last_index, instructions):
    """Execution.reported_start's last_index after the worker wrote `records` to the progress pipe."""
    progress_r, progress_w = os.pipe()
    os.set_blocking(progress_r, False)
    os.write(progress_w, records)
    os.close(progress_w)
    execution = types.SimpleNamespace(progress=progress_r, last_index=last_index,
                                      job=types.SimpleNamespace(program=types.SimpleNamespace(instructions=instructions)))
    try:
        kcoral.Execution.reported_start(execution)
    finally:
        os.close(progress_r)
    return execution.last_index


def test_the_front_end_takes_the_last_instruction_reported_on_the_progress_pipe():
    record = kcoral_worker.PROGRESS_RECORD.pack
    assert reported(record(1) + record(2), 0, [*FILES, MODULE]) == 2
    assert reported(record(1) + record(3), 0, [*FILES, MODULE]) == 3
    assert reported(record(1), 3, [*FILES, MODULE, *FILES]) == 3  # an older record: the message is later
    assert reported(record(9), 0, [*FILES, MODULE]) == 0  # out of range
    assert reported(b"\1\0", 0, [*FILES, MODULE]) == 0  # not a whole record
