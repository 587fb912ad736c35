"""kcoral.py's module docstring is its map: the sections and the names placed in each, the calls
that go back up the file (the jumps a reader of one request makes), and the threads the server
runs.  These tests hold the map to the code: names by where the code defines them, jumps by the
calls a real request makes, threads by the ones a busy server runs."""

import ast
import collections
import os
import re
import socket
import threading
import time
import weakref

import pytest

import kcoral
from kcoral import Client, Program
from tests.support import ROOT, bound_names, wait_for

SOURCE = os.path.join(ROOT, "kcoral.py")
NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"


def section_ranges(path=SOURCE):
    """{section number: (first line, last line)} from the `# --- N. title ---` markers."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    starts = [(i + 1, int(m.group(1))) for i, line in enumerate(lines) if (m := re.match(r"# --- (\d+)\. ", line))]
    ends = [start - 1 for start, _ in starts[1:]] + [len(lines)]
    return {number: (start, end) for (start, number), end in zip(starts, ends)}


def section_of(line, ranges):
    return next((n for n, (first, last) in ranges.items() if first <= line <= last), None)


def mapped_names(doc):
    """{section number: the backticked code names the docstring's list of sections places in it}."""
    block = doc.split("Sections, in the order a request travels")[1].split("\n\n")[0]
    block = block.split("\n", 1)[1]
    parts = re.split(r"(?:^|(?<=, ))\s*(\d+)\. ", block, flags=re.M)
    names = collections.defaultdict(set)
    for number, text in zip(parts[1::2], parts[2::2]):
        names[int(number)] |= {n for n in re.findall(r"`([^`]+)`", text) if re.fullmatch(NAME, n)}
    return names


def definitions(tree):
    """[(dotted name, line)] of every top-level function, class and assignment, and every class's
    methods and class attributes."""
    found = []
    for node in tree.body:
        for name in bound_names(node):
            found.append((name, node.lineno))
        if isinstance(node, ast.ClassDef):
            found += [(f"{node.name}.{name}", member.lineno) for member in node.body for name in bound_names(member)]
            found += [(name, member.lineno) for member in node.body for name in bound_names(member)]
    return found


def test_each_name_the_map_places_in_a_section_is_defined_in_that_section():
    ranges = section_ranges()
    with open(SOURCE, encoding="utf-8") as f:
        defined = definitions(ast.parse(f.read()))
    placed = mapped_names(kcoral.__doc__)
    assert set(placed) >= set(range(12)) and sum(map(len, placed.values())) > 25, placed
    misplaced = {(number, name): sorted({section_of(line, ranges) for n, line in defined if n == name})
                 for number, names in placed.items() for name in names
                 if not any(n == name and section_of(line, ranges) == number for n, line in defined)}
    assert not misplaced, f"(section the map says, name): the sections that define it: {misplaced}"


# --- the jumps: calls back up the file --------------------------------------------------------------

def listed_jumps(doc):
    """{(caller section, caller, callee section, callee): GPU only} from the docstring's lines
    `§A `caller` -> §B `callee``, a GPU-only one marked `(GPU)`."""
    block = doc.split("The jumps, the calls that go back up the file")[1].split("\n\n")[0]
    jumps = {}
    for line in block.splitlines():
        m = re.search(rf"§(\d+) `({NAME})` -> §(\d+) `({NAME})`", line)
        if m:
            jumps[(int(m[1]), m[2], int(m[3]), m[4])] = "(GPU)" in line
    return jumps


class ThreadProfile:
    """Calls `profile` in every thread started while it is entered."""

    def __enter__(self):
        threading.setprofile(self.profile)
        return self

    def __exit__(self, *exc):
        threading.setprofile(None)


class CallTrace(ThreadProfile):
    """The calls between kcoral.py's functions made by the threads started while it records, as
    {(caller section, caller, callee section, callee)}; a nested function or lambda counts as the
    function that defines it, and stdlib frames in between (socketserver, threading) are skipped."""

    def __init__(self):
        self.ranges = section_ranges()
        self.calls = set()
        self.lock = threading.Lock()

    def profile(self, frame, event, arg):
        if event != "call" or frame.f_code.co_filename != SOURCE:
            return
        caller = frame.f_back
        while caller is not None and caller.f_code.co_filename != SOURCE:
            caller = caller.f_back
        if caller is None:
            return
        a, b = (section_of(f.f_code.co_firstlineno, self.ranges) for f in (caller, frame))
        if a is not None and b is not None:
            with self.lock:
                self.calls.add((a, named(caller), b, named(frame)))

    def jumps(self):
        return {call for call in self.calls if call[2] < call[0]}


def named(frame):
    return frame.f_code.co_qualname.split(".<locals>")[0]


def upload_program():
    """A module, a bytes blob and a call: the client's first attempt is answered CACHE_MISS and it
    sends the blob, so the request goes through the blob store both ways."""
    program = Program()
    module = program.upload(id="m", kind="module", source="def f(data):\n    print(len(data))\n    return data[:3]\n")
    blob = program.upload(id="b", kind="bytes", value=os.urandom(4096))
    program.return_(key="out", value=program.run(fn=program.get_function(module=module, name="f"), args=[blob]))
    return program


def settle(app, workers=1, timeout=60):
    """Until every slot has its worker back and no replacement is under way."""
    deadline = time.monotonic() + timeout
    while app.pool.load()["requests_in_progress"] or len(app.pool.idle) != workers or app.pool.replacing:
        assert time.monotonic() < deadline, f"the server never settled: {app.pool.load()}"
        time.sleep(0.02)


def embedded(sandbox):
    config = kcoral.ServerConfig(port=0, device="cpu", num_workers=1, log_dir=None, disk_cache_dir="",
                                 log_console=False, sandbox=sandbox)
    return kcoral.create_app(config).start()


@pytest.fixture(scope="module")
def traced_jumps():
    """The jumps one request makes on an embedded server, unsandboxed and sandboxed, until the
    server has its worker back."""
    jumps = set()
    for sandbox in ("none", "bubblewrap"):
        app = embedded(sandbox)
        try:
            settle(app)
            with CallTrace() as trace, Client(app.url) as client:
                result = client.execute(upload_program())
                settle(app)
            assert result.completed, result
        finally:
            app.stop()
        jumps |= trace.jumps()
    return jumps


def test_the_map_lists_every_jump_one_request_makes(traced_jumps):
    listed = {jump for jump, gpu in listed_jumps(kcoral.__doc__).items() if not gpu}
    assert traced_jumps, "the trace saw no call back up the file: is it tracing at all?"
    assert not traced_jumps - listed, f"jumps the docstring does not list: {sorted(traced_jumps - listed)}"
    assert not listed - traced_jumps, f"listed jumps one request does not make: {sorted(listed - traced_jumps)}"


def test_each_listed_jump_is_a_call_the_code_makes():
    """Each jump the map lists, GPU-only ones included (a CPU host cannot trace them), is a call in
    the caller's body, both functions where the map says."""
    ranges = section_ranges()
    with open(SOURCE, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    functions = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            functions |= {f"{node.name}.{m.name}": m for m in node.body if isinstance(m, ast.FunctionDef)}
        elif isinstance(node, ast.FunctionDef):
            functions[node.name] = node
    listed = list(listed_jumps(kcoral.__doc__))
    assert listed
    for a, caller, b, callee in listed:
        called = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)
                  for n in ast.walk(functions[caller]) if isinstance(n, ast.Call)}
        assert callee.split(".")[-1] in called, (caller, callee)
        assert (section_of(functions[caller].lineno, ranges), section_of(functions[callee].lineno, ranges)) == (a, b)



