"""Bounded cost for every input: the blob store, the multipart and program parsers, Content-Length
framing and the body budget, measured against a real server (time, RSS through /proc, files).

Each attack is an *item* taking a Scale and returning what it measured; the test beside it holds
the bounds.  The tests run at CI size; at full size (`python -m tests.test_bounds`, the figures in
docs/reliability-hostile.md) the same tests run once at the sizes the attacks were first measured
at, on one CPU worker.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import select
import sys
import tempfile
import threading
import time
import tracemalloc
import types

import pytest

import kcoral
from kcoral_worker import ValidationError
from tests.support import (
    Sampler,
    assert_error_body,
    cpu_seconds,
    get_fn,
    health_latency,
    join_threads,
    multipart,
    post_raw,
    prog,
    program_parts,
    ref,
    request,
    ret,
    rss_kib,
    run,
    simple_program,
    unread_bytes,
    up_blob,
    up_module,
    wait_for,
)
from tests.test_hostile import connect, flags
from tests.test_reliability import Server


@dataclasses.dataclass(frozen=True)
class Scale:
    name: str
    blobs: int              # distinct 8-byte `bytes` uploads in one request ...
    blob_seconds: float     # ... answered within this
    parts: int              # tiny parts in one body ...
    parts_seconds: float    # ... refused within this
    parts_rss_mib: int      # ... with at most this front-end RSS growth
    budget_mib: int         # --max-body-bytes-in-flight for the tricklers (0: default)
    rate_window: float      # --body-rate-window-seconds (0: default) ...
    rate_min: int           # ... and --body-rate-min-bytes the tricklers keep up
    admission_wait: float   # --body-admission-wait-seconds
    tiny_files: int         # distinct 8-byte file blobs uploaded to a small disk cache


CI = Scale("ci", blobs=8000, blob_seconds=8.0, parts=200_000, parts_seconds=3.0, parts_rss_mib=128, budget_mib=8,
           rate_window=2.0, rate_min=1024, admission_wait=10.0, tiny_files=1200)
FULL = Scale("full", blobs=20_000, blob_seconds=10.0, parts=200_000, parts_seconds=3.0, parts_rss_mib=128,
             budget_mib=0, rate_window=0, rate_min=0, admission_wait=60.0, tiny_files=1200)


def limits(**values):
    return dataclasses.replace(kcoral.DEFAULT_LIMITS, **values)


def eight_bytes(i):
    return b"%08d" % i


# --- 1. the blob store ---------------------------------------------------------------------------

def test_cache_entry_overhead_covers_what_an_entry_costs():
    """What a cached 8-byte blob keeps alive beyond its payload (key, tuple, bytes object, dict slot),
    measured with tracemalloc at several sizes (the dict grows in steps), stays within the charge."""
    tracemalloc.start()
    try:
        worst = 0.0
        for n in (1000, 5462, 21846, 43691):
            cache = kcoral.MemoryCache(1 << 40, 1 << 30)
            before = tracemalloc.get_traced_memory()[0]
            for i in range(n):
                cache.put(hashlib.sha256(eight_bytes(i)).hexdigest(), bytes(eight_bytes(i)))
            worst = max(worst, (tracemalloc.get_traced_memory()[0] - before) / n - 8)
            del cache
    finally:
        tracemalloc.stop()
    assert 100 < worst <= kcoral.CACHE_ENTRY_OVERHEAD, worst


def fill_seconds(cache, n, start=0):
    started = time.perf_counter()
    for i in range(start, start + n):
        cache.put(f"{i:064x}", bytes(eight_bytes(i)))
    return time.perf_counter() - started


def test_memory_cache_insert_and_eviction_are_amortized_constant():
    """Inserting into a full cache whose LRU end is pinned: 8 times the inserts take about 8 times as
    long (a scan per insert made it 64 times), and the byte and entry budgets hold throughout."""
    entry = 8 + kcoral.CACHE_ENTRY_OVERHEAD
    cache = kcoral.MemoryCache(2000 * entry, 1500)
    fill_seconds(cache, 1500)
    pinned = [f"{i:064x}" for i in range(1000)]  # the 1000 least recently used ones
    cache.pin(pinned)
    small = fill_seconds(cache, 5000, 10_000)
    large = fill_seconds(cache, 40_000, 100_000)
    assert len(cache) <= 1500 and cache.size <= 2000 * entry, (len(cache), cache.size)
    assert all(cache.get(d) is not None for d in pinned), "a pinned entry was evicted"
    assert large <= 8 * small * 2.5 + 0.05, (small, large)
    cache.unpin(pinned)
    fill_seconds(cache, 1500, 200_000)
    assert all(cache.get(d) is None for d in pinned), "unpinned entries were never evicted"


def test_memory_cache_entry_limit():
    cache = kcoral.MemoryCache(1 << 30, 100)
    fill_seconds(cache, 1000)
    assert len(cache) == 100 and cache.get(f"{999:064x}") is not None and cache.get(f"{0:064x}") is None


def test_disk_cache_charges_blocks_and_counts_files(tmp_path):
    """1-byte blobs cost a block each, and the file limit holds: the directory never holds more
    files than either budget allows (a byte count would have let all 3000 in)."""
    by_blocks = kcoral.DiskCache(str(tmp_path / "blocks"), 256 << 10, 100_000)
    by_count = kcoral.DiskCache(str(tmp_path / "count"), 1 << 30, 300)
    for i in range(3000):
        data = eight_bytes(i)[-1:] + eight_bytes(i)  # 9 distinct bytes
        by_blocks.put(hashlib.sha256(data).hexdigest(), data)
        by_count.put(hashlib.sha256(data).hexdigest(), data)
    for cache, budget_bytes, budget_files in ((by_blocks, 256 << 10, 100_000), (by_count, 1 << 30, 300)):
        files, blocks = cache_usage(os.path.dirname(cache.root))
        assert files <= budget_files and blocks <= budget_bytes, (files, blocks)
        assert files > 0
    assert cache_usage(os.path.dirname(by_blocks.root))[0] < 3000


def test_a_new_blob_is_linked_for_its_tenant_even_over_a_link_to_a_lost_copy(tmp_path):
    """A new blob is linked for its tenant while still staged, then renamed into place; where the
    tenant's link already exists (to a copy whose <hash> was lost), it is replaced once the new one
    is in place.  Nothing staged is left behind, and another tenant never finds it."""
    cache = kcoral.DiskCache(str(tmp_path), 1 << 20, 100)
    data = b"a blob"
    digest = hashlib.sha256(data).hexdigest()
    cache.put(digest, data, "alice")
    assert cache.get(digest, "alice") == data and cache.get(digest, "bob") is None
    os.unlink(cache.path(digest))  # alice's link outlives the copy it named
    assert cache.get(digest, "alice") is None
    cache.put(digest, data, "alice")
    assert cache.get(digest, "alice") == data and cache.get(digest, "bob") is None
    assert os.path.samefile(cache.path(digest), cache.path(digest) + "+alice")
    assert sorted(os.listdir(os.path.dirname(cache.path(digest)))) == [digest, digest + "+alice"]


def test_a_file_read_with_no_blocks_during_writeback_is_still_charged_its_blocks(tmp_path):
    """ext4 reports st_blocks 0 for a file while writeback allocates its blocks: the cache charges
    such a file its size in whole blocks (it kept a 257th 4 KiB blob in 1 MiB when it charged 0)."""
    written = tmp_path / "blob"
    written.write_bytes(b"8 bytes!")
    info = os.stat(written)
    mid_writeback = os.stat_result(tuple(info[:10]), {"st_blocks": 0, "st_blksize": info.st_blksize})
    assert mid_writeback.st_blocks == 0 and mid_writeback.st_size == 8
    assert kcoral.disk_cost(mid_writeback) == kcoral.DISK_BLOCK
    assert kcoral.disk_cost(info) == max(info.st_blocks * 512, kcoral.DISK_BLOCK)


def file_blob_store(tmp_path, release):
    """A BlobStore whose disk writes wait for `release`: the answer must not."""
    store = kcoral.BlobStore(dataclasses.replace(kcoral.DEFAULT_LIMITS, disk_cache_dir=str(tmp_path),
                                                 disk_cache_capacity_mbytes=256))
    put_all = store.disk.put_all
    store.disk.put_all = lambda items, tenant="": (release.wait(30), put_all(items, tenant))
    return store


def test_file_blobs_not_yet_on_disk_are_found_and_the_memory_they_hold_is_bounded(tmp_path):
    """Until its disk writes land, a request's file blobs are served from the body they arrived in
    (a later request never misses them); past UNWRITTEN_LIMIT of such bodies, a request waits for its writes."""
    release = threading.Event()
    store = file_blob_store(tmp_path, release)
    small, large = bytearray(os.urandom(1000)), bytearray(kcoral.UNWRITTEN_LIMIT + 1)
    programs = {}
    for name, body in (("small", small), ("large", large)):
        digest = hashlib.sha256(body).hexdigest()
        programs[name] = (digest, types.SimpleNamespace(blob_kinds={digest: {"file"}}))
        writes = store.keep_file_blobs(programs[name][1], {digest: memoryview(body)})
        if name == "small":
            store.settle_file_blobs(writes)  # returns although the write waits
            assert writes.is_alive()
            blobs, missing = store.resolve(programs[name][1], {})
            assert missing == [] and bytes(blobs[digest]) == bytes(small)
    settled = threading.Thread(target=store.settle_file_blobs, args=(writes,))
    settled.start()
    settled.join(0.5)
    assert settled.is_alive(), "a request holding more than UNWRITTEN_LIMIT answered before its writes"
    release.set()
    settled.join(30)
    writes.join(30)
    assert store.unwritten == {} and store.unwritten_bytes == 0
    for digest, program in programs.values():
        assert store.resolve(program, {})[1] == [] and store.disk.get(digest) is not None


def test_file_blob_writes_outlive_the_daemon_thread_of_their_connection(tmp_path):
    """An exiting server finishes its disk writes: their thread is no daemon, although the
    connection thread that creates it is one (ThreadingHTTPServer.daemon_threads)."""
    store = file_blob_store(tmp_path, threading.Event())
    body = bytearray(os.urandom(100))
    digest = hashlib.sha256(body).hexdigest()
    made = []
    connection = threading.Thread(target=lambda: made.append(store.keep_file_blobs(
        types.SimpleNamespace(blob_kinds={digest: {"file"}}), {digest: memoryview(body)})), daemon=True)
    connection.start()
    connection.join(30)
    assert made[0].daemon is False


def cache_usage(directory):
    """(files, bytes of blocks) under a disk cache directory, its lock file left out.  A file is an
    inode, counted once however many names link to it (each tenant that supplied a blob has one)."""
    seen = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            if name != ".lock":
                info = os.lstat(os.path.join(folder, name))
                seen[info.st_dev, info.st_ino] = info.st_blocks * 512
    return len(seen), sum(seen.values())


def settled_cache_usage(directory, timeout=30.0):
    """cache_usage once the disk cache stopped changing: an answer does not wait for the disk
    writes of its file blobs (the next request finds them in memory meanwhile)."""
    last, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            now = cache_usage(directory)
        except FileNotFoundError:  # evicted while counted
            now = None
        if now is not None and now == last:
            break
        last = now
        time.sleep(0.3)
    return last


def many_blobs_item(scale, workdir):
    """One request with `scale.blobs` distinct 8-byte `bytes` uploads -> its answer, how long it took,
    the slowest /health answer meanwhile, the server's exit code."""
    server, figures = Server(workdir, workers=1), {}
    try:
        blobs = [eight_bytes(i) for i in range(scale.blobs)]
        program = prog(up_module("m", "def f(*xs):\n    return sum(len(x) for x in xs)\n"),
                       *[up_blob(f"b{i}", "bytes", blob) for i, blob in enumerate(blobs)],
                       get_fn("fn", "m", "f"), run("r", "fn", *[ref(f"b{i}") for i in range(len(blobs))]),
                       ret("out", "r"))
        body, content_type = multipart(program_parts(program, blobs))
        with Sampler(lambda: health_latency(server.url), interval=0.05) as health:
            started = time.monotonic()
            status, _, data = request("POST", server.url + "/execute", body, {"Content-Type": content_type}, 300)
            seconds = time.monotonic() - started
        figures |= {"blobs": scale.blobs, "body MB": round(len(body) / 1e6, 1), "status": status,
                    "out": json.loads(data)["results"]["out"]["value"] if status == 200 else data[:300],
                    "answered after s": seconds, "slowest /health s": max(health.values)}
    finally:
        figures["exit code"] = server.stop()
    return figures


