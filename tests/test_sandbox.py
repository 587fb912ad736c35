"""The sandbox (`--sandbox bubblewrap`, docs/sandbox.md): escape probes and programs that must still work.

Each probe is what a curious user would try from inside a request.  It runs against an
unsandboxed server too, where it must succeed: that shows the probe really reaches what it
claims to, so "blocked" under the sandbox means the sandbox blocked it.
"""

import array
import fcntl
import glob
import json
import os
import subprocess
import threading
import time
import uuid

import pytest

import kcoral
from tests.support import (
    ADD_ONE_CPU,
    PYTHON,
    ROOT,
    ServerProcess,
    call_program,
    execute_ok,
    free_port,
    join_threads,
    marked_pids,
    mounted_ext4,
    post,
    prog,
    ret_path,
    server_connections,
    sha256,
    thread_count,
    up_blob,
    wait_for,
    workspaces,
)

TOKEN = "probe-token-" + uuid.uuid4().hex
SECRET = "probe-secret-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module", params=["none", "bubblewrap"], ids=["unsandboxed", "sandboxed"])
def probed(request, tmp_path_factory):
    """A server whose $HOME holds a secret, whose environment holds another and a token."""
    base = tmp_path_factory.mktemp(f"probe-{request.param}")
    home, tmpdir = base / "home", base / "tmp"
    home.mkdir()
    tmpdir.mkdir()
    (home / "secret.txt").write_text(SECRET)
    env = {"HOME": str(home), "TMPDIR": str(tmpdir), "KCORAL_TOKEN": TOKEN, "KCORAL_PROBE_SECRET": SECRET}
    with ServerProcess("--sandbox", request.param, tmp_path=base, env=env) as srv:
        srv.sandbox, srv.home, srv.tmpdir = request.param, str(home), str(tmpdir)
        srv.disk_cache = str(base / "disk-cache")
        yield srv


def probe(srv, source, *args):
    """Run `probe(*args)` from `source` in a request -> its JSON-decoded answer."""
    status, _, body = post(srv.url, call_program(source, "probe", *args), headers=AUTH)
    assert status == 200 and body["status"] == "COMPLETED", body
    return json.loads(body["results"]["out"]["value"])


def expect(srv, escaped, evidence=""):
    """Unsandboxed the probe gets through; sandboxed it must not."""
    assert escaped == (srv.sandbox == "none"), evidence


READ = """import json
def probe(path):
    try:
        with open(path) as f:
            return json.dumps(f.read())
    except OSError as exc:
        return json.dumps("blocked: " + type(exc).__name__)
"""


def test_probe_secret_in_server_home(probed):
    seen = probe(probed, READ, os.path.join(probed.home, "secret.txt"))
    expect(probed, seen == SECRET, seen)


def test_probe_read_host_tmp(probed):
    path = f"/tmp/kcoral-probe-{uuid.uuid4().hex}"
    with open(path, "w") as f:
        f.write(SECRET)
    try:
        seen = probe(probed, READ, path)
    finally:
        os.unlink(path)
    expect(probed, seen == SECRET, seen)


def test_probe_write_host_tmp(probed):
    path = f"/tmp/kcoral-probe-{uuid.uuid4().hex}"
    probe(probed, "import json\ndef probe(path):\n    open(path, 'w').write('x')\n    return json.dumps(path)\n",
          path)
    escaped = os.path.exists(path)
    if escaped:
        os.unlink(path)
    expect(probed, escaped)


def test_probe_read_cached_blobs_in_disk_cache(probed):
    data = os.urandom(64)
    execute_ok(probed.url, prog(up_blob("f", "file", data, path="cached.bin")), [data], headers=AUTH)
    # the target exists once the disk write lands, which the answer does not wait for
    assert wait_for(lambda: any(sha256(data) in names for _, _, names in os.walk(probed.disk_cache)), 10)
    source = """import json, os
def probe(root):
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), 'rb') as f:
                found.append(f.read().hex())
    return json.dumps(found)
"""
    seen = probe(probed, source, probed.disk_cache)
    expect(probed, data.hex() in seen, seen)


def test_probe_tcp_connect_to_the_server_port(probed):
    source = """import json, socket
def probe(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
        return json.dumps("connected")
    except OSError as exc:
        return json.dumps("blocked: " + type(exc).__name__)
"""
    seen = probe(probed, source, probed.port)
    expect(probed, seen == "connected", seen)


