"""Server tests: the wire contract (docs/protocol.md) end to end on CPU workers.

Servers run as real `python -m kcoral` processes on free loopback ports, so
these tests see exactly what a client sees.  The helpers they use (`ServerProcess`,
`post`, `multipart`, `parse_multipart_response`, ...) live in tests/support.py, shared
with the suites under tests/; the shared servers are fixtures from there too.  The few
helpers only one group needs (its case tables' builders) sit with that group.

Groups, in file order: envelope and request ids (docs/protocol.md §4, table-driven), strict JSON and
program validation (docs/protocol.md §5-6, table-driven), tensor byte length and CACHE_MISS (docs/protocol.md §7),
value/file/folder encoding (docs/protocol.md §9), our extensions (tensors on CPU, instance header,
tokens), FAILED kinds (docs/protocol.md §9.7), crashes/teardown/timeouts (docs/protocol.md §10), output capture
(docs/protocol.md §8.7), /health and load, and the servers started with other flags (limits, token,
worker reuse, CLI, graceful shutdown and restart).  Every test that needs no special flag shares a
module-scoped server: `server` (unsandboxed, then sandboxed) where a worker runs the program, and
`front_end_server` (unsandboxed, once) where the request is answered before any worker sees it.
"""

import hashlib
import http.client
import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid

import numpy
import pytest

import kcoral
import kcoral_worker
from tests.support import (
    BOUNDARY,
    CT,
    EMPTY_MODULE,
    EMPTY_MODULE_JSON,
    ERROR_FIELDS,
    PYTHON,
    ROOT,
    UUID_RE,
    H,
    ServerProcess,
    assert_completed,
    assert_error_body,
    assert_failed,
    assert_parse_error,
    call_program,
    execute_ok,
    free_port,
    front_end_server,  # noqa: F401  (the shared server for requests no worker sees, a fixture)
    get_fn,
    is_alive,
    join_threads,
    marked_pids,
    multipart,
    ok_run,
    plain,
    post,
    post_raw,
    prog,
    program_parts,
    raw_body,
    raw_part,
    ref,
    request,
    ret,
    ret_path,
    run,
    server,  # noqa: F401  (the shared default server, a fixture)
    sha256,
    simple_program,
    up_blob,
    up_module,
    wait_for,
    workspaces,
)


def test_trivial_program_completes(server):
    status, headers, body = post(server.url, simple_program("def f(a, b):\n    return a + b\n", args=[2, 3]))
    assert status == 200
    assert body["status"] == "COMPLETED"
    assert body["results"] == {"out": {"type": "integer", "value": 5}}
    assert headers["x-request-id"] == body["request_id"]
    assert headers["x-kcoral-instance"] == server.health()["instance_id"]


# --- docs/protocol.md §4.1 size limit and transfer encoding --------------------------------------

def test_413_from_content_length_before_reading_the_body(front_end_server):
    """The declared length alone decides: no body byte is ever sent here. The answer names the
    size, the limit (a 1 GiB tensor and 64 MiB more, by default) and the flag that raises it."""
    limit = (1 << 30) + (64 << 20)
    assert kcoral.ServerConfig().max_request_bytes == limit
    for content_type in (CT, "text/plain"):  # docs/protocol.md §4.7: 413 wins over a bad envelope
        conn = http.client.HTTPConnection(f"127.0.0.1:{front_end_server.port}", timeout=10)
        try:
            conn.putrequest("POST", "/execute")
            conn.putheader("Content-Type", content_type)
            conn.putheader("Content-Length", str(limit + 1))
            conn.endheaders()
            response = conn.getresponse()
            data = response.read()
            headers = {k.lower(): v for k, v in response.getheaders()}
        finally:
            conn.close()
        assert_error_body(response.status, headers, json.loads(data), 413, "request_too_large")
        assert json.loads(data)["error"]["message"] == (
            f"request of {limit + 1} bytes exceeds the server's size limit of {limit} bytes (max_request_bytes; "
            "the server's --max-request-bytes flag raises it)")


def test_chunked_request_body_is_accepted(server):
    body, content_type = multipart(program_parts(simple_program("def f():\n    return 'chunked'\n")))
    conn = http.client.HTTPConnection(f"127.0.0.1:{server.port}", timeout=60)
    try:
        chunks = [body[i:i + 100] for i in range(0, len(body), 100)]
        conn.request("POST", "/execute", body=iter(chunks), encode_chunked=True,
                     headers={"Content-Type": content_type, "Transfer-Encoding": "chunked"})
        response = conn.getresponse()
        result = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 200
    assert assert_completed(result) == {"out": {"type": "string", "value": "chunked"}}


# --- docs/protocol.md §4.2 request ids -----------------------------------------------------------

REQUEST_IDS = [
    ("123e4567-e89b-12d3-a456-426614174000", True),
    ("00000000-0000-0000-0000-000000000000", True),       # nil UUID
    ("6ba7b810-9dad-11d1-80b4-00c04fd430c8", True),       # version 1
    ("123E4567-E89B-12D3-A456-426614174000", False),      # uppercase
    ("{123e4567-e89b-12d3-a456-426614174000}", False),    # braces
    ("123e4567e89b12d3a456426614174000", False),          # no hyphens
    ("urn:uuid:123e4567-e89b-12d3-a456-426614174000", False),
    ("not-a-uuid", False),
    ("", False),
    ("123e4567-e89b-12d3-a456-42661417400", False),       # one digit short
    ("123e4567-e89b-12d3-a456-4266141740000", False),     # one digit long
]
REQUEST_ID_NAMES = ["canonical", "nil", "v1", "uppercase", "braces", "no-hyphens", "urn", "garbage", "empty", "short",
                    "long"]


@pytest.mark.parametrize("given,kept", REQUEST_IDS, ids=REQUEST_ID_NAMES)
def test_request_id_rules_on_a_completed_request(server, given, kept):
    check_request_id_rule(server, simple_program("def f():\n    return 1\n"), 200, given, kept)


@pytest.mark.parametrize("given,kept", REQUEST_IDS, ids=REQUEST_ID_NAMES)
def test_request_id_rules_on_a_rejected_request(front_end_server, given, kept):
    check_request_id_rule(front_end_server, {"instructions": []}, 400, given, kept)


def check_request_id_rule(srv, program, http_status, given, kept):
    conn = http.client.HTTPConnection(f"127.0.0.1:{srv.port}", timeout=60)
    try:
        body, content_type = multipart(program_parts(program))
        conn.putrequest("POST", "/execute")
        conn.putheader("Content-Type", content_type)
        conn.putheader("Content-Length", str(len(body)))
        if given or kept:
            conn.putheader("X-Request-ID", given)
        conn.endheaders(body)
        response = conn.getresponse()
        result = json.loads(response.read())
        header = response.getheader("X-Request-ID")
    finally:
        conn.close()
    assert response.status == http_status
    assert header == result["request_id"]
    if kept:
        assert result["request_id"] == given
    else:
        assert result["request_id"] != given.strip().lower()
        assert UUID_RE.fullmatch(result["request_id"])
        assert uuid.UUID(result["request_id"]).version == 4


def test_two_request_id_headers_get_a_fresh_id(server):
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    for pair in ((first, second), (first, first)):
        body, content_type = multipart(program_parts(simple_program("def f():\n    return 1\n")))
        conn = http.client.HTTPConnection(f"127.0.0.1:{server.port}", timeout=60)
        try:
            conn.putrequest("POST", "/execute")
            conn.putheader("Content-Type", content_type)
            conn.putheader("Content-Length", str(len(body)))
            for value in pair:
                conn.putheader("X-Request-ID", value)
            conn.endheaders(body)
            response = conn.getresponse()
            result = json.loads(response.read())
        finally:
            conn.close()
        assert response.status == 200
        assert result["request_id"] not in pair
        assert response.getheader("X-Request-ID") == result["request_id"]
        assert uuid.UUID(result["request_id"]).version == 4


# --- docs/protocol.md §4.3-4.6 envelope, framing, part headers, part names -----------------------------

def _blob_part(data, content_type="application/octet-stream", digest=None):
    return raw_part(f"blob:{digest or sha256(data)}", content_type, data)


PROGRAM_PART = raw_part("program", "application/json", EMPTY_MODULE_JSON)
BYTES_BLOB = b"\x00\x01payload"
BYTES_PROGRAM = json.dumps(prog(up_blob("b", "bytes", BYTES_BLOB), ret("out", "b"))).encode()
BYTES_PROGRAM_PART = raw_part("program", "application/json", BYTES_PROGRAM)


def _headers_part(*lines, payload=EMPTY_MODULE_JSON):
    return b"\r\n".join(line.encode() for line in lines) + b"\r\n\r\n" + payload


ENVELOPE_CASES = [
    # docs/protocol.md §4.3 Content-Type of the request
    ("ct-missing", raw_body([PROGRAM_PART]), None, ["multipart/form-data"]),
    ("ct-json", raw_body([PROGRAM_PART]), "application/json", ["multipart/form-data"]),
    ("ct-mixed", raw_body([PROGRAM_PART]), f"multipart/mixed; boundary={BOUNDARY}", ["multipart/form-data"]),
    ("ct-form-data-suffix", raw_body([PROGRAM_PART]), f"multipart/form-datax; boundary={BOUNDARY}",
     ["multipart/form-data"]),
    ("ct-urlencoded", b"program=1", "application/x-www-form-urlencoded", ["multipart/form-data"]),
    ("boundary-missing", raw_body([PROGRAM_PART]), "multipart/form-data", ["boundary"]),
    ("boundary-empty", raw_body([PROGRAM_PART]), "multipart/form-data; boundary=", []),
    ("boundary-empty-quoted", raw_body([PROGRAM_PART]), 'multipart/form-data; boundary=""', ["boundary"]),
    ("boundary-malformed", raw_body([PROGRAM_PART]), "multipart/form-data; boundary", []),
    ("boundary-unterminated-quote", raw_body([PROGRAM_PART]), 'multipart/form-data; boundary="abc', []),
    ("boundary-wrong", raw_body([PROGRAM_PART]), "multipart/form-data; boundary=other", []),
    # docs/protocol.md §4.4 framing
    ("body-empty", b"", CT, []),
    ("no-delimiter", EMPTY_MODULE_JSON, CT, []),
    ("only-closing-delimiter", f"--{BOUNDARY}--\r\n".encode(), CT, ["no parts"]),
    ("no-closing-delimiter", f"--{BOUNDARY}\r\n".encode() + PROGRAM_PART + b"\r\n", CT, ["closing"]),
    ("no-closing-delimiter-lf", f"--{BOUNDARY}\n".encode() + PROGRAM_PART, CT, ["closing"]),
    ("delimiter-not-at-line-start", f"x--{BOUNDARY}\r\n".encode() + PROGRAM_PART + f"\r\n--{BOUNDARY}--".encode(),
     CT, []),
    ("delimiter-followed-by-text", f"--{BOUNDARY}junk\r\n".encode() + PROGRAM_PART +
     f"\r\n--{BOUNDARY}--".encode(), CT, []),
    # docs/protocol.md §4.5 part headers
    ("header-stray-line", raw_body([_headers_part('Content-Disposition: form-data; name="program"',
                                                  "this is no header", "Content-Type: application/json")]), CT, []),
    ("header-name-with-space", raw_body([_headers_part('Content-Disposition: form-data; name="program"',
                                                       "Content Type: application/json")]), CT, []),
    ("header-block-unterminated", f"--{BOUNDARY}\r\nContent-Type: application/json\r\n--{BOUNDARY}--\r\n".encode(),
     CT, []),
    ("disposition-missing", raw_body([_headers_part("Content-Type: application/json")]), CT,
     ["content-disposition"]),
    ("disposition-twice", raw_body([_headers_part('Content-Disposition: form-data; name="program"',
                                                  'Content-Disposition: form-data; name="program"',
                                                  "Content-Type: application/json")]), CT, ["content-disposition"]),
    ("content-type-missing", raw_body([_headers_part('Content-Disposition: form-data; name="program"')]), CT,
     ["content-type"]),
    ("content-type-twice", raw_body([_headers_part('Content-Disposition: form-data; name="program"',
                                                   "Content-Type: application/json",
                                                   "Content-Type: application/json")]), CT, ["content-type"]),
    ("disposition-attachment", raw_body([_headers_part('Content-Disposition: attachment; name="program"',
                                                       "Content-Type: application/json")]), CT, ["form-data"]),
    ("name-missing", raw_body([_headers_part("Content-Disposition: form-data",
                                             "Content-Type: application/json")]), CT, ["name"]),
    ("name-empty", raw_body([_headers_part('Content-Disposition: form-data; name=""',
                                           "Content-Type: application/json")]), CT, ["name"]),
    ("name-twice", raw_body([_headers_part('Content-Disposition: form-data; name="program"; name="program"',
                                           "Content-Type: application/json")]), CT, ["name"]),
    ("nested-multipart", raw_body([_headers_part('Content-Disposition: form-data; name="program"',
                                                 "Content-Type: multipart/mixed; boundary=x")]), CT,
     ["multipart"]),
    *[(f"cte-{cte}", raw_body([_headers_part('Content-Disposition: form-data; name="program"',
                                             "Content-Type: application/json",
                                             f"Content-Transfer-Encoding: {cte}")]), CT,
       ["content-transfer-encoding"]) for cte in ("base64", "quoted-printable", "7bit", "gzip")],
    # docs/protocol.md §4.6 part names
    ("program-twice", raw_body([PROGRAM_PART, PROGRAM_PART]), CT, ["program"]),
    ("program-missing", raw_body([_blob_part(b"x")]), CT, ["program"]),
    ("program-text-plain", raw_body([raw_part("program", "text/plain", EMPTY_MODULE_JSON)]), CT, ["program"]),
    ("program-octet-stream", raw_body([raw_part("program", "application/octet-stream", EMPTY_MODULE_JSON)]), CT,
     ["program"]),
    ("name-unknown", raw_body([PROGRAM_PART, raw_part("extra", "application/octet-stream", b"x")]), CT,
     ["extra"]),
    ("name-program-case", raw_body([raw_part("Program", "application/json", EMPTY_MODULE_JSON)]), CT, []),
    ("blob-hash-uppercase", raw_body([BYTES_PROGRAM_PART,
                                      _blob_part(BYTES_BLOB, digest=sha256(BYTES_BLOB).upper())]), CT, []),
    ("blob-hash-short", raw_body([BYTES_PROGRAM_PART, _blob_part(BYTES_BLOB, digest=sha256(BYTES_BLOB)[:63])]),
     CT, []),
    ("blob-hash-long", raw_body([BYTES_PROGRAM_PART, _blob_part(BYTES_BLOB, digest=sha256(BYTES_BLOB) + "0")]),
     CT, []),
    ("blob-no-hash", raw_body([BYTES_PROGRAM_PART, raw_part("blob:", "application/octet-stream", b"")]), CT, []),
    ("blob-twice", raw_body([BYTES_PROGRAM_PART, _blob_part(BYTES_BLOB), _blob_part(BYTES_BLOB)]), CT,
     ["duplicate"]),
    ("blob-text-plain", raw_body([BYTES_PROGRAM_PART, _blob_part(BYTES_BLOB, "text/plain")]), CT,
     ["octet-stream"]),
    ("blob-hash-mismatch", raw_body([BYTES_PROGRAM_PART, _blob_part(BYTES_BLOB + b"!", digest=sha256(BYTES_BLOB))]),
     CT, ["mismatch"]),
    ("blob-unreferenced", raw_body([PROGRAM_PART, _blob_part(BYTES_BLOB)]), CT, ["unreferenced"]),
    ("blob-unreferenced-besides-referenced", raw_body([BYTES_PROGRAM_PART, _blob_part(BYTES_BLOB),
                                                       _blob_part(b"other")]), CT, ["unreferenced"]),
    # docs/protocol.md §4.7 which error wins
    ("order-header-defect-beats-earlier-bad-name",
     raw_body([raw_part("bogus", "application/json", b"{}"), _headers_part('Content-Disposition: form-data; name="program"')]),
     CT, ["content-type"]),
    ("order-hash-mismatch-beats-later-duplicate-program",
     raw_body([_blob_part(b"zzz", digest=sha256(b"yyy")), PROGRAM_PART, PROGRAM_PART]), CT, ["mismatch"]),
    ("order-duplicate-program-beats-later-mismatch",
     raw_body([PROGRAM_PART, PROGRAM_PART, _blob_part(b"zzz", digest=sha256(b"yyy"))]), CT, ["program"]),
    ("order-hash-mismatch-beats-missing-program",
     raw_body([_blob_part(b"zzz", digest=sha256(b"yyy"))]), CT, ["mismatch"]),
    ("order-bad-name-beats-missing-program", raw_body([raw_part("other", "application/json", b"{}")]), CT,
     ["other"]),
    ("order-json-beats-unreferenced-blob", raw_body([raw_part("program", "application/json", b"{"),
                                                     _blob_part(b"unref")]), CT, ["json"]),
    ("order-program-validation-beats-unreferenced-blob",
     raw_body([raw_part("program", "application/json", b'{"instructions":[]}'), _blob_part(b"unref")]), CT,
     ["instructions"]),
]