def test_many_blobs_in_one_request(tmp_path, record_property, scale=CI):
    """Answered 200 with every blob seen, within the bound, /health answering within 1 s all along."""
    got = many_blobs_item(scale, str(tmp_path))
    record_property("figures", got)
    assert got["status"] == 200 and got["out"] == 8 * scale.blobs, got
    assert got["answered after s"] <= scale.blob_seconds, got
    assert got["slowest /health s"] <= 1.0, got
    assert got["exit code"] == 0, got


TINY_FILE_CACHES = ((1, 100_000), (1024, 200))  # (--disk-cache-capacity-mbytes, --disk-cache-max-files)


def tiny_files_item(scale, workdir):
    """Distinct 8-byte `file` blobs uploaded 400 a request to each of TINY_FILE_CACHES -> per cache,
    the statuses of the uploads, the files and bytes of blocks the disk cache kept, the exit code."""
    figures = {}
    for capacity_mib, max_files in TINY_FILE_CACHES:
        server = Server(workdir, "--disk-cache-capacity-mbytes", str(capacity_mib),
                        "--disk-cache-max-files", str(max_files), workers=1)
        cache = figures[capacity_mib, max_files] = {"not 200": []}
        try:
            for start in range(0, scale.tiny_files, 400):
                blobs = [b"f%07d" % i for i in range(start, min(start + 400, scale.tiny_files))]
                program = prog(*[up_blob(f"f{i}", "file", blob, path=f"d/{i}") for i, blob in enumerate(blobs)])
                body, content_type = multipart(program_parts(program, blobs))
                status, _, data = request("POST", server.url + "/execute", body, {"Content-Type": content_type})
                if status != 200:
                    cache["not 200"].append((status, data[:300]))
            cache["files"], cache["block bytes"] = settled_cache_usage(server.disk_cache)
        finally:
            cache["exit code"] = server.stop()
    return figures


