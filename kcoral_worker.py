"""KCoral worker: the process that runs programs, and the wire helpers it shares.

The front-end (kcoral.py) forks workers from a warm template process (a
forkserver that imported torch, numpy and tvm_ffi; under `--sandbox bubblewrap`,
a template inside the slot's container, `template_main`).  A worker serves one
request at a time, running its instructions in order, and reports over a
multiprocessing pipe with the typed messages defined below (section "the
messages"), each a length-prefixed JSON object whose keys and value types the
receiver checks against the message's dataclass.  Nothing on a pipe is ever
unpickled: a worker runs uploaded code, so the front-end treats whatever it
sends as hostile input:

    worker -> front-end   WorkerReady | WorkerFailed      once, after the fork
    front-end -> worker   InitGpu -> GpuInitialized        GPU workers, once, under the lease
    front-end -> worker   JobRequest                       per request, then for captured output
                                                           the two pipe write ends as passed fds
    worker -> front-end   StageBlobs -> the memfd          at most once, when a blob's bytes are
                                                           first needed (a passed fd)
                          InstructionStarted               before each instruction
                          ReturnValue + raw parts          as each return completes
                          AcquireLease -> LeaseGranted     GPU workers only
                          ReleaseLease
                          RequestDone                      the request's last message
    front-end -> worker   StopWorker                       an idle worker exits
    front-end -> sandbox template   RequestSpace           once, its start-up argument
                                    ForkWorker + the worker's pipe as a passed fd
    sandbox template -> front-end   WorkerReady once, then WorkerForked and WorkerExited per worker
    evaluate -> kernel process      EvalLoad and EvalPublish, answered by EvalOutputs; EvalStage (+ a
                                    region's memfd as a passed fd), EvalInputsBack, answered by EvalDone;
                                    EvalGo, answered by EvalDone twice (armed; continued, the round).
                                    The kernel process stops itself after every answer.

Payloads travel raw.  The front-end stages the request's blobs in sealed memfds
(indexed by hash in JobRequest.blob_index, passed when the worker sends StageBlobs),
from which the worker maps a large `bytes` blob (MappedBytes), reads any other straight
into its final object, or copies one into the workspace with sendfile; returned tensors,
bytes and files go back as raw bytes on the pipe right after their ReturnValue.  Streaming returns as they happen
is what lets the front-end keep them when uploaded native code later kills the
process.  Output is captured at the file-descriptor level into pipes whose
read ends the front-end holds, for the same reason.  Importing this module
must stay cheap (the front-end does): torch, numpy and tvm_ffi are imported
by the template process or on first use.

Sections, top-down: the shared contract (types, errors, path rules; raw bytes and the staged
blobs; the messages), the process helpers and the one home of process trees (finding them,
ending them with a grace, confirming them gone), all of which kcoral.py imports too; the
sandbox's template (`template_main`, `fork_request`), which forks workers in a container; the
worker process (`worker_main` -> `serve_request` per request); one program (`ProgramRun`, output capture,
workspace files, value encoding); the runtimes (tensors and libraries per device, the GPU lease,
CUDA's guards); last, `kcoral.builtins` and `kcoral.errors`, what uploaded code imports, with
`evaluate`'s kernel processes (a fresh interpreter per kernel under test, its own messages).

A worker's device is fixed when it starts: `worker_main` builds one `Runtime` and hands it
down to each request.  Ten module-level names change in a worker or its template, each once per
process or as a cache its requests may share (a worker serves one request by default):
`TEMPLATE_PREPARED`, `TEMPLATE_TORCH_SETTINGS` and `FLUSH_HOOKS_INSTALLED` (set in a template
before it forks: its workers inherit them), `_library_runtimes_loaded` and `_cute_preloaded` (set
the first time), `SANDBOXED` (set by a sandboxed request's worker), `_cudarts` (the libcudart
handles loaded), `_cupti_used` (set by a request's profiler guard, cleared before the next) and
`_compiled` (compiled executables by structural hash); in evaluate's kernel processes,
`IN_PLACE_DTYPES` (which dtypes' bytes are as sent).  Nothing else module-level changes.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import dataclasses
import errno
import faulthandler
import functools
import hashlib
import importlib.util
import io
import itertools
import json
import linecache
import math
import mmap
import operator
import os
import resource
import select
import signal
import socket
import stat
import struct
import sys
import sysconfig
import time
import traceback
import types
import typing
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import IO, Any

# --- the shared contract: types, errors, path rules ---------------------------------------------

DTYPE_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "float32": 4, "int64": 8, "float64": 8,
}
ERROR_KINDS = frozenset({"parse", "compile", "runtime", "gpu_access", "correctness",
                         "serialization", "unavailable", "engine"})
TRACEBACK_CHARS = 8192
SERVER_FILES = ("kcoral.py", "kcoral_worker.py")  # the frames a program's traceback leaves out
MAX_VALUE_DEPTH = 400  # returned values, as requests (docs/protocol.md §5): a frame stays well within JSON's recursion
Buffer = bytes | bytearray | memoryview | mmap.mmap  # what the raw-bytes helpers accept (any buffer, in fact)
Instruction = dict[str, Any]  # one validated program instruction, as the front-end passed it
ErrorObject = dict[str, Any]  # a FAILED result's "error" (docs/protocol.md §9.7)
RAW_CHUNK = 1 << 20


class ValidationError(ValueError):
    """A request or path that breaks the protocol's rules (answered 400 parse)."""


