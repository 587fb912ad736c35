"""The benchmark's floor (bench/floor_server.py), whose answers set each client's floor: after
recording a program's answer from our server, it must answer that program exactly as our server
does, through the same round trips, for both clients, and refuse a program it holds no recording
of.  The benchmark itself is not run here (it takes 15-20 minutes)."""

import os
import subprocess
import textwrap

import pytest

from bench import scenarios
from bench.bench_servers import CountingClient
from bench.floor_server import FloorServer
from client import Client, KCoralError, Program
from tests.support import ROOT, reference_popen_options, reference_python


@pytest.fixture
def floor(front_end_server):
    server = FloorServer(front_end_server.url)
    yield server
    server.stop()


def folder_contents(result):
    folder = result["out"]
    return {rel: f.read_bytes() for rel, f in folder.files.items()}, sorted(folder.directories)


def replayed(floor, client, program, **options):
    """The floor's answer to `program`, recorded first as the benchmark does."""
    scenarios.record(floor, Client, program, **options)
    return scenarios.completed(client.execute(program, **options))


def test_it_answers_every_scenario_as_our_server_does(floor, front_end_server, tmp_path):
    payload = os.urandom(3 << 20)
    files = scenarios.make_folder(str(tmp_path / "folder"), 0)
    same = scenarios.bytes_function_program(Program, payload, "same")
    size = scenarios.bytes_function_program(Program, payload, "size")
    folder = scenarios.folder_program(Program, str(tmp_path / "folder"))
    trivial = scenarios.function_program(Program, scenarios.TRIVIAL_SOURCE)
    lines = scenarios.function_program(Program, scenarios.STDOUT_LINES_SOURCE)
    replay, real = CountingClient(floor.url), Client(front_end_server.url)
    try:
        first = replayed(floor, replay, same)  # no instance named yet: our client asks first
        assert (replay.posts, replay.blob_bytes) == (2, len(payload))  # CACHE_MISS, then the upload
        assert first["out"] == real.execute(same)["out"] == payload
        hit = replayed(floor, replay, size)
        assert (replay.posts, replay.blob_bytes) == (1, 0)  # a cache hit: it was sent the blob, and says so
        assert hit["out"] == real.execute(size)["out"] == len(payload)

        ours = folder_contents(replayed(floor, replay, folder))
        assert replay.posts == 1  # our server's instance named: our client sends the small files at once
        assert ours == folder_contents(real.execute(folder))
        assert ours[0] == files and len(ours[1]) == 10

        assert replayed(floor, replay, trivial)["out"] == real.execute(trivial)["out"] == 42
        printed = replayed(floor, replay, lines, output_limit_bytes=2 * scenarios.STDOUT_BYTES)
        assert printed.stdout == real.execute(lines, output_limit_bytes=2 * scenarios.STDOUT_BYTES).stdout
        assert len(printed.stdout) == scenarios.STDOUT_BYTES and not printed.stdout_truncated
    finally:
        replay.close()
        real.close()


def test_it_answers_nothing_it_has_not_recorded(floor):
    client = Client(floor.url)
    try:
        with pytest.raises(KCoralError) as failure:
            client.execute(scenarios.function_program(Program, scenarios.TRIVIAL_SOURCE))
        assert failure.value.status_code == 400 and "no recording" in failure.value.message
        same = scenarios.bytes_function_program(Program, b"still here", "same")
        assert replayed(floor, client, same)["out"] == b"still here"
    finally:
        client.close()


PUBLISHED_CLIENT = textwrap.dedent("""
    import os, sys, tempfile
    sys.path.insert(0, os.path.join(sys.argv[1], "bench"))
    import kcoral, scenarios
    from floor_server import FloorServer
    floor = FloorServer(sys.argv[2])
    client = kcoral.Client(floor.url)

    def replayed(program, **options):
        scenarios.record(floor, kcoral.Client, program, **options)
        return scenarios.completed(client.execute(program, **options))

    assert replayed(scenarios.function_program(kcoral.Program, scenarios.TRIVIAL_SOURCE))["out"] == 42
    printed = replayed(scenarios.function_program(kcoral.Program, scenarios.STDOUT_LINES_SOURCE),
                       output_limit_bytes=2 * scenarios.STDOUT_BYTES)
    assert printed.stdout == ("y" * 63 + "\\n") * scenarios.STDOUT_LINES
    payload = os.urandom(1 << 20)
    assert replayed(scenarios.bytes_function_program(kcoral.Program, payload, "same"))["out"] == payload
    assert replayed(scenarios.bytes_function_program(kcoral.Program, payload, "size"))["out"] == len(payload)
    directory = os.path.join(tempfile.mkdtemp(), "folder")
    files = scenarios.make_folder(directory, 1)
    folder = replayed(scenarios.folder_program(kcoral.Program, directory))["out"]
    assert {rel: f.read_bytes() for rel, f in folder.files.items()} == files
    floor.stop()
    print("published client ok")
""")


def test_the_published_client_takes_its_answers(front_end_server):
    result = subprocess.run([reference_python(), "-c", PUBLISHED_CLIENT, ROOT, front_end_server.url],
                            capture_output=True, text=True, timeout=300, **reference_popen_options())
    assert result.returncode == 0 and "published client ok" in result.stdout, result.stderr