def test_tiny_file_blobs_are_charged_blocks_and_counted(tmp_path, record_property, scale=CI):
    """Distinct 8-byte `file` blobs into a 1 MiB disk cache: charged a 4 KiB block each, at most 256
    of them stay (charged by bytes, all would), and with --disk-cache-max-files the count holds."""
    got = tiny_files_item(scale, str(tmp_path))
    record_property("figures", got)
    for (capacity_mib, max_files), cache in got.items():
        assert cache["not 200"] == [] and cache["exit code"] == 0, cache
        assert 0 < cache["files"] <= max_files and cache["block bytes"] <= capacity_mib << 20, cache
        assert cache["files"] < scale.tiny_files, cache
    assert set(got) == set(TINY_FILE_CACHES), got


# --- 2. parsing ----------------------------------------------------------------------------------

BOUNDARY = "bounds"
CT = f"multipart/form-data; boundary={BOUNDARY}"


def part(name, payload=b"x", content_type="application/octet-stream", extra=()):
    head = [f'Content-Disposition: form-data; name="{name}"', f"Content-Type: {content_type}", *extra]
    return f"--{BOUNDARY}\r\n".encode() + "\r\n".join(head).encode() + b"\r\n\r\n" + payload + b"\r\n"


def body_of(*parts):
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def program_part(program):
    return part("program", json.dumps(program).encode(), "application/json")


