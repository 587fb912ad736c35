"""HashAhead: blob parts hashed while a body arrives.  What it records must be the SHA-256 of exactly
the range it names, whatever the body and however it arrives; split_request trusts it for that
range only, and hashes everything else itself."""

import hashlib
import json
import os
import random
import socket
import threading

import pytest

import kcoral
from tests.support import (
    assert_error_body,
    decode_response,
    execute_ok,
    join_threads,
    multipart,
    prog,
    request,
    ret,
    sha256,
    up_blob,
)

BOUNDARY = b"kcoral-0123456789abcdef0123456789abcdef"
CT = "multipart/form-data; boundary=" + BOUNDARY.decode()


def part(name, content_type, payload, nl=b"\r\n"):
    return (b"--" + BOUNDARY + nl + b'Content-Disposition: form-data; name="' + name + b'"' + nl +
            b"Content-Type: " + content_type + nl + nl + payload + nl)


def request_body(blobs, nl=b"\r\n"):
    program = b'{"instructions":[]}'
    body = part(b"program", b"application/json", program, nl)
    for data in blobs:
        body += part(b"blob:" + hashlib.sha256(data).hexdigest().encode(), b"application/octet-stream", data, nl)
    return bytearray(body + b"--" + BOUNDARY + b"--" + nl)


def arrive(body, pieces, fail_at=None):
    """Feed `body` to a HashAhead as a reader would, in `pieces` random cuts -> its digests."""
    buffer = bytearray(len(body))
    ahead = kcoral.HashAhead(buffer, BOUNDARY)
    cuts = sorted(random.Random(pieces).sample(range(1, len(body)), min(pieces, len(body) - 1))) + [len(body)]
    received = 0
    for cut in cuts:
        if fail_at is not None and cut > fail_at:
            break  # the client went away: the reader stops publishing
        buffer[received:cut] = body[received:cut]
        received = cut
        ahead.advance(received)
    ahead.slots.acquire()  # finish() gives back the slot start() would have taken
    digests = ahead.finish()
    assert not ahead.thread.is_alive()
    return digests


def assert_sound(body, digests):
    for (start, end), digest in digests.items():
        assert hashlib.sha256(body[start:end]).hexdigest() == digest


@pytest.mark.parametrize("pieces", [1, 7, 300, 5000])
def test_each_blob_part_is_hashed_once_it_has_arrived(pieces):
    blobs = [os.urandom(n) for n in (70_000, 0, 1, 123_457)]
    body = request_body(blobs)
    digests = arrive(body, pieces)
    assert_sound(body, digests)
    assert sorted(digests.values()) == sorted(hashlib.sha256(b).hexdigest() for b in blobs)
    split = kcoral.split_request(bytes(body), CT, digests=digests)
    assert [bytes(split.supplied[hashlib.sha256(b).hexdigest()]) for b in blobs] == blobs


def test_split_request_takes_a_digest_for_its_exact_range_only():
    blob = os.urandom(5000)
    body = request_body([blob])
    (start, end), = arrive(body, 9)
    wrong = "0" * 64
    with pytest.raises(kcoral.ValidationError, match="blob hash mismatch"):  # it is used: it decides
        kcoral.split_request(bytes(body), CT, digests={(start, end): wrong})
    for near in ((start, end - 1), (start + 1, end), (start, end + 1)):  # never for another range
        assert bytes(kcoral.split_request(bytes(body), CT, digests={near: wrong}).supplied[
            hashlib.sha256(blob).hexdigest()]) == blob


@pytest.mark.parametrize("data", [
    b"A\r\n--" + BOUNDARY + b"x not a delimiter\r\n" + b"B" * 3000,   # the delimiter's bytes inside data
    b"\r\n--" + BOUNDARY + b"x",                                         # ... near its end
    b"C--" + BOUNDARY + b"--\r\n" + b"C" * 100,                         # a close delimiter's bytes inside data
    b"\r\n\r\n" * 500,
])
@pytest.mark.parametrize("pieces", [3, 400])
def test_a_body_it_misreads_is_only_hashed_twice(data, pieces):
    body = request_body([data, os.urandom(2000)])
    digests = arrive(body, pieces)
    assert_sound(body, digests)
    split = kcoral.split_request(bytes(body), CT, digests=digests)
    assert bytes(split.supplied[hashlib.sha256(data).hexdigest()]) == data


