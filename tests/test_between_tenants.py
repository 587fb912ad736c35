"""Tenants that cannot hurt or watch each other through the front-end (docs/sandbox.md, "Between
tenants"): each test performs one attack a tenant's token allows and measures what it got.

1. memory the front-end allocates for a body follows the bytes received, not the declaration;
2. one tenant's (or one address's) slow bodies cannot hold every connection, and /health is
   answered while every body slot is held;
3. a client that leaves is seen leaving however it leaves (unread bytes, half-close, reset);
4. the blob cache answers a tenant only for blobs that tenant supplied, also after a restart.
"""

import json
import os
import socket
import struct
import time

import pytest

from tests.support import (
    ServerProcess,
    is_alive,
    post,
    prog,
    rss_kib,
    run,
    sha256,
    simple_program,
    up_blob,
    up_module,
    wait_for,
)
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