def blob_part(data):
    return part(f"blob:{hashlib.sha256(data).hexdigest()}", data)


BYTES_PROGRAM = prog(up_blob("b", "bytes", b"one"), ret("out", "b"))


def refused(body, limit_values, error=ValidationError):
    """split_request and the program's validation on `body` under these limits -> the error's message."""
    with pytest.raises(error) as caught:
        kcoral.split_request(body, CT, limits(**limit_values)).program()
    return str(caught.value)


def test_parts_beyond_the_hard_cap_are_refused_as_too_large():
    body = body_of(*[blob_part(eight_bytes(i)) for i in range(11)], program_part(BYTES_PROGRAM))
    assert "more than 10 multipart parts" in refused(body, {"max_request_parts": 10}, kcoral.RequestTooLarge)


def test_a_program_first_allows_one_part_per_referenced_blob():
    """The program comes first: the part after its one blob is refused before the rest is parsed
    (the body's malformed tail is never reached), with what the full parse would have said."""
    tail = b"--" + BOUNDARY.encode() + b"\r\nno headers, no end" * 1000
    body = program_part(BYTES_PROGRAM) + blob_part(b"one") + blob_part(b"two") + tail
    assert "unreferenced blob part" in refused(body, {})
    body = program_part(BYTES_PROGRAM) + blob_part(b"one") + blob_part(b"one") + tail
    assert "duplicate blob part" in refused(body, {})
    exact = body_of(program_part(BYTES_PROGRAM), blob_part(b"one"))
    assert bytes(kcoral.split_request(exact, CT).supplied[hashlib.sha256(b"one").hexdigest()]) == b"one"