def test_probe_signal_the_server_process(probed):
    source = """import json, os
def probe(pid):
    try:
        os.kill(pid, 0)  # permission and visibility, without harming the server
        return json.dumps("signalled")
    except OSError as exc:
        return json.dumps("blocked: " + type(exc).__name__)
"""
    seen = probe(probed, source, probed.proc.pid)
    expect(probed, seen == "signalled", seen)
    assert probed.proc.poll() is None


def test_probe_read_the_server_environment(probed):
    source = """import json, os
def probe(pid):
    seen = [repr(dict(os.environ))]
    for path in (f"/proc/{pid}/environ", "/proc/1/environ", f"/proc/{os.getppid()}/environ"):
        try:
            with open(path, "rb") as f:
                seen.append(f.read().decode(errors="replace"))
        except OSError:
            pass
    return json.dumps(seen)
"""
    seen = "".join(probe(probed, source, probed.proc.pid))
    expect(probed, SECRET in seen or TOKEN in seen, seen[:2000])
    if probed.sandbox != "none":
        assert TOKEN not in seen and "KCORAL_PROBE_SECRET" not in seen


LEAVE = """import json, os
def probe(path):
    with open(path, "w") as f:
        f.write("left behind")
    return json.dumps(path)
"""
LOOK = """import json, os
def probe(path):
    return json.dumps(os.path.exists(path))
"""


@pytest.mark.parametrize("folder", ["/tmp", "/dev/shm"])
def test_probe_files_left_for_the_next_request(probed, folder):
    path = f"{folder}/kcoral-probe-{uuid.uuid4().hex}"
    probe(probed, LEAVE, path)
    seen = [probe(probed, LOOK, path) for _ in range(4)]  # two workers: each slot serves again
    if os.path.exists(path):  # unsandboxed, it is the host's folder
        os.unlink(path)
    expect(probed, any(seen), seen)


def test_probe_read_a_concurrent_requests_uploaded_files(probed):
    name = f"concurrent-{uuid.uuid4().hex}.txt"
    data = SECRET.encode()
    slow = prog(up_blob("f", "file", data, path=name),
                *call_program("import time\ndef probe():\n    time.sleep(4)\n    return '\"done\"'\n",
                              "probe")["instructions"])
    source = """import glob, json, os
def probe(name, tmpdir):
    found = []
    for pattern in (f"{tmpdir}/*/work/{name}", f"/tmp/*/work/{name}", f"/tmp/**/{name}", f"/kcoral/**/{name}"):
        found += glob.glob(pattern, recursive=True)
    if not found:  # then everything it can see, but the kernel's and the system's trees
        for folder, dirs, names in os.walk("/"):
            dirs[:] = [d for d in dirs if os.path.join(folder, d) not in ("/proc", "/sys", "/usr", "/dev")]
            found += [os.path.join(folder, name)] if name in names else []
    return json.dumps(found)
"""
    # unsandboxed the workspace is a host directory; sandboxed, a tmpfs the host sees through the
    # worker's /proc/PID/root
    on_the_host = [os.path.join(glob.escape(probed.tmpdir), "**", "work", name), f"/proc/[0-9]*/root/kcoral/work/{name}"]
    first = threading.Thread(target=post, args=(probed.url, slow, [data]), kwargs={"headers": AUTH})
    first.start()
    try:  # the premise: the first request runs, its file in its workspace
        assert wait_for(lambda: any(glob.glob(p, recursive=True) for p in on_the_host), 30), \
            "the first request's file never appeared"
        seen = probe(probed, source, name, probed.tmpdir)
    finally:
        join_threads([first], 60)
    expect(probed, bool(seen), seen)


# --- what must still work inside ----------------------------------------------------------------

@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory):
    base = tmp_path_factory.mktemp("sandboxed")
    tmpdir = base / "tmp"
    tmpdir.mkdir()
    with ServerProcess("--sandbox", "bubblewrap", "--default-timeout-seconds", "60", tmp_path=base,
                       env={"TMPDIR": str(tmpdir)}) as srv:
        srv.tmpdir = str(tmpdir)
        yield srv


def value(body, key="out"):
    return body["results"][key]["value"]


