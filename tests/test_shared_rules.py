"""Rules the client and the server both apply, checked to agree.

client.py keeps its own copy of each rule it shares with the server (dtype sizes, error
kinds, path normalisation, strict JSON, multipart framing, file-path conflicts,
tensor-to-bytes, folder walks) so that it stays one file users can vendor.  Two copies can
drift; this suite runs both over the same hypothesis corpus and requires the same outcome:
both refuse, or both accept with the same result.
"""

import json
import os
import socket
import tempfile

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import client
import kcoral
import kcoral_worker

EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome(function, *args):
    """("ok", result) or ("refused", None): the two copies may word their errors differently."""
    try:
        return "ok", function(*args)
    except (ValueError, kcoral_worker.ExecutionError):  # ValidationError is a ValueError on both sides
        return "refused", None


# --- tables ----------------------------------------------------------------------------

def test_dtype_tables_agree():
    assert client._ITEMSIZE == kcoral_worker.DTYPE_SIZES
    decodable = set(client._NUMPY_DTYPES) | set(client._ML_DTYPES) | {"bool"}
    assert decodable == set(kcoral_worker.DTYPE_SIZES)


def test_error_kinds_agree():
    assert client._ERROR_KINDS == kcoral_worker.ERROR_KINDS


# --- path normalisation (docs/protocol.md §6.7) --------------------------------------------

COMPONENTS = st.sampled_from(["a", "b", "é", ".", "..", "", " ", "x" * 255, "x" * 256, "é" * 127 + "e",
                              "é" * 128, "a\\b", "a\0", "\udc80", "\ud800", "\U0001f600", ".hidden"])
PATHS = st.one_of(
    st.lists(COMPONENTS, max_size=6).map("/".join),
    st.lists(COMPONENTS, min_size=1, max_size=4).map(lambda c: "/" + "/".join(c)),
    st.text(max_size=40),
    st.lists(st.just("d" * 200), min_size=19, max_size=22).map("/".join),  # around 4096 bytes
)


@EXAMPLES
@given(PATHS)
def test_path_normalisation_agrees(path):
    assert outcome(client._normalize_path, path) == outcome(kcoral_worker.normalize_path, path)


@given(st.one_of(st.none(), st.integers(), st.binary(max_size=4), st.lists(st.text(max_size=2), max_size=2)))
def test_non_string_paths_are_refused_by_both(value):
    assert outcome(client._normalize_path, value) == outcome(kcoral_worker.normalize_path, value) == \
        ("refused", None)


# --- file-upload path conflicts (docs/protocol.md §6.8) --------------------------------------

FILE_PATHS = st.lists(st.lists(st.sampled_from(["a", "b", "a-b", "ab"]), min_size=1, max_size=3).map("/".join),
                      max_size=6)


def client_accepts_paths(paths):
    program = client.Program()
    program._with_file_paths(paths)
    return True


def server_accepts_paths(paths):
    claimed = {}
    for path in paths:
        kcoral.claim_file_path(claimed, path, "instruction")
    return True


@EXAMPLES
@given(FILE_PATHS)
def test_file_path_conflicts_agree(paths):
    for n in range(len(paths) + 1):  # the same first offending path, not only the same verdict
        assert outcome(client_accepts_paths, paths[:n]) == outcome(server_accepts_paths, paths[:n]), paths[:n]


# --- strict JSON (docs/protocol.md §5.1) -----------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20)


def json_variants():
    encoded = JSON_VALUES.map(lambda v: json.dumps(v).encode())
    return st.one_of(
        encoded,
        JSON_VALUES.map(lambda v: json.dumps(v, ensure_ascii=False).encode()),
        encoded.map(lambda b: b"\xef\xbb\xbf" + b),
        st.tuples(encoded, st.sampled_from([b" x", b"{}", b"\n", b" 1", b"\x00"])).map(b"".join),
        st.sampled_from([b'{"a": 1, "a": 2}', b'[{"x": {"y": 1, "y": 1}}]', b"NaN", b"[Infinity]", b"-Infinity",
                         b"[1e400]", b'"\\ud800"', b"\xff", b'"\xc3"', b"", b" ", b"1" * 5000, b"[" * 3000]),
        st.binary(max_size=30),
    )


def same_json(a, b):
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@EXAMPLES
@given(json_variants())
def test_strict_json_agrees(data):
    (client_verdict, client_value), (server_verdict, server_value) = \
        outcome(client._strict_json, data), outcome(kcoral.strict_json, data)
    assert client_verdict == server_verdict, data[:200]
    assert same_json(client_value, server_value)