# --- the threads --------------------------------------------------------------------------------------

SLOT_NAME = re.compile(r"-(?:cpu|gpu\d+)/w\d+$")


def listed_threads(doc):
    block = doc.split("Threads of this process, by name")[1].split("\n\n")[0]
    return set(re.findall(r"^    ([\w{}-]+): ", block, flags=re.M))


def threads_in_source():
    """The name of every thread kcoral.py starts (an f-string's fields read `{slot}`), None for one
    started without a name, the names of the callables it hands to its helper threads
    (`helpers.start`), and the names it gives a thread it runs on (`current_thread().name =`)."""
    with open(SOURCE, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr == "Thread" or node.func.attr == "start" and "helpers" in ast.unparse(node.func.value)):
            name = next((k.value for k in node.keywords if k.arg == "name"), None)
            names.append(None if name is None else literal_name(name))
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr == "name" and "current_thread" in ast.unparse(t.value)
                for t in node.targets):
            names.append(literal_name(node.value))
    return names


def literal_name(node):
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{slot}" for v in node.values)
    return node.value if isinstance(node, ast.Constant) else ast.unparse(node)


def test_every_thread_the_server_starts_has_a_name_the_map_lists():
    started = threads_in_source()
    assert len(started) >= 12 and None not in started, started
    assert listed_threads(kcoral.__doc__) == set(started) | {"MainThread"}