def test_torch_runs_inside(sandboxed):
    body = execute_ok(sandboxed.url, call_program(
        "import torch\ndef f():\n    return float(torch.arange(5.0).sum())\n", "f"))
    assert value(body) == 10.0


def test_subprocess_runs_and_sees_only_its_own_pid_namespace(sandboxed):
    source = """import os, subprocess
def f():
    out = subprocess.run(["sh", "-c", "echo from-shell; ls /proc | grep -c '^[0-9]'"], capture_output=True,
                         text=True, check=True).stdout.split()
    return [out[0], int(out[1]), os.getpid()]
"""
    word, processes, pid = [v["value"] for v in value(execute_ok(sandboxed.url, call_program(source, "f")))]
    assert word == "from-shell"
    assert processes <= 8 and pid < 10  # init, template, worker, shell, ls, grep: nothing of the host


def parent(pid):
    return int(kcoral.kcoral_worker.proc_stat(pid)[1])  # fields after the name: state, ppid, ...


def while_running(sandboxed, source, look):
    """Run `source` (a program's f) on the sandboxed server and, while it runs, `look(worker, init)`
    at its worker (PID 2 of its PID namespace) and that namespace's init -> what look returned."""
    request = threading.Thread(target=post, args=(sandboxed.url, call_program(source, "f")))
    request.start()
    try:
        def running_worker():
            return next((pid for pid in kcoral.kcoral_worker.descendants(sandboxed.proc.pid)
                         if len(kcoral.namespace_pids(pid)) == 3 and kcoral.namespace_pids(pid)[-1] == 2), None)
        worker = wait_for(running_worker, 30)
        assert worker, "no request's worker appeared"
        namespace = os.stat(f"/proc/{worker}/ns/pid").st_ino
        init = next(pid for pid in kcoral.kcoral_worker.descendants(sandboxed.proc.pid)
                    if kcoral.namespace_pids(pid)[-1] == 1 and os.stat(f"/proc/{pid}/ns/pid").st_ino == namespace)
        return look(worker, init)
    finally:
        join_threads([request], 60)


def test_a_request_forks_the_template_once_and_its_init_is_a_fork_of_a_small_process(sandboxed):
    """One fork of the template per request: the worker (PID 2 of the request's PID namespace) is
    the template's own child (PID 1 of the container).  Its namespace's init (PID 1 there) is a
    fork of the template's small init maker, made before the template imported torch: an init
    forked from the template copied and freed the page tables of all its memory, 4.3 ms of CPU a
    request."""
    def mapped_kib(pid):
        with open(f"/proc/{pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmSize:")).split()[1])

    def look(worker, init):
        template, maker = parent(worker), parent(init)
        assert len(kcoral.namespace_pids(template)) == 2 and kcoral.namespace_pids(template)[-1] == 1, \
            f"the worker's parent {template} is not the template: {kcoral.namespace_pids(template)}"
        assert parent(maker) == template and len(kcoral.namespace_pids(maker)) == 2
        assert mapped_kib(maker) * 4 < mapped_kib(template), (mapped_kib(maker), mapped_kib(template))
    while_running(sandboxed, "import time\ndef f():\n    time.sleep(3)\n    return 1\n", look)


def test_a_sweep_below_the_template_that_finds_nothing_is_final(monkeypatch):
    """A sandboxed worker's disposal takes no second look (terminate's, 5 ms later, for a fork a
    snapshot of /proc can miss): everything below the template is in a request's PID namespace,
    which the kernel empties before its init can be reaped, and a listed init keeps the sweeps going."""
    stand_in = subprocess.Popen(["sleep", "30"])  # the template, with nothing below it
    sweeps = []
    monkeypatch.setattr(kcoral, "descendants", lambda pid: sweeps.append(pid) or [])
    template = object.__new__(kcoral.SandboxTemplate)
    template.pid = stand_in.pid
    try:
        assert template.kill_requests(0, stand_in.pid)
    finally:
        stand_in.kill()
        stand_in.wait()
    assert sweeps == [stand_in.pid]


