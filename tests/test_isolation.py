"""Isolation: every request is hostile, to the server and to the next request.

Each test is an attack from inside an ordinary request against a real server (one CPU worker,
so consecutive requests share a slot and, sandboxed, its container), and each measures its
effect where it would show: files and modes on the host, processes in /proc, the front-end's
memory.  Where the attack can be shown to work against a weaker setup (an unpickling reader, a
plain Python started where the server was), the test shows that too, so it can fail.
"""

import contextlib
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from kcoral_worker import MAPPED_BLOB_BYTES, SEALED_BLOB_BYTES
from tests.support import (
    PYTHON,
    ROOT,
    ServerProcess,
    call_program,
    execute_ok,
    get_fn,
    marked_pids,
    plain,
    post,
    prog,
    ref,
    ret,
    sha256,
    up_blob,
    up_module,
    wait_for,
    workspaces,
)
from tests.support import (
    run as run_instruction,
)

pytestmark = pytest.mark.skipif(not any(os.access(os.path.join(d, "bwrap"), os.X_OK)
                                        for d in os.environ.get("PATH", "").split(":")),
                                reason="bwrap is not installed")


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory):
    base = tmp_path_factory.mktemp("isolation")
    tmpdir = base / "tmp"
    tmpdir.mkdir()
    with ServerProcess("--sandbox", "bubblewrap", workers=1, tmp_path=base, env={"TMPDIR": str(tmpdir)}) as srv:
        srv.tmpdir = str(tmpdir)
        yield srv


def run(srv, source, *args, **options):
    """Run f(*args) from `source` -> the decoded value (asserting a COMPLETED answer)."""
    body = execute_ok(srv.url, call_program(textwrap.dedent(source), "f", *args, **options))
    assert body["status"] == "COMPLETED", body.get("error")
    return plain(body["results"]["out"])


# --- no code from workers -----------------------------------------------------------------------

class Planted:
    """Unpickling this runs a shell command: what a hostile worker would write to its pipe."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_pickle_written_to_every_socket_the_program_holds_runs_nothing(sandboxed, tmp_path):
    canary = tmp_path / "pickle-ran"
    payload = pickle.dumps(Planted(f"touch {canary}"))
    # the payload is real: an unpickling reader (the old front-end, `Connection.recv`) runs it
    pickle.loads(payload)
    assert canary.exists()
    canary.unlink()
    source = """
    import os, stat, struct
    def f(text):
        payload, hit = text.encode("latin-1"), 0
        for fd in range(3, 256):
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.write(fd, struct.pack("!i", len(payload)) + payload)  # multiprocessing's framing
                    hit += 1
            except OSError:
                pass
        return hit
    """
    status, _, body = post(sandboxed.url, call_program(textwrap.dedent(source), "f", payload.decode("latin-1")))
    assert status == 200 and body["status"] == "FAILED", body  # the worker broke the protocol: killed
    assert body["error"]["message"].startswith("worker exited"), body["error"]
    assert not canary.exists()
    assert run(sandboxed, "def f():\n    return 7\n") == 7  # the server keeps serving


def test_malformed_frames_kill_only_the_worker(sandboxed):
    """Oversized, non-JSON and wrongly typed frames: each answered as a crash of its request."""
    source = """
    import json, os, stat, struct
    def f(kind):
        frames = {"huge": struct.pack("!I", 0xFFFFFFF0),
                  "junk": struct.pack("!I", 4) + b"\\xff\\xfe{[",
                  "typed": (lambda p: struct.pack("!I", len(p)) + p)(
                      json.dumps({"type": "InstructionStarted", "index": "0; rm -rf /"}).encode()),
                  "extra": (lambda p: struct.pack("!I", len(p)) + p)(
                      json.dumps({"type": "RequestDone", "error": None, "poisoned": False, "x": 1}).encode())}
        for fd in range(3, 256):
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.write(fd, frames[kind])
            except OSError:
                pass
        import time
        time.sleep(30)
    """
    for kind in ("huge", "junk", "typed", "extra"):
        started = time.monotonic()
        status, _, body = post(sandboxed.url, call_program(textwrap.dedent(source), "f", kind))
        assert status == 200 and body["status"] == "FAILED", (kind, body)
        assert time.monotonic() - started < 20, kind  # not the program's 30 s sleep
    assert run(sandboxed, "def f():\n    return 8\n") == 8


# --- no host-side path the program can steer -----------------------------------------------------

def test_links_and_renames_cannot_steer_the_cleanup_onto_host_files(sandboxed, tmp_path):
    """The program links every writable place to a host directory, tries to rename its mounted
    directories away and chmods everything: the host directory keeps its files and mode, and no
    host directory of the request's is there to steer."""
    host = tmp_path / "host-dir"
    host.mkdir(mode=0o750)
    (host / "precious").write_text("keep me")
    source = """
    import os
    def f(host):
        done = []
        for place in ("/tmp", "/var/tmp", "/dev/shm", "/kcoral"):
            try:
                os.rename(place, place + ".moved")
                done.append("renamed " + place)
            except OSError:
                pass
            for name in ("link", "home", "cache", "work", "blobs", "tmp", "shm", "private"):
                target = os.path.join(place, name)
                try:
                    if os.path.isdir(target) and not os.path.islink(target):
                        os.rename(target, target + ".old")
                    os.symlink(host, target)
                    done.append("linked " + target)
                except OSError:
                    pass
            for folder, dirs, _ in os.walk(place):
                for d in dirs:
                    try:
                        os.chmod(os.path.join(folder, d), 0o777)
                    except OSError:
                        pass
            try:
                os.chmod(place, 0o777)
            except OSError:
                pass
        return done
    """
    done = run(sandboxed, source, str(host))
    assert any(d.startswith("linked /tmp/") for d in done) and any(d.startswith("linked /kcoral/") for d in done)
    assert not [d for d in done if d.startswith("renamed")], done  # mount points cannot be renamed
    assert run(sandboxed, "import os\ndef f():\n    return sorted(os.listdir('/tmp')) + sorted(os.listdir('/kcoral'))\n")
    assert (host / "precious").read_text() == "keep me"
    assert stat.S_IMODE(host.stat().st_mode) == 0o750
    assert workspaces(sandboxed) == []  # no host directory holds what a request writes


