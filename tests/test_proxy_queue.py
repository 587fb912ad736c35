"""A request whose client leaves while it waits in HAProxy's queue never reaches a node
(docs/scaling.md "Cancellation"), through the generated configuration."""

import pytest

from tests.support import HAPROXY, HAProxyProcess, ServerProcess, requests_the_node_logged, simple_program, wait_for
from tests.test_tenants import NAP, open_post, read_answer

TOKEN = "queue-token-1"


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_a_request_left_in_the_proxy_queue_never_reaches_a_node(tmp_path):
    """One one-slot node: a 3 s request holds it, a second waits in HAProxy's queue and its client
    closes the connection.  The node logs the first request alone: nothing of the second."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with ServerProcess("--token", TOKEN, "--log-dir", str(tmp_path / "logs"), workers=1, tmp_path=tmp_path) as node:
        proxy = HAProxyProcess([f"{node.url}=1"], tmp_path, token=TOKEN)
        try:
            busy = open_post(proxy.url, simple_program(NAP, args=[3.0]), auth)
            left = open_post(proxy.url, simple_program(NAP, args=[0.1]), auth)
            assert wait_for(lambda: proxy.row("kcoral_spread")["qcur"] == "1", 5)
            left.close()
            assert read_answer(busy)[0] == 200
            busy.close()
            assert requests_the_node_logged(tmp_path / "logs") == [("request_finished", None)]
        finally:
            proxy.stop()