def test_c_compiler_builds_and_runs_in_the_workspace(sandboxed):
    source = r"""import os, subprocess
def f():
    with open("hello.c", "w") as out:
        out.write('#include <stdio.h>\nint main(void) { printf("built here\\n"); return 0; }\n')
    subprocess.run(["gcc", "-O1", "-o", "hello", "hello.c"], check=True)
    return [os.getcwd(), subprocess.run(["./hello"], capture_output=True, text=True, check=True).stdout]
"""
    cwd, out = [v["value"] for v in value(execute_ok(sandboxed.url, call_program(source, "f")))]
    assert cwd == "/kcoral/work" and out == "built here\n"
    assert workspaces(sandboxed) == []


def test_tvm_ffi_library_built_inside_the_request(sandboxed):
    """tvm_ffi.cpp.build runs the compiler in the request; its cache goes to TVM_FFI_CACHE_DIR inside."""
    source = """import os, sys, torch, tvm_ffi, tvm_ffi.cpp
def f(code):
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]  # pip's ninja
    with open("add_one.cc", "w") as out:
        out.write(code)
    library = tvm_ffi.load_module(tvm_ffi.cpp.build(name="add_one", sources=["add_one.cc"], build_directory="build"))
    x, y = torch.arange(4, dtype=torch.float32), torch.zeros(4, dtype=torch.float32)
    library.add_one(x, y)
    return y.tolist()
"""
    body = execute_ok(sandboxed.url, call_program(source, "f", ADD_ONE_CPU))
    assert body["status"] == "COMPLETED", body.get("error")
    assert [v["value"] for v in value(body)] == [1.0, 2.0, 3.0, 4.0]
    assert workspaces(sandboxed) == []


def test_tempfile_and_caches_live_inside_the_request(sandboxed):
    source = """import os, tempfile
def f():
    with tempfile.NamedTemporaryFile("w+", delete=False) as t:
        t.write("scratch")
    with open(t.name) as again:
        text = again.read()
    return [tempfile.gettempdir(), text, os.environ["HOME"], os.environ["TORCH_EXTENSIONS_DIR"],
            os.access(os.environ["HOME"], os.W_OK), os.access("/usr", os.W_OK)]
"""
    tmp, text, home, extensions, home_writable, usr_writable = [
        v["value"] for v in value(execute_ok(sandboxed.url, call_program(source, "f")))]
    assert (tmp, text, home, home_writable, usr_writable) == ("/tmp", "scratch", "/kcoral/home", True, False)
    assert extensions.startswith("/kcoral/")
    assert workspaces(sandboxed) == []


def test_file_and_folder_returns(sandboxed):
    data = os.urandom(1000)
    source = """import os
def f():
    os.makedirs("out/sub")
    open("out/sub/b.txt", "w").write("bee")
    open("out/a.bin", "wb").write(open("in.bin", "rb").read())
"""
    program = prog(up_blob("in", "file", data, path="in.bin"),
                   *call_program(source, "f")["instructions"][:3],
                   ret_path("a", "file", "out/a.bin"), ret_path("d", "folder", "out"))
    body = execute_ok(sandboxed.url, program, [data])
    assert body["status"] == "COMPLETED", body.get("error")
    assert data in body["_parts"].values() and b"bee" in body["_parts"].values()
    assert set(body["results"]["d"]["files"]) == {"a.bin", "sub/b.txt"}


def test_timeout_kills_everything_the_request_started(sandboxed):
    marker = f"kcoral-probe-{uuid.uuid4().hex[:12]}"
    source = f"""import subprocess, sys, time
SLEEP = [sys.executable, "-c", "import time; time.sleep(300)", "{marker}"]
def f():
    subprocess.Popen(SLEEP, start_new_session=True)
    subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen(sys.argv[1:])", *SLEEP])
    time.sleep(300)
"""
    status, _, body = post(sandboxed.url, call_program(source, "f", options={"timeout_seconds": 3}))
    assert status == 504, body
    assert marked_pids(marker) == []
    assert value(execute_ok(sandboxed.url, call_program("def f():\n    return 5\n", "f"))) == 5
    assert workspaces(sandboxed) == []


def test_background_process_is_reported_and_killed(sandboxed):
    marker = f"kcoral-bg-{uuid.uuid4().hex[:12]}"
    source = f"""import subprocess, sys
def f():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{marker}"])
    return 1
"""
    body = execute_ok(sandboxed.url, call_program(source, "f"))
    assert body["status"] == "FAILED" and "background" in body["error"]["message"], body
    leftover = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False).stdout.split()
    assert leftover == []