# --- nothing persists between requests -------------------------------------------------------------

def test_nothing_one_request_writes_anywhere_is_seen_by_the_next(sandboxed):
    marker = f"planted-{uuid.uuid4().hex[:8]}"
    plant = """
    import os
    def f(marker):
        wrote = []
        places = ["/", "/etc", "/dev", "/usr", "/opt", "/root", "/home", "/kcoral", "/kcoral/home",
                  "/kcoral/cache", "/kcoral/work", "/tmp", "/var/tmp", "/dev/shm"]
        places += os.environ["PATH"].split(":") + [os.environ["HOME"], "/usr/local/bin", "/root/.local/bin"]
        for place in places:
            for path in (os.path.join(place, marker), os.path.join(place, "gcc"), os.path.join(place, "sh")):
                try:
                    os.makedirs(place, exist_ok=True)
                    with open(path, "x") as out:
                        out.write("#!/bin/sh\\necho planted\\n")
                    os.chmod(path, 0o755)
                    wrote.append(path)
                except OSError:
                    pass
        return sorted(set(wrote))
    """
    wrote = run(sandboxed, plant, marker)
    # it could write its private places, and nothing else at all
    assert {os.path.dirname(p) for p in wrote} <= {"/kcoral", "/kcoral/home", "/kcoral/cache", "/kcoral/work",
                                                   "/tmp", "/var/tmp", "/dev/shm"}, wrote
    assert "/tmp/" + marker in wrote and "/kcoral/home/" + marker in wrote
    look = """
    import os, subprocess
    def f(marker, planted):
        found = [p for p in planted if os.path.exists(p)]
        for place in ("/tmp", "/var/tmp", "/dev/shm", "/kcoral"):
            for folder, _, files in os.walk(place):
                found += [os.path.join(folder, n) for n in files if n in (marker, "gcc", "sh")]
        gcc = subprocess.run(["sh", "-c", "gcc --version | head -1"], capture_output=True, text=True).stdout
        return [found, gcc]
    """
    found, gcc = run(sandboxed, look, marker, wrote)
    assert found == [] and "planted" not in gcc and gcc, (found, gcc)


IPC = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
KEY = 0x4B43
def plant():
    shm = libc.shmget(KEY, 4096, 0o1600)  # IPC_CREAT | 0600
    queue = libc.mq_open(b"/kcoral-probe", os.O_CREAT | os.O_RDWR, 0o600, None)
    return [shm >= 0, queue >= 0, libc.shmget(KEY, 0, 0) >= 0]
def look():
    return [libc.shmget(KEY, 0, 0) >= 0, libc.mq_open(b"/kcoral-probe", os.O_RDONLY) >= 0]