@pytest.mark.parametrize("body,content_type,fragments", [c[1:] for c in ENVELOPE_CASES],
                         ids=[c[0] for c in ENVELOPE_CASES])
def test_envelope_rejected(front_end_server, body, content_type, fragments):
    assert_parse_error(post_raw(front_end_server.url, body, content_type), *fragments)


def test_request_boundary_with_cr_or_lf_is_rejected():
    """A boundary with CR/LF cannot travel in a real header line; check the parser directly."""
    import kcoral
    for value in ('multipart/form-data; boundary="a\rb"', 'multipart/form-data; boundary="a\nb"'):
        with pytest.raises(ValueError):
            kcoral.request_boundary(value)


LOOKALIKE = (b"\r\n--" + BOUNDARY.encode() + b"x\r\n" + b"\n--" + BOUNDARY.encode() + b"-\n" +
             b"--" + BOUNDARY.encode() + b"\t!\r\n" + b"\r\n--" + BOUNDARY.encode() + b"\r")


def _bytes_program_body(nl=b"\r\n", preamble=b"", epilogue=b"\r\n", data=LOOKALIKE, program_headers=None,
                        blob_headers=None, boundary=BOUNDARY, padding=b""):
    program = json.dumps(prog(up_blob("b", "bytes", data), ret("out", "b"))).encode()
    program_headers = program_headers or ['Content-Disposition: form-data; name="program"',
                                          "Content-Type: application/json"]
    blob_headers = blob_headers or [f'Content-Disposition: form-data; name="blob:{sha256(data)}"',
                                    "Content-Type: application/octet-stream"]
    parts = [nl.join(h.encode() for h in program_headers) + nl + nl + program,
             nl.join(h.encode() for h in blob_headers) + nl + nl + data]
    delimiter = b"--" + boundary.encode()
    body = preamble + b"".join(delimiter + padding + nl + p + nl for p in parts) + delimiter + b"--" + epilogue
    return body, data


ACCEPTED_ENVELOPES = [
    ("lookalike-boundary-in-payload", {}, CT),
    ("lf-only", {"nl": b"\n"}, CT),
    ("preamble-and-epilogue", {"preamble": b"ignored preamble\r\n--not-it\r\n", "epilogue": b"\r\nignored epilogue"},
     CT),
    ("closing-delimiter-at-end-of-body", {"epilogue": b""}, CT),
    ("transport-padding", {"padding": b" \t "}, CT),
    ("payload-with-trailing-newlines", {"data": b"line\r\n\r\n"}, CT),
    ("empty-blob", {"data": b""}, CT),
    ("ct-uppercase", {}, f"MULTIPART/FORM-DATA; BOUNDARY={BOUNDARY}"),
    ("ct-quoted-boundary", {}, f'multipart/form-data; boundary="{BOUNDARY}"'),
    ("ct-extra-params", {}, f"multipart/form-data; charset=utf-8; boundary={BOUNDARY}; x=y"),
    ("boundary-with-spaces-quoted", {"boundary": "a b c"}, 'multipart/form-data; boundary="a b c"'),
    ("part-headers-case-and-params",
     {"program_headers": ["content-disposition: FORM-DATA; name=program; filename=\"p.json\"",
                          "CONTENT-TYPE: Application/JSON; charset=utf-8", "Content-Transfer-Encoding: 8bit",
                          "X-Other: ignored"]}, CT),
    ("blob-cte-binary", {"blob_headers": None}, CT),
]


@pytest.mark.parametrize("kwargs,content_type", [c[1:] for c in ACCEPTED_ENVELOPES],
                         ids=[c[0] for c in ACCEPTED_ENVELOPES])
def test_envelope_accepted(server, kwargs, content_type):
    kwargs = dict(kwargs)
    if "data" not in kwargs:
        kwargs["data"] = LOOKALIKE + b"|" + os.urandom(8) + b"|end"  # never ends in CR (LF-only framing)
    if kwargs.get("blob_headers", 1) is None:
        kwargs["blob_headers"] = [f'Content-Disposition: form-data; name="blob:{sha256(kwargs["data"])}"',
                                  "Content-Type: application/octet-stream", "Content-Transfer-Encoding: BINARY"]
    body, data = _bytes_program_body(**kwargs)
    status, _, result = post_raw(server.url, body, content_type)
    assert status == 200, result
    assert assert_completed(result) == {"out": {"type": "bytes", "part": "return:0", "sha256": sha256(data)}}
    assert result["_parts"] == {"return:0": data}


def test_header_parameters_unquoted_and_extra_headers_in_request(server):
    """`X-KCoral-Node` and other request headers are ignored (docs/protocol.md §4.1)."""
    status, _, body = post(server.url, simple_program("def f():\n    return 3\n"),
                           headers={"X-KCoral-Node": "node-7", "X-Anything": "1"})
    assert status == 200 and assert_completed(body)["out"]["value"] == 3


# --- docs/protocol.md §5.1 strict JSON -----------------------------------------------------------------

VALID_PROGRAM_TEXT = ('{"instructions":[{"op":"upload","id":"m","kind":"module","source":"def f(*a):\\n    return a\\n"},'
                      '{"op":"get_function","id":"g","module":{"$ref":"m"},"name":"f"},'
                      '{"op":"run","id":"r","fn":{"$ref":"g"},"args":[ARGS]},'
                      '{"op":"return","key":"k","value":{"$ref":"r"}}]OPTIONS}')


def program_text(args="", options=""):
    return VALID_PROGRAM_TEXT.replace("ARGS", args).replace("OPTIONS", options).encode()


STRICT_JSON_CASES = [
    ("bom", b"\xef\xbb\xbf" + program_text(), []),
    ("invalid-utf8", program_text('"X"').replace(b'"X"', b'"\xff"'), ["utf-8"]),
    ("invalid-utf8-overlong", program_text('"X"').replace(b'"X"', b'"\xc0\xaf"'), ["utf-8"]),
    ("dup-key-top", program_text(options=',"options":{},"options":{}'), ["duplicate"]),
    ("dup-key-instruction", program_text().replace(b'"name":"f"', b'"name":"f","name":"f"'), ["duplicate"]),
    ("dup-key-options", program_text(options=',"options":{"timeout_seconds":5,"timeout_seconds":5}'),
     ["duplicate"]),
    ("dup-key-in-args-literal", program_text('{"a":1,"a":1}'), ["duplicate"]),
    ("dup-key-deep-in-args", program_text('[1,{"x":[{"y":{"z":1,"z":2}}]}]'), ["duplicate"]),
    ("dup-key-ref", program_text('{"$ref":"m","$ref":"m"}'), ["duplicate"]),
    ("nan-in-args", program_text("NaN"), []),
    ("infinity-in-args", program_text("Infinity"), []),
    ("minus-infinity-in-args", program_text("[-Infinity]"), []),
    ("nan-timeout", program_text(options=',"options":{"timeout_seconds":NaN}'), []),
    ("overflow-timeout", program_text(options=',"options":{"timeout_seconds":1e400}'), ["timeout_seconds"]),
    ("overflow-in-args", program_text("1e400"), []),
    ("overflow-deep-in-args", program_text('{"a":[-1e400]}'), []),
    ("trailing-garbage", program_text() + b" x", []),
    ("trailing-object", program_text() + b"{}", []),
    ("two-values", program_text() + b"\n" + program_text(), []),
    ("truncated", program_text()[:-1], []),
    ("empty", b"", []),
    ("whitespace-only", b"  \n", []),
    ("single-quotes", b"{'instructions': []}", []),
    ("trailing-comma", program_text("1,"), []),
    ("trailing-comma-object", program_text('{"a":1,}'), []),
]


@pytest.mark.parametrize("data,fragments", [c[1:] for c in STRICT_JSON_CASES], ids=[c[0] for c in STRICT_JSON_CASES])
def test_strict_json_rejected(front_end_server, data, fragments):
    assert_parse_error(post(front_end_server.url, data), *fragments)


def test_strict_json_accepts_whitespace_unicode_and_big_integers(server):
    big = "1" + "0" * 40
    data = (b" \r\n\t" + program_text(f'{big}, -{big}, "\\u00e9\\ud83d\\ude00", "café", 1E2, -0.0, 1e-300')
            + b"\n\t ")
    status, _, body = post(server.url, data)
    assert status == 200, body
    values = assert_completed(body)["k"]["value"]
    assert values[0] == {"type": "integer", "value": int(big)}
    assert values[1] == {"type": "integer", "value": -int(big)}
    assert values[2] == {"type": "string", "value": "é😀"}
    assert values[3] == {"type": "string", "value": "café"}
    assert values[4] == {"type": "number", "value": 100.0}
    assert values[5]["type"] == "number" and values[5]["value"] == 0.0
    assert values[6] == {"type": "number", "value": 1e-300}


# --- docs/protocol.md §5.2-5.3, 6 program validation -----------------------------------------------------

SRC = "def f(*a):\n    return list(a)\n"
M = up_module("m", SRC)
G = get_fn("g", "m", "f")
R = run("r", "g")


def upl(kind, **fields):
    return {"op": "upload", "id": "u", "kind": kind, **fields}


def file_up(path, ident="u"):
    return {"op": "upload", "id": ident, "kind": "file", "blob": H, "path": path}


def opts(**options):
    return {"instructions": [M], "options": options}