def test_crash_keeps_early_returns_and_output(sandboxed):
    source = "import os, sys\ndef early():\n    print('said before', flush=True)\n    return 3\n" \
             "def die():\n    os._exit(7)\n"
    program = prog({"op": "upload", "id": "m", "kind": "module", "source": source},
                   {"op": "get_function", "id": "e", "module": {"$ref": "m"}, "name": "early"},
                   {"op": "get_function", "id": "d", "module": {"$ref": "m"}, "name": "die"},
                   {"op": "run", "id": "r", "fn": {"$ref": "e"}, "args": []},
                   {"op": "return", "key": "early", "value": {"$ref": "r"}},
                   {"op": "run", "id": "x", "fn": {"$ref": "d"}, "args": []})
    body = execute_ok(sandboxed.url, program)
    assert body["status"] == "FAILED" and body["results"]["early"]["value"] == 3
    assert "said before" in body["stdout"]


def test_a_program_that_kills_its_slots_template_gets_a_new_one(tmp_path):
    """The slot's container is started again; one started by a pool thread outlives that thread."""
    source = """import os, signal
def f():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"template_main" in f.read():
                os.kill(int(pid), signal.SIGKILL)
"""
    with ServerProcess("--sandbox", "bubblewrap", workers=1, tmp_path=tmp_path) as srv:
        def idle_threads():
            """The server's threads once it is idle, no connection's thread left and the count
            steady (the same 50 ms later) -> None before."""
            if srv.health()["load"]["request_capacity"] != 1 or server_connections(srv.port):
                return None
            count = thread_count(srv.proc.pid)
            time.sleep(0.05)  # the interval of the comparison, not a synchronisation
            return count if count == thread_count(srv.proc.pid) else None

        idle = wait_for(idle_threads, 60)
        assert idle, "the server never became idle"
        status, _, body = post(srv.url, call_program(source, "f"))
        assert status in (200, 500), body
        for _ in range(3):  # the new container, workers forked in it
            assert value(execute_ok(srv.url, call_program("def f():\n    return 9\n", "f"))) == 9
            # the threads that started the new container and workers (a slot's replacement, the
            # pool's) have ended before the next request: a container tied to them would be dead
            assert wait_for(lambda: (idle_threads() or idle + 1) <= idle, 60), \
                f"the server's threads never came back to {idle}: {thread_count(srv.proc.pid)}"


def test_a_program_that_stops_its_slots_template_costs_only_itself(tmp_path):
    source = """import os, signal
def f():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"template_main" in f.read():
                os.kill(int(pid), signal.SIGSTOP)
    return 1
"""
    with ServerProcess("--sandbox", "bubblewrap", workers=1, tmp_path=tmp_path) as srv:
        status, _, body = post(srv.url, call_program(source, "f", options={"timeout_seconds": 3}))
        assert status in (200, 504), body
        started = time.monotonic()
        assert value(execute_ok(srv.url, call_program("def f():\n    return 9\n", "f"))) == 9
        assert time.monotonic() - started < 60  # waited for a new container, got no error


