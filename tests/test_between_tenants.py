"""Tenants that cannot hurt or watch each other through the front-end (docs/sandbox.md, "Between
tenants"): each test performs one attack a tenant's token allows and measures what it got.

1. memory the front-end allocates for a body follows the bytes received, not the declaration;
2. one tenant's (or one address's) slow bodies cannot hold every connection, and /health is
   answered while every body slot is held;
3. a client that leaves is seen leaving however it leaves (unread bytes, half-close, reset);
4. the blob cache answers a tenant only for blobs that tenant supplied, also after a restart;
5. /metrics is the operator's: a tenant's token is refused it (403), the operator's
   (--metrics-token-file) reads it; a node of anonymous tokens alone serves it as before;
6. X-Request-Start is believed only beside the proxy's secret (--proxy-secret-file), and a
   program that kills its own worker is counted apart from the server's crashes (the alerts' inputs).
"""

import json
import os
import signal
import socket
import struct
import time

import pytest

from tests.support import (
    HAPROXY,
    HAProxyProcess,
    ServerProcess,
    call_program,
    is_alive,
    post,
    prog,
    request,
    rss_kib,
    run,
    scrape_when,
    sha256,
    simple_program,
    up_blob,
    up_module,
    wait_for,
)
from tests.test_metrics import samples, value
from tests.test_tenants import ALICE, BOB, NAP, auth, events, open_post, read_answer, sleeper, started_pids, token_file

CAROL = "carol-token-4"
TOKENS = f"alice {ALICE}\nbob {BOB}\ncarol {CAROL}\n"


def mem_available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    return 0


def start_body(port, token, declared, sent=1024, chunked=False):
    """A POST /execute that declares a `declared`-byte body and sends only `sent` bytes of it -> the
    socket, left open."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    framing = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {declared}\r\n"
    head = (f"POST /execute HTTP/1.1\r\nHost: kcoral\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: multipart/form-data; boundary=b\r\n{framing}\r\n")
    chunk_head = f"{declared:x}\r\n".encode() if chunked else b""
    sock.sendall(head.encode() + chunk_head + b"x" * sent)
    return sock


def answer_of(sock, timeout=10):
    sock.settimeout(timeout)
    status, headers, body = read_answer(sock)
    sock.close()
    return status, headers, body


def health_seconds(url, token=BOB):
    started = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10)
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: kcoral\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
    status, _, _ = answer_of(sock)
    assert status == 200
    return time.monotonic() - started


# --- 1. body memory follows bytes received ---------------------------------------------------

@pytest.mark.skipif(mem_available_bytes() < 4 << 30, reason="needs 4 GiB free: unfixed, the attack costs 1.6 GiB")
def test_declared_body_sizes_cost_nothing_until_the_bytes_arrive(tmp_path):
    """Eight POSTs declare 200 MiB each (four by Content-Length, four as one chunk) and send 1 KiB:
    the front-end's RSS grows by at most 64 MiB (it grew by 1.4-1.6 GiB when it allocated what was
    declared)."""
    with ServerProcess("--token-file", token_file(tmp_path, TOKENS), workers=1, tmp_path=tmp_path) as server:
        before = rss_kib(server.proc.pid)
        socks = [start_body(server.port, ALICE, 200 << 20, chunked=i % 2 == 1) for i in range(8)]
        time.sleep(1.0)  # the server has read what was sent and waits for the rest
        grown_mib = (rss_kib(server.proc.pid) - before) / 1024
        for sock in socks:
            sock.close()
        print(f"front-end RSS +{grown_mib:.1f} MiB for 8 bodies declaring 200 MiB, 8 KiB received")
        assert grown_mib <= 64, f"front-end RSS grew {grown_mib:.0f} MiB for 8 KiB received"
        assert health_seconds(server.url) < 1.0


# --- 2. connections per tenant, per address, and a whole-body deadline -------------------------

def assert_busy(answer, status, *fragments):
    got, headers, body = answer
    assert got == status, body
    assert headers.get("retry-after") == "1" and body["status"] == "ERROR", (headers, body)
    assert body["error"]["kind"] == "busy", body
    for fragment in fragments:
        assert fragment in body["error"]["message"], body


def test_one_tenants_slow_bodies_hold_only_its_share_of_connections(tmp_path):
    """alice holds her 3 body slots with bodies that trickle; her 4th POST is refused at once
    (429, Retry-After, naming the flag), while bob's request runs and /health answers."""
    with ServerProcess("--token-file", token_file(tmp_path, TOKENS), "--max-connections", "64",
                       "--max-bodies-per-tenant", "3", workers=1, tmp_path=tmp_path) as server:
        held = [start_body(server.port, ALICE, 1 << 20) for _ in range(3)]
        time.sleep(0.3)
        started = time.monotonic()
        fourth = start_body(server.port, ALICE, 1 << 20)
        assert_busy(answer_of(fourth), 429, "tenant alice", "--max-bodies-per-tenant")
        refused_after = time.monotonic() - started
        status, _, body = post(server.url, simple_program(NAP, args=[0]), headers=auth(BOB), timeout=30)
        assert status == 200 and body["status"] == "COMPLETED", body
        assert health_seconds(server.url) < 1.0
        assert refused_after < 1.0, refused_after
        for sock in held:
            sock.close()