PROGRAM_CASES = [
    # docs/protocol.md §5.2 top level
    ("top-array", [M], ["object"]),
    ("top-string", "program", ["object"]),
    ("top-null", None, ["object"]),
    ("top-unknown-field", {"instructions": [M], "extra": 1}, ["extra"]),
    ("top-unknown-field-only", {"version": 1}, []),
    ("instructions-missing", {}, ["instructions"]),
    ("instructions-empty", {"instructions": []}, ["instructions"]),
    ("instructions-object", {"instructions": {"0": M}}, ["instructions"]),
    ("instructions-null", {"instructions": None}, ["instructions"]),
    ("options-null", {"instructions": [M], "options": None}, ["options"]),
    ("options-array", {"instructions": [M], "options": []}, ["options"]),
    ("options-string", {"instructions": [M], "options": "x"}, ["options"]),
    # docs/protocol.md §5.3 options
    ("option-unknown", opts(retries=1), ["retries"]),
    ("option-unknown-beside-known", opts(timeout_seconds=5, cpu=1), ["cpu"]),
    ("timeout-bool", opts(timeout_seconds=True), ["timeout_seconds"]),
    ("timeout-string", opts(timeout_seconds="5"), ["timeout_seconds"]),
    ("timeout-zero", opts(timeout_seconds=0), ["timeout_seconds"]),
    ("timeout-zero-float", opts(timeout_seconds=0.0), ["timeout_seconds"]),
    ("timeout-negative", opts(timeout_seconds=-1), ["timeout_seconds"]),
    ("timeout-null", opts(timeout_seconds=None), ["timeout_seconds"]),
    ("timeout-array", opts(timeout_seconds=[5]), ["timeout_seconds"]),
    ("output-limit-negative", opts(output_limit_bytes=-1), ["output_limit_bytes"]),
    ("output-limit-float", opts(output_limit_bytes=1.0), ["output_limit_bytes"]),
    ("output-limit-exponent", opts(output_limit_bytes=1e3), ["output_limit_bytes"]),
    ("output-limit-bool", opts(output_limit_bytes=True), ["output_limit_bytes"]),
    ("output-limit-string", opts(output_limit_bytes="10"), ["output_limit_bytes"]),
    ("output-limit-null", opts(output_limit_bytes=None), ["output_limit_bytes"]),
    ("gpu-count-zero", opts(gpu_count=0), ["gpu_count"]),
    ("gpu-count-nine", opts(gpu_count=9), ["gpu_count"]),
    ("gpu-count-negative", opts(gpu_count=-1), ["gpu_count"]),
    ("gpu-count-bool", opts(gpu_count=True), ["gpu_count"]),
    ("gpu-count-float", opts(gpu_count=1.0), ["gpu_count"]),
    ("gpu-count-string", opts(gpu_count="1"), ["gpu_count"]),
    ("gpu-count-on-cpu-server", opts(gpu_count=1), ["gpu_count"]),  # docs/protocol.md §5.3: after blob resolution
    ("gpu-count-8-on-cpu-server", opts(gpu_count=8), ["gpu_count"]),
    # docs/protocol.md §6.1 common rules
    ("instruction-number", prog(5), ["instruction 0", "object"]),
    ("instruction-null", prog(M, None), ["instruction 1", "object"]),
    ("instruction-array", prog([M]), ["instruction 0", "object"]),
    ("op-missing", prog({"id": "m", "kind": "module", "source": ""}), ["instruction 0", "op"]),
    ("op-unknown", prog({"op": "delete", "id": "m"}), ["instruction 0", "delete"]),
    ("op-wrong-case", prog({"op": "Upload", "id": "m", "kind": "module", "source": ""}), ["instruction 0"]),
    ("op-not-string", prog({"op": 1, "id": "m"}), ["instruction 0"]),
    ("id-missing", prog({"op": "upload", "kind": "module", "source": ""}), ["instruction 0", "id"]),
    ("id-empty", prog({"op": "upload", "id": "", "kind": "module", "source": ""}), ["instruction 0", "id"]),
    ("id-number", prog({"op": "upload", "id": 5, "kind": "module", "source": ""}), ["instruction 0", "id"]),
    ("id-null", prog({"op": "upload", "id": None, "kind": "module", "source": ""}), ["instruction 0", "id"]),
    ("id-duplicate", prog(M, up_module("m", "")), ["instruction 1", "duplicate", "'m'"]),
    ("id-duplicate-across-ops", prog(M, get_fn("m", "m", "f")), ["instruction 1", "duplicate"]),
    ("id-checked-before-kind", prog(M, {"op": "upload", "id": "m", "kind": "bogus"}),
     ["instruction 1", "duplicate"]),
    ("id-missing-before-kind", prog({"op": "upload", "kind": "bogus"}), ["instruction 0", "id"]),
    ("id-checked-before-fields", prog(M, {"op": "run", "id": "m", "fn": "g", "extra": 1}),
     ["instruction 1", "duplicate"]),
    ("first-invalid-instruction-wins", prog(M, {"op": "upload", "id": "a", "kind": "bogus"}, 5),
     ["instruction 1", "bogus"]),
    ("return-with-id", prog(M, {"op": "return", "id": "x", "key": "k", "value": ref("m")}),
     ["instruction 1", "id"]),
    # docs/protocol.md §6.3 upload
    ("upload-kind-missing", prog({"op": "upload", "id": "u", "source": ""}), ["instruction 0", "kind"]),
    ("upload-kind-unknown", prog(upl("folder", path="x")), ["instruction 0", "folder"]),
    ("upload-kind-null", prog(upl(None, source="")), ["instruction 0", "kind"]),
    ("module-source-missing", prog(upl("module")), ["instruction 0", "source"]),
    ("module-source-number", prog(upl("module", source=1)), ["instruction 0", "source"]),
    ("module-source-null", prog(upl("module", source=None)), ["instruction 0", "source"]),
    ("module-extra-field", prog(upl("module", source="", blob=H)), ["instruction 0", "blob"]),
    ("bytes-blob-missing", prog(upl("bytes")), ["instruction 0", "blob"]),
    ("bytes-blob-uppercase", prog(upl("bytes", blob="A" * 64)), ["instruction 0", "blob"]),
    ("bytes-blob-short", prog(upl("bytes", blob="a" * 63)), ["instruction 0", "blob"]),
    ("bytes-blob-long", prog(upl("bytes", blob="a" * 65)), ["instruction 0", "blob"]),
    ("bytes-blob-not-hex", prog(upl("bytes", blob="g" * 64)), ["instruction 0", "blob"]),
    ("bytes-blob-number", prog(upl("bytes", blob=1)), ["instruction 0", "blob"]),
    ("bytes-extra-dtype", prog(upl("bytes", blob=H, dtype="uint8")), ["instruction 0", "dtype"]),
    ("bytes-extra-path", prog(upl("bytes", blob=H, path="x")), ["instruction 0", "path"]),
    ("library-extra-source", prog(upl("library", blob=H, source="")), ["instruction 0", "source"]),
    ("library-blob-missing", prog(upl("library")), ["instruction 0", "blob"]),
    ("tensor-dtype-missing", prog(upl("tensor", blob=H, shape=[1])), ["instruction 0", "dtype"]),
    ("tensor-shape-missing", prog(upl("tensor", blob=H, dtype="uint8")), ["instruction 0", "shape"]),
    ("tensor-blob-missing", prog(upl("tensor", dtype="uint8", shape=[1])), ["instruction 0", "blob"]),
    ("tensor-extra-field", prog(upl("tensor", blob=H, dtype="uint8", shape=[1], device="cuda")),
     ["instruction 0", "device"]),
    *[(f"tensor-dtype-{d}", prog(upl("tensor", blob=H, dtype=d, shape=[1])), ["instruction 0", "dtype"])
      for d in ("complex64", "uint16", "float128", "Float32", "torch.float32", "float8_e4m3fnuz", "")],
    ("tensor-dtype-number", prog(upl("tensor", blob=H, dtype=4, shape=[1])), ["instruction 0", "dtype"]),
    *[(f"tensor-shape-{name}", prog(upl("tensor", blob=H, dtype="uint8", shape=shape)), ["instruction 0", "shape"])
      for name, shape in (("negative", [2, -1]), ("bool", [True]), ("float", [1.0]), ("string", "2"),
                          ("null", None), ("nested", [[1]]), ("object", {"0": 1}), ("number", 4),
                          ("string-dim", ["2"]))],
    ("file-path-missing", prog(upl("file", blob=H)), ["instruction 0", "path"]),
    ("file-blob-missing", prog(upl("file", path="x")), ["instruction 0", "blob"]),
    ("file-extra-field", prog(upl("file", blob=H, path="x", mode=384)), ["instruction 0", "mode"]),
    # docs/protocol.md §6.7 paths
    *[(f"file-path-{name}", prog(file_up(path)), ["instruction 0", "path"]) for name, path in (
        ("empty", ""), ("nul", "a\0b"), ("backslash", "a\\b"), ("absolute", "/abs"), ("double-slash-start", "//x"),
        ("dotdot", "../x"), ("inner-dotdot", "a/../b"), ("only-dotdot", ".."), ("trailing-dotdot", "a/.."),
        ("dot", "."), ("dot-slash", "./"), ("dots-and-slashes", "././/."),
        ("component-256", "x" * 256), ("component-256-bytes-utf8", "é" * 128),
        ("total-over-4096", "/".join(["y" * 255] * 17)), ("number", 5), ("null", None),
        ("array", ["a"]), ("ref-not-allowed-for-upload", {"$ref": "m"}))],
    # docs/protocol.md §6.8 conflicts
    ("file-duplicate-path", prog(file_up("a/b", "u1"), file_up("./a//b", "u2")),
     ["instruction 1", "duplicate"]),
    ("file-duplicate-path-later", prog(M, file_up("x/y", "u1"), file_up("q", "u2"), file_up("x/./y/", "u3")),
     ["instruction 3", "duplicate"]),
    ("file-prefix-conflict", prog(file_up("a", "u1"), file_up("a/b", "u2")), ["instruction 1", "conflicting"]),
    ("file-prefix-conflict-reversed", prog(file_up("a/b", "u1"), file_up("a", "u2")),
     ["instruction 1", "conflicting"]),
    ("file-prefix-conflict-deep", prog(file_up("a", "u1"), file_up("a/b/c", "u2")),
     ["instruction 1", "conflicting"]),
    # docs/protocol.md §6.4 get_function
    ("getfn-module-missing", prog(M, {"op": "get_function", "id": "g", "name": "f"}), ["instruction 1", "module"]),
    ("getfn-name-missing", prog(M, {"op": "get_function", "id": "g", "module": ref("m")}),
     ["instruction 1", "name"]),
    ("getfn-module-bare-string", prog(M, {**G, "module": "m"}), ["instruction 1", "module"]),
    ("getfn-module-extra-key", prog(M, {**G, "module": {"$ref": "m", "x": 1}}), ["instruction 1", "module"]),
    ("getfn-module-empty-ref", prog(M, {**G, "module": {"$ref": ""}}), ["instruction 1", "module"]),
    ("getfn-module-ref-number", prog(M, {**G, "module": {"$ref": 1}}), ["instruction 1", "module"]),
    ("getfn-module-unknown", prog(M, {**G, "module": ref("nope")}), ["instruction 1", "module", "nope"]),
    ("getfn-module-forward", prog(G, M), ["instruction 0", "module"]),
    ("getfn-module-self", prog(M, {**G, "module": ref("g")}), ["instruction 1", "module"]),
    ("getfn-module-is-return-key", prog(M, ret("k", "m"), {**G, "module": ref("k")}), ["instruction 2", "module"]),
    ("getfn-name-empty", prog(M, {**G, "name": ""}), ["instruction 1", "name"]),
    ("getfn-name-number", prog(M, {**G, "name": 1}), ["instruction 1", "name"]),
    ("getfn-cpu-only-string", prog(M, {**G, "cpu_only": "yes"}), ["instruction 1", "cpu_only"]),
    ("getfn-cpu-only-number", prog(M, {**G, "cpu_only": 1}), ["instruction 1", "cpu_only"]),
    ("getfn-cpu-only-null", prog(M, {**G, "cpu_only": None}), ["instruction 1", "cpu_only"]),
    ("getfn-extra-field", prog(M, {**G, "args": []}), ["instruction 1", "args"]),
    # docs/protocol.md §6.5 run
    ("run-fn-missing", prog(M, G, {"op": "run", "id": "r", "args": []}), ["instruction 2", "fn"]),
    ("run-fn-bare-string", prog(M, G, {**R, "fn": "g"}), ["instruction 2", "fn"]),
    ("run-fn-unknown", prog(M, G, {**R, "fn": ref("h")}), ["instruction 2", "fn"]),
    ("run-fn-self", prog(M, G, {**R, "fn": ref("r")}), ["instruction 2", "fn"]),
    ("run-fn-extra-key", prog(M, G, {**R, "fn": {"$ref": "g", "x": 1}}), ["instruction 2", "fn"]),
    ("run-args-null", prog(M, G, {**R, "args": None}), ["instruction 2", "args"]),
    ("run-args-object", prog(M, G, {**R, "args": {}}), ["instruction 2", "args"]),
    ("run-args-string", prog(M, G, {**R, "args": "x"}), ["instruction 2", "args"]),
    ("run-args-unknown-ref", prog(M, G, {**R, "args": [ref("nope")]}), ["instruction 2", "args[0]"]),
    ("run-args-forward-ref", prog(M, G, {**R, "args": [1, ref("later")]}, up_module("later", "")),
     ["instruction 2", "args[1]"]),
    ("run-args-self-ref", prog(M, G, {**R, "args": [ref("r")]}), ["instruction 2", "args[0]"]),
    ("run-extra-field", prog(M, G, {**R, "kwargs": {}}), ["instruction 2", "kwargs"]),
    # docs/protocol.md §6.6 return
    ("return-key-missing", prog(M, {"op": "return", "value": ref("m")}), ["instruction 1", "key"]),
    ("return-value-missing", prog(M, {"op": "return", "key": "k"}), ["instruction 1", "value"]),
    ("return-key-empty", prog(M, ret("", "m")), ["instruction 1", "key"]),
    ("return-key-number", prog(M, {"op": "return", "key": 1, "value": ref("m")}), ["instruction 1", "key"]),
    ("return-key-duplicate", prog(M, ret("k", "m"), ret("k", "m")), ["instruction 2", "duplicate"]),
    ("return-key-duplicate-file", prog(M, ret("k", "m"), ret_path("k", "file", "x")),
     ["instruction 2", "duplicate"]),
    ("return-value-bare-string", prog(M, {"op": "return", "key": "k", "value": "m"}), ["instruction 1", "value"]),
    ("return-value-empty-ref", prog(M, {"op": "return", "key": "k", "value": {"$ref": ""}}),
     ["instruction 1", "value"]),
    ("return-value-literal", prog(M, {"op": "return", "key": "k", "value": 5}), ["instruction 1", "value"]),
    ("return-value-unknown", prog(M, ret("k", "nope")), ["instruction 1", "value"]),
    ("return-value-forward", prog(ret("k", "m"), M), ["instruction 0", "value"]),
    ("return-kind-unknown", prog(M, ret_path("k", "dir", "x")), ["instruction 1", "kind"]),
    ("return-kind-null", prog(M, ret_path("k", None, "x")), ["instruction 1", "kind"]),
    ("return-file-path-missing", prog(M, {"op": "return", "key": "k", "kind": "file"}), ["instruction 1", "path"]),
    ("return-file-with-value", prog(M, {**ret_path("k", "file", "x"), "value": ref("m")}),
     ["instruction 1", "value"]),
    ("return-value-with-path", prog(M, {**ret("k", "m"), "path": "x"}), ["instruction 1", "path"]),
    *[(f"return-{kind}-path-{name}", prog(M, ret_path("k", kind, path)), ["instruction 1", "path"])
      for kind in ("file", "folder") for name, path in (
          ("dot", "."), ("empty", ""), ("dotdot", "../x"), ("absolute", "/etc/passwd"), ("backslash", "a\\b"),
          ("number", 3), ("unknown-ref", {"$ref": "nope"}), ("ref-extra-key", {"$ref": "m", "x": 1}),
          ("empty-ref", {"$ref": ""}))],
]


@pytest.mark.parametrize("program,fragments", [c[1:] for c in PROGRAM_CASES], ids=[c[0] for c in PROGRAM_CASES])
def test_program_rejected(front_end_server, program, fragments):
    assert_parse_error(post(front_end_server.url, json.dumps(program).encode()), *fragments)


def test_invalid_blob_hash_is_reported_before_anything_runs(front_end_server):
    """A rejected program never starts: no instruction of it has side effects (nothing in results)."""
    marker = f"/tmp/kcoral-never-{uuid.uuid4().hex}"
    program = prog(up_module("m", f"open({marker!r}, 'w').close()\n"), upl("bytes", blob="Z" * 64))
    assert_parse_error(post(front_end_server.url, program), "instruction 1")
    assert not os.path.exists(marker)


VALID_PROGRAMS = [
    ("options-all-valid", {**call_program(SRC, "f", 1), "options": {"timeout_seconds": 0.5 + 59.5,
                                                                   "output_limit_bytes": 0}}),
    ("timeout-small", call_program(SRC, "f", options={"timeout_seconds": 0.5})),
    ("timeout-huge-clamped", call_program(SRC, "f", options={"timeout_seconds": 1000000})),
    ("timeout-integer", call_program(SRC, "f", options={"timeout_seconds": 30})),
    ("output-limit-huge-clamped", call_program(SRC, "f", options={"output_limit_bytes": 10 ** 12})),
    ("options-empty", call_program(SRC, "f", options={})),
    ("return-key-equals-id", prog(M, G, R, ret("r", "r"), ret("m2", "r"))),
    ("id-any-characters", prog(up_module("ü ñ/$ref", SRC), get_fn(" ", "ü ñ/$ref", "f"), run("{}", " "),
                               ret("{}", "{}"))),
    ("cpu-only-true-and-false", prog(M, {**G, "cpu_only": True}, get_fn("g2", "m", "f", cpu_only=False),
                                     run("r", "g"), run("r2", "g2"), ret("k", "r"))),
    ("args-omitted", prog(M, G, {"op": "run", "id": "r", "fn": ref("g")}, ret("k", "r"))),
    ("module-source-empty", prog(up_module("m", ""))),
    ("file-paths-siblings", prog(*[file_up(p, f"u{i}") for i, p in enumerate(["a/b", "a/c", "a-b", "ab"])])),
    ("return-path-equals-upload-path", prog(file_up("a/b"), ret_path("k", "file", "a/b"))),
    ("return-path-ref", prog(file_up("a/b"), ret_path("k", "file", ref("u")))),
]


@pytest.mark.parametrize("program", [c[1] for c in VALID_PROGRAMS], ids=[c[0] for c in VALID_PROGRAMS])
def test_program_accepted(server, program):
    """Valid programs are not rejected (blob-referencing ones get CACHE_MISS, not 400)."""
    status, _, body = post(server.url, program)
    assert status == 200, body
    if any(i.get("blob") for i in program["instructions"]):
        assert body["status"] == "CACHE_MISS"
    else:
        assert body["status"] == "COMPLETED", body


def test_reference_shaped_literals_in_args(server):
    """docs/protocol.md §6.2: only top-level exact references are resolved; everything else is a literal."""
    literals = [{"$ref": "m", "x": 1}, {"$ref": 1}, {"$ref": ""}, [{"$ref": "nope"}], {"a": {"$ref": "nope"}},
                [{"$ref": "m"}]]
    program = prog(M, G, up_module("other", "X = 5\n"), get_fn("x", "other", "X"),
                   run("r", "g", *literals, ref("x")), ret("k", "r"))
    body = execute_ok(server.url, program)
    value = assert_completed(body)["k"]["value"]
    decoded = [plain(v) for v in value]
    assert decoded == literals + [5]


def test_file_upload_handle_is_normalised_path(server):
    data = b"hello kcoral\n"
    program = prog(up_module("m", "def f(p):\n    return [p, open(p, 'rb').read().decode()]\n"),
                   up_blob("cfg", "file", data, path="./inputs//config.txt"), ret("path", "cfg"),
                   get_fn("g", "m", "f"), run("r", "g", ref("cfg")), ret("read", "r"))
    body = execute_ok(server.url, program, [data])
    results = assert_completed(body)
    assert results["path"] == {"type": "string", "value": "inputs/config.txt"}
    assert plain(results["read"]) == ["inputs/config.txt", "hello kcoral\n"]