def test_a_worker_serving_several_requests_is_never_sandboxed(tmp_path):
    """One process serving several tenants would carry one request's memory into the next: the
    sandbox refuses reused workers outright, and auto leaves them unsandboxed with a warning."""
    refused = subprocess.run([PYTHON, "-m", "kcoral", "--device", "cpu", "--sandbox", "bubblewrap",
                              "--max-requests-per-worker", "0", "--log-dir", "", "--port", "0"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode != 0 and "--max-requests-per-worker 1" in refused.stderr, refused.stderr
    with ServerProcess("--sandbox", "auto", "--max-requests-per-worker", "0", workers=1, tmp_path=tmp_path) as srv:
        assert srv.health()["sandbox"] == "none"
        assert "sandbox_off" in srv.log() and "--max-requests-per-worker" in srv.log()


def test_readonly_path_is_visible_and_not_writable(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("read me")
    source = """import json
def probe(path):
    text = open(path + "/data.txt").read()
    try:
        open(path + "/new.txt", "w")
        return json.dumps([text, "written"])
    except OSError as exc:
        return json.dumps([text, type(exc).__name__])
"""
    with ServerProcess("--sandbox", "bubblewrap", "--sandbox-readonly-path", str(shared), workers=1,
                       tmp_path=tmp_path) as srv:
        body = execute_ok(srv.url, call_program(source, "probe", str(shared)))
    assert body["status"] == "COMPLETED", body.get("error")
    assert json.loads(body["results"]["out"]["value"]) == ["read me", "OSError"]
    assert not (shared / "new.txt").exists()


# --- start-up probe -------------------------------------------------------------------------------

def start_failure(tmp_path, path_dirs):
    result = subprocess.run([PYTHON, "-m", "kcoral", "--port", str(free_port()), "--device", "cpu", "--log-dir", "",
                             "--disk-cache-dir", "", "--sandbox", "bubblewrap"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False, env={**os.environ, "PATH": os.pathsep.join(path_dirs)})
    return result.returncode, result.stderr.strip().splitlines()


def test_start_fails_in_one_line_without_bwrap(tmp_path):
    code, lines = start_failure(tmp_path, [str(tmp_path)])
    assert code != 0 and len(lines) == 1 and "bwrap" in lines[0] and "apt-get install bubblewrap" in lines[0], lines


def test_start_fails_in_one_line_when_bwrap_does_not_work(tmp_path):
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    broken.chmod(0o755)
    code, lines = start_failure(tmp_path, [str(tmp_path), "/usr/bin", "/bin"])
    assert code != 0 and len(lines) == 1, lines
    assert "does not work here" in lines[0] and "Permission denied" in lines[0], lines


def test_startup_line_names_the_mode(sandboxed):
    assert "sandbox=bubblewrap" in sandboxed.log()
    assert sandboxed.proc.poll() is None


def test_directories_of_a_dead_server_are_removed_at_start_and_a_live_ones_kept(tmp_path):
    """Workspaces and sandbox slot directories carry their owner (pid and start time) in their
    name; a server that was SIGKILLed cannot clean up, so the next start does."""
    ticks = kcoral.process_start_ticks(os.getpid())
    dead = [f"kcoral-sandbox-{2 ** 22 + 7}.{ticks}-abc", f"kcoral-program-{os.getpid()}.{ticks + 1}-def"]
    live = [f"kcoral-sandbox-{os.getpid()}.{ticks}-ghi", "kcoral-sandbox-unrelated", "other"]
    for name in dead + live:
        (tmp_path / name / "work").mkdir(parents=True)
    assert kcoral.remove_dead_workspaces(str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == sorted(live)


def directory_flags(path) -> int | None:
    """The directory's inode flags (`lsattr -d`), or None where the file system keeps none."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, kcoral.FS_IOC_GETFLAGS, flags)
        return flags[0]
    except OSError:
        return None
    finally:
        os.close(fd)


def test_workspace_directories_ask_for_block_groups_of_their_own(tmp_path):
    """ext4 without a journal steps over every recently freed inode of a block group to allocate
    one: the workspace root carries the top-directory hint and each `work` is created under a
    fresh name, so that successive requests' files come from different groups (docs/performance.md).
    ext4 takes the group with the fewest directories among those with room, searching from one a
    hash of the name picks: on a host disk one group may stand out, so this runs on a fresh disk
    whose groups tie, where the name decides."""
    with mounted_ext4(tmp_path) as disk:
        spread, plain = os.path.join(disk, "spread"), os.path.join(disk, "plain")
        os.mkdir(spread)
        os.mkdir(plain)
        kcoral.spread_subdirectories(spread)
        kcoral.spread_subdirectories(spread)  # idempotent
        assert directory_flags(spread) & kcoral.FS_TOPDIR_FL
        assert not directory_flags(plain) & kcoral.FS_TOPDIR_FL
        spread_inodes, plain_inodes = set(), set()
        for _ in range(12):
            work = os.path.join(spread, "work")
            kcoral.make_spread_directory(work)
            assert os.listdir(spread) == ["work"]  # the fresh name is gone
            assert (os.stat(work).st_mode & 0o777) == 0o700
            spread_inodes.add(os.stat(work).st_ino)
            os.rmdir(work)
            os.mkdir(os.path.join(plain, "work"))
            plain_inodes.add(os.stat(os.path.join(plain, "work")).st_ino)
            os.rmdir(os.path.join(plain, "work"))
        assert len(plain_inodes) == 1  # a plain parent gets the same inode back every time
        assert len(spread_inodes) > 1