def test_part_header_lines_and_bytes_are_capped():
    many = body_of(program_part(BYTES_PROGRAM), part("blob:" + "a" * 64, extra=["X-A: 1"] * 20))
    assert "more than 16 header lines" in refused(many, {})
    long = body_of(part("blob:" + "a" * 64, extra=["X-A: " + "a" * 20_000]), program_part(BYTES_PROGRAM))
    assert "headers exceed 16384 bytes" in refused(long, {})


def test_a_blob_part_as_our_client_writes_it_parses_as_any_other_header_block():
    """kcoral.PLAIN_BLOB_HEADERS: the header block our client writes is read without the line parser,
    to the same headers as the parser's (which a block with lower-case names takes), under the same caps."""
    digest = hashlib.sha256(b"one").hexdigest()
    plain = part("blob:" + digest, b"one").split(b"\r\n", 1)[1]
    assert kcoral.PLAIN_BLOB_HEADERS.match(plain)
    lower = plain.replace(b"Content-Disposition", b"content-disposition").replace(b"Content-Type", b"content-type")
    assert not kcoral.PLAIN_BLOB_HEADERS.match(lower)
    assert kcoral.parse_part_headers(plain, 0, len(plain), kcoral.DEFAULT_LIMITS) == \
        kcoral.parse_part_headers(lower, 0, len(lower), kcoral.DEFAULT_LIMITS)
    body = body_of(part("blob:" + digest, b"one"), program_part(BYTES_PROGRAM))  # the blob's block read first
    assert "more than 1 header lines" in refused(body, {"max_part_header_lines": 1})
    assert "headers exceed 100 bytes" in refused(body, {"max_part_header_bytes": 100})


def test_program_size_values_instructions_and_arguments_are_capped():
    def program_with(*extra, args=()):
        return prog(up_module("m", "def f(*a):\n    return 1\n"), get_fn("fn", "m", "f"), run("r", "fn", *args),
                    ret("out", "r"), *extra)
    big = body_of(program_part(program_with(args=["x" * 2000])))
    assert "exceeds 1000 bytes" in refused(big, {"max_program_bytes": 1000}, kcoral.RequestTooLarge)
    values = body_of(program_part(program_with(args=[[[], []]] * 100)))
    assert "more than 200 JSON values" in refused(values, {"max_program_values": 200}, kcoral.RequestTooLarge)
    commas_in_strings = body_of(program_part(program_with(args=[",[{" * 1000])))
    assert kcoral.split_request(commas_in_strings, CT, limits(max_program_values=200)).program()
    many = body_of(program_part(program_with(*[up_module(f"m{i}", "") for i in range(10)])))
    assert "more than 12 instructions" in refused(many, {"max_program_instructions": 12}, kcoral.RequestTooLarge)
    args = body_of(program_part(program_with(args=list(range(11)))))
    assert "more than 10 arguments" in refused(args, {"max_run_args": 10}, kcoral.RequestTooLarge)


def test_limits_answer_with_the_protocols_error_bodies(tmp_path):
    """Over HTTP: a size limit is 413 request_too_large, a malformed part 400 parse, and the server serves on."""
    with Server(str(tmp_path), "--max-program-instructions", "3", "--max-request-parts", "3", workers=1) as server:
        too_many = prog(up_module("m", ""), up_module("n", ""), up_module("o", ""), up_module("p", ""))
        assert_error_body(*post_raw(server.url, body_of(program_part(too_many)), CT), 413, "request_too_large",
                          "more than 3 instructions")
        parts = body_of(*[blob_part(eight_bytes(i)) for i in range(4)], program_part(BYTES_PROGRAM))
        assert_error_body(*post_raw(server.url, parts, CT), 413, "request_too_large", "more than 3 multipart parts")
        headers = body_of(part("program", b"{}", "application/json", extra=["X-A: 1"] * 17))
        assert_error_body(*post_raw(server.url, headers, CT), 400, "parse", "header lines")
        status, _, body = post_raw(server.url, body_of(program_part(BYTES_PROGRAM), blob_part(b"one")), CT)
        assert status == 200 and body["results"]["out"]["type"] == "bytes", body