# --- multipart framing and part headers (docs/protocol.md §4.4-4.5) ----------------------------

HEADER_VARIANTS = st.sampled_from([
    'Content-Disposition: form-data; name="{name}"',
    "Content-Disposition: form-data; name={name}",
    'content-disposition: FORM-DATA; name="{name}"; filename="x.bin"',
    'Content-Disposition: form-data; name="{name}"; name="{name}"',
    'Content-Disposition: attachment; name="{name}"',
    "Content-Disposition: form-data",
    'Content-Disposition: form-data; name=""',
    'Content-Disposition: form-data; name="{name}"; charset=utf-8; charset=latin-1',
    'Content-Disposition: form-data ; name = "{name}" ;',
    'Content-Disposition: form-data;; name="{name}"',
    'Content-Disposition: form-data; name="{name}"; filename="a\\"b"',
    'Content-Disposition: form-data; name="{name}"; filename="unterminated',
    "Content-Disposition: form-data; name={name}; flag",
    'Content-Disposition: form-data; NAME="{name}"',
    'Content-Disposition: form-data name="{name}"',
    'Content-Disposition : form-data; name="{name}"',
    'Content-Disposition:form-data;name="{name}"',
])
TYPE_VARIANTS = st.sampled_from(["Content-Type: application/octet-stream", "Content-Type: APPLICATION/JSON",
                                 "Content-Type: application/", "Content-Type: /json", "Content-Type:",
                                 "Content-Type: application/json; q", "Content-Type: text/plain; a=\"b;c\"",
                                 "Content-Type: application/json; charset=utf-8", "Content-Type: multipart/mixed",
                                 "Content-Type: text/plain", ""])
ENCODING_VARIANTS = st.sampled_from(["", "Content-Transfer-Encoding: binary", "Content-Transfer-Encoding: 8BIT",
                                     "Content-Transfer-Encoding: base64", "X-Extra: yes", "not a header line",
                                     " folded continuation"])


@st.composite
def multipart_bodies(draw):
    boundary = draw(st.sampled_from(["b", "kcoral-0123", "x y", "---"]))
    nl = draw(st.sampled_from([b"\r\n", b"\n"]))
    parts = []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["program", "blob:" + "a" * 64, "result", "return:0"]))
        lines = [draw(HEADER_VARIANTS).format(name=name), draw(TYPE_VARIANTS), draw(ENCODING_VARIANTS)]
        header = nl.join(line.encode() for line in lines if line)
        payload = draw(st.binary(max_size=12) | st.sampled_from([b"--" + boundary.encode(), nl + b"--x"]))
        parts.append(header + nl + nl + payload)
    delimiter = b"--" + boundary.encode()
    padding = draw(st.sampled_from([b"", b" \t"]))
    body = draw(st.sampled_from([b"", b"preamble" + nl]))
    for part in parts:
        body += delimiter + padding + nl + part + nl
    body += draw(st.sampled_from([delimiter + b"--", delimiter + b"--" + nl + b"epilogue", b""]))
    cut = draw(st.integers(0, len(body)))
    if draw(st.booleans()):
        body = body[:cut]  # truncated bodies too
    return body, boundary


def server_parts(body, boundary):
    ranges = kcoral.multipart_ranges(body, boundary.encode())
    return [(*kcoral.check_part_headers(headers), bytes(body[start:end])) for headers, start, end in ranges]


def client_parts(body, boundary):
    return [(name, media, bytes(payload)) for name, media, payload in client._parse_multipart(body, boundary)]


@EXAMPLES
@given(multipart_bodies())
def test_multipart_parsing_agrees(case):
    body, boundary = case
    assert outcome(client_parts, body, boundary) == outcome(server_parts, body, boundary), body


@EXAMPLES
@given(st.binary(max_size=200), st.lists(st.binary(max_size=64), max_size=4, unique=True))
def test_client_request_encoding_parses_on_the_server(program_json, payloads):
    blobs = [(kcoral_worker.hashlib.sha256(p).hexdigest(), p) for p in payloads]
    body = b"".join(client._multipart_chunks("kcoral-test", program_json, blobs))
    split = kcoral.split_request(body, "multipart/form-data; boundary=kcoral-test")
    assert bytes(split.program_json) == program_json
    assert {h: bytes(p) for h, p in split.supplied.items()} == dict(blobs)