def test_one_address_holds_only_its_share_of_connections(tmp_path):
    """Without names, clients are held apart by address: the 3rd body from 127.0.0.1 is refused."""
    with ServerProcess("--token-file", token_file(tmp_path, TOKENS), "--max-bodies-per-address", "2",
                       workers=1, tmp_path=tmp_path) as server:
        held = [start_body(server.port, token, 1 << 20) for token in (ALICE, BOB)]
        time.sleep(0.3)
        assert_busy(answer_of(start_body(server.port, CAROL, 1 << 20)), 429, "127.0.0.1",
                    "--max-bodies-per-address")
        for sock in held:
            sock.close()


def test_health_is_answered_while_every_body_slot_is_held(tmp_path):
    """With 16 connections and 4 reserved, 12 trickling bodies hold every body slot: the 13th is
    refused (503) and /health still answers within a second (it timed out when bodies could take
    every connection)."""
    with ServerProcess("--token-file", token_file(tmp_path, TOKENS), "--max-connections", "16",
                       "--reserved-connections", "4", "--max-bodies-per-tenant", "100",
                       "--max-bodies-per-address", "100", workers=1, tmp_path=tmp_path) as server:
        held = [start_body(server.port, (ALICE, BOB)[i % 2], 1 << 20) for i in range(12)]
        time.sleep(0.5)
        assert_busy(answer_of(start_body(server.port, CAROL, 1 << 20)), 503, "--reserved-connections")
        seconds = [health_seconds(server.url, token) for token in (ALICE, BOB, CAROL)]
        print(f"/health with every body slot held: {max(seconds) * 1e3:.0f} ms at most")
        assert max(seconds) < 1.0, seconds
        for sock in held:
            sock.close()


def test_a_body_above_the_window_rule_but_below_the_average_is_cut(tmp_path):
    """A body that brings just enough in every window (the attack: 70 KiB per 20 s against 64 KiB
    per 30 s, here scaled to 2 KB per 0.5 s against 1 KB per 1 s) is cut once its average falls
    below --body-min-average-bytes-per-second: its slot is free within two windows."""
    with ServerProcess("--token-file", token_file(tmp_path, TOKENS), "--body-rate-window-seconds", "1",
                       "--body-rate-min-bytes", "1000", "--body-min-average-bytes-per-second", "50000",
                       workers=1, tmp_path=tmp_path) as server:
        sock = start_body(server.port, ALICE, 1 << 20, sent=2000)
        started = time.monotonic()
        cut_after = None
        while time.monotonic() - started < 10:
            time.sleep(0.5)
            try:
                sock.sendall(b"x" * 2000)
            except OSError:  # the server closed its side
                break
            if events(server, "client_disconnected"):
                break
        assert wait_for(lambda: any("reason=body_average" in e for e in events(server, "client_disconnected")), 5)
        cut_after = time.monotonic() - started
        sock.close()
        print(f"a body averaging 4 KB/s cut after {cut_after:.1f} s")
        assert cut_after < 3.0, cut_after


# --- 3. cancellation sees the client leave however it leaves ----------------------------------

def leave(sock, how):
    if how == "close after extra bytes":  # the attack: a byte after the body, then close
        sock.sendall(b"x")
        sock.close()
    elif how == "half-close":  # FIN on the client's sending side: counted as gone, as HAProxy does
        sock.shutdown(socket.SHUT_WR)
    elif how == "reset":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    else:
        sock.close()