def test_spec_worked_example(server):
    """docs/protocol.md §11 verbatim: first CACHE_MISS listing both blobs, then COMPLETED with two parts."""
    data, cfg = bytes([1, 2, 3, 4]), b"hello kcoral\n"
    source = ("import os\ndef scale(data, path, factor):\n    text = open(path).read()\n"
              "    print(\"read\", len(text), \"chars\")\n    os.makedirs(\"out\", exist_ok=True)\n"
              "    with open(\"out/report.txt\", \"w\") as f:\n        f.write(text.upper())\n"
              "    return {\"n\": len(data) * factor, \"head\": data[:2]}\n")
    unique = f"# {uuid.uuid4()}\n".encode()  # fresh blobs: the module server's caches are shared
    data, cfg = data + unique, cfg + unique
    program = prog(up_module("mod", source), up_blob("data", "bytes", data),
                   up_blob("cfg", "file", cfg, path="./inputs//config.txt"), get_fn("fn", "mod", "scale"),
                   run("out", "fn", ref("data"), ref("cfg"), 3), ret("summary", "out"),
                   ret_path("report", "file", "out/report.txt"), options={"timeout_seconds": 60})
    status, headers, body = post(server.url, program)
    assert status == 200 and headers["content-type"] == "application/json"
    assert body == {"status": "CACHE_MISS", "request_id": headers["x-request-id"],
                    "missing_blobs": [sha256(data), sha256(cfg)]}
    body = execute_ok(server.url, program, [data, cfg])
    results = assert_completed(body)
    assert body["stdout"] == f"read {len(cfg)} chars\n" and body["stderr"] == ""
    assert results["summary"] == {"type": "object", "value": {
        "n": {"type": "integer", "value": len(data) * 3},
        "head": {"type": "bytes", "part": "return:0", "sha256": sha256(data[:2])}}}
    report = cfg.decode().upper().encode()
    assert results["report"] == {"type": "file", "part": "return:1", "sha256": sha256(report), "size": len(report)}
    assert body["_parts"] == {"return:0": data[:2], "return:1": report}
    assert body["lease_wait_ms"] == 0.0 and body["lease_held_ms"] == 0.0
    assert isinstance(body["queue_ms"], float) and body["elapsed_ms"] > 0
    assert list(body["results"]) == ["summary", "report"]
    # third identical request: memory cache for bytes, disk cache for the file
    assert assert_completed(execute_ok(server.url, program))["report"]["sha256"] == sha256(report)


# --- docs/protocol.md §6.3, 4.7 step 8 tensor byte length ---------------------------------------------------

def test_tensor_byte_length_mismatch(front_end_server):
    data = os.urandom(12)
    program = prog(up_blob("t", "tensor", data, dtype="float32", shape=[2, 2]), ret("k", "t"))
    assert_parse_error(post(front_end_server.url, program, [data]), "'t'", "16", "12")


def test_tensor_byte_length_checked_even_when_other_blobs_are_missing(front_end_server):
    data, missing = os.urandom(3), os.urandom(5)
    program = prog(up_blob("b", "bytes", missing), up_blob("t", "tensor", data, dtype="int16", shape=[2]))
    assert_parse_error(post(front_end_server.url, program, [data]), "'t'", "4", "3")


def test_tensor_byte_length_checked_against_a_cached_blob(server):
    data = os.urandom(6)
    assert_completed(execute_ok(server.url, prog(up_blob("b", "bytes", data), ret("k", "b")), [data]))
    program = prog(up_blob("t", "tensor", data, dtype="int32", shape=[2]))
    assert_parse_error(post(server.url, program), "'t'", "8", "6")
    ok = prog(up_blob("t", "tensor", data, dtype="int16", shape=[3]), ret("k", "t"))
    assert assert_completed(execute_ok(server.url, ok))["k"]["shape"] == [3]


def test_tensor_byte_length_not_checked_while_missing(front_end_server):
    program = prog(up_blob("t", "tensor", os.urandom(7), dtype="float64", shape=[3]))
    status, _, body = post(front_end_server.url, program)
    assert status == 200 and body["status"] == "CACHE_MISS"


# --- docs/protocol.md §7 CACHE_MISS semantics --------------------------------------------------------------

def test_cache_miss_lists_blobs_in_first_reference_order_without_duplicates(front_end_server):
    b1, b2, b3, b4 = (os.urandom(16) for _ in range(4))
    program = prog(up_blob("x1", "bytes", b1), up_blob("x2", "file", b2, path="in/two"),
                   up_blob("x3", "tensor", b1, dtype="uint8", shape=[16]), up_blob("x4", "library", b3),
                   up_blob("x5", "file", b1, path="in/one"), up_blob("x6", "bytes", b4),
                   up_blob("x7", "bytes", b3))
    status, headers, body = post(front_end_server.url, program)
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert set(body) == {"status", "request_id", "missing_blobs"}
    assert body["status"] == "CACHE_MISS" and body["request_id"] == headers["x-request-id"]
    assert body["missing_blobs"] == [sha256(b1), sha256(b2), sha256(b3), sha256(b4)]
    assert UUID_RE.fullmatch(headers["x-kcoral-instance"])


def test_cache_miss_partial_supply_and_retry(server):
    b1, b2, b3 = (os.urandom(16) for _ in range(3))
    program = prog(up_blob("x1", "bytes", b1), up_blob("x2", "file", b2, path="f"), up_blob("x3", "bytes", b3),
                   ret("a", "x1"), ret_path("b", "file", "f"), ret("c", "x3"))
    status, _, body = post(server.url, program, [b2])
    assert body["status"] == "CACHE_MISS" and body["missing_blobs"] == [sha256(b1), sha256(b3)]
    status, _, body = post(server.url, program)  # b2 stayed cached although the request missed
    assert body["status"] == "CACHE_MISS" and body["missing_blobs"] == [sha256(b1), sha256(b3)]
    status, _, body = post(server.url, program, [b3])
    assert body["missing_blobs"] == [sha256(b1)]
    body = execute_ok(server.url, program, [b1])
    assert_completed(body)
    assert body["_parts"] == {"return:0": b1, "return:1": b2, "return:2": b3}


def test_supplied_blobs_cached_even_when_the_request_is_rejected(server):
    kept, bad = os.urandom(10), os.urandom(5)
    rejected = prog(up_blob("k", "bytes", kept), up_blob("t", "tensor", bad, dtype="int32", shape=[2]))
    assert_parse_error(post(server.url, rejected, [kept, bad]), "'t'")
    body = execute_ok(server.url, prog(up_blob("k", "bytes", kept), ret("k", "k")))
    assert_completed(body)
    assert body["_parts"] == {"return:0": kept}
    # docs/protocol.md §4.7 step 10: gpu_count is checked after resolution, so the blob is cached too
    kept2 = os.urandom(10)
    with_gpus = prog(up_blob("k", "bytes", kept2), ret("k", "k"), options={"gpu_count": 1})
    status, _, body = post(server.url, with_gpus)
    assert body["status"] == "CACHE_MISS"  # missing blob wins over gpu_count on a CPU server
    assert_parse_error(post(server.url, with_gpus, [kept2]), "gpu_count")
    body = execute_ok(server.url, prog(up_blob("k", "bytes", kept2), ret("k", "k")))
    assert body["_parts"] == {"return:0": kept2}


def test_unreferenced_blob_is_rejected_and_not_cached(front_end_server):
    stray = os.urandom(9)
    assert_parse_error(post(front_end_server.url, EMPTY_MODULE, [stray]), "unreferenced", sha256(stray))
    status, _, body = post(front_end_server.url, prog(up_blob("b", "bytes", stray)))
    assert body["status"] == "CACHE_MISS"


def test_file_only_blob_is_not_in_the_memory_cache(server):
    data = os.urandom(20)
    body = execute_ok(server.url, prog(up_blob("f", "file", data, path="x.bin"), ret_path("k", "file", "x.bin")),
                      [data])
    assert_completed(body)
    status, _, body = post(server.url, prog(up_blob("b", "bytes", data), ret("k", "b")))
    assert body["status"] == "CACHE_MISS" and body["missing_blobs"] == [sha256(data)]
    # still served from the disk cache to file uploads
    body = execute_ok(server.url, prog(up_blob("f", "file", data, path="y.bin"), ret_path("k", "file", "y.bin")))
    assert body["_parts"] == {"return:0": data}
    # a program using it both ways: the disk copy serves both (docs/protocol.md §7.1 lookup order)
    both = prog(up_blob("f", "file", data, path="z"), up_blob("b", "bytes", data), ret("k", "b"))
    body = execute_ok(server.url, both)
    assert body["_parts"] == {"return:0": data}


def test_memory_only_blob_is_not_in_the_disk_cache(server):
    data = os.urandom(20)
    assert_completed(execute_ok(server.url, prog(up_blob("b", "bytes", data), ret("k", "b")), [data]))
    status, _, body = post(server.url, prog(up_blob("f", "file", data, path="x")))
    assert body["status"] == "CACHE_MISS" and body["missing_blobs"] == [sha256(data)]


def test_blob_supplied_for_both_kinds_lands_in_both_caches(server):
    data = os.urandom(20)
    both = prog(up_blob("f", "file", data, path="z"), up_blob("b", "bytes", data), ret("k", "b"))
    assert_completed(execute_ok(server.url, both, [data]))
    assert_completed(execute_ok(server.url, prog(up_blob("b", "bytes", data), ret("k", "b"))))
    assert_completed(execute_ok(server.url, prog(up_blob("f", "file", data, path="q"))))


# --- docs/protocol.md §9.5 value encoding ---------------------------------------------------------------------

PRELUDE = """import collections, enum, math, types
import numpy
class F(float):
    pass
class S(str):
    pass
class I(int):
    pass
class E(enum.IntEnum):
    A = 7
class L(list):
    pass
class D(dict):
    pass
"""


def value_program(expr):
    return prog(up_module("m", PRELUDE + f"def f():\n    return {expr}\n"), get_fn("g", "m", "f"), run("r", "g"),
                ret("out", "r"))


ENCODING_CASES = [
    ("none", "None", {"type": "null"}),
    ("true", "True", {"type": "boolean", "value": True}),
    ("false", "False", {"type": "boolean", "value": False}),
    ("zero", "0", {"type": "integer", "value": 0}),
    ("big-int", "10**30", {"type": "integer", "value": 10 ** 30}),
    ("big-negative-int", "-(10**30) - 1", {"type": "integer", "value": -(10 ** 30) - 1}),
    ("int-subclass", "I(5)", {"type": "integer", "value": 5}),
    ("int-enum", "E.A", {"type": "integer", "value": 7}),
    ("float", "2.5", {"type": "number", "value": 2.5}),
    ("float-whole", "1.0", {"type": "number", "value": 1.0}),
    ("float-tiny", "2.5e-08", {"type": "number", "value": 2.5e-08}),
    ("float-negative-zero", "-0.0", {"type": "number", "value": -0.0}),
    ("float-subclass", "F(1.5)", {"type": "number", "value": 1.5}),
    ("numpy-float64", "numpy.float64(0.25)", {"type": "number", "value": 0.25}),
    ("string", "'hé\\u2603'", {"type": "string", "value": "hé☃"}),
    ("string-empty", "''", {"type": "string", "value": ""}),
    ("string-subclass", "S('x')", {"type": "string", "value": "x"}),
    ("list", "[1, 'a', None]", {"type": "array", "value": [{"type": "integer", "value": 1},
                                                           {"type": "string", "value": "a"}, {"type": "null"}]}),
    ("tuple", "(1, (True,))", {"type": "array", "value": [{"type": "integer", "value": 1},
                                                         {"type": "array", "value": [{"type": "boolean", "value": True}]}]}),
    ("list-subclass", "L([2])", {"type": "array", "value": [{"type": "integer", "value": 2}]}),
    ("empty-list", "[]", {"type": "array", "value": []}),
    ("dict-insertion-order", "{'z': 1, 'a': {'m': []}}",
     {"type": "object", "value": {"z": {"type": "integer", "value": 1},
                                  "a": {"type": "object", "value": {"m": {"type": "array", "value": []}}}}}),
    ("dict-subclass", "collections.OrderedDict([('b', 1.5)])", {"type": "object", "value": {"b": {"type": "number", "value": 1.5}}}),
    ("empty-dict", "{}", {"type": "object", "value": {}}),
    ("dict-key-looks-like-ref", "{'$ref': 'm'}", {"type": "object", "value": {"$ref": {"type": "string", "value": "m"}}}),
    # failures (docs/protocol.md §9.5 table): kind serialization, op return, id null
    ("nan", "float('nan')", "non-finite"),
    ("inf", "math.inf", "non-finite"),
    ("minus-inf", "-math.inf", "non-finite"),
    ("nan-nested", "[1, {'a': (2, float('nan'))}]", "non-finite"),
    ("numpy-float-nan", "numpy.float64('nan')", "non-finite"),
    ("dict-int-key", "{1: 'a'}", "string keys"),
    ("dict-tuple-key-nested", "[{'a': {('x',): 1}}]", "string keys"),
    ("dict-mixed-keys", "{'a': 1, None: 2}", "string keys"),
    ("set", "{1, 2}", "set"),
    ("frozenset", "frozenset()", "frozenset"),
    ("function", "f", "function"),
    ("lambda-in-list", "[lambda: 1]", "function"),
    ("object", "object()", "object"),
    ("module", "math", "module"),
    ("generator", "(i for i in [])", "generator"),
    ("complex", "1j", "complex"),
    ("namespace", "types.SimpleNamespace()", "SimpleNamespace"),
    ("type", "int", "type"),
    ("set-in-dict", "{'ok': 1, 'bad': {3}}", "set"),
]


@pytest.mark.parametrize("expr,expected", [c[1:] for c in ENCODING_CASES], ids=[c[0] for c in ENCODING_CASES])
def test_value_encoding(server, expr, expected):
    body = execute_ok(server.url, value_program(expr))
    if isinstance(expected, dict):
        results = assert_completed(body)
        assert results == {"out": expected}
        assert "_parts" not in body  # no binary value: a plain JSON answer
    else:
        assert_failed(body, "serialization", 3, "return", None, expected)
        assert body["results"] == {}


def test_json_response_is_compact_utf8_without_escapes(server):
    body, content_type = multipart(program_parts(value_program("'é☃'")))
    status, headers, data = request("POST", server.url + "/execute", body, {"Content-Type": content_type})
    assert status == 200 and headers["content-type"] == "application/json"
    assert "é☃".encode() in data and b"\\u" not in data
    assert b'": ' not in data and b'", "' not in data


def test_module_namespace_cannot_be_returned(server):
    body = execute_ok(server.url, prog(up_module("m", "X = 1\n"), ret("ns", "m")))
    assert_failed(body, "serialization", 1, "return", None)


def test_binary_values_and_depth_first_part_numbering(server):
    """docs/protocol.md §9.4: one part per binary value, even empty or identical ones, numbered depth-first."""
    source = ("def f():\n    return {'z': [b'1', {'x': bytearray(b'2'), 'e': b''}], 'a': memoryview(b'33'),\n"
              "            'same': [b'1', b'1']}\n"
              "def g():\n    return b''\n")
    program = prog(up_module("m", source), get_fn("f", "m", "f"), get_fn("g", "m", "g"), run("rf", "f"),
                   run("rg", "g"), ret("first", "rf"), ret("empty", "rg"), ret("again", "rf"))
    body = execute_ok(server.url, program)
    results = assert_completed(body)
    assert list(results) == ["first", "empty", "again"]

    def b(n, data):
        return {"type": "bytes", "part": f"return:{n}", "sha256": sha256(data)}

    def first(o):
        return {"type": "object", "value": {
            "z": {"type": "array", "value": [b(o, b"1"), {"type": "object", "value": {"x": b(o + 1, b"2"),
                                                                                      "e": b(o + 2, b"")}}]},
            "a": b(o + 3, b"33"),
            "same": {"type": "array", "value": [b(o + 4, b"1"), b(o + 5, b"1")]}}}

    assert results == {"first": first(0), "empty": b(6, b""), "again": first(7)}
    payloads = [b"1", b"2", b"", b"33", b"1", b"1"]
    assert body["_parts"] == {f"return:{i}": p for i, p in enumerate(payloads + [b""] + payloads)}