"""


def test_shared_memory_and_message_queues_do_not_outlive_the_request(sandboxed):
    """Not files, so no directory cleanup removes them: System V objects and POSIX queues."""
    assert run(sandboxed, IPC.replace("def plant", "def f")) == [True, True, True]  # they existed
    assert run(sandboxed, IPC.replace("def look", "def f")) == [False, False]


def test_environment_allow_list_names_exact_variables(tmp_path):
    secrets_env = {"NVIDIA_API_KEY": "sk-nvidia", "CUDA_SECRET_TOKEN": "sk-cuda", "TORCH_HUB_TOKEN": "sk-torch",
                   "LC_SECRET": "sk-lc", "CUDA_HOME": "/usr/local/cuda",
                   "PATH": f"/nonexistent/bin:{tmp_path}:{os.environ['PATH']}"}
    source = "import os\ndef f():\n    return [dict(os.environ), [d for d in os.environ['PATH'].split(':') if not os.path.isdir(d)]]\n"
    with ServerProcess("--sandbox", "bubblewrap", workers=1, tmp_path=tmp_path, env=secrets_env) as srv:
        env, missing = run(srv, source)
    assert not [k for k in secrets_env if k in env and k not in ("CUDA_HOME", "PATH")], env
    assert env.get("CUDA_HOME") == "/usr/local/cuda"  # an exact name on the list passes
    assert missing == [] and "/nonexistent/bin" not in env["PATH"] and str(tmp_path) not in env["PATH"], env["PATH"]
    assert "/usr/bin" in env["PATH"].split(":")


# --- the start directory is not on the workers' import path -------------------------------------

@pytest.mark.parametrize("mode", ["none", "bubblewrap"])
def test_a_numpy_py_in_the_servers_start_directory_is_never_imported(tmp_path, mode):
    start = tmp_path / "start"
    start.mkdir()
    canary = tmp_path / "fake-numpy-ran"
    (start / "numpy.py").write_text(f"open({str(canary)!r}, 'w').close()\n")
    # the trap is real: a Python started there imports it
    subprocess.run([PYTHON, "-c", "import numpy"], cwd=start, check=False, capture_output=True)
    assert canary.exists()
    canary.unlink()
    env = {"PYTHONPATH": ROOT}  # the server's own files, as an installed copy would provide them
    proc = ServerProcess("--sandbox", mode, workers=1, tmp_path=tmp_path, env=env, cwd=str(start))
    try:
        where = run(proc, "import numpy\ndef f():\n    return numpy.__file__\n")
    finally:
        proc.stop()
    assert "site-packages" in where and not canary.exists(), where


STAGED_WRITER = """
import os
def f(payload):
    tried, targets = [], {}
    for name in os.listdir("/proc/self/fd"):  # all read first: an fd opened below may reuse a listed number
        try:
            targets[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    for name, target in targets.items():
        if "kcoral-blobs" not in target:
            continue
        for how in ("its fd", "reopened read-write"):
            try:
                fd = int(name) if how == "its fd" else os.open(f"/proc/self/fd/{name}", os.O_RDWR)
                os.pwrite(fd, b"EVIL", 0)
                tried.append(how + ": wrote")
            except OSError as exc:
                tried.append(f"{how}: errno {exc.errno}")
            try:
                os.ftruncate(int(name), 0)
                tried.append("truncated")
            except OSError:
                pass
    return [tried, payload == b"staged " * 1000]
"""


@pytest.mark.parametrize("mode", ["none", "bubblewrap"])
def test_staged_blobs_cannot_be_altered_by_the_program(tmp_path, mode):
    """The request's blobs reach the worker in a memfd: the program finds it and tries to write,
    directly and through a read-write reopening via /proc; the seals refuse both, and the same
    blob staged again for the next request is intact."""
    payload = b"staged " * 1000
    program = prog(up_module("m", STAGED_WRITER), get_fn("fn", "m", "f"), up_blob("b", "bytes", payload),
                   run_instruction("r", "fn", ref("b")), ret("out", "r"))
    with ServerProcess("--sandbox", mode, workers=1, tmp_path=tmp_path) as srv:
        for blobs in ((payload,), ()):  # the second answer comes from the memory cache
            body = execute_ok(srv.url, program, blobs)
            assert body["status"] == "COMPLETED", body.get("error")
            tried, intact = plain(body["results"]["out"])
            assert tried == ["its fd: errno 1", "reopened read-write: errno 1"], tried  # EPERM, no truncation
            assert intact is True


STAGED_FDS = """
import os
def staged():
    return sum("kcoral-blobs" in os.readlink(f"/proc/self/fd/{name}") for name in os.listdir("/proc/self/fd")
               if os.path.islink(f"/proc/self/fd/{name}"))
def length(data):
    return len(data)
"""


def test_blobs_are_staged_only_once_the_program_reads_one(tmp_path):
    """The worker asks for the memfd the first time it needs a blob's bytes: before that the
    program holds no staged blobs, after it one memfd; a `bytes` upload only returned is sent
    from the front-end's own copy without ever being staged."""
    payload, kept = b"read " * 1000, b"only returned " * 1000
    reads = prog(up_module("m", STAGED_FDS), get_fn("staged", "m", "staged"), get_fn("length", "m", "length"),
                 up_blob("b", "bytes", payload), up_blob("kept", "bytes", kept),
                 run_instruction("before", "staged"), run_instruction("n", "length", ref("b")),
                 run_instruction("after", "staged"), ret("counts", "before"), ret("n", "n"), ret("after", "after"),
                 ret("kept", "kept"))
    returns = prog(up_module("m", STAGED_FDS), get_fn("staged", "m", "staged"), up_blob("kept", "bytes", kept),
                   run_instruction("during", "staged"), ret("during", "during"), ret("kept", "kept"))
    with ServerProcess("--sandbox", "none", workers=1, tmp_path=tmp_path) as srv:
        body = execute_ok(srv.url, reads, (payload, kept))
        assert body["status"] == "COMPLETED", body.get("error")
        assert [plain(body["results"][k]) for k in ("counts", "n", "after")] == [0, len(payload), 1]
        assert body["_parts"][body["results"]["kept"]["part"]] == kept
        body = execute_ok(srv.url, returns)  # from the memory cache
        assert body["status"] == "COMPLETED", body.get("error")
        assert plain(body["results"]["during"]) == 0
        assert body["_parts"][body["results"]["kept"]["part"]] == kept

MAPPED = """
import ctypes, hashlib
def mappings():
    with open("/proc/self/maps") as f:
        return [[*(int(a, 16) for a in line.split()[0].split("-")), int(line.split()[4])]
                for line in f if "kcoral-blobs" in line]
def facts(data):
    address = id(data)
    nul = ctypes.string_at(address + bytes.__basicsize__ - 1 + len(data), 1)  # every bytes object ends with one
    inodes = [inode for start, end, inode in mappings() if start <= address < end]
    return [type(data) is bytes, len(inodes) == 1, nul == b"\\0", hashlib.sha256(data).hexdigest(),
            hash(data) == hash(bytes(bytearray(data))), data[-3:] == b"end", inodes[:1]]
def remaining():
    return len(mappings())
"""


@pytest.mark.parametrize("mode", ["none", "bubblewrap"])
@pytest.mark.parametrize("size", [MAPPED_BLOB_BYTES, SEALED_BLOB_BYTES], ids=["mapped", "sealed"])
def test_a_large_bytes_upload_is_the_staged_pages_as_a_real_bytes_object(tmp_path, mode, size):
    """A `bytes` upload of kcoral_worker.MAPPED_BLOB_BYTES or more reaches the program as a `bytes`
    object whose pages are a staged memfd's (mapped copy-on-write, nothing copied), complete with
    its NUL terminator; freed, its mapping goes (a reused worker's next request finds none), and
    the same blob served again from the cache is intact.  One of SEALED_BLOB_BYTES or more is a
    file of its own that the cache keeps: the cache hit's worker maps the very same file."""
    payload = os.urandom(size + 12345) + b"end"
    program = prog(up_module("m", MAPPED), get_fn("facts", "m", "facts"), up_blob("b", "bytes", payload),
                   run_instruction("r", "facts", ref("b")), ret("out", "r"))
    after = prog(up_module("m", MAPPED), get_fn("remaining", "m", "remaining"), run_instruction("r", "remaining"),
                 ret("out", "r"))
    reuse = ("--max-requests-per-worker", "2") if mode == "none" else ()
    inodes = []
    with ServerProcess("--sandbox", mode, *reuse, workers=1, tmp_path=tmp_path) as srv:
        for blobs in ((payload,), ()):  # the second answer comes from the memory cache
            body = execute_ok(srv.url, program, blobs)
            assert body["status"] == "COMPLETED", body.get("error")
            *facts, inode = plain(body["results"]["out"])
            assert facts == [True, True, True, sha256(payload), True, True]
            inodes += inode
            if reuse:  # the same worker's next request: the mapping went with the object
                body = execute_ok(srv.url, after)
                assert body["status"] == "COMPLETED", body.get("error")
                assert plain(body["results"]["out"]) == 0
    assert (inodes[0] == inodes[1]) == (size == SEALED_BLOB_BYTES), inodes


# --- no process outlives its request ---------------------------------------------------------------

CHAIN = """
import ctypes, os, time
def f(mark):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:  # a daemon that forks and exits as fast as it can, forever
            ctypes.CDLL(None).prctl(15, mark.encode(), 0, 0, 0)  # PR_SET_NAME: its children inherit it
            while True:
                if os.fork():
                    os._exit(0)
        os._exit(0)
    time.sleep(0.5)
    return len(named(mark))

def named(mark):
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/comm") as c:
                if c.read().strip() == mark:
                    found.append(int(pid))
        except (OSError, ValueError):
            pass
    return found
"""


def chain_processes(mark):
    """Live processes of the chain, by the name it gave itself (zombies are already dead)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    name, state = f.read().split(" (", 1)[1].rsplit(") ", 1)
                if name == mark and state[0] not in "ZX":
                    found.append(int(pid))
            except (OSError, ValueError, IndexError):
                pass
    return found


@pytest.mark.parametrize("mode", ["none", "bubblewrap"])
def test_a_fork_chain_racing_the_kill_does_not_survive(tmp_path, mode):
    mark = f"kc{uuid.uuid4().hex[:13]}"  # a process name: at most 15 bytes
    with ServerProcess("--sandbox", mode, workers=1, tmp_path=tmp_path) as srv:
        status, _, body = post(srv.url, call_program(CHAIN, "f", mark))
        assert status == 200, body
        assert plain(body["results"]["out"]) >= 1, body  # the chain was running when the request ended
        if mode == "bubblewrap":  # the container's sweep reports it; unsandboxed, the retiring worker's kill ends it
            assert body["status"] == "FAILED" and "background processes" in body["error"]["message"], body
        gone = wait_for(lambda: not chain_processes(mark), 10)
        still = chain_processes(mark)
        stayed_gone = gone and not wait_for(lambda: chain_processes(mark), 2)  # none comes back
        assert run(srv, "def f():\n    return 5\n") == 5
    stop_chain(mark)  # never leave it running on the machine, whatever happened
    assert gone and stayed_gone, still


def stop_chain(mark, seconds=5.0):
    """Stop, then kill, every process of the chain, sweep after sweep: one pass never catches it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for pid in chain_processes(mark):
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)