@pytest.mark.parametrize("how", ["plain close", "close after extra bytes", "half-close", "reset"])
def test_a_client_that_leaves_is_cancelled_however_it_leaves(tmp_path, how):
    with ServerProcess(workers=1, tmp_path=tmp_path) as server:
        program, marker = sleeper(tmp_path, "running")
        sock = open_post(server.url, program)
        pids = started_pids(marker)
        time.sleep(0.3)  # the body has been read: the extra byte arrives after it
        left = time.monotonic()
        leave(sock, how)
        assert wait_for(lambda: not any(is_alive(pid) for pid in pids), 5, 0.02), f"{how}: the program ran on"
        gone_after = time.monotonic() - left
        print(f"{how}: program gone {gone_after:.2f} s after the client left")
        assert gone_after < 1.5
        assert wait_for(lambda: events(server, "request_cancelled"), 5)
        if how == "half-close":
            sock.close()


# a pipelined request on a live connection is no goodbye: tests/test_tenants.py
# test_a_pipelined_request_is_not_a_disconnect


# --- 4. the blob cache answers a tenant only for what it supplied ------------------------------

GUESSES = 10_000
PIN_SOURCE = "def f(*paths):\n    return len(paths)\n"


def guessing_program(digests):
    """One upload of kind file per guessed hash, without bytes: CACHE_MISS lists the hashes absent."""
    uploads = [up_blob(f"g{i}", "file", digest, path=f"g/{i}") for i, digest in enumerate(digests)]
    return prog(up_module("m", PIN_SOURCE), *uploads,
                {"op": "get_function", "id": "fn", "module": {"$ref": "m"}, "name": "f"},
                run("r", "fn", {"$ref": "g0"}), {"op": "return", "key": "out", "value": {"$ref": "r"}})


def missing_for(url, token, digests):
    status, _, body = post(url, guessing_program(digests), headers=auth(token), timeout=60)
    assert status == 200, body
    return set(body.get("missing_blobs", ()))


def supply(url, token, blob, kind):
    program = prog(up_module("m", PIN_SOURCE), up_blob("b", kind, blob, **({"path": "pin"} if kind == "file" else {})),
                   {"op": "get_function", "id": "fn", "module": {"$ref": "m"}, "name": "f"},
                   run("r", "fn", {"$ref": "b"}), {"op": "return", "key": "out", "value": {"$ref": "r"}})
    status, _, answer = post(url, program, [blob], headers=auth(token))
    assert status == 200 and answer["status"] == "COMPLETED", answer


def test_a_tenant_cannot_learn_which_blobs_another_sent(tmp_path):
    """alice sends a file holding her PIN and a bytes blob; bob names 10 000 guessed hashes, hers
    among them: every one is missing for him (before: 9 999, the one absent being her PIN).  bob
    then supplies the PIN himself and finds it; after a restart, alice and bob each still find it
    (the disk cache's index keeps who supplied it), carol does not."""
    pin = b"PIN=4711"
    secret = os.urandom(64)
    guesses = [sha256(f"PIN={n:04d}".encode()) for n in range(GUESSES)]
    cache = tmp_path / "cache"
    flags = ("--token-file", token_file(tmp_path, TOKENS), "--disk-cache-dir", str(cache))
    with ServerProcess(*flags, workers=1, tmp_path=tmp_path) as server:
        supply(server.url, ALICE, pin, "file")
        supply(server.url, ALICE, secret, "bytes")
        assert missing_for(server.url, ALICE, [sha256(pin)]) == set()  # alice finds her own
        started = time.monotonic()
        missing = missing_for(server.url, BOB, guesses)
        print(f"bob's {GUESSES} guesses: {len(missing)} missing in {time.monotonic() - started:.2f} s")
        assert missing == set(guesses), f"{len(set(guesses) - missing)} guess(es) answered as present"
        status, _, body = post(server.url, prog(up_blob("s", "bytes", secret)), headers=auth(BOB))
        assert body.get("missing_blobs") == [sha256(secret)], body
        supply(server.url, BOB, pin, "file")
        assert missing_for(server.url, BOB, [sha256(pin)]) == set()
    # the file's bytes are stored once, with a link per tenant that supplied them
    stored = [p for p in (cache / "v1" / sha256(pin)[:2]).iterdir() if p.name.startswith(sha256(pin))]
    assert len({os.stat(p).st_ino for p in stored}) == 1 and len(stored) == 3, stored
    with ServerProcess(*flags, workers=1, tmp_path=tmp_path) as server:
        assert missing_for(server.url, ALICE, [sha256(pin)]) == set()
        assert missing_for(server.url, BOB, [sha256(pin)]) == set()
        assert missing_for(server.url, CAROL, [sha256(pin)]) == {sha256(pin)}


