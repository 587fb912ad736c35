"""A worker's life between requests, against a real CPU server: a reused worker starts each
request with torch's settings as it started (docs/server.md §3.3); a retired one is killed before
the answer, which does not wait for its exit (docs/server.md §1.3)."""

import os
import signal
import subprocess
import sys
import time

import pytest

import kcoral_worker
from tests.support import (
    ROOT,
    ServerProcess,
    execute_ok,
    huge_pages_collapse,
    is_alive,
    mem_available,
    plain,
    post,
    simple_program,
)

TORCH_STATE = ("import torch\n"
               "def f(change):\n"
               "    seen = {'dtype': str(torch.get_default_dtype()),\n"
               "            'deterministic': torch.are_deterministic_algorithms_enabled(),\n"
               "            'warn_only': torch.is_deterministic_algorithms_warn_only_enabled(),\n"
               "            'matmul': torch.get_float32_matmul_precision(),\n"
               "            'cudnn_benchmark': torch.backends.cudnn.benchmark}\n"
               "    if change:\n"
               "        torch.set_default_dtype(torch.float64)\n"
               "        torch.use_deterministic_algorithms(True, warn_only=True)\n"
               "        torch.set_float32_matmul_precision('medium')\n"
               "        torch.backends.cudnn.benchmark = True\n"
               "    return {'pid': __import__('os').getpid(), **seen}\n")
DEFAULTS = {"dtype": "torch.float32", "deterministic": False, "warn_only": False, "matmul": "highest",
            "cudnn_benchmark": False}


def torch_state(server, change):
    program = {"instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": TORCH_STATE},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}, "args": [change]},
        {"op": "return", "key": "out", "value": {"$ref": "r"}}]}
    status, _, body = post(server.url, program)
    assert status == 200 and body["status"] == "COMPLETED", body
    return plain(body["results"]["out"])


def test_a_reused_worker_puts_torch_settings_back(tmp_path):
    with ServerProcess("--max-requests-per-worker", "0", workers=1, tmp_path=tmp_path) as server:
        first = torch_state(server, change=True)
        second = torch_state(server, change=False)
    assert first.pop("pid") == second.pop("pid")  # the same process served both
    assert first == DEFAULTS and second == DEFAULTS


# Every worker forked from the template sleeps this long before it can report ready: a stand-in
# for a slow start (on a GPU server, process start plus imports plus CUDA initialisation).
SLOW_START_SECONDS = 1.0
SLOW_START = f"""
import os, sys, time
if sys.argv == ["-c"]:  # only the workers' template (the forkserver), not the server itself
    os.register_at_fork(after_in_child=lambda: time.sleep({SLOW_START_SECONDS}))
"""


def timed_sleep(server, seconds):
    """One request whose program sleeps -> (what the client waited, what the server reports it ran) in s."""
    program = {"instructions": [
        {"op": "upload", "id": "m", "kind": "module", "source": f"import time\ndef f():\n    time.sleep({seconds})\n"},
        {"op": "get_function", "id": "f", "module": {"$ref": "m"}, "name": "f"},
        {"op": "run", "id": "r", "fn": {"$ref": "f"}}]}
    started = time.monotonic()
    status, _, body = post(server.url, program)
    assert status == 200 and body["status"] == "COMPLETED", body
    return time.monotonic() - started, body["elapsed_ms"] / 1e3