def test_lf_only_and_padded_bodies_are_split_by_the_protocol_rules():
    blob = os.urandom(4000)
    for body in (request_body([blob], nl=b"\n"),
                 bytearray(bytes(request_body([blob])).replace(BOUNDARY + b"\r\n", BOUNDARY + b" \t\r\n"))):
        digests = arrive(body, 50)
        assert_sound(body, digests)
        assert bytes(kcoral.split_request(bytes(body), CT, digests=digests).supplied[
            hashlib.sha256(blob).hexdigest()]) == blob


def test_a_body_cut_short_ends_the_thread_with_what_it_had():
    blobs = [os.urandom(3000), os.urandom(90_000)]
    body = request_body(blobs)
    digests = arrive(body, 200, fail_at=len(body) // 2)
    assert_sound(body, digests)
    assert list(digests.values()) == [hashlib.sha256(blobs[0]).hexdigest()]


def test_small_bodies_and_busy_slots_take_no_thread():
    assert kcoral.HashAhead.start(bytearray(kcoral.HashAhead.MIN_BODY - 1), CT) is None
    taken = [kcoral.HashAhead.start(bytearray(kcoral.HashAhead.MIN_BODY), CT) for _ in range(3)]
    try:
        assert taken[2] is None and all(isinstance(a, kcoral.HashAhead) for a in taken[:2])
        assert kcoral.HashAhead.start(bytearray(kcoral.HashAhead.MIN_BODY), "text/plain") is None
    finally:
        for ahead in taken[:2]:
            ahead.finish()
    assert isinstance(second := kcoral.HashAhead.start(bytearray(kcoral.HashAhead.MIN_BODY), CT), kcoral.HashAhead)
    second.finish()  # the slots came back


def test_a_body_read_from_a_socket_is_hashed_as_it_arrives():
    blob = os.urandom(9 << 20)
    body = request_body([blob])
    left, right = socket.socketpair()
    buffer = bytearray(len(body))
    ahead = kcoral.HashAhead.start(buffer, CT)
    assert ahead is not None
    sender = threading.Thread(target=left.sendall, args=(bytes(body),))
    sender.start()
    view, got = memoryview(buffer), 0
    while got < len(body):
        got += right.recv_into(view[got:])
        ahead.advance(got)
    join_threads([sender])
    left.close()
    right.close()
    assert list(ahead.finish().values()) == [hashlib.sha256(blob).hexdigest()]


def test_large_uploads_through_the_server(front_end_server):
    """A real server reading 6 MiB bodies: a good blob is taken, a blob whose name lies is refused."""
    blob = os.urandom(6 << 20)
    program = prog(up_blob("b", "bytes", blob), ret("out", "b"))
    assert execute_ok(front_end_server.url, program, [blob])["results"]["out"]["type"] == "bytes"
    lying = [("program", "application/json", json.dumps(program).encode()),
             (f"blob:{sha256(blob)}", "application/octet-stream", os.urandom(6 << 20))]
    body, content_type = multipart(lying)
    status, headers, data = request("POST", front_end_server.url + "/execute", body, {"Content-Type": content_type})
    assert_error_body(status, headers, decode_response(headers, data), 400, "parse", "blob hash mismatch")


def test_it_follows_a_bounded_number_of_parts():
    """A body of many tiny parts costs it no more than its first MAX_PARTS (split_request hashes the rest)."""
    blobs = [b"%d" % i for i in range(kcoral.HashAhead.MAX_PARTS * 3)]
    body = request_body(blobs)
    digests = arrive(body, 40)
    assert_sound(body, digests)
    assert len(digests) == kcoral.HashAhead.MAX_PARTS - 1  # the program is the first part followed
    split = kcoral.split_request(bytes(body), CT, digests=digests)
    assert len(split.supplied) == len(blobs)