def test_an_anonymous_only_server_shares_its_cache_as_before(tmp_path):
    """Bare tokens (no names): one client's blob is found by another, in memory and on disk."""
    path = tmp_path / "tokens"
    path.write_text("first-token-1\nsecond-token-2\n")
    path.chmod(0o600)
    with ServerProcess("--token-file", str(path), workers=1, tmp_path=tmp_path) as server:
        for kind in ("file", "bytes"):
            blob = os.urandom(100)
            supply(server.url, "first-token-1", blob, kind)
            program = prog(up_module("m", PIN_SOURCE), up_blob("b", kind, blob, **({"path": "x"} if kind == "file" else {})),
                           {"op": "get_function", "id": "fn", "module": {"$ref": "m"}, "name": "f"},
                           run("r", "fn", {"$ref": "b"}), {"op": "return", "key": "out", "value": {"$ref": "r"}})
            status, _, body = post(server.url, program, headers=auth("second-token-2"))
            assert status == 200 and body["status"] == "COMPLETED", (kind, json.dumps(body)[:300])


# --- 5. /metrics is the operator's; 6. what the alerts read cannot be forged ----------------------

OPERATOR = "operator-token-3"
SECRET = "proxy-secret-4"


def private_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def tenants_file(tmp_path):
    return private_file(tmp_path, "tokens", f"alice {ALICE}\nbob {BOB}\n")


def test_a_tenant_cannot_watch_another_tenants_requests(tmp_path):
    """bob polls /metrics while alice's program fails: 403 for him, the numbers for the operator."""
    with ServerProcess("--token-file", tenants_file(tmp_path), "--metrics-token-file",
                       private_file(tmp_path, "operators", OPERATOR + "\n"), workers=1, tmp_path=tmp_path) as node:
        status, _, body = post(node.url, simple_program("def f():\n    raise ValueError('no')\n"), headers=auth(ALICE))
        assert status == 200 and body["status"] == "FAILED"
        status, _, answer = request("GET", node.url + "/metrics", headers=auth(BOB))
        assert status == 403, answer
        assert b"alice" not in answer and b"kcoral_requests_total" not in answer
        assert request("GET", node.url + "/health", headers=auth(BOB))[0] == 200  # his own view stays
        failed = 'kcoral_requests_total{status="FAILED",code="200",kind="engine",tenant="alice"} 1'
        assert failed in scrape_when(node.url, lambda text: failed in text, auth(OPERATOR))
        # the operator's token reads; it runs nothing
        assert post(node.url, simple_program("def f():\n    return 1\n"), headers=auth(OPERATOR))[0] == 401
        refused = value(scrape_when(node.url, lambda text: True, auth(OPERATOR)), "kcoral_reads_refused_total")
        assert refused == 2  # the start-up probe's (no token) and bob's: refused reads, not client requests


def test_without_an_operator_token_no_tenant_reads_metrics(tmp_path):
    with ServerProcess("--token-file", tenants_file(tmp_path), workers=1, tmp_path=tmp_path) as node:
        assert [request("GET", node.url + "/metrics", headers=auth(t))[0] for t in (ALICE, BOB)] == [403, 403]


def test_a_node_of_anonymous_tokens_serves_metrics_as_before(tmp_path):
    with ServerProcess("--token-file", private_file(tmp_path, "tokens", f"{ALICE}\n{BOB}\n"), workers=1,
                       tmp_path=tmp_path) as node:
        assert [request("GET", node.url + "/metrics", headers=auth(t))[0] for t in (ALICE, BOB)] == [200, 200]
    with ServerProcess(workers=1, tmp_path=tmp_path / "open") as node:
        assert request("GET", node.url + "/metrics")[0] == 200


FORGED_SECONDS = 3500


def forged_stamp():
    return f"t={int((time.time() - FORGED_SECONDS) * 1e6)}"


def slow_queue_observations(text):
    """Queue observations above 1000 s: what the queue-backlog alert's p95 would read."""
    found = samples(text)
    total = found.get(("kcoral_request_queue_seconds_count", frozenset()), 0)
    below = found.get(("kcoral_request_queue_seconds_bucket", frozenset({("le", "900")})), 0)
    return total - below