# --- bounded front-end memory for results ----------------------------------------------------------

def peak_rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@pytest.mark.parametrize("mode", ["none", "bubblewrap"])
def test_a_1_gib_return_against_a_64_mib_limit_is_refused_before_it_is_read(tmp_path, mode):
    with ServerProcess("--sandbox", mode, "--max-response-bytes", str(64 << 20), workers=1, tmp_path=tmp_path) as srv:
        assert run(srv, "def f():\n    return 1\n") == 1
        before = peak_rss_kib(srv.proc.pid)
        started = time.monotonic()
        status, _, body = post(srv.url, call_program("def f():\n    return b'\\0' * (1 << 30)\n", "f"))
        took = time.monotonic() - started
        grown_mib = (peak_rss_kib(srv.proc.pid) - before) / 1024
        assert (status, body["error"]["kind"]) == (500, "response_too_large"), body
        assert run(srv, "def f():\n    return 2\n") == 2
    print(f"\n1 GiB return, 64 MiB limit ({mode}): answered in {took:.1f} s, front-end peak RSS +{grown_mib:.0f} MiB")
    assert grown_mib <= 96


def test_returned_parts_beyond_the_cap_fail_the_return(tmp_path):
    with ServerProcess("--max-response-parts", "100", workers=1, tmp_path=tmp_path) as srv:
        body = execute_ok(srv.url, call_program("def f():\n    return [b'x'] * 101\n", "f"))
    assert body["status"] == "FAILED" and body["error"]["kind"] == "serialization", body
    assert "at most 100 binary parts" in body["error"]["message"]


