"""`kcoral run TOOL [options] -- ARGS...`: the real command in subprocesses, against our
server and against the published 0.1.1 server (interop), plus the checks that need no server.

Every CLI run is a fresh `python -m kcoral run ...` process started in a scratch directory
holding the local inputs, so what is measured is exactly what a user types.
"""

import contextlib
import hashlib
import os
import pty
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from tests.support import (
    PYTHON,
    ROOT,
    ServerProcess,
    free_port,
    join_threads,
    proxy_in_front,
    reference_popen_options,
    reference_server_argv,
    request,
    wait_for,
)

CLI_ENV = {k: v for k, v in os.environ.items() if k not in ("KCORAL_URL", "KCORAL_TOKEN")}
CLI_ENV["PYTHONPATH"] = ROOT  # the command runs from a scratch directory, outside the checkout
TOOLS = ("python", "shell", "ncu", "compute-sanitizer", "run-iket")

SCRIPT = """\
import os, sys
print("argv", sys.argv[1:])
print("FROM_FLAG", os.environ.get("FROM_FLAG"), "COPIED", os.environ.get("COPIED"))
print("to stderr", file=sys.stderr)
os.makedirs("results/deep", exist_ok=True)
open("results/deep/table.csv", "w").write("n,time\\n1,2\\n")
open("summary.txt", "w").write("done")
sys.exit(int(sys.argv[1]))
"""


def cli(*args, cwd, env=None, timeout=120, **kw):
    """Run `python -m kcoral run ARGS` in ``cwd``; the completed process (text streams)."""
    return subprocess.run([PYTHON, "-m", "kcoral", "run", *args], cwd=str(cwd), env={**CLI_ENV, **(env or {})},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, check=False, **kw)