class ExecutionError(Exception):
    """Raised (also by uploaded code) to fail an instruction with a chosen kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(kind, message)
        self.kind = kind
        self.message = message
        self.path: list[int | str] = []  # where in a returned value a serialization failure lies

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def normalize_path(raw: object) -> str:
    """docs/protocol.md §6.7: the canonical relative form of a workspace path, or ValidationError."""
    if not isinstance(raw, str) or not raw:
        raise ValidationError("path must be a non-empty string")
    if "\0" in raw:
        raise ValidationError("path must not contain NUL")
    if "\\" in raw:
        raise ValidationError("path must not contain a backslash")
    if raw.startswith("/"):
        raise ValidationError("path must be relative")
    parts = raw.split("/")
    if ".." in parts:
        raise ValidationError("path must not contain '..'")
    parts = [p for p in parts if p not in ("", ".")]
    if not parts:
        raise ValidationError("path names nothing")
    path = "/".join(parts)
    try:  # a lone surrogate ("\udc80" in the JSON) has no UTF-8 form, so no byte length
        if any(len(p.encode("utf-8")) > 255 for p in parts):
            raise ValidationError("path component longer than 255 bytes")
        if len(path.encode("utf-8")) > 4096:
            raise ValidationError("path longer than 4096 bytes")
    except UnicodeEncodeError:
        raise ValidationError("path is not valid Unicode (a lone surrogate)") from None
    return path


def is_ref(value: object) -> bool:
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get("$ref"), str) and value["$ref"] != ""


def shorten(text: str, limit: int = 600) -> str:
    """Keep the head and the tail of a long diagnostic."""
    if len(text) <= limit:
        return text
    head = limit // 3
    return text[:head] + " …[truncated]… " + text[-(limit - head):]


# --- raw bytes on a pipe, and the request's staged blobs ------------------------------------------

def send_raw(conn: Connection, *buffers: Buffer) -> None:
    """Write buffers straight to the pipe, in order: no pickling, no intermediate copy."""
    fd = conn.fileno()
    write_batches(lambda views: os.writev(fd, views), buffers)


WRITE_BATCH = 512  # buffers per writev/sendmsg call, well under Linux's IOV_MAX (1024)


def write_batches(write: Callable[[list[memoryview]], int], buffers: Iterable[Buffer]) -> None:
    """Hand `buffers` to `write` (os.writev, socket.sendmsg: -> bytes written, which may stop
    anywhere, short of 2 GiB at most) up to WRITE_BATCH at a time: a folder's 500 files take a
    few system calls instead of one each."""
    pending = collections.deque(view for view in (memoryview(b).cast("B") for b in buffers) if view.nbytes)
    while pending:
        sent = write(list(itertools.islice(pending, WRITE_BATCH)))
        while sent and sent >= pending[0].nbytes:
            sent -= pending.popleft().nbytes
        if sent:
            pending[0] = pending[0][sent:]


def recv_raw(conn: Connection, size: int, deadline: float | None = None) -> bytearray:
    """Read exactly `size` raw bytes from the pipe into a new buffer.

    A bytearray, on plain pages: huge pages were slower where free memory goes back to the
    host in 2 MiB blocks (docs/performance.md).

    With a `deadline` (time.monotonic()), a peer that announces bytes and never sends them
    raises TimeoutError instead of blocking the reader forever."""
    buf = bytearray(size)
    read_into(conn.fileno(), memoryview(buf), deadline)
    return buf


def read_into(fd: int, view: memoryview, deadline: float | None) -> None:
    while view:
        if deadline is not None:
            wait_readable(fd, deadline)
        n = os.readv(fd, [view])
        if n == 0:
            raise EOFError("pipe closed")
        view = view[n:]


def wait_readable(fd: int, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
        raise TimeoutError


MAPPED_BLOB_BYTES = 1 << 20  # a blob this large is staged where the worker can map it as `bytes` (MappedBytes)
SEALED_BLOB_BYTES = 16 << 20  # one this large in a memfd of its own, which the front-end's memory cache keeps


def blob_layout(sizes: Iterable[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Where the front-end stages blobs of these sizes -> ([(file, offset)], file sizes), file 0
    shared by the smaller ones if any, then one file per blob of SEALED_BLOB_BYTES or more (the
    front-end keeps those in its cache, kcoral.SealedBlob).  Small blobs lie back to back; one of
    MAPPED_BLOB_BYTES or more at an offset MappedBytes can map (MappedBytes.HEADER past a page
    boundary), followed by a zero byte, the NUL every `bytes` object ends with (the file's holes
    read as zeros: the padding costs no memory)."""
    places: list[tuple[int, int]] = []
    files: list[int] = []
    shared = None
    for size in sizes:
        if size >= SEALED_BLOB_BYTES:
            places.append((len(files), MappedBytes.HEADER))
            files.append(MappedBytes.HEADER + size + 1)
            continue
        if shared is None:
            shared = len(files)
            files.append(0)
        end = files[shared]
        if size >= MAPPED_BLOB_BYTES:
            end = -(-end // mmap.PAGESIZE) * mmap.PAGESIZE + MappedBytes.HEADER
        places.append((shared, end))
        files[shared] = end + size + (size >= MAPPED_BLOB_BYTES)
    return places, files


class MappedBytes:
    """A `bytes` object over the staged memfd's pages: no copy, nothing paged in until read.

    A `bytes` object keeps its bytes inline after a 32-byte header, and CPython frees a large
    one with the C library's free().  So a private (copy-on-write) mapping of the memfd, starting
    HEADER bytes before a blob that blob_layout placed there, gets in its first page the header
    glibc's free() expects of a chunk it mapped itself (free() then unmaps the whole mapping)
    and the `bytes` header; the blob's own pages stay the memfd's, shared with the front-end's
    copy, and the program pays only the page faults of what it reads (a copy into a fresh
    `bytes` cost ~45 ms per 64 MiB here, most of it faults of fresh memory).  The object is a
    real `bytes` in every respect: type, immutability, hash, pickling, the NUL after its end.
    Only glibc and CPython's default allocators are known to agree (`supported`); elsewhere
    StagedBlobs.read copies."""

    CHUNK = 16  # glibc's header of a chunk it mapped: (prev_size, size | IS_MMAPPED)
    HEADER = CHUNK + bytes.__basicsize__ - 1  # then the bytes object's: refcount, type, size, hash
    IS_MMAPPED = 2

    @staticmethod
    @functools.cache
    def supported() -> bool:
        allocator = os.environ.get("PYTHONMALLOC", "")
        # not a debug build (its allocator adds guards around each block) nor a free-threaded one
        # (mimalloc frees what it did not allocate differently)
        return (sys.implementation.name == "cpython" and sys.maxsize > 2 ** 32
                and (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
                and bytes.__basicsize__ - 1 == 4 * ctypes.sizeof(ctypes.c_ssize_t)
                and allocator in ("", "malloc", "pymalloc") and not sys.flags.dev_mode
                and not hasattr(sys, "gettotalrefcount") and not sysconfig.get_config_var("Py_GIL_DISABLED"))

    @classmethod
    def map(cls, fd: int, offset: int, size: int) -> bytes:
        start = offset - cls.HEADER  # a page boundary (blob_layout)
        length = -(-(cls.HEADER + size + 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        address = LIBC.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, start)
        if address in (None, MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mapping a staged blob: {os.strerror(ctypes.get_errno())}")
        header = (ctypes.c_ssize_t * 6).from_address(address)  # written to the mapping's first page, privately
        header[:] = [0, length | cls.IS_MMAPPED, 0, id(bytes), size, -1]  # refcount 0: .value takes the one reference
        return ctypes.cast(address + cls.CHUNK, ctypes.py_object).value


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_FAILED = ctypes.c_void_p(-1).value
LIBC.memcmp.restype = ctypes.c_int
LIBC.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class StagedBlobs:
    """The request's blobs, staged by the front-end in sealed memfds (files in memory nobody can
    write any more, passed as file descriptors: no path, no inode on disk), as blob_layout places
    them.

    The worker asks for the memfds (StageBlobs) the first time it needs a blob's bytes: a program
    that only returns its `bytes` uploads never has them copied at all.  A large `bytes` blob is
    mapped (MappedBytes), a small one read into a `bytes` object in one copy, and file uploads
    are copied by the kernel: a blob never sits twice in worker memory.
    """

    def __init__(self, conn: Connection, index: dict[str, tuple[int, int, int]]) -> None:
        self.conn = conn
        self.fds: list[int] | None = None  # until stage()
        self.index = index  # hash -> (file, offset, size)
        # id -> (object, hash) for what read() and unread_view() returned
        self.handed_out: dict[int, tuple[bytes | memoryview, str]] = {}

    def digest_of(self, value: object) -> str | None:
        """The hash of `value` if it is a bytes object read() returned, else None.

        bytes are immutable, so a returned upload need not be hashed a second time
        (the front-end verified it on arrival)."""
        entry = self.handed_out.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def stage(self) -> list[int]:
        """The memfds, asked for on first use -> their fds, by file number."""
        if self.fds is None:
            send_message(self.conn, StageBlobs())
            self.fds = []
            for _ in range(1 + max(file for file, _, _ in self.index.values())):
                self.fds.append(reduction.recv_handle(self.conn))
                os.set_inheritable(self.fds[-1], False)  # arrived inheritable: no process the program execs keeps it
        return self.fds

    def locate(self, digest: str) -> tuple[int, int, int]:
        """-> (fd, offset, size) of a blob of the index (KeyError for any other)."""
        file, offset, size = self.index[digest]
        return self.stage()[file], offset, size

    def read(self, digest: str) -> bytes:
        fd, offset, size = self.locate(digest)
        mappable = size >= MAPPED_BLOB_BYTES and offset % mmap.PAGESIZE == MappedBytes.HEADER
        data = (MappedBytes.map(fd, offset, size) if mappable and MappedBytes.supported()
                else self.copied(fd, offset, size))
        self.handed_out[id(data)] = (data, digest)
        return data

    @staticmethod
    def copied(fd: int, offset: int, size: int) -> bytes:
        chunks = []
        while size:  # one read stops short of 2 GiB
            chunk = os.pread(fd, size, offset)
            if not chunk:
                raise OSError("staged blob is shorter than announced")
            chunks.append(chunk)
            offset, size = offset + len(chunk), size - len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def unread_view(self, digest: str) -> memoryview:
        """A stand-in of the blob's size for a `bytes` upload returned without being used: the
        front-end sends its own copy (digest_of knows the stand-in, which nobody reads), so
        nothing is staged, copied or paged in.  Untouched anonymous memory costs no pages."""
        size = self.index[digest][2]
        view = memoryview(mmap.mmap(-1, size) if size else b"")
        self.handed_out[id(view)] = (view, digest)
        return view

    def read_writable(self, digest: str) -> bytearray:
        fd, offset, size = self.locate(digest)
        data = bytearray(size)
        view = memoryview(data)
        while view:
            n = os.preadv(fd, [view], offset)
            if not n:
                raise OSError("staged blob is shorter than announced")
            view, offset = view[n:], offset + n
        return data

    def copy_to(self, digest: str, out_fd: int) -> None:
        fd, offset, size = self.locate(digest)
        while size:
            n = os.sendfile(out_fd, fd, offset, size)
            if not n:
                raise OSError("staged blob is shorter than announced")
            offset, size = offset + n, size - n

    def close(self) -> None:
        for fd in self.fds or ():
            os.close(fd)
        self.fds = None


# --- the messages between the front-end and its worker processes ----------------------------------

# Each message is a frozen dataclass sent as a 4-byte big-endian length and a JSON object: its
# class name under "type" and exactly its fields, each of its annotated type (JSON has no tuples:
# a tuple field arrives as a list).  Every payload (blobs, returned parts) travels as raw bytes
# next to them.  Each side dispatches on the type and treats anything else as a broken peer: the
# front-end answers WorkerCrashed and kills the worker, the worker raises UnexpectedMessage.

MESSAGE_HEADER = struct.Struct("!I")
MESSAGE_TYPES: dict[str, type] = {}  # class name -> message class, filled by @message
MESSAGE_HINTS: dict[type, dict[str, Any]] = {}  # message class -> its fields' types, resolved once


class UnexpectedMessage(RuntimeError):
    """The peer sent a message the protocol does not allow at this point."""


_Message = typing.TypeVar("_Message", bound=type)

if typing.TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:  # only a type checker needs telling that @message makes a frozen dataclass
    def dataclass_transform(**_: Any) -> Callable[[_Message], _Message]:
        return lambda decorator: decorator


@dataclass_transform(frozen_default=True)
def message(cls: _Message) -> _Message:
    """Declare a message class: a frozen dataclass the codec knows by name."""
    dataclasses.dataclass(frozen=True)(cls)  # makes `cls` itself one (no slots asked for)
    MESSAGE_TYPES[cls.__name__] = cls
    return cls


def encode_message(msg: object) -> bytes:
    """The frame of one message.  RecursionError or ValueError for a value JSON cannot carry."""
    if not dataclasses.is_dataclass(msg):  # what dataclasses.fields() raises, with the type named
        raise TypeError(f"{type(msg).__name__} is not a message")
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    payload = json.dumps({"type": type(msg).__name__, **fields}, separators=(",", ":"),
                         allow_nan=False).encode()
    return MESSAGE_HEADER.pack(len(payload)) + payload


def send_message(conn: Connection, msg: object) -> None:
    send_raw(conn, encode_message(msg))


def receive_message(conn: Connection, limit: int = 1 << 30, deadline: float | None = None) -> tuple[object, int]:
    """The next message off the pipe, checked field by field -> (message, its frame's size).

    UnexpectedMessage for a frame over `limit` bytes, malformed JSON, an unknown type, a missing
    or extra key or a value of the wrong type; TimeoutError past `deadline`; EOFError when the
    peer closed the pipe."""
    payload = receive_frame(conn, limit, deadline)
    return decode_message(payload), MESSAGE_HEADER.size + len(payload)


def receive_frame(conn: Connection, limit: int = 1 << 30, deadline: float | None = None) -> bytearray:
    """The next message's payload off the pipe, not yet decoded (receive_message's errors but the checks)."""
    fd = conn.fileno()
    header = bytearray(MESSAGE_HEADER.size)
    read_into(fd, memoryview(header), deadline)
    (size,) = MESSAGE_HEADER.unpack(header)
    if size > limit:
        raise UnexpectedMessage(f"a message of {size} bytes (at most {limit} allowed here)")
    payload = bytearray(size)
    read_into(fd, memoryview(payload), deadline)
    return payload


def decode_message(payload: bytes | bytearray) -> object:
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):
        raise UnexpectedMessage("a message that is not JSON") from None
    cls = MESSAGE_TYPES.get(data["type"]) if isinstance(data, dict) and isinstance(data.get("type"), str) else None
    if cls is None:
        raise UnexpectedMessage("a message of no known type")
    hints = MESSAGE_HINTS.get(cls) or MESSAGE_HINTS.setdefault(cls, typing.get_type_hints(cls))
    fields = {k: v for k, v in data.items() if k != "type"}
    if set(fields) != set(hints):
        raise UnexpectedMessage(f"{cls.__name__} with fields {sorted(fields)!r:.200}")
    for name, value in fields.items():
        if not fits(value, hints[name]):
            raise UnexpectedMessage(f"{cls.__name__}.{name} is not {hints[name]}")
    return cls(**fields)


def fits(value: object, hint: Any) -> bool:
    """Whether a decoded JSON value has the annotated type (bool is not an int here)."""
    origin, args = hint_parts(hint)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint in (bool, int, str):
        return type(value) is hint
    if hint is float:
        return type(value) in (int, float)
    if (origin or hint) is list:
        return type(value) is list and (not args or all_fit(value, args[0]))
    if (origin or hint) is tuple:
        return type(value) is list and len(value) == len(args) and all(map(fits, value, args))
    if (origin or hint) is dict:
        return type(value) is dict and (not args or all(fits(v, args[1]) for v in value.values()))
    return False


def all_fit(values: list, hint: Any) -> bool:
    """Whether every one of `values` fits `hint`: scalars, plain dicts and lists of them checked in
    C loops (a race's EvalDone lists 1000 calls' results, its EvalStage 1000 calls' arguments)."""
    origin, args = hint_parts(hint)
    if hint in (bool, int, str, dict):
        return set(map(type, values)) <= {hint}
    if origin is list and args and set(map(type, values)) <= {list}:
        return all_fit(list(itertools.chain.from_iterable(values)), args[0])
    return all(fits(v, hint) for v in values)


@functools.cache
def hint_parts(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    """A type hint's origin and arguments, worked out once per hint, not once per value checked."""
    return typing.get_origin(hint), typing.get_args(hint)


@message
class WorkerReady:
    """Worker -> front-end, once after the fork: pinned to its GPU(s) and imported, no CUDA context yet.
    The sandbox template sends it too, once it has imported what its workers preload."""
    pid: int  # as the sender sees it (a sandbox has its own PID namespace)


@message
class WorkerFailed:
    """Worker -> front-end, instead of WorkerReady: this fork cannot serve (the template initialised CUDA)."""
    reason: str


@message
class InitGpu:
    """Front-end -> GPU worker, once after WorkerReady, while the front-end holds the lease: create the
    CUDA context.  Answered by GpuInitialized."""


@message
class GpuInitialized:
    """Worker -> front-end, the answer to InitGpu: what device 0 is, to check the pinning."""
    arch: str  # like "sm_90a"
    cuda: str | None  # the CUDA version torch was built with
    uuid: str  # device 0's UUID, or ""


@message
class JobRequest:
    """Front-end -> worker, once per request; with `capture`, the write ends of the stdout and
    stderr pipes follow as two passed file descriptors, then with `progress` the write end of the
    progress pipe (announced_by_record).  `blob_index` (hash -> (file, offset, size))
    describes the memfds the worker gets when it asks for them (StageBlobs), file 0 first."""
    instructions: list[dict]
    retire: bool  # exit after this request
    workspace: str  # the program's working directory, as the worker sees it
    blob_index: dict[str, tuple[int, int, int]]
    capture: bool
    grace: float  # seconds between SIGTERM and SIGKILL for processes the program left behind
    max_response_bytes: int
    max_response_parts: int
    progress: bool


@message
class StopWorker:
    """Front-end -> idle worker: exit now."""


@message
class InstructionStarted:
    """Worker -> front-end, before the first instruction (and any whose record found the progress
    pipe full): a crash from here on is attributed to it (announced_by_record)."""
    index: int


PROGRESS_RECORD = struct.Struct("<I")  # on the progress pipe: the index of an instruction starting


def announced_by_record(index: int) -> bool:
    """Whether instruction `index` is announced with a 4-byte record on the progress pipe, which
    wakes nobody, instead of an InstructionStarted the front-end wakes up for (500 of them cost
    a 500-file folder tens of ms; a trivial program has three): every instruction but the first.
    The front-end reads the pipe when it attributes a crash or timeout: indices only grow, so the
    last instruction started is the highest index either channel reported.  The first is a
    message: a worker that dies before it is the server's fault, and uploaded code, which runs in
    this process and may write to either channel, can then only blur which of its own
    instructions failed, never shift the blame to the server."""
    return index > 0


@message
class StageBlobs:
    """Worker -> front-end, at most once per request, the first time the program needs a blob's
    bytes (a GPU worker: before its first instruction, so the copy never runs under the lease).
    Answered by the sealed memfds of JobRequest.blob_index as passed file descriptors, file 0 first."""


@message
class ReturnValue:
    """Worker -> front-end, as each `return` instruction completes (so a later crash cannot lose it).

    Each entry of `parts` is either a size: that many raw bytes follow on the pipe, or the hash of
    a staged blob returned unchanged: the front-end holds those bytes already and sends its own."""
    key: str
    encoded: dict  # the result's JSON, naming its parts
    parts: list[int | str]


@message
class AcquireLease:
    """GPU worker -> front-end, before an instruction that may touch the GPU; answered by LeaseGranted."""


@message
class LeaseGranted:
    """Front-end -> GPU worker, the answer to AcquireLease: the worker's GPU(s) are its own now."""


@message
class ReleaseLease:
    """GPU worker -> front-end, before host-only work (file uploads and returns, cpu_only runs),
    after giving its cached GPU memory back.  Not answered."""


@message
class RequestDone:
    """Worker -> front-end, the last message of a request."""
    error: dict | None  # the FAILED result's error object
    poisoned: bool  # the worker must not serve again (its CUDA context unusable, or its program left processes)


@message
class RequestSpace:
    """Front-end -> sandbox template, once, as its start-up argument: who its workers run as and
    the limits each request gets (0: none).  `kept` lists the read-only paths the container shows
    under /tmp, /var/tmp or /dev/shm, which each request's fresh writable space must keep showing."""
    uid: int
    gid: int
    memory_bytes: int
    disk_bytes: int
    files: int
    processes: int
    kept: list[str]


@message
class ForkWorker:
    """Front-end -> sandbox template: fork one worker; the worker's pipe follows as a passed file
    descriptor.  Answered by WorkerForked, then WorkerExited once that worker is gone."""
    device: str
    visible_gpus: list[str]


@message
class WorkerForked:
    """Sandbox template -> front-end: the pid, inside the container, of the new worker (PID 2 in
    its request's own PID namespace, whose init is PID 1)."""
    pid: int


@message
class WorkerExited:
    """Sandbox template -> front-end: the worker it forked last is gone, with this exit code."""
    exit_code: int


# --- process helpers (the front-end uses them too) ------------------------------------------------

WORKER_MARK = "KCORAL_WORKER_PID"


def ignore_tree_signals() -> None:
    """SIGTERM and SIGINT do nothing to this process (a worker, a sandbox's template).

    systemd's default stop signals every process of the service at once, and a terminal's
    Ctrl+C its whole foreground group; a worker that died of it would fail the request the
    server is finishing for its graceful stop.  The front-end ends workers with SIGKILL
    (`terminate(at_once=...)`).  A Python handler rather than SIG_IGN: exec resets handlers,
    so the programs a request starts get the default dispositions back; and unblocked, as the
    front-end's template hands it down blocked (kcoral.start_forkserver): a mask survives exec."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def prctl(option: int, value: int) -> None:
    """Best effort: a libc without prctl (not Linux) leaves the process as it is."""
    with contextlib.suppress(OSError, AttributeError):
        LIBC.prctl(option, value, 0, 0, 0)


def set_dumpable(flag: bool) -> None:
    prctl(4, int(flag))  # PR_SET_DUMPABLE


def become_subreaper() -> None:
    """Orphans of our descendants are re-parented to us, so a new session cannot hide them
    and we can reap them."""
    prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def die_with_parent() -> None:
    """If the server dies hard, its template exits and takes the workers with it."""
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def set_oom_score(value: int) -> None:
    """This process's oom_score_adj (-1000..1000): raising it needs no privilege, lowering it does."""
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write(str(value))


def oom_score() -> int:
    with open("/proc/self/oom_score_adj") as f:
        return int(f.read())


def prepare_template() -> None:
    """Once a template has imported (a sandbox container's; the forkserver's before its first fork,
    TEMPLATE_MARK): what each fresh worker would set up for itself, set up once here
    (warm_request_path), then its memory into huge pages (collapse_template_memory).  Once per
    process, and never in what a template forks (they inherit the flag set): a program's forks are
    its own."""
    global TEMPLATE_PREPARED
    if TEMPLATE_PREPARED:
        return
    TEMPLATE_PREPARED = True
    warm_request_path()
    collapse_template_memory()


def warm_request_path() -> None:
    """What a worker sets up on first use for its whole process, done in the template and inherited
    by every worker forked from it, instead of in each fresh one: OpenSSL's digest tables (a
    module's filename is a SHA-1: 0.3 ms the first time), the flush hooks (install_flush_hooks wraps
    nine functions: 0.3 ms), each message's field types (typing.get_type_hints, ~0.3 ms for a
    JobRequest), the module a forkserver's child unpickles its process object with
    (multiprocessing.popen_forkserver, which each worker imported from disk: ~1.2 ms of CPU) and
    torch's settings, which a worker starts with (TorchSettings.at_start: 0.75 ms read in each)."""
    hashlib.sha1(b"")
    install_flush_hooks()
    for cls in MESSAGE_TYPES.values():
        MESSAGE_HINTS.setdefault(cls, typing.get_type_hints(cls))
    import multiprocessing.popen_forkserver  # noqa: F401
    global TEMPLATE_TORCH_SETTINGS
    TEMPLATE_TORCH_SETTINGS = TorchSettings.capture()


def collapse_template_memory() -> None:
    """A template's private anonymous memory, some 150 MiB once torch is imported, into huge pages
    where the kernel can (MADV_COLLAPSE, Linux 6.1; whatever the THP setting but "never").  A fork
    then copies one page-table entry per 2 MiB instead of 512, and the child's exit frees as few;
    a child's write still copies only 4 KiB (the kernel splits the huge page under it).  Measured
    on a 2-core machine: a fork 4.3 -> 1.4 ms, a fork and a worker's exit 17 -> 11 ms of CPU; the
    collapse itself ~0.35 s, once per template.  Best effort: where the kernel refuses (older, THP
    off, no free huge pages), the memory stays as it is."""
    with contextlib.suppress(OSError, AttributeError):
        madvise = LIBC.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        deadline = time.monotonic() + COLLAPSE_SECONDS
        for low, high in dense_anonymous_regions():
            first = -(-low // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # the huge pages wholly inside
            for start in range(first, high - HUGE_PAGE_BYTES + 1, HUGE_PAGE_BYTES):
                if time.monotonic() > deadline:  # compaction on a fragmented host: the rest stays as it is
                    return
                madvise(start, HUGE_PAGE_BYTES, MADV_COLLAPSE)


def dense_anonymous_regions() -> list[tuple[int, int]]:
    """This process's private anonymous mappings (the heap, unnamed ones) at least half resident:
    a collapse fills a huge page's missing pages, which in a sparse mapping (a thread's stack, an
    allocator's reserve) would add memory, not save page-table entries.  -> [(start, end)]."""
    regions, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0]:  # a mapping's first line: range, permissions, offset, device, inode, name
                bounds = [int(bound, 16) for bound in fields[0].split("-")]
                private_anonymous = fields[1][:2] == "rw" and fields[1][3] == "p" and fields[5:] in ([], ["[heap]"])
                current = bounds if private_anonymous else None
            elif fields[0] == "Anonymous:" and current is not None:
                if int(fields[1]) << 10 >= (current[1] - current[0]) // 2:
                    regions.append((current[0], current[1]))
    return regions


TEMPLATE_PREPARED = False  # prepare_template: done in this process, or in its parent before the fork
TEMPLATE_TORCH_SETTINGS: TorchSettings | None = None  # read by warm_request_path, for TorchSettings.at_start
HUGE_PAGE_BYTES, MADV_COLLAPSE = 2 << 20, 25  # x86-64's and arm64's (4 KiB pages) PMD size; Linux's constant
COLLAPSE_SECONDS = 2.0  # collapse_template_memory's budget: a template's start-up waits for it
# In the environment of the forkserver kcoral.start_forkserver starts, and only there: that process
# runs none of our code but the imports, so its first fork prepares it.  Taken out at once, so
# that nothing it forks, nor any other process that imports this module, is touched.
TEMPLATE_MARK = "KCORAL_WORKER_TEMPLATE"
if os.environ.pop(TEMPLATE_MARK, None) == "1":
    os.register_at_fork(before=prepare_template)

# --- process trees: finding a request's processes, ending them with a grace, confirming them gone --
#
# Finding: `group_members` (a worker's group and its leader's descendants), `marked_processes` (by
# the environment mark, after a crash), `descendants`, `escaped_descendants` (the worker's, outside
# its group).  Ending: `terminate`, which every caller goes through (`kill_group`, the worker's
# `terminate_descendants`, the sandbox's template), or, in a request's own PID namespace, kill(-1).
# Confirming: `terminate`'s result, and `killed_already` for a tree the kernel still tears down.
# What to do when a tree will not go (quarantine a GPU, replace a container) stays with its owner.

def proc_stat(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ... : field 3 on
    is index 0 on), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return None


def process_table() -> Iterator[tuple[int, bytes, int, int]]:
    """(pid, state, ppid, pgrp) of every process this one can see."""
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := proc_stat(name)) is not None:
            yield int(name), fields[0], int(fields[1]), int(fields[2])


PF_EXITING = 0x4  # /proc/PID/stat flags: the process is in its exit (include/linux/sched.h)


def is_live(pid: int) -> bool:
    fields = proc_stat(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")


def children_of(pid: int | None, live: bool = True) -> list[int]:
    """Children of a process (only the live ones unless `live` is False), from the kernel's
    per-thread child lists: a few small reads instead of a scan of every process on the machine
    (this runs on every request)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
            found += [int(child) for child in f.read().split()]
    return [child for child in found if is_live(child)] if live else found


def descendants(pid: int | None) -> list[int]:
    """Live descendants of a process, walked down the kernel's child lists."""
    found: list[int] = []
    frontier = children_of(pid)
    while frontier:
        found += frontier
        frontier = [child for parent in frontier for child in children_of(parent)]
    return found


def group_members(pgid: int, exclude: Collection[int] = ()) -> list[int]:
    """Live processes in a process group, plus the leader's live descendants in other groups
    (a program may start new sessions); our adopted orphans' zombies are reaped first."""
    reap_adopted_orphans()
    if group_gone(pgid):  # the usual end of a worker: no /proc scan (milliseconds on a busy host)
        return []
    members = [pid for pid, state, _, pgrp in process_table() if pgrp == pgid and state != b"Z" and pid not in exclude]
    return members + [pid for pid in descendants(pgid) if pid not in members and pid not in exclude]


def group_gone(pgid: int) -> bool:
    """Whether a process group has no process left, zombies included (one signal-0 system call, which
    the kernel answers for the whole group at once, a fork in progress included), and its leader,
    were it now in another group, is gone too: nothing group_members could find."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return proc_stat(pgid) is None
    except PermissionError:  # a member of another user's (a sandbox's uid): it exists
        pass
    return False


def reap_adopted_orphans() -> None:
    """Reap the zombies among our children in a group not our own: orphans of programs that ended
    up with us, their subreaper (multiprocessing and subprocess reap the children they started,
    which stay in our group)."""
    with contextlib.suppress(ChildProcessError):  # none at all
        if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return  # no child has ended (the usual case): one system call, where our threads' child lists are many
    me, own_group = os.getpid(), os.getpgrp()
    for child in children_of(me, live=False):
        if (fields := proc_stat(child)) is not None and fields[0] == b"Z" and int(fields[2]) != own_group:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, os.WNOHANG)


def marked_processes(worker_pid: int) -> list[int]:
    """Live processes started under a worker (they inherit its KCORAL_WORKER_PID), wherever
    they are now: after a crash, a new-session child is an orphan outside every tree."""
    mark = f"\0{WORKER_MARK}={worker_pid}\0".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if mark in b"\0" + f.read() + b"\0":
                        found.append(int(name))
            except OSError:
                pass
    return found


def tree_members(pgid: int, exclude: Collection[int] = (), orphans: bool = False) -> list[int]:
    """What kill_group kills: the group and its leader's descendants (with `orphans`, every live
    process started under it too)."""
    marked = [pid for pid in marked_processes(pgid) if pid not in exclude] if orphans else []
    return group_members(pgid, exclude) + [pid for pid in marked if is_live(pid)]


def escaped_descendants() -> list[int]:
    """Live descendants outside our process group (started with a new session or group): the
    front-end kills and reports what is left in the group; these it cannot see."""
    group = os.getpgid(0)
    return [pid for pid in descendants(os.getpid()) if (fields := proc_stat(pid)) and int(fields[2]) != group]


def terminate_descendants(grace: float) -> bool:
    """SIGTERM what the program left running, SIGKILL it after `grace` s, sweep after sweep (reaping
    it as its subreaper); -> whether there was any.  Every descendant, in the worker's group or
    not: a retiring worker's front-end then only kills the group at once (it looks for nothing
    before the answer); a reused worker's still checks the group itself.  A child whose parent
    thread is exiting may be in no thread's child list for a moment, which `waitpid` still counts:
    `terminate`'s second look, a moment later, finds it."""
    if SANDBOXED["worker"]:
        return end_request_namespace(grace)

    def remaining() -> list[int]:  # as their subreaper we reap them, or they linger as zombies
        return descendants(os.getpid()) if reap_children() else []

    found = bool(remaining()) or reap_children()
    if found:
        terminate(remaining, grace, 10.0)
    return found


def end_request_namespace(grace: float) -> bool:
    """In a sandboxed worker, PID 2 of its request's PID namespace, where every process but the
    init and us is the program's: SIGTERM them all, SIGKILL them after `grace` s; -> whether
    there were any.

    No /proc scan: a chain that forks and exits faster than /proc is read hides from every
    snapshot (one did, in CI).  As their subreaper we have a child while any of them runs, and
    kill(-1) reaches every process of the namespace at once, a fork in progress included."""
    if not reap_children():
        return False
    with contextlib.suppress(ProcessLookupError):  # the last one ended meanwhile
        os.kill(-1, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while reap_children() and time.monotonic() < deadline:
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)
    deadline = time.monotonic() + 10.0  # a process in uninterruptible sleep dies late; the init's exit ends it
    while reap_children() and time.monotonic() < deadline:
        time.sleep(0.001)
    return True


def reap_children() -> bool:
    """Reap every child that has ended -> whether one is left (running, or ended since): a system
    call or two, where a /proc scan takes milliseconds.  As a subreaper we adopt every orphaned
    descendant, so without children we have no descendants at all."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        return False
    return True


def terminate(remaining: Callable[[], list[int]], grace: float, kill_for: float, group: int | None = None,
              keep_groups: Collection[int] = (), at_once: Collection[int] = (), second_look: bool = True) -> bool:
    """SIGTERM each process `remaining()` lists (SIGKILL those in `at_once`: workers, which
    ignore SIGTERM, see ignore_tree_signals), then, once `grace` has passed, freeze and kill
    what is left, for up to `kill_for` seconds.  -> whether none is left.

    Killing pid after pid loses to a chain that forks and exits as fast as it can: a snapshot of
    /proc is stale by the time it is signalled.  So every signal also goes to the process group
    of each process found (but ours, `group`'s owner's and `keep_groups`), which the kernel
    delivers to all members at once, forks in progress included; and each sweep SIGSTOPs what
    it finds (a stopped process cannot fork), SIGKILLing once a sweep finds nothing new.  A
    chain that also starts a new session in every generation can still outrun the sweeps:
    only a PID namespace (the sandbox's container) ends that for certain.  An empty sweep is
    looked at again a moment later unless the caller knows it is final (`second_look`)."""
    spared = {os.getpgrp(), *keep_groups}

    def signal_all(pids: list[int], sig: int) -> None:
        groups = {group} if group is not None else set()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                groups.add(os.getpgid(pid))
                os.kill(pid, sig)
        for pgid in groups - spared:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)

    for pid in at_once:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    pids = remaining()
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        time.sleep(0.01)
        pids = remaining()
    deadline, seen = time.monotonic() + kill_for, set[int]()
    while True:
        if not pids:
            if not second_look:
                return True
            # a second look: a process forking while /proc was read can be missed by one snapshot
            # (its parent gone, itself not listed yet), not by two a moment apart
            time.sleep(0.005)
            pids = remaining()
            if not pids:
                return True
        signal_all(pids, signal.SIGSTOP)
        if set(pids) <= seen:  # nothing new since the last sweep: all stopped
            signal_all(pids, signal.SIGKILL)
        if time.monotonic() >= deadline:
            return False
        seen = set(pids)
        time.sleep(0.001)
        pids = remaining()


def kill_group(pgid: int, grace: float, exclude: Collection[int] = (), orphans: bool = False,
               kill_wait: float = 10.0) -> bool:
    """SIGTERM the group and its leader's descendants (with `orphans`, also every process
    started under it), SIGKILL what is left after the grace period, sweep after sweep for up to
    `kill_wait` seconds.  -> whether it is gone."""
    return terminate(lambda: tree_members(pgid, exclude, orphans), grace, kill_wait, group=pgid, at_once=(pgid,))


def killed_already(pid: int) -> bool:
    """Whether a process will never run a program's code again: it is gone, in its exit, or has
    SIGKILL pending (waiting in the kernel, say for a driver that tears down a CUDA context whose
    kernel still spins).  What is left of it is the kernel's work, not the program's."""
    fields = proc_stat(pid)
    if fields is None or int(fields[6]) & PF_EXITING:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (OSError, ValueError, IndexError):
        return proc_stat(pid) is None
    return any(mask & 1 << (signal.SIGKILL - 1) for mask in pending)


# --- the sandbox's template: the container's PID 1, a request's namespaces (docs/sandbox.md) ----

def template_main(fd: int, preload: list[str], import_env: dict[str, str], space_frame: bytes) -> None:
    """Entry point of a slot's template: PID 1 of its bubblewrap container (kcoral.py SandboxTemplate).

    It becomes the sandbox's user (`become_sandbox_user`), forks the small process that makes each
    request's init (`RequestInits`), imports once (with `import_env` set meanwhile), then per
    `ForkWorker` (plus the worker's pipe, passed as a handle) starts one worker in namespaces of
    its own (`fork_request`), answers `WorkerForked` and, once that worker and everything in its
    namespace are gone, `WorkerExited`.  It is never dumpable and, as its PID namespace's init,
    takes no signal it does not handle: no request can trace, read or stop it.
    """
    import importlib
    space = decode_message(space_frame)
    if not isinstance(space, RequestSpace):
        raise UnexpectedMessage(f"a sandbox template cannot start with {space!r}")
    become_sandbox_user(space)
    seccomp = seccomp_filter()  # built once; each request's worker installs it
    ignore_tree_signals()
    set_dumpable(False)  # a request may not ptrace or read the process that forks the next one
    inits = RequestInits(keep=fd)  # before the imports, which it need not copy
    saved = {name: os.environ.get(name) for name in import_env}
    os.environ.update(import_env)
    for name in preload:
        importlib.import_module(name)
    for name, value in saved.items():
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value
    prepare_template()  # each request's fork copies less
    own_pids = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)  # where its own children go back to
    conn = Connection(fd)
    send_message(conn, WorkerReady(os.getpid()))
    for message in messages(conn):
        if not isinstance(message, ForkWorker):
            raise UnexpectedMessage(f"a sandbox template cannot serve {message!r}")
        pipe = reduction.recv_handle(conn)
        try:
            worker = fork_request(conn, pipe, message, space, seccomp, inits, own_pids)
            send_message(conn, WorkerForked(worker))
            status = wait_for_child(worker)
        finally:
            inits.end()  # the request's init, and with it everything left in its namespace
        send_message(conn, WorkerExited(os.waitstatus_to_exitcode(status)))


# Linux's constants (stable ABI) for what the os module lacks before Python 3.12
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x08000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
CAP_SETGID, CAP_SETUID, CAP_SETPCAP, CAP_SYS_ADMIN, CAP_SYS_RESOURCE = 6, 7, 8, 21, 24
# what the template keeps to give each request fresh namespaces, and what it needs only to become
# the sandbox's user when the server runs as root (kcoral.py's bwrap_command adds exactly these)
TEMPLATE_CAPS = (CAP_SETPCAP, CAP_SYS_ADMIN, CAP_SYS_RESOURCE)
ROOT_TEMPLATE_CAPS = (CAP_SETGID, CAP_SETUID)
PROC_COVERED = ("sys", "sysrq-trigger", "irq", "bus")  # read-only in every /proc a request sees
NVIDIA_PROC_GPUS = "/proc/driver/nvidia/gpus"  # the driver's folder per GPU: a request sees its own only
SANDBOX_ROOT = "/kcoral"  # inside a sandbox: the request's writable space (work/, home/, cache/, tmp/, shm/)
SANDBOX_SPACES = {"/tmp": "tmp", "/var/tmp": "tmp", "/dev/shm": "shm"}  # where else it shows


def libc_call(name: str, *args: Any) -> int:
    """A libc call that sets errno -> its result; OSError naming the call when it fails."""
    result = getattr(LIBC, name)(*args)  # one CDLL: a new one makes a class, ~50 us in a fresh fork
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return result


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc_call("mount", source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
              data and data.encode())


# capset's and seccomp's structures, made once in the template: a class made in a request's fresh
# fork costs ~0.2 ms, most of it copying the pages it writes
class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def set_capabilities(keep: Collection[int]) -> None:
    """Make `keep` this process's effective and permitted capabilities, nothing inheritable."""
    bits = sum(1 << cap for cap in keep)
    data = (CapData * 2)(CapData(bits & 0xFFFFFFFF, bits & 0xFFFFFFFF, 0), CapData(bits >> 32, bits >> 32, 0))
    libc_call("capset", ctypes.byref(CapHeader(0x20080522, 0)), data)  # _LINUX_CAPABILITY_VERSION_3


def become_sandbox_user(space: RequestSpace) -> None:
    """Started by a root server, the template runs as the container's uid 0, which is the host's
    root: it switches to the sandbox's unprivileged uid, keeping only TEMPLATE_CAPS (within the
    container's user namespace) to give each request its namespaces.  A no-op otherwise."""
    if os.getuid() == space.uid:
        return
    libc_call("prctl", 8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS: the switch must not clear the permitted set
    os.setgroups([])
    os.setresgid(space.gid, space.gid, space.gid)
    os.setresuid(space.uid, space.uid, space.uid)
    set_capabilities(TEMPLATE_CAPS)


class RequestInits:
    """Each sandboxed request's init, PID 1 of the request's PID namespace, made by a small process
    the template forks before it imports anything: an init forked from the template itself copied
    the page tables of all its memory (torch's) and freed them again at its exit, 4.3 ms of CPU a
    request (a 2-core VM, a sandboxed burst), as much as the worker's own 5.7.  A fork of this
    process copies a few MiB of them.

    An init only has to be there: its namespace lasts as long as it does, and the kernel
    re-parents the request's orphans to it, which it reaps at once (SIGCHLD ignored).  It is not
    dumpable (inherited from the template) and drops every capability, so that a request, which
    sees it as PID 1, can neither trace nor read it (it stays in the container's mount namespace).
    The template forks the request's worker into its namespace (`fork_request`) and, once the
    worker is gone, has it killed (`end`): the kernel then ends everything else in the namespace."""

    def __init__(self, keep: int) -> None:
        """Fork the maker; `keep`, the template's pipe to the front-end, is closed in it."""
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.fork() == 0:
            os.close(keep)
            self.sock.close()
            serve_inits(theirs)
        theirs.close()

    def start(self) -> int:
        """A new PID namespace whose init is running -> a descriptor of that namespace (the
        maker's: the init, not dumpable, is not the template's to open in /proc)."""
        self.sock.sendall(b"n")
        data, fds, _, _ = socket.recv_fds(self.sock, INIT_STARTED.size, 1)
        if len(data) < INIT_STARTED.size:
            raise EOFError("the process that makes requests' inits is gone")
        failed = INIT_STARTED.unpack(data)[0]
        if failed or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(failed, f"a request's init could not start: {os.strerror(failed)}")
        return fds[0]

    def end(self) -> None:
        """Kill the last init started, if any, and wait until it is reaped (its namespace is then empty)."""
        self.sock.sendall(b"e")
        if self.sock.recv(1) != b"e":
            raise EOFError("the process that makes requests' inits is gone")

    def close(self) -> None:  # in the worker: nothing of the template's a request may hold
        self.sock.close()


INIT_STARTED = struct.Struct("=i")  # 0, with the namespace's descriptor, or the errno


def serve_inits(sock: socket.socket) -> typing.NoReturn:
    """The init maker's loop: "n" starts an init in a new PID namespace and answers with a
    descriptor of that namespace (or the errno), "e" kills the last one and answers once it is
    reaped; the template closing the socket ends it."""
    init, own_pids = 0, os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    while command := sock.recv(1):
        if command == b"n":
            try:
                libc_call("unshare", CLONE_NEWPID)  # the next child is PID 1 of a new namespace
                # libc's fork, not os.fork: this process has one thread, and the at-fork handlers its
                # imports registered (threading's, logging's, random's) cost each init ~0.7 ms of CPU
                # for state the init never uses
                init = libc_call("fork")
                if init == 0:
                    be_request_init(sock, own_pids)
                # the namespace can be opened once it has its first process
                namespace = os.open("/proc/self/ns/pid_for_children", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                sock.sendall(INIT_STARTED.pack(exc.errno or errno.EAGAIN))
                continue
            finally:  # back in its own: unshare fails while its children's namespace is another
                libc_call("setns", own_pids, CLONE_NEWPID)
            try:
                socket.send_fds(sock, [INIT_STARTED.pack(0)], [namespace])
            finally:
                os.close(namespace)
        elif command == b"e":
            if init:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGKILL)
                os.waitpid(init, 0)
                init = 0
            sock.sendall(b"e")
    os._exit(0)


def be_request_init(sock: socket.socket, own_pids: int) -> typing.NoReturn:
    """PID 1 of a request's namespace, until killed: holds nothing, can do nothing, reaps its orphans."""
    try:
        sock.close()
        os.close(own_pids)
        set_capabilities(())
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # a child it is given is reaped as it ends
        while True:
            signal.pause()
    finally:
        os._exit(1)


def fork_request(conn: Connection, pipe: int, message: ForkWorker, space: RequestSpace,
                 seccomp: bytes, inits: RequestInits, own_pids: int) -> int:
    """Fork a request's worker into the PID namespace of a fresh init (`RequestInits`) -> its pid.
    The worker is PID 2 there; it takes new mount and IPC namespaces, sets up the request's space
    (`enter_request_space`) and serves.  The worker is not the init itself, since an init takes no
    signal it does not handle from inside its namespace: a program's kill(getpid(), SIGKILL) would
    do nothing.

    The worker sees none of the container's processes, starts its PIDs afresh, and writes only to
    a tmpfs of its own, sized by the limits; the tmpfs and IPC objects go with its last process."""
    tasks = len(os.listdir("/proc/self/task"))  # the template's threads count against the uid too
    namespace = inits.start()
    try:
        libc_call("setns", namespace, CLONE_NEWPID)  # the template's next child goes there
    finally:
        os.close(namespace)
    try:
        worker = os.fork()
    except BaseException:
        libc_call("setns", own_pids, CLONE_NEWPID)
        raise
    if worker != 0:  # the template: its later children in its own namespace again
        libc_call("setns", own_pids, CLONE_NEWPID)
        os.close(pipe)
        return worker
    try:
        conn.close()
        inits.close()
        os.close(own_pids)  # the template's namespace: nothing a request may hold
        libc_call("unshare", CLONE_NEWNS | CLONE_NEWIPC)
        enter_request_space(space, tasks + 2, seccomp)  # + the init maker and the init
        if message.device == "cpu" and space.memory_bytes:
            limit_private_memory(space.memory_bytes)
        set_dumpable(True)
        worker_main(Connection(pipe), message.device, message.visible_gpus)
    finally:
        os._exit(1)


SANDBOXED = {"worker": False}  # set by a sandboxed worker: it ends its namespace's strays (terminate_descendants)


def enter_request_space(space: RequestSpace, others: int, seccomp: bytes) -> None:
    """In a request's worker, PID 2 of its PID namespace, in new mount and IPC namespaces: a /proc of its own (what
    changes the host read-only), no further user namespaces, a fresh tmpfs for everything the
    request may write (sized by --disk-limit-bytes and --file-limit), its own message queues; then
    no capabilities, at most --process-limit processes and threads for what it forks (counted per
    uid in the container's user namespace, where `others` are the template's threads, the init
    maker and the init), no core dumps, and last the seccomp filter (`install_seccomp_filter`), which no
    later process can shed."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    own_gpus = os.listdir(NVIDIA_PROC_GPUS) if os.path.isdir(NVIDIA_PROC_GPUS) else []  # the container shows its own
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    hide_other_gpu_folders(own_gpus)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:  # this user namespace's own limit
        f.write("0")
    for name in PROC_COVERED:
        path = f"/proc/{name}"
        if os.path.exists(path):
            mount(path, path, None, MS_BIND)
            mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("tmpfs", SANDBOX_ROOT, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={space.disk_bytes},nr_inodes={space.files},mode=0700")
    for sub in ("work", "home", "cache", "tmp", "shm"):
        os.mkdir(f"{SANDBOX_ROOT}/{sub}", 0o700)
    for place, sub in SANDBOX_SPACES.items():
        for path in space.kept:  # a read-only mount inside it (a checkout under /tmp, say) keeps its way
            if path.startswith(place + "/"):
                keep_mount(path, f"{SANDBOX_ROOT}/{sub}{path[len(place):]}")
        mount(f"{SANDBOX_ROOT}/{sub}", place, None, MS_BIND | MS_REC)
    mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for cap in range(64):  # the bounding set too: nothing can be regained by an exec
        with contextlib.suppress(OSError):
            libc_call("prctl", 24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    libc_call("prctl", 47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    set_capabilities(())
    if space.processes:
        resource_limit("RLIMIT_NPROC", space.processes + others)
    resource_limit("RLIMIT_CORE", 0)
    install_seccomp_filter(seccomp)
    SANDBOXED["worker"] = True



def limit_private_memory(memory_bytes: int) -> None:
    """RLIMIT_DATA: no process of the request may hold more than `memory_bytes` of private writable
    memory beyond what it was forked with (the template's).  The front-end samples the
    request's memory, all its kinds and processes together; between two samples a program that
    asks for 3 GiB at once (`bytearray(3 << 30)`) would outrun it, and is refused here at once
    instead (MemoryError).  CPU workers only: CUDA's driver maps private memory the request's
    limit was never meant to count."""
    with open("/proc/self/status", "rb") as f:
        data = next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"VmData:"))
    resource_limit("RLIMIT_DATA", data + memory_bytes)


def hide_other_gpu_folders(own: list[str], folder: str = NVIDIA_PROC_GPUS) -> None:
    """In a fresh /proc, which shows every GPU's driver folder again: a read-only tmpfs over `folder`
    with only the `own` ones (those the container showed) bound back, as the container's /proc has."""
    if not os.path.isdir(folder):
        return
    kept = {name: os.open(os.path.join(folder, name), os.O_PATH | os.O_DIRECTORY) for name in own}
    try:
        mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755")  # read-only below
        for name, fd in kept.items():
            os.mkdir(os.path.join(folder, name))
            mount(f"/proc/self/fd/{fd}", os.path.join(folder, name), None, MS_BIND)
        mount(None, folder, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    finally:
        for fd in kept.values():
            os.close(fd)


def keep_mount(source: str, target: str) -> None:
    """Show the read-only mount at `source` at `target` too (made in the fresh tmpfs), read-only."""
    if os.path.isdir(source):
        os.makedirs(target, 0o700, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), 0o700, exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o600))
    mount(source, target, None, MS_BIND | MS_REC)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def resource_limit(name: str, value: int) -> None:
    resource.setrlimit(getattr(resource, name), (value, value))


def wait_for_child(pid: int) -> int:
    """Wait for the child `pid` -> its wait status; the template, its container's init, also reaps
    every orphan re-parented to it meanwhile."""
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            return status


# --- the request's seccomp filter: kernel calls no program or GPU tool needs (docs/sandbox.md) ----

# Denied with EPERM in every sandboxed request, by name -> (x86_64 number, aarch64 number; None where
# the architecture has no such call).  What Docker's default profile denies an unprivileged
# container, less what CUDA, ncu, compute-sanitizer, nvcc, g++ and Triton use (docs/sandbox.md
# lists what was kept and why).
SECCOMP_DENIED = {
    # the kernel keyring: a key outlives its request and is readable by the next (same uid)
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    # mounts and namespaces: a request's worker has set up its space before; nothing after needs them
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "mount_setattr": (442, 442),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "open_tree": (428, 428), "move_mount": (429, 429), "unshare": (272, 97), "setns": (308, 268),
    # large kernel surfaces, each a source of privilege escalations, that no tool here uses
    "bpf": (321, 280), "userfaultfd": (323, 282), "perf_event_open": (298, 241),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    # file handles (the "shocker" escape), the host's clock, log, modules, swap, accounting, reboot
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266),
    "syslog": (103, 116), "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "reboot": (169, 142), "acct": (163, 89),
    "swapon": (167, 224), "swapoff": (168, 225), "quotactl": (179, 60), "vhangup": (153, 58),
    "fanotify_init": (300, 262), "kcmp": (312, 272), "lookup_dcookie": (212, 18), "nfsservctl": (180, 42),
    # x86_64 only: I/O ports and obsolete calls
    "iopl": (172, None), "ioperm": (173, None), "create_module": (174, None), "get_kernel_syms": (177, None),
    "query_module": (178, None), "uselib": (134, None), "ustat": (136, None), "sysfs": (139, None),
    "_sysctl": (156, None),
}
# the machine -> (its AUDIT_ARCH_ value, which column of SECCOMP_DENIED, the first number of another ABI
# sharing it: x32's calls on x86_64, which must not slip past the table)
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 0, 0x40000000), "aarch64": (0xC00000B7, 1, None)}
BPF_LOAD, BPF_JEQ, BPF_JGE, BPF_RETURN = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..|JGE|K, BPF_RET|K
SECCOMP_ALLOW, SECCOMP_KILL_PROCESS, SECCOMP_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
BPF_INSTRUCTION = struct.Struct("=HBBI")  # struct sock_filter


def seccomp_filter(machine: str | None = None) -> bytes:
    """The request's filter for this machine, as classic BPF: a call of another architecture (an
    i386 binary's int 0x80) kills the process, each SECCOMP_DENIED call fails with EPERM, every
    other call is allowed.  OSError on a machine without a table (the sandbox then does not start)."""
    machine = machine or os.uname().machine
    if machine not in SECCOMP_ARCHES:
        raise OSError(errno.ENOSYS, f"no seccomp table for {machine} (only {', '.join(SECCOMP_ARCHES)})")
    arch, column, foreign_abi = SECCOMP_ARCHES[machine]
    numbers = sorted({number for pair in SECCOMP_DENIED.values() if (number := pair[column]) is not None})
    checks: list[tuple[int, int]] = [(BPF_JGE, foreign_abi)] if foreign_abi is not None else []
    checks += [(BPF_JEQ, number) for number in numbers]
    program = [(BPF_LOAD, 0, 0, 4), (BPF_JEQ, 1, 0, arch), (BPF_RETURN, 0, 0, SECCOMP_KILL_PROCESS),
               (BPF_LOAD, 0, 0, 0)]
    # each check jumps, when it matches, over the checks after it and the ALLOW to the EPERM
    program += [(code, len(checks) - i, 0, k) for i, (code, k) in enumerate(checks)]
    program += [(BPF_RETURN, 0, 0, SECCOMP_ALLOW), (BPF_RETURN, 0, 0, SECCOMP_ERRNO | errno.EPERM)]
    return b"".join(BPF_INSTRUCTION.pack(*instruction) for instruction in program)


def install_seccomp_filter(program: bytes) -> None:
    """Apply `program` to this process and everything it starts, for good (filters only stack up:
    nothing a request runs can remove it).  no_new_privs first, as the kernel requires of a process
    without CAP_SYS_ADMIN; it also keeps any set-uid file from gaining privileges.  OSError if the
    kernel refuses, which ends the request's set-up: no request runs unfiltered."""
    libc_call("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    fprog = SockFprog(len(program) // BPF_INSTRUCTION.size, program)
    libc_call("prctl", 22, 2, ctypes.byref(fprog), 0, 0)  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def check_seccomp() -> None:
    """For the server's start-up probe, inside a container: install the filter in a child and
    confirm a keyring call is refused there -> SystemExit naming what failed otherwise."""
    program = seccomp_filter()
    child = os.fork()
    if child == 0:
        code = 3
        try:
            install_seccomp_filter(program)
            code = 0 if keyring_call_refused() else 2
        finally:
            os._exit(code)
    status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if status != 0:
        raise SystemExit("the request's seccomp filter " + ("did not refuse keyctl" if status == 2 else
                                                            "cannot be installed here (prctl PR_SET_SECCOMP)"))


def keyring_call_refused() -> bool:
    """Whether keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING, 0) fails with EPERM, as the
    filter makes it (unfiltered, it answers the user keyring's id)."""
    return LIBC.syscall(SECCOMP_DENIED["keyctl"][SECCOMP_ARCHES[os.uname().machine][1]], 0, -4, 0) == -1 \
        and ctypes.get_errno() == errno.EPERM


# --- the worker process: start, serve requests, exit ----------------------------------------------

def worker_main(conn: Connection, device: str, visible_gpus: list[str]) -> None:
    """Entry point of a worker process forked from the template.

    It leads its own process group so that the front-end can kill everything
    a program started with one signal.
    """
    os.setsid()
    ignore_tree_signals()
    die_with_parent()
    become_subreaper()
    detach_standard_streams()
    set_oom_score(1000)  # when the host runs out of memory, a worker goes first, never the front-end
    os.environ[WORKER_MARK] = str(os.getpid())  # inherited: finds what escapes after a crash
    # a native crash prints the Python frames it happened under into fd 2, the request's captured stderr
    faulthandler.enable(file=2, all_threads=False)
    problem = template_cuda_problem(device)
    if problem:
        send_message(conn, WorkerFailed(problem))
        os._exit(1)
    if device == "cuda":
        prepare_gpu(visible_gpus)
    runtime = Runtime(device)
    install_kcoral_modules()
    import gc
    gc.freeze()  # the template's objects are permanent: later collections skip them
    env = dict(os.environ)
    torch_settings = TorchSettings.at_start()
    send_message(conn, WorkerReady(os.getpid()))
    for message in messages(conn):
        match message:
            case StopWorker():
                os._exit(0)
            case InitGpu():
                send_message(conn, initialize_gpu())
                env = dict(os.environ)
                if torch_settings is not None:
                    torch_settings.capture_cuda()
            case JobRequest():
                poisoned = serve_request(conn, message, runtime)
                if message.retire or poisoned:
                    os._exit(0)
                reset_process_state(env, torch_settings)
            case _:
                raise UnexpectedMessage(f"a worker cannot serve {message!r}")


def detach_standard_streams() -> None:
    """stdin, stdout and stderr on /dev/null: a program writes to its request's capture pipes
    (`Capture`) or nowhere, never to the server's own log or console."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def messages(conn: Connection) -> Iterator[object]:
    """What the front-end sends, one message at a time; when it closes the pipe, this process
    (a worker or a sandbox template) has nothing left to do and exits quietly."""
    while True:
        try:
            yield receive_message(conn)[0]
        except EOFError:
            os._exit(0)


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")


def template_cuda_problem(device: str) -> str | None:
    """Why this fork cannot use CUDA, or None.

    The template preloads torch (and tvm_ffi) so that a fresh worker per request
    costs a fork, not seconds of imports; that is only sound while the template
    never initialised CUDA (a CUDA context does not survive fork).  The front-end
    sets PYTORCH_NVML_BASED_CUDA_CHECK=1 for it, so availability checks on import
    ask NVML instead of calling cuInit.  Where NVML is missing (a CPU host with a
    CUDA build of torch) torch falls back to cudaGetDeviceCount, which marks every
    fork as bad: that only matters to a worker that will use CUDA, so CPU workers
    are never refused.
    """
    torch = sys.modules.get("torch")
    if device != "cuda" or torch is None or not hasattr(torch, "cuda"):
        return None
    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    if torch.cuda.is_initialized() or bad_fork():
        return "the worker template initialised CUDA before forking; its workers cannot use the GPU"
    return None


def prepare_gpu(visible_gpus: list[str]) -> None:
    """Pin the worker to its GPU(s) before CUDA starts; host work only, no CUDA context yet.

    torch reads CUDA_VISIBLE_DEVICES when CUDA initialises, not on import, so
    pinning after the template imported it still holds.
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
    for name in TORCHRUN_VARIABLES:
        os.environ.pop(name, None)
    import torch  # noqa: F401  mandatory on GPU workers: failing here fails the start
    with contextlib.suppress(ImportError):
        import tvm_ffi  # noqa: F401  preloaded by the template; imported now rather than under the lease later
    preload_library_runtimes("cuda")  # likewise: before the worker is offered, not at its first library load


def initialize_gpu() -> GpuInitialized:
    """Create the CUDA context (the front-end holds the lease meanwhile).

    -> GpuInitialized(arch like "sm_90a", CUDA version torch was built with, device 0's UUID or "").
    """
    import torch
    torch.cuda.init()
    torch.cuda.synchronize()
    major, minor = torch.cuda.get_device_capability(0)
    suffix = "a" if major >= 9 else ""
    # later CPU-only compiles then need not query the driver
    os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", f"{major}.{minor}{suffix}")
    gpu_uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    return GpuInitialized(f"sm_{major}{minor}{suffix}", torch.version.cuda, str(gpu_uuid or ""))


def serve_request(conn: Connection, request: JobRequest, runtime: Runtime) -> bool:
    staged = StagedBlobs(conn, request.blob_index)
    capture = None
    if request.capture:
        out_fd = reduction.recv_handle(conn)
        err_fd = reduction.recv_handle(conn)
        capture = Capture(out_fd, err_fd)
    progress = reduction.recv_handle(conn) if request.progress else None
    if progress is not None:  # a full pipe is a BlockingIOError: announce_start falls back to a message
        os.set_blocking(progress, False)
        os.set_inheritable(progress, False)
    if request.blob_index and runtime.device == "cuda":  # staged under the lease, the copy would keep peers waiting
        staged.stage()
    lease = GpuLease(conn, runtime) if runtime.device == "cuda" else NoLease()
    root_fd = os.open(request.workspace, NOFOLLOW_DIR)
    os.chdir(request.workspace)
    sys.path.insert(0, request.workspace)  # uploaded packages import as they would from a checkout
    try:
        program = ProgramRun(conn, request, staged, root_fd, lease, runtime, progress)
        error = program.run()
        error, poisoned = finish_on_device(program, error, lease, reused=not request.retire)
        if terminate_descendants(request.grace):  # a worker whose program left processes retires too
            poisoned = True
            error = error or program.error_at_last("runtime", "program left background processes running; "
                                                   "they were terminated")
    finally:
        staged.close()  # the views it handed out stay mapped
        os.close(root_fd)
        if progress is not None:
            os.close(progress)
        os.chdir("/")
        if not request.retire:  # a retiring worker exits: forgetting would only delay its answer (ms)
            forget_workspace_imports(request.workspace)
        if capture is not None:
            capture.restore()
    send_message(conn, RequestDone(error, poisoned))
    return poisoned


def forget_workspace_imports(workspace: str) -> None:
    """Take the workspace off the import path, and what was imported from it out of sys.modules:
    a reused worker's next request has a workspace of the same name holding other files."""
    with contextlib.suppress(ValueError):  # the program may have edited sys.path itself
        sys.path.remove(workspace)
    inside = workspace.rstrip("/") + "/"
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(inside):
            del sys.modules[name]
    importlib.invalidate_caches()


def finish_on_device(program: ProgramRun, error: ErrorObject | None, lease: GpuLease | NoLease,
                     reused: bool) -> tuple[ErrorObject | None, bool]:
    """docs/server.md §3.4, under the lease: wait for the devices' work, read and clear CUDA's last error, and
    on a worker that serves again drop the request's objects and give their GPU memory back
    before the front-end releases the lease, so an idle worker never sits on a peer's memory.
    -> (error, poisoned): a CUDA failure here makes the context unusable for later requests."""
    poisoned = False
    try:
        lease.finish()
    except Exception as exc:
        poisoned = True
        error = error or program.error_at_last("runtime", f"{type(exc).__name__}: {exc}")
    runtime = program.runtime
    cuda_error = runtime.take_last_error()
    if cuda_error and error and error["kind"] == "gpu_access":
        error["message"] += f"; CUDA also reports {cuda_error}"
    elif cuda_error:
        error = program.error_at_last("runtime", cuda_error)
    program.handles.clear()
    if reused and not poisoned and runtime.device == "cuda":
        import gc
        gc.collect()  # module-scope tensors in reference cycles
        try:
            runtime.release_cached_memory()
        except Exception as exc:
            poisoned = True
            error = error or program.error_at_last("runtime", f"{type(exc).__name__}: {exc}")
        finalize_cupti()
    return error, poisoned


def reset_process_state(env: dict[str, str], torch_settings: TorchSettings | None = None) -> None:
    """Between requests of a reused worker: environment, torch's global settings, source cache, garbage."""
    import gc
    if torch_settings is not None:
        torch_settings.restore()
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    for name in [n for n in linecache.cache if n.startswith("<uploaded:")]:
        del linecache.cache[name]
    gc.collect()


# torch's process-wide switches a program may flip, as (module under torch, attribute): the
# cudnn and matmul flags, then the fp32_precision settings of torch 2.9+ that the legacy ones are
# views of (restored last, so the exact original values win over what the legacy setters derive)
TORCH_FLAGS = (("backends.cudnn", "enabled"), ("backends.cudnn", "benchmark"), ("backends.cudnn", "deterministic"),
               ("backends.cudnn", "allow_tf32"), ("backends.cuda.matmul", "allow_tf32"),
               ("backends.cuda.matmul", "allow_fp16_reduced_precision_reduction"),
               ("backends.cuda.matmul", "allow_bf16_reduced_precision_reduction"),
               ("backends", "fp32_precision"), ("backends.cuda.matmul", "fp32_precision"),
               ("backends.cudnn", "fp32_precision"), ("backends.cudnn.conv", "fp32_precision"),
               ("backends.cudnn.rnn", "fp32_precision"), ("backends.mkldnn", "fp32_precision"),
               ("backends.mkldnn.matmul", "fp32_precision"), ("backends.mkldnn.conv", "fp32_precision"),
               ("backends.mkldnn.rnn", "fp32_precision"))


class TorchSettings:
    """torch's global settings as a worker started with them, put back between the requests of a
    reused worker (docs/server.md §3.3): default dtype, deterministic algorithms, float32 matmul
    precision, the cudnn/matmul flags and, once CUDA is initialised, the current device and its
    stream.  Reading them costs microseconds in a warm process (not in a fresh fork: at_start);
    only what differs is set again."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.dtype = torch.get_default_dtype()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.flags = {}
        for path, name in TORCH_FLAGS:
            with contextlib.suppress(Exception):  # older torch: no such flag
                self.flags[path, name] = getattr(self.owner(path), name)
        self.cuda_device: int | None = None

    @staticmethod
    def capture() -> TorchSettings | None:
        """The settings now, if torch is loaded (the template preloads it); None without torch."""
        torch = sys.modules.get("torch")
        return TorchSettings(torch) if torch is not None and hasattr(torch, "get_default_dtype") else None

    @staticmethod
    def at_start() -> TorchSettings | None:
        """A fresh worker's settings: those its template read before the fork (nothing changes them
        in between; read in each worker, they took 0.75 ms of CPU, first touches of a fork's pages),
        or, in a process no prepared template forked, read now."""
        return TEMPLATE_TORCH_SETTINGS if TEMPLATE_PREPARED else TorchSettings.capture()

    def owner(self, path: str) -> Any:
        return functools.reduce(getattr, path.split("."), self.torch)

    def capture_cuda(self) -> None:
        """Once the worker created its CUDA context: the device (and so its default stream) it chose."""
        self.cuda_device = self.torch.cuda.current_device()

    def restore(self) -> None:
        torch = self.torch
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        if torch.get_float32_matmul_precision() != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        for (path, name), value in self.flags.items():
            with contextlib.suppress(Exception):  # a legacy getter refuses to read mixed settings: set anyway
                if getattr(self.owner(path), name) == value:
                    continue
            setattr(self.owner(path), name, value)
        if self.cuda_device is not None:
            self.restore_cuda()

    def restore_cuda(self) -> None:
        cuda, device = self.torch.cuda, self.cuda_device
        if cuda.current_device() != device:
            cuda.set_device(device)
        default = cuda.default_stream(device)
        if cuda.current_stream(device) != default:
            cuda.set_stream(default)


# --- one program: instructions in order (docs/protocol.md §8) -------------------------------------

class UploadedModule:
    """The namespace of an uploaded Python module."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace


def load_module(source: str) -> UploadedModule:
    filename = f"<uploaded:{hashlib.sha1(source.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        code = compile(source, filename, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        raise ExecutionError("parse", syntax_error_message(exc)) from exc
    namespace: dict[str, Any] = {}
    try:
        exec(code, namespace)
    except Exception as exc:
        raise ExecutionError("parse", f"{type(exc).__name__}: {exc}") from exc
    return UploadedModule(namespace)


def syntax_error_message(exc: SyntaxError | ValueError) -> str:
    """"syntax error: <what> (<file>, line N)", then the offending line with a caret under the
    column, as Python's own traceback shows them: a line number alone leaves the reader counting."""
    message = f"syntax error: {exc}"
    if not isinstance(exc, SyntaxError) or not exc.text:
        return message
    lines = "".join(traceback.format_exception_only(exc)).splitlines()
    return "\n".join([message, *lines[1:-1]])  # between '  File "...", line N' and 'SyntaxError: ...'


@dataclasses.dataclass(frozen=True)
class UnreadUpload:
    """The handle of a `bytes` upload not read yet: the staged blob's hash."""
    digest: str


class ProgramRun:
    """One request's execution: handles, returns streamed to the front-end, the error."""

    def __init__(self, conn: Connection, request: JobRequest, staged: StagedBlobs, root_fd: int,
                 lease: GpuLease | NoLease, runtime: Runtime, progress: int | None) -> None:
        self.conn = conn
        self.progress = progress  # the progress pipe's write end (JobRequest.progress)
        self.runtime = runtime
        self.request = request
        self.staged = staged
        self.root_fd = root_fd
        self.upload_dirs = UploadDirectories(root_fd)
        self.lease = lease
        self.handles: dict[str, Any] = {}
        self.last_index = 0
        self.cpu_only: set[str] = set()
        self.files_added = False  # since the import system last listed the workspace (refresh_import_caches)
        self.encoder = Encoder(0, request.max_response_bytes, lambda value: self.staged.digest_of(value),
                               request.max_response_parts)

    def run(self) -> ErrorObject | None:
        try:
            return self.run_instructions()
        finally:
            self.upload_dirs.forget()

    def run_instructions(self) -> ErrorObject | None:
        follows_file_upload = False
        for index, ins in enumerate(self.request.instructions):
            self.last_index = index
            file_upload = ins["op"] == "upload" and ins["kind"] == "file"
            if not (file_upload and follows_file_upload):  # since the last file upload only our code ran
                instruction_boundary()
            if not file_upload:  # code may run now that moves or removes the directories
                self.upload_dirs.forget()
            follows_file_upload = file_upload
            self.announce_start(index)
            try:
                self.lease.before(ins, self.cpu_only)
                getattr(self, "op_" + ins["op"])(ins)
            except ExecutionError as exc:
                kind, message = exc.kind, exc.message
                if kind not in ERROR_KINDS:
                    kind, message = "engine", f"ExecutionError with unknown kind {exc.kind!r}: {exc.message}"
                tb = getattr(exc, "stack", None) or traceback_text(exc, ours=False)  # a deliberate, worded error
                error = error_object(kind, message, index, ins, tb)
                error.update(getattr(exc, "fields", {}))
                return error
            except Exception as exc:
                ours = ins["op"] != "run" and not passes_through_uploaded_code(exc)
                return error_object("engine", f"{type(exc).__name__}: {exc}{limit_hint(exc)}", index, ins,
                                    traceback_text(exc, ours))
        return None

    def announce_start(self, index: int) -> None:
        """From here on a crash is attributed to instruction `index` (announced_by_record)."""
        if self.progress is not None and announced_by_record(index):
            with contextlib.suppress(BlockingIOError):  # a record is atomic: written whole or not at all
                os.write(self.progress, PROGRESS_RECORD.pack(index))
                return
        send_message(self.conn, InstructionStarted(index))

    def ref(self, value: dict[str, str]) -> Any:
        handle = self.handles[value["$ref"]]
        if isinstance(handle, UnreadUpload):  # first use of a `bytes` upload: read it now, once
            handle = self.handles[value["$ref"]] = self.staged.read(handle.digest)
        return handle

    def returned(self, value: dict[str, str]) -> Any:
        """A return's value: a `bytes` upload never used is returned unread (the front-end sends
        its own copy of a staged blob), anything else as `ref` gives it."""
        handle = self.handles[value["$ref"]]
        return self.staged.unread_view(handle.digest) if isinstance(handle, UnreadUpload) else self.ref(value)

    def error_at_last(self, kind: str, message: str) -> ErrorObject:
        """An error attributed to the last instruction started (docs/server.md §3.4)."""
        index = self.last_index
        return error_object(kind, message, index, self.request.instructions[index], "")

    def op_upload(self, ins: Instruction) -> None:
        kind = ins["kind"]
        value: Any
        if kind == "module":
            self.refresh_import_caches()
            value = load_module(ins["source"])
        elif kind == "bytes":  # read on first use (ref): an upload that is only returned is never read
            value = UnreadUpload(ins["blob"])
        elif kind == "tensor":
            value = self.runtime.load_tensor(self.staged.read_writable(ins["blob"]), ins["dtype"], ins["shape"])
        elif kind == "library":
            value = self.runtime.load_library(ins["blob"], self.staged.read(ins["blob"]))
        else:
            materialize(self.upload_dirs, ins["path"], self.staged, ins["blob"])
            self.files_added = True
            value = ins["path"]
        self.handles[ins["id"]] = value

    def op_get_function(self, ins: Instruction) -> None:
        target, name = self.ref(ins["module"]), ins["name"]
        if isinstance(target, UploadedModule):
            if name not in target.namespace:
                raise ExecutionError("parse", f"the uploaded Python module defines no name {name!r}")
            value = target.namespace[name]
        elif self.runtime.is_library(target):
            value = self.runtime.library_function(target, name)
        elif self.runtime.device == "cpu":
            raise ExecutionError("unavailable", "get_function needs an uploaded module or library")
        else:
            raise ExecutionError("runtime", "get_function needs an uploaded module or library")
        if ins.get("cpu_only"):
            self.cpu_only.add(ins["id"])
        self.handles[ins["id"]] = value

    def refresh_import_caches(self) -> None:
        """Before code runs that may import files uploaded since the last import: the import
        system caches a directory's listing, and trusts its mtime, which can miss writes made
        within the same clock tick."""
        if self.files_added:
            importlib.invalidate_caches()
            self.files_added = False

    def op_run(self, ins: Instruction) -> None:
        self.refresh_import_caches()
        fn = self.ref(ins["fn"])
        if not callable(fn):
            raise ExecutionError("runtime", f"handle {ins['fn']['$ref']!r} is not callable")
        args = [self.ref(a) if is_ref(a) else a for a in ins.get("args", [])]
        watched = self.runtime.device == "cuda" and ins["fn"]["$ref"] in self.cpu_only
        with CudaCallGuard() if watched else contextlib.nullcontext():
            self.handles[ins["id"]] = fn(*args)

    def op_return(self, ins: Instruction) -> None:
        self.encoder.parts = []
        first_part = self.encoder.next_part
        try:
            encoded = self.encode_return(ins)
            # JSON recurses twice per level: a value the encoder took can still be too deep
            frame = encode_message(
                ReturnValue(ins["key"], encoded, [digest or data.nbytes for data, digest in self.encoder.parts]))
        except BaseException as exc:
            # a failing return contributes nothing: give its part numbers back
            self.encoder.byte_budget += sum(data.nbytes for data, _ in self.encoder.parts)
            self.encoder.next_part = first_part
            if isinstance(exc, RecursionError):
                raise ExecutionError("serialization", f"return {json.dumps(ins['key'])}: the returned value is "
                                     "nested too deeply") from exc
            raise
        send_raw(self.conn, frame, *(data for data, staged in self.encoder.parts if staged is None))

    def encode_return(self, ins: Instruction) -> dict[str, Any]:
        kind = ins.get("kind")
        if kind is None:
            try:
                return self.encoder.value(self.returned(ins["value"]))
            except ExecutionError as exc:  # say which return, and where inside its value
                exc.message = located_message(ins["key"], exc)
                raise
        path = ins["path"]
        if is_ref(path):
            try:
                path = normalize_path(self.ref(path))
            except ValidationError as exc:
                raise ExecutionError("serialization", f"cannot return {kind}: {exc}") from exc
        if kind == "file":
            return self.encoder.file(collect_file(self.root_fd, path, self.encoder.byte_budget))
        files, dirs = collect_folder(self.root_fd, path, self.encoder.byte_budget)
        return {"type": "folder", "files": {rel: self.encoder.file(data) for rel, data in files.items()},
                "directories": dirs}


def error_object(kind: str, message: str, index: int, ins: Instruction, tb: str) -> ErrorObject:
    return {"kind": kind, "message": message, "instruction_index": index,
            "instruction_op": ins["op"], "instruction_id": ins.get("id"), "traceback": tb}


def traceback_text(exc: BaseException, ours: bool = True) -> str:
    """The traceback as Python prints it (last TRACEBACK_CHARS).  For an error of the program
    (`ours` false) without the server's frames: they only say how the worker called the uploaded
    code, and would bury its frames; a failure of our own code keeps them, they are the bug."""
    report = traceback.TracebackException.from_exception(exc)
    if not ours:
        drop_server_frames(report)
    return "".join(report.format())[-TRACEBACK_CHARS:]


def drop_server_frames(report: traceback.TracebackException) -> None:
    """Remove the frames of SERVER_FILES from `report` and every exception chained to it."""
    for current in chained(report):
        current.stack = traceback.StackSummary.from_list(
            [frame for frame in current.stack if os.path.basename(frame.filename) not in SERVER_FILES])


def chained(root: Any) -> list[Any]:
    """`root` and every exception chained to it (cause, context, an exception group's members),
    each once: for exceptions and their traceback.TracebackException reports alike."""
    found, pending, seen = [], [root], set()
    while pending:
        current = pending.pop()
        if id(current) not in seen:
            seen.add(id(current))
            found.append(current)
            links = (current.__cause__, current.__context__, *(getattr(current, "exceptions", None) or ()))
            pending += [e for e in links if e is not None]
    return found


def limit_hint(exc: BaseException) -> str:
    """Which request limit a failure ran into, when one plausibly did (docs/sandbox.md): a write
    that found the sandbox's tmpfs full of bytes or of files, a fork or thread refused."""
    chain = chained(exc)
    errnos = {e.errno for e in chain if isinstance(e, OSError)}
    if errnos & {errno.ENOSPC, errno.EDQUOT} and os.getcwd().startswith(SANDBOX_ROOT):
        space = os.statvfs(SANDBOX_ROOT)
        if space.f_files and not space.f_ffree:
            return f" (the request's file limit, {space.f_files} files and directories, is reached: --file-limit)"
        return (f" (the request's disk limit, {space.f_blocks * space.f_frsize} bytes in its workspace, /tmp "
                "and /dev/shm together, is reached: --disk-limit-bytes)")
    if (errno.ENOMEM in errnos or any(isinstance(e, MemoryError) for e in chain)) and private_memory_limited():
        return " (the request's memory limit, for one process's private memory, is reached: --memory-limit-bytes)"
    if errno.EAGAIN in errnos or any("can't start new thread" in str(e) for e in chain):
        return " (the request may have reached its limit of processes and threads: --process-limit)"
    return ""


def private_memory_limited() -> bool:
    """Whether this sandboxed process runs under `limit_private_memory`."""
    return resource.getrlimit(resource.RLIMIT_DATA)[0] != resource.RLIM_INFINITY


def passes_through_uploaded_code(exc: BaseException) -> bool:
    """Whether `exc` (or an exception chained to it) was raised in or below a frame of uploaded code."""
    return any(frame.f_code.co_filename.startswith("<uploaded:")
               for current in chained(exc) for frame, _ in traceback.walk_tb(current.__traceback__))


LINE_BUDGET = 256  # line-ending writes per instruction that reach the pipe as they are printed
FLUSH_HOOKS_INSTALLED = False  # in this process (install_flush_hooks)


class Capture:
    """Points fds 1 and 2 (and sys.stdout/err) at the front-end's pipes for one request.

    stderr is line-buffered, as CPython makes it.  stdout is line-buffered for an instruction's
    first LINE_BUDGET lines, so that what a program prints before a native crash reaches the
    pipe, then block-buffered: a write syscall per line costs several microseconds, a whole
    request's worth for a program printing 65 536 lines.  Buffered output is flushed at every
    instruction boundary and before another process can write to fds 1 and 2 or this one ends
    (install_flush_hooks), which keeps it in order with what child processes write.
    """

    active: Capture | None = None

    def __init__(self, out_fd: int, err_fd: int) -> None:
        install_flush_hooks()
        for stream in (sys.stdout, sys.stderr):
            flush_quietly(stream)
        self.saved = (os.dup(1), os.dup(2), sys.stdout, sys.stderr)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        self.stdout_buffer = BudgetedBuffer(1)
        self.stdout = sys.stdout = self.stdout_buffer.text
        self.stderr = sys.stderr = text_stream(open(2, "wb", closefd=False))
        Capture.active = self

    def flush(self) -> None:
        # the program may have replaced sys.stdout (contextlib.redirect_stdout): ours still hold output
        for stream in (sys.stdout, sys.stderr, self.stdout, self.stderr):
            flush_quietly(stream)

    def next_instruction(self) -> None:
        self.flush()
        self.stdout_buffer.rearm()

    def restore(self) -> None:
        Capture.active = None
        saved_out, saved_err, sys_out, sys_err = self.saved
        self.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        sys.stdout, sys.stderr = sys_out, sys_err


class BudgetedBuffer(io.BufferedWriter):
    """The captured stdout's byte buffer: while its line-buffered text stream `text` calls flush()
    once per printed line, it counts them and, at LINE_BUDGET, makes `fast` sys.stdout until the
    next instruction: a block-buffered text stream of the io module's own types, over fd 1 too.
    A text stream over a subclass like this one looks its `closed` up on every write (a print
    0.68 µs where it takes 0.55: 8 ms of 65 536 lines).  A program that holds `text` or this
    buffer from before still writes in order: each write here flushes `fast` first, and past the
    budget goes out at once."""

    def __init__(self, fd: int) -> None:
        super().__init__(open(fd, "wb", buffering=0, closefd=False))
        self.fd = fd
        self.lines = 0
        self.text = text_stream(self)
        self.fast: io.TextIOWrapper | None = None  # made at the first budget reached
        self.passing = False  # past the budget: `fast` is sys.stdout, writes here go out at once

    def write(self, data: Any, /) -> int:  # any buffer, as the io module's
        self.flush_fast()
        written = super().write(data)
        if self.passing:
            super().flush()
        return written

    def flush(self) -> None:
        self.flush_fast()
        super().flush()
        self.lines += 1
        if self.lines == LINE_BUDGET and not self.closed:  # reconfigure() flushes again: lines goes past it
            with contextlib.suppress(ValueError):  # detached by the program
                self.text.reconfigure(line_buffering=False, write_through=True)
            if self.fast is None:
                self.fast = io.TextIOWrapper(open(self.fd, "wb", closefd=False),
                                             encoding="utf-8", errors="replace")
            self.passing = True
            if sys.stdout is self.text:  # not where the program put a stream of its own
                sys.stdout = self.fast

    def flush_fast(self) -> None:
        if self.fast is not None and not self.fast.closed:  # the program may close it
            self.fast.flush()

    def rearm(self) -> None:
        if sys.stdout is self.fast:
            sys.stdout = self.text
        self.passing = False
        with contextlib.suppress(ValueError):  # closed by the program
            self.text.reconfigure(line_buffering=True, write_through=False)
        self.lines = 0  # after reconfigure(), whose flush counts


def text_stream(buffer: io.BufferedWriter) -> io.TextIOWrapper:
    return io.TextIOWrapper(buffer, encoding="utf-8", errors="replace", line_buffering=True)


def instruction_boundary() -> None:
    """Before each instruction: the previous one's output reaches the pipes, the line budget restarts."""
    if Capture.active is not None:
        Capture.active.next_instruction()


def flush_output() -> None:
    """Before another process may write to fds 1 and 2, or this one ends: Python's buffers first."""
    if Capture.active is not None:
        Capture.active.flush()
    else:
        for stream in (sys.stdout, sys.stderr):
            flush_quietly(stream)


def install_flush_hooks() -> None:
    """Once per process (a template's workers inherit them: warm_request_path): flush_output() before
    every fork, exec, spawn and system(), and before os._exit() and os.abort(), which skip the flush
    at interpreter exit."""
    global FLUSH_HOOKS_INSTALLED
    if FLUSH_HOOKS_INSTALLED:
        return
    FLUSH_HOOKS_INSTALLED = True
    import _posixsubprocess
    import functools
    import subprocess

    def flushing_first(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            flush_output()
            return fn(*args, **kwargs)
        return wrapper

    os.register_at_fork(before=flush_output)  # os.fork, os.forkpty, multiprocessing's fork
    # subprocess (both its fork_exec and posix_spawn paths), multiprocessing's spawn and forkserver,
    # and the exec family (os.execl ... os.execvpe end in os.execv or os.execve)
    for owner, name in ((subprocess.Popen, "_execute_child"), (_posixsubprocess, "fork_exec"),
                        (os, "posix_spawn"), (os, "posix_spawnp"), (os, "execv"), (os, "execve"),
                        (os, "_exit"), (os, "abort"), (os, "system")):
        setattr(owner, name, flushing_first(getattr(owner, name)))



def flush_quietly(stream: IO[str]) -> None:
    try:
        stream.flush()
    except (OSError, ValueError, AttributeError):  # user code may have closed the fd
        pass


# --- workspace files (docs/protocol.md §8.3, 8.6) -------------------------------------------------

NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_parent(root_fd: int, path: str) -> tuple[int, str]:
    """Open the directory holding `path`'s last component without following links."""
    parts = path.split("/")
    fd = os.dup(root_fd)
    try:
        for name in parts[:-1]:
            child = os.open(name, NOFOLLOW_DIR, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


class UploadDirectories:
    """The directories file uploads write into, kept open while uploads follow one another: each
    of a folder's 500 files is created in its directory's fd, without a walk from the workspace's
    root first (a mkdir, an open and a close per level).  Forgotten before any other instruction,
    which may run code that moves or removes them; at most MAX_OPEN open at a time."""
    MAX_OPEN = 64

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.fds: dict[str, int] = {}  # workspace-relative path -> fd

    def parent_of(self, path: str) -> tuple[int, str]:
        """-> (fd of the directory holding `path`, made where missing, links not followed; its last component)."""
        head, _, name = path.rpartition("/")
        return (self.directory(head) if head else self.root_fd), name

    def directory(self, path: str) -> int:
        fd = self.fds.get(path)
        if fd is None:
            parent_fd, name = self.parent_of(path)
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                pass
            fd = os.open(name, NOFOLLOW_DIR, dir_fd=parent_fd)
            if len(self.fds) >= self.MAX_OPEN:
                self.forget()
            self.fds[path] = fd
        return fd

    def forget(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def materialize(directories: UploadDirectories, path: str, staged: StagedBlobs, digest: str) -> None:
    try:
        dir_fd, name = directories.parent_of(path)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o600)
            staged.copy_to(digest, fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ExecutionError("runtime", f"cannot materialize file {path!r}: {exc.strerror or exc}") from exc


def read_regular(dir_fd: int, name: str, budget: int, what: str) -> bytearray:
    """Read a regular file (never a link or special file) that must not change meanwhile."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise ExecutionError("serialization", f"cannot return {what}: {name!r} is not a regular file")
        if before.st_size > budget:
            raise ExecutionError("serialization", f"cannot return {what}: exceeds the response-size limit")
        data = bytearray(before.st_size)
        got = os.readv(fd, [data]) if data else 0
        after = os.fstat(fd)
        if (got != before.st_size or os.read(fd, 1) or
                (before.st_size, before.st_mtime_ns, before.st_ctime_ns) !=
                (after.st_size, after.st_mtime_ns, after.st_ctime_ns)):
            raise ExecutionError("serialization", f"cannot return {what}: {name!r} changed while being read")
        return data
    finally:
        os.close(fd)


def collect_file(root_fd: int, path: str, budget: int) -> bytearray:
    try:
        dir_fd, name = open_parent(root_fd, path)
        try:
            return read_regular(dir_fd, name, budget, "file")
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise ExecutionError("serialization", f"cannot return file {path!r}: {exc.strerror or exc}") from exc


def collect_folder(root_fd: int, path: str, budget: int) -> tuple[dict[str, bytearray], list[str]]:
    """Snapshot a directory tree: ({relpath: bytes}, [dirs]) sorted by path."""
    files, dirs, seen = {}, [], set()

    def walk(fd: int, prefix: str) -> None:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) in seen:
            raise ExecutionError("serialization", "cannot return folder: a directory is reached twice")
        seen.add((info.st_dev, info.st_ino))
        for entry in os.scandir(fd):
            rel = prefix + entry.name
            if entry.is_symlink():
                raise ExecutionError("serialization", f"cannot return folder: {rel!r} is a symbolic link")
            if entry.is_dir(follow_symlinks=False):
                dirs.append(rel)
                child = os.open(entry.name, NOFOLLOW_DIR, dir_fd=fd)
                try:
                    walk(child, rel + "/")
                finally:
                    os.close(child)
            elif entry.is_file(follow_symlinks=False):
                nonlocal budget
                files[rel] = read_regular(fd, entry.name, budget, "folder")
                budget -= len(files[rel])
            else:
                raise ExecutionError("serialization", f"cannot return folder: {rel!r} is a special file")

    try:
        dir_fd, name = open_parent(root_fd, path)
        try:
            top = os.open(name, NOFOLLOW_DIR, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        try:
            walk(top, "")
        finally:
            os.close(top)
    except OSError as exc:
        raise ExecutionError("serialization", f"cannot return folder {path!r}: {exc.strerror or exc}") from exc
    return dict(sorted(files.items())), sorted(dirs)


# --- value encoding (docs/protocol.md §9.5) -------------------------------------------------------

class Unreturnable(ExecutionError):
    """A value the protocol cannot carry; `what` completes "value[...] <what>", and `path` is filled in
    on the way up (the keys and indices from the returned value down to it)."""

    def __init__(self, what: str) -> None:
        super().__init__("serialization", f"the returned value {what}")
        self.what = what


def located_message(key: str, exc: ExecutionError) -> str:
    """`return "out": value["a"][2] is a set, ...`: the return key and the path inside its value."""
    path = getattr(exc, "path", [])
    if len(path) > 12:  # a value nested hundreds deep: its first and last steps say enough
        path = [*path[:6], None, *path[-6:]]
    where = "value" + "".join("[...]" if step is None else f"[{json.dumps(step)}]" for step in path)
    detail = f"{where} {exc.what}" if isinstance(exc, Unreturnable) else f"{where}: {exc.message}"
    return f"return {json.dumps(key)}: {detail}"


class Encoder:
    """Encodes returned values depth-first, collecting binary parts in order."""

    def __init__(self, first_part: int, byte_budget: int,
                 known_digest: Callable[[object], str | None] = lambda value: None,
                 max_parts: int = 1 << 62) -> None:
        self.next_part = first_part
        self.byte_budget = byte_budget
        self.max_parts = max_parts
        self.parts: list[tuple[memoryview, str | None]] = []  # (bytes, hash if a staged blob)
        self.known_digest = known_digest  # a staged blob -> its SHA-256, anything else -> None

    def part(self, data: Buffer, digest: str | None = None) -> tuple[str, str]:
        # Only file/folder returns are held to the byte budget (docs/protocol.md §8.6, checked while reading);
        # an oversized value makes the front-end answer 500 response_too_large (docs/protocol.md §9.8).
        if self.next_part >= self.max_parts:
            raise ExecutionError("serialization", f"a response may carry at most {self.max_parts} binary parts "
                                 "(returned bytes, tensors and files)")
        data = memoryview(data).cast("B")
        self.byte_budget -= data.nbytes
        self.parts.append((data, digest))
        name = f"return:{self.next_part}"
        self.next_part += 1
        return name, digest or hashlib.sha256(data).hexdigest()

    def value(self, v: object, depth: int = 0) -> dict[str, Any]:
        if depth > MAX_VALUE_DEPTH:
            raise Unreturnable(f"is nested more than {MAX_VALUE_DEPTH} levels deep")
        if v is None:
            return {"type": "null"}
        if isinstance(v, bool):
            return {"type": "boolean", "value": v}
        if isinstance(v, int):
            try:
                str(int(v))  # the front-end's JSON encoder has the same digit limit
            except ValueError:
                raise Unreturnable(f"is an integer of more than {sys.get_int_max_str_digits()} digits") from None
            return {"type": "integer", "value": int(v)}
        if isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                raise Unreturnable(f"is a non-finite number ({v!r}), which JSON cannot carry")
            return {"type": "number", "value": float(v)}
        if isinstance(v, str):
            return {"type": "string", "value": str(v)}
        if isinstance(v, (bytes, bytearray, memoryview)):
            name, digest = self.part(v, self.known_digest(v))
            return {"type": "bytes", "part": name, "sha256": digest}
        if isinstance(v, (list, tuple)):
            items = []
            try:  # a loop, not a comprehension: one frame per level keeps deep values within the recursion limit
                for x in v:
                    items.append(self.value(x, depth + 1))
            except ExecutionError as exc:
                record_step(exc, len(items))  # the element that failed
                raise
            return {"type": "array", "value": items}
        if isinstance(v, dict):
            for k in v:
                if not isinstance(k, str):
                    raise Unreturnable(f"is a dict with a key that is not a string ({k!r:.60}); "
                                       "returned dicts need string keys")
            members, key = {}, ""
            try:
                for key, x in v.items():
                    members[str(key)] = self.value(x, depth + 1)
            except ExecutionError as exc:
                record_step(exc, key)
                raise
            return {"type": "object", "value": members}
        tensor = tensor_bytes(v)
        if tensor is not None:
            dtype, shape, data = tensor
            name, digest = self.part(data)
            return {"type": "tensor", "dtype": dtype, "shape": shape, "part": name, "sha256": digest}
        raise Unreturnable(f"is {article(type(v).__name__)} {type(v).__name__}, which cannot be returned "
                           "(None, bool, int, float, str, bytes, list, tuple, dict with str keys and tensors can)")

    def file(self, data: Buffer) -> dict[str, Any]:
        name, digest = self.part(data)
        return {"type": "file", "part": name, "sha256": digest, "size": len(data)}


def record_step(exc: ExecutionError, step: int | str) -> None:
    """A failure inside a container's element or member `step`: prepend it to the failure's path."""
    exc.path = [str(step) if isinstance(step, str) else step, *exc.path]


def article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def tensor_bytes(v: object) -> tuple[str, list[int], Any] | None:
    """(dtype, shape, little-endian bytes) for torch tensors and numpy arrays/scalars, else None."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        dtype = str(v.dtype).removeprefix("torch.")
        if dtype not in DTYPE_SIZES:
            raise ExecutionError("serialization", f"cannot return tensor dtype {dtype}")
        try:
            if v.is_cuda:  # kernels on another stream may still be writing it
                torch.cuda.synchronize(v.device)
            flat = v.detach().to("cpu").contiguous().reshape(-1)
            return dtype, list(v.shape), flat.view(torch.uint8).numpy()
        except Exception as exc:
            raise ExecutionError("serialization", f"failed to export tensor: {exc}") from exc
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(v, (numpy.ndarray, numpy.generic)):
        array = numpy.asarray(v)
        dtype = array.dtype.name
        # ml_dtypes (bfloat16, float8_*) have kind "V": check the item size, not the kind
        if dtype not in DTYPE_SIZES or array.dtype.itemsize != DTYPE_SIZES[dtype]:
            raise ExecutionError("serialization", f"cannot return tensor dtype {array.dtype}")
        little = array.astype(array.dtype.newbyteorder("<"), copy=False)
        return dtype, list(array.shape), numpy.ascontiguousarray(little).reshape(-1).view(numpy.uint8)
    return None


def torch_dtype(name: str) -> Any:
    import torch
    return getattr(torch, name)


def numpy_dtype(name: str) -> Any:
    import numpy
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes
        return numpy.dtype(getattr(ml_dtypes, name))
    return numpy.dtype(name).newbyteorder("<")


def numpy_dtype_array(data: Buffer, dtype: str, shape: list[int]) -> Any:
    import numpy
    return numpy.frombuffer(data, dtype=numpy_dtype(dtype)).reshape(shape)


# --- runtimes: tensors, libraries, the GPU lease, CUDA's guards ------------------------------------

class Runtime:
    """Device-specific pieces: tensors, libraries, synchronisation.

    `device` is "cpu" or "cuda".  Tensors become torch tensors when torch is
    installed (numpy arrays otherwise); libraries load with tvm_ffi on both.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.libraries: dict[str, Any] = {}  # blob hash -> loaded module, least recently used first

    def load_tensor(self, data: bytearray, dtype: str, shape: list[int]) -> Any:
        """`data` is a private writable buffer: the tensor may keep it."""
        try:
            import torch
        except ImportError:
            return numpy_dtype_array(data, dtype, shape)
        try:
            if not data:
                return torch.empty(shape, dtype=torch_dtype(dtype), device=self.device)
            flat = torch.frombuffer(data, dtype=torch.uint8)
            return flat.view(torch_dtype(dtype)).reshape(shape).to(self.device)
        except Exception as exc:
            raise ExecutionError("runtime", f"malformed tensor: {exc}") from exc

    def load_library(self, blob_hash: str, data: bytes) -> Any:
        if blob_hash in self.libraries:
            self.libraries[blob_hash] = module = self.libraries.pop(blob_hash)
            return module
        try:
            import tvm_ffi
        except ImportError:
            raise ExecutionError("unavailable", "library uploads need apache-tvm-ffi "
                                 "in the worker environment") from None
        preload_library_runtimes(self.device)  # GPU workers did it before they were offered
        import tempfile
        fd, path = tempfile.mkstemp(prefix=f"{blob_hash}-", suffix=".so")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            module = tvm_ffi.load_module(path)
        except Exception as exc:
            raise ExecutionError("compile", shorten(f"cannot load the uploaded library: {exc}")) from exc
        finally:
            os.unlink(path)  # the mapping outlives the file
        self.libraries[blob_hash] = module
        while len(self.libraries) > 32:
            self.libraries.pop(next(iter(self.libraries)))
        return module

    def library_function(self, module: Any, name: str) -> Any:
        try:
            exported = module.implements_function(name)
        except Exception as exc:
            raise ExecutionError("runtime", f"cannot inspect the uploaded library: {exc}") from exc
        if not exported:
            raise ExecutionError("compile", f"the uploaded library exports no function {name!r}")
        try:
            return module.get_function(name)
        except Exception as exc:
            raise ExecutionError("compile", shorten(f"cannot bind {name!r}: {exc}")) from exc

    def is_library(self, value: object) -> bool:
        tvm_ffi = sys.modules.get("tvm_ffi")
        return tvm_ffi is not None and isinstance(value, tvm_ffi.Module)

    def synchronize(self) -> None:
        if self.device == "cuda":
            import torch
            for index in self.devices_in_use():
                torch.cuda.synchronize(index)

    def devices_in_use(self) -> list[int]:
        """The visible devices this process has a CUDA context on: synchronizing (or emptying the
        cache of) any other would create one there, hundreds of MB for a device the program never
        touched.  The driver's primary-context state (cuDevicePrimaryCtxGetState, which torch's
        autograd engine asks for the same reason) covers kernels that libraries launched through
        the runtime API too, unlike torch's allocator statistics.  A torch without the query: all."""
        import torch
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None) if hasattr(torch, "_C") else None
        indices = range(torch.cuda.device_count())
        return [i for i in indices if has_context(i)] if has_context is not None else list(indices)

    def release_cached_memory(self) -> None:
        """Drain every device in use and give the allocator's unused cache back to the driver,
        so a peer sharing the GPU gets the memory once the lease is released (docs/server.md §2.2)."""
        if self.device != "cuda":
            return
        import torch
        self.synchronize()
        for index in self.devices_in_use():
            if torch.cuda.memory_reserved(index) > torch.cuda.memory_allocated(index):
                with torch.cuda.device(index):
                    torch.cuda.empty_cache()

    def take_last_error(self) -> str | None:
        """Read and clear CUDA's last error (docs/server.md §3.4 step 3) in every libcudart loaded here:
        a bad launch configuration sits there without failing a synchronize.
        -> "CUDA error <name> (<code>): <description>" for the first pending one, or None."""
        if self.device != "cuda":
            return None
        found = None
        for cudart in loaded_cudarts():
            code = cudart.cudaGetLastError()  # also clears it
            if code and found is None:
                name, text = cudart.cudaGetErrorName(code), cudart.cudaGetErrorString(code)
                found = f"CUDA error {(name or b'?').decode()} ({code}): {(text or b'?').decode()}"
        return found


_cudarts: dict[str, ctypes.CDLL] = {}  # path -> the ctypes handle of a libcudart this process loaded


def cudart_paths(maps: str) -> list[str]:
    """Paths of the CUDA runtime libraries mapped into a process, from its /proc/PID/maps text."""
    paths = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith("libcudart.so") and fields[5] not in paths:
            paths.append(fields[5])
    return paths


def loaded_cudarts() -> list[ctypes.CDLL]:
    """The libcudart copies already loaded (torch's, a library's own shared one): each keeps its own
    last error.  Opening a loaded path again gives the same library, never a new copy."""
    with open("/proc/self/maps") as f:
        paths = cudart_paths(f.read())
    for path in paths:
        if path not in _cudarts:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            lib.cudaGetLastError.restype = ctypes.c_int
            for getter in (lib.cudaGetErrorName, lib.cudaGetErrorString):
                getter.restype, getter.argtypes = ctypes.c_char_p, [ctypes.c_int]
            _cudarts[path] = lib
    return [_cudarts[p] for p in paths if p in _cudarts]


_library_runtimes_loaded = False


def preload_library_runtimes(device: str) -> None:
    """What loading an uploaded library needs first, once per process, each part optional: tvm
    registers the loaders of device modules a library may embed; GPU workers also load CuTe DSL's
    runtime (§4.2).  Both only load libraries (no CUDA call), so GPU workers do it in prepare_gpu,
    off the lease and before a request arrives; CPU workers at their first library load."""
    global _library_runtimes_loaded
    if _library_runtimes_loaded:
        return
    _library_runtimes_loaded = True
    with contextlib.suppress(Exception):  # absent, or broken: libraries that need it fail to load instead
        if importlib.util.find_spec("tvm") is not None:
            import tvm  # noqa: F401
    if device == "cuda":
        preload_cute_dsl_runtime()


_cute_preloaded = False


def preload_cute_dsl_runtime() -> None:
    """docs/server.md §4.2: libraries that CuTe DSL exported with `--enable-tvm-ffi` need its runtime
    libraries loaded globally first.  Optional: without CuTe DSL (or with a broken one) nothing happens."""
    global _cute_preloaded
    if _cute_preloaded:
        return
    _cute_preloaded = True
    with contextlib.suppress(Exception):
        from cutlass.cute.runtime import find_runtime_libraries
        for path in find_runtime_libraries(enable_tvm_ffi=True):
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


class NoLease:
    """CPU workers have no GPU lease to take or give back."""

    def before(self, ins: Instruction, cpu_only: set[str]) -> None:
        pass

    def finish(self) -> None:
        pass


class GpuLease:
    """The worker's side of the front-end's lease on its GPU(s) (docs/server.md §2.2)."""

    def __init__(self, conn: Connection, runtime: Runtime) -> None:
        self.conn = conn
        self.runtime = runtime
        self.held = False

    def before(self, ins: Instruction, cpu_only: set[str]) -> None:
        op, kind = ins["op"], ins.get("kind")
        if (op == "upload" and kind == "file") or (op == "return" and kind in ("file", "folder")) \
                or (op == "run" and ins["fn"]["$ref"] in cpu_only):
            self.release()
        elif not (op == "upload" and kind == "bytes"):
            self.acquire()

    def acquire(self) -> None:
        if not self.held:
            send_message(self.conn, AcquireLease())
            reply, _ = receive_message(self.conn)
            if not isinstance(reply, LeaseGranted):
                raise UnexpectedMessage(f"expected LeaseGranted, got {reply!r}")
            self.held = True

    def release(self) -> None:
        if self.held:
            self.runtime.release_cached_memory()
            send_message(self.conn, ReleaseLease())
            self.held = False

    def finish(self) -> None:
        """At the request's end, under the lease, wait for the device's work; a CUDA error here fails the program."""
        self.acquire()
        self.runtime.synchronize()


class CudaCallGuard:
    """Watches a cpu_only call for CUDA runtime/driver API entries with CUPTI callbacks (docs/server.md §6).

    The call is not interrupted; the first API it entered fails the run
    afterwards.  Best effort: child processes, and CUDA use CUPTI does not
    see, go unnoticed.  Without cupti-python the worker cannot check that
    the call leaves the GPU alone while another request may hold its lease,
    so, like the reference, the run is answered `unavailable`.
    """

    first: tuple[str, list[traceback.FrameSummary], float] | None  # the first API entered: name, stack, time

    def __enter__(self) -> CudaCallGuard:
        try:
            from cupti import cupti
        except (ImportError, OSError):
            raise ExecutionError("unavailable", "verifying a cpu_only function needs cupti-python "
                                 "in the worker environment") from None
        self.cupti, self.first, self.subscriber = cupti, None, None
        with cupti_unavailable("cannot watch the cpu_only function with CUPTI"):
            try:
                self.subscriber = cupti.subscribe(self.on_api, None)
                for domain in (cupti.CallbackDomain.RUNTIME_API, cupti.CallbackDomain.DRIVER_API):
                    cupti.enable_domain(1, self.subscriber, domain)
            except Exception:
                self.unsubscribe()
                raise
        return self

    def on_api(self, userdata: object, domain: int, cbid: int, data: Any) -> None:
        if self.first is None and data.callback_site == self.cupti.ApiCallbackSite.API_ENTER:
            # wall-clock time: the front-end's lease history uses it too
            self.first = (data.function_name, traceback.extract_stack()[:-1], time.time())

    def unsubscribe(self) -> None:
        global _cupti_used
        if self.subscriber is not None:
            _cupti_used = self.cupti
            for domain in (self.cupti.CallbackDomain.RUNTIME_API, self.cupti.CallbackDomain.DRIVER_API):
                self.cupti.enable_domain(0, self.subscriber, domain)
            self.cupti.unsubscribe(self.subscriber)
            self.subscriber = None

    def __exit__(self, *exc: object) -> None:
        try:
            with cupti_unavailable("CUPTI cleanup failed"):
                self.unsubscribe()
        finally:
            if self.first is not None:
                raise GpuAccessError(*self.first)  # also over the call's own exception


_cupti_used = None  # the cupti module once the guard subscribed: finalised before the next request


def finalize_cupti() -> None:
    """docs/server.md §3.3: CUPTI is finalised when the cpu_only guard was used."""
    global _cupti_used
    if _cupti_used is not None:
        cupti, _cupti_used = _cupti_used, None
        with contextlib.suppress(Exception):
            cupti.finalize()


class GpuAccessError(ExecutionError):
    """A cpu_only call entered CUDA: docs/protocol.md §9.7's extra fields, and the stack at that call."""

    def __init__(self, cuda_call: str, stack: list[traceback.FrameSummary], when: float) -> None:
        location = call_site(stack)
        super().__init__("gpu_access", f"cpu_only function called {cuda_call} at {location}")
        self.stack = "".join(traceback.format_list(stack))[-TRACEBACK_CHARS:]
        # the front-end swaps lease_time for interfered_request_id
        self.fields = {"cuda_call": cuda_call, "location": location, "lease_time": when}


def call_site(stack: traceback.StackSummary | list[traceback.FrameSummary]) -> str:
    """The innermost frame of uploaded code, else the innermost one outside the server."""
    uploaded = [f for f in stack if f.filename.startswith("<uploaded:")]
    outside = [f for f in stack if os.path.basename(f.filename) not in SERVER_FILES]
    frames = uploaded or outside
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "an unknown call site"


# --- kcoral.builtins and kcoral.errors: what uploaded code imports ---------------------------------

def install_kcoral_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """Publish `kcoral.errors` and `kcoral.builtins` in sys.modules; -> (errors, builtins).

    Once `kcoral` itself is imported (or not at all: `from kcoral.errors import X` finds a
    published submodule directly), the import system takes these entries, so the names work
    in uploaded code and, through kcoral.py calling this, in any process that can import
    kcoral -- without this file importing kcoral back.  Idempotent.
    """
    if "kcoral.errors" in sys.modules and "kcoral.builtins" in sys.modules:
        return sys.modules["kcoral.errors"], sys.modules["kcoral.builtins"]
    errors = types.ModuleType("kcoral.errors")
    vars(errors).update(ExecutionError=ExecutionError, ValidationError=ValidationError)
    builtins_mod = types.ModuleType("kcoral.builtins")
    vars(builtins_mod).update(benchmark=benchmark, build_library=build_library, check_close=check_close,
                              compile_tirx=compile_tirx, evaluate=evaluate,
                              __all__=["benchmark", "build_library", "check_close", "compile_tirx", "evaluate"])
    sys.modules["kcoral.errors"] = errors
    sys.modules["kcoral.builtins"] = builtins_mod
    return errors, builtins_mod


_compiled: dict[int, Any] = {}  # structural hash -> executable, least recently used first


def compile_tirx(fn: Any, bindings: dict[str, Any] | None = None) -> Any:
    """Compile a TVM TIRx kernel for CUDA (docs/server.md §5.1); cached by structural hash."""
    try:
        import tvm
        from tvm import tirx
    except ImportError:
        raise ExecutionError("unavailable", "server-side compilation requires tvm, "
                             "which is not installed on this server") from None
    if bindings is not None and not isinstance(bindings, dict):
        raise ExecutionError("compile", "compile_tirx bindings must be a dict")
    if isinstance(fn, tirx.PrimFunc):
        if bindings:
            raise ExecutionError("compile", "a @T.prim_func takes no bindings")
        prim_func = fn
    elif hasattr(fn, "specialize"):
        try:
            prim_func = fn.specialize(**(bindings or {}))
        except TypeError as exc:
            raise ExecutionError("compile", shorten(f"bad bindings: {exc}")) from exc
        except Exception as exc:
            if type(exc).__name__ == "DiagnosticError":
                raise ExecutionError("parse", shorten(str(exc))) from exc
            raise
    else:
        raise ExecutionError("compile", "compile_tirx expects a @T.jit or @T.prim_func kernel handle")
    import tvm_ffi
    key = tvm_ffi.structural_hash(prim_func)
    if key in _compiled:
        _compiled[key] = _compiled.pop(key)
        return _compiled[key]
    try:
        executable = tvm.compile(tvm.IRModule({"main": prim_func}),
                                 target=tvm.target.Target("cuda"), tir_pipeline="tirx")
    except Exception as exc:
        if isinstance(exc, RuntimeError) or type(exc).__name__ in ("InternalError", "TVMError"):  # nvcc/nvrtc too
            raise ExecutionError("compile", shorten(str(exc))) from exc
        raise
    _compiled[key] = executable
    while len(_compiled) > 32:
        _compiled.pop(next(iter(_compiled)))
    return executable


COMPILER_DIAGNOSTIC_CHARS = 6000  # the end of a compiler's output: where its errors and their count are


def build_library(sources: str | Sequence[str], arch: str | None = None, *, options: Sequence[str] = (),
                  output: str | None = None, load: bool = True) -> Any:
    """Compile C++ (g++) or CUDA (nvcc, when a source ends in .cu) files of the working directory
    into a TVM-FFI library and load it (docs/server.md §5.5) -> the loaded module, whose exports
    `get_function` (or `module.get_function(name)`) binds; with `load=False`, the library's path.

    `arch`: the CUDA target, `sm_90a` say; by default the worker's own GPU.  `options`: more
    compiler flags.  `output`: the library's path (default: the first source's name, `.so`), left
    in the working directory for `return_file`.  A compiler error is ExecutionError("compile",
    <the compiler's diagnostics>); a missing compiler, "unavailable"."""
    import subprocess
    paths = [sources] if isinstance(sources, str) else list(sources)
    if not paths or not all(isinstance(p, str) for p in paths) or isinstance(options, str):
        raise ExecutionError("compile", "build_library expects source paths and a list of options")
    output = output or os.path.splitext(paths[0])[0] + ".so"
    command = compile_command(paths, output, list(options), arch)
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace")
    except FileNotFoundError:
        raise ExecutionError("unavailable", f"build_library needs {command[0]}, which this server lacks") from None
    if done.returncode != 0:
        diagnostics = (done.stderr + done.stdout).strip()[-COMPILER_DIAGNOSTIC_CHARS:]
        raise ExecutionError("compile", f"{command[0]} failed (exit status {done.returncode}):\n{diagnostics}")
    if not load:
        return output
    import tvm_ffi
    preload_library_runtimes("cuda" if command[0] == "nvcc" else "cpu")
    try:
        return tvm_ffi.load_module(os.path.abspath(output))
    except Exception as exc:
        raise ExecutionError("compile", shorten(f"cannot load the library built: {exc}")) from exc


def compile_command(sources: list[str], output: str, options: list[str], arch: str | None) -> list[str]:
    """g++, or nvcc when a source is CUDA, against apache-tvm-ffi's headers and libtvm_ffi.so
    (what makes `TVM_FFI_DLL_EXPORT_TYPED_FUNC` exports resolve)."""
    try:
        import tvm_ffi.libinfo
    except ImportError:
        raise ExecutionError("unavailable", "build_library needs apache-tvm-ffi in the worker environment") from None
    includes = [f"-I{path}" for path in tvm_ffi.libinfo.include_paths()]
    link = ["-shared", f"-L{os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())}", "-ltvm_ffi"]
    if not any(path.endswith(".cu") for path in sources):
        return ["g++", "-std=c++17", "-O2", "-fPIC", *includes, *options, *sources, "-o", output, *link]
    # exactly the GPU's architecture ("sm_90a": its `a` features too); other code fails to load or launch
    listed = os.environ.get("TVM_FFI_CUDA_ARCH_LIST", "").split(";")[0]  # "9.0a", set by initialize_gpu
    arch = arch or ("sm_" + listed.replace(".", "") if listed else None)
    if not arch:
        raise ExecutionError("compile", "a CUDA source needs arch= (say \"sm_90a\") on a worker without a GPU")
    return ["nvcc", "-std=c++17", "-O2", "-Xcompiler", "-fPIC", f"-arch={arch}", *includes, *options, *sources,
            "-o", output, *link, "-lcudart"]


def benchmark(mod: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """Per-call latency of mod(*args) (docs/server.md §5.2).

    CUDA workers use the reference's method: CUPTI activity records, each
    call's span from its first GPU activity to its last; without usable
    cupti-python the answer is `unavailable`, as in the reference.  CPU
    workers use a host timer and say so with "timer": "host" (our extension).
    """
    config = dict(args[-1]) if args and isinstance(args[-1], dict) else {}
    if config:
        args = args[:-1]
    if not callable(mod):
        raise ExecutionError("runtime", "benchmark expects a compiled module handle")
    flush_l2 = bool(config.get("flush_l2", True))  # other keys are ignored, as the reference does
    try:
        timer = make_timer(flush_l2)  # allocating the flush buffer can run out of memory: runtime
        warmup, repeat = benchmark_counts(timer, mod, args, config)
        for _ in range(warmup):
            timer.call(mod, args)
        timer.synchronize()
        samples, stable = timer.measure(mod, args, repeat)
    except RuntimeError as exc:
        raise ExecutionError("runtime", shorten(f"{type(exc).__name__}: {exc}")) from exc
    samples.sort()
    result: dict[str, Any] = {"latency_ms_median": median(samples), "latency_ms_mean": sum(samples) / len(samples),
              "latency_ms_min": samples[0], "latency_ms_max": samples[-1],
              "activities_stable": stable, "flush_l2": flush_l2,
              "warmup": warmup, "repeat": repeat}
    if timer.name:
        result["timer"] = timer.name
    return result


def check_close(actual: Any, expected: Any, *, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False,
                raise_on_mismatch: bool = False, max_reported: int = 5) -> dict[str, Any]:
    """Compare a kernel's output with a reference, element by element (docs/server.md §5.3).

    `actual`, `expected`: torch tensors (any device) or NumPy arrays (anything numpy.asarray
    takes).  When both hold integers or bool they are compared exactly, and `rtol`, `atol` do not
    apply (the report's are 0): a float64 holds 53 bits, so two 64-bit integers that differ below
    their top bits would compare equal as floats.  Otherwise both sides are compared as float64:
    an element is close when |actual - expected| <= atol + rtol * |expected| (numpy.isclose; NaN
    equals NaN only with `equal_nan`).  The shapes must be equal.  -> a report of JSON values
    only, so a program can return it (a non-finite number is written as the string "nan", "inf"
    or "-inf").  With `raise_on_mismatch`, a report that is not ok raises
    ExecutionError("correctness", <its summary>) instead.
    """
    (a, actual_dtype), (e, expected_dtype) = as_numpy(actual), as_numpy(expected)
    exact = is_integral(a) and is_integral(e)
    if exact:
        rtol = atol = 0.0
    report: dict[str, Any] = {"ok": False, "shape": list(a.shape), "expected_shape": list(e.shape),
                              "dtype": actual_dtype, "expected_dtype": expected_dtype, "total": int(e.size),
                              "mismatches": None, "mismatch_fraction": None, "max_abs_error": None,
                              "max_rel_error": None, "rtol": rtol, "atol": atol, "worst": None,
                              "nonfinite_mismatches": None, "first_mismatches": [], "spread_mismatches": []}
    if a.shape != e.shape:
        report["summary"] = f"check_close: shape {list(a.shape)} differs from the expected {list(e.shape)}"
    elif exact:
        report.update(exact_mismatch_report(a, e, max_reported))
    else:
        report.update(mismatch_report(a, e, rtol, atol, equal_nan, max_reported))
    if raise_on_mismatch and not report["ok"]:
        raise ExecutionError("correctness", report["summary"])
    return report


def as_numpy(value: Any) -> tuple[Any, str]:
    """A torch tensor (any device; a host one viewed, not copied; bfloat16 and float8, which have no
    NumPy dtype, as float32, which holds each of their values exactly) or anything numpy.asarray
    takes -> (a NumPy array, the original dtype's name)."""
    import numpy
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        host = value.detach().cpu().resolve_neg()  # a negated view has no NumPy form: numpy() refuses it
        name = str(value.dtype).removeprefix("torch.")
        if host.is_floating_point() and name not in ("float16", "float32", "float64"):
            host = host.float()
        return host.numpy(), name
    array = numpy.asarray(value)
    return array, array.dtype.name


def is_integral(array: Any) -> bool:
    return bool(array.dtype.kind in "biu")


def exact_equal(a: Any, e: Any) -> Any:
    """a == e element by element for integer or bool arrays, without NumPy's promotion of int64
    against uint64 to float64."""
    import numpy
    if a.dtype == e.dtype:
        return a == e
    if numpy.can_cast(a.dtype, numpy.int64) and numpy.can_cast(e.dtype, numpy.int64):
        return a.astype(numpy.int64) == e.astype(numpy.int64)
    # one side is uint64: equal where the signs agree and so do the 64 bits
    return (a.astype(numpy.uint64) == e.astype(numpy.uint64)) & ((a < 0) == (e < 0))


def exact_mismatch_report(a: Any, e: Any, max_reported: int) -> dict[str, Any]:
    """check_close's comparison of two integer or bool arrays of one shape: exact, the errors as
    Python integers (computed for the differing elements only: no overflow, no rounding)."""
    import numpy
    wrong = numpy.flatnonzero(~exact_equal(a, e))
    actual, expected = a.reshape(-1)[wrong].tolist(), e.reshape(-1)[wrong].tolist()  # Python ints and bools
    abs_error = [abs(int(x) - int(y)) for x, y in zip(actual, expected)]
    rel_error = [d / abs(int(y)) if y else 0.0 for d, y in zip(abs_error, expected)]

    def element(k: int) -> dict[str, Any]:
        return {"index": [int(i) for i in numpy.unravel_index(int(wrong[k]), a.shape)], "actual": actual[k],
                "expected": expected[k], "abs_error": abs_error[k]}
    worst = max(range(len(wrong)), key=abs_error.__getitem__, default=None)
    return listed_mismatches(len(wrong), int(e.size), element, worst, None if worst is None else rel_error[worst],
                             max(abs_error, default=0),
                             max(rel_error, default=0.0), {"nan": 0, "inf": 0}, max_reported, "exact")


def json_number(x: Any) -> float | str:
    """A float for a JSON report: non-finite ones as the strings "nan", "inf", "-inf"."""
    x = float(x)
    return x if math.isfinite(x) else repr(x)


def mismatch_report(a: Any, e: Any, rtol: float, atol: float, equal_nan: bool, max_reported: int) -> dict[str, Any]:
    """The comparison of two arrays of one shape as float64, as check_close reports it
    (listed_mismatches); the worst element is the one furthest outside the tolerance, a NaN or
    infinity first.  CHECK_CHUNK elements at a time: a whole 16 MiB float32 pair took 200-500 ms
    and 40-200 MiB of float64 temporaries, faulted in afresh, where chunks stay in the cache."""
    import numpy
    flat_a, flat_e = a.reshape(-1), e.reshape(-1)
    wrong_parts: list[Any] = []  # the mismatches' flat indices, chunk by chunk
    abs_maxima, rel_maxima, found = [0.0], [0.0], 0
    worst, worst_excess = None, -1.0
    for start in range(0, flat_e.size, CHECK_CHUNK):
        x, y = flat_a[start:start + CHECK_CHUNK], flat_e[start:start + CHECK_CHUNK]
        close, abs_error, rel_error, excess = element_errors(x, y, rtol, atol, equal_nan)
        abs_maxima.append(abs_error.max())  # a NaN error stays NaN in the maximum, as over the whole array
        rel_maxima.append(rel_error.max())
        wrong = numpy.flatnonzero(~close)
        if wrong.size:
            wrong_excess = excess[wrong]
            k = int(numpy.argmax(wrong_excess))
            if worst is None or wrong_excess[k] > worst_excess:  # the first of equals stays the worst
                worst, worst_excess = found + k, wrong_excess[k]
            wrong_parts.append(wrong + start)
            found += wrong.size
    wrong = numpy.concatenate(wrong_parts) if wrong_parts else numpy.zeros(0, dtype=numpy.intp)

    def errors_at(k: int) -> tuple[Any, Any, Any]:  # (index, abs error, rel error)
        index = numpy.unravel_index(int(wrong[k]), a.shape)
        _, abs_error, rel_error, _ = element_errors(a[index].reshape(1), e[index].reshape(1), rtol, atol, equal_nan)
        return index, abs_error[0], rel_error[0]

    def element(k: int) -> dict[str, Any]:
        index, abs_error, _ = errors_at(k)
        return {"index": [int(i) for i in index], "actual": json_number(a[index]),
                "expected": json_number(e[index]), "abs_error": json_number(abs_error)}
    wrong_actual = flat_a[wrong]
    nonfinite = {"nan": int(numpy.isnan(wrong_actual).sum()), "inf": int(numpy.isinf(wrong_actual).sum())}
    worst_rel = None if worst is None else json_number(errors_at(worst)[2])
    return listed_mismatches(wrong.size, e.size, element, worst, worst_rel, json_number(numpy.max(abs_maxima)),
                             json_number(numpy.max(rel_maxima)), nonfinite, max_reported,
                             f"rtol={rtol:g}, atol={atol:g}")


CHECK_CHUNK = 1 << 16  # elements compared at a time: each float64 temporary 512 KiB, within a core's L2


def element_errors(a: Any, e: Any, rtol: float, atol: float, equal_nan: bool) -> tuple[Any, Any, Any, Any]:
    """Element by element, as float64: (close, abs error, rel error, excess: how many tolerances
    away, NaN and infinity as infinitely many).  A close element with a non-finite error (inf ==
    inf; NaN == NaN with equal_nan) has errors 0; the rel error is 0 where expected is 0."""
    import numpy
    a, e = a.astype("float64", copy=False), e.astype("float64", copy=False)
    with numpy.errstate(invalid="ignore", divide="ignore", over="ignore"):  # inf - inf, x / 0: judged below
        close = numpy.isclose(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan)
        abs_error = numpy.abs(a - e)
        rel_error = numpy.where(e != 0, abs_error / numpy.abs(e), 0.0)
        abs_error, rel_error = (numpy.where(close & ~numpy.isfinite(x), 0.0, x) for x in (abs_error, rel_error))
        excess = abs_error / (atol + rtol * numpy.abs(e))
    return close, abs_error, rel_error, numpy.where(numpy.isfinite(excess), excess, numpy.inf)


def listed_mismatches(count: int, total: int, element: Callable[[int], dict[str, Any]], worst: int | None,
                      worst_rel: float | str | None, max_abs: float | str, max_rel: float | str,
                      nonfinite: dict[str, int], max_reported: int, criterion: str) -> dict[str, Any]:
    """check_close's report of the `count` differing elements (`element(k)`, k in 0..count-1, in
    order): the worst, the first ones and some spread evenly over all of them (a bug in the last
    column shows up however many tiny rounding differences come before it), and a one-line
    `summary` saying all that."""
    import numpy
    spread: Any = numpy.unique(numpy.linspace(0, count - 1, min(max_reported, count)).astype(int)) if count else []
    report = {"ok": not count, "mismatches": int(count), "mismatch_fraction": count / total if total else 0.0,
              "max_abs_error": max_abs, "max_rel_error": max_rel,
              "worst": None if worst is None else {**element(worst), "rel_error": worst_rel},
              "nonfinite_mismatches": nonfinite,
              "first_mismatches": [element(k) for k in range(min(count, max_reported))],
              "spread_mismatches": [element(int(k)) for k in spread] if max_reported > 0 else []}
    report["summary"] = mismatch_summary(report, total, criterion)
    return report


def mismatch_summary(report: dict[str, Any], total: int, criterion: str) -> str:
    """check_close's one line: how many differ, the worst element, the non-finite ones, a spread sample."""
    line = f"check_close: {report['mismatches']} of {total} elements differ ({criterion})"
    if not report["mismatches"]:
        return line
    worst = report["worst"]
    line += (f", {report['mismatch_fraction']:.3%}; worst {worst['index']}: {worst['actual']} vs {worst['expected']} "
             f"(abs error {worst['abs_error']}, rel error {worst['rel_error']}); "
             f"max abs error {report['max_abs_error']}, max rel error {report['max_rel_error']}")
    named = [f"{n} {'are' if n > 1 else 'is'} {kind}" for kind, n in report["nonfinite_mismatches"].items() if n]
    if named:
        line += f"; of the actual values, {' and '.join(named)}"
    shown = "; ".join(f"{m['index']}: {m['actual']} vs {m['expected']}" for m in report["spread_mismatches"])
    return line + (f"; at {shown}" if shown else "")


def benchmark_counts(timer: HostTimer, mod: Callable[..., Any], args: Sequence[Any],
                     config: dict[str, Any]) -> tuple[int, int]:
    """-> (warmup, repeat).  Explicit counts win (at least 1); a missing one is its ms budget
    over the cost of one flush + call, estimated from 5 of them after an untimed one: the
    budgets bound the time the benchmark really spends, flushes included (docs/server.md §5.2)."""
    warmup, repeat = config.get("warmup"), config.get("repeat")
    if warmup is None or repeat is None:
        timer.call(mod, args)
        timer.synchronize()
        estimate = timer.estimate(mod, args)

        def derive(budget: float) -> int:
            return max(1, int(budget / estimate)) if estimate > 0 else 1000
        warmup = derive(config.get("warmup_ms", 25)) if warmup is None else warmup
        repeat = derive(config.get("repeat_ms", 100)) if repeat is None else repeat
    return max(1, int(warmup)), max(1, int(repeat))


def make_timer(flush_l2: bool) -> HostTimer:
    """CUPTI in a worker that holds a CUDA context (a GPU worker creates it before its first
    request, a CPU worker never does); the host clock otherwise."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        keep_freed_memory()  # time the kernel as evaluate's kernel processes do, not glibc's page faults
        return HostTimer(flush_l2)
    try:
        from cupti import cupti
    except (ImportError, OSError):
        raise ExecutionError("unavailable", "benchmark needs cupti-python in the worker environment") from None
    return CuptiTimer(flush_l2, cupti)


@functools.cache
def host_flush_buffer() -> Any:
    """64 MiB of host memory, written once (pages of its own, not the shared zero page), made once a
    process: a fresh one took ~40 ms of page faults a benchmark or evaluate call on a VM (16 384 of
    them), more than a short benchmark's own time.  It stays resident for the rest of the request."""
    import numpy
    return numpy.ones(8 << 20, dtype=numpy.uint64)


class HostTimer:
    """Wall-clock timing for CPU workers; the L2 flush reads a buffer larger than the L2 (and than a
    last-level cache of up to 64 MiB)."""
    name: str | None = "host"
    scratch: Any  # the L2 flush buffer, or None: a NumPy array here, a CUDA tensor in CuptiTimer

    def __init__(self, flush_l2: bool) -> None:
        self.scratch = host_flush_buffer() if flush_l2 else None

    def flush(self) -> None:
        """Read, not written: a written buffer leaves the cache full of dirty lines, which the timed
        call then pays to write back, by a varying amount (a 352 KiB kernel's median over 15 calls
        moved 19 % between runs after a 64 MiB memset, 2 % after a 64 MiB read)."""
        if self.scratch is not None:
            self.scratch.max()

    def call(self, mod: Callable[..., Any], args: Sequence[Any]) -> None:
        self.flush()
        mod(*args)

    def synchronize(self) -> None:
        pass

    def estimate(self, mod: Callable[..., Any], args: Sequence[Any]) -> float:
        """ms per flush + call."""
        start = time.perf_counter()
        for _ in range(5):
            self.call(mod, args)
        return (time.perf_counter() - start) * 1e3 / 5

    def timed(self, mod: Callable[..., Any], args: Sequence[Any]) -> float:
        self.flush()
        start = time.perf_counter()
        mod(*args)
        return (time.perf_counter() - start) * 1e3

    def measure(self, mod: Callable[..., Any], args: Sequence[Any], repeat: int) -> tuple[list[float], bool]:
        """-> (samples in ms, activities_stable).  A timer around the call sees no
        activity records, so stability is not measured and never claimed: False."""
        return [self.timed(mod, args) for _ in range(repeat)], False


class CuptiTimer(HostTimer):
    """The reference's measurement: CUPTI activity records of what each call launched; the
    device's L2 flushed by zeroing 2 x its size, and the count estimate timed with CUDA events."""
    name = None  # the reference's result has no "timer" field
    API_KINDS = ("RUNTIME", "DRIVER")
    GPU_KINDS = ("CONCURRENT_KERNEL", "MEMCPY", "MEMSET")

    def __init__(self, flush_l2: bool, cupti: Any) -> None:
        import torch
        self.torch = torch
        self.scratch = None
        if flush_l2:
            self.scratch = cuda_flush_buffer(torch)
        self.cupti = cupti
        self.kinds = [int(getattr(cupti.ActivityKind, k)) for k in self.API_KINDS + self.GPU_KINDS]

    def flush(self) -> None:
        if self.scratch is not None:
            self.scratch.zero_()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def estimate(self, mod: Callable[..., Any], args: Sequence[Any]) -> float:
        """ms per flush + call: one pair of events around 5 of them, as the reference times it."""
        cuda = self.torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        cuda.synchronize()
        start.record()
        for _ in range(5):
            self.call(mod, args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 5

    def measure(self, mod: Callable[..., Any], args: Sequence[Any], repeat: int) -> tuple[list[float], bool]:
        records: list[Activity] = []
        cupti, sync, windows = self.cupti, self.torch.cuda.synchronize, []
        with cupti_unavailable("cannot start CUPTI activity tracing"):
            # records are copied out at once: their buffer is reused when the callback returns
            cupti.activity_register_callbacks(lambda: (8 << 20, 0),
                                              lambda activities: records.extend(map(activity_fields, activities)))
            for kind in self.kinds:
                cupti.activity_enable(kind)
        try:
            for _ in range(repeat):
                self.flush()
                sync()
                start = cupti.get_timestamp()
                mod(*args)
                windows.append((start, cupti.get_timestamp()))
                sync()
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        with cupti_unavailable("CUPTI cleanup failed"):
            self.stop()
        return activity_spans(records, windows, set(self.kinds[:len(self.API_KINDS)]))

    def stop(self) -> None:
        self.cupti.activity_flush_all(1)
        for kind in self.kinds:
            self.cupti.activity_disable(kind)
        self.cupti.finalize()


def cuda_flush_buffer(torch: Any) -> Any:
    """A device buffer twice the L2's size, zeroed to flush it (benchmark's and evaluate's flush)."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    return torch.empty(2 * l2, dtype=torch.int8, device="cuda")


@contextlib.contextmanager
def cupti_unavailable(what: str) -> Iterator[None]:
    """CUPTI failures answer `unavailable` (docs/server.md §5.2, §6)."""
    try:
        yield
    except ExecutionError:
        raise
    except Exception as exc:
        raise ExecutionError("unavailable", shorten(f"{what}: {type(exc).__name__}: {exc}")) from exc


Activity = tuple[int, int, int, int, tuple]  # (kind, start ns, end ns, correlation id, identity)


def activity_fields(record: Any) -> Activity:
    """(kind, start ns, end ns, correlation id, identity) of a CUPTI activity record."""
    kind = int(record.kind)
    identity = (kind, getattr(record, "name", None), getattr(record, "copy_kind", None),
                getattr(record, "bytes", None), getattr(record, "value", None))
    return kind, record.start, record.end, record.correlation_id, identity


def activity_spans(records: list[Activity], windows: list[tuple[int, int]],
                   api_kinds: set[int]) -> tuple[list[float], bool]:
    """Per timed call (host timestamp window): ms from its first GPU activity's start to its
    last one's end, and whether every call launched the same multiset of activities.

    An API record that starts inside a call's window ties its correlation id
    to that call; GPU activities are attributed through that id.
    """
    starts = [start for start, _ in windows]
    owner = {}
    for kind, start, _, correlation, _ in records:
        i = bisect.bisect_right(starts, start) - 1
        if kind in api_kinds and i >= 0 and start <= windows[i][1]:
            owner[correlation] = i
    spans: list[list[Any]] = [[None, None, collections.Counter()] for _ in windows]  # first start, last end, identities
    for kind, start, end, correlation, identity in records:
        if kind not in api_kinds and correlation in owner:
            span = spans[owner[correlation]]
            span[0] = start if span[0] is None else min(span[0], start)
            span[1] = end if span[1] is None else max(span[1], end)
            span[2][identity] += 1
    if any(first is None for first, _, _ in spans):
        raise ExecutionError("unavailable", "CUPTI recorded no GPU activity for a benchmarked call")
    samples = [(last - first) / 1e6 for first, last, _ in spans]
    if min(samples) <= 0:
        raise ExecutionError("unavailable", "CUPTI reported a non-positive activity span")
    return samples, all(activities == spans[0][2] for _, _, activities in spans)


# --- kcoral.builtins.evaluate: a verdict the kernel under test cannot forge (docs/evaluate.md) ----
#
# The candidate, and for a fair race the reference, each run in a kernel process of their own,
# started afresh (`python -I`: nothing of this process's memory).  Its arguments lie in shared
# memory this process creates and writes while the kernel process is stopped; the clock runs from
# the SIGCONT that lets it start a round to the moment it is stopped again, having said it was
# done; its results are then read out of its memory (the candidate's) or sent by it (the trusted
# reference's), and its arguments read back, bit for bit.  The seeds, the clock, the comparison
# and the verdict stay in the process that called evaluate, which never runs the candidate's
# code: what the candidate patches, reads or leaves running is in its own process.

@message
class EvalLoad:
    """evaluate -> kernel process, once: run `source` as a module and call its `entry` from now on
    (through one captured CUDA graph with `cuda_graph`); answered by an empty EvalOutputs.  With
    `readable` the process stays dumpable: evaluate reads its results out of its memory itself
    (the candidate's; the reference's process, which the candidate could read, is not).  Without
    `writable_inputs` the shared region is mapped read-only (the reference's: the candidate's inputs
    lie in the same pages, and a change to them is the candidate's, which the reference cannot cause)."""
    source: str
    entry: str
    cuda_graph: bool
    readable: bool
    writable_inputs: bool


@message
class EvalStage:
    """evaluate -> kernel process: the arguments of the next calls, one list of value specs per call,
    a tensor's bytes at its `offset` in the shared region (a memfd evaluate created, the same for
    both kernel processes; a new one follows the frame, by SCM_RIGHTS, when `region_bytes` is not 0).
    Answered by an empty EvalDone.  Evaluate writes the bytes afterwards, with the process stopped:
    it sees them only at EvalGo."""
    calls: list[list[dict]]
    region_bytes: int


@message
class EvalGo:
    """evaluate -> kernel process, off the clock: arm the round.  Answered by an EvalDone describing
    the last round's results again (the path the round ends on, run once after the cache flush so
    that it is not timed cold), then, once continued (the clock starts at that SIGCONT): the staged
    arguments built on their devices, the kernel called on each in turn (with `call`; without it,
    nothing called: the empty round trip), every result held in host memory, and EvalDone."""
    call: bool


@message
class EvalDone:
    """kernel process -> evaluate: per call, per result, the index of its value spec in `forms`
    (calls mostly return the same forms, so each is sent once), and `addresses`, in hex, where each
    result's bytes lie in this process, 8 bytes little-endian a result in the calls' order (read
    there with process_vm_readv while it is stopped; as one string, since encoding a round's 25
    addresses as JSON numbers took 3x longer, on the clock); or what went wrong."""
    forms: list[dict]
    calls: list[list[int]]
    addresses: str
    error: str | None


@message
class EvalPublish:
    """evaluate -> the reference's process: answer call `index`'s results as bytes (EvalOutputs)."""
    index: int


@message
class EvalInputsBack:
    """evaluate -> kernel process: copy every device argument back over its bytes in the region (did
    the calls write them?); answered by an empty EvalDone."""


@message
class EvalOutputs:
    """kernel process -> evaluate: value specs, their bytes after the frame; or what went wrong."""
    values: list[dict]
    error: str | None


EVAL_SPEC_KEYS = {"kind", "dtype", "shape", "device"}
EVAL_MAX_BYTES = 1 << 30  # one answer's tensors: far above a kernel test's, far below a worker's memory
EVAL_FRAME_BYTES = 1 << 20  # one answer's frame: specs only, the bytes follow it
# a round's arguments and results per kernel process (the region, and the results it holds): what
# bounds the calls per round when each has megabytes of data
EVAL_ROUND_BYTES = 768 << 20
EVAL_MAX_CALLS = 1000  # calls per round, whatever the kernel's time: make_inputs runs once per call
EVAL_ALIGN = 64  # each tensor in the region starts at a cache line
# how long a kernel process may take to stop itself after an answer (microseconds, unless a thread
# of its own holds the GIL) before evaluate stops it: no honest round waits for it
EVAL_STOP_GRACE = 0.5
# a race round's tensors start up to this far into the region, at random (the same for both kernels,
# which share the region): an address kept for the whole race would give a kernel a lasting edge or
# handicap (4K aliasing between its inputs and its outputs)
EVAL_SHIFT_SPAN = 4096
EVAL_MAX_WARMUP_ROUNDS = 10  # past them, the calls per round stay as they are
# rtol, atol per output dtype when the caller sets none: torch.testing.assert_close's defaults,
# float8's from its mantissa (3 and 2 bits); integers and bool compare exactly (check_close)
EVAL_TOLERANCES = {"float64": (1e-7, 1e-7), "float32": (1.3e-6, 1e-5), "float16": (1e-3, 1e-5),
                   "bfloat16": (1.6e-2, 1e-5), "float8_e4m3fn": (1.25e-1, 1e-2), "float8_e5m2": (2.5e-1, 1e-2)}
# NVML clock throttle reasons that slow a measurement down (idle, application clocks and the
# display clock do not): nvmlClocksThrottleReason* bits
THROTTLE_REASONS = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "software thermal slowdown",
                    0x40: "hardware thermal slowdown", 0x80: "power brake"}


@dataclasses.dataclass
class EvalValue:
    """One argument or output as it crosses between processes: a JSON value, or a tensor's bytes."""
    kind: str  # "torch", "numpy" or "json" (arguments only)
    dtype: str = ""
    shape: list[int] = dataclasses.field(default_factory=list)
    device: str = "cpu"
    data: Any = None  # the bytes, or the JSON value

    def spec(self) -> dict[str, Any]:
        if self.kind == "json":
            return {"kind": "json", "value": self.data}
        return {"kind": self.kind, "dtype": self.dtype, "shape": self.shape, "device": self.device}

    def build(self, device: str | None = None, copy: bool = True) -> Any:
        """This value as an object, on `device` or its own: over a private copy of the bytes, or
        (`copy=False`, for bytes nothing else holds) over the bytes themselves."""
        if self.kind == "json":
            return self.data
        data = bytearray(self.data) if copy else self.data
        if self.kind == "numpy":
            return numpy_dtype_array(data, self.dtype, self.shape)
        import torch
        dtype = torch_dtype(self.dtype)
        flat = torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)
        return flat.reshape(self.shape).to(device or self.device)

    def describe(self) -> str:
        return f"a {self.device} {self.kind} {self.dtype} of shape {self.shape}"


def eval_value(value: Any, where: str, copy: bool = True, output: bool = False) -> EvalValue:
    """A kernel's argument or output as an EvalValue, over a copy of its bytes or (`copy=False`)
    a view of them: a tensor, an array, a JSON scalar (an argument) or a number (an output, as a
    0-d NumPy array); TypeError for anything else.  Exact types: a subclass, or an object that
    only converts to a tensor, could compute when it is read."""
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if output and numpy is not None and type(value) in (bool, int, float):
        value = numpy.asarray(value)
    elif not output and (value is None or type(value) in (bool, int, float, str)):
        return EvalValue("json", data=value)
    exact = ((torch is not None and type(value) is torch.Tensor)
             or (numpy is not None and (type(value) is numpy.ndarray or isinstance(value, numpy.generic))))
    encoded = tensor_bytes(value) if exact else None
    if encoded is None:
        raise TypeError(f"{where} is {article(type(value).__name__)} {type(value).__name__}, "
                        f"not a torch.Tensor, a numpy.ndarray or {'a number' if output else 'a JSON scalar'}")
    dtype, shape, data = encoded
    is_torch = torch is not None and type(value) is torch.Tensor
    return EvalValue("torch" if is_torch else "numpy", dtype, shape, value.device.type if is_torch else "cpu",
                     bytearray(data) if copy else data)


def send_values(conn: Connection, values: list[EvalValue]) -> None:
    send_message(conn, EvalOutputs([v.spec() for v in values], None))
    send_raw(conn, *(v.data for v in values if v.kind != "json"))


def value_size(spec: dict, keys: set[str] = EVAL_SPEC_KEYS) -> int:
    """The bytes of a tensor a peer described, its spec checked first (UnexpectedMessage), so that a
    hostile answer cannot make this process allocate or read at will."""
    shape = spec.get("shape")
    if (set(spec) != keys or spec["kind"] not in ("torch", "numpy") or spec["dtype"] not in DTYPE_SIZES
            or type(spec["device"]) is not str or type(shape) is not list or len(shape) > 64
            or not all(type(n) is int and 0 <= n < 1 << 48 for n in shape)):
        raise UnexpectedMessage(f"a value described as {spec!r:.200}")
    size = DTYPE_SIZES[spec["dtype"]]
    for n in shape:
        size *= n
    if size > EVAL_MAX_BYTES:
        raise UnexpectedMessage(f"values of more than {EVAL_MAX_BYTES} bytes")
    return size


def read_values(conn: Connection, specs: list[dict], deadline: float | None) -> list[EvalValue]:
    """The values a frame announced, their bytes read off the channel (at most EVAL_MAX_BYTES)."""
    values, budget = [], EVAL_MAX_BYTES
    for spec in specs:
        size = value_size(spec)
        if size > budget:
            raise UnexpectedMessage(f"values of more than {EVAL_MAX_BYTES} bytes")
        budget -= size
        values.append(EvalValue(spec["kind"], spec["dtype"], spec["shape"], spec["device"],
                                recv_raw(conn, size, deadline)))
    return values


def staged_layout(calls: list[list[EvalValue]], shift: int = 0) -> tuple[list[list[dict]], list[tuple[int, EvalValue]],
                                                                        int]:
    """Where each call's tensors go in a region, from `shift` on: (the specs per call, each tensor with
    its `offset`; (offset, value) for every tensor; the bytes the region needs)."""
    specs, placed, end = [], [], shift
    for args in calls:
        call = []
        for value in args:
            if value.kind == "json":
                call.append(value.spec())
                continue
            offset = -(-end // EVAL_ALIGN) * EVAL_ALIGN
            call.append({**value.spec(), "offset": offset})
            placed.append((offset, value))
            end = offset + len(value.data)
        specs.append(call)
    return specs, placed, max(end, 1)


class SharedRegion:
    """A memfd this process creates, maps and shares with one kernel process, its pages allocated at
    once (MAP_POPULATE): the kernel's arguments lie there, written here, read there in place."""

    def __init__(self, size: int) -> None:
        self.size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        self.fd = os.memfd_create("kcoral-evaluate", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, placed: list[tuple[int, EvalValue]]) -> None:
        for offset, value in placed:
            self.map[offset:offset + len(value.data)] = value.data

    def first_changed(self, placed: list[tuple[int, EvalValue]]) -> int | None:
        """The index of the first tensor whose bytes here differ from what was written, or None."""
        view = memoryview(self.map)
        try:
            for i, (offset, value) in enumerate(placed):
                if not same_bytes(view[offset:offset + len(value.data)], value.data):
                    return i
            return None
        finally:
            view.release()

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def same_bytes(a: Buffer, b: Buffer) -> bool:
    """Two buffers' bytes equal, by memcmp: a memoryview comparison goes element by element
    through Python's struct rules (about 100 MB/s), and numpy.array_equal writes a bool per byte
    first (6.1 ms for 16 MiB here, memcmp 3.1 ms; a race checks every call's inputs a round)."""
    import numpy
    x, y = (numpy.frombuffer(v, dtype=numpy.uint8) for v in (a, b))
    return x.size == y.size and LIBC.memcmp(x.ctypes.data, y.ctypes.data, x.size) == 0


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def read_process_memory(pid: int, address: int, size: int) -> bytearray:
    """`size` bytes at `address` in process `pid` (process_vm_readv: the same user, and the process
    dumpable); OSError where they are not all mapped there."""
    buf = bytearray(size)
    done = 0
    while done < size:
        local = IoVec(ctypes.addressof((ctypes.c_char * size).from_buffer(buf)) + done, size - done)
        remote = IoVec(address + done, size - done)
        n = LIBC.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            code = ctypes.get_errno() if n < 0 else errno.EFAULT
            raise OSError(code, f"cannot read {size} bytes at {address:#x} in process {pid}: {os.strerror(code)}")
        done += n
    return buf


def kernel_process_main(fd: int) -> None:
    """Entry point of one of evaluate's kernel processes (KernelProcess starts it): load the kernel,
    then serve EvalStage, EvalGo, EvalPublish and EvalInputsBack until evaluate closes the channel,
    stopping itself after every answer (evaluate continues it for the next)."""
    conn = Connection(fd)
    load = receive_message(conn)[0]
    if not isinstance(load, EvalLoad):
        raise UnexpectedMessage(f"a kernel process cannot start with {load!r}")
    set_dumpable(load.readable)  # unreadable: the other kernel process, as the same user, cannot ptrace or read it
    die_with_parent()
    keep_freed_memory()
    install_kcoral_modules()
    try:
        kernel = KernelUnderTest(load)
    except BaseException as exc:
        send_message(conn, EvalOutputs([], error_line(exc)))
        return
    answer_and_stop(conn, EvalOutputs([], None))
    for msg in messages(conn):
        try:
            if isinstance(msg, EvalStage):
                region = reduction.recv_handle(conn) if msg.region_bytes else None
                kernel.stage(msg.calls, region, msg.region_bytes)
                answer_and_stop(conn, EvalDone([], [], "", None))
            elif isinstance(msg, EvalGo):
                answer_and_stop(conn, EvalDone(*kernel.arm(msg.call), None))
                answer_and_stop(conn, EvalDone(*kernel.go(msg.call), None))  # continued: on the clock
            elif isinstance(msg, EvalPublish):
                answer_and_stop(conn, kernel.publish(msg.index))
            elif isinstance(msg, EvalInputsBack):
                kernel.inputs_back()
                answer_and_stop(conn, EvalDone([], [], "", None))
            else:
                raise UnexpectedMessage(f"a kernel process cannot serve {msg!r}")
        except UnexpectedMessage:
            raise
        except BaseException as exc:
            answer_and_stop(conn, (EvalOutputs([], error_line(exc)) if isinstance(msg, EvalPublish)
                                   else EvalDone([], [], "", error_line(exc))))


def answer_and_stop(conn: Connection, answer: EvalOutputs | EvalDone | list[EvalValue]) -> None:
    """Send an answer (values: EvalOutputs and their bytes), then stop this process's whole group: no
    thread of it runs on once it has answered, and evaluate, woken by the answer, finds it stopped
    already instead of stopping it (two more wake-ups, on the clock after a round)."""
    if isinstance(answer, list):
        send_values(conn, answer)
    else:
        send_message(conn, answer)
    os.killpg(0, signal.SIGSTOP)


def keep_freed_memory(trim_bytes: int = 1 << 30, mapped_bytes: int = 32 << 20) -> None:
    """glibc keeps freed memory for reuse instead of returning it to the system: blocks under
    `mapped_bytes` come from its heaps (M_MMAP_THRESHOLD; by default glibc's largest on 64-bit), whose
    top it trims only past `trim_bytes` free (M_TRIM_THRESHOLD): a kernel's fresh output then lands on
    pages already mapped, as in a long-running loop, and not on new ones whose faults would be timed
    with it.  By default glibc trims the heap's top past 32 MiB free: a kernel with a 16 MiB output
    and a 16 MiB temporary faulted 4 MiB afresh every call (8.5 ms a call, not 5.2, on a VM's ~6 us
    faults).  For the rest of the process: evaluate's kernel processes, a CPU benchmark's worker,
    and the front-end (kcoral.FRONT_END_HEAP_BLOCK_BYTES)."""
    with contextlib.suppress(OSError, AttributeError):
        LIBC.mallopt(-1, trim_bytes)  # M_TRIM_THRESHOLD
        LIBC.mallopt(-3, mapped_bytes)  # M_MMAP_THRESHOLD


def module_function(source: str, entry: str) -> Callable[..., Any]:
    fn = load_module(source).namespace.get(entry)
    if not callable(fn):
        raise ExecutionError("parse", f"the module defines no function {entry!r}")
    return fn


def error_line(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, ExecutionError) else f"{type(exc).__name__}: {exc}"
    return shorten(text)


def address_of(data: Any) -> int:
    """Where a buffer's bytes start in this process."""
    import numpy
    return int(numpy.frombuffer(data, dtype=numpy.uint8).__array_interface__["data"][0]) if len(data) else 0


Form = tuple[str, str, tuple[int, ...], str]  # a value spec's kind, dtype, shape and device, hashable


def result_location(value: Any, index: int) -> tuple[Form, int, Any]:
    """A call's result `index`: its form, the address of its bytes in this process, and the object
    that keeps them there.  On the clock, once per result where same_form_columns does not apply: a
    contiguous CPU array or tensor of a known dtype is described in place (about a microsecond);
    anything else goes through eval_value's checks and host copy."""
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if numpy is not None and type(value) is numpy.ndarray and value.flags.c_contiguous:
        dtype = in_place_dtype(value.dtype)
        if dtype is not None:
            return ("numpy", dtype, value.shape, "cpu"), array_address(value), value
    if (torch is not None and type(value) is torch.Tensor and value.device.type == "cpu" and value.is_contiguous()
            and not value.is_conj() and not value.is_neg()):
        dtype = in_place_dtype(value.dtype)
        if dtype is not None:
            return ("torch", dtype, tuple(value.shape), "cpu"), value.data_ptr(), value
    held = eval_value(value, f"output {index}", copy=False, output=True)
    return (held.kind, held.dtype, tuple(held.shape), held.device), address_of(held.data), held


ARRAY_SHAPE, ARRAY_DTYPE, ARRAY_C_CONTIGUOUS = map(operator.attrgetter, ("shape", "dtype", "flags.c_contiguous"))


def same_form_columns(results: list[list[Any]]) -> list[tuple[Form, list[int]]] | None:
    """A round's description, where its calls each return as many C-contiguous NumPy arrays, the
    n-th of one dtype and shape in every call (a kernel's usual round): per output, (its form, its
    arrays' addresses); None for any other round, which result_location describes result by
    result.  The checks run in C loops (map), not in Python per result: 25 results in ~20 us
    instead of ~50 (twice that after a kernel's data has evicted the interpreter's from the caches)."""
    numpy = sys.modules.get("numpy")
    if numpy is None or not results or len(set(map(len, results))) != 1:
        return None
    columns = []
    for column in zip(*results):
        if set(map(type, column)) != {numpy.ndarray} or not all(map(ARRAY_C_CONTIGUOUS, column)):
            return None
        shapes, dtypes = set(map(ARRAY_SHAPE, column)), set(map(ARRAY_DTYPE, column))
        dtype = in_place_dtype(column[0].dtype) if len(shapes) == len(dtypes) == 1 else None
        if dtype is None:
            return None
        columns.append((("numpy", dtype, column[0].shape, "cpu"), list(map(array_address, column))))
    return columns


def array_address(array: Any) -> int:
    """Where a contiguous NumPy array's bytes start: through ctypes' view of a writable buffer (0.4 us),
    else NumPy's own (1.3 us)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):  # read-only, or empty
        return int(array.ctypes.data)


IN_PLACE_DTYPES: dict[Any, str | None] = {}  # a NumPy or torch dtype -> its name where its bytes are as sent


def in_place_dtype(dtype: Any) -> str | None:
    """The name of a dtype whose elements lie in memory as evaluate reads them (little-endian, the
    size DTYPE_SIZES says), else None; cached, since a dtype's name costs microseconds to form."""
    if dtype not in IN_PLACE_DTYPES:
        name = str(dtype).removeprefix("torch.") if type(dtype).__module__ == "torch" else dtype.name
        size = dtype.itemsize
        native = getattr(dtype, "isnative", True) and sys.byteorder == "little"
        IN_PLACE_DTYPES[dtype] = name if native and DTYPE_SIZES.get(name) == size else None
    return IN_PLACE_DTYPES[dtype]


class KernelUnderTest:
    """A kernel process's side: the loaded function, the staged arguments (views of the shared
    region), and every result of the last round held in host memory, where evaluate reads it; with
    `cuda_graph`, one graph captured at the first call and replayed on static input buffers the
    inputs are copied into."""

    def __init__(self, load: EvalLoad) -> None:
        self.fn = module_function(load.source, load.entry)
        self.cuda_graph = load.cuda_graph
        self.graph: Any = None
        self.inputs: list[Any] = []  # the arguments of the call in progress (a graph's: its static buffers)
        self.graph_outputs: Any = None
        self.region: mmap.mmap | None = None
        self.writable_inputs = load.writable_inputs
        self.staged: list[list[EvalValue]] = []
        self.host_args: list[list[Any]] = []  # the staged arguments, over the region
        self.on_device = False  # some of them belong on a GPU
        self.built: list[list[Any]] = []  # the last round's arguments on their devices
        self.results: list[list[Any]] = []
        self.held: list[list[Any]] = []  # what keeps each result's bytes where go said they lie

    def stage(self, calls: list[list[dict]], fd: int | None, size: int) -> None:
        if fd is not None:  # pages mapped now, not on the kernel's first touch inside the window
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable_inputs else 0)
            try:
                self.region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)
            finally:
                os.close(fd)
        view = memoryview(self.region) if self.region is not None else memoryview(b"")
        self.staged = [[EvalValue("json", data=spec["value"]) if spec["kind"] == "json" else
                        EvalValue(spec["kind"], spec["dtype"], spec["shape"], spec["device"],
                                  view[spec["offset"]:spec["offset"] + value_size(spec, EVAL_SPEC_KEYS | {"offset"})])
                        for spec in call] for call in calls]
        # views of the region, made now, while it does not yet hold this round's bytes; a device's
        # copies are made on the clock (go), where they belong to the kernel's time.  Read-only views
        # where the mapping is (torch warns of them, once: they are meant so)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            self.host_args = [[v.build("cpu", copy=False) for v in args] for args in self.staged]
        self.on_device = any(v.device != "cpu" for args in self.staged for v in args if v.kind == "torch")

    def arm(self, call: bool) -> tuple[list[dict], list[list[int]], str]:
        """Off the clock, before a round: the last results described (the path the round ends on, run
        after the cache flush, so that it is not timed cold), then, before a round of calls, let go
        of: the next results reuse their memory, and a round of as many calls as the last times no
        first touches of new pages."""
        described = self.describe()
        if call:
            self.results, self.held = [], []
        return described

    def go(self, call: bool) -> tuple[list[dict], list[list[int]], str]:
        """The round: the arguments built over the region (on a GPU, copied to it), the kernel called
        on each call's, and once the device has finished all its work (every stream's: nothing can
        finish after the clock stops) every result in host memory, described.  Without `call`, all
        of that but the calls: the last results described again."""
        self.built = self.host_args
        if self.on_device:
            self.built = [[a.to(v.device) if v.kind == "torch" else a for v, a in zip(staged, args)]
                          for staged, args in zip(self.staged, self.host_args)]
        if call:
            self.results = [self.call(args) for args in self.built]
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return self.describe()

    def describe(self) -> tuple[list[dict], list[list[int]], str]:
        """Where each result of the last round lies: (the distinct value specs, per call per result
        its spec's index, the addresses of their bytes as EvalDone sends them), what keeps those
        bytes there held."""
        forms: dict[Form, int] = {}
        calls, addresses, self.held = [], [], []
        columns = same_form_columns(self.results)
        if columns is not None:  # each result holds its own bytes
            calls = [[forms.setdefault(form, len(forms)) for form, _ in columns]] * len(self.results)
            addresses = [address for row in zip(*(column for _, column in columns)) for address in row]
        else:
            for results in self.results:
                located = [result_location(v, i) for i, v in enumerate(results)]
                calls.append([forms.setdefault(form, len(forms)) for form, _, _ in located])
                addresses += [address for _, address, _ in located]
                self.held.append([keep for _, _, keep in located])
        return ([{"kind": kind, "dtype": dtype, "shape": list(shape), "device": device}
                 for kind, dtype, shape, device in forms], calls, struct.pack(f"<{len(addresses)}Q", *addresses).hex())

    def publish(self, index: int) -> list[EvalValue]:
        """Call `index`'s results as bytes (the reference's, which evaluate cannot read in place)."""
        return [eval_value(v, f"output {i}", copy=False, output=True) for i, v in enumerate(self.results[index])]

    def call(self, args: list[Any]) -> list[Any]:
        self.set_inputs(args)
        if not self.cuda_graph:
            result = self.fn(*self.inputs)
            return list(result) if type(result) in (tuple, list) else [result]
        result = self.replay()  # the graph's own output buffers, which its next replay rewrites: copied
        return [v.clone() for v in (list(result) if type(result) in (tuple, list) else [result])]

    def inputs_back(self) -> None:
        for staged, built in zip(self.staged, self.built):
            for value, arg in zip(staged, built):
                if value.kind == "torch" and value.device != "cpu":
                    value.build("cpu", copy=False).copy_(arg.cpu())

    def set_inputs(self, inputs: list[Any]) -> None:
        if self.graph is None:
            self.inputs = inputs
            return
        for i, (static, new) in enumerate(zip(self.inputs, inputs)):  # the graph reads the captured buffers
            if hasattr(static, "copy_"):
                static.copy_(new)
            elif static != new:
                raise ValueError(f"cuda_graph: argument {i} changed from {static!r} to {new!r}, "
                                 "which a captured graph cannot follow")

    def replay(self) -> Any:
        torch = sys.modules.get("torch")
        if torch is None or not any(getattr(v, "is_cuda", False) for v in self.inputs):
            raise ValueError("cuda_graph needs CUDA tensors among the inputs")
        if self.graph is None:  # warm up on a side stream first, as torch.cuda.graph requires
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.fn(*self.inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.graph_outputs = self.fn(*self.inputs)
            self.graph = graph
        self.graph.replay()
        return self.graph_outputs


class KernelFailed(Exception):
    """A kernel process raised, died, timed out or broke the channel: the verdict is "error"."""


class Incorrect(Exception):
    """The candidate's outputs or inputs differ from what they must be: the verdict is "incorrect"."""

    def __init__(self, message: str, report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.report = report


KERNEL_PROCESS_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); import kcoral_worker; "
                       "kcoral_worker.kernel_process_main(int(sys.argv[2]))")


class KernelProcess:
    """evaluate's handle on one kernel process: a fresh interpreter in a session of its own (so it
    can be stopped and killed as a group), spoken to over a socket pair, every answer validated.
    It is stopped except while evaluate stages its arguments or runs it: it stops itself after
    every answer (answer_and_stop), which evaluate awaits (its own stop is for a process that
    does not)."""

    def __init__(self, role: str, source: str, entry: str, cuda_graph: bool, timeout: float) -> None:
        import subprocess
        self.role, self.timeout = role, timeout
        self.mapped: SharedRegion | None = None  # the region its process has mapped
        self.stop_pending = False  # stopped by evaluate, maybe before its own stop: that one may follow
        ours, theirs = socket.socketpair()
        with ours, theirs:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", KERNEL_PROCESS_BOOT, os.path.dirname(os.path.abspath(__file__)),
                 str(theirs.fileno())], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
            self.conn = Connection(os.dup(ours.fileno()))
        send_message(self.conn, EvalLoad(source, entry, cuda_graph, readable=role == "candidate",
                                         writable_inputs=role == "candidate"))

    def loaded(self) -> None:
        self.settle(EvalOutputs)

    def stage(self, specs: list[list[dict]], region: SharedRegion) -> None:
        """The next round's arguments, where they will lie in `region` (passed to the process if it
        has not mapped it yet); the process stopped again before evaluate writes their bytes."""
        fresh = region is not self.mapped
        self.resume()
        send_message(self.conn, EvalStage(specs, region.size if fresh else 0))
        if fresh:
            reduction.send_handle(self.conn, region.fd, self.proc.pid)
        self.mapped = region
        self.settle(EvalDone)

    def go(self, call: bool) -> tuple[list[list[dict]], float]:
        """The round on the clock, this process's own: armed first (off the clock), then from the
        SIGCONT that continues it to its stop, after it said it was done -> (its results' specs per
        call, each with its address there; ms).  Nothing it writes after the clock stops, since it
        is stopped: every thread, and its group's other processes."""
        self.resume()
        send_message(self.conn, EvalGo(call))
        self.settle(EvalDone)
        start = time.perf_counter()
        self.resume()
        frame = self.settle(EvalDone, decode=False)  # decoded off the clock, below
        elapsed = (time.perf_counter() - start) * 1e3
        forms, calls, addresses = self.answer(EvalDone, frame)
        for spec in forms:
            self.result_size(spec)
        count = sum(map(len, calls))
        try:
            located = iter(struct.unpack(f"<{count}Q", bytes.fromhex(addresses)))
        except (ValueError, struct.error):
            located = None
        if located is None or any(not 0 <= form < len(forms) for results in calls for form in results):
            raise KernelFailed(f"the {self.role}'s process broke the channel: results described as "
                               f"{calls!r:.100} at {addresses!r:.100}")
        return [[{**forms[form], "address": next(located)} for form in results] for results in calls], elapsed

    def result_size(self, spec: dict) -> int:
        """The bytes of a result spec the process sent: KernelFailed otherwise."""
        try:
            if type(spec) is not dict:
                raise UnexpectedMessage(f"a result described as {spec!r:.200}")
            return value_size(spec, EVAL_SPEC_KEYS | ({"address"} if "address" in spec else set()))
        except UnexpectedMessage as exc:
            raise KernelFailed(f"the {self.role}'s process broke the channel: {exc}") from None

    def read_results(self, layout: list[dict]) -> list[EvalValue]:
        """One call's results, read out of the stopped process's memory (process_vm_readv)."""
        values, budget = [], EVAL_MAX_BYTES
        for spec in layout:
            size = self.result_size(spec)
            if size > budget:
                raise KernelFailed(f"the {self.role}'s process broke the channel: values of more than "
                                   f"{EVAL_MAX_BYTES} bytes")
            budget -= size
            try:
                data = read_process_memory(self.proc.pid, spec["address"], size)
            except OSError as exc:
                raise KernelFailed(f"the {self.role}'s results could not be read from its process: {exc}") from None
            values.append(EvalValue(spec["kind"], spec["dtype"], spec["shape"], spec["device"], data))
        return values

    def publish(self, index: int) -> list[EvalValue]:
        """Call `index`'s results, sent by the process (the reference's, trusted: evaluate cannot
        read its memory)."""
        self.resume()
        send_message(self.conn, EvalPublish(index))
        return self.settle(EvalOutputs)

    def inputs_back(self) -> None:
        self.resume()
        send_message(self.conn, EvalInputsBack())
        self.settle(EvalDone)

    def settle(self, expected: type, decode: bool = True) -> Any:
        """The process's answer (as `answer`), then its stop: its own, which follows the answer at
        once, awaited; or, where none comes within EVAL_STOP_GRACE (a frame the harness did not
        send, a harness late to stop), evaluate's, after which its own may still be due
        (absorb_late_stop).  Either way its whole group is stopped."""
        try:
            answer = self.answer(expected, decode=decode)
        except BaseException:
            self.halt()
            raise
        deadline, checks = time.monotonic() + EVAL_STOP_GRACE, 0
        while not self.stopped():
            if time.monotonic() > deadline:
                self.halt()
                self.stop_pending = True
                return answer
            checks += 1
            time.sleep(0 if checks < 100 else 0.001)  # its stop follows its answer by microseconds
        self.send_signal(signal.SIGSTOP)  # its group's other processes, were its own stop not theirs
        return answer

    def stopped(self) -> bool:
        """Whether the process has stopped (a stop not reported before); KernelFailed if it died."""
        pid, status = os.waitpid(self.proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid and not os.WIFSTOPPED(status):  # reaped here, so Popen learns it here
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            raise KernelFailed(f"the {self.role}'s process died ({self.exit_status()})")
        return bool(pid)

    def answer(self, expected: type, frame: bytearray | None = None, decode: bool = True) -> Any:
        """The next message (or `frame`, one already read), of type `expected`: EvalOutputs with
        their bytes, or EvalDone's forms, calls and addresses; without `decode`, only its frame, read."""
        deadline = time.monotonic() + self.timeout
        try:
            if frame is None:
                self.absorb_late_stop(deadline)
                frame = receive_frame(self.conn, EVAL_FRAME_BYTES, deadline)
            if not decode:
                return frame
            msg = decode_message(frame)
            if not isinstance(msg, (EvalOutputs, EvalDone)) or not isinstance(msg, expected):
                raise UnexpectedMessage(f"{type(msg).__name__} where {expected.__name__} was expected")
            if msg.error is not None:
                raise KernelFailed(f"the {self.role} raised {msg.error}")
            if isinstance(msg, EvalOutputs):
                return read_values(self.conn, msg.values, deadline)
            return msg.forms, msg.calls, msg.addresses
        except TimeoutError:  # before OSError, of which it is one
            raise KernelFailed(f"the {self.role} did not answer within {self.timeout:g} s") from None
        except (EOFError, OSError):
            raise KernelFailed(f"the {self.role}'s process died ({self.exit_status()})") from None
        except UnexpectedMessage as exc:
            raise KernelFailed(f"the {self.role}'s process broke the channel: {exc}") from None

    def exit_status(self) -> str:
        import subprocess
        try:
            code = self.proc.wait(1)
        except subprocess.TimeoutExpired:
            return "still running, its channel closed"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def resume(self) -> None:
        self.send_signal(signal.SIGCONT)

    def absorb_late_stop(self, deadline: float) -> None:
        """After evaluate stopped the process, its own stop may still be due (a harness late to stop
        itself): continued, it stops once more before it reads the next message.  Until it answers,
        or is found stopped (and continued), look every millisecond."""
        while self.stop_pending:
            if select.select([self.conn.fileno()], [], [], 0.001)[0]:
                self.stop_pending = False  # it answers: its own stop is behind it
            elif self.stopped():
                self.send_signal(signal.SIGCONT)
                self.stop_pending = False
            elif time.monotonic() > deadline:
                raise TimeoutError

    def halt(self) -> None:
        """SIGSTOP to the whole group, until the process has stopped: nothing of this one (a
        spinning thread, a helper process) competes with the other kernel meanwhile, or writes
        its results once they are read.  A signal is delivered when the process next runs: a
        process woken to stop would otherwise compete with the other kernel at the start of its call."""
        self.send_signal(signal.SIGSTOP)
        if self.proc.returncode is not None:
            return
        pid, status = os.waitpid(self.proc.pid, os.WUNTRACED)
        if pid and not os.WIFSTOPPED(status):  # it died meanwhile: reaped here, so Popen learns it here
            self.proc.returncode = os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        self.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.conn.close()


def evaluate(candidate: str, reference: str, make_inputs: Callable[[int], Any], *, entry: str = "kernel",
             seeds: int = 3, rtol: float | None = None, atol: float | None = None, timing: bool = True,
             warmup_ms: float = 100.0, target_rse: float = 0.01, budget_ms: float = 2000.0, min_rounds: int = 20,
             max_rounds: int = 1000, round_ms: float = 25.0, flush_l2: bool = True, cuda_graph: bool = False,
             implausible_speedup: float = 10.0, confidence: float = 0.95,
             call_timeout_s: float = 60.0) -> dict[str, Any]:
    """Check a candidate kernel against a reference, then race them (docs/evaluate.md).

    `candidate`, `reference`: Python source defining `entry(*inputs)`, each run in a fresh
    process of its own; `make_inputs(seed)` (called here) -> the arguments, a tuple or one value
    (torch tensors on any device, NumPy arrays, JSON scalars).  -> a verdict of JSON values:
    "status" "correct", "incorrect" or "error", a one-line "message", the correctness checks,
    and for a correct candidate with `timing` the race's samples, speedup and flags.
    """
    if not isinstance(candidate, str) or not isinstance(reference, str):
        raise TypeError("evaluate takes the candidate's and the reference's source text (str): a function "
                        "object's module has already run in this process, where it could patch the harness")
    if not callable(make_inputs):
        raise TypeError("evaluate's make_inputs must be a function of a seed")
    if seeds < 1 or min_rounds < 3 or max_rounds < min_rounds or not 0 < confidence < 1 or round_ms < 0:
        raise ValueError("evaluate needs seeds >= 1, 3 <= min_rounds <= max_rounds, 0 < confidence < 1 "
                         "and round_ms >= 0")
    options = dict(rtol=rtol, atol=atol, warmup_ms=warmup_ms, target_rse=target_rse, budget_ms=budget_ms,
                   min_rounds=min_rounds, max_rounds=max_rounds, round_ms=round_ms, flush_l2=flush_l2,
                   cuda_graph=cuda_graph, implausible_speedup=implausible_speedup, confidence=confidence)
    run = Evaluation(candidate, reference, make_inputs, entry, call_timeout_s, options)
    try:
        return run.verdict(seeds, timing)
    finally:
        run.close()


class Evaluation:
    """One evaluate call: the two kernel processes, the reference here, and the verdict taking shape."""

    def __init__(self, candidate: str, reference: str, make_inputs: Callable[[int], Any], entry: str,
                 timeout: float, options: dict[str, Any]) -> None:
        self.make_inputs, self.options = make_inputs, options
        self.reference_fn = module_function(reference, entry)  # trusted: it may run here
        set_dumpable(False)  # the kernel processes, running as our user, cannot ptrace or read this one
        self.processes: dict[str, KernelProcess] = {}
        self.region: SharedRegion | None = None  # both kernels' arguments, in the same pages
        try:
            for role, source in (("reference", reference), ("candidate", candidate)):
                self.processes[role] = KernelProcess(role, source, entry, options["cuda_graph"], timeout)
        except BaseException:
            self.close()
            raise
        self.candidate, self.reference = self.processes["candidate"], self.processes["reference"]
        self.device = "cpu"
        self.flush: Callable[[], None] = lambda: None  # the race's (cache_flush)
        self.answers: collections.deque[list[EvalValue]] = collections.deque(maxlen=8)  # the last calls checked
        self.passed = 0  # calls checked and found correct so far
        self.report: dict[str, Any] = {"status": "correct", "correct": True, "message": "", "seeds": [],
                                       "checks": [], "timing": None, "flags": {}}

    def close(self) -> None:
        for process in self.processes.values():
            process.close()
        if self.region is not None:
            self.region.close()
        set_dumpable(True)  # as the worker was (template_main)

    def verdict(self, seeds: int, timing: bool) -> dict[str, Any]:
        report = self.report
        try:
            self.candidate.loaded()
            self.reference.loaded()
            for _ in range(seeds):
                self.check_input_set(random_seed())
            report["message"] = f"correct on {seeds} input sets"
            if timing:
                report["timing"] = self.race()
                report["message"] += "; " + speedup_line(report["timing"])
        except Incorrect as exc:
            report.update(status="incorrect", correct=False, message=str(exc))
            if exc.report is not None:
                report["mismatch"] = exc.report
        except KernelFailed as exc:
            report.update(status="error", correct=False, message=str(exc))
        return report

    def inputs(self, seed: int, copy: bool = True) -> list[EvalValue]:
        """make_inputs(seed) as values: over copies of their bytes, or (`copy=False`, bytes only ever
        written to the regions and compared with them) over the arrays make_inputs returned."""
        args = self.make_inputs(seed)
        values = [eval_value(v, f"make_inputs' value {i}", copy=copy)
                  for i, v in enumerate(args if type(args) in (tuple, list) else [args])]
        if any(v.device == "cuda" for v in values):
            self.device = "cuda"
        return values

    def check_input_set(self, seed: int) -> None:
        """Correctness on one input set: the reference's outputs computed here, on copies; the
        candidate's call staged and run as a round of the race is, with the call alone."""
        self.report["seeds"].append(seed)
        sent = self.inputs(seed)
        result = self.reference_fn(*[v.build() for v in sent])
        expected = [eval_value(v, f"reference output {i}", output=True)
                    for i, v in enumerate(list(result) if type(result) in (tuple, list) else [result])]
        self.report["flags"].update(nonfinite_flag(expected))
        placed = self.stage([sent], [self.candidate])
        layout, elapsed = self.candidate.go(True)
        reports = self.check_call(layout, 1, 0, expected, placed, elapsed,
                                  f"on input set {len(self.report['seeds'])} (seed {seed})", full=True)
        self.report["checks"].append({"seed": seed, "ok": True, "outputs": reports})

    def check_call(self, layout: list[list[dict]], calls: int, index: int, expected: list[EvalValue],
                   placed: list[tuple[int, EvalValue]], elapsed: float, where: str,
                   full: bool = False) -> list[dict[str, Any]]:
        """The candidate's results of call `index` of `calls`, read out of its stopped process, against
        the reference's on the same inputs (every call's kinds, dtypes and shapes too), then its inputs
        in the region, bit for bit: Incorrect at the first difference, saying what it most likely did.
        `full`: check_close's reports even where the bytes are identical."""
        if len(layout) != calls:
            raise KernelFailed(f"the candidate's process broke the channel: results of {len(layout)} calls "
                               f"where it made {calls}")
        for results in layout:
            same_form(results, expected, where)
        actual = self.candidate.read_results(layout[index])
        try:
            reports = compare_outputs(actual, expected, self.options, where, full)
        except Incorrect as exc:
            raise Incorrect(f"{exc}{self.likely_cause(actual, expected, layout[index], elapsed)}", exc.report) from None
        if any(v.kind == "torch" and v.device != "cpu" for _, v in placed):
            self.candidate.inputs_back()
        assert self.region is not None
        changed = self.region.first_changed(placed)
        if changed is not None:
            raise Incorrect(f"the candidate modified its tensor argument {changed % (len(placed) // calls)} {where}")
        self.answers.append(expected)
        self.passed += 1
        return reports

    def likely_cause(self, actual: list[EvalValue], expected: list[EvalValue], layout: list[dict],
                     elapsed: float) -> str:
        """What a wrong answer most likely came from, where the evidence shows it ("; most likely ..."),
        else "": its results becoming right once it runs on (work left running after it answered),
        the reference's answer to an earlier call (a result kept across calls), or right answers
        to every call checked before (behaving differently from some point on)."""
        self.candidate.resume()
        waited = min(1.0, max(0.05, 3 * elapsed / 1e3))
        time.sleep(waited)
        self.candidate.halt()
        with contextlib.suppress(KernelFailed):
            if matches(self.candidate.read_results(layout), expected, self.options):
                return (f"; most likely work still running after it said it was done: its results were right "
                        f"{waited * 1e3:.0f} ms later (a thread, or a stream it did not wait for)")
        for k, earlier in enumerate(reversed(self.answers)):
            if matches(actual, earlier, self.options):
                return (f"; most likely a result kept from an earlier call: it is the reference's answer to the call "
                        f"checked {k + 1} before this one (a cache keyed on something that repeats, such as its "
                        "inputs' address)")
        if self.passed:
            before = f"{self.passed} calls checked before were" if self.passed > 1 else "call checked before was"
            return (f"; the {before} right: most likely it behaves differently from some point on (once timed, "
                    "or after some number of calls)")
        return ""

    def stage(self, calls: list[list[EvalValue]], processes: list[KernelProcess], shift: int = 0
              ) -> list[tuple[int, EvalValue]]:
        """The next round's arguments placed in the shared region from `shift` on (a larger region made
        when they do not fit), staged in each of `processes`, then written while they are stopped ->
        where each tensor lies.  One region for both kernels: the same bytes in the same pages at the
        same offsets, so that neither kernel's inputs lie in memory that is lastingly faster to read
        (two regions, one per process, gave one of two identical kernels a lasting edge of 3-12 %)."""
        specs, placed, size = staged_layout(calls, shift)
        if self.region is None or self.region.size < size:
            if self.region is not None:
                self.region.close()
            self.region = SharedRegion(size - shift + EVAL_SHIFT_SPAN)
        for process in processes:
            process.stage(specs, self.region)
        self.region.write(placed)
        return placed

    def race(self) -> dict[str, Any]:
        """Warm-up rounds (which set the calls per round), then interleaved timed rounds until the
        relative standard errors reach the target, or the budget ends."""
        opts = self.options
        self.flush = cache_flush(self.device, opts["flush_l2"])
        before = gpu_conditions() if self.device == "cuda" else None
        samples: dict[str, list[float]] = {"reference": [], "candidate": [], "echo": []}
        warming: dict[str, list[float]] = {k: [] for k in samples}
        estimates: list[float] = []
        calls, warm, settled, start = 1, 0, 0, time.perf_counter()
        # at least 2 rounds at the final calls per round: a round of more calls than before
        # allocates memory whose first touches (page faults) would be timed otherwise
        while settled < 2 or time.perf_counter() - start < opts["warmup_ms"] / 1e3:
            warm += 1
            call_bytes = self.round(f"warm-up round {warm}", calls, warming)  # the same protocol as a timed one
            # the kernel's time per call where this round resolved it (its window at least twice the
            # quickest empty round trip so far, which it is taken less): the quickest of those after
            # the first, since load and the first touches of a round of more calls only lengthen one
            # (their median settled at half the calls round_ms holds); none yet, 4x the calls
            echo = min(warming["echo"])
            if warming["reference"][-1] > 2 * echo:
                estimates.append((warming["reference"][-1] - echo) / calls)
            kernel_ms = min(estimates[1:] or estimates) if estimates else opts["round_ms"] / (4 * calls)
            wanted = calls_per_round(kernel_ms, call_bytes, opts["round_ms"])
            settled = settled + 1 if wanted <= calls or warm >= EVAL_MAX_WARMUP_ROUNDS else 0
            calls = max(calls, wanted) if warm < EVAL_MAX_WARMUP_ROUNDS else calls
        start, stopped = time.perf_counter(), "max_rounds"
        least = next(n for n in itertools.count(3) if sign_test_ranks(n, opts["confidence"])[0] is not None)
        for index in range(opts["max_rounds"]):
            self.round(f"timed round {index + 1}", calls, samples)
            rse = {role: relative_standard_error(samples[role], samples["echo"]) for role in ("reference", "candidate")}
            rse["speedup"] = speedup_standard_error(samples)
            # on each kernel's own: the speedup's, lower, would stop a race after the few rounds of a
            # stretch of steady load, over which both processes' lot differs (where each runs)
            if index + 1 >= opts["min_rounds"] and max(rse["reference"], rse["candidate"]) <= opts["target_rse"]:
                stopped = "target_rse"
                break
            if index + 1 >= least and (time.perf_counter() - start) * 1e3 >= opts["budget_ms"]:
                stopped = "budget"
                break
        result = race_statistics(samples, opts["confidence"], calls)
        result.update(rounds=len(samples["candidate"]), calls_per_round=calls, warmup_rounds=warm, stopped=stopped,
                      overhead_ms_per_call=median(samples["echo"]) / calls,
                      rse={k: (round(v, 6) if math.isfinite(v) else None) for k, v in rse.items()},
                      device=self.device, flush_l2=opts["flush_l2"], cuda_graph=opts["cuda_graph"], timer="host",
                      samples_ms={k: [round(v, 6) for v in s] for k, s in samples.items()})
        self.report["flags"].update(race_flags(result, opts["implausible_speedup"]))
        if self.device == "cuda":
            result["gpu"] = {"before": before, "after": gpu_conditions()}
            self.report["flags"].update(gpu_flags(result["gpu"]["before"], result["gpu"]["after"]))
        return result

    def round(self, label: str, calls: int, samples: dict[str, list[float]]) -> int:
        """One round of `calls` calls, each on fresh inputs: both kernels' arguments staged (in the same
        region, which the reference's process maps read-only), then their
        turns back to back, in alternating order (AB, BA: an order effect cancels over two rounds),
        each timed while the other's process group is stopped, then the reference's empty round
        trip; the candidate's results of one call drawn at random (after the round) checked against
        the reference's on the same inputs, and all its inputs unchanged.  -> the bytes of a call's
        inputs and outputs."""
        import secrets
        sets = [self.inputs(random_seed(), copy=False) for _ in range(calls)]
        index = secrets.randbelow(calls)
        shift = secrets.randbelow(EVAL_SHIFT_SPAN // EVAL_ALIGN) * EVAL_ALIGN
        placed = self.stage(sets, list(self.processes.values()), shift)
        layout, elapsed = {}, {}
        for role in ("reference", "candidate") if len(samples["echo"]) % 2 == 0 else ("candidate", "reference"):
            if role == "reference":
                self.report["flags"].update(foreign_flag(self.processes.values()))
            self.flush()
            layout[role], elapsed[role] = self.processes[role].go(True)
            samples[role].append(elapsed[role])
        self.flush()  # the exchange alone, in the trusted process: both kernels' baseline
        samples["echo"].append(self.reference.go(False)[1])
        expected = self.reference.publish(index)
        self.check_call(layout["candidate"], calls, index, expected, placed, elapsed["candidate"],
                        f"in {label} (call {index + 1} of {calls}), against the reference on the same inputs")
        return sum(len(v.data) for v in [*sets[0], *expected] if v.kind != "json")


def calls_per_round(kernel_ms: float, call_bytes: int, round_ms: float) -> int:
    """Calls enough for a round of `round_ms` at the reference's `kernel_ms` per call, within
    EVAL_MAX_CALLS and EVAL_ROUND_BYTES: the fixed cost of a round (its empty round trip), spread
    over them, becomes a small part of each call."""
    wanted = math.ceil(round_ms / max(kernel_ms, 1e-3))
    return max(1, min(wanted, EVAL_MAX_CALLS, EVAL_ROUND_BYTES // max(call_bytes, 1)))


def foreign_flag(kernels: Iterable[KernelProcess]) -> dict[str, str]:
    """Descendants of this process outside its own process group and the kernels' while the
    reference is about to run: nothing stops them meanwhile (a helper the candidate moved to a
    session of its own, say), so they could compete with it or signal it."""
    groups = {str(group).encode() for group in (os.getpgid(0), *(kernel.proc.pid for kernel in kernels))}
    foreign = [pid for pid in escaped_descendants()
               if (fields := proc_stat(pid)) is not None and fields[2] not in groups]
    if not foreign:
        return {}
    return {"foreign_processes": f"processes {foreign} outside the kernels' process groups ran during the race, "
                                "unstopped: the timing may be skewed"}


def random_seed() -> int:
    """A seed the candidate cannot know before its call: drawn from the OS at that moment."""
    import secrets
    return secrets.randbits(63)


def compare_outputs(actual: list[EvalValue], expected: list[EvalValue], options: dict[str, Any],
                    where: str, full: bool = True) -> list[dict[str, Any]]:
    """check_close's report per output (NaN equal only to NaN, inf to inf of its sign, at the same
    place; kind, device, dtype and shape exact); Incorrect at the first output that differs.
    Without `full`, outputs identical byte for byte pass unreported (the race's calls)."""
    same_form([a.spec() for a in actual], expected, where)
    reports = []
    for i, (a, e) in enumerate(zip(actual, expected)):
        if not full and same_bytes(a.data, e.data):
            continue
        rtol, atol = tolerance(e.dtype, options)
        report = check_close(a.build("cpu", copy=False), e.build("cpu", copy=False), rtol=rtol, atol=atol,
                             equal_nan=True)
        if not report["ok"]:  # its summary names the worst element
            raise Incorrect(f"output {i} {where}: {report['summary']}", report)
        reports.append(report)
    return reports


def same_form(specs: list[dict], expected: list[EvalValue], where: str) -> None:
    """Outputs as many as the reference's, each of its kind, device, dtype and shape: Incorrect otherwise."""
    if len(specs) != len(expected):
        raise Incorrect(f"{len(specs)} outputs where the reference returns {len(expected)} {where}")
    for i, (spec, e) in enumerate(zip(specs, expected)):
        a = EvalValue(spec["kind"], spec["dtype"], spec["shape"], spec["device"])
        if (a.kind, a.device, a.dtype, a.shape) != (e.kind, e.device, e.dtype, e.shape):
            raise Incorrect(f"output {i} is {a.describe()}, the reference's {e.describe()} {where}")


def matches(actual: list[EvalValue], expected: list[EvalValue], options: dict[str, Any]) -> bool:
    try:
        compare_outputs(actual, expected, options, "", full=False)
    except Incorrect:
        return False
    return True


def tolerance(dtype: str, options: dict[str, Any]) -> tuple[float, float]:
    rtol, atol = EVAL_TOLERANCES.get(dtype, (0.0, 0.0))
    return (rtol if options["rtol"] is None else options["rtol"],
            atol if options["atol"] is None else options["atol"])


def nonfinite_flag(expected: list[EvalValue]) -> dict[str, str]:
    """NaN or inf in the reference's outputs: the candidate then only has to match them in place."""
    import numpy
    for i, value in enumerate(expected):
        if value.dtype.startswith(("float", "bfloat")):
            built = value.build("cpu")
            as_numpy = built.double().numpy() if hasattr(built, "double") else built.astype(numpy.float64)
            if not numpy.isfinite(as_numpy).all():
                return {"reference_nonfinite": f"the reference's output {i} holds NaN or inf, "
                                               "which the candidate matched only in place"}
    return {}


def cache_flush(device: str, flush_l2: bool) -> Callable[[], None]:
    """benchmark's cache flush, run here before each timed call: the last-level cache (CPU) and the
    L2 (GPU) are shared with the kernel processes, and a flush the candidate does not run, it cannot skip."""
    if not flush_l2:
        return lambda: None
    if device != "cuda":
        timer = HostTimer(True)

        def flush_host() -> None:
            timer.flush()
            time.sleep(0.001)  # a 64 MiB read is a long burst: let the scheduler even up before the clock starts
        return flush_host
    import torch
    scratch = cuda_flush_buffer(torch)

    def flush() -> None:
        scratch.zero_()
        torch.cuda.synchronize()
    return flush


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def relative_standard_error(windows: list[float], echoes: list[float]) -> float:
    """The standard error of the median window, relative to the kernel's own time (median window less
    median echo); from the median absolute deviation, so that a few descheduled calls do not hold
    the race open: 1.4826 x MAD estimates the deviation of normal noise, 1.2533 x that / sqrt(n) the
    median's standard error."""
    if len(windows) < 2:
        return math.inf
    middle = median(windows)
    kernel = middle - median(echoes)
    spread = 1.4826 * median([abs(w - middle) for w in windows])
    return 1.2533 * spread / math.sqrt(len(windows)) / kernel if kernel > 0 else math.inf


def speedup_standard_error(samples: dict[str, list[float]]) -> float:
    """The relative standard error of the speedup (the median of the rounds' ratios): from the
    median absolute deviation of their logarithms, as relative_standard_error.  A load common to
    both turns of a round cancels in its ratio, so this falls where each kernel's own does not."""
    echo = median(samples["echo"])
    logs = [math.log(r) for r in (round_ratio(r - echo, c - echo) for r, c in zip(samples["reference"],
                                                                                   samples["candidate"]))
            if 0 < r < math.inf]
    if len(logs) < 2 or len(logs) < len(samples["echo"]) / 2:
        return math.inf
    middle = median(logs)
    return 1.2533 * 1.4826 * median([abs(v - middle) for v in logs]) / math.sqrt(len(logs))


def race_statistics(samples: dict[str, list[float]], confidence: float, calls: int = 1) -> dict[str, Any]:
    """Each kernel's time per call (median window less median echo, over the `calls` of a round; ms)
    and the speedup reference / candidate: the median of the rounds' own ratios (each round times
    both kernels back to back, so the load of that moment hits both), with the distribution-free
    interval of a median (sign_test_ranks): no assumption on the shape of the noise, and a few
    descheduled rounds move it by a rank each, not by their size."""
    echo = median(samples["echo"])
    reference = (median(samples["reference"]) - echo) / calls
    candidate = (median(samples["candidate"]) - echo) / calls
    result: dict[str, Any] = {"reference_ms": reference, "candidate_ms": candidate, "speedup": None,
                              "speedup_ci": None, "confidence": confidence}
    if reference > 0 and candidate > 0:
        ratios = sorted(round_ratio(r - echo, c - echo) for r, c in zip(samples["reference"], samples["candidate"]))
        low, high = sign_test_ranks(len(ratios), confidence)
        middle = math.exp(median([log_or_infinite(r) for r in ratios]))
        result.update(speedup=middle if 0 < middle < math.inf else reference / candidate,  # half the rounds unresolved
                      speedup_ci=[ratios[low] if low is not None else 0.0,
                                  ratios[high] if high is not None and math.isfinite(ratios[high]) else None])
    return result


def round_ratio(reference: float, candidate: float) -> float:
    """One round's speedup from the kernels' times (the echo taken off): 0 where the reference's is
    not above the echo, inf where the candidate's is not."""
    if candidate <= 0:
        return math.inf
    return max(reference, 0.0) / candidate


def log_or_infinite(ratio: float) -> float:
    return math.log(ratio) if ratio > 0 else -math.inf


def sign_test_ranks(n: int, confidence: float) -> tuple[int | None, int | None]:
    """The 0-based ranks (low, high) among n sorted samples that bound their population's median
    with at least `confidence`: the k-th smallest and k-th largest, k the largest with
    P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2 (exact, in integers).  (None, None) where n is
    too small for any (5 or fewer at 95%)."""
    k, cumulative = 0, 0
    while k < n and (cumulative + math.comb(n, k)) / 2 ** n <= (1 - confidence) / 2:  # int / int: no overflow
        cumulative += math.comb(n, k)
        k += 1
    return (k - 1, n - k) if k else (None, None)


def race_flags(result: dict[str, Any], implausible: float) -> dict[str, str]:
    flags = {}
    speedup, interval = result["speedup"], result["speedup_ci"]
    if speedup is None:
        flags["below_resolution"] = (f"a kernel's time ({result['reference_ms']:.4g} ms reference, "
                                     f"{result['candidate_ms']:.4g} ms candidate) is not above the harness's echo")
        return flags
    if speedup > implausible:
        flags["implausible_speedup"] = f"{speedup:.3g}x is beyond {implausible:g}x: check what the candidate skips"
    overhead, fastest = result.get("overhead_ms_per_call", 0.0), min(result["reference_ms"], result["candidate_ms"])
    if overhead > fastest:  # the subtraction, and its noise, outweigh what is left of a kernel
        flags["harness_dominates"] = (f"the harness's cost per call ({overhead:.3g} ms, subtracted) exceeds a kernel's "
                                      f"time per call ({fastest:.3g} ms): raise round_ms, or budget_ms")
    if interval[0] <= 1 and (interval[1] is None or interval[1] >= 1):
        high = "inf" if interval[1] is None else f"{interval[1]:.3g}"
        flags["within_noise"] = f"the {result['confidence']:.0%} interval {interval[0]:.3g}-{high} contains 1"
    return flags


def speedup_line(timing: dict[str, Any]) -> str:
    if timing["speedup"] is None:
        return "speedup below the harness's resolution"
    low, high = timing["speedup_ci"]
    return (f"speedup {timing['speedup']:.3g}x ({timing['confidence']:.0%} interval {low:.3g}-"
            f"{'inf' if high is None else format(high, '.3g')}), candidate {timing['candidate_ms']:.4g} ms, "
            f"reference {timing['reference_ms']:.4g} ms over {timing['rounds']} rounds "
            f"of {timing['calls_per_round']} calls")


def gpu_conditions() -> dict[str, Any] | None:
    """The GPU's SM and memory clocks (MHz), temperature (C) and throttle reasons now, through NVML
    (nvidia-ml-py); None without it.  The device is the worker's cuda:0, found by UUID."""
    try:
        import pynvml  # type: ignore[import-not-found]
        import torch
        pynvml.nvmlInit()
        gpu_uuid = str(torch.cuda.get_device_properties(0).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid if gpu_uuid.startswith("GPU-") else f"GPU-{gpu_uuid}")
        return {"sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "memory_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
                "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
                "throttle_reasons": int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))}
    except Exception:  # no NVML, no permission, an old driver: the verdict says None rather than fail
        return None


def gpu_flags(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, str]:
    """What changed between two gpu_conditions() enough to move a measurement: an SM or memory
    clock by more than 5%, the temperature by more than 10 C, a throttle reason set at either end."""
    if before is None or after is None:
        return {"gpu_conditions_unrecorded": "no NVML (nvidia-ml-py): clocks and throttling not recorded"}
    moved = []
    for key in ("sm_clock_mhz", "memory_clock_mhz"):
        if abs(after[key] - before[key]) > 0.05 * max(before[key], 1):
            moved.append(f"{key} {before[key]} -> {after[key]}")
    if abs(after["temperature_c"] - before["temperature_c"]) > 10:
        moved.append(f"temperature {before['temperature_c']} C -> {after['temperature_c']} C")
    reasons = [name for bit, name in THROTTLE_REASONS.items()
               if (before["throttle_reasons"] | after["throttle_reasons"]) & bit]
    if reasons:
        moved.append("throttled: " + ", ".join(reasons))
    return {"gpu_conditions_moved": "; ".join(moved)} if moved else {}