# --- secure by default --------------------------------------------------------------------------

def test_auto_sandboxes_when_bwrap_works_and_warns_when_it_is_missing(tmp_path):
    with ServerProcess("--sandbox", "auto", workers=1, tmp_path=tmp_path / "a") as srv:
        assert srv.health()["sandbox"] == "bubblewrap"
        assert "sandbox=bubblewrap" in srv.log()
    bare = tmp_path / "bin"
    bare.mkdir()
    env = {"PATH": f"{bare}:{os.path.dirname(sys.executable)}"}  # no bwrap on it
    with ServerProcess("--sandbox", "auto", workers=1, tmp_path=tmp_path / "b", env=env) as srv:
        assert srv.health()["sandbox"] == "none"
        log = srv.log()
        assert "sandbox_off" in log and "apt-get install bubblewrap" in log and "sandbox=none" in log
    refused = subprocess.run([PYTHON, "-m", "kcoral", "--device", "cpu", "--sandbox", "bubblewrap", "--log-dir", "",
                              "--port", "0"], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=60, check=False)
    assert refused.returncode != 0 and "needs bwrap on PATH" in refused.stderr


# --- the host-side removal itself ------------------------------------------------------------------

def test_emptying_follows_no_link_and_survives_any_depth_and_mode(tmp_path):
    """What a program can leave in a writable directory: links out, directories it chmod-ed to
    000, nesting deeper than the recursion limit and the open-directory cap.  Nothing outside is
    touched."""
    import kcoral
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    top = tmp_path / "top"
    top.mkdir()
    (top / "link").symlink_to(outside)
    (top / "link-file").symlink_to(outside / "precious")
    locked = top / "locked" / "inner"
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    os.chmod(locked, 0)
    os.chmod(top / "locked", 0)
    fd = os.open(top, os.O_RDONLY)
    deep = os.dup(fd)
    for _ in range(sys.getrecursionlimit() + 500):  # deeper than any recursive walk, by descriptor
        os.mkdir("d", dir_fd=deep)
        nxt = os.open("d", os.O_RDONLY, dir_fd=deep)
        os.close(deep)
        deep = nxt
    os.close(deep)
    try:
        kcoral.empty_directory_at(fd)
    finally:
        os.close(fd)
    assert os.listdir(top) == []
    assert (outside / "precious").read_text() == "keep" and stat.S_IMODE(outside.stat().st_mode) != 0o700


# --- round 3: never host root, nothing that outlives a request, none of the server's streams -------

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the attack needs the server to run as root")

KNOB_PROBE = """
import os
def knobs():
    '''Every file under /proc/sys, /proc's other host-wide files and /sys that opens for writing
    (opened and closed at once: nothing is written), and the real uid.'''
    writable = []
    for top in ("/proc/sys", "/sys/kernel", "/sys/fs", "/sys/module", "/sys/power"):
        for folder, _, names in os.walk(top):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                    writable.append(path)
                except OSError:
                    pass
    for path in ("/proc/sysrq-trigger", "/proc/kcore", "/proc/kmsg"):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            writable.append(path)
        except OSError:
            pass
    return {"writable": writable, "uid": os.getuid()}
"""