def test_the_next_fresh_worker_starts_while_the_request_runs(tmp_path):
    """docs/server.md §1.3: with a fresh worker per request, the next one starts when a request
    begins, so a request running longer than a worker's start-up leaves the next one nothing to
    wait for (before: each waited for the whole start of a worker begun after the last answer)."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_START)
    with ServerProcess(workers=1, tmp_path=tmp_path, env={"PYTHONPATH": str(tmp_path)}) as server:
        overheads = []
        for _ in range(3):  # back to back
            waited, ran = timed_sleep(server, SLOW_START_SECONDS * 1.5)
            overheads.append(waited - ran)
    assert max(overheads[1:]) < SLOW_START_SECONDS / 2, overheads


# A retiring worker holding this much touched memory takes ~0.1 s to exit (the kernel frees it page by page).
EXIT_MEMORY = 1 << 30
HOLDS_MEMORY = f"""
import os, time
held = None
def f():
    global held
    held = bytearray({EXIT_MEMORY})
    held[::4096] = b"\\1" * ({EXIT_MEMORY} // 4096)  # every page touched: the exit must free each
    return [time.time(), os.getpid()]
"""


def exit_seconds_of_held_memory():
    """How long a process holding EXIT_MEMORY of touched memory takes to exit and be reaped, here and now."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        held = bytearray(EXIT_MEMORY)
        held[::4096] = b"\1" * (EXIT_MEMORY // 4096)
        os.write(ready_w, b"+")
        os._exit(0)
    os.close(ready_w)
    os.read(ready_r, 1)
    os.close(ready_r)
    started = time.monotonic()
    os.waitpid(pid, 0)
    return time.monotonic() - started


@pytest.mark.skipif(mem_available() < 3 * EXIT_MEMORY, reason="the host lacks room for a worker holding 1 GiB")
def test_the_answer_does_not_wait_for_the_retired_workers_exit(tmp_path):
    """The worker that served its last request is killed before the answer, which then waits for no
    part of its exit (before: the answer waited until the worker's memory was freed and it was reaped);
    the slot's next request still gets a fresh worker, once the old one is gone."""
    exit_seconds = sorted(exit_seconds_of_held_memory() for _ in range(3))[1]
    with ServerProcess(workers=1, tmp_path=tmp_path) as server:
        status, _, body = post(server.url, simple_program(HOLDS_MEMORY))
        answered = time.time()
        assert status == 200 and body["status"] == "COMPLETED", body
        returned, first_pid = plain(body["results"]["out"])
        status, _, body = post(server.url, simple_program(HOLDS_MEMORY))
        assert status == 200 and body["status"] == "COMPLETED", body
        second_pid = plain(body["results"]["out"])[1]
    assert answered - returned < exit_seconds / 2, (answered - returned, exit_seconds)
    assert second_pid != first_pid and not is_alive(first_pid)


KEEPS_WRITING = """
import os, signal, threading, time
def keep_writing(path, tag):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    while True:
        os.write(fd, tag)
        time.sleep(0.001)
def f(path):
    if os.fork() == 0:  # a child in the worker's group that ignores SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        keep_writing(path, b"c")
    threading.Thread(target=keep_writing, args=(path, b"t"), daemon=True).start()
    time.sleep(0.05)
    return 1
"""


def test_nothing_a_retired_worker_ran_acts_after_the_answer(tmp_path):
    """A program's thread still running in the worker after its last message, and a child it forked,
    are both stopped before the answer: what they write stops growing by the time it arrives."""
    path = tmp_path / "written"
    with ServerProcess(workers=1, tmp_path=tmp_path) as server:
        status, _, body = post(server.url, simple_program(KEEPS_WRITING, args=[str(path)]))
        at_answer = path.read_bytes()
        time.sleep(0.3)
        later = path.read_bytes()
        assert status == 200 and body["status"] == "FAILED", body
        assert body["error"]["message"] == "program left background processes running; they were terminated"
        status, _, body = post(server.url, simple_program("def f():\n    return 5\n"))  # the slot serves on
        assert status == 200 and plain(body["results"]["out"]) == 5, body
    assert b"c" in at_answer and b"t" in at_answer
    assert later == at_answer


NEVER_EXITS = """
import os, time
def f():
    os._exit = lambda code: time.sleep(3600)  # the worker's own exit, after its last message, now hangs
    return os.getpid()
"""


def test_a_worker_that_does_not_exit_is_killed_and_its_slot_serves_on(tmp_path):
    """The answer waits for the retiring worker to begin its exit, within the request's timeout: one
    that never does is a timeout in its teardown, killed, and the slot's next request gets a fresh worker."""
    with ServerProcess(workers=1, tmp_path=tmp_path) as server:
        status, _, body = post(server.url, simple_program(NEVER_EXITS, options={"timeout_seconds": 2}))
        assert status == 504 and "in the worker's teardown after instruction 3" in body["error"]["message"], body
        status, _, body = post(server.url, simple_program("import os\ndef f():\n    return os.getpid()\n"))
        assert status == 200 and body["status"] == "COMPLETED", body
        assert server.health()["load"]["request_capacity"] == 1


LEAVES_A_CHILD = """
import os, subprocess
def f():
    subprocess.Popen(['sleep', '30'])
    return os.getpid()
"""


def test_a_reused_worker_whose_program_left_a_process_retires(tmp_path):
    """docs/server.md §1.3: the worker itself ends what its program left, and then serves no other request."""
    with ServerProcess("--max-requests-per-worker", "0", workers=1, tmp_path=tmp_path) as server:
        status, _, body = post(server.url, simple_program(LEAVES_A_CHILD))
        assert status == 200 and body["error"]["message"] == ("program left background processes running; "
                                                              "they were terminated"), body
        first = plain(body["results"]["out"])
        status, _, body = post(server.url, simple_program("import os\ndef f():\n    return os.getpid()\n"))
        assert status == 200 and plain(body["results"]["out"]) != first, body


TEMPLATE_VIEW = """
import os, sys
def f():
    worker = sys.modules["kcoral_worker"]
    with open("/proc/self/smaps_rollup") as rollup:
        huge = [int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:")]
    return {"huge_kib": huge[0], "prepared": worker.TEMPLATE_PREPARED,
            "marked": worker.TEMPLATE_MARK in os.environ}
"""


@pytest.mark.skipif(not huge_pages_collapse(), reason="this kernel does not collapse memory into huge pages")
def test_a_worker_is_forked_from_a_template_held_in_huge_pages(server):
    """kcoral_worker.collapse_template_memory: the template's memory (torch's, shared with each
    worker until written) is in huge pages, which a fork copies 512 times fewer entries of; the
    worker does not collapse its own again when its program forks, nor passes the mark on."""
    seen = plain(execute_ok(server.url, simple_program(TEMPLATE_VIEW))["results"]["out"])
    assert seen["huge_kib"] >= 16 << 10, seen  # the template holds ~110 MiB of them; writes split some
    assert seen["prepared"] is True and seen["marked"] is False, seen


def test_a_worker_inherits_what_its_template_resolved_for_every_worker(server):
    """kcoral_worker.warm_request_path: every message's field types are resolved in the template,
    not by each fresh worker as it decodes its first JobRequest (which a worker decodes alone
    proves it: it never sees most of the types), torch's settings a worker starts with are the
    ones the template read (0.75 ms of CPU read in each worker), and the template holds the module
    its forkserver's children unpickle their process object with, which each of them imported from
    disk (~1.2 ms of CPU a worker)."""
    source = ("import sys\n"
              "def f():\n"
              "    worker = sys.modules['kcoral_worker']\n"
              "    return [sorted(set(worker.MESSAGE_TYPES) - {c.__name__ for c in worker.MESSAGE_HINTS}),\n"
              "            worker.TEMPLATE_TORCH_SETTINGS is not None]\n")
    assert plain(execute_ok(server.url, simple_program(source))["results"]["out"]) == [[], True]
    fresh = subprocess.run([sys.executable, "-c", "import sys, kcoral_worker\n"
                            "kcoral_worker.warm_request_path()\n"
                            "print('multiprocessing.popen_forkserver' in sys.modules)"],
                           capture_output=True, text=True, check=True, cwd=ROOT)
    assert fresh.stdout.split() == ["True"], fresh


def test_a_group_with_nothing_left_is_confirmed_gone_without_reading_every_process(monkeypatch):
    """kcoral_worker.group_members, as a retired worker's disposal calls it: a group that still has
    a member once its leader is gone is found by a scan of /proc; a group with nothing left (the
    usual end of a worker) is confirmed by one signal-0 call, not a read of every process's stat."""
    scans = []
    table = kcoral_worker.process_table
    monkeypatch.setattr(kcoral_worker, "process_table", lambda: scans.append(1) or table())
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!"], start_new_session=True, stdout=subprocess.PIPE)
    left = int(leader.stdout.readline())
    leader.wait()  # the leader reaped, a member of its group left
    try:
        assert kcoral_worker.group_members(leader.pid) == [left] and scans == [1]
    finally:
        os.kill(left, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not kcoral_worker.group_gone(leader.pid) and time.monotonic() < deadline:  # its new parent reaps it
        time.sleep(0.01)
    assert kcoral_worker.group_members(leader.pid) == [] and scans == [1]