def test_multipart_response_framing(server):
    """docs/protocol.md §9.3: result part first, then return:N in order, CRLF everywhere, closing delimiter."""
    data = b"\r\n--kcoral-" + os.urandom(64) + b"\r\n"
    program = prog(up_blob("b", "bytes", data), ret("k", "b"))
    body, content_type = multipart(program_parts(program, [data]))
    status, headers, raw = request("POST", server.url + "/execute", body, {"Content-Type": content_type})
    assert status == 200
    media, _, param = headers["content-type"].partition(";")
    assert media == "multipart/form-data"
    boundary = param.strip().removeprefix("boundary=")
    assert re.fullmatch(r"kcoral-[0-9a-f]{32}", boundary)
    assert raw.startswith(f'--{boundary}\r\nContent-Disposition: form-data; name="result"\r\n'
                          f"Content-Type: application/json\r\n\r\n".encode())
    assert raw.endswith(f"\r\n--{boundary}--\r\n".encode())
    assert (f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="return:0"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + f"\r\n--{boundary}--".encode()) in raw
    assert int(headers["content-length"]) == len(raw)


# --- docs/protocol.md §9.6, 8.6 file and folder returns ------------------------------------------------------

FOLDER_SOURCE = """import os
def make():
    os.makedirs('out/.hid')
    os.makedirs('out/sub/empty')
    for path, data in (('out/.hid/x', b'1'), ('out/.hidden', b'2'), ('out/b.txt', b'4'), ('out/a.txt', b'3'),
                       ('out/sub/z.bin', b'567')):
        with open(path, 'wb') as f:
            f.write(data)
    return 'out'
"""


def test_folder_return_manifest_order_hidden_and_empty_dirs(server):
    program = prog(up_module("m", FOLDER_SOURCE), get_fn("g", "m", "make"), run("r", "g"),
                   ret("before", "r"), ret_path("tree", "folder", "out"), ret_path("via_ref", "folder", ref("r")),
                   ret_path("one", "file", "./out//sub/z.bin"))
    body = execute_ok(server.url, program)
    results = assert_completed(body)

    def f(n, data):
        return {"type": "file", "part": f"return:{n}", "sha256": sha256(data), "size": len(data)}

    def tree(o):
        return {"type": "folder",
                "files": {".hid/x": f(o, b"1"), ".hidden": f(o + 1, b"2"), "a.txt": f(o + 2, b"3"),
                          "b.txt": f(o + 3, b"4"), "sub/z.bin": f(o + 4, b"567")},
                "directories": [".hid", "sub", "sub/empty"]}

    assert results["tree"] == tree(0)
    assert list(results["tree"]["files"]) == [".hid/x", ".hidden", "a.txt", "b.txt", "sub/z.bin"]
    assert results["via_ref"] == tree(5)
    assert results["one"] == f(10, b"567")
    assert body["_parts"]["return:4"] == b"567" and body["_parts"]["return:10"] == b"567"
    assert len(body["_parts"]) == 11


def test_empty_folder_and_empty_file(server):
    source = "import os\ndef f():\n    os.mkdir('e')\n    open('e0', 'w').close()\n"
    program = prog(up_module("m", source), get_fn("g", "m", "f"), run("r", "g"), ret_path("dir", "folder", "e"),
                   ret_path("file", "file", "e0"))
    body = execute_ok(server.url, program)
    assert assert_completed(body) == {"dir": {"type": "folder", "files": {}, "directories": []},
                                      "file": {"type": "file", "part": "return:0", "sha256": sha256(b""), "size": 0}}
    assert body["_parts"] == {"return:0": b""}


def test_returned_file_is_snapshot_at_that_moment(server):
    source = ("def w(data):\n    open('f', 'w').write(data)\n"
              "def mutate(x):\n    x.append(2)\n")
    program = prog(up_module("m", source), get_fn("w", "m", "w"), get_fn("mu", "m", "mutate"),
                   up_module("vals", "L = [1]\n"), get_fn("l", "vals", "L"),
                   run("a", "w", "one"), ret_path("first", "file", "f"), ret("list_before", "l"),
                   run("b", "w", "second"), run("c", "mu", ref("l")),
                   ret_path("second", "file", "f"), ret("list_after", "l"))
    body = execute_ok(server.url, program)
    results = assert_completed(body)
    assert body["_parts"] == {"return:0": b"one", "return:1": b"second"}
    assert plain(results["list_before"]) == [1] and plain(results["list_after"]) == [1, 2]


RETURN_FAILURES = [
    ("missing-file", "", ret_path("k", "file", "nope.txt")),
    ("missing-folder", "", ret_path("k", "folder", "nope")),
    ("missing-parent", "", ret_path("k", "file", "no/such/file")),
    ("directory-as-file", "os.mkdir('d')", ret_path("k", "file", "d")),
    ("file-as-folder", "open('f', 'w').close()", ret_path("k", "folder", "f")),
    ("symlink-file", "open('f', 'w').close(); os.symlink('f', 'l')", ret_path("k", "file", "l")),
    ("symlink-to-outside", "os.symlink('/etc/hostname', 'l')", ret_path("k", "file", "l")),
    ("symlink-dir-component", "os.mkdir('d'); open('d/f', 'w').close(); os.symlink('d', 'l')",
     ret_path("k", "file", "l/f")),
    ("symlink-folder", "os.mkdir('d'); os.symlink('d', 'l')", ret_path("k", "folder", "l")),
    ("symlink-inside-folder", "os.mkdir('d'); open('d/f', 'w').close(); os.symlink('f', 'd/l')",
     ret_path("k", "folder", "d")),
    ("dangling-symlink-inside-folder", "os.makedirs('d/s'); os.symlink('nowhere', 'd/s/l')",
     ret_path("k", "folder", "d")),
    ("fifo-file", "os.mkfifo('p')", ret_path("k", "file", "p")),
    ("fifo-inside-folder", "os.makedirs('d/s'); os.mkfifo('d/s/p')", ret_path("k", "folder", "d")),
    ("socket-inside-folder", "os.mkdir('d'); s = socket.socket(socket.AF_UNIX); s.bind('d/sock')",
     ret_path("k", "folder", "d")),
    ("path-ref-not-string", "", ret_path("k", "file", ref("r"))),
    ("path-ref-invalid-path", "return '../etc/passwd'", ret_path("k", "file", ref("r"))),
    ("path-ref-absolute", "return '/etc/hostname'", ret_path("k", "file", ref("r"))),
    ("path-ref-dot", "return '.'", ret_path("k", "folder", ref("r"))),
]


@pytest.mark.parametrize("setup,instruction", [c[1:] for c in RETURN_FAILURES], ids=[c[0] for c in RETURN_FAILURES])
def test_file_and_folder_return_failures(server, setup, instruction):
    body_lines = "".join(f"    {line}\n" for line in setup.split("; ") if line) or "    pass\n"
    source = f"import os, socket\ndef f():\n{body_lines}"
    program = prog(up_module("m", source), get_fn("g", "m", "f"), run("r", "g"), instruction)
    body = execute_ok(server.url, program)
    assert_failed(body, "serialization", 3, "return", None)
    assert body["results"] == {}


def test_failing_return_adds_nothing_and_numbering_stays_contiguous(server):
    source = "def f():\n    return [b'withdrawn', b'also', {1, 2}]\n"
    program = prog(up_module("m", source), get_fn("g", "m", "f"), run("r", "g"),
                   up_blob("b", "bytes", b"early"), ret("early", "b"), ret("bad", "r"), ret("never", "b"))
    body = execute_ok(server.url, program, [b"early"])
    assert_failed(body, "serialization", 5, "return", None, "set")
    assert body["results"] == {"early": {"type": "bytes", "part": "return:0", "sha256": sha256(b"early")}}
    assert body["_parts"] == {"return:0": b"early"}
    # with no surviving binary value the answer is plain JSON
    program = prog(up_module("m", source), get_fn("g", "m", "f"), run("r", "g"), ret("bad", "r"))
    status, headers, body = post(server.url, program)
    assert headers["content-type"] == "application/json"
    assert_failed(body, "serialization", 3, "return", None)


def test_failing_folder_return_withdraws_its_files(server):
    source = "import os\ndef f():\n    os.makedirs('d/z')\n    open('d/a', 'w').write('a')\n    os.mkfifo('d/z/p')\n"
    program = prog(up_module("m", source), get_fn("g", "m", "f"), run("r", "g"), up_blob("b", "bytes", b"e2"),
                   ret("early", "b"), ret_path("bad", "folder", "d"))
    body = execute_ok(server.url, program, [b"e2"])
    assert_failed(body, "serialization", 5, "return", None)
    assert body["_parts"] == {"return:0": b"e2"} and list(body["results"]) == ["early"]


def test_early_returns_survive_a_later_failure(server):
    source = "def ok():\n    return {'x': b'kept'}\ndef bad():\n    raise ValueError('late')\n"
    program = prog(up_module("m", source), get_fn("ok", "m", "ok"), get_fn("bad", "m", "bad"), run("r1", "ok"),
                   ret("early", "r1"), run("r2", "bad"), ret("late", "r2"))
    body = execute_ok(server.url, program)
    assert_failed(body, "engine", 5, "run", "r2", "ValueError: late")
    assert body["results"] == {"early": {"type": "object", "value": {
        "x": {"type": "bytes", "part": "return:0", "sha256": sha256(b"kept")}}}}
    assert body["_parts"] == {"return:0": b"kept"}


# --- file materialisation (docs/protocol.md §8.3) -------------------------------------------------------------

def test_file_upload_modes_and_directory_reuse(server):
    data = os.urandom(33)
    source = ("import os, stat\ndef prep():\n    os.makedirs('shared', exist_ok=True)\n"
              "def modes(path):\n    return [stat.S_IMODE(os.stat(path).st_mode), stat.S_IMODE(os.stat('in').st_mode),\n"
              "            stat.S_IMODE(os.stat('in/deep').st_mode), sorted(os.listdir('.'))]\n")
    program = prog(up_module("m", source), get_fn("prep", "m", "prep"), run("p", "prep"),
                   up_blob("f1", "file", data, path="shared/x.bin"), up_blob("f2", "file", data, path="in/deep/y"),
                   get_fn("modes", "m", "modes"), run("r", "modes", ref("f2")), ret("modes", "r"),
                   ret_path("x", "file", ref("f1")))
    body = execute_ok(server.url, program, [data])
    results = assert_completed(body)
    assert plain(results["modes"]) == [0o600, 0o700, 0o700, ["in", "shared"]]
    assert body["_parts"] == {"return:0": data}


def test_file_upload_materialised_at_its_position(server):
    data = b"late file"
    source = "import os\ndef exists():\n    return os.path.exists('late.txt')\n"
    program = prog(up_module("m", source), get_fn("e", "m", "exists"), run("before", "e"),
                   up_blob("f", "file", data, path="late.txt"), run("after", "e"), ret("before", "before"),
                   ret("after", "after"))
    results = assert_completed(execute_ok(server.url, program, [data]))
    assert results == {"before": {"type": "boolean", "value": False}, "after": {"type": "boolean", "value": True}}


def test_file_uploads_after_code_moved_their_directory_land_at_their_path(server):
    """The worker keeps the directories of consecutive file uploads open; code that runs between
    two uploads may move them, and the later upload still lands at its own path."""
    first, second = b"first file", b"second file"
    source = ("import os\ndef move():\n    os.rename('in', 'moved')\n"
              "def tree():\n    return sorted(os.path.join(d, f) for d, _, fs in os.walk('.') for f in fs)\n")
    program = prog(up_module("m", source), up_blob("a", "file", first, path="in/deep/a.txt"),
                   get_fn("move", "m", "move"), run("mv", "move"),
                   up_blob("b", "file", second, path="in/deep/b.txt"), get_fn("tree", "m", "tree"),
                   run("t", "tree"), ret("tree", "t"))
    results = assert_completed(execute_ok(server.url, program, [first, second]))
    assert plain(results["tree"]) == ["./in/deep/b.txt", "./moved/deep/a.txt"]


def test_the_upload_directories_held_open_are_capped(tmp_path):
    """A program uploading files into thousands of directories holds at most MAX_OPEN of them open."""
    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        before = open_fds()
        dirs = kcoral_worker.UploadDirectories(root)
        most = 0
        for i in range(3 * dirs.MAX_OPEN):
            dirs.parent_of(f"top/d{i}/sub/f.txt")
            most = max(most, open_fds() - before)
        assert dirs.MAX_OPEN // 2 < most <= dirs.MAX_OPEN
        dirs.forget()
        assert open_fds() == before
        assert sorted(os.listdir(tmp_path / "top")) == sorted(f"d{i}" for i in range(3 * dirs.MAX_OPEN))
        assert {(tmp_path / "top" / f"d{i}" / "sub").stat().st_mode & 0o777 for i in range(3 * dirs.MAX_OPEN)} == {0o700}
    finally:
        os.close(root)


def test_workspace_is_fresh_private_and_removed(server):
    source = ("import os\ndef f():\n    listing = os.listdir('.')\n    open('left-behind', 'w').close()\n"
              "    return [os.getcwd(), listing]\n")
    seen = []
    for _ in range(3):  # two workers: some slot serves twice
        results = assert_completed(execute_ok(server.url, simple_program(source)))
        cwd, listing = plain(results["out"])
        assert listing == []
        if server.sandbox == "none":
            assert "kcoral-program-" in cwd and cwd.startswith(server.tmpdir)
            assert wait_for(lambda cwd=cwd: not os.path.exists(cwd), timeout=5)  # removed just after the answer
        else:  # the container's fixed private directory; the host's path is not visible inside
            assert cwd == "/kcoral/work"
        seen.append(cwd)
    assert len(set(seen)) == (3 if server.sandbox == "none" else 1)
    assert workspaces(server) == []


# --- extension 1: tensors on CPU workers --------------------------------------------------------

DTYPE_SIZES = {"bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int16": 2, "float16": 2,
               "bfloat16": 2, "int32": 4, "float32": 4, "int64": 8, "float64": 8}
# NaN payloads, signalling NaNs, infinities, negative zero and subnormals must survive bit-exactly
SPECIAL_BITS = {
    "float16": [0x7E01, 0xFE00, 0x7C01, 0xFC00, 0x7C00, 0x8000, 0x0001, 0xFFFF],
    "bfloat16": [0x7FC1, 0xFF81, 0x7F81, 0xFF80, 0x7F80, 0x8000, 0x0001, 0xFFFF],
    "float32": [0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0xFF800000, 0x80000000, 0x00000001, 0x7FBFFFFF],
    "float64": [0x7FF8000000000001, 0xFFF0000000000001, 0x7FF0000000000000, 0x8000000000000000, 1],
    "float8_e4m3fn": [0x7F, 0xFF, 0x80, 0x01, 0x7E, 0xFE],
    "float8_e5m2": [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF, 0x7C, 0xFC, 0x80, 0x01],
}


def tensor_bytes(dtype, count):
    size = DTYPE_SIZES[dtype]
    if dtype == "bool":
        return bytes(b & 1 for b in os.urandom(count))
    special = b"".join(v.to_bytes(size, "little") for v in SPECIAL_BITS.get(dtype, []))[:count * size]
    return special + os.urandom(count * size - len(special))


