"""docs/operations.md, "Trace a failed request": one id per request from the client through HAProxy
to the node and back.  Our client's X-KCoral-Client-Request-ID (HAProxy's own UUID for a client
that sends none) is in HAProxy's log line beside the node it chose, in the node's log as
client_request_id, on every answer, and on the client's result or exception: for a FAILED program,
a node's 503 and the proxy's own 401.  Real nodes, a real HAProxy configured by haproxy-config."""

import json
import re
import threading
import uuid

import pytest

from client import Client, KCoralError, Program
from tests.support import (
    HAPROXY,
    HAProxyProcess,
    ServerProcess,
    free_port,
    join_threads,
    post,
    request,
    simple_program,
    wait_for,
)

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")

TOKEN = "trace-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    """One node of one worker that lets a request wait 1 s for it, behind a proxy that sends it two
    at a time: the second of two concurrent requests is answered 503 busy by the node."""
    workdir = tmp_path_factory.mktemp("trace")
    node = ServerProcess("--token", TOKEN, "--worker-wait-timeout-seconds", "1", workers=1, tmp_path=workdir)
    proxy = HAProxyProcess([f"{node.url}=2"], workdir, token=TOKEN)
    try:
        assert wait_for(lambda: request("GET", proxy.url + "/health", headers=AUTH)[0] == 200, 20)
        yield node, proxy
    finally:
        proxy.stop()
        node.stop()


def program_running(source):
    program = Program()
    module = program.upload(kind="module", source=source)
    program.return_(key="out", value=program.run(fn=program.get_function(module=module, name="f")))
    return program


def proxy_line(proxy, request_id):
    """HAProxy's log line for the request, once written (it logs when the answer is sent)."""
    found = []
    wait_for(lambda: found.extend(line for line in proxy.log().splitlines() if f"request_id={request_id}" in line)
             or found, 10)
    assert len(found) == 1, (request_id, proxy.log()[-3000:])
    return found[0]


def node_lines(node, request_id, expected=True):
    """The node's log lines naming the id, once there are some (the node logs once the answer is out)."""
    def lines():
        return [line for line in node.log().splitlines() if f"client_request_id={request_id}" in line]

    if expected:
        wait_for(lines, 10)
    return lines()


def test_a_failed_program_is_traced_from_the_client_to_the_node(cohort):
    node, proxy = cohort
    with Client(proxy.url, headers=AUTH) as client:
        result = client.execute(program_running("def f():\n    raise ValueError('wrong answer')\n"))
    assert result.status == "FAILED"
    trace = result.client_request_id
    assert str(uuid.UUID(trace)) == trace
    line = proxy_line(proxy, trace)
    assert f"kcoral_spread/{node.url.removeprefix('http://')} " in line and " 200 " in line, line
    [logged] = node_lines(node, trace)
    assert "request_finished" in logged and "status=FAILED" in logged and f"request_id={result.request_id}" in logged


def test_a_client_without_an_id_gets_the_proxys_on_its_answer(cohort):
    """A client that sends none (the published 0.1.1, curl) gets HAProxy's, which the node logs."""
    node, proxy = cohort
    for sent in ({}, {"X-KCoral-Client-Request-ID": "not-a-uuid"}):
        status, headers, body = post(proxy.url, simple_program("def f():\n    return 1\n"), headers={**AUTH, **sent})
        assert status == 200 and body["status"] == "COMPLETED"
        trace = headers["x-kcoral-client-request-id"]
        assert str(uuid.UUID(trace)) == trace
        assert proxy_line(proxy, trace)
        assert len(node_lines(node, trace)) == 1


def test_the_proxys_own_401_is_traced(cohort):
    node, proxy = cohort
    with Client(proxy.url, headers={"Authorization": "Bearer not-the-token"}) as client:
        with pytest.raises(KCoralError) as refused:
            client.execute(program_running("def f():\n    return 1\n"))
    error = refused.value
    assert (error.status_code, error.kind) == (401, "unauthorized")
    assert error.client_request_id and error.request_id == error.client_request_id  # the proxy's body names it
    line = proxy_line(proxy, error.client_request_id)
    assert "kcoral/<NOSRV> " in line and " 401 " in line, line
    assert node_lines(node, error.client_request_id, expected=False) == []  # never reached the node


def test_a_nodes_503_is_traced(cohort):
    node, proxy = cohort
    sleeper = simple_program("import time\ndef f():\n    time.sleep(8)\n    return 1\n")
    answers = []
    thread = threading.Thread(target=lambda: answers.append(post(proxy.url, sleeper, headers=AUTH)[0]))
    thread.start()
    try:
        assert wait_for(lambda: json.loads(request("GET", node.url + "/health", headers=AUTH)[2])["load"]
                        ["requests_in_progress"] == 1, 20)
        with Client(proxy.url, headers=AUTH) as client:
            with pytest.raises(KCoralError) as busy:
                client.execute(program_running("def f():\n    return 1\n"))
    finally:
        join_threads([thread], 30)
    assert answers == [200]
    error = busy.value
    assert (error.status_code, error.kind) == (503, "busy")
    line = proxy_line(proxy, error.client_request_id)
    assert f"kcoral_spread/{node.url.removeprefix('http://')} " in line and " 503 " in line, line
    refusals = node_lines(node, error.client_request_id)  # one per attempt: HAProxy retried each on the node
    assert refusals and all("http_status=503" in line for line in refusals), refusals
    assert error.request_id in {re.search(r" request_id=(\S+)", line)[1] for line in refusals}


def test_the_proxys_own_503_carries_the_id(tmp_path):
    """No node up: HAProxy answers 503 itself (its http-error body), with the request's id."""
    proxy = HAProxyProcess([f"http://127.0.0.1:{free_port()}=1"], tmp_path, token=TOKEN)
    try:
        sent = str(uuid.uuid4())
        status, headers, body = request("POST", proxy.url + "/execute", b"{}",
                                        {**AUTH, "X-KCoral-Client-Request-ID": sent}, timeout=60)
        assert status == 503 and json.loads(body)["error"]["kind"] == "busy"
        assert headers["x-kcoral-client-request-id"] == json.loads(body)["request_id"] == sent
        assert " 503 " in proxy_line(proxy, sent)
    finally:
        proxy.stop()