@ROOT_ONLY
def test_no_request_runs_as_host_root_or_can_open_a_kernel_knob(sandboxed):
    """core_pattern, drop_caches, sysrq-trigger: the attack opened them for writing and so ran its
    code as host root.  Now nothing under /proc or /sys that changes the host opens for writing,
    and the worker's real uid on the host is not 0."""
    # the probe is real: run as root on the host, it finds the knobs (core_pattern among them)
    namespace = {}
    exec(textwrap.dedent(KNOB_PROBE), namespace)
    assert "/proc/sys/kernel/core_pattern" in namespace["knobs"]()["writable"]
    mark = f"knob-{uuid.uuid4().hex}"
    source = KNOB_PROBE + f"""
import subprocess, sys
def f():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)", {mark!r}])
    found = knobs()
    child.wait()
    return found
"""
    result = {}
    request = threading.Thread(target=lambda: result.update(run(sandboxed, source)))
    request.start()
    assert wait_for(lambda: marked_pids(mark), 30)
    host_uids = {pid: host_uid(pid) for pid in marked_pids(mark)}
    request.join(60)
    assert result["writable"] == [], result["writable"]
    assert result["uid"] != 0 and 0 not in host_uids.values(), host_uids


def host_uid(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))


TRACE_PROBE = """
import ctypes, os, signal
def f():
    '''Which processes this one can see, and which of them it can trace, or whose memory or
    environment it can open; its own child first, to show the probe works.'''
    libc = ctypes.CDLL(None, use_errno=True)
    child = os.fork()
    if child == 0:
        signal.pause()
        os._exit(0)
    def reachable(pid):
        ways = []
        if libc.ptrace(0x4206, pid, None, None) == 0:  # PTRACE_SEIZE
            ways.append("ptrace")
            libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
        for name, flags in (("mem", os.O_RDWR), ("environ", os.O_RDONLY)):
            try:
                os.close(os.open(f"/proc/{pid}/{name}", flags))
                ways.append(name)
            except OSError:
                pass
        return ways
    seen = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    found = {str(pid): reachable(pid) for pid in seen if pid not in (os.getpid(), child)}
    own_child = reachable(child)
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    return {"self": os.getpid(), "seen": seen, "reachable": found, "own_child": own_child}
"""


def test_no_process_the_request_sees_can_be_traced_or_read(sandboxed):
    """The attack traced the container's long-lived init and planted a spy in it.  Now a request
    sees only its own processes: no init, template or forkserver to trace or read."""
    result = run(sandboxed, TRACE_PROBE)
    assert result["own_child"] == ["ptrace", "mem", "environ"]  # the probe works
    # its namespace's init (1), itself (2) and its child: the init is out of reach
    assert result["self"] == 2 and result["seen"] == [1, 2, result["seen"][-1]], result
    assert result["reachable"] == {"1": []}, result