TENSOR_CHECK = """import torch
def check(x, dtype, shape):
    assert isinstance(x, torch.Tensor), type(x)
    assert x.dtype == getattr(torch, dtype), x.dtype
    assert list(x.shape) == shape and x.device.type == 'cpu'
    return [x.clone(), x.reshape(-1)]
"""


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
def test_tensor_round_trip_bit_exact(server, dtype):
    shape = [3, 4]
    data = tensor_bytes(dtype, 12)
    program = prog(up_module("m", TENSOR_CHECK), get_fn("c", "m", "check"),
                   up_blob("t", "tensor", data, dtype=dtype, shape=shape), ret("raw", "t"),
                   run("r", "c", ref("t"), dtype, shape), ret("checked", "r"))
    body = execute_ok(server.url, program, [data])
    results = assert_completed(body)
    digest = sha256(data)
    assert results["raw"] == {"type": "tensor", "dtype": dtype, "shape": shape, "part": "return:0", "sha256": digest}
    assert results["checked"] == {"type": "array", "value": [
        {"type": "tensor", "dtype": dtype, "shape": shape, "part": "return:1", "sha256": digest},
        {"type": "tensor", "dtype": dtype, "shape": [12], "part": "return:2", "sha256": digest}]}
    assert body["_parts"] == {"return:0": data, "return:1": data, "return:2": data}


@pytest.mark.parametrize("shape", [[], [0], [2, 0, 3], [1, 1, 1, 5]], ids=["scalar", "empty", "empty-3d", "4d"])
def test_tensor_shapes(server, shape):
    count = math.prod(shape)
    data = tensor_bytes("float32", count)
    program = prog(up_module("m", TENSOR_CHECK), get_fn("c", "m", "check"),
                   up_blob("t", "tensor", data, dtype="float32", shape=shape),
                   run("r", "c", ref("t"), "float32", shape), ret("k", "r"))
    body = execute_ok(server.url, program, [data])
    value = assert_completed(body)["k"]["value"][0]
    assert value == {"type": "tensor", "dtype": "float32", "shape": shape, "part": "return:0", "sha256": sha256(data)}
    assert body["_parts"]["return:0"] == data


def _np(expr):
    import ml_dtypes  # noqa: F401  (used by the evaluated expressions)
    return eval(expr, {"numpy": numpy, "ml_dtypes": ml_dtypes})


ARRAY_RETURNS = [
    ("numpy-int16-2d", "numpy.arange(6, dtype=numpy.int16).reshape(2, 3)", "int16", [2, 3],
     "numpy.arange(6, dtype='<i2')"),
    ("numpy-big-endian", "numpy.arange(6, dtype='>i4').reshape(3, 2)", "int32", [3, 2], "numpy.arange(6, dtype='<i4')"),
    ("numpy-transposed", "numpy.arange(6, dtype=numpy.float32).reshape(2, 3).T", "float32", [3, 2],
     "numpy.ascontiguousarray(numpy.arange(6, dtype='<f4').reshape(2, 3).T)"),
    ("numpy-int64-scalar", "numpy.int64(7)", "int64", [], "numpy.array(7, dtype='<i8')"),
    ("numpy-bool-scalar", "numpy.bool_(True)", "bool", [], "numpy.array(True)"),
    ("numpy-uint8-scalar", "numpy.uint8(200)", "uint8", [], "numpy.array(200, dtype=numpy.uint8)"),
    ("numpy-float16", "numpy.array([1.5, -2], dtype=numpy.float16)", "float16", [2],
     "numpy.array([1.5, -2], dtype='<f2')"),
    ("numpy-bfloat16", "numpy.array([1, 2, 3], dtype=ml_dtypes.bfloat16)", "bfloat16", [3],
     "numpy.array([1, 2, 3], dtype=ml_dtypes.bfloat16)"),
    ("numpy-float8-e4m3fn", "numpy.array([0.5, 448], dtype=ml_dtypes.float8_e4m3fn)", "float8_e4m3fn", [2],
     "numpy.array([0.5, 448], dtype=ml_dtypes.float8_e4m3fn)"),
    ("numpy-empty", "numpy.zeros((0, 4), dtype=numpy.int8)", "int8", [0, 4], "numpy.zeros(0, dtype=numpy.int8)"),
    ("torch-transposed", "torch.arange(6).reshape(2, 3).t()", "int64", [3, 2],
     "numpy.ascontiguousarray(numpy.arange(6, dtype='<i8').reshape(2, 3).T)"),
    ("torch-0d", "torch.tensor(2.5, dtype=torch.float64)", "float64", [], "numpy.array(2.5, dtype='<f8')"),
    ("torch-requires-grad", "torch.ones(2, requires_grad=True) * 3", "float32", [2], "numpy.full(2, 3, dtype='<f4')"),
    ("torch-bool", "torch.tensor([True, False])", "bool", [2], "numpy.array([True, False])"),
]


@pytest.mark.parametrize("expr,dtype,shape,expected", [c[1:] for c in ARRAY_RETURNS], ids=[c[0] for c in ARRAY_RETURNS])
def test_arrays_returned_encode_as_tensor(server, expr, dtype, shape, expected):
    data = _np(expected).tobytes()
    source = f"import numpy, ml_dtypes, torch\ndef f():\n    return [{expr}, b'after']\n"
    body = execute_ok(server.url, simple_program(source))
    value = assert_completed(body)["out"]["value"]
    assert value[0] == {"type": "tensor", "dtype": dtype, "shape": shape, "part": "return:0", "sha256": sha256(data)}
    assert value[1] == {"type": "bytes", "part": "return:1", "sha256": sha256(b"after")}
    assert body["_parts"] == {"return:0": data, "return:1": b"after"}


@pytest.mark.parametrize("expr", ["numpy.zeros(2, dtype=numpy.uint16)", "numpy.zeros(2, dtype=numpy.complex64)",
                                  "numpy.array(['a'])", "numpy.array([None])", "numpy.zeros(1, dtype=numpy.uint32)",
                                  "numpy.zeros(1, dtype=numpy.longdouble)",
                                  "torch.zeros(2, dtype=torch.complex64)", "torch.zeros(2, dtype=torch.uint16)"],
                         ids=["numpy-uint16", "numpy-complex", "numpy-str", "numpy-object", "numpy-uint32", "numpy-longdouble",
                              "torch-complex", "torch-uint16"])
def test_arrays_with_unsupported_dtypes_fail_serialization(server, expr):
    source = f"import numpy, torch\ndef f():\n    return {expr}\n"
    assert_failed(execute_ok(server.url, simple_program(source)), "serialization", 3, "return", None)


# --- FAILED kinds a CPU server produces (docs/protocol.md §9.7) -----------------------------------------------------

def failing(source, *extra, name="f", args=()):
    """module 'm' -> get_function 'g' -> run 'r' -> return 'k', plus extra instructions after 'm'."""
    return prog(up_module("m", source), *extra, get_fn("g", "m", name), run("r", "g", *args), ret("k", "r"))


ERR = "from kcoral.errors import ExecutionError\n"
FAILED_CASES = [
    ("parse-syntax-error", failing("def f(:\n    pass\n"), (), "parse", 0, "upload", "m", "syntax"),
    ("parse-top-level-raise", failing("raise RuntimeError('top level')\n"), (), "parse", 0, "upload", "m",
     "RuntimeError: top level"),
    ("parse-import-error", failing("import no_such_module_kcoral\n"), (), "parse", 0, "upload", "m",
     "no_such_module_kcoral"),
    ("parse-missing-name", failing("def g():\n    pass\n"), (), "parse", 1, "get_function", "g", "'f'"),
    ("compile-garbage-library", prog(up_blob("lib", "library", b"\x7fELF garbage"), ret("k", "lib")),
     (b"\x7fELF garbage",), "compile", 0, "upload", "lib", ""),
    ("runtime-not-callable", failing("f = 3\n"), (), "runtime", 2, "run", "r", "not callable"),
    ("runtime-file-exists", prog(up_module("m", "def f():\n    open('x', 'w').close()\n"), get_fn("g", "m", "f"),
                                 run("r", "g"), up_blob("x", "file", b"data-x", path="x")),
     (b"data-x",), "runtime", 3, "upload", "x", "x"),
    ("runtime-file-through-symlink",
     prog(up_module("m", "import os\ndef f():\n    os.mkdir('real')\n    os.symlink('real', 'lnk')\n"),
          get_fn("g", "m", "f"), run("r", "g"), up_blob("x", "file", b"data-y", path="lnk/x")),
     (b"data-y",), "runtime", 3, "upload", "x", "lnk/x"),
    ("runtime-file-parent-is-file",
     prog(up_module("m", "def f():\n    open('a', 'w').close()\n"), get_fn("g", "m", "f"), run("r", "g"),
          up_blob("x", "file", b"data-z", path="a/b")),
     (b"data-z",), "runtime", 3, "upload", "x", "a/b"),
    ("correctness", failing(ERR + "def f():\n    raise ExecutionError('correctness', 'max abs diff 0.5')\n"), (),
     "correctness", 2, "run", "r", "max abs diff 0.5"),
    *[(f"execution-error-{kind}", failing(ERR + f"def f():\n    raise ExecutionError({kind!r}, 'chosen')\n"), (),
       kind, 2, "run", "r", "chosen")
      for kind in ("parse", "compile", "runtime", "serialization", "unavailable", "engine")],
    ("serialization-set", failing("def f():\n    return {1}\n"), (), "serialization", 3, "return", None, "set"),
    ("unavailable-compile-tirx", failing("from kcoral.builtins import compile_tirx\ndef f():\n    compile_tirx(None)\n"),
     (), "unavailable", 2, "run", "r", "tvm"),
    ("unavailable-get-function-on-bytes",
     prog(up_blob("b", "bytes", b"not a module"), get_fn("g", "b", "f")), (b"not a module",),
     "unavailable", 1, "get_function", "g", ""),
    ("engine-value-error", failing("def f():\n    raise ValueError('boom')\n"), (), "engine", 2, "run", "r",
     "ValueError: boom"),
    ("engine-assertion", failing("def f():\n    assert 1 == 2, 'nope'\n"), (), "engine", 2, "run", "r",
     "AssertionError: nope"),
    ("engine-wrong-arg-count", failing("def f(a):\n    return a\n"), (), "engine", 2, "run", "r", "TypeError"),
    ("engine-unknown-execution-error-kind",
     failing(ERR + "def f():\n    raise ExecutionError('weird', 'custom text')\n"), (), "engine", 2, "run", "r",
     "weird"),
]


@pytest.mark.parametrize("program,blobs,kind,index,op,ident,fragment", [c[1:] for c in FAILED_CASES],
                         ids=[c[0] for c in FAILED_CASES])
def test_failed_kinds(server, program, blobs, kind, index, op, ident, fragment):
    body = execute_ok(server.url, program, blobs)
    error = assert_failed(body, kind, index, op, ident, fragment)
    assert body["results"] == {}
    if kind == "engine" and fragment.startswith(("ValueError", "AssertionError")):  # raised in uploaded code
        assert "<uploaded:" in error["traceback"] and "Traceback" in error["traceback"]


def test_engine_traceback_names_uploaded_source(server):
    source = "def f():\n    x = 1\n    raise ValueError('line three')\n"
    error = assert_failed(execute_ok(server.url, simple_program(source)), "engine", 2, "run", "r",
                          "ValueError: line three")
    filename = f"<uploaded:{hashlib.sha1(source.encode()).hexdigest()[:16]}>"
    assert filename in error["traceback"]
    assert "raise ValueError('line three')" in error["traceback"]


def test_callable_returned_by_run_can_be_run(server):
    source = "def make(n):\n    return lambda x: x * n\n"
    program = prog(up_module("m", source), get_fn("mk", "m", "make"), run("times3", "mk", 3),
                   run("r", "times3", 5), ret("k", "r"))
    assert assert_completed(execute_ok(server.url, program)) == {"k": {"type": "integer", "value": 15}}


def test_get_function_selects_any_object(server):
    program = prog(up_module("m", "LIMIT = {'n': 4}\n"), get_fn("c", "m", "LIMIT"), ret("k", "c"))
    assert plain(assert_completed(execute_ok(server.url, program))["k"]) == {"n": 4}


def test_gpu_access_kind_from_uploaded_code_has_the_full_field_set(server):
    """docs/protocol.md §9.7: kind gpu_access always carries cuda_call, location and interfered_request_id."""
    body = execute_ok(server.url, failing(ERR + "def f():\n    raise ExecutionError('gpu_access', 'pretend')\n"))
    assert body["status"] == "FAILED"
    error = body["error"]
    assert set(error) == ERROR_FIELDS | {"cuda_call", "location", "interfered_request_id"}, error
    assert error["kind"] == "gpu_access" and (error["instruction_index"], error["instruction_id"]) == (2, "r")
    assert isinstance(error["cuda_call"], str) and isinstance(error["location"], str)
    assert error["interfered_request_id"] is None


# --- docs/protocol.md §10 crashes, teardown, background processes, timeouts ----------------------------------------

CRASH_SOURCE = """import ctypes, os, signal, sys
def talk():
    print("printed-before")
    os.write(1, b"fd-before\\n")
    sys.stderr.write("stderr-before\\n")
    return b"early-bytes"
def crash():
    print("printed-in-crash")
    {stmt}
"""
FRAMES_IN_STDERR = '; the Python frames it crashed in are in stderr, under "Stack (most recent call first)"'
CRASHES = [  # (id, statement, the cause the message names, or its start)
    ("os-exit-3", "os._exit(3)", "it exited with status 3 (os._exit, sys.exit or a native exit())"),
    ("os-exit-0", "os._exit(0)", "it exited with status 0 (os._exit, sys.exit or a native exit())"),
    ("sigkill", "os.kill(os.getpid(), signal.SIGKILL)", "killed by signal 9 (SIGKILL, Killed)"),
    ("sigsegv", "ctypes.string_at(0)", "killed by signal 11 (SIGSEGV, Segmentation fault)" + FRAMES_IN_STDERR),
    ("abort", "os.abort()", "killed by signal 6 (SIGABRT, Aborted)" + FRAMES_IN_STDERR),
    # the status of an escaping exception is multiprocessing's (2, 1); in the sandbox, its template's (1)
    ("system-exit", "raise SystemExit(2)", "it exited with status "),
    ("keyboard-interrupt", "raise KeyboardInterrupt", "it exited with status 1 "),
]


@pytest.mark.parametrize("stmt,cause", [c[1:] for c in CRASHES], ids=[c[0] for c in CRASHES])
def test_worker_crash_keeps_early_returns_and_output(server, stmt, cause):
    """docs/protocol.md §10 attribution, the message naming the cause; extension 3: returns and
    output written before the crash survive."""
    program = prog(up_module("m", CRASH_SOURCE.format(stmt=stmt)), get_fn("talk", "m", "talk"),
                   get_fn("crash", "m", "crash"), run("t", "talk"), ret("early", "t"), run("c", "crash"),
                   ret("late", "c"))
    body = execute_ok(server.url, program)
    error = assert_failed(body, "runtime", 5, "run", "c")
    assert error["message"].startswith(f"worker exited while executing the instruction: {cause}"), error
    assert error["traceback"] == ""
    assert body["results"] == {"early": {"type": "bytes", "part": "return:0", "sha256": sha256(b"early-bytes")}}
    assert body["_parts"] == {"return:0": b"early-bytes"}
    for text in ("printed-before", "fd-before", "printed-in-crash"):
        assert text in body["stdout"], body["stdout"]
    assert "stderr-before" in body["stderr"]
    assert body["stdout_truncated"] is False and body["stderr_truncated"] is False
    ok_run(server.url)
    assert workspaces(server) == []


def test_crash_in_module_top_level_and_in_return(server):
    body = execute_ok(server.url, prog(up_module("m", "import os\nos._exit(1)\n"), ret("k", "m")))
    assert_failed(body, "runtime", 0, "upload", "m", "worker exited")
    source = "import os\nclass K(str):\n    def __str__(self):\n        os._exit(4)\ndef f():\n    return K('a')\n"
    body = execute_ok(server.url, simple_program(source))
    assert_failed(body, "runtime", 3, "return", None, "worker exited")
    ok_run(server.url)