def one_line(stderr):
    """The last stderr line, asserting the command said exactly one thing about its failure."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


# --- the two servers ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_url():
    """The published server's URL (installed on first use by tests/support.py)."""
    port = free_port()
    options = reference_popen_options()
    env = {k: v for k, v in options["env"].items() if k not in ("KCORAL_URL", "KCORAL_TOKEN")}
    proc = subprocess.Popen(reference_server_argv(port, "--num-workers", "2"), cwd=options["cwd"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            assert proc.poll() is None, "the reference server exited while starting"
            try:
                return request("GET", url + "/health", timeout=5)[0] == 200
            except OSError:
                return False

        assert wait_for(healthy, timeout=60, interval=0.1), "the reference server did not answer 200 in 60 s"
        yield url
    finally:
        proc.terminate()  # the server stops its workers itself; a group-wide signal races that
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def our_server(tmp_path_factory):
    with ServerProcess(tmp_path=tmp_path_factory.mktemp("ours")) as srv:
        yield srv


@pytest.fixture(params=["ours", "reference"])
def url(request):
    if request.param == "ours":
        return request.getfixturevalue("our_server").url
    return request.getfixturevalue("reference_url")


@pytest.fixture
def work(tmp_path):
    """A scratch directory with the script the tests send."""
    (tmp_path / "bench.py").write_text(SCRIPT)
    return tmp_path


# --- against both servers ----------------------------------------------------------------

def test_script_with_arguments_env_fetch_and_exit_code(url, work):
    result = cli("python", "--url", url, "--send", "bench.py", "-e", "FROM_FLAG=a=b", "-e", "COPIED",
                 "--fetch", "summary.txt", "--fetch", "results", "--out", "saved", "--", "bench.py", "3", "--size", "9",
                 cwd=work, env={"COPIED": "local value"})
    assert result.returncode == 3, result.stderr
    assert "argv ['3', '--size', '9']" in result.stdout
    assert "FROM_FLAG a=b COPIED local value" in result.stdout
    assert "to stderr" in result.stderr and "to stderr" not in result.stdout
    assert (work / "saved" / "summary.txt").read_text() == "done"
    assert (work / "saved" / "results" / "deep" / "table.csv").read_text() == "n,time\n1,2\n"
    assert sorted(p.name for p in (work / "saved").iterdir()) == ["results", "summary.txt"]


def test_inline_code_stdin_less_and_signals(url, work):
    inline = cli("python", "--url", url, "--", "-c", "import sys; print(sys.argv[1:]); sys.exit(5)", "x", "y",
                 cwd=work)
    assert (inline.returncode, inline.stdout) == (5, "['x', 'y']\n"), inline.stderr
    no_stdin = cli("python", "--url", url, "--", "-c", "input()", cwd=work)
    assert no_stdin.returncode == 1 and "EOFError" in no_stdin.stderr
    killed = cli("python", "--url", url, "--", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                 cwd=work)
    assert killed.returncode == 128 + signal.SIGKILL, killed.stderr
    assert one_line(killed.stderr) == "kcoral run python: python was killed by signal 9 (SIGKILL, Killed)"
    module = cli("python", "--url", url, "--", "-m", "platform", cwd=work)
    assert module.returncode == 0 and module.stdout.startswith("Linux"), module.stderr


def test_send_files_and_directories_keeps_names_tree_and_exec_bits(url, work):
    tree = work / "data" / "nested"
    tree.mkdir(parents=True)
    (tree / "weights.bin").write_bytes(bytes(range(256)) * 64)
    (work / "data" / "empty").mkdir()
    (work / "tool.sh").write_text("#!/bin/sh\necho tool ran with \"$@\"\nexit 7\n")
    (work / "tool.sh").chmod(0o755)
    listing = ("import os, hashlib\n"
               "for d, dirs, files in sorted(os.walk('.')):\n"
               "    for f in sorted(files):\n"
               "        p = os.path.join(d, f)\n"
               "        print(p, os.access(p, os.X_OK), hashlib.sha256(open(p, 'rb').read()).hexdigest()[:8])\n"
               "print('empty dir', os.path.isdir('data/empty'))\n")
    result = cli("python", "--url", url, "--send", "data", "--send", str(work / "tool.sh"), "--", "-c", listing,
                 cwd=work)
    assert result.returncode == 0, result.stderr
    digest = {name: hashlib.sha256((work / name).read_bytes()).hexdigest()[:8]
              for name in ("tool.sh", "data/nested/weights.bin")}
    assert result.stdout.splitlines() == [f"./tool.sh True {digest['tool.sh']}",
                                          f"./data/nested/weights.bin False {digest['data/nested/weights.bin']}",
                                          "empty dir True"]
    shell = cli("shell", "--url", url, "--send", "tool.sh", "--", "./tool.sh", "a", "b c", cwd=work)
    assert (shell.returncode, shell.stdout) == (7, "tool ran with a b c\n"), shell.stderr


def test_kcoral_url_and_host_port(url, work):
    port = url.rsplit(":", 1)[1]
    from_env = cli("python", "--", "-c", "print('via env')", cwd=work, env={"KCORAL_URL": url})
    assert (from_env.returncode, from_env.stdout) == (0, "via env\n"), from_env.stderr
    from_flags = cli("python", "--port", port, "--", "-c", "print('via port')", cwd=work)
    assert (from_flags.returncode, from_flags.stdout) == (0, "via port\n"), from_flags.stderr


def test_missing_remote_tool_is_one_line_naming_it(url, work):
    ncu = cli("ncu", "--url", url, "--out", "prof", "--", "--set", "full", "--", "python", "bench.py", "0", cwd=work)
    assert ncu.returncode == 1
    assert one_line(ncu.stderr) == "kcoral run ncu: ncu is not installed on the server (or is not executable there)"
    sanitizer = cli("compute-sanitizer", "--url", url, "--", "python", "bench.py", "0", cwd=work)
    assert sanitizer.returncode == 1 and "compute-sanitizer is not installed" in one_line(sanitizer.stderr)
    assert not (work / "prof").exists()


def test_missing_fetch_is_an_error_naming_it_and_leaves_no_empty_out(url, work):
    result = cli("python", "--url", url, "--fetch", "nowhere.txt", "--out", "saved", "--", "-c", "pass", cwd=work)
    assert result.returncode == 1
    assert one_line(result.stderr) == \
        "kcoral run python: --fetch nowhere.txt: no such file or directory in the remote working directory"
    assert not (work / "saved").exists()


def test_a_missing_fetch_beside_a_found_one_saves_what_was_found(url, work):
    result = cli("python", "--url", url, "--fetch", "here.txt", "--fetch", "gone/x", "--out", "saved", "--", "-c",
                 "open('here.txt', 'w').write('x')", cwd=work)
    assert result.returncode == 1
    assert "kcoral run python: --fetch gone/x: no such file or directory in the remote working directory" in \
        result.stderr.splitlines()
    assert [p.name for p in (work / "saved").iterdir()] == ["here.txt"]


def test_second_run_of_the_same_inputs_uploads_nothing_large(url, work):
    (work / "big.bin").write_bytes(os.urandom(4 * 1024 * 1024))
    with ByteCountingProxy(url) as proxy:
        sent = []
        for _ in range(2):
            before = proxy.upstream_bytes
            result = cli("python", "--url", proxy.url, "--send", "big.bin", "--", "-c",
                         "import os; print(os.path.getsize('big.bin'))", cwd=work)
            assert (result.returncode, result.stdout) == (0, f"{4 * 1024 * 1024}\n"), result.stderr
            sent.append(proxy.upstream_bytes - before)
    assert sent[0] > 4 * 1024 * 1024
    assert sent[1] < 64 * 1024, sent


# --- our server only ---------------------------------------------------------------------

def test_bearer_token(work, tmp_path_factory):
    with ServerProcess("--token", "s3cret", tmp_path=tmp_path_factory.mktemp("token")) as srv:
        allowed = cli("python", "--url", srv.url, "--", "-c", "print('in')", cwd=work, env={"KCORAL_TOKEN": "s3cret"})
        flag = cli("python", "--url", srv.url, "--token", "s3cret", "--", "-c", "print('in')", cwd=work)
        refused = cli("python", "--url", srv.url, "--", "-c", "print('in')", cwd=work)
    assert (allowed.returncode, allowed.stdout, flag.returncode, flag.stdout) == (0, "in\n", 0, "in\n")
    assert refused.returncode == 1 and refused.stdout == ""
    assert "401" in one_line(refused.stderr) and "bearer token" in refused.stderr


@pytest.fixture(scope="module")
def proxied(our_server, tmp_path_factory):
    """HAProxy, configured by `haproxy-config`, in front of our server."""
    with proxy_in_front(our_server.url, tmp_path_factory.mktemp("proxy")) as proxy:
        yield proxy


PRINT_SLEEP_PRINT = "import time; print('first'); time.sleep(2); print('second', time.time())"


@pytest.mark.parametrize("route", ["direct", "haproxy"])
def test_remote_output_streams_to_the_local_terminal_as_it_is_printed(our_server, work, route, request):
    """The first line is here before the second is printed there (docs/cli.md)."""
    url = our_server.url if route == "direct" else request.getfixturevalue("proxied").url
    proc = subprocess.Popen([PYTHON, "-m", "kcoral", "run", "python", "--url", url, "--", "-c", PRINT_SLEEP_PRINT],
                            cwd=str(work), env=CLI_ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        first = proc.stdout.readline()
        first_seen = time.time()
        second = proc.stdout.readline()
        rest = proc.stdout.read()
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert (first, rest) == (b"first\n", b"")
    assert second.startswith(b"second ")
    assert first_seen < float(second.split()[1]), "the first line arrived only after the second was printed"


def test_a_timeout_keeps_what_was_printed_before_it(our_server, work):
    result = cli("python", "--url", our_server.url, "--timeout", "2", "--", "-c",
                 "import sys, time; print('so far'); print('warn', file=sys.stderr); time.sleep(60)", cwd=work)
    assert (result.returncode, result.stdout) == (124, "so far\n"), result.stderr
    assert result.stderr.splitlines() == [  # in the command's words: the tool and --timeout, no instruction ids
        "warn", "kcoral run python: python timed out: still running after --timeout 2 s (its output so far is above)"]


def test_timeout_is_one_line_and_exit_124(our_server, work):
    started = time.monotonic()
    result = cli("python", "--url", our_server.url, "--timeout", "1", "--", "-c", "import time; time.sleep(60)",
                 cwd=work)
    assert result.returncode == 124 and "timed out" in one_line(result.stderr)  # as timeout(1)
    assert time.monotonic() - started < 30


def test_progress_line_only_on_a_terminal_and_only_when_uploading(our_server, work):
    (work / "huge.bin").write_bytes(os.urandom(17 * 1024 * 1024))
    args = ["python", "--url", our_server.url, "--send", "huge.bin", "--", "-c", "pass"]
    piped = cli(*args, cwd=work)
    assert piped.returncode == 0 and "uploading" not in piped.stderr
    (work / "huge.bin").write_bytes(os.urandom(17 * 1024 * 1024))  # new content: must be sent again
    first = run_with_terminal_stderr(args, work)
    again = run_with_terminal_stderr(args, work)
    assert first[0] == 0 and "kcoral: uploading 1 blobs, 17.0 MiB ... sent" in first[1], first
    assert again == (0, ""), again


def test_mode_bits_of_saved_artifacts_are_private(our_server, work):
    result = cli("python", "--url", our_server.url, "--fetch", "r.txt", "--out", "saved", "--", "-c",
                 "open('r.txt', 'w').write('x')", cwd=work)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE((work / "saved").stat().st_mode) == 0o700
    assert (work / "saved" / "r.txt").read_text() == "x"


def test_a_vendored_client_py_alone_has_the_command(our_server, work):
    vendored = work / "vendor"
    vendored.mkdir()
    shutil.copy(os.path.join(ROOT, "client.py"), vendored / "client.py")
    result = subprocess.run([PYTHON, "vendor/client.py", "run", "python", "--url", our_server.url, "--send", "bench.py",
                             "--", "bench.py", "6"], cwd=str(work), env={**CLI_ENV, "PYTHONPATH": ""}, check=False,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert result.returncode == 6 and "argv ['6']" in result.stdout, result.stderr


STAND_INS = {  # NVIDIA's tools are absent on a CPU box: stand-ins on the server's PATH check the plumbing
    "ncu": '#!/bin/sh\necho "ncu $*"\n[ "$1 $2 $3" = "--config-file 0 --export" ] || exit 90\n'
           'echo report > "$4"\nshift 6\nexec "$@"\n',
    "compute-sanitizer": '#!/bin/sh\n"$@"\ncode=$?\necho "========= ERROR SUMMARY: 0 errors"\nexit $code\n',
    "run-iket": '#!/bin/sh\necho "run-iket $*"\necho iket > "$KCORAL_OUTPUT_DIR/iket.txt"\nshift 3\nexec "$@"\n',
}


def test_profilers_save_their_reports_in_out(work, tmp_path_factory):
    bin_dir = tmp_path_factory.mktemp("stand-ins")
    for tool, script in STAND_INS.items():
        (bin_dir / tool).write_text(script)
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    with ServerProcess(tmp_path=tmp_path_factory.mktemp("profiling"), env=env) as srv:
        ncu = cli("ncu", "--url", srv.url, "--send", "bench.py", "--out", "prof", "--",
                  "--launch-count", "1", "--", "python", "bench.py", "4", cwd=work)
        sanitizer = cli("compute-sanitizer", "--url", srv.url, "--send", "bench.py", "--fetch", "summary.txt",
                        "--out", "checked", "--", "python", "bench.py", "0", cwd=work)
        iket = cli("run-iket", "--url", srv.url, "--send", "bench.py", "--out", "iket", "--",
                   "--mode", "x", "--", "python", "bench.py", "0", cwd=work)
    assert ncu.returncode == 4, ncu.stderr
    assert ncu.stdout.startswith("ncu --config-file 0 --export ") and "--launch-count 1 python bench.py 4" in ncu.stdout
    assert "argv ['4']" in ncu.stdout
    assert [p.name for p in (work / "prof").iterdir()] == ["capture.ncu-rep"]
    assert (work / "prof" / "capture.ncu-rep").read_text() == "report\n"
    assert sanitizer.returncode == 0 and sanitizer.stdout.endswith("ERROR SUMMARY: 0 errors\n"), sanitizer.stderr
    assert (work / "checked" / "summary.txt").read_text() == "done"
    assert iket.returncode == 0 and iket.stdout.startswith("run-iket --mode x -- python bench.py 0"), iket.stderr
    assert (work / "iket" / "iket.txt").read_text() == "iket\n"


def test_gpu_check_helper_on_a_cpu_server(our_server, tmp_path):
    from bench.cli_checks import cli_tool_checks

    if shutil.which("ncu") or shutil.which("compute-sanitizer"):
        pytest.skip("NVIDIA tools are installed here: bench.gpu_check runs them against a GPU server")
    checks = cli_tool_checks(our_server.url, str(tmp_path))
    assert [name for name, _, _ in checks] == ["kcoral run python", "kcoral run ncu (not installed: one-line error)",
                                               "kcoral run compute-sanitizer (not installed: one-line error)"]
    assert all(ok for _, ok, _ in checks), checks


# --- no server needed --------------------------------------------------------------------

USAGE_ERRORS = [
    (["python", "--url", "http://h:1", "script.py"], "separate KCoral options from tool arguments with '--'"),
    (["python", "--url", "http://h:1", "-c", "pass"], "unrecognized arguments: -c"),
    (["python", "--url", "http://h:1", "--"], "arguments are required after '--'"),
    (["python", "--url", "http://h:1", "--", "-u"], "stdin execution is unsupported"),
    (["python", "--url", "http://h:1", "--", "-"], "stdin execution is unsupported"),
    (["python", "--url", "http://h:1", "--", "-i", "x.py"], "interactive Python is unsupported"),
    (["python", "--url", "http://h:1", "-e", "CUDA_VISIBLE_DEVICES=1", "--", "-c", "pass"],
     "CUDA_VISIBLE_DEVICES is managed by the server"),
    (["python", "--url", "http://h:1", "-e", "1BAD=x", "--", "-c", "pass"], "must be identifiers"),
    (["python", "--url", "http://h:1", "-e", "SURELY_UNSET_VARIABLE", "--", "-c", "pass"],
     "local environment variable SURELY_UNSET_VARIABLE is not set"),
    (["python", "--url", "http://h:1", "--host", "h", "--", "-c", "pass"], "--url cannot be combined"),
    (["python", "--", "-c", "pass"], "set KCORAL_URL or pass --url, --host or --port"),
    (["python", "--url", "h:1", "--", "-c", "pass"], "must start with http://"),
    (["python", "--url", "http://h:1", "--fetch", "x", "--", "-c", "pass"], "--fetch and --out must be used together"),
    (["python", "--url", "http://h:1", "--fetch", "../x", "--out", "o", "--", "-c", "pass"], "expected a relative path"),
    (["python", "--url", "http://h:1", "--timeout", "0", "--", "-c", "pass"], "--timeout must be positive"),
    (["ncu", "--url", "http://h:1", "--", "--", "app"], "the following arguments are required: --out"),
    (["ncu", "--url", "http://h:1", "--out", "o", "--", "python", "x.py"], "with another '--'"),
    (["ncu", "--url", "http://h:1", "--out", "o", "--", "-o", "r", "--", "app"], "-o conflicts"),
    (["ncu", "--url", "http://h:1", "--out", "o", "--", "--export=r", "--", "app"], "--export conflicts"),
    (["ncu", "--url", "http://h:1", "--out", "o", "--fetch", "x", "--", "--", "app"], "unrecognized arguments"),
    (["nvcc", "--url", "http://h:1", "--", "x"], "invalid choice: 'nvcc'"),
]


@pytest.mark.parametrize("args, message", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_exit_2_with_the_message(args, message, tmp_path):
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "error: " in result.stderr and message in result.stderr, result.stderr
    assert "usage: kcoral run" in result.stderr


def test_unreachable_server_is_one_line_and_exit_1(tmp_path):
    result = cli("python", "--url", f"http://127.0.0.1:{free_port()}", "--", "-c", "pass", cwd=tmp_path)
    assert result.returncode == 1
    assert one_line(result.stderr).startswith("kcoral run python: cannot reach http://127.0.0.1:")
    assert "Connection refused" in result.stderr


def test_existing_out_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "saved").mkdir()
    # An unreachable server: the refusal comes before any connection is attempted.
    result = cli("python", "--url", f"http://127.0.0.1:{free_port()}", "--fetch", "x", "--out", "saved",
                 "--", "-c", "pass", cwd=tmp_path)
    assert result.returncode == 1
    assert one_line(result.stderr) == "kcoral run python: --out saved already exists; choose a new directory"


def test_bad_send_paths_are_refused_with_a_clear_message(tmp_path):
    (tmp_path / "real.py").write_text("")
    (tmp_path / "link.py").symlink_to("real.py")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "inner").symlink_to("../real.py")
    unreachable = f"http://127.0.0.1:{free_port()}"
    cases = {"link.py": "link.py is a symbolic link", "dir": "dir/inner is a symbolic link",
             "/dev/null": "/dev/null is not a regular file or directory", "absent": "No such file or directory"}
    for path, message in cases.items():
        result = cli("python", "--url", unreachable, "--send", path, "--", "-c", "pass", cwd=tmp_path)
        assert result.returncode == 1 and message in one_line(result.stderr), (path, result.stderr)
    duplicate = cli("python", "--url", unreachable, "--send", "real.py", "--send", str(tmp_path / "real.py"),
                    "--", "-c", "pass", cwd=tmp_path)
    assert duplicate.returncode == 1 and "already named 'real.py'" in one_line(duplicate.stderr)


def swap_after_lstat(monkeypatch, path, replace):
    """Make ``replace(path)`` happen right after the CLI's lstat of ``path``: the window between
    checking an input and opening it, which a racing local user could use."""
    real_lstat, swapped = os.lstat, []

    def lstat_then_swap(name, *args, **kwargs):
        info = real_lstat(name, *args, **kwargs)
        if os.path.basename(os.fspath(name)) == path.name and not swapped:
            swapped.append(path)
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            replace(path)
        return info

    monkeypatch.setattr(os, "lstat", lstat_then_swap)
    return swapped


@pytest.mark.parametrize("where", ["top", "inside", "directory"])
def test_send_refuses_a_link_swapped_in_after_the_check(tmp_path, monkeypatch, where):
    """The input is replaced by a link to a private file (or directory) between the CLI's check
    and its open: the upload is refused, and nothing of the target is read."""
    import client
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key").write_text("private")
    (tmp_path / "data").mkdir()
    victim = {"top": tmp_path / "input.txt", "inside": tmp_path / "data" / "input.txt",
              "directory": tmp_path / "data" / "sub"}[where]
    if where == "directory":
        victim.mkdir()
    else:
        victim.write_text("harmless")
    target = secret if where == "directory" else secret / "key"
    swapped = swap_after_lstat(monkeypatch, victim, lambda path: path.symlink_to(target))
    with pytest.raises(client._CommandError, match="is a symbolic link") as refused:
        client._read_inputs([str(victim if where == "top" else tmp_path / "data")])
    assert swapped == [victim] and victim.is_symlink()
    assert "private" not in str(refused.value)


def test_send_refuses_a_fifo_swapped_in_after_the_check_without_hanging(tmp_path, monkeypatch):
    """A FIFO with no writer would block a plain open forever; the CLI opens non-blocking and
    refuses it by what it opened."""
    import client
    victim = tmp_path / "input.txt"
    victim.write_text("harmless")
    swap_after_lstat(monkeypatch, victim, os.mkfifo)
    outcome = []

    def read():
        try:
            client._read_inputs([str(victim)])
            outcome.append("read")
        except client._CommandError as exc:
            outcome.append(str(exc))

    started = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    took = time.monotonic() - started
    if reader.is_alive():  # blocked in open: a writer releases it, so the failure is reported
        os.close(os.open(victim, os.O_WRONLY | os.O_NONBLOCK))
    join_threads([reader], 10)
    assert outcome == [f"--send: {victim} is not a regular file or directory"], outcome
    assert took < 2


def test_remote_output_on_a_terminal_cannot_drive_it_but_a_pipe_gets_it_exactly(our_server, work):
    """Escape sequences from the server (colour, window title, clear screen, C1 CSI, a carriage
    return that would overwrite a line) reach a terminal as visible text; piped, every byte is kept."""
    code = ("import sys\nsys.stdout.write('out \\x1b[31mred\\x1b[0m \\x1b]0;title\\x07 \\x9b2J\\r'"
            "'kcoral: fake\\tend\\n')\nsys.stderr.write('err \\x1b[2J\\x00\\n')\n")
    args = ["python", "--url", our_server.url, "--", "-c", code]
    piped = subprocess.run([PYTHON, "-m", "kcoral", "run", *args], cwd=str(work), env=CLI_ENV, check=False,
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == "out \x1b[31mred\x1b[0m \x1b]0;title\x07 \x9b2J\rkcoral: fake\tend\n".encode()
    assert piped.stderr == b"err \x1b[2J\x00\n"
    status, shown = run_with_terminal_stderr(args, work, stdout_too=True)
    assert status == 0
    assert not set(shown) & {"\x1b", "\x07", "\x9b", "\r", "\x00"}, repr(shown)
    assert "out \\x1b[31mred\\x1b[0m \\x1b]0;title\\x07 \\x9b2J\\x0dkcoral: fake\tend\n" in shown, repr(shown)
    assert "err \\x1b[2J\\x00\n" in shown, repr(shown)


def test_error_lines_quoting_the_server_are_made_harmless_on_a_terminal(monkeypatch):
    import client
    leader, follower = pty.openpty()
    try:
        terminal = open(follower, "w", encoding="utf-8", closefd=False)
        monkeypatch.setattr(sys, "stderr", terminal)
        client._complain("kcoral run python: server error: HTTP 500: \x1b]0;pwned\x07")
        terminal.flush()
        shown = os.read(leader, 4096).decode()
    finally:
        os.close(follower)
        os.close(leader)
    assert shown == "kcoral run python: server error: HTTP 500: \\x1b]0;pwned\\x07\r\n", repr(shown)


def test_help_lists_every_option_with_text_for_run_and_each_tool(tmp_path):
    overview = cli("--help", cwd=tmp_path)
    assert overview.returncode == 0 and all(tool in overview.stdout for tool in TOOLS)
    for tool in TOOLS:
        result = cli(tool, "--help", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        text = " ".join(result.stdout.split())
        for option in ("--url", "--host", "--port", "--token", "--timeout", "--output-limit-bytes", "--send",
                       "--env", "--out"):
            assert option in text, (tool, option)
        assert "KCORAL_URL" in text and "KCORAL_TOKEN" in text and "default: 300" in text
        assert ("--fetch" in text) == (tool not in ("ncu", "run-iket")), tool


# --- helpers -----------------------------------------------------------------------------

def run_with_terminal_stderr(args, cwd, stdout_too=False):
    """(exit status, stderr text) of the CLI with its stderr (and stdout) on a pseudo-terminal."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([PYTHON, "-m", "kcoral", "run", *args], cwd=str(cwd), env=CLI_ENV,
                                stdin=subprocess.DEVNULL, stdout=follower if stdout_too else subprocess.DEVNULL,
                                stderr=follower)
        os.close(follower)
        chunks = []
        while True:
            ready, _, _ = select.select([leader], [], [], 120)
            assert ready, "the CLI said nothing for 120 s"
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        return proc.wait(60), b"".join(chunks).decode().replace("\r\n", "\n")
    finally:
        os.close(leader)


class ByteCountingProxy:
    """A TCP relay in front of a server that counts the bytes clients send upstream."""

    def __init__(self, target_url):
        host, port = target_url.split("//", 1)[1].rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.upstream_bytes = 0
        self.lock = threading.Lock()
        self.threads = []
        self.sockets = []

    def __enter__(self):
        self.threads.append(threading.Thread(target=self.accept, daemon=True))
        self.threads[0].start()
        return self

    def __exit__(self, *exc):
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):  # not connected any more: nothing to wake
                sock.shutdown(socket.SHUT_RDWR)  # wakes a pump still blocked in recv
        for thread in self.threads:
            thread.join(10)
            assert not thread.is_alive()
        for sock in [self.listener, *self.sockets]:
            sock.close()

    def accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for source, sink, counted in ((client, upstream, True), (upstream, client, False)):
                thread = threading.Thread(target=self.pump, args=(source, sink, counted), daemon=True)
                thread.start()
                self.threads.append(thread)

    def pump(self, source, sink, counted):
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
                if counted:
                    with self.lock:
                        self.upstream_bytes += len(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            return