def test_the_probe_does_trace_the_init_of_a_container_without_these_defences(tmp_path):
    """The weakened set-up: a plain bubblewrap container whose PID 1 is bwrap's own init."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(TRACE_PROBE) + "\nprint(f())\n")
    result = subprocess.run(["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--ro-bind", "/", "/",
                             "--proc", "/proc", "--dev", "/dev", sys.executable, str(script)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    found = eval(result.stdout)  # our own probe's repr of plain values
    assert "ptrace" in found["reachable"].get("1", []), found


def test_the_next_request_sees_fresh_pids_and_nothing_the_last_one_started(sandboxed):
    """A request forks 300 processes and leaves a daemon: the next one is PID 2 again (its
    namespace's init is 1), its first child PID 3, and it sees no process but its own."""
    source = """
    import os, subprocess
    def f():
        for _ in range(300):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        subprocess.Popen(["sleep", "60"], start_new_session=True)
        return os.getpid()
    """
    body = execute_ok(sandboxed.url, call_program(textwrap.dedent(source), "f"))
    assert "background processes" in body["error"]["message"], body
    probe = """
    import os
    def f():
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        return [os.getpid(), child, sorted(int(p) for p in os.listdir("/proc") if p.isdigit())]
    """
    assert run(sandboxed, probe) == [2, 3, [1, 2]]


def test_stopping_or_killing_everything_it_can_signal_leaves_the_slot_serving(sandboxed):
    """SIGSTOP to the template (pid 2) made the slot's next request wait 15 s.  Now a request can
    signal only its own processes: the next request is served at once."""
    source = """
    import os, signal
    def f(sig):
        for pid in range(1, 400):
            if pid != os.getpid():
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        os.kill(-1, sig)  # every process it may signal but itself
        return 0
    """
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        post(sandboxed.url, call_program(textwrap.dedent(source), "f", int(sig)))
        started = time.monotonic()
        assert run(sandboxed, "def f():\n    return 3\n") == 3
        assert time.monotonic() - started < 2.0


def stream_targets(pid):
    """Where a process's fds 0-2 point, as the host sees them."""
    targets = {}
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            targets[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return targets


def test_templates_and_workers_hold_none_of_the_servers_streams(sandboxed):
    """The template inherited the server's stdout and stderr: a request appended 64 MiB to the
    server's log and read it back by reopening /proc/self/fd/N.  Now no fd a request holds is the
    server's, and what it writes anywhere outside its capture reaches no log."""
    log_file = os.path.realpath(sandboxed.stderr_path)
    assert stream_targets(sandboxed.proc.pid)[2] == log_file  # what the check would catch
    mark = f"streams-{uuid.uuid4().hex}"
    source = f"""
    import os, sys
    def f():
        targets = {{}}
        for name in os.listdir("/proc/self/fd"):
            try:
                targets[name] = os.readlink("/proc/self/fd/" + name)
            except OSError:
                pass
        written = []
        for name in ("0", "1", "2"):
            try:
                fd = os.open("/proc/self/fd/" + name, os.O_WRONLY | os.O_APPEND)
                os.write(fd, b"{mark}\\n")
                os.close(fd)
                written.append(name)
            except OSError:
                pass
        sys.__stdout__.write("{mark}\\n")
        sys.__stdout__.flush()
        return targets
    """
    targets = run(sandboxed, source)
    templates = [pid for pid in marked_pids("kcoral_worker.template_main") if host_uid(pid) != os.geteuid()
                 or os.geteuid() != 0]
    assert templates, "no sandbox template found"
    for pid in templates:
        assert log_file not in stream_targets(pid).values(), stream_targets(pid)
    paths = [t for t in targets.values() if t.startswith("/")]
    assert all(t == "/dev/null" or t.startswith("/kcoral/") for t in paths), targets
    time.sleep(0.5)  # the server's own lines about this request are written by now
    assert mark not in sandboxed.log()


def test_a_field_the_program_controls_cannot_forge_a_console_line(sandboxed):
    """A raw newline in a logged field (a gpu_access error's cuda_call) printed a forged
    `server_stopping` line on the console.  Now every field is escaped as in the JSON log."""
    forged = "2026-12-03T00:00:00.000Z INFO server_stopping forged=yes"
    source = f"""
    from kcoral.errors import ExecutionError
    def f():
        error = ExecutionError("gpu_access", "touched the GPU")
        error.fields = {{"cuda_call": "cudaMalloc\\n{forged}", "location": "x.py:1\\r\\n{forged}"}}
        raise error
    """
    body = execute_ok(sandboxed.url, call_program(textwrap.dedent(source), "f"))
    assert body["error"]["kind"] == "gpu_access", body
    assert wait_for(lambda: "gpu_access_violation" in sandboxed.log(), 5)
    lines = sandboxed.log().splitlines()
    assert not [line for line in lines if line.startswith(forged)], lines[-5:]
    assert any("cuda_call=\"cudaMalloc\\n" in line for line in lines), lines[-5:]


def test_console_values_are_one_plain_word_or_quoted():
    import kcoral
    assert kcoral.console_value("abc-1") == "abc-1"
    assert kcoral.console_value(1.26) == "1.3"
    assert kcoral.console_value("a\nb") == '"a\\nb"'
    assert kcoral.console_value("a b=c") == '"a b=c"'
    assert "\n" not in kcoral.console_value("x\r\n\x1b[2J")


# --- round 3: per-request limits -----------------------------------------------------------------

LIMITS = {"--memory-limit-bytes": 512 << 20, "--process-limit": 64, "--disk-limit-bytes": 32 << 20,
          "--file-limit": 500}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    base = tmp_path_factory.mktemp("limits")
    flags = [str(x) for pair in LIMITS.items() for x in pair]
    with ServerProcess("--sandbox", "bubblewrap", *flags, workers=1, tmp_path=base) as srv:
        yield srv


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def assert_served_at_once(srv, seconds=2.0):
    """The slot's next request: answered within `seconds` of asking."""
    started = time.monotonic()
    assert run(srv, "def f():\n    return 11\n") == 11
    took = time.monotonic() - started
    assert took < seconds, f"the next request took {took:.1f} s"


def over_limit(srv, source, flag):
    """Run an attack that must fail on the limit `flag`: -> its error message."""
    body = execute_ok(srv.url, call_program(textwrap.dedent(source), "f"))
    assert body["status"] == "FAILED", body
    assert flag in body["error"]["message"], body["error"]
    assert_served_at_once(srv)
    return body["error"]["message"]


def test_memory_beyond_the_limit_stops_the_request(limited):
    """4 then 8 GiB were accepted, host memory 19.9 -> 12.5 GiB.  Now the request is stopped near
    its 512 MiB, counted over all its processes (here two children of 384 MiB each, neither over
    the limit alone), and neither the front-end nor the next request notices."""
    assert run(limited, "def f():\n    return 1\n") == 1
    front_end = rss_kib(limited.proc.pid)
    mark = f"memory-{uuid.uuid4().hex}"
    hog = "import time; hold = bytearray(b'x') * (384 << 20); time.sleep(60)"
    source = f"""
    import subprocess, sys
    def f():
        children = [subprocess.Popen([sys.executable, "-c", {hog!r}, {mark!r}]) for _ in range(2)]
        for child in children:
            child.wait()
    """
    message = over_limit(limited, source, "--memory-limit-bytes")
    used = int(message.split(" used ")[1].split()[0])
    assert (512 << 20) < used < (1 << 30), message  # stopped within a sample of the limit
    assert marked_pids(mark) == []  # nothing of it left behind
    assert rss_kib(limited.proc.pid) < front_end + (32 << 10)


@pytest.mark.parametrize("kind", ["processes", "threads"])
def test_processes_and_threads_beyond_the_limit_are_refused(limited, kind):
    """3 000 processes were accepted, and the next tenant's first pid told how many.  Now a fork
    or thread beyond --process-limit fails with EAGAIN, named in the answer."""
    source = f"""
    import os, threading, time
    def f():
        started, stop = [], threading.Event()
        try:
            for _ in range(3000):
                if {kind!r} == "threads":
                    thread = threading.Thread(target=stop.wait, daemon=True)
                    thread.start()
                    started.append(thread)
                else:
                    pid = os.fork()
                    if pid == 0:
                        time.sleep(30)
                        os._exit(0)
                    started.append(pid)
        except (OSError, RuntimeError) as exc:
            error = exc
        stop.set()
        for child in started:
            if isinstance(child, int):
                os.kill(child, 9)
                os.waitpid(child, 0)
        raise RuntimeError(f"started {{len(started)}}") from error
    """
    message = over_limit(limited, source, "--process-limit")
    count = int(message.split("started ")[1].split()[0])
    assert 32 < count < LIMITS["--process-limit"], message


def test_disk_beyond_the_limit_fails_the_write(limited, tmp_path):
    """5 GiB landed on the host's / through the workspace, /tmp and /dev/shm.  Now they share one
    tmpfs of --disk-limit-bytes: a write beyond it fails with ENOSPC, and nothing reaches the host."""
    free = os.statvfs(str(tmp_path)).f_bavail * os.statvfs(str(tmp_path)).f_frsize
    source = """
    import os
    def f():
        chunk, written = b"x" * (1 << 20), 0
        try:
            for place in ("/kcoral/work/a", "/tmp/b", "/dev/shm/c", "/var/tmp/d"):
                with open(place, "wb") as out:
                    for _ in range(16):
                        written += out.write(chunk)
                        out.flush()
        except OSError as exc:
            raise RuntimeError(f"wrote {written}") from exc
    """
    message = over_limit(limited, source, "--disk-limit-bytes")
    written = int(message.split("wrote ")[1].split()[0])
    assert (16 << 20) < written <= LIMITS["--disk-limit-bytes"], message  # shared by all four places
    assert os.statvfs(str(tmp_path)).f_bavail * os.statvfs(str(tmp_path)).f_frsize > free - (16 << 20)


def test_files_beyond_the_limit_fail_to_be_created(limited):
    """500 000 empty files were accepted, and the slot served nothing for 10 s after.  Now the
    request's tmpfs has --file-limit inodes: the next file fails with ENOSPC."""
    source = """
    import os
    def f():
        made = 0
        try:
            for i in range(500_000):
                os.close(os.open(f"/tmp/{i}", os.O_CREAT | os.O_WRONLY))
                made += 1
        except OSError as exc:
            raise RuntimeError(f"made {made}") from exc
    """
    message = over_limit(limited, source, "--file-limit")
    made = int(message.split("made ")[1].split()[0])
    assert 400 < made < LIMITS["--file-limit"], message


def test_limits_are_reported_with_how_they_are_enforced(limited, tmp_path):
    limits = limited.health()["limits"]
    assert {name: limits[name]["value"] for name in limits} == {
        "max_request_bytes": (1 << 30) + (64 << 20),
        "memory_limit_bytes": 512 << 20, "process_limit": 64, "disk_limit_bytes": 32 << 20, "file_limit": 500}
    assert "tmpfs" in limits["disk_limit_bytes"]["enforced"]
    with ServerProcess("--sandbox", "none", workers=1, tmp_path=tmp_path) as srv:
        limits = srv.health()["limits"]
        log = srv.log()
    assert limits["memory_limit_bytes"]["value"] > 0 and "PSS" in limits["memory_limit_bytes"]["enforced"]
    assert limits["file_limit"]["enforced"] == "not enforced without the sandbox"
    if os.geteuid() == 0:
        assert "WARNING unsandboxed_as_root" in log


def test_the_front_end_is_the_oom_killers_last_choice_and_workers_its_first(limited):
    """Workers at 1000; the front-end at -900 where it may lower its own score (CAP_SYS_RESOURCE),
    else as it started, and the start-up line says which."""
    with open(f"/proc/{limited.proc.pid}/status") as f:
        may_lower = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16) >> 24 & 1
    with open(f"/proc/{limited.proc.pid}/oom_score_adj") as f:
        front_end = int(f.read())
    assert front_end == -900 if may_lower else front_end <= 0
    assert f"oom_score_adj={front_end}" in limited.log()
    mark = f"oom-{uuid.uuid4().hex}"
    source = f"""
    import subprocess, sys
    def f():
        subprocess.run([sys.executable, "-c", "import time; time.sleep(2)", {mark!r}])
        return 0
    """
    request = threading.Thread(target=run, args=(limited, source))
    request.start()
    assert wait_for(lambda: marked_pids(mark), 30)
    scores = []
    for pid in marked_pids(mark):
        with open(f"/proc/{pid}/oom_score_adj") as f:
            scores.append(int(f.read()))
    request.join(30)
    assert scores and set(scores) == {1000}, scores