def test_teardown_exit_code_fails_a_completed_program(server):
    source = ("import os\ndef f():\n    real = os._exit\n    os._exit = lambda code: real(5)\n"
              "    print('finished')\n    return 1\n")
    body = execute_ok(server.url, simple_program(source))
    error = assert_failed(body, "runtime", 3, "return", None, "5", "teardown")
    assert error["traceback"] == ""
    assert body["results"] == {"out": {"type": "integer", "value": 1}}
    assert body["stdout"] == "finished\n"
    ok_run(server.url)


BACKGROUND = [  # SECONDS is a duration unique to the test, by which the host finds the process
    ("child", "subprocess.Popen(['sleep', 'SECONDS'])"),
    ("orphan", "subprocess.Popen(['sh', '-c', 'sleep SECONDS & echo $!'], stdout=subprocess.PIPE)"),
    ("new-session", "subprocess.Popen(['sleep', 'SECONDS'], start_new_session=True)"),
]


@pytest.mark.parametrize("spawn", [c[1] for c in BACKGROUND], ids=[c[0] for c in BACKGROUND])
def test_background_processes_are_terminated_and_reported(server, spawn):
    seconds = f"30.{uuid.uuid4().int % 10**12:012d}"
    source = ("import subprocess\ndef f():\n"
              f"    p = {spawn.replace('SECONDS', seconds)}\n"
              "    pid = int(p.stdout.readline()) if p.stdout else p.pid\n"
              "    print('spawned', pid)\n    return pid\n")
    program = prog(up_module("m", source), get_fn("g", "m", "f"), run("r", "g"), ret("pid", "r"))
    body = execute_ok(server.url, program)
    error = assert_failed(body, "runtime", 3, "return", None,
                          "program left background processes running; they were terminated")
    assert error["traceback"] == ""
    pid = body["results"]["pid"]["value"]  # the sandbox's PID namespace's number, inside one
    assert body["stdout"] == f"spawned {pid}\n"
    survivors = lambda: marked_pids(f"sleep\0{seconds}\0")  # noqa: E731
    assert wait_for(lambda: not survivors(), timeout=10), f"background processes {survivors()} survived"
    ok_run(server.url)


def test_new_session_process_is_killed_after_a_worker_crash(server):
    """The orphan is outside every tree once the worker is gone; it must not survive (docs/protocol.md §10)."""
    # found by its unique argument: a pid printed inside a sandbox is its PID namespace's, not the host's
    seconds = f"20.{uuid.uuid4().int % 10**12:012d}"
    source = ("import os, subprocess\ndef f():\n"
              f"    p = subprocess.Popen(['sleep', '{seconds}'], start_new_session=True)\n"
              "    print(p.pid, flush=True)\n    os._exit(3)\n")
    body = execute_ok(server.url, simple_program(source))

    def sleeping():
        return [pid for pid in os.listdir("/proc") if pid.isdigit() and proc_cmdline(pid) == f"sleep\0{seconds}\0"]
    try:
        assert_failed(body, "runtime", 2, "run", "r", "worker exited")
        assert wait_for(lambda: not sleeping(), timeout=5), f"processes {sleeping()} survived the crash"
    finally:
        for pid in sleeping():
            os.kill(int(pid), signal.SIGKILL)


def proc_cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def test_waited_subprocess_is_fine(server):
    source = "import subprocess\ndef f():\n    return subprocess.run(['true']).returncode\n"
    assert assert_completed(execute_ok(server.url, simple_program(source)))["out"]["value"] == 0


TIMEOUT_SOURCE = """import subprocess, sys, time
def f(marker, new_session):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker], start_new_session=new_session)
    print("looping")
    while True:
        time.sleep(0.05)
"""


@pytest.mark.parametrize("new_session", [False, True], ids=["same-group", "new-session"])
def test_timeout_kills_the_whole_tree(server, new_session):
    marker = f"kcoral-grandchild-{uuid.uuid4().hex}"
    program = call_program(TIMEOUT_SOURCE, "f", marker, new_session, options={"timeout_seconds": 2})
    seen = []
    watcher = threading.Thread(target=lambda: seen.extend(wait_for(lambda: marked_pids(marker), timeout=30) or []))
    watcher.start()
    started = time.monotonic()
    status, headers, body = post(server.url, program)
    join_threads([watcher], 60)
    assert_error_body(status, headers, body, 504, "timeout")
    assert time.monotonic() - started < 30
    assert seen, "the grandchild never ran"
    assert wait_for(lambda: not any(is_alive(pid) for pid in seen), timeout=10), f"grandchild {seen} survived"
    ok_run(server.url)
    assert workspaces(server) == []


def test_timeout_fractional_and_clamped(server):
    source = "import time\ndef f(s):\n    time.sleep(s)\n    return s\n"
    status, headers, body = post(server.url, call_program(source, "f", 5, options={"timeout_seconds": 0.5}))
    assert_error_body(status, headers, body, 504, "timeout")
    body = execute_ok(server.url, call_program(source, "f", 0.1, options={"timeout_seconds": 10 ** 9}))
    assert assert_completed(body)["out"]["value"] == 0.1


# --- docs/protocol.md §8.7 output capture ----------------------------------------------------------------------------

OUTPUT_SOURCE = """import os, subprocess, sys
print("module-level")
def f(text):
    print("python-print")
    os.write(1, b"fd-level\\n")
    subprocess.run(["echo", "from-child"])
    subprocess.run(["sh", "-c", "echo child-err >&2"])
    sys.stderr.write(text)
"""


def test_output_capture_is_fd_level_and_covers_all_instructions(server):
    body = execute_ok(server.url, call_program(OUTPUT_SOURCE, "f", "py-err\n"))
    assert_completed(body)
    for text in ("module-level\n", "python-print\n", "fd-level\n", "from-child\n"):
        assert text in body["stdout"]
    assert "child-err\n" in body["stderr"] and "py-err\n" in body["stderr"]
    assert body["stdout_truncated"] is False and body["stderr_truncated"] is False


@pytest.mark.parametrize("limit,stdout,truncated", [
    (12, "fd-level\nfro", True),
    (len("fd-level\nfrom-child\n"), "fd-level\nfrom-child\n", False),
    (len("fd-level\nfrom-child\n") - 1, "fd-level\nfrom-child", True),
    (1, "f", True),
])
def test_output_truncation(server, limit, stdout, truncated):
    source = "import os, subprocess\ndef f():\n    os.write(1, b'fd-level\\n')\n    subprocess.run(['echo', 'from-child'])\n"
    body = execute_ok(server.url, simple_program(source, options={"output_limit_bytes": limit}))
    assert (body["stdout"], body["stdout_truncated"]) == (stdout, truncated)
    assert (body["stderr"], body["stderr_truncated"]) == ("", False)


def test_output_cut_inside_a_utf8_character(server):
    source = "import os\ndef f():\n    os.write(1, 'aé'.encode())\n    os.write(2, b'\\xff ok')\n"
    body = execute_ok(server.url, simple_program(source, options={"output_limit_bytes": 2}))
    assert (body["stdout"], body["stdout_truncated"]) == ("a\ufffd", True)
    assert (body["stderr"], body["stderr_truncated"]) == ("\ufffd ", True)


def test_output_limit_zero_disables_capture(server):
    body = execute_ok(server.url, call_program(OUTPUT_SOURCE, "f", "x" * 5000, options={"output_limit_bytes": 0}))
    assert_completed(body)
    assert (body["stdout"], body["stderr"], body["stdout_truncated"], body["stderr_truncated"]) == \
        ("", "", False, False)


def test_large_output_does_not_block_and_is_cut(server):
    source = "import os\ndef f():\n    for _ in range(64):\n        os.write(1, b'x' * 65536)\n    return 1\n"
    body = execute_ok(server.url, simple_program(source, options={"output_limit_bytes": 1000}))
    assert assert_completed(body)["out"]["value"] == 1
    assert body["stdout"] == "x" * 1000 and body["stdout_truncated"] is True


def test_default_output_limit_is_one_mib(server):
    source = "import os\ndef f():\n    os.write(1, b'y' * ((1 << 20) + 5))\n"
    body = execute_ok(server.url, simple_program(source))
    assert len(body["stdout"]) == 1 << 20 and body["stdout_truncated"] is True


# --- /health, load, concurrency --------------------------------------------------------------------

