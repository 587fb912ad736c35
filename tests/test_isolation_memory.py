"""Isolation, round 4: memory that counts everything, and a kernel surface a request cannot reach.

Against a sandboxed server with the limits the attacks were first tried under, each test performs
the attack from inside an ordinary request and measures it on the host: how far the host's
available memory fell (`HostMemoryPeak`: whatever form the memory took), whether it came back,
and whether the next request is served.  Each memory attack asks for 3 GiB against a 1 GiB limit
(and is skipped where the host has no room for that); before this round each one COMPLETED.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

import kcoral_worker
from tests.support import (
    PYTHON,
    HostMemoryPeak,
    ServerProcess,
    call_program,
    execute_ok,
    plain,
    request,
    skip_without_memory,
)

pytestmark = pytest.mark.skipif(not any(os.access(os.path.join(d, "bwrap"), os.X_OK)
                                        for d in os.environ.get("PATH", "").split(":")),
                                reason="bwrap is not installed")

LIMIT = 1 << 30
SLACK = 256 << 20  # the most a request may hold beyond its limit, at its peak
LIMITS = ("--memory-limit-bytes", str(LIMIT), "--process-limit", "256", "--disk-limit-bytes", str(256 << 20),
          "--file-limit", "20000")
ALICE, BOB = "alice-" + uuid.uuid4().hex, "bob-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    base = tmp_path_factory.mktemp("memory")
    tokens = base / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    tokens.chmod(0o600)
    with ServerProcess("--sandbox", "bubblewrap", "--token-file", str(tokens), *LIMITS, workers=2,
                       tmp_path=base) as srv:
        yield srv


def execute(srv, source, *args, token=ALICE):
    return execute_ok(srv.url, call_program(textwrap.dedent(source), "f", *args),
                      headers={"Authorization": f"Bearer {token}"})


def assert_served_at_once(srv, seconds=2.0):
    started = time.monotonic()
    body = execute(srv, "def f():\n    return 11\n")
    assert body["status"] == "COMPLETED" and plain(body["results"]["out"]) == 11, body
    assert time.monotonic() - started < seconds


def memory_attack(srv, source):
    """Run an attack that must be stopped on --memory-limit-bytes, measured on the host."""
    skip_without_memory(3 << 30)
    with HostMemoryPeak() as host:
        body = execute(srv, source)
    ended = time.monotonic()
    back = host.back_within(2.0, SLACK)
    back_after = time.monotonic() - ended
    print(f"\n{source.strip().splitlines()[0]}: {body['status']}, host memory peak "
          f"{host.peak / (1 << 30):.2f} GiB, back after {back_after:.2f} s, error: {body.get('error', {}).get('message')}")
    assert body["status"] == "FAILED", body
    assert "--memory-limit-bytes" in body["error"]["message"], body["error"]
    assert host.peak <= LIMIT + SLACK, f"the host's processes held {host.peak >> 20} MiB more at the peak"
    assert back, "the host's memory did not come back within 2 s (other work on the host may hold it)"
    assert_served_at_once(srv)


# --- 1. memory the sampler did not see -----------------------------------------------------------

def test_a_memfd_filled_with_pwrite_and_never_mapped_is_counted(limited):
    """Before: 3 GiB held, host memory -2.8 GiB, COMPLETED (no process's RSS shows it)."""
    memory_attack(limited, """
    # a memfd filled with pwrite, never mapped
    import os, time
    def f():
        fd, chunk = os.memfd_create("hold"), b"x" * (64 << 20)
        for i in range(48):
            os.pwrite(fd, chunk, i * len(chunk))
        time.sleep(2)
        return os.fstat(fd).st_blocks * 512
    """)


def test_shared_anonymous_memory_is_counted(limited):
    """Before: mmap(MAP_SHARED | MAP_ANONYMOUS) touched, VmRSS 3.3 GB, host -3.4 GiB, COMPLETED."""
    memory_attack(limited, """
    # mmap(MAP_SHARED | MAP_ANONYMOUS), touched
    import mmap, time
    def f():
        size, chunk = 3 << 30, b"x" * (64 << 20)
        shared = mmap.mmap(-1, size)
        for offset in range(0, size, len(chunk)):
            shared[offset:offset + len(chunk)] = chunk
        time.sleep(2)
        return size
    """)


def test_detached_system_v_segments_are_counted(limited):
    """Before: a detached System V segment held 3 GiB, host -3.3 GiB, COMPLETED.  Segments of 256 MiB,
    each filled and detached, so that no process maps any of them."""
    memory_attack(limited, """
    # System V segments, filled and detached
    import ctypes, time
    def f():
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype, libc.shmat.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        held, size = 0, 256 << 20
        while held < 3 << 30:
            shmid = libc.shmget(0, ctypes.c_size_t(size), 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
            if shmid < 0:
                raise OSError(ctypes.get_errno(), f"shmget after {held} bytes")
            address = libc.shmat(shmid, None, 0)
            ctypes.memset(address, 1, size)
            libc.shmdt(ctypes.c_void_p(address))
            held += size
        time.sleep(2)
        return held
    """)


def test_page_tables_of_read_faults_over_a_huge_mapping_are_counted(limited):
    """Before: read faults over a 1 TiB read-only mapping made 2.1 GB of page tables with 160 MB of
    RSS, COMPLETED.  One read every 2 MiB: each fault maps the zero page and costs a page table."""
    memory_attack(limited, """
    # page tables of read faults over 1 TiB
    import ctypes, mmap, time
    def f():
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        size, step = 1 << 40, 2 << 20
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, -1, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        libc.madvise(address, size, 15)  # MADV_NOHUGEPAGE: no huge zero page, a page table per 2 MiB
        for offset in range(0, size, step):
            ctypes.string_at(address + offset, 1)
        time.sleep(2)
        with open("/proc/self/status") as status:
            return next(line for line in status if line.startswith("VmPTE"))
    """)


# --- 2. bursts between samples -------------------------------------------------------------------

def test_a_burst_between_samples_is_stopped_near_the_limit(limited):
    """Before: 3 GiB asked at once peaked at 1.96 GiB of tree RSS before the kill (0.6 s)."""
    memory_attack(limited, """
    # a burst: 3 GiB touched at once
    def f():
        hold = bytearray(b"x") * (3 << 30)
        return len(hold)
    """)


# --- 3. the kernel's keyring and the rest of the kernel surface ----------------------------------

KERNEL_CALLS = """
import ctypes, errno, os
def f(numbers):
    '''Calls that succeed (or fail for their arguments) for an unprivileged process, each harmless:
    the keys go to a thread keyring that ends with the process.  -> name: "ok" or the errno's name.'''
    libc = ctypes.CDLL(None, use_errno=True)
    outcome = {}
    def call(name, *args):
        result = libc.syscall(numbers[name], *args)
        outcome[name] = "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()]
        return result
    thread_keyring = -1  # KEY_SPEC_THREAD_KEYRING
    call("keyctl", 0, thread_keyring, 1)  # KEYCTL_GET_KEYRING_ID, creating it
    call("add_key", b"user", b"kcoral-probe", b"secret", 6, thread_keyring)
    call("request_key", b"user", b"kcoral-absent", None, thread_keyring)
    call("unshare", 0)
    call("kcmp", os.getpid(), os.getpid(), 1, 0, 0)  # KCMP_VM
    handle, mount_id = ctypes.create_string_buffer(8), ctypes.c_int()  # handle_bytes 0: EOVERFLOW
    call("name_to_handle_at", -100, b"/", handle, ctypes.byref(mount_id), 0)
    params = ctypes.create_string_buffer(120)
    ring = call("io_uring_setup", 1, params)
    uffd = call("userfaultfd", 1)  # UFFD_USER_MODE_ONLY
    for fd in (ring, uffd):
        if fd >= 0:
            os.close(fd)
    with open("/proc/self/status") as status:
        outcome["Seccomp"] = next(line.split()[1] for line in status if line.startswith("Seccomp:"))
    return outcome
"""


def test_keyring_and_kernel_surface_calls_are_refused_inside_and_work_outside(limited):
    """The same calls, outside in a plain process (as the server's user) and inside a request:
    outside none is refused with EPERM; inside every one is, by the filter (Seccomp: 2)."""
    machine = os.uname().machine
    column = kcoral_worker.SECCOMP_ARCHES[machine][1]
    numbers = {name: pair[column] for name, pair in kcoral_worker.SECCOMP_DENIED.items() if pair[column] is not None}
    outside = subprocess.run([PYTHON, "-c", KERNEL_CALLS + f"\nprint(f({numbers!r}))"], capture_output=True,
                             text=True, timeout=60, check=True)
    outside_outcome = eval(outside.stdout)  # a dict literal printed by our own probe
    body = execute(limited, KERNEL_CALLS, numbers)
    assert body["status"] == "COMPLETED", body
    inside = plain(body["results"]["out"])
    print(f"\noutside: {outside_outcome}\ninside: {inside}")
    calls = [name for name in outside_outcome if name != "Seccomp"]
    assert outside_outcome["keyctl"] == outside_outcome["add_key"] == "ok"
    assert "EPERM" not in [outside_outcome[name] for name in calls], outside_outcome
    assert {name: inside[name] for name in calls} == dict.fromkeys(calls, "EPERM")
    assert inside["Seccomp"] == "2" and outside_outcome["Seccomp"] == "0"


PLANT_KEY = """
import ctypes, os
def f(add_key, keyctl, marker):
    '''The attack: a key in the uid's user keyring, readable by every process of that uid.'''
    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(add_key, b"user", marker.encode(), b"tenant secret", 13, -4)  # KEY_SPEC_USER_KEYRING
    if key < 0:
        return ["add_key", os.strerror(ctypes.get_errno())]
    libc.syscall(keyctl, 5, key, 0x3F3F3F3F)  # KEYCTL_SETPERM: everything to everyone
    return ["planted", key]
"""
READ_KEYS = """
def f(marker):
    with open("/proc/keys") as keys:
        return [line for line in keys if marker in line]
"""


def test_a_key_one_tenant_plants_is_refused_and_no_later_request_reads_one(limited):
    """Before: alice's key, made readable by the sandbox uid, was read by id from /proc/keys by bob's
    later requests in either slot; 195 keys filled the uid's quota for every later request."""
    column = kcoral_worker.SECCOMP_ARCHES[os.uname().machine][1]
    add_key, keyctl = (kcoral_worker.SECCOMP_DENIED[name][column] for name in ("add_key", "keyctl"))
    marker = "kcoral-" + uuid.uuid4().hex
    planted = [plain(execute(limited, PLANT_KEY, add_key, keyctl, marker)["results"]["out"]) for _ in range(3)]
    assert all(attempt[0] == "add_key" and "not permitted" in attempt[1] for attempt in planted), planted
    for _ in range(4):  # both slots, more than once
        assert plain(execute(limited, READ_KEYS, marker, token=BOB)["results"]["out"]) == []


def test_the_filter_is_built_for_both_architectures_and_refuses_an_unknown_one():
    for machine, (arch, _, _) in kcoral_worker.SECCOMP_ARCHES.items():
        program = kcoral_worker.seccomp_filter(machine)
        assert len(program) % kcoral_worker.BPF_INSTRUCTION.size == 0
        assert kcoral_worker.BPF_INSTRUCTION.unpack_from(program, 8)[3] == arch  # the architecture check comes first
    with pytest.raises(OSError, match="no seccomp table for riscv64"):
        kcoral_worker.seccomp_filter("riscv64")


def test_the_filter_kills_a_call_of_another_architecture():
    """An i386 int 0x80 call on x86_64 would bypass a table of x86_64 numbers: it kills the process."""
    if os.uname().machine != "x86_64":
        pytest.skip("the 32-bit ABI check is x86_64's")
    code = textwrap.dedent("""
        import ctypes, mmap, os, kcoral_worker
        kcoral_worker.install_seccomp_filter(kcoral_worker.seccomp_filter())
        # mov eax, 20 (i386 getpid); int 0x80; ret
        text = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        text.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))
        address = ctypes.addressof(ctypes.c_char.from_buffer(text))
        print(ctypes.CFUNCTYPE(ctypes.c_int)(address)(), flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == -31, (result.returncode, result.stdout, result.stderr)  # SIGSYS


def test_health_says_how_memory_is_enforced_and_what_it_cannot_see(limited):
    status, _, body = request("GET", limited.url + "/health", headers={"Authorization": f"Bearer {ALICE}"})
    assert status == 200, body
    memory = json.loads(body)["limits"]["memory_limit_bytes"]
    assert memory["value"] == LIMIT
    for seen in ("PSS", "page tables", "memfds", "RLIMIT_DATA"):
        assert seen in memory["enforced"], memory
    assert ("System V" in memory["enforced"]) == (os.geteuid() == 0)
    assert "pipe and socket buffers" in memory["unseen"] and "GPU worker" in memory["unseen"]


# --- 4. a delegated cgroup v2 subtree: the kernel's limit -----------------------------------------

CGROUP_FILES = """
import glob, os
def f(root):
    mine = [path for path in glob.glob(os.path.join(root, "request-*"))
            if open(os.path.join(path, "cgroup.procs")).read().split() == [str(os.getpid())]]
    return {name: open(os.path.join(mine[0], name)).read().strip()
            for name in ("memory.max", "memory.swap.max", "pids.max", "memory.oom.group")} if len(mine) == 1 else mine
"""
KILLED_OVER_MEMORY_MAX = """
import glob, os, signal
def f(root):
    '''What the kernel does beyond memory.max, played in the test's tree: count the kill, kill.'''
    mine = next(path for path in glob.glob(os.path.join(root, "request-*"))
                if open(os.path.join(path, "cgroup.procs")).read().split() == [str(os.getpid())])
    with open(os.path.join(mine, "memory.events"), "w") as events:
        events.write("low 0\\nhigh 0\\nmax 3\\noom 1\\noom_kill 1\\noom_group_kill 1\\n")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_with_a_delegated_cgroup_each_request_gets_its_own_with_the_limits(tmp_path):
    """Against a cgroup v2 tree the test provides (plain files: this host has no delegated cgroup v2,
    and tests never create real cgroups): the server moves itself to a leaf, enables memory and pids
    for children, puts each request's worker in a child with the limits, names the flag when the
    kernel killed there, and /health says the kernel enforces the limit."""
    root = tmp_path / "delegated"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text("")
    with ServerProcess("--sandbox", "none", "--cgroup", str(root), "--memory-limit-bytes", str(LIMIT),
                       "--process-limit", "256", workers=1, tmp_path=tmp_path) as srv:
        assert (root / "kcoral-server" / "cgroup.procs").read_text().split() == [str(srv.proc.pid)]
        assert (root / "cgroup.subtree_control").read_text().split() == ["+memory", "+pids"]
        body = execute_ok(srv.url, call_program(CGROUP_FILES, "f", str(root)))
        assert plain(body["results"]["out"]) == {"memory.max": str(LIMIT), "memory.swap.max": "0",
                                                 "pids.max": "256", "memory.oom.group": "1"}, body
        body = execute_ok(srv.url, call_program(KILLED_OVER_MEMORY_MAX, "f", str(root)))
        assert body["status"] == "FAILED" and "--memory-limit-bytes" in body["error"]["message"], body
        assert "memory.max" in body["error"]["message"]
        memory = srv.health()["limits"]["memory_limit_bytes"]
        assert memory["enforced"].startswith("the kernel: memory.max") and str(root) in memory["enforced"]


def test_auto_finds_no_delegated_cgroup_on_a_cgroup_v1_host():
    import kcoral
    with open("/proc/self/cgroup") as f:
        v1 = any(not line.startswith("0::") for line in f)
    if not v1:
        pytest.skip("this host has cgroup v2: auto may find a delegated subtree here")
    assert kcoral.own_delegated_cgroup() is None
