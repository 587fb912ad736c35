"""The streamed answer (docs/protocol.md §13): output frames while the program runs, the answer
as the last frame; only for a request with `X-KCoral-Stream: output`, directly and through HAProxy."""

import contextlib
import http.client
import json
import time

import pytest

from client import Client, KCoralError, Program
from tests.support import ServerProcess, multipart, program_parts, proxy_in_front, simple_program

PRINT_SLEEP_PRINT = ("import os, sys, time\ndef f():\n    print('first')\n    os.write(2, b'to stderr\\n')\n"
                     "    time.sleep(2)\n    print('second', time.time())\n    return b'bytes back'\n")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with ServerProcess(tmp_path=tmp_path_factory.mktemp("stream")) as srv:
        yield srv


@pytest.fixture(scope="module")
def proxy(node, tmp_path_factory):
    with proxy_in_front(node.url, tmp_path_factory.mktemp("proxy")) as proxy:
        yield proxy


@pytest.fixture(params=["direct", "haproxy"])
def url(request, node):
    return node.url if request.param == "direct" else request.getfixturevalue("proxy").url


def raw_post(url, program, headers, version=11):
    """POST a program -> (response, its connection), the body unread."""
    body, content_type = multipart(program_parts(program))
    conn = http.client.HTTPConnection(url.split("//", 1)[1], timeout=60)
    conn._http_vsn, conn._http_vsn_str = (11, "HTTP/1.1") if version == 11 else (10, "HTTP/1.0")
    conn.request("POST", "/execute", body, {"Content-Type": content_type, **headers})
    return conn.getresponse(), conn


def frames(response):
    """The frames of a streamed body -> [(head fields, payload, seconds since the call)]."""
    started, found = time.monotonic(), []
    while head := response.readline():
        fields = head.decode().rstrip("\n").split(" ", 3)
        found.append((fields, response.read(int(fields[1])), time.monotonic() - started))
    return found


def test_output_frames_arrive_while_the_program_runs_and_the_answer_is_the_last(url):
    response, conn = raw_post(url, simple_program(PRINT_SLEEP_PRINT), {"X-KCoral-Stream": "output"})
    with contextlib.closing(conn):
        assert response.status == 200
        assert (response.getheader("Content-Type"), response.getheader("X-KCoral-Stream")) == \
            ("application/x-kcoral-stream", "output")
        assert response.getheader("Transfer-Encoding") == "chunked"
        got = frames(response)
    first_seen = time.time() - got[-1][2] + got[0][2]  # wall clock when the first frame arrived
    names = [fields[0] for fields, _, _ in got]
    assert names[-1] == "result" and set(names[:-1]) == {"stdout", "stderr"}, names
    assert got[0][1] == b"first\n"
    second = b"".join(payload for fields, payload, _ in got if fields[0] == "stdout")
    assert second.startswith(b"first\nsecond ")
    assert first_seen < float(second.split()[-1]), "the first line only arrived after the second was printed"
    status, content_type = int(got[-1][0][2]), got[-1][0][3]
    assert status == 200 and content_type.startswith("multipart/form-data; boundary=kcoral-")
    assert b'"stdout":"first\\nsecond ' in got[-1][1] and b"bytes back" in got[-1][1]


def test_without_the_header_or_over_http_1_0_the_answer_is_plain(url):
    for headers, version in (({}, 11), ({"X-KCoral-Stream": "output"}, 10), ({"X-KCoral-Stream": "yes"}, 11)):
        response, conn = raw_post(url, simple_program("def f():\n    print('hi')\n    return 1\n"), headers, version)
        with contextlib.closing(conn):
            assert response.getheader("X-KCoral-Stream") is None
            assert response.getheader("Content-Type") == "application/json"
            body = json.loads(response.read())
        assert (body["status"], body["stdout"]) == ("COMPLETED", "hi\n")


def test_a_program_that_prints_nothing_gets_the_plain_answer(node):
    response, conn = raw_post(node.url, simple_program("def f():\n    return 1\n"), {"X-KCoral-Stream": "output"})
    with contextlib.closing(conn):
        assert response.getheader("Content-Type") == "application/json"
        assert json.loads(response.read())["status"] == "COMPLETED"


def test_the_client_calls_on_output_as_chunks_arrive_and_the_result_holds_all(url):
    program = Program()
    module = program.upload(kind="module", source=PRINT_SLEEP_PRINT)
    program.return_(key="out", value=program.run(fn=program.get_function(module=module, name="f")))
    seen = []
    with Client(url) as client:
        result = client.execute(program, on_output=lambda name, data: seen.append((name, data, time.time())))
    assert result.completed and result["out"] == b"bytes back"
    assert seen[0][:2] == ("stdout", b"first\n") and ("stderr", b"to stderr\n") in [s[:2] for s in seen]
    assert b"".join(d for name, d, _ in seen if name == "stdout").decode() == result.stdout
    assert seen[0][2] < float(result.stdout.split()[-1])


def test_a_timeout_in_a_stream_is_its_last_frame_with_the_output(node):
    program = Program()
    module = program.upload(kind="module", source="import time\ndef f():\n    print('so far')\n    time.sleep(60)\n")
    program.run(fn=program.get_function(module=module, name="f"), id="r")
    seen = []
    with Client(node.url) as client, pytest.raises(KCoralError) as info:
        client.execute(program, timeout_seconds=1.5, on_output=lambda name, data: seen.append(data))
    assert seen == [b"so far\n"]
    assert (info.value.status_code, info.value.stdout) == (504, "so far\n")
    assert info.value.message == "execution timed out after 1.5 s in instruction 2 (run 'r')"