def many_parts_item(scale, workdir):
    """Bodies of `scale.parts` tiny parts (about 19 MiB), sent whole -> per body, its answer, the
    front-end's CPU seconds and RSS growth meanwhile; then /health's latency and the exit code."""
    server = Server(workdir, workers=1)
    bodies = {
        "named x, no program": body_of(*[part("x")] * scale.parts),
        "program first": body_of(program_part(BYTES_PROGRAM), *[part("x")] * scale.parts),
        "blob parts, program last": body_of(*[blob_part(b"%d" % i) for i in range(scale.parts)],
                                            program_part(BYTES_PROGRAM)),
    }
    figures = {}
    try:
        for name, body in bodies.items():
            before, cpu_before = rss_kib(server.pid), cpu_seconds(server.pid)
            with Sampler(lambda: rss_kib(server.pid)) as rss:
                started = time.monotonic()
                status, _, data = request("POST", server.url + "/execute", body, {"Content-Type": CT})
                seconds = time.monotonic() - started
            figures[name] = {"MiB": round(len(body) / 2**20), "status": status, "answer": data[:120],
                             "seconds": seconds, "CPU s": cpu_seconds(server.pid) - cpu_before,
                             "RSS growth MiB": (max(rss.values) - before) / 1024}
        figures["/health s"] = health_latency(server.url)
    finally:
        figures["exit code"] = server.stop()
    return figures


def test_many_tiny_parts_are_refused_quickly(tmp_path, record_property, scale=CI):
    """Refused within the bound of the front-end's CPU time (its own work, whatever else runs), its
    RSS growing by at most the bound (the body itself included); /health answers at once after."""
    got = many_parts_item(scale, str(tmp_path))
    record_property("figures", got)
    bodies = {name: body for name, body in got.items() if isinstance(body, dict)}
    assert len(bodies) == 3, got
    for name, body in bodies.items():
        assert body["status"] in (400, 413), (name, body)
        assert body["CPU s"] <= scale.parts_seconds, (name, body)
        assert body["RSS growth MiB"] <= scale.parts_rss_mib, (name, body)
    assert got["/health s"] < 1.0, got
    assert got["exit code"] == 0, got


# --- 4. the body budget --------------------------------------------------------------------------