# --- tensor to bytes: what the client uploads and what the server returns ---------------------

WIRE_DTYPES = [np.dtype(n) for n in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32",
                                     "float64")] + [np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn),
                                                    np.dtype(ml_dtypes.float8_e5m2)]
OTHER_DTYPES = [np.dtype(n) for n in ("uint16", "uint32", "complex64", "float128")]


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(WIRE_DTYPES + OTHER_DTYPES))
    if dtype.kind in "iuf" and draw(st.booleans()):
        dtype = dtype.newbyteorder(">")
    elements = st.integers(0, 1) if dtype.kind == "b" else None
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4))
    if dtype.kind == "V" or dtype.name.startswith(("bfloat", "float8")):
        array = np.frombuffer(draw(st.binary(min_size=int(np.prod(shape)) * dtype.itemsize,
                                             max_size=int(np.prod(shape)) * dtype.itemsize)), dtype=dtype)
        array = array.reshape(shape)
    else:
        array = draw(hnp.arrays(dtype, shape, elements=elements))
    if array.ndim > 1 and draw(st.booleans()):
        array = array.T  # not C-contiguous
    return array


def client_tensor(array):
    dtype, shape, data = client._tensor_payload(array, None, None)
    return dtype, shape, bytes(data)


def server_tensor(array):
    dtype, shape, data = kcoral_worker.tensor_bytes(array)
    return dtype, shape, bytes(data)


@EXAMPLES
@given(arrays())
def test_tensor_bytes_agree(array):
    assert outcome(client_tensor, array) == outcome(server_tensor, array), (array.dtype, array.shape)


def test_zero_dimensional_arrays_differ_only_by_the_published_quirk():
    """0.1.1's client uploads np.array(5) with shape [1] (docs/client.md §3.4, kept
    for compatibility); the server returns it with shape []. Same dtype, same bytes."""
    value = np.array(5, dtype=np.int32)
    assert client_tensor(value) == ("int32", [1], value.tobytes())
    assert server_tensor(value) == ("int32", [], value.tobytes())


# --- folder walks: the client's upload_folder and the server's folder return -------------------

NAMES = st.sampled_from(["a", "b", ".hidden", "é", "sub", "x.bin", "A", "a b"])
TREES = st.dictionaries(st.lists(NAMES, min_size=1, max_size=3).map("/".join), st.binary(max_size=8), max_size=6)
SPECIALS = st.sampled_from([None, "symlink", "dangling symlink", "fifo", "socket", "empty dir"])


def build_tree(root, files, special):
    written = {}
    for rel, data in files.items():
        path = os.path.join(root, rel)
        if any(os.path.isfile(os.path.join(root, *rel.split("/")[:i])) for i in range(1, rel.count("/") + 1)):
            continue  # a parent of this file is already a file
        if os.path.isdir(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        written[rel] = data
    target = os.path.join(root, "special")
    if special == "symlink":
        os.symlink(".", target)
    elif special == "dangling symlink":
        os.symlink("nowhere", target)
    elif special == "fifo":
        os.mkfifo(target)
    elif special == "socket":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(target)
    elif special == "empty dir":
        os.mkdir(target)


def client_walk(root):
    return dict(client._snapshot_folder(root))


def server_walk(root):
    fd = os.open(os.path.dirname(root), os.O_RDONLY | os.O_DIRECTORY)
    try:
        files, _ = kcoral_worker.collect_folder(fd, os.path.basename(root), 1 << 30)
    finally:
        os.close(fd)
    return {rel: bytes(data) for rel, data in files.items()}


@EXAMPLES
@given(TREES, SPECIALS)
def test_folder_walks_agree(files, special):
    assume(files or special)
    with tempfile.TemporaryDirectory() as scratch:
        root = os.path.join(scratch, "folder")
        os.mkdir(root)
        build_tree(root, files, special)
        client_outcome, server_outcome = outcome(client_walk, root), outcome(server_walk, root)
    assert client_outcome == server_outcome, (files, special)


# --- the size limit's words (docs/client.md §4.10) ----------------------------------------

@EXAMPLES
@given(st.one_of(st.none(), st.integers(min_value=0, max_value=1 << 50)), st.integers(min_value=1, max_value=1 << 50))
def test_the_413_and_the_clients_refusal_say_the_same(size, limit):
    assert client._request_too_large_message(size, limit) == kcoral.request_too_large_message(size, limit)
