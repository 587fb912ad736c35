"""Running a server for others: a private event log bounded in size and reopened on SIGHUP,
saved programs bounded too, every refusal logged, bearer tokens kept out of `ps` (a token
file or the environment, several at once for rotation), one log per embedded server.

Everything is measured from outside the server: modes with os.stat, the sizes of the rotated
files, /proc/<pid>/cmdline, the records in events.jsonl, the answers to requests.
"""

import contextlib
import http.client
import json
import multiprocessing.forkserver
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
import uuid

import pytest

import kcoral
from tests.support import (
    PYTHON,
    ROOT,
    ServerProcess,
    assert_completed,
    free_port,
    is_alive,
    join_threads,
    log_records,
    post,
    request,
    run_directories,
    simple_program,
    wait_for,
)

REQUEST_FIELDS = {"request_id", "http_status", "status", "error_kind", "worker_id", "queue_ms", "elapsed_ms",
                  "total_ms", "response_bytes"}
ECHO = simple_program("def f(x):\n    return x\n", args=[1])
CT = "multipart/form-data; boundary=B"


@contextlib.contextmanager
def umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def logged_server(tmp_path, *flags, **options):
    """A server logging under tmp_path/logs (the flags come after ServerProcess's `--log-dir ''`)."""
    return ServerProcess("--log-dir", str(tmp_path / "logs"), *flags, tmp_path=tmp_path, **options)


def events_path(tmp_path):
    return os.path.join(run_directories(tmp_path / "logs")[-1], "events.jsonl")


def request_events(path, request_id):
    return [r for r in log_records(path) if r.get("request_id") == request_id
            and r["event"] in ("request_finished", "request_refused")]


def private_file(path, text, mode=0o600):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    return str(path)