def tricklers_item(scale, workdir):
    """Three clients each declaring nearly a third of the body budget and trickling it at the least
    rate allowed; a fourth uploads a body of half the budget (200 MiB at most) normally -> its answer
    and how long it took, whether the three were still held then, the exit code."""
    budget = (scale.budget_mib or 768) << 20
    window = scale.rate_window or 30.0
    piece = scale.rate_min or 64 << 10
    # the whole-body average at the window's own rate, so the least rate allowed is the window's
    server = Server(workdir, *flags(max_body_bytes_in_flight=scale.budget_mib << 20,
                                    body_rate_window_seconds=scale.rate_window, body_rate_min_bytes=scale.rate_min,
                                    body_min_average_bytes_per_second=int(piece / window),
                                    body_admission_wait_seconds=scale.admission_wait), workers=1)
    program = json.dumps(prog(up_module("m", "def f(x):\n    return len(x)\n"), up_blob("b", "bytes", "0" * 64),
                              get_fn("fn", "m", "f"), run("r", "fn", ref("b")), ret("out", "r"))).encode()
    head = (f"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: {CT}\r\n"
            f"Content-Length: {budget * 3 // 10}\r\n\r\n").encode() + part("program", program, "application/json")
    tricklers, stop, figures = [], threading.Event(), {}
    try:
        for _ in range(3):
            sock = connect(server.port, timeout=10)
            sock.sendall(head + b"p" * piece)
            tricklers.append(sock)
        for sock in tricklers:  # the server reads them: admitted, holding what they declared or what they sent
            client_port = sock.getsockname()[1]
            assert wait_for(lambda: unread_bytes(server.port, client_port) == 0, 10, 0.01), \
                "a trickler's body was never read"

        def trickle():
            while not stop.wait(window * 0.4):
                for sock in tricklers:
                    sock.sendall(b"p" * piece)

        trickling = threading.Thread(target=trickle, daemon=True)
        trickling.start()
        blob = os.urandom(min(budget // 2, 200 << 20))  # within --max-request-bytes
        program = prog(up_module("m", "def f(x):\n    return len(x)\n"), up_blob("b", "bytes", blob),
                       get_fn("fn", "m", "f"), run("r", "fn", ref("b")), ret("out", "r"))
        body, content_type = multipart(program_parts(program, [blob]))
        started = time.monotonic()
        status, _, data = request("POST", server.url + "/execute", body, {"Content-Type": content_type},
                                  scale.admission_wait * 3)
        seconds = time.monotonic() - started
        still_held = [not select.select([sock], [], [], 0)[0] for sock in tricklers]  # no answer, not closed
        stop.set()
        join_threads([trickling], 60)
        figures |= {"budget MiB": budget >> 20, "tricklers": f"3 declaring {budget * 3 // 10 >> 20} MiB each",
                    "upload bytes": len(blob), "status": status,
                    "out": json.loads(data)["results"]["out"]["value"] if status == 200 else data[:300],
                    "answered after s": seconds, "tricklers still held": still_held}
    finally:
        stop.set()
        for sock in tricklers:
            sock.close()
        figures["exit code"] = server.stop()
    return figures


def test_tricklers_do_not_hold_the_body_budget(tmp_path, record_property, scale=CI):
    """The fourth upload gets 200 at once, while the three tricklers are still being read."""
    got = tricklers_item(scale, str(tmp_path))
    record_property("figures", got)
    assert got["status"] == 200 and got["out"] == got["upload bytes"], got
    assert got["answered after s"] <= scale.admission_wait / 2, got
    assert got["tricklers still held"] == [True] * 3, "a trickler was cut: the fourth upload proves nothing"
    assert got["exit code"] == 0, got


def test_a_body_read_halfway_waits_for_room_then_proceeds():
    """Two bodies each larger than half the budget, read in turns: the first waiting takes all it
    declared beyond the budget, the other waits until it is released (no deadlock), and no more
    than the budget plus one body is ever reserved."""
    budget = kcoral.BodyBudget(1 << 20)
    first = kcoral.BodyReservation(budget, 800 << 10, 1.0)
    second = kcoral.BodyReservation(budget, 800 << 10, 1.0)
    for reservation in (first, second, first, second):
        assert reservation.grow()
        reservation.received = reservation.held
    assert first.grow() and first.held == 800 << 10  # beyond the budget: the whole rest
    assert budget.in_use <= (1 << 20) + (800 << 10)
    waited = []
    thread = threading.Thread(target=lambda: waited.append(second.grow()))
    thread.start()
    thread.join(0.2)
    assert thread.is_alive(), "the second body grew while the first was beyond the budget"
    first.release()
    join_threads([thread], 5)
    assert waited == [True] and second.held > 512 << 10
    second.release()
    assert budget.in_use == 0


# --- full size -----------------------------------------------------------------------------------

CHECKS = [("20 000 blobs", test_many_blobs_in_one_request), ("200 000 parts", test_many_tiny_parts_are_refused_quickly),
          ("three tricklers", test_tricklers_do_not_hold_the_body_budget),
          ("tiny file blobs", test_tiny_file_blobs_are_charged_blocks_and_counted)]

if __name__ == "__main__":
    for label, check in CHECKS:  # the tests themselves, at full size: the same bounds
        check(pathlib.Path(tempfile.mkdtemp()), lambda _, figures: print(f"{label}: {figures}", flush=True), FULL)
    sys.exit(0)


def test_a_timeout_past_floats_range_is_capped_by_the_server_not_an_internal_error():
    """options.timeout_seconds is any finite number > 0, and JSON's integers have no bound: 10**400
    is one, which the server's cap then applies to.  The check converted it to a float for
    math.isfinite: OverflowError, where the property test (test_multipart_and_program_properties)
    expects a verdict."""
    program = simple_program("def f():\n    return 1\n")
    for value, valid in ((10 ** 400, True), (0.5, True), (0, False), (-(10 ** 400), False)):
        text = json.dumps({**program, "options": {"timeout_seconds": value}}).encode()
        if valid:
            assert kcoral.parse_program(kcoral.strict_json(text)).options["timeout_seconds"] == value
        else:
            with pytest.raises(kcoral.ValidationError):
                kcoral.parse_program(kcoral.strict_json(text))
    with pytest.raises(kcoral.ValidationError):  # 1e400 decodes to inf
        kcoral.parse_program(kcoral.strict_json(json.dumps(program).encode()[:-1] + b', "options": {"timeout_seconds": 1e400}}'))