def test_a_client_cannot_forge_its_queue_time(tmp_path):
    """X-Request-Start an hour old, sent straight to a node: no queue time, with or without a guessed
    secret; the same stamp beside the proxy's secret is believed (HAProxy's)."""
    secret = private_file(tmp_path, "secret", SECRET + "\n")
    with ServerProcess("--token", ALICE, "--proxy-secret-file", secret, workers=1, tmp_path=tmp_path) as node:
        program = simple_program("def f():\n    return 1\n")
        for headers in ({"X-Request-Start": forged_stamp()},
                        {"X-Request-Start": forged_stamp(), "X-KCoral-Proxy": "guessed"}):
            status, _, body = post(node.url, program, headers={**auth(ALICE), **headers})
            assert status == 200 and body["queue_ms"] < 1000, body
        text = scrape_when(node.url, lambda t: value(t, "kcoral_request_queue_seconds_count") >= 2, auth(ALICE))
        assert slow_queue_observations(text) == 0
        status, _, body = post(node.url, program, headers={**auth(ALICE), "X-Request-Start": forged_stamp(),
                                                           "X-KCoral-Proxy": SECRET})
        assert status == 200 and body["queue_ms"] >= FORGED_SECONDS * 1e3


def test_a_node_without_the_proxy_secret_believes_no_stamp(tmp_path):
    with ServerProcess("--token", ALICE, workers=1, tmp_path=tmp_path) as node:
        status, _, body = post(node.url, simple_program("def f():\n    return 1\n"),
                               headers={**auth(ALICE), "X-Request-Start": forged_stamp()})
        assert status == 200 and body["queue_ms"] < 1000, body


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_the_generated_proxy_sends_its_secret_and_a_client_stamp_is_replaced(tmp_path):
    secret = private_file(tmp_path, "secret", SECRET + "\n")
    with ServerProcess("--token", ALICE, "--proxy-secret-file", secret, workers=1, tmp_path=tmp_path) as node:
        proxy = HAProxyProcess([f"{node.url}=1"], tmp_path, token=ALICE, flags=["--proxy-secret-file", secret])
        try:
            with open(proxy.config_path) as f:
                assert f"set-header X-KCoral-Proxy {SECRET}" in f.read()
            status, _, body = post(proxy.url, simple_program("def f():\n    return 1\n"),
                                   headers={**auth(ALICE), "X-Request-Start": forged_stamp(),
                                            "X-KCoral-Proxy": "guessed"})
            assert status == 200 and body["queue_ms"] < 1000, body  # HAProxy's own stamp, believed
        finally:
            proxy.stop()


SELF_KILL = f"import os\ndef f():\n    os.kill(os.getpid(), {int(signal.SIGKILL)})\n"


def test_programs_killing_their_own_worker_raise_no_crash_alert(tmp_path):
    """11 programs that SIGKILL their worker (the worker-crash alert: more than 10 in 15 minutes):
    each fails, and each is counted as the program's, not as a server crash."""
    with ServerProcess("--token", ALICE, workers=1, tmp_path=tmp_path) as node:
        for _ in range(11):
            status, _, body = post(node.url, call_program(SELF_KILL, "f"), headers=auth(ALICE))
            assert status == 200 and body["status"] == "FAILED", body
            assert "killed by signal 9" in body["error"]["message"]
        failed = {"status": "FAILED", "code": "200", "kind": "runtime"}
        text = scrape_when(node.url, lambda t: value(t, "kcoral_requests_total", **failed) >= 11, auth(ALICE))
        assert value(text, "kcoral_requests_total", **failed) == 11
        assert value(text, "kcoral_worker_crashes_total") == 0  # the alert's input: no server fault
        assert value(text, "kcoral_program_crashes_total", cause="signal") == 11


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed")
def test_one_tenants_burst_does_not_lock_out_another_behind_the_same_address(tmp_path):
    """alice's /health calls used up the per-address limit for bob behind the same address.
    With named tenants the limit counts per tenant: alice is answered 429 past it, bob is served;
    HAProxy's log names the tenant of each line."""
    tokens = tenants_file(tmp_path)
    with ServerProcess("--token-file", tokens, workers=1, tmp_path=tmp_path) as node:
        proxy = HAProxyProcess([f"{node.url}=1"], tmp_path, flags=["--token-file", tokens,
                                                                   "--max-requests-per-source", "10"])
        try:
            statuses = [request("GET", proxy.url + "/health", headers=auth(ALICE))[0] for _ in range(15)]
            assert statuses.count(429) >= 5 and statuses[-1] == 429, statuses
            assert [request("GET", proxy.url + "/health", headers=auth(BOB))[0] for _ in range(3)] == [200] * 3
            log = proxy.log()
            assert " 429 " in log and "tenant=alice" in log and "tenant=bob" in log
        finally:
            proxy.stop()
