"""The timed scenarios of bench/bench_servers.py, written against the client API that our client
and the published one share (`Client(url).execute(program, ...)`, `Program().upload(...)` ...).

Standard library only and nothing from this repository: bench/published_client_driver.py runs
the same scenarios under the published client's own virtualenv, where `kcoral` is the published
package.  Each scenario alternates request by request between the servers (published, ours,
published, ours ...) so that machine drift hits both alike, and returns {server name: samples}.
Each sample starts once the *other* servers are idle: on a 2-core machine the published server's
replacement of a used worker (a fresh process importing torch, ~3 s of CPU) would otherwise run
during the next server's sample.  Samples alternate, so a server also finishes its own background
work while the other's sample waits and runs: in effect every sample starts on idle servers.  For
the published server that is its best case (its per-request worker start drops out of its
sequential latency), so the ratios are conservative.
A server is anything with `name` and `url`; a client counts what each execute() put on the wire
in `posts` and `blob_bytes`.  The floor (bench/floor_server.py) takes its turn last in every
scenario; a server with a `record_url` is one, and each program's answer is recorded through it
from our server, off the clock, before the floor's first sample of that program (for a fresh
payload: after our server's sample, whose cache the recording would otherwise fill).
"""

import json
import os
import shutil
import threading
import time
import urllib.request

WORKERS = 2
MIB = 1 << 20
TRIVIAL_SOURCE = "def f():\n    return 42\n"
STDOUT_BYTES = 4 * MIB
STDOUT_SOURCE = f"import sys\n\ndef f():\n    sys.stdout.write('x' * {STDOUT_BYTES})\n    return 1\n"
STDOUT_LINES = 65536  # of 64 bytes with the newline: STDOUT_BYTES again, one print() each
STDOUT_LINES_SOURCE = (f"def f():\n    line = 'y' * {STDOUT_BYTES // STDOUT_LINES - 1}\n"
                       f"    for _ in range({STDOUT_LINES}):\n        print(line)\n    return 1\n")
FOLDER_FILES = 500


# --- programs ----------------------------------------------------------------

def function_program(program_class, source):
    """upload module -> get_function f -> run -> return "out"."""
    program = program_class()
    module = program.upload(kind="module", source=source)
    fn = program.get_function(module=module, name="f")
    program.return_(key="out", value=program.run(fn=fn))
    return program


BYTES_SOURCE = "def same(b):\n    return b\n\ndef size(b):\n    return len(b)\n"


def bytes_function_program(program_class, payload, name):
    """A function of the module BYTES_SOURCE (`same`: reads and returns it, `size`: its length) on a
    `bytes` upload of `payload`."""
    program = program_class()
    module = program.upload(kind="module", source=BYTES_SOURCE)
    data = program.upload(kind="bytes", value=payload)
    program.return_(key="out", value=program.run(fn=program.get_function(module=module, name=name), args=[data]))
    return program


