"""The benchmark's stand-in server (bench/instant_server.py), whose answers set each client's floor:
it must answer the data-moving scenarios exactly as a server does, for both clients, and refuse
what it cannot answer.  The benchmark itself is not run here (it takes 15-20 minutes)."""

import os
import subprocess
import textwrap

import pytest

from bench import scenarios
from bench.bench_servers import CountingClient
from bench.instant_server import InstantServer
from client import Client, KCoralError, Program
from tests.support import ROOT, reference_popen_options, reference_python


@pytest.fixture
def alone():
    server = InstantServer()
    yield server
    server.stop()


def folder_contents(result):
    folder = result["out"]
    return {rel: f.read_bytes() for rel, f in folder.files.items()}, sorted(folder.directories)


def test_it_answers_the_echo_programs_as_our_server_does(alone, front_end_server, tmp_path):
    payload = os.urandom(3 << 20)
    files = scenarios.make_folder(str(tmp_path / "folder"), 0)
    echo = scenarios.echo_bytes_program(Program, payload)
    folder = scenarios.folder_program(Program, str(tmp_path / "folder"))
    instant, real = CountingClient(alone.url), Client(front_end_server.url)
    try:
        first, again = instant.execute(echo), None
        assert (instant.posts, instant.blob_bytes) == (2, len(payload))  # CACHE_MISS, then the upload
        again = instant.execute(echo)
        assert (instant.posts, instant.blob_bytes) == (1, 0)  # a cache hit: it kept the blob, and said so
        assert first["out"] == again["out"] == real.execute(echo)["out"] == payload
        ours = folder_contents(instant.execute(folder))
        assert instant.posts == 1  # its instance named: our client sends the small files at once
        assert ours == folder_contents(real.execute(folder))
        assert ours[0] == files and len(ours[1]) == 10
    finally:
        instant.close()
        real.close()


def test_it_runs_no_code(alone):
    client = Client(alone.url)
    try:
        with pytest.raises(KCoralError) as failure:
            client.execute(scenarios.function_program(Program, scenarios.TRIVIAL_SOURCE))
        assert failure.value.status_code == 400 and "only echoes uploads" in failure.value.message
        assert client.execute(scenarios.echo_bytes_program(Program, b"still here"))["out"] == b"still here"
    finally:
        client.close()


PUBLISHED_CLIENT = textwrap.dedent("""
    import os, sys, tempfile
    sys.path.insert(0, os.path.join(sys.argv[1], "bench"))
    import kcoral, scenarios
    from instant_server import InstantServer
    alone = InstantServer()
    client = kcoral.Client(alone.url)
    payload = os.urandom(1 << 20)
    for _ in range(2):  # a CACHE_MISS round, then a cache hit
        assert client.execute(scenarios.echo_bytes_program(kcoral.Program, payload))["out"] == payload
    directory = os.path.join(tempfile.mkdtemp(), "folder")
    files = scenarios.make_folder(directory, 1)
    folder = client.execute(scenarios.folder_program(kcoral.Program, directory))["out"]
    assert {rel: f.read_bytes() for rel, f in folder.files.items()} == files
    alone.stop()
    print("published client ok")
""")


def test_the_published_client_takes_its_answers():
    result = subprocess.run([reference_python(), "-c", PUBLISHED_CLIENT, ROOT], capture_output=True, text=True,
                            timeout=300, **reference_popen_options())
    assert result.returncode == 0 and "published client ok" in result.stdout, result.stderr