def test_health_fields_and_types(server):
    status, headers, data = request("GET", server.url + "/health")
    assert status == 200 and headers["content-type"] == "application/json"
    assert UUID_RE.fullmatch(headers["x-kcoral-instance"])
    health = json.loads(data)
    assert set(health) == {"status", "instance_id", "started_at", "gpu_count", "load", "target", "versions",
                           "sandbox", "version", "limits"}
    assert set(health["limits"]) == {"max_request_bytes", "memory_limit_bytes", "process_limit", "disk_limit_bytes",
                                     "file_limit"}
    assert all(type(limit["value"]) is int and limit["value"] > 0 and limit["enforced"]
               for limit in health["limits"].values())
    assert health["status"] == "ok" and health["sandbox"] == server.sandbox
    assert health["version"] == kcoral.__version__  # our extension: which kcoral answered (upgrades)
    assert UUID_RE.fullmatch(health["instance_id"]) and health["instance_id"] == headers["x-kcoral-instance"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", health["started_at"])
    assert health["gpu_count"] == 0 and health["target"] == {}
    import importlib.metadata
    assert health["versions"] == {"tvm_ffi": importlib.metadata.version("apache-tvm-ffi")}
    load = health["load"]
    assert set(load) == {"request_capacity", "requests_in_progress", "requests_waiting"}
    assert all(type(v) is int and v >= 0 for v in load.values())
    assert wait_for(lambda: server.health()["load"] == {"request_capacity": 2, "requests_in_progress": 0,
                                                         "requests_waiting": 0})


def test_load_moves_with_in_flight_and_waiting_requests(server):
    source = "import time\ndef f(i):\n    time.sleep(1.2)\n    return i\n"
    assert wait_for(lambda: server.health()["load"]["request_capacity"] == 2), server.health()
    answers = {}

    def client(i):
        answers[i] = post(server.url, call_program(source, "f", i))[2]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    seen, deadline = [], time.monotonic() + 60
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        seen.append(server.health()["load"])
        time.sleep(0.03)  # the sampling rate, not a synchronisation
    join_threads(threads, 5)
    assert max(s["requests_in_progress"] for s in seen) == 2, seen
    assert max(s["requests_waiting"] for s in seen) >= 1, seen
    assert all(s["requests_in_progress"] <= 2 for s in seen)
    for i in range(3):
        assert assert_completed(answers[i])["out"]["value"] == i
    assert wait_for(lambda: server.health()["load"] == {"request_capacity": 2, "requests_in_progress": 0,
                                                         "requests_waiting": 0})


def test_concurrent_clients_each_get_their_own_answer(server):
    source = "import hashlib\ndef f(c, r, data):\n    return [c, r, hashlib.sha256(data).hexdigest(), data[::-1]]\n"
    failures = []

    def client(c):
        try:
            for r in range(10):
                data = f"{c}:{r}:".encode() + os.urandom(32)
                program = prog(up_module("m", source), up_blob("d", "bytes", data), get_fn("g", "m", "f"),
                               run("r", "g", c, r, ref("d")), ret("out", "r"))
                status, _, body = post(server.url, program, [data])
                value = assert_completed(body)["out"]["value"]
                assert [value[0]["value"], value[1]["value"], value[2]["value"]] == [c, r, sha256(data)]
                assert body["_parts"] == {"return:0": data[::-1]}
        except BaseException as exc:  # reported below with the client number
            failures.append((c, repr(exc)))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
    for t in threads:
        t.start()
    join_threads(threads, 240)
    assert not failures, failures
    assert workspaces(server) == []


# --- HTTP surface ---------------------------------------------------------------------------------

def test_unknown_path_404_and_wrong_method_405(server):
    for method, path in (("GET", "/nope"), ("POST", "/health/x"), ("GET", "/execute/")):
        status, headers, data = request(method, server.url + path)
        assert status == 404 and json.loads(data) == {"detail": "Not Found"}
        assert UUID_RE.fullmatch(headers["x-kcoral-instance"])
    for method, path, allow in (("GET", "/execute", "POST"), ("POST", "/health", "GET"),
                                ("PUT", "/execute", "POST"), ("DELETE", "/health", "GET")):
        status, headers, data = request(method, server.url + path)
        assert status == 405 and json.loads(data) == {"detail": "Method Not Allowed"}
        assert allow in headers["allow"]
        assert UUID_RE.fullmatch(headers["x-kcoral-instance"])
    ok_run(server.url)


def test_instance_header_on_every_kind_of_response(server):
    instance = server.health()["instance_id"]
    seen = []
    seen.append(post(server.url, simple_program("def f():\n    return 1\n"))[1])      # 200 COMPLETED
    seen.append(post(server.url, prog(up_blob("b", "bytes", os.urandom(4))))[1])       # 200 CACHE_MISS
    seen.append(post(server.url, {"instructions": []})[1])                              # 400
    seen.append(post(server.url, simple_program("def f():\n    raise ValueError\n"))[1])  # 200 FAILED
    seen.append(request("GET", server.url + "/nope")[1])                                # 404
    seen.append(request("GET", server.url + "/execute")[1])                             # 405
    conn = http.client.HTTPConnection(f"127.0.0.1:{server.port}", timeout=10)
    try:
        conn.putrequest("POST", "/execute")
        conn.putheader("Content-Length", str(2 << 30))  # over the default --max-request-bytes
        conn.endheaders()
        response = conn.getresponse()
        response.read()
        assert response.status == 413
        seen.append({k.lower(): v for k, v in response.getheaders()})
    finally:
        conn.close()
    assert [h["x-kcoral-instance"] for h in seen] == [instance] * len(seen)


def test_a_request_head_is_parsed_without_compiling_its_multipart_boundary(monkeypatch):
    """email's parser, which http.server runs over a head, compiles a regular expression for each
    request's new multipart boundary (0.3 ms a request); kcoral.RequestHead gives the same headers
    without it, and keeps what follows a line that is not a header as the payload parse_request refuses."""
    heads = [f"Host: x\r\nContent-Type: multipart/form-data; boundary={uuid.uuid4().hex}\r\n"
             f"Content-Length: 10\r\n\r\n".encode() for _ in range(3)]
    heads.append(heads[0].replace(b"Content-Length", b"no colon here\r\nContent-Length"))
    stock = [http.client.parse_headers(io.BytesIO(head)) for head in heads]
    compiled, real_compile = [], re.compile
    monkeypatch.setattr(re, "compile", lambda pattern, flags=0: compiled.append(pattern) or real_compile(pattern, flags))
    ours = [http.client.parse_headers(io.BytesIO(head), _class=kcoral.RequestHandler.MessageClass) for head in heads]
    assert compiled == []
    assert [list(h.items()) for h in ours] == [list(h.items()) for h in stock]
    assert [h.get_payload() for h in ours[:3]] == ["", "", ""]
    assert ours[3].get_payload().startswith("no colon here") and ours[3]["Content-Length"] is None


def test_large_parts_answer_intact_between_other_parts(server):
    """Parts of several MiB, one the program computed (it crosses the worker's pipe) and one an
    upload returned unchanged (the front-end's own copy), with small parts around them: every
    byte arrives once, in its place."""
    upload = os.urandom(9 << 20)
    source = "def f(data):\n    return [b'head', data[::-1], b'', b'tail']\n"
    program = prog(up_module("m", source), get_fn("fn", "m", "f"), up_blob("b", "bytes", upload),
                   run("r", "fn", ref("b")), ret("out", "r"), ret("echo", "b"))
    body = execute_ok(server.url, program, [upload])
    results = assert_completed(body)
    parts = [body["_parts"][item["part"]] for item in results["out"]["value"]]
    assert parts == [b"head", upload[::-1], b"", b"tail"]
    assert body["_parts"][results["echo"]["part"]] == upload

def test_keep_alive_connection_serves_several_requests(server):
    conn = http.client.HTTPConnection(f"127.0.0.1:{server.port}", timeout=60)
    try:
        for i in range(3):
            body, content_type = multipart(program_parts(simple_program("def f(i):\n    return i\n", args=[i])))
            conn.request("POST", "/execute", body=body, headers={"Content-Type": content_type})
            response = conn.getresponse()
            assert assert_completed(json.loads(response.read()))["out"]["value"] == i
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert json.loads(response.read())["status"] == "ok"
            conn.request("POST", "/execute", body=b"", headers={"Content-Type": "text/plain"})
            response = conn.getresponse()
            assert response.status == 400 and json.loads(response.read())["error"]["kind"] == "parse"
    finally:
        conn.close()


# --- servers with other flags ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def limits_server(tmp_path_factory):
    """Small request/response limits; a disk cache that cannot be written."""
    with ServerProcess("--max-response-bytes", "16384", "--max-request-bytes", "65536",
                       "--disk-cache-dir", "/proc/kcoral-unwritable", workers=1,
                       tmp_path=tmp_path_factory.mktemp("limits")) as srv:
        yield srv


def test_response_too_large_for_bytes_value(limits_server):
    """docs/protocol.md §9.8: an oversized value is 500 response_too_large, not a FAILED return."""
    source = "def f(n):\n    return b'x' * n\n"
    status, headers, body = post(limits_server.url, call_program(source, "f", 20000))
    assert_error_body(status, headers, body, 500, "response_too_large")
    status, headers, body = post(limits_server.url, call_program("def f():\n    return [b'x' * 9000] * 2\n", "f"))
    assert_error_body(status, headers, body, 500, "response_too_large")
    body = execute_ok(limits_server.url, call_program(source, "f", 1000))
    assert body["_parts"] == {"return:0": b"x" * 1000}
    ok_run(limits_server.url)


def test_response_too_large_for_json_only_answer(limits_server):
    source = "def f(n):\n    return 'y' * n\n"
    status, headers, body = post(limits_server.url, call_program(source, "f", 20000))
    assert_error_body(status, headers, body, 500, "response_too_large")
    status, headers, body = post(limits_server.url, call_program("def f():\n    print('z' * 20000)\n", "f"))
    assert_error_body(status, headers, body, 500, "response_too_large")


def test_file_and_folder_returns_respect_the_byte_budget(limits_server):
    source = ("import os\ndef f(n):\n    os.makedirs('d')\n    open('d/a', 'wb').write(b'a' * n)\n"
              "    open('d/b', 'wb').write(b'b' * n)\n    open('big', 'wb').write(b'c' * 20000)\n"
              "    return b'e' * 10000\n")
    base = [up_module("m", source), get_fn("g", "m", "f")]
    body = execute_ok(limits_server.url, prog(*base, run("r", "g", 10), ret_path("k", "file", "big")))
    assert_failed(body, "serialization", 3, "return", None)
    body = execute_ok(limits_server.url, prog(*base, run("r", "g", 9000), ret_path("k", "folder", "d")))
    assert_failed(body, "serialization", 3, "return", None)
    # binary parts already registered count against the budget of a later file return
    body = execute_ok(limits_server.url, prog(*base, run("r", "g", 3500), ret("early", "r"),
                                              ret_path("k", "folder", "d")))
    assert_failed(body, "serialization", 4, "return", None)
    assert body["_parts"] == {"return:0": b"e" * 10000}
    body = execute_ok(limits_server.url, prog(*base, run("r", "g", 100), ret_path("k", "folder", "d")))
    assert_completed(body)


def test_request_limit_declared_and_chunked(limits_server):
    conn = http.client.HTTPConnection(f"127.0.0.1:{limits_server.port}", timeout=10)
    try:
        conn.putrequest("POST", "/execute")
        conn.putheader("Content-Type", CT)
        conn.putheader("Content-Length", "65537")
        conn.endheaders()
        response = conn.getresponse()
        assert_error_body(response.status, {k.lower(): v for k, v in response.getheaders()},
                          json.loads(response.read()), 413, "request_too_large")
    finally:
        conn.close()
    # exactly at the limit is fine (the preamble pads the body)
    body = raw_body([raw_part("program", "application/json", json.dumps(simple_program(
        "def f():\n    return 1\n")).encode())])
    padded = b"p" * (65536 - len(body) - 2) + b"\r\n" + body
    assert len(padded) == 65536
    status, _, result = post_raw(limits_server.url, padded, CT)
    assert status == 200 and assert_completed(result)
    for size, expected in ((70000, 413), (1000, 200)):
        payload = b"p" * (size - len(body) - 2) + b"\r\n" + body
        conn = http.client.HTTPConnection(f"127.0.0.1:{limits_server.port}", timeout=30)
        try:
            conn.request("POST", "/execute", body=iter([payload[i:i + 4096] for i in range(0, len(payload), 4096)]),
                         headers={"Content-Type": CT, "Transfer-Encoding": "chunked"}, encode_chunked=True)
            response = conn.getresponse()
            data = json.loads(response.read())
        finally:
            conn.close()
        assert response.status == expected, data
        if expected == 413:
            assert data["error"]["kind"] == "request_too_large"
            assert data["error"]["message"] == ("request exceeds the server's size limit of 65536 bytes "
                                                "(max_request_bytes; the server's --max-request-bytes flag raises it)")


def refuse_with_body_unread(sock: socket.socket, body: bytes) -> bytes:
    """POST /execute declaring 1 GiB, over the limit, send `body` whole (a broken pipe here is a
    failure: the server reset the connection), then read the answer -> what came back."""
    sock.sendall(f"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: {CT}\r\n"
                 f"Content-Length: {1 << 30}\r\n\r\n".encode())
    sock.sendall(body)
    answer = b""
    while chunk := sock.recv(1 << 16):  # the server stops sending (its FIN) once it answered
        answer += chunk
    return answer


def test_a_refused_body_is_drained_so_the_client_reads_the_refusal(limits_server):
    """A client sends its whole body before it reads: the server refuses 1 GiB at the head (413)
    and keeps reading what follows until the client closes (--lingering-close-seconds), so the
    8 MiB already in flight, far more than the sockets' buffers, meets no reset."""
    with socket.create_connection(("127.0.0.1", limits_server.port), timeout=30) as sock:
        answer = refuse_with_body_unread(sock, os.urandom(8 << 20))
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"request_too_large"' in answer
    assert_completed(execute_ok(limits_server.url, call_program("def f():\n    return 1\n", "f")))


def test_a_refused_connection_lingers_for_a_bounded_time(limits_server):
    """A client that never closes but keeps sending holds its refused connection for
    --lingering-close-seconds (2 s by default), not longer: then the server closes it, and the
    next bytes the client sends meet a reset."""
    with socket.create_connection(("127.0.0.1", limits_server.port), timeout=30) as sock:
        assert refuse_with_body_unread(sock, b"x" * 1000).startswith(b"HTTP/1.1 413 ")
        answered = time.monotonic()
        with pytest.raises(OSError):  # EPIPE or ECONNRESET, once the server has closed
            while time.monotonic() - answered < 8:
                sock.sendall(b"x" * 100)
                time.sleep(0.05)
        held = time.monotonic() - answered
    assert 1.5 <= held <= 6.0, held


def test_unusable_disk_cache_never_rejects_a_request(limits_server):
    data = os.urandom(64)
    program = prog(up_blob("f", "file", data, path="in.bin"), ret_path("k", "file", "in.bin"))
    body = execute_ok(limits_server.url, program, [data])
    assert body["_parts"] == {"return:0": data}
    # nor keeps the blob: the failing write may still be on its way once the answer is out, and
    # until it ends the blob is served from memory; then a request that only names it misses it
    answers = []

    def missed():
        status, _, body = post(limits_server.url, program)
        answers.append((status, body["status"]))
        return body["status"] == "CACHE_MISS"
    assert wait_for(missed, 10) and set(answers) <= {(200, "COMPLETED"), (200, "CACHE_MISS")}, answers


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    with ServerProcess("--token", "s3cret-token", workers=1, tmp_path=tmp_path_factory.mktemp("token")) as srv:
        yield srv


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "s3cret-token", "Basic czNjcmV0LXRva2Vu",
                                           "Bearer s3cret-token-and-more", "Bearer  s3cret-token"],
                         ids=["none", "wrong", "no-scheme", "basic", "prefix", "extra-space"])
def test_token_rejects_missing_or_wrong_credentials(token_server, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    status, rh, data = request("GET", token_server.url + "/health", headers=headers)
    body = json.loads(data)
    assert status == 401 and rh["content-type"] == "application/json"
    assert set(body) == {"status", "request_id", "error"} and body["status"] == "ERROR"
    assert set(body["error"]) == {"kind", "message"} and body["error"]["kind"] == "unauthorized"
    assert UUID_RE.fullmatch(rh["x-kcoral-instance"])
    given = str(uuid.uuid4())
    status, rh, body = post(token_server.url, simple_program("def f():\n    return 1\n"),
                            headers={**headers, "X-Request-ID": given})
    assert_error_body(status, rh, body, 401, "unauthorized")
    assert body["request_id"] == given


def test_token_accepted_as_bearer(token_server):
    auth = {"Authorization": "Bearer s3cret-token"}
    status, headers, data = request("GET", token_server.url + "/health", headers=auth)
    assert status == 200 and json.loads(data)["status"] == "ok"
    status, headers, body = post(token_server.url, simple_program("def f():\n    return 41 + 1\n"), headers=auth)
    assert status == 200 and assert_completed(body)["out"]["value"] == 42
    status, headers, body = post(token_server.url, {"instructions": []}, headers=auth)
    assert_parse_error((status, headers, body), "instructions")


@pytest.fixture(scope="module")
def reuse_server(tmp_path_factory):
    env = {"KCORAL_TEST_EXISTING": "original", "KCORAL_TEST_DELETED": "present"}
    with ServerProcess("--max-requests-per-worker", "0", workers=1, env=env,
                       tmp_path=tmp_path_factory.mktemp("reuse")) as srv:
        yield srv


REUSE_SOURCE = """import os, subprocess
def first():
    os.environ["KCORAL_TEST_NEW"] = "leaked"
    os.environ["KCORAL_TEST_EXISTING"] = "changed"
    del os.environ["KCORAL_TEST_DELETED"]
    open("scratch", "w").close()
    return [os.getpid(), os.getcwd()]
def second():
    shell = subprocess.run(["sh", "-c", "echo $KCORAL_TEST_NEW,$KCORAL_TEST_EXISTING,$KCORAL_TEST_DELETED"],
                           capture_output=True, text=True).stdout.strip()
    return [os.getpid(), os.getcwd(), os.listdir("."), os.environ.get("KCORAL_TEST_NEW"),
            os.environ.get("KCORAL_TEST_EXISTING"), os.environ.get("KCORAL_TEST_DELETED"), shell]
"""


def test_reused_worker_runs_requests_with_a_clean_environment(reuse_server):
    first = plain(assert_completed(execute_ok(reuse_server.url, simple_program(REUSE_SOURCE, "first")))["out"])
    second = plain(assert_completed(execute_ok(reuse_server.url, simple_program(REUSE_SOURCE, "second")))["out"])
    assert second[0] == first[0], "the same worker process should serve both requests"
    assert second[1] != first[1] and not os.path.exists(first[1])
    assert second[2:] == [[], None, "original", "present", ",original,present"]
    # a failing request does not poison the reused worker
    assert_failed(execute_ok(reuse_server.url, simple_program("def f():\n    raise ValueError('x')\n")),
                  "engine", 2, "run", "r")
    third = plain(assert_completed(execute_ok(reuse_server.url, simple_program(REUSE_SOURCE, "second")))["out"])
    assert third[0] == first[0] and third[3:] == [None, "original", "present", ",original,present"]


def test_reused_worker_is_replaced_after_a_crash(reuse_server):
    body = execute_ok(reuse_server.url, simple_program("import os\ndef f():\n    os._exit(9)\n"))
    assert_failed(body, "runtime", 2, "run", "r", "worker exited")
    ok_run(reuse_server.url)


# --- process lifecycle: CLI, graceful shutdown, restart -----------------------------------------------------

@pytest.mark.parametrize("flags,fragment", [
    (["--sandbox", "firejail"], "sandbox"),
    (["server", "--sandbox", "docker"], "sandbox"),
    (["--sandbox", "none", "--sandbox-readonly-path", "/opt"], "requires the sandbox"),
    (["--sandbox", "bubblewrap", "--sandbox-readonly-path", "opt"], "absolute"),
    (["--router", "x"], "router"),
    (["--router", "http://r", "--node-id", "n"], "router"),
    (["--node-token", "t"], "router"),
    (["--device", "gpu"], "gpu"),
    (["--device", "tpu"], "device"),
    (["--num-workers", "0"], "num_workers"),
    (["--num-work", "2"], "--num-work"),
    (["--no-such-flag"], "--no-such-flag"),
], ids=["sandbox-unknown", "server-word-sandbox-unknown", "sandbox-path-unsandboxed", "sandbox-path-relative",
        "router", "router-node", "node-token", "gpu-absent", "device-unknown", "zero-workers", "abbreviation",
        "unknown-flag"])
def test_cli_refuses_unsupported_or_invalid_flags(flags, fragment):
    result = subprocess.run([PYTHON, "-m", "kcoral", "--port", str(free_port()), "--log-dir", "", *flags],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert fragment.lower() in result.stderr.lower(), result.stderr
    assert len(result.stderr) < 4000 and "Traceback" not in result.stderr


def test_graceful_shutdown_then_restart_keeps_disk_cache(tmp_path):
    """docs/server.md §8 and docs/protocol.md §7.5: SIGTERM drains, exit 0; a restart has a new id and the old disk cache."""
    data = os.urandom(40)
    file_program = prog(up_blob("f", "file", data, path="cfg"), ret_path("k", "file", "cfg"))
    slow = call_program("import time\ndef f():\n    time.sleep(3)\n    return 'finished'\n", "f")
    first = ServerProcess(tmp_path=tmp_path)
    try:
        instance = first.health()["instance_id"]
        assert execute_ok(first.url, file_program, [data])["_parts"] == {"return:0": data}
        outcome = {}
        slow_thread = threading.Thread(target=lambda: outcome.update(slow=post(first.url, slow)))
        slow_thread.start()
        assert wait_for(lambda: first.health()["load"]["requests_in_progress"] >= 1)
        first.proc.send_signal(signal.SIGTERM)
        refused = None
        while slow_thread.is_alive() and refused is None:
            try:
                status, headers, body = post(first.url, simple_program("def f():\n    return 1\n"), timeout=10)
            except OSError:
                refused = "connection refused"
                break
            if status == 503:
                assert_error_body(status, headers, body, 503, "busy")
                assert headers["retry-after"] == "1"
                refused = "503"
                try:
                    assert first.health()["load"]["request_capacity"] == 0
                except OSError:
                    pass
            else:
                assert status == 200  # accepted before the signal was handled
                time.sleep(0.05)
        join_threads([slow_thread], 60)
        assert refused, "no request was refused during the shutdown"
        status, _, body = outcome["slow"]
        assert status == 200 and assert_completed(body)["out"]["value"] == "finished"
        assert first.proc.wait(60) == 0
    finally:
        first.stop()
    # restart on the same disk cache, without --device: CPU fallback with a one-line warning
    started = time.monotonic()
    second = ServerProcess(tmp_path=tmp_path, device=None)
    try:
        assert time.monotonic() - started < 30
        assert second.health()["instance_id"] != instance
        assert second.health()["gpu_count"] == 0
        warnings = [line for line in second.log().splitlines() if line and not re.match(r"\d{4}-\d\d-\d\dT", line)]
        assert len(warnings) == 1 and "cpu" in warnings[0].lower(), second.log()
        body = execute_ok(second.url, file_program)
        assert body["status"] == "COMPLETED" and body["_parts"] == {"return:0": data}
    finally:
        assert second.stop() == 0