def raw_exchange(port, head):
    """Send `head` on a new connection -> (status, decoded ERROR body) of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        response = http.client.HTTPResponse(s, method="POST")
        response.begin()
        return response.status, json.loads(response.read())


def refused_framing(port):
    """A request whose Content-Length is no number: 400 before anything runs -> its request id."""
    status, body = raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n")
    assert status == 400, body
    return body["request_id"]


def health_status(url, token):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return request("GET", url + "/health", headers=headers)[0]


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def start_refused(*flags, env=None):
    """`python -m kcoral` that must refuse to start -> its CompletedProcess."""
    return subprocess.run([PYTHON, "-m", "kcoral", "--port", str(free_port()), "--device", "cpu",
                           "--disk-cache-dir", "", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


# --- the log's files ------------------------------------------------------------------------------

def test_log_directories_and_files_are_private_whatever_the_umask(tmp_path):
    with umask(0), logged_server(tmp_path) as srv:
        status, _, body = post(srv.url, ECHO)
        assert status == 200, body
        run_dir = run_directories(tmp_path / "logs")[-1]
        program = os.path.join(run_dir, "programs", body["request_id"] + ".json")
        directories = [tmp_path / "logs", tmp_path / "logs" / "runs", run_dir, os.path.join(run_dir, "programs")]
        files = [os.path.join(run_dir, "events.jsonl"), program]
        modes = {str(path): stat.S_IMODE(os.stat(path).st_mode) for path in directories + files}
    assert modes == {**{str(d): 0o700 for d in directories}, **{f: 0o600 for f in files}}


@pytest.mark.parametrize("unsafe", ["writable by others", "owned by another user"])
def test_a_log_directory_that_others_control_is_refused(tmp_path, unsafe):
    log_dir = tmp_path / "shared"
    log_dir.mkdir()
    if unsafe == "writable by others":
        os.chmod(log_dir, 0o777)
    elif os.geteuid() == 0:
        os.chown(log_dir, 65534, 65534)
    else:
        log_dir = "/"  # root's own, and not ours
    result = start_refused("--log-dir", str(log_dir))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert ("writable by other users" if unsafe == "writable by others" else "is owned by uid") in lines[0]
    assert not os.path.exists(os.path.join(log_dir, "runs"))


def test_the_event_log_rotates_at_its_cap(tmp_path):
    cap, backups = 2048, 2
    with logged_server(tmp_path, "--log-max-bytes", str(cap), "--log-backups", str(backups)) as srv:
        ids = [refused_framing(srv.port) for _ in range(60)]  # each one request_refused record, ~350 bytes
        run_dir = run_directories(tmp_path / "logs")[-1]

        def kept():
            return [r["request_id"] for name in ("events.jsonl.2", "events.jsonl.1", "events.jsonl")
                    for r in log_records(os.path.join(run_dir, name)) if r["event"] == "request_refused"]
        assert wait_for(lambda: set(ids[-2:]) <= set(kept()))  # logged once answered: the last may lag
        names = sorted(os.listdir(run_dir))
        sizes = {name: os.stat(os.path.join(run_dir, name)).st_size for name in names if name != "programs"}
        kept = kept()
    assert names == ["events.jsonl", "events.jsonl.1", "events.jsonl.2", "programs"], names
    assert all(0 < size <= cap for size in sizes.values()), sizes
    assert set(kept) <= set(ids) and len(kept) == len(set(kept)) and len(kept) < len(ids) // 2, kept
    assert set(ids[-2:]) <= set(kept)  # the oldest went, the newest stayed


def test_sighup_reopens_the_event_log_under_its_name(tmp_path):
    with logged_server(tmp_path) as srv:
        events = events_path(tmp_path)
        moved = events + ".moved"
        os.rename(events, moved)  # what logrotate does before it signals
        srv.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: [r["event"] for r in log_records(events)] == ["log_reopened"]), log_records(moved)
        status, _, body = post(srv.url, ECHO)
        assert status == 200, body
        assert wait_for(lambda: request_events(events, body["request_id"]))
        assert srv.proc.poll() is None  # SIGHUP's default action would have ended it
    assert request_events(moved, body["request_id"]) == []
    # the run's start-up lines stayed in the moved file (as root, unsandboxed: its warning first)
    first = [r["event"] for r in log_records(moved)][:2]
    assert first[0] == "server_started" or first == ["unsandboxed_as_root", "server_started"], first


@pytest.mark.parametrize("cap", ["count", "bytes"])
def test_saved_programs_stay_within_their_caps(tmp_path, cap):
    size = len(json.dumps(ECHO).encode())  # what post() sends as the program part, saved as it came
    flags, kept = (["--log-programs-max-count", "3"], 3) if cap == "count" else \
        (["--log-programs-max-bytes", str(size * 5 // 2)], 2)
    with logged_server(tmp_path, *flags) as srv:
        ids = []
        for _ in range(6):
            status, _, body = post(srv.url, ECHO)
            assert status == 200, body
            ids.append(body["request_id"])
        programs = os.path.join(run_directories(tmp_path / "logs")[-1], "programs")
        names = sorted(os.listdir(programs))
        total = sum(os.stat(os.path.join(programs, name)).st_size for name in names)
    assert names == sorted(f"{i}.json" for i in ids[-kept:])
    assert total == kept * size


# --- what gets logged -----------------------------------------------------------------------------

def test_every_refusal_and_every_killed_request_is_one_request_event(tmp_path):
    token_file = private_file(tmp_path / "token", "refusal-token\n")
    auth = {"Authorization": "Bearer refusal-token"}
    flags = ["--token-file", token_file, "--max-header-bytes", "4096", "--header-timeout-seconds", "1",
             "--max-request-bytes", str(1 << 16)]
    answers = {}
    with logged_server(tmp_path, *flags, workers=1) as srv:
        status, _, body = post(srv.url, ECHO)
        answers[401] = body["request_id"]
        status, _, data = request("GET", srv.url + "/health", headers={**auth, "X-Big": "x" * 8192})
        assert status == 431, data
        answers[431] = json.loads(data)["request_id"]
        status, body = raw_exchange(srv.port, b"POST /execute HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        assert status == 408, body
        answers[408] = body["request_id"]
        sent = str(uuid.uuid4())
        status, body = raw_exchange(srv.port, (
            f"POST /execute HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer refusal-token\r\nX-Request-ID: {sent}\r\n"
            f"Content-Type: {CT}\r\nContent-Length: {1 << 20}\r\n\r\n").encode())
        assert status == 413 and body["request_id"] == sent, body
        answers[413] = sent
        status, _, body = post(srv.url, simple_program("import time\ndef f():\n    time.sleep(60)\n",
                                                       options={"timeout_seconds": 1}), headers=auth)
        assert status == 504, body
        answers[504] = body["request_id"]
        status, _, body = post(srv.url, simple_program("import os\ndef f():\n    os._exit(3)\n"), headers=auth)
        assert status == 200 and body["status"] == "FAILED", body
        answers["crash"] = body["request_id"]
        events = events_path(tmp_path)
        assert wait_for(lambda: all(request_events(events, i) for i in answers.values())), log_records(events)
    expected = {401: ("request_refused", "unauthorized", "ERROR"), 431: ("request_refused", "parse", "ERROR"),
                408: ("request_refused", "parse", "ERROR"), 413: ("request_finished", "request_too_large", "ERROR"),
                504: ("request_finished", "timeout", "ERROR"), "crash": ("request_finished", "runtime", "FAILED")}
    for key, request_id in answers.items():
        found = request_events(events, request_id)
        assert len(found) == 1, (key, found)
        record = found[0]
        assert REQUEST_FIELDS <= set(record), (key, record)
        assert (record["event"], record["error_kind"], record["status"]) == expected[key], (key, record)
        assert record["http_status"] == (200 if key == "crash" else key), record
        assert record["response_bytes"] > 0, record
    for key in (504, "crash"):  # a killed worker is named
        assert request_events(events, answers[key])[0]["worker_id"] == "cpu/w0"


# --- bearer tokens --------------------------------------------------------------------------------

def test_a_token_file_accepts_each_of_its_tokens_and_stays_out_of_ps(tmp_path):
    tokens = [f"old-{uuid.uuid4().hex}", f"new-{uuid.uuid4().hex}"]
    path = private_file(tmp_path / "tokens", "\n".join(tokens) + "\n")
    with ServerProcess("--token-file", path, tmp_path=tmp_path, workers=1) as srv:
        statuses = [health_status(srv.url, t) for t in [*tokens, f"third-{uuid.uuid4().hex}", None]]
        for token in tokens:
            status, _, body = post(srv.url, ECHO, headers={"Authorization": f"Bearer {token}"})
            assert status == 200 and assert_completed(body)
        command = cmdline(srv.proc.pid)
        warned = "visible to every local user" in srv.log()
    assert statuses == [200, 200, 401, 401]
    assert not [t for t in tokens if t.encode() in command], command
    assert not warned


def test_tokens_from_the_environment_are_all_accepted_and_stay_out_of_ps(tmp_path):
    tokens = [f"env-{uuid.uuid4().hex}", f"env-{uuid.uuid4().hex}", f"env-{uuid.uuid4().hex}"]
    env = {"KCORAL_TOKEN": f"{tokens[0]}, {tokens[1]}\n{tokens[2]}"}  # commas and white space separate
    with ServerProcess(tmp_path=tmp_path, workers=1, env=env) as srv:
        statuses = [health_status(srv.url, t) for t in [*tokens, "env-other", None]]
        command = cmdline(srv.proc.pid)
        warned = "visible to every local user" in srv.log()
    assert statuses == [200, 200, 200, 401, 401]
    assert not [t for t in tokens if t.encode() in command]
    assert not warned


def test_a_token_on_the_command_line_still_works_with_a_warning(tmp_path):
    with ServerProcess("--token", "argv-token", tmp_path=tmp_path, workers=1) as srv:
        statuses = [health_status(srv.url, t) for t in ("argv-token", "other")]
        warnings = [line for line in srv.log().splitlines() if "visible to every local user" in line]
    assert statuses == [200, 401]
    assert len(warnings) == 1 and "KCORAL_TOKEN" in warnings[0] and "--token-file" in warnings[0]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620], ids=["group-readable", "other-readable", "group-writable"])
def test_a_token_file_others_may_access_is_refused(tmp_path, mode):
    secret = f"leaky-{uuid.uuid4().hex}"
    path = private_file(tmp_path / "tokens", secret + "\n", mode)
    result = start_refused("--token-file", path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "accessible to group or others" in lines[0] and f"{mode:o}" in lines[0]
    assert secret not in result.stderr


@pytest.mark.parametrize("value, source", [("good,bad token\\", "KCORAL_TOKEN"), (" , ", "KCORAL_TOKEN"),
                                           ("tok\"en", "file")], ids=["bad-char", "empty", "quote-in-file"])
def test_a_malformed_token_is_refused_without_being_shown(tmp_path, value, source):
    if source == "file":
        result = start_refused("--token-file", private_file(tmp_path / "tokens", value))
    else:
        result = start_refused(env={"KCORAL_TOKEN": value})
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and lines, result.stderr
    assert "bearer token" in lines[-1] or "holds no token" in lines[-1], lines
    assert "token\\" not in result.stderr and 'tok"en' not in result.stderr


def test_sighup_reads_the_token_file_again(tmp_path):
    path = tmp_path / "tokens"
    private_file(path, "first-token\n")
    with ServerProcess("--token-file", str(path), tmp_path=tmp_path, workers=1) as srv:
        assert health_status(srv.url, "first-token") == 200
        os.replace(private_file(tmp_path / "tokens.new", "second-token\nthird-token\n"), path)  # rotation
        srv.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: health_status(srv.url, "second-token") == 200)
        after_rotation = [health_status(srv.url, t) for t in ("first-token", "second-token", "third-token")]
        os.chmod(path, 0o644)  # a broken file on the next reload keeps the tokens in use
        srv.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: "tokens_reload_failed" in srv.log())
        after_failure = [health_status(srv.url, t) for t in ("first-token", "second-token")]
    assert after_rotation == [401, 200, 200]
    assert after_failure == [401, 200]


# --- embedded servers -----------------------------------------------------------------------------

def embedded_config(log_dir):
    return kcoral.ServerConfig(port=0, device="cpu", num_workers=1, log_dir=log_dir, disk_cache_dir="",
                               log_console=False)


def executed_id(app):
    status, _, body = post(app.url, ECHO)
    assert status == 200, body
    return body["request_id"]


def logged_ids(log_dir):
    return {r["request_id"] for run in run_directories(log_dir) for r in log_records(run)
            if r["event"] == "request_finished"}


def test_each_embedded_server_writes_its_own_log(tmp_path):
    """Two at once, then one without a log after one stopped, in one process."""
    first_dir, second_dir = str(tmp_path / "first"), str(tmp_path / "second")
    first = kcoral.create_app(embedded_config(first_dir)).start()
    try:
        second = kcoral.create_app(embedded_config(second_dir)).start()
        try:
            ids = {first_dir: [executed_id(first)], second_dir: [executed_id(second)]}
        finally:
            second.stop()
        unlogged = kcoral.create_app(embedded_config(None)).start()
        try:
            stray = executed_id(unlogged)
        finally:
            unlogged.stop()
        ids[first_dir].append(executed_id(first))
    finally:
        first.stop()
    assert {d: logged_ids(d) for d in ids} == {d: set(i) for d, i in ids.items()}
    assert [[r["event"] for r in log_records(run)][-1] for d in ids for run in run_directories(d)] == \
        ["server_stopped", "server_stopped"]
    assert stray not in logged_ids(first_dir) | logged_ids(second_dir)


UNIT = os.path.join(ROOT, "docs", "kcoral.service")
UNIT_PYTHON = "/opt/kcoral/venv/bin/python"


def unit_settings(text):
    """The unit's `Key=value` lines (continuations joined) -> {key: [values]}."""
    settings = {}
    for line in text.replace("\\\n", " ").splitlines():
        if re.fullmatch(r"[A-Za-z]+=.*", line):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_systemd_unit_verifies_and_uses_the_real_flags(tmp_path):
    """docs/kcoral.service passes `systemd-analyze verify` without a remark (with this interpreter in
    place of its ExecStart's), names only flags `python -m kcoral --help` knows, gives a stop the
    time a drain can take, and keeps the user namespaces the sandbox needs."""
    with open(UNIT) as f:
        text = f.read()
    assert UNIT_PYTHON in text
    copy = tmp_path / "kcoral.service"
    copy.write_text(text.replace(UNIT_PYTHON, PYTHON))
    verified = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, check=False)
    assert verified.returncode == 0 and verified.stdout + verified.stderr == "", verified.stdout + verified.stderr
    settings = unit_settings(text)
    exec_start = settings["ExecStart"][0].split()
    assert exec_start[:3] == [UNIT_PYTHON, "-m", "kcoral"]
    cli = subprocess.run([PYTHON, "-m", "kcoral", "--help"], cwd=ROOT, capture_output=True, text=True, check=True)
    known = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", cli.stdout))
    used = {arg for arg in exec_start if arg.startswith("--")}
    assert used and used <= known, used - known
    # the tokens are read from their files at start and at each reload: a rotation is no restart
    assert "LoadCredential" not in settings
    assert exec_start[exec_start.index("--token-file") + 1] == "/etc/kcoral/tokens"
    assert exec_start[exec_start.index("--metrics-token-file") + 1] == "/etc/kcoral/operator-tokens"
    # a private address by default (tenants must not reach the node past the proxy); no duplicate journal
    host = exec_start[exec_start.index("--host") + 1]
    assert host == "${KCORAL_HOST}" and settings["Environment"][0] == "KCORAL_HOST=127.0.0.1", settings["Environment"]
    assert "0.0.0.0" not in text.replace("never 0.0.0.0", "")
    assert "--no-log-console" in exec_start
    assert int(settings["OOMScoreAdjust"][0]) < 0 and settings["WatchdogSec"] == ["30s"]
    defaults = kcoral.ServerConfig()
    # a running and a queued request per slot behind the generated HAProxy config (docs/operations.md)
    drain = 2 * (defaults.max_timeout_seconds + defaults.worker_termination_grace_seconds) + 10 * defaults.drain_seconds
    assert int(settings["TimeoutStopSec"][0]) >= drain
    assert settings["KillMode"] == ["mixed"] and settings["Restart"] == ["on-failure"]
    assert settings["User"] == ["kcoral"] and "RestartSec" in settings
    for breaks_the_sandbox in ("RestrictNamespaces", "PrivateUsers", "SystemCallFilter", "ProtectKernelTunables",
                               "ProcSubset", "ProtectProc"):
        assert breaks_the_sandbox not in settings, breaks_the_sandbox
    # ready when /health answers (sd_notify, below); a broken GPU driver fails the start, never serves on CPU;
    # one OOM-killed worker does not stop the node; its cgroup subtree is its own, and writable
    assert settings["Type"] == ["notify"] and exec_start[exec_start.index("--device") + 1] == "gpu"
    assert settings["OOMPolicy"] == ["continue"] and settings["Delegate"] == ["yes"]
    assert "ProtectControlGroups" not in settings and "MemoryMax" in settings and "TasksMax" in settings
    # logrotate rotates (docs/operations.md's one recipe, whose postrotate is the unit's reload): not the node too
    assert exec_start[exec_start.index("--log-max-bytes") + 1] == "0"
    assert settings["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


def test_the_one_logrotate_recipe_reloads_through_the_unit():
    """docs/operations.md holds the recipe; server.md points to it rather than giving another."""
    recipes = {}
    for name in ("operations.md", "server.md"):
        with open(os.path.join(ROOT, "docs", name)) as f:
            recipes[name] = re.findall(r"^ */var/log/kcoral/runs/\*/events\.jsonl \{\n(.*?)^ *\}", f.read(), re.M | re.S)
    assert len(recipes["operations.md"]) == 1 and recipes["server.md"] == []
    assert "systemctl reload kcoral" in recipes["operations.md"][0]


def test_the_node_tells_systemd_it_is_ready_once_health_answers(tmp_path):
    """sd_notify over $NOTIFY_SOCKET, as systemd runs a Type=notify unit: READY=1 comes when /health
    already answers (its first try), STOPPING=1 when a stop begins."""
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        listener.settimeout(120)
        port = free_port()
        server = subprocess.Popen([PYTHON, "-m", "kcoral", "--port", str(port), "--device", "cpu", "--num-workers", "1",
                                   "--log-dir", "", "--disk-cache-dir", str(tmp_path / "cache"), "--sandbox", "none"],
                                  cwd=ROOT, env={**os.environ, "NOTIFY_SOCKET": path},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert listener.recv(4096) == b"READY=1"
            status, _, body = request("GET", f"http://127.0.0.1:{port}/health", timeout=10)
            assert status == 200 and json.loads(body)["load"]["request_capacity"] == 1
            server.send_signal(signal.SIGTERM)
            assert listener.recv(4096) == b"STOPPING=1"
            assert server.wait(60) == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


def test_the_node_pings_the_systemd_watchdog_while_it_serves(tmp_path):
    """Under WatchdogSec= (WATCHDOG_USEC; WATCHDOG_PID, when given, must be the node's): WATCHDOG=1 every half of the interval after
    READY=1; none once a stop began.  The unit's WatchdogSec= (docs/kcoral.service) relies on it."""
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        listener.settimeout(120)
        server = subprocess.Popen([PYTHON, "-m", "kcoral", "--port", str(free_port()), "--device", "cpu", "--num-workers", "1", "--log-dir", "",
                                   "--disk-cache-dir", str(tmp_path / "cache"), "--sandbox", "none"],
                                  cwd=ROOT, env={**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert listener.recv(4096) == b"READY=1"
            listener.settimeout(2)
            started = time.monotonic()
            pings = [listener.recv(4096) for _ in range(4)]
            elapsed = time.monotonic() - started
            assert pings == [b"WATCHDOG=1"] * 4 and elapsed < 1.5, (pings, elapsed)  # every 0.2 s
            server.send_signal(signal.SIGTERM)
            while (message := listener.recv(4096)) == b"WATCHDOG=1":  # one may have been on its way
                pass
            assert message == b"STOPPING=1"
            assert server.wait(60) == 0
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


# --- a stop signal to every process of the tree -----------------------------------------------------

def tree_of(pid):
    """`pid` and every process below it, from /proc (ppid links)."""
    parents = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                parents[int(name)] = int(f.read().rpartition(b")")[2].split()[1])
        except OSError:
            pass
    tree, frontier = {pid}, {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - tree
        tree |= frontier
    return tree


@pytest.mark.parametrize("sandbox", ["none", "bubblewrap"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_the_whole_tree_finishes_the_requests_in_flight(tmp_path, sandbox, sig):
    """As systemd's default KillMode (every process of the service) and a terminal's Ctrl+C (its
    foreground group) deliver it: the server drains, the requests in flight complete, exit 0."""
    if sandbox == "bubblewrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap missing")
    srv = ServerProcess("--sandbox", sandbox, "--drain-seconds", "0.5", workers=2, tmp_path=tmp_path)
    slow = simple_program("import time\ndef f(x):\n    time.sleep(2)\n    return x\n", args=[41])
    answers, threads = [], []
    for _ in range(2):
        thread = threading.Thread(target=lambda: answers.append(post(srv.url, slow)))
        thread.start()
        threads.append(thread)
    assert wait_for(lambda: srv.health()["load"]["requests_in_progress"] == 2, timeout=20)
    tree = tree_of(srv.proc.pid)
    assert len(tree) >= 4, tree  # the server, its template and two workers at least
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert [(status, body["status"], body["results"]["out"]["value"]) for status, _, body in answers] == \
        [(200, "COMPLETED", 41)] * 2, answers
    assert srv.proc.wait(60) == 0, srv.log()
    srv.stderr.close()
    survivors = lambda: [pid for pid in tree if is_alive(pid)]  # noqa: E731
    assert wait_for(lambda: not survivors(), timeout=10), f"processes of the tree outlived the server: {survivors()}"


@pytest.mark.parametrize("whole_tree", [False, True], ids=["SIGINT to the server", "SIGTERM to the whole tree"])
def test_a_stop_signal_runs_the_queued_requests_too(tmp_path, whole_tree):
    """Requests the node took but had no worker for yet are run, not answered 503: a client sees no
    503 for a request a stopping node had admitted (docs/server.md §8).  One worker, three requests
    of 1 s: one running and two queued when the signal comes."""
    srv = ServerProcess("--drain-seconds", "0.5", workers=1, tmp_path=tmp_path)
    slow = simple_program("import time\ndef f(x):\n    time.sleep(1)\n    return x\n", args=[41])
    answers, threads = [], []
    for _ in range(3):
        thread = threading.Thread(target=lambda: answers.append(post(srv.url, slow)))
        thread.start()
        threads.append(thread)
    assert wait_for(lambda: srv.health()["load"]["requests_waiting"] == 2, timeout=20)
    if whole_tree:
        for pid in tree_of(srv.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    else:
        srv.proc.send_signal(signal.SIGINT)
    join_threads(threads, 60)
    assert [(status, body["status"]) for status, _, body in answers] == [(200, "COMPLETED")] * 3, answers
    assert srv.proc.wait(60) == 0, srv.log()
    srv.stderr.close()


def test_a_stop_signal_while_the_template_starts_is_not_lost(monkeypatch):
    """The template must not inherit a SIGTERM handler (it would die of a signal to the whole tree),
    so start_forkserver holds SIGTERM back while it forks it: one sent to the server meanwhile (as
    right after the server starts) is delivered afterwards, not ignored (the server ran on)."""
    received = []
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: os.kill(os.getpid(), signal.SIGTERM))
    previous = signal.signal(signal.SIGTERM, lambda number, _: received.append(number))
    try:
        kcoral.start_forkserver(multiprocessing.get_context("forkserver"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]


SIGNAL_STATE = """import subprocess
def f():
    status = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True).stdout
    return {k: int(v, 16) for k, v in (line.split(":\\t") for line in status.splitlines())
            if k in ("SigBlk", "SigIgn")}
"""


@pytest.mark.parametrize("sandbox", ["none", "bubblewrap"])
def test_what_a_program_starts_gets_the_stop_signals_back(tmp_path, sandbox):
    """Workers take no SIGTERM or SIGINT (a stop signal to the whole tree must not fail the
    requests it drains), but the processes a program starts do: neither blocked nor ignored."""
    if sandbox == "bubblewrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap missing")
    stop_signals = 1 << (signal.SIGTERM - 1) | 1 << (signal.SIGINT - 1)
    with ServerProcess("--sandbox", sandbox, workers=1, tmp_path=tmp_path) as srv:
        status, _, body = post(srv.url, simple_program(SIGNAL_STATE))
    assert status == 200 and body["status"] == "COMPLETED", body
    state = {name: value["value"] for name, value in body["results"]["out"]["value"].items()}
    assert state.keys() == {"SigBlk", "SigIgn"} and not state["SigBlk"] & stop_signals \
        and not state["SigIgn"] & stop_signals, state