def make_folder(directory, round_number):
    """FOLDER_FILES small files with fresh contents, spread over 10 sub-directories."""
    files = {}
    for i in range(FOLDER_FILES):
        rel = f"d{i % 10}/f{i:03d}.txt"
        data = f"round {round_number} file {i} ".encode() + os.urandom(256 + 8 * (i % 64))
        os.makedirs(os.path.join(directory, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(directory, rel), "wb") as f:
            f.write(data)
        files[rel] = data
    return files


def folder_program(program_class, directory):
    program = program_class()
    program.upload_folder(directory, path="in")
    program.return_folder(key="out", path="in")
    return program


def check(condition, what):
    if not condition:
        raise AssertionError(f"benchmark answer check failed: {what}")


def completed(result):
    check(result.completed, f"program did not complete: {result.error}")
    return result


def wait_idle(url, timeout=30):
    """Until every worker slot is ready again (replacements run after each request)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            load = json.load(response)["load"]
        if load["request_capacity"] == WORKERS and load["requests_in_progress"] == 0:
            return
        time.sleep(0.02)


# --- scenarios ---------------------------------------------------------------

def timed(fn):
    start = time.perf_counter()
    value = fn()
    return (time.perf_counter() - start) * 1e3, value


def others_idle(servers, server):
    """Before `server`'s sample: the other servers have finished their background work."""
    for other in servers:
        if other is not server:
            wait_idle(other.url)


def is_floor(server):
    return hasattr(server, "record_url")


RECORDING_SETTLE_SECONDS = 0.5  # after a recording: our server's disk-cache writes and workspace removal


def record(server, make_client, program, **options):
    """Off the clock: the floor's recording of `program`'s answer, from our server through it.  Then a
    pause: what our server does after answering (500 files into its disk cache, the workspace's
    removal) would otherwise run during the floor's sample, which /health does not show."""
    recorder = make_client(server.record_url)
    try:
        completed(recorder.execute(program, **options))
    finally:
        recorder.close()
    time.sleep(RECORDING_SETTLE_SECONDS)


def record_once(servers, make_client, program, **options):
    for server in filter(is_floor, servers):
        record(server, make_client, program, **options)


def alternate(servers, rounds, once):
    """Run `once(server)` -> sample for published, ours, published, ours, ... -> {name: [samples]}."""
    samples = {server.name: [] for server in servers}
    for _ in range(rounds):
        for server in servers:
            others_idle(servers, server)
            samples[server.name].append(once(server))
    return samples


def scenario_trivial(servers, clients, make_client, rounds, program_class):
    program = function_program(program_class, TRIVIAL_SOURCE)
    record_once(servers, make_client, program)
    for server in servers:  # warm-up: connection, first-request paths
        completed(clients[server.name].execute(program))

    def once(server):
        ms, result = timed(lambda: clients[server.name].execute(program))
        check(completed(result)["out"] == 42, "trivial result")
        return ms
    return alternate(servers, rounds, once)


def scenario_burst(servers, make_client, rounds, program_class, concurrency=4, per_client=10):
    program = function_program(program_class, TRIVIAL_SOURCE)
    record_once(servers, make_client, program)
    pools = {server.name: [make_client(server.url) for _ in range(concurrency)] for server in servers}

    def once(server):
        wait_idle(server.url)
        barrier = threading.Barrier(concurrency + 1)
        errors = []

        def drive(client):
            barrier.wait()
            try:
                for _ in range(per_client):
                    check(completed(client.execute(program))["out"] == 42, "burst result")
            except Exception as exc:  # reported after the round
                errors.append(exc)

        threads = [threading.Thread(target=drive, args=(c,)) for c in pools[server.name]]
        for thread in threads:
            thread.start()
        barrier.wait()
        start = time.perf_counter()
        for thread in threads:
            thread.join()
        ms = (time.perf_counter() - start) * 1e3
        if errors:
            raise errors[0]
        return ms

    try:
        return alternate(servers, rounds, once)
    finally:
        for pool in pools.values():
            for client in pool:
                client.close()


def scenario_bytes64(servers, clients, make_client, rounds, program_class):
    """-> (round trip samples, cache hit samples): each round's fresh payload goes to a function
    that returns it, then to one that takes its length.

    The round trip must be 2 POSTs carrying the 64 MiB (CACHE_MISS, then the upload), the cache
    hit 1 POST without it."""
    trips = {server.name: [] for server in servers}
    hits = {server.name: [] for server in servers}
    for _ in range(rounds):
        payload = os.urandom(64 * MIB)
        for samples, posts, uploads, name, answer in ((trips, 2, True, "same", payload),
                                                      (hits, 1, False, "size", len(payload))):
            program = bytes_function_program(program_class, payload, name)
            for server in servers:
                client = clients[server.name]
                if is_floor(server):
                    record(server, make_client, program)
                others_idle(servers, server)
                ms, result = timed(lambda: client.execute(program))
                check(completed(result)["out"] == answer, f"64 MiB payload: {name}")
                check((client.posts, client.blob_bytes >= 64 * MIB) == (posts, uploads),
                      f"{server.name}: {client.posts} POSTs with {client.blob_bytes} blob bytes, "
                      f"expected {posts} {'with' if uploads else 'without'} the 64 MiB")
                samples[server.name].append(ms)
                del result
    return trips, hits


def scenario_folder(servers, clients, make_client, rounds, scratch, program_class):
    samples = {server.name: [] for server in servers}
    for round_number in range(rounds):
        directory = os.path.join(scratch, f"folder-{round_number}")
        files = make_folder(directory, round_number)
        program = folder_program(program_class, directory)  # reads the files: the directory can go
        shutil.rmtree(directory)
        for server in servers:
            if is_floor(server):
                record(server, make_client, program)
            others_idle(servers, server)
            ms, result = timed(lambda: clients[server.name].execute(program))
            returned = completed(result)["out"]
            check({rel: f.read_bytes() for rel, f in returned.files.items()} == files, "folder returned intact")
            samples[server.name].append(ms)
    return samples


def scenario_stdout(servers, clients, make_client, rounds, program_class, source=STDOUT_SOURCE):
    """4 MiB of stdout, by default in one write; with STDOUT_LINES_SOURCE as 65 536 print() lines."""
    program = function_program(program_class, source)
    record_once(servers, make_client, program, output_limit_bytes=2 * STDOUT_BYTES)

    def once(server):
        ms, result = timed(lambda: clients[server.name].execute(program, output_limit_bytes=2 * STDOUT_BYTES))
        check(len(completed(result).stdout) == STDOUT_BYTES and not result.stdout_truncated, "4 MiB stdout")
        return ms
    return alternate(servers, rounds, once)


def run_timed_scenarios(names, servers, clients, make_client, counts, scratch, program_class, progress, floor):
    """The timed scenarios among `names`, in the benchmark's order -> {scenario key: {server: samples}}.

    `counts`: samples per server, {"trivial": n, "burst": n, "rounds": n (the heavy ones)}.  `floor`,
    a FloorServer (bench/floor_server.py) with a client in `clients`, takes its turn last in each."""
    servers = [*servers, floor]
    steps = [
        ("trivial", lambda: scenario_trivial(servers, clients, make_client, counts["trivial"], program_class)),
        ("burst", lambda: scenario_burst(servers, make_client, counts["burst"], program_class)),
        (("bytes64", "cachehit64"), lambda: scenario_bytes64(servers, clients, make_client, counts["rounds"],
                                                             program_class)),
        ("folder", lambda: scenario_folder(servers, clients, make_client, counts["rounds"], scratch, program_class)),
        ("stdout4", lambda: scenario_stdout(servers, clients, make_client, counts["rounds"], program_class)),
        ("stdout_lines", lambda: scenario_stdout(servers, clients, make_client, counts["rounds"], program_class,
                                                 STDOUT_LINES_SOURCE)),
    ]
    raw = {}
    for keys, step in steps:
        keys = (keys,) if isinstance(keys, str) else keys
        if keys[0] not in names:
            continue
        started = time.monotonic()
        values = step()
        raw.update(zip(keys, values if len(keys) > 1 else (values,)))
        progress(f"{'/'.join(keys)}: {time.monotonic() - started:.1f} s")
    return raw