class ThreadNames(ThreadProfile):
    """Every name but the first of every thread started while it records that ran code of
    kcoral.py, or its only one (a thread may rename itself: socketserver's connection threads do
    before they serve, a helper thread for each callable it runs), plus what `threading.enumerate()`
    shows of them whenever `snapshot` is called."""

    def __init__(self):
        self.names = collections.defaultdict(list)
        self.before = set(threading.enumerate())

    def profile(self, frame, event, arg):
        if frame.f_code.co_filename == SOURCE:
            self.saw(threading.current_thread())

    def saw(self, thread):
        names = self.names[thread]
        if not names or names[-1] != thread.name:
            names.append(thread.name)

    def snapshot(self):
        for thread in threading.enumerate():
            if thread not in self.before and not thread.name.startswith("test-"):
                self.saw(thread)

    def kinds(self):
        return {SLOT_NAME.sub("-{slot}", name) for names in self.names.values() for name in names[1:] or names
                if not name.startswith("test-")}


def test_helper_threads_are_reused_and_keep_nothing_of_what_they_ran(monkeypatch):
    """`Helpers`: a callable runs on a thread an earlier one finished on; once it returns, the thread
    holds nothing of it (a retired worker's pipes, say) while it waits, and an idle thread exits."""
    monkeypatch.setattr(kcoral, "HELPER_IDLE_SECONDS", 0.3)
    helpers, ran = kcoral.Helpers(), []

    class Held:
        pass

    held = Held()
    gone = weakref.ref(held)
    first = helpers.start(lambda obj: ran.append(threading.get_ident()), held, name="test-helper")
    first.join(5)
    del held
    assert gone() is None, "the idle thread still holds what its callable was given"
    helpers.start(lambda: ran.append(threading.get_ident()), name="test-helper").join(5)
    assert len(ran) == 2 and ran[0] == ran[1], ran
    assert wait_for(lambda: not helpers.idle and all(t.ident != ran[0] for t in threading.enumerate()), 5)


def slow_body(url):
    """A connection that sent its headers and a tenth of its body, and waits."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=B\r\n"
                 b"Content-Length: 10000\r\n\r\n" + b"-" * 1000)
    return sock


def busy_request(url, seconds):
    """A request that uploads a file, prints, and runs `seconds`, its output streamed back."""
    program = Program()
    program.upload_file(blob=os.urandom(2048), path="data.bin")
    module = program.upload(kind="module", source=f"import time\ndef f():\n    print('busy', flush=True)\n"
                                                  f"    time.sleep({seconds})\n    return 1\n")
    program.return_(key="out", value=program.run(fn=program.get_function(module=module, name="f")))
    with Client(url) as client:
        return client.execute(program, on_output=lambda stream, data: None)


@pytest.mark.parametrize("sandbox", ["none", "bubblewrap"])
def test_a_busy_server_runs_only_the_threads_the_map_lists(sandbox, tmp_path):
    """A running request with streamed output, a file blob and a memory limit, a slow body, the
    spare worker starting and the retired one replaced: every thread of the server that runs is
    one the docstring lists."""
    config = kcoral.ServerConfig(port=0, device="cpu", num_workers=1, log_dir=None, log_console=False,
                                 disk_cache_dir=str(tmp_path / "disk"), sandbox=sandbox,
                                 memory_limit_bytes=2 << 30)
    with ThreadNames() as threads:
        app = kcoral.create_app(config).start()
        try:
            sock = slow_body(app.url)
            result = []
            client = threading.Thread(target=lambda: result.append(busy_request(app.url, 1.5)), name="test-client")
            client.start()
            while client.is_alive():
                threads.snapshot()
                time.sleep(0.005)
            sock.close()
            settle(app)
            threads.snapshot()
        finally:
            app.stop()
    assert result and result[0].completed, result
    seen, listed = threads.kinds(), listed_threads(kcoral.__doc__)
    assert not seen - listed, f"threads the map does not list: {seen - listed}"
    driven = {"kcoral-http", "kcoral-connection", "kcoral-connection-guard", "kcoral-output-reader",
              "kcoral-stream-sender", "kcoral-replace-{slot}", "kcoral-write-blobs", "memory-watch"}
    if sandbox == "none":  # a container forks one worker at a time: no spare beside it
        driven.add("kcoral-spare-{slot}")
    assert driven <= seen, f"the test no longer drives {driven - seen}"


# --- one way to end a worker -------------------------------------------------------------------

def test_a_worker_is_ended_only_by_the_pool():
    """Once a worker has a slot, `Pool.end_worker` is the only caller of its `kill`: the quarantine
    of a GPU whose worker cannot be confirmed gone is decided there and nowhere else.  (A `Worker`
    whose start fails kills itself; it has no slot yet.)"""
    with open(SOURCE, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    callers = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name != "Worker"):
        for method in (m for m in cls.body if isinstance(m, ast.FunctionDef)):
            for node in ast.walk(method):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "kill" \
                        and "worker" in ast.unparse(node.func.value).lower():
                    callers.append(f"{cls.name}.{method.name}")
    assert callers == ["Pool.end_worker"], callers
