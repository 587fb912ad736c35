"""KCoral server: HTTP front-end, request validation, blob caches and the worker pool.

    python -m kcoral [server] [--port 8000] [--device auto|cpu|gpu] ...

`POST /execute` takes a multipart request (a JSON program plus blob parts),
validates it completely, resolves its blobs against the memory and disk
caches, and hands it to a worker process (kcoral_worker.py) forked from a
warm template; `GET /health` reports load, target and versions.  Everything
here runs on the standard library: `http.server` threads, a hand-written
multipart parser, `multiprocessing` pipes.  The wire contract is
docs/protocol.md; docs/design.md gives the decisions behind this file's shape.

Processes and threads (one node):

    kcoral (this file)                                forkserver template (or, sandboxed, a
      kcoral-connection thread:                       bwrap container per slot running
        RequestHandler -> handle_execute              kcoral_worker.template_main)
        -> Pool.run_job -> Execution.run  <--pipe-->    | fork
      kcoral-output-reader thread per request:        worker process (kcoral_worker.worker_main):
        the worker's stdout/stderr <---------------   serves one request at a time, in its
      and the threads below                           own process group; retires after one
                                                      request by default

Threads of this process, by name (`{slot}`: a slot's name such as cpu/w0; tests/test_map.py
holds the list to `threading.enumerate()` on a busy server and to every `threading.Thread` here):
    MainThread: `KCoralServer.serve_forever` under `python -m kcoral`, waiting for signals
    kcoral-http: the HTTP server's accept loop (`KCoralServer.start`)
    kcoral-connection: one per connection, reading and answering its requests (`RequestHandler`)
    kcoral-connection-guard: cuts slow and idle clients (`ConnectionGuard`)
    kcoral-stream-sender: writes a streamed answer's output frames (`OutputStream`)
    kcoral-write-blobs: writes a request's file blobs to the disk cache (`BlobStore.keep_file_blobs`)
    kcoral-spare-{slot}: starts a slot's next worker while its last request runs (`SpareWorker`)
    kcoral-replace-{slot}: replaces a retired worker (`Pool.release`)
    kcoral-output-reader: one per request, reads its worker's stdout and stderr (`OutputReader`)
    memory-watch: one per request under a memory limit, samples its processes (`MemoryWatch`)
    kcoral-helper: a thread that ran one of the four above, idle until it runs another (`Helpers`)
    remove-workspace: removes an unsandboxed request's workspace after the answer
    remove-cgroup: removes a request's cgroup once its processes are gone (`RequestCgroup`)
    sandbox-output: follows a container template's stdout and stderr (`OutputTail`)
    kcoral-spawner: starts the containers, from one thread that lives as long as the server

Before §0, what several sections rely on: `wait_turn`, the one FIFO wait of the three admission
points (body memory, worker slots, GPU leases), and `receive_checked`, a worker's or container's next
message, checked (and the exceptions both raise).

Sections, in the order a request travels (each section's functions in call order):
 0. configuration: `ServerConfig`, every setting once; the command line is generated from it
 1. HTTP front-end: `KCoralHTTPServer`, `RequestHandler` (`handle_one_request` -> `parse_request`
    -> `do_POST` -> `read_and_execute` -> `respond`), then what it reads under: `ConnectionGuard`,
    `BodyBudget`
 2. the application: `Job`, `Outcome`, `KCoralServer.handle_execute` (protocol order,
    docs/protocol.md §4.7) -> `run_program`, then its lifecycle (`start`, `serve_forever`, `stop`)
 3. wire rules, envelope: `split_request`, the multipart parser, strict JSON
 4. wire rules, program: `parse_program` and its checks
 5. the blob store: `BlobStore` over `MemoryCache` and `DiskCache`
 6. the pool: `FairQueue`, `Slot`, `SpareWorker`, `Pool.run_job` (a slot, in fair order)
 7. one execution: `Execution.run` (the worker conversation), `OutputReader`
 8. a request's limits: `RequestCgroup`, `MemoryWatch`
 9. workspaces: created per request, removed without following links
10. launching workers: the forkserver template and its imports, `Worker`
11. GPUs and the lease: `LeaseArbiter`
12. the sandbox: `SandboxTemplate`, `bwrap_command`
13. what the application records: `EventLog`, `SavedPrograms`, `Metrics`
14. the command line, 15. `haproxy-config`

Read downwards, a request goes §1 -> §2 -> §3 -> §4 -> §5 -> §6 -> §7 -> §8 -> §9 -> §10, §2
calling each of §3-§6 in protocol order.  The jumps, the calls that go back up the file
(tests/test_map.py traces one request, unsandboxed and sandboxed, and holds this list to the
calls it makes):
    §4 `decode_program` -> §3 `strict_json`: the program part is strict JSON as every part is
    §7 `Execution.run` -> §0 `delegated_cgroup`: a setting resolved at start
Two more cross into kcoral_worker.py: `Execution.converse` (§7) talks to the worker's
`serve_request` over the pipe, and ending a worker (§10's `Worker.kill`, through §6's
`Pool.end_worker`) goes through the worker file's process trees (`kill_group`, `terminate`).
Everything else is a call down the file: §1 asks §2 whose tenant and request it is, §1 and §2
record through §13 (`event`, `save_program`), §6, §7 and §10 count through §13's `Metrics.add` and
§7 writes through §13's `write_all`.  GPU workers take the lease of §11 and, sandboxed, start in
§12's container, both set up at start-up.

Lifecycle verbs mean one thing each, across the classes (tests/test_docs.py holds them to it, by
name and by what each such method calls):
`start` begins serving, threads or processes (`KCoralServer`, `SpareWorker`, `Helpers`); `drain` admits
nothing new while admitted work, queued included, runs on (`Pool`); `refuse_waiters` admits
nothing new and turns away whoever waits (`BodyBudget`, `LeaseArbiter`); `stop` ends gracefully
and releases everything once work is done, waiting until no thread or process of it is left
(`KCoralServer`, `Pool`, `Worker`, `ConnectionGuard`, `MemoryWatch`); `kill` ends processes now,
by signal (`Worker`, `SandboxTemplate`); `halt` signals a worker's process group and waits for
nothing, its exit and reaping left to a later kill (`Worker`); `close` releases a file or
descriptor only (`EventLog`, `SavedPrograms`).  A worker that has a slot ends one way,
`Pool.end_worker` (its kill, and the quarantine of a GPU it cannot confirm gone; `Execution`
takes the GPU lease first), which tests/test_map.py holds; a request's `MemoryWatch` only
SIGKILLs a worker over its limit, which the conversation then sees end as any crash.

The client lives in client.py; `from kcoral import Client, Program` loads it
lazily from beside this file (`load_client`), so the server needs only this
file and kcoral_worker.py.
"""

from __future__ import annotations

import argparse
import array
import collections
import contextlib
import ctypes
import dataclasses
import datetime
import email.message
import errno
import fcntl
import functools
import hashlib
import hmac
import http.client
import http.server
import importlib.metadata
import importlib.util
import io
import json
import math
import mmap
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import queue
import re
import resource
import secrets
import select
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import types
import typing
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, NoReturn

import kcoral_worker
from kcoral_worker import (
    DTYPE_SIZES,
    NOFOLLOW_DIR,
    Buffer,
    ErrorObject,
    Instruction,
    ValidationError,
    become_subreaper,
    children_of,
    descendants,
    group_members,
    is_live,
    is_ref,
    kill_group,
    killed_already,
    normalize_path,
    recv_raw,
    tree_members,
    wait_readable,
)

# the types this file's signatures share (Buffer, Instruction and ErrorObject are the worker's)
Json = Any  # a decoded JSON value
Body = bytes | bytearray  # a request body as read: searchable with find(), unlike a memoryview
PartHeaders = dict[str, list[str]]  # a multipart part's headers: lower-cased name -> values
Blobs = dict[str, Buffer]  # hash -> payload, for every blob a program references
LeaseTicket = tuple[object, list[int] | None, int | None]  # (identity, the GPUs wanted, or how many of any)
ExtraHeaders = Mapping[str, str] | tuple[()]  # headers a response adds; () for none

# `kcoral.errors` and `kcoral.builtins`, as in the published package (defined by the worker); the
# name `builtins` is that public API's, and this file never imports the stdlib module it shadows
errors, builtins = kcoral_worker.install_kcoral_modules()

__version__ = "0.4.0"
CLIENT_NAMES = ("Client", "KCoralError", "Program", "ProgramResult", "ProtocolError", "Register",
                "RemoteExecutionError", "RemoteFunction", "ReturnedFile", "ReturnedFolder",
                "TransportError")
__all__ = sorted(CLIENT_NAMES + ("ServerConfig", "create_app", "parse_program"))


def __getattr__(name: str) -> Any:
    """Client names come from client.py on first use, so the server never needs it."""
    if name in CLIENT_NAMES:
        return getattr(load_client(), name)
    raise AttributeError(f"module 'kcoral' has no attribute {name!r}")


CLIENT_MODULE = "kcoral_client"
PROJECT_DIR = os.path.dirname(os.path.abspath(__file__))  # this file and kcoral_worker.py
_client_lock = threading.Lock()


def load_client() -> types.ModuleType:
    """The client module from the file beside this one, whatever `client.py` lies on sys.path.

    A checkout holds it as client.py (vendorable by copying); an installed distribution ships
    it as kcoral_client.py (setup.py), so that no generic top-level name enters site-packages.
    Either is loaded by path under the private name `kcoral_client`.
    """
    with _client_lock:
        module = sys.modules.get(CLIENT_MODULE)
        if module is not None:
            return module
        here = os.path.dirname(os.path.abspath(__file__))
        installed = os.path.join(here, CLIENT_MODULE + ".py")
        path = installed if os.path.exists(installed) else os.path.join(here, "client.py")
        spec = importlib.util.spec_from_file_location(CLIENT_MODULE, path)
        assert spec is not None and spec.loader is not None  # a .py path always gets a source loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[CLIENT_MODULE] = module  # before running it: its dataclasses look themselves up there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[CLIENT_MODULE]
            raise
        return module


# --- shared by the sections below: the one FIFO wait, a worker's checked message ------------------

CLIENT_CHECK_SECONDS = 0.25  # how often a waiting or running request checks that its client is still there


class WorkerCrashed(Exception):
    """The worker process died or stopped talking the protocol."""


class WorkerStartTimeout(WorkerCrashed):
    """A start-up step outlived its time limit (a multi-GPU request answers 504, docs/server.md §7)."""


class ResponseTooLarge(Exception):
    """A worker announced more returned bytes or parts than the response may carry."""


class ClientGone(Exception):
    """The request's client closed its connection while the request waited or ran: nobody is
    left to answer, so it is stopped.  `where`: "queue" (waiting for a worker), "lease" (for the GPU)
    or "running" (wait_turn's `where`; logged as the event's `phase`)."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


_Served = typing.TypeVar("_Served")


def wait_turn(cond: threading.Condition, line: Any, ticket: object, turn: Callable[[], _Served | None],
              deadline: float | None, refused: Callable[[], bool] = lambda: False,
              client_gone: Callable[[], bool] | None = None, where: str = "") -> _Served | None:
    """The one wait of the three admission points (body memory, slots, GPU leases), `ticket`
    already in their `line`, `cond` held: until `turn()` serves it (-> what it returns), `refused()`
    says no or `deadline` (time.monotonic(), None: none) passes (-> None); ClientGone(`where`) once
    `client_gone()` says so, asked every CLIENT_CHECK_SECONDS.  However it ends, the ticket leaves
    the queue and the other waiters are woken: the head of the line may have changed."""
    try:
        while not refused():
            served = turn()
            if served is not None:
                return served
            if client_gone is not None and client_gone():
                raise ClientGone(where)
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return None
            if client_gone is not None:
                wait = CLIENT_CHECK_SECONDS if wait is None else min(wait, CLIENT_CHECK_SECONDS)
            cond.wait(wait)
        return None
    finally:
        line.remove(ticket)
        cond.notify_all()


class Helper:
    """One callable run by `Helpers`; `join` waits for its end as Thread.join would."""

    def __init__(self, target: Callable[..., object], args: tuple[Any, ...], name: str, reuse: bool) -> None:
        self.target, self.args, self.name, self.reuse = target, args, name, reuse
        self.done = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)


class Helpers:
    """The threads a request's helpers run on (its output reader and memory watch, a slot's spare and
    replacement): each callable on a thread of its own, one that finished an earlier callable where
    one waits idle.  A new thread's start waits until it runs, 0.15-0.7 ms on a request's path here,
    four a request; a hand-off to an idle one takes tens of microseconds.  Idle threads exit after
    HELPER_IDLE_SECONDS, so an idle server keeps none.  `reuse=False`: a thread of its own, which ends
    with the callable (one that enters a request's namespace, which the thread's successors would share)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[queue.SimpleQueue[Helper]] = []
        self.running = threading.local()  # .helper: the one this thread runs (`current`)

    def current(self) -> Helper | None:
        return getattr(self.running, "helper", None)

    def start(self, target: Callable[..., object], *args: Any, name: str, reuse: bool = True) -> Helper:
        helper = Helper(target, args, name, reuse)
        with self.lock:
            inbox = self.idle.pop() if self.idle and reuse else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self.serve, args=(inbox,), name="kcoral-helper", daemon=True).start()
        inbox.put(helper)
        return helper

    def serve(self, inbox: queue.SimpleQueue[Helper]) -> None:
        thread = threading.current_thread()
        while True:
            try:
                helper = inbox.get(timeout=HELPER_IDLE_SECONDS)
            except queue.Empty:
                with self.lock:
                    if inbox in self.idle:  # else a start() took it just now: its callable is on the way
                        self.idle.remove(inbox)
                        return
                continue
            thread.name, self.running.helper = helper.name, helper
            try:
                helper.target(*helper.args)
            except BaseException:  # reported as a thread's own would be
                threading.excepthook(threading.ExceptHookArgs((*sys.exc_info(), thread)))
            finally:
                helper.done.set()
                # as Thread.run does: what the callable held goes now (a worker's pipes, say), not when
                # a cycle through its owner is collected or this thread runs another
                del helper.target, helper.args
            if not helper.reuse:
                return
            del helper, self.running.helper
            threading.current_thread().name = "kcoral-helper"
            with self.lock:
                self.idle.append(inbox)


HELPER_IDLE_SECONDS = 2.0


# what a worker may send mid-request
WORKER_MESSAGES = (kcoral_worker.InstructionStarted, kcoral_worker.StageBlobs, kcoral_worker.ReturnValue,
                   kcoral_worker.AcquireLease, kcoral_worker.ReleaseLease, kcoral_worker.RequestDone)
WORKER_STEP_SECONDS = 60.0  # each start-up step (docs/server.md §1.1)
PROGRESS_READS = 16  # x 64 KiB at most off the progress pipe, well over its 64 KiB capacity
CONTROL_MESSAGE_BYTES = 1 << 16  # any worker or template message but a ReturnValue, which the response budget bounds


def receive_checked(conn: Connection, kinds: type | tuple[type, ...], deadline: float, late: str,
           limit: int = CONTROL_MESSAGE_BYTES, sizes: list[int] | None = None) -> Any:
    """A worker's or template's next message, which must be one of `kinds` (its frame's size
    is appended to `sizes`, if given).

    Nothing from those processes is trusted (they run, or ran, uploaded code): a frame that is
    oversized, malformed or of another kind is WorkerCrashed, as is a closed pipe; no message
    by `deadline` is WorkerStartTimeout(`late`), which the conversation turns into a 504."""
    try:
        message, size = kcoral_worker.receive_message(conn, limit, deadline)
    except TimeoutError:
        raise WorkerStartTimeout(late) from None
    except kcoral_worker.UnexpectedMessage as exc:
        raise WorkerCrashed(f"protocol violation: {exc}") from None
    except (EOFError, OSError) as exc:
        raise WorkerCrashed(f"the pipe broke: {exc}") from None
    if not isinstance(message, kinds):
        raise WorkerCrashed(f"protocol violation: an unexpected {type(message).__name__}")
    if sizes is not None:
        sizes.append(size)
    return message


# --- 0. configuration: every setting defined once, the command line generated from it -------------

def default_disk_cache_dir() -> str:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kcoral", "files")


def option(default: Any, help: str, *, env: str | None = None, cli_default: Any = None,
           factory: Callable[[], Any] | None = None, choices: tuple[str, ...] | None = None,
           parse: Callable[[str], Any] | None = None, flag: str | None = None) -> Any:
    """One server setting: its default, its help text and how the command line spells it.

    The command line is generated from these (`parse_args`), so a default is written once.
    `cli_default` is the command line's default where it differs from the dataclass's
    (the published package's `log_dir`: None embedded, "logs" from the CLI); `parse` turns the flag's
    string into the field's value.  A `flag` names a repeatable option whose values make up
    the field's tuple (`--sandbox-readonly-path` fills `sandbox_readonly_paths`).
    """
    meta = {"help": help, "env": env, "cli_default": cli_default, "choices": choices, "parse": parse,
            "flag": flag}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def parse_gpu_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(g) for g in text.split(",") if g.strip())
    except ValueError:
        raise ValueError("--gpus takes comma-separated physical GPU ids") from None


LARGE_REQUEST_BYTES = (1 << 30) + (64 << 20)  # the size limits' default: a 1 GiB tensor, its program and more


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Server settings; field names and defaults follow the published package where it has them."""
    # what this node serves, and with which processes
    host: str = option("127.0.0.1", "address to bind", env="KCORAL_SERVER_HOST")
    port: int = option(8000, "TCP port to listen on (0 picks a free one)", env="KCORAL_SERVER_PORT")
    device: str = option("auto", "where programs run: GPU workers, CPU workers, or GPU when CUDA devices "
                         "are visible", env="KCORAL_SERVER_DEVICE", choices=("auto", "cpu", "gpu"))
    gpus: tuple = option((0,), "comma-separated physical GPU ids to serve (GPU mode)",
                         env="KCORAL_SERVER_GPUS", parse=parse_gpu_ids)
    num_workers: int = option(1, "worker processes in CPU mode")
    workers_per_gpu: int = option(1, "worker slots per GPU; more than 1 overlaps one request's "
                                  "compilation with another's GPU work")
    max_requests_per_worker: int = option(1, "retire a worker after this many requests (0: never); "
                                          "1 gives every request a fresh process")
    # blob caches (docs/protocol.md §7.4)
    cache_capacity_bytes: int = option(16 << 30, "memory blob cache budget in bytes (each entry is charged its "
                                       "payload plus a fixed overhead, CACHE_ENTRY_OVERHEAD)")
    cache_max_entries: int = option(1 << 20, "memory blob cache entry limit, least recently used evicted first")
    disk_cache_dir: str | None = option(None, "disk cache for file blobs ('' disables)",
                                        factory=default_disk_cache_dir)
    disk_cache_capacity_mbytes: int = option(16384, "disk cache budget in MiB, charged by the blocks its files "
                                             "occupy (0 disables)")
    disk_cache_max_files: int = option(100_000, "disk cache file limit: tiny blobs run out of inodes before "
                                       "they fill a byte budget")
    # the event log and saved programs (docs/server.md §10)
    log_dir: str | None = option(None, "directory for the JSON-lines event log and saved programs "
                                 "('' disables)", env="KCORAL_LOG_DIR", cli_default="logs")
    log_console: bool = option(True, "mirror events to stderr")
    log_programs: bool = option(True, "save each accepted request's program beside the log")
    log_max_bytes: int = option(64 << 20, "rotate events.jsonl when a record would take it past this size "
                                "(0: never; leave rotation to logrotate and SIGHUP)")
    log_backups: int = option(4, "rotated event logs kept beside it (events.jsonl.1 is the newest)")
    log_programs_max_bytes: int = option(1 << 30, "saved programs of a run kept, in bytes all together; "
                                         "the oldest are removed first")
    log_programs_max_count: int = option(10000, "saved programs of a run kept at most; the oldest are "
                                         "removed first")
    # time limits of a request, a wait, a shutdown
    default_timeout_seconds: float = option(300.0, "execution timeout when a request sets none")
    max_timeout_seconds: float = option(900.0, "upper clamp for a request's timeout_seconds")
    worker_wait_timeout_seconds: float = option(1800.0, "how long a request waits for a free worker "
                                                "before 503 busy")
    drain_seconds: float = option(2.0, "on shutdown, answer new requests 503 no sooner than this after "
                                  "the signal, and keep the port open until none came for this long (at "
                                  "most 10x): time for a load balancer's health check to take the node out")
    worker_termination_grace_seconds: float = option(5.0, "SIGTERM-to-SIGKILL window when killing a "
                                                     "worker's process tree")
    prepare_timeout_seconds: float = option(600.0, "how long the one-time preparation of the worker "
                                            "template's imports may take at start-up (tvm_ffi may "
                                            "compile its torch add-on); beyond it the add-on is disabled")
    # the size of a request and its program (docs/protocol.md §4, 5)
    max_request_bytes: int = option(LARGE_REQUEST_BYTES, "request size limit (413 beyond it); the default holds a "
                                    "1 GiB tensor and 64 MiB more")
    max_request_parts: int = option(50_000, "multipart parts in one request (413 beyond it); a request whose "
                                    "first part is its program may have only one more than it references blobs")
    max_part_header_lines: int = option(16, "header lines of one multipart part (400 beyond it)")
    max_part_header_bytes: int = option(16 << 10, "header block of one multipart part (400 beyond it)")
    # the program part
    max_program_bytes: int = option(16 << 20, "size of the program part (413 beyond it)")
    max_program_instructions: int = option(100_000, "instructions in one program (413 beyond it)")
    max_run_args: int = option(100_000, "arguments of one run instruction (413 beyond it)")
    max_program_values: int = option(1_000_000, "JSON values in the program part, counted by its commas and "
                                     "opening brackets outside strings (413 beyond it)")
    # connections, slow clients and request bodies in memory
    max_connections: int = option(0, "open client connections served at once; more wait in the listen "
                                  "backlog while idle keep-alive ones are closed (0: from the fd limit)")
    keepalive_timeout_seconds: float = option(15.0, "close a keep-alive connection idle this long")
    header_timeout_seconds: float = option(20.0, "whole request line and headers must arrive within this "
                                           "(408 beyond it)")
    max_header_bytes: int = option(64 << 10, "request line plus headers size limit (431 beyond it)")
    body_rate_window_seconds: float = option(30.0, "a request body must bring --body-rate-min-bytes in every "
                                             "window of this length (408 and close otherwise)")
    body_rate_min_bytes: int = option(64 << 10, "least body bytes per --body-rate-window-seconds")
    body_min_average_bytes_per_second: int = option(
        128 << 10, "least average rate of a whole body, from its first --body-rate-window-seconds on (408 "
        "and close otherwise): a body just above the window rule cannot hold its connection for hours")
    max_bodies_per_tenant: int = option(0, "request bodies one named tenant may be sending at once (429 "
                                        "beyond it; 0: a quarter of --max-connections)")
    max_bodies_per_address: int = option(0, "request bodies one client address may be sending at once (429 "
                                         "beyond it; 0: a quarter of --max-connections)")
    reserved_connections: int = option(0, "connections request bodies may not take, kept for /health, "
                                       "/metrics and short requests (0: an eighth of --max-connections, at least 2)")
    # request bodies in memory, all clients together
    max_body_bytes_in_flight: int = option(768 << 20, "request bodies held in memory at once, all clients "
                                           "together; later ones wait before being read")
    body_admission_wait_seconds: float = option(60.0, "how long a body waits for --max-body-bytes-in-flight "
                                                "room before 503 busy")
    # responses and captured output
    send_timeout_seconds: float = option(30.0, "drop a client that takes longer than this to take 1 MiB "
                                         "of its response")
    lingering_close_seconds: float = option(2.0, "after refusing a body it left unread, read and drop what "
                                            "the client still sends for up to this long before closing, so "
                                            "that it reads the refusal rather than a connection reset")
    max_response_bytes: int = option(LARGE_REQUEST_BYTES, "response size limit (500 response_too_large beyond "
                                     "it); the default holds a returned 1 GiB tensor and 64 MiB more")
    max_response_parts: int = option(100_000, "binary parts one response may carry (returned bytes, tensors "
                                     "and files; a folder's files each count): a return beyond it is FAILED "
                                     "serialization")
    output_limit_bytes: int = option(1 << 20, "default per-stream stdout/stderr capture limit")
    max_output_limit_bytes: int = option(16 << 20, "upper clamp for a request's output_limit_bytes")
    # isolation and what one request may use (docs/sandbox.md)
    sandbox: str = option("auto", "isolate each request's code in a bubblewrap container (docs/sandbox.md); "
                          "auto: when a working bwrap is found and workers serve one request each",
                          choices=("auto", "none", "bubblewrap"))
    sandbox_readonly_paths: tuple = option((), "extra path mounted read-only in the sandbox (repeatable)",
                                           flag="--sandbox-readonly-path")
    sandbox_uid: int = option(2_000_000_000, "host uid and gid sandboxed programs run as when the server runs "
                              "as root (pick one no account uses); an unprivileged server runs them as itself")
    # one request's resources
    cgroup: str = option("auto", "cgroup v2 subtree delegated to the server (systemd Delegate=yes), where each "
                         "request runs in a child cgroup of its own with memory.max, memory.swap.max 0 and "
                         "pids.max, killed by the kernel beyond them; auto: the server's own cgroup when it is "
                         "delegated, none: never (the front-end samples memory instead)")
    memory_limit_bytes: int | None = option(None, "memory of all of one request's processes together (anonymous, "
                                            "shared, page tables, memfds, System V), sampled every 0.1 s "
                                            "(5 ms past half of it); beyond it the request is stopped (0: no limit; "
                                            "default: half the machine's memory shared among the slots)")
    process_limit: int | None = option(None, "processes and threads one request may have alive at once; "
                                       "a fork beyond it fails with EAGAIN (sandbox only; 0: no limit; "
                                       "default: 16 per CPU, at least 1024)")
    disk_limit_bytes: int | None = option(None, "bytes one request may write to its workspace, /tmp and "
                                          "/dev/shm together, a tmpfs in memory; beyond it writes fail with "
                                          "ENOSPC (sandbox only; 0: no limit; default: a quarter of the "
                                          "machine's memory shared among the slots)")
    file_limit: int | None = option(None, "files and directories one request may create (ENOSPC beyond it; "
                                    "sandbox only; 0: no limit; default: 100000)")
    # who may call, and tenants' shares (docs/operations.md)
    token: str | None = option(None, "require 'Authorization: Bearer <token>' on every endpoint; several "
                               "tokens separated by commas or white space are all accepted.  On the command "
                               "line it is visible to every local user (ps): prefer KCORAL_TOKEN or "
                               "--token-file", env="KCORAL_TOKEN")
    token_file: str | None = option(None, "file of accepted bearer tokens, one a line, each alone (anonymous) or "
                                    "after its tenant's name (NAME TOKEN); with --token, both sets are "
                                    "accepted; it must not be readable by group or others; read again on SIGHUP")
    metrics_token_file: str | None = option(None, "file of the operator's bearer tokens, one a line, read again on "
                                            "SIGHUP: they read /metrics and /health and run nothing.  With it, only "
                                            "they read /metrics; without it, a node whose --token-file names "
                                            "tenants answers /metrics 403 to every token (docs/operations.md)")
    proxy_secret_file: str | None = option(None, "file holding the secret the generated HAProxy configuration "
                                           "sends in X-KCoral-Proxy (haproxy-config --proxy-secret-file, the same "
                                           "file); X-Request-Start and X-KCoral-Health-Check are believed only on "
                                           "requests carrying it (without this flag: X-Request-Start never)")
    max_running_per_tenant: int = option(0, "requests one tenant runs at once on this node; its others wait "
                                         "while other tenants' run (0: no limit)")
    max_waiting_per_tenant: int = option(0, "requests one tenant may have waiting for a worker on this node; "
                                         "more are answered 429 with Retry-After (0: no limit)")


DEFAULT_LIMITS = ServerConfig()  # the limits of the wire rules' functions called without a server's settings


def validate_config(config: ServerConfig) -> None:
    if config.device not in ("auto", "cpu", "gpu"):
        raise ValueError("device must be 'auto', 'cpu' or 'gpu'")
    if config.sandbox not in ("auto", "none", "bubblewrap"):
        raise ValueError("sandbox must be 'auto', 'none' or 'bubblewrap'")
    if config.sandbox_readonly_paths and config.sandbox == "none":
        raise ValueError("--sandbox-readonly-path requires the sandbox")
    if config.sandbox == "bubblewrap" and config.max_requests_per_worker != 1:
        # one process would serve several tenants: whatever a request left in its memory, the next one reads
        raise ValueError("--sandbox bubblewrap needs --max-requests-per-worker 1 (a fresh worker per request)")
    if not all(os.path.isabs(path) for path in config.sandbox_readonly_paths):
        raise ValueError("--sandbox-readonly-path takes absolute paths")
    if config.token is not None:
        split_tokens(config.token, "--token")
    checks = [(config.disk_cache_capacity_mbytes >= 0, "disk_cache_capacity_mbytes must be >= 0"),
              (config.num_workers >= 1, "num_workers must be >= 1"),
              (config.workers_per_gpu >= 1, "workers_per_gpu must be >= 1"),
              (config.max_requests_per_worker >= 0, "max_requests_per_worker must be >= 0"),
              (len(config.gpus) > 0, "gpus must not be empty"),
              (config.default_timeout_seconds > 0 and config.max_timeout_seconds > 0,
               "timeouts must be positive"),
              (1 <= config.port <= 65535 or config.port == 0, "port must be 1-65535"),
              (0 <= config.drain_seconds <= 3600, "drain_seconds must be 0-3600"),
              (min(config.max_running_per_tenant, config.max_waiting_per_tenant) >= 0,
               "the per-tenant limits must be >= 0"),
              (min(config.log_max_bytes, config.log_backups, config.log_programs_max_bytes,
                   config.log_programs_max_count) >= 0, "the log limits must be >= 0"),
              (all((getattr(config, name) or 0) >= 0 for name in QUOTA_NAMES), "the request limits must be >= 0"),
              (0 < config.sandbox_uid < 0xFFFFFFFF, "sandbox_uid must be a uid other than 0")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


QUOTA_NAMES = ("memory_limit_bytes", "process_limit", "disk_limit_bytes", "file_limit")
FILE_LIMIT = 100_000  # --file-limit's default: a pip install of a large package, many times over


def machine_quotas(config: ServerConfig, slots: int) -> dict[str, Any]:
    """The request limits left at their defaults, derived from this machine: all slots together
    may use three quarters of its memory (processes half, their tmpfs a quarter), which leaves the
    front-end and the host a quarter."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    derived = {"memory_limit_bytes": memory // 2 // slots, "disk_limit_bytes": memory // 4 // slots,
               "process_limit": max(1024, 16 * (os.cpu_count() or 1)), "file_limit": FILE_LIMIT}
    return {name: derived[name] if getattr(config, name) is None else getattr(config, name) for name in QUOTA_NAMES}


def delegated_cgroup(config: ServerConfig) -> str | None:
    """The delegated cgroup v2 directory requests get children in, once --cgroup is resolved at start
    (enter_delegated_cgroup: a path, or "none"); None before that, or without one."""
    return config.cgroup if os.path.isabs(config.cgroup) else None


def quota_enforcement(config: ServerConfig) -> dict[str, str]:
    """How each request limit is enforced here, or why it is not (for /health and the start-up line)."""
    sandboxed = config.sandbox == "bubblewrap"
    if delegated_cgroup(config):
        return {**fallback_enforcement(config, sandboxed),
                "memory_limit_bytes": f"the kernel: memory.max of the request's own cgroup under {config.cgroup} "
                                      "(everything it charges: anonymous, shared, page tables, kernel memory), "
                                      "memory.swap.max 0"}
    return fallback_enforcement(config, sandboxed)


def fallback_enforcement(config: ServerConfig, sandboxed: bool) -> dict[str, str]:
    """How each limit is enforced without a delegated cgroup: per process and per namespace."""
    system_v = sandboxed and os.getuid() == 0  # enter_ipc: the request's IPC namespace, from a root front-end
    memory = ("front-end, every 0.1 s (every 5 ms past half the limit), all the request's processes together: "
              "anonymous and shared memory (PSS), page tables, memfds held but not mapped"
              + (", System V segments no process attaches (its IPC namespace: shmall = the limit)" if system_v else "")
              + ("; RLIMIT_DATA per process on CPU workers (a burst is refused at once)" if sandboxed else ""))
    how = {"memory_limit_bytes": memory,
           "process_limit": "RLIMIT_NPROC in the request's user namespace" if sandboxed else "",
           "disk_limit_bytes": "size of the request's tmpfs" if sandboxed else "",
           "file_limit": "inodes of the request's tmpfs" if sandboxed else ""}
    return {name: ("off (0)" if not getattr(config, name) else how[name] or "not enforced without the sandbox")
            for name in QUOTA_NAMES}


def request_too_large_message(size: int | None, limit: int) -> str:
    """The 413's words, the server's and the client's refusal before sending alike (tests/test_shared_rules.py)."""
    what = f"request of {size} bytes" if size is not None else "request"
    return (f"{what} exceeds the server's size limit of {limit} bytes (max_request_bytes; the server's "
            "--max-request-bytes flag raises it)")


def memory_unseen(config: ServerConfig) -> str:
    """What the memory limit cannot see here (for /health): the fallback's honest blind spots."""
    if delegated_cgroup(config):
        return "the process the request's worker was forked as (before it joined its cgroup)"
    sandboxed = config.sandbox == "bubblewrap"
    unseen = ["kernel memory other than page tables (pipe and socket buffers, inode and dentry caches, "
              "the kernel's own objects)", "a burst on a GPU worker between two samples"
              if sandboxed else "a burst between two samples"]
    if not (sandboxed and os.getuid() == 0):
        unseen.append("System V segments no process attaches")
    if not sandboxed:
        unseen.append("files in /dev/shm or /tmp no process maps (no tmpfs of its own)")
    return "; ".join(unseen)


# --- 1. HTTP front-end: the server, the request handler, then the limits it reads under -----------

class KCoralHTTPServer(http.server.ThreadingHTTPServer):
    """ThreadingHTTPServer with a bounded number of connections (one thread each).

    At the limit, the listening socket is not accepted from: new connections wait in the
    backlog while idle keep-alive connections are closed to make room.  When the process runs
    out of fds, accept() fails while the socket stays readable; we back off instead of spinning.
    """
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    server_address: tuple[str, int]  # once bound, getsockname() of an AF_INET socket

    def __init__(self, address: tuple[str, int], handler: type[RequestHandler], app: KCoralServer) -> None:
        self.app = app
        self.guard = ConnectionGuard(app.config)
        self.max_connections = app.config.max_connections or default_max_connections()
        self.senders = BodySenders(app.config, self.max_connections)
        self.open_connections = 0
        self.connections_changed = threading.Condition()  # open_connections went up or down
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        with self.connections_changed:
            if self.open_connections >= self.max_connections:
                self.guard.cut_idle(min(1.0, self.app.config.keepalive_timeout_seconds))
                self.connections_changed.wait(0.5)
                if self.open_connections >= self.max_connections:  # serve_forever polls again
                    raise OSError(errno.EAGAIN, "connection limit reached")
        try:
            request = self.socket.accept()
        except OSError as exc:
            if exc.errno in ACCEPT_RESOURCE_ERRORS:
                self.guard.cut_idle(0.0)
                time.sleep(0.1)
            raise
        with self.connections_changed:
            self.open_connections += 1
        return request

    def shutdown_request(self, request: socket.socket | tuple[bytes, socket.socket]) -> None:
        super().shutdown_request(request)
        with self.connections_changed:
            self.open_connections -= 1
            self.connections_changed.notify_all()

    def handle_error(self, request: socket.socket | tuple[bytes, socket.socket],
                     client_address: tuple[str, int]) -> None:
        """One line, never a traceback: a client that vanished is routine, anything else a bug."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            self.app.log.event("client_disconnected", "WARNING", peer=client_address[0], phase="request",
                               error=type(exc).__name__)
        else:
            self.app.log.event("server_error", "ERROR", peer=client_address[0], error=repr(exc))

    def server_close(self) -> None:
        self.guard.stop()
        super().server_close()


CONTROL_CHARS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
DRAIN_LIMIT = 1 << 16  # unread bodies up to this size are skipped to keep the connection
STREAM_HEADER = "X-KCoral-Stream"  # our client's opt-in to the streamed answer (docs/protocol.md §13)
# one id for all attempts of a client's execute(), or HAProxy's for the request: logged, and on the answer
CLIENT_REQUEST_ID_HEADER = "X-KCoral-Client-Request-ID"
STREAM_MEDIA_TYPE = "application/x-kcoral-stream"
SEND_SLICE = 1 << 20  # the send timeout applies to each slice: a slow reader is fine, a stalled one is not
ZEROS = memoryview(bytes(1 << 20))  # what a body buffer grows by, at most, before a read fills it


class RequestHead(http.client.HTTPMessage):
    """A request's headers, as http.server parses them, but never taken for a MIME multipart.

    http.server parses a head with email's parser, which reads a multipart Content-Type as a body
    to split and compiles a regular expression for its boundary: new in every request, 0.3 ms of
    the front-end's time each (and the re module's cache of 512 patterns flushed by them).  A head
    has no body; what follows a line that is not a header stays the payload (parse_request)."""

    def get_content_maintype(self) -> str:  # the parser's one question; the server asks none
        return "text"


class RequestHandler(http.server.BaseHTTPRequestHandler):
    """One connection: reads each request's head and body under the guard's deadlines and the
    body budget, hands POST /execute to the app, writes the answer.

    Overrides of BaseHTTPRequestHandler, in call order: `setup`, `handle_one_request` (a
    capped head read instead of readline), `parse_request` (plus RFC 9112 framing checks),
    `do_GET`/`do_POST`, `send_error` (JSON bodies), `finish`, `log_message` (silenced: the
    event log has one line per request).  `handle_expect_100` is deferred to
    `read_and_execute`, which answers 100 only once the request is acceptable."""
    protocol_version = "HTTP/1.1"
    server_version = "kcoral/" + __version__
    disable_nagle_algorithm = True  # headers and body are separate writes
    MessageClass = RequestHead
    server: KCoralHTTPServer

    def setup(self) -> None:
        # per socket operation: bounds each send slice, and backs up the guard for reads
        self.timeout = self.server.app.config.send_timeout_seconds  # type: ignore[misc]  # typeshed: a ClassVar
        super().setup()
        threading.current_thread().name = "kcoral-connection"  # socketserver's thread, named for the map
        self.cut_reason: str | None = None  # set by the ConnectionGuard when it cuts this connection
        self.tenant = ""  # the name of the request's token in --token-file, once authorized ("": anonymous)
        self.stream: OutputStream | None = None  # the answer of a POST that asked for streamed output
        self.body_done = True
        self.client_request_id: str | None = None  # of the POST being answered (CLIENT_REQUEST_ID_HEADER)
        # of the request being read: its events' total_ms counts from the first, a proxy's wait up to the second
        self.head_started, self.head_arrived = time.monotonic(), time.time()

    def handle_one_request(self) -> None:
        """http.server's, with the request head read under a size cap and a total deadline,
        and the wait for a keep-alive connection's next request bounded."""
        self.watch("idle")
        try:
            waiting = self.rfile.peek(1)  # type: ignore[attr-defined]  # a BufferedReader; typeshed: BufferedIOBase
        except OSError:  # reset, or the backstop timeout, while idle: nothing to say
            waiting = b""
        if not waiting or self.cut_reason:
            self.unwatch()
            self.close_connection = True
            return
        self.watch("header")
        self.head_started, self.head_arrived = time.monotonic(), time.time()
        self.client_request_id = None
        head = self.read_head()
        self.unwatch()
        if head is None:
            self.close_connection = True
            return
        self.raw_requestline, self.header_block = head
        if not self.parse_request():
            return
        self.body_done = False
        self.expects_continue = (self.headers.get("Expect", "").lower() == "100-continue"
                                 and self.request_version >= "HTTP/1.1")
        handler = getattr(self, "do_" + self.command, None)
        if handler is None:
            return self.route_error()
        handler()
        self.wfile.flush()

    def watch(self, phase: str) -> None:
        self.phase = self.server.guard.enter(self, phase)

    def unwatch(self) -> None:
        self.server.guard.leave(self)

    def read_head(self) -> tuple[bytes, bytes] | None:
        """Request line and header block -> (request line, header bytes); None once answered or gone."""
        limit = self.app.config.max_header_bytes
        lines, size = [], 0
        try:
            while True:
                line = self.rfile.readline(limit - size + 1)
                size += len(line)
                if size > limit:
                    self.refuse_head(431, f"request line and headers exceed {limit} bytes")
                    return None
                if not line.endswith(b"\n"):
                    self.head_cut_short(size)
                    return None
                lines.append(line)
                if line in (b"\r\n", b"\n"):
                    return lines[0], b"".join(lines[1:])
                # http.server's own limit, without waiting for the end (private: typeshed does not know it)
                if len(lines) > http.client._MAXHEADERS + 1:  # type: ignore[attr-defined]
                    self.refuse_head(431, f"more than {http.client._MAXHEADERS} request headers")  # type: ignore[attr-defined]
                    return None
        except OSError as exc:
            self.disconnected("header", error=type(exc).__name__)
            return None

    def head_cut_short(self, size: int) -> None:
        if self.cut_reason == "header_timeout":
            self.disconnected("header", reason="header_timeout")
            self.refuse_head(408, f"request headers not received within {self.app.config.header_timeout_seconds:g} s")
        elif self.cut_reason is None and size:
            self.disconnected("header")

    def refuse_head(self, status: int, message: str) -> None:
        """Answer a request whose head could not be read, then close."""
        # command None, as http.server's parse_request resets it before parsing (typeshed: str)
        self.command, self.requestline, self.request_version = None, "", "HTTP/1.1"  # type: ignore[assignment]
        try:
            self.send_error(status, message)
        except OSError:
            pass

    def parse_request(self) -> bool:
        """http.server's parser over the head read_head took in, then RFC 9112's framing checks.

        http.server also stops the header block at a line it cannot parse (no colon, a bare
        CR) and drops the headers after it, Content-Length included: the body would then be
        read as the next request on the connection.  Refuse such a request instead."""
        socket_reader, self.rfile = self.rfile, io.BytesIO(self.header_block)
        try:
            parsed = super().parse_request()
        finally:
            self.rfile = socket_reader
        if not parsed:
            return False
        problem = "malformed request header block" if self.headers.get_payload() else framing_problem(self.headers)
        if problem:
            self.send_error(400, problem)
            return False
        return True

    def handle_expect_100(self) -> bool:
        """`100 Continue` waits until the request is known to be acceptable (execute)."""
        return True

    def do_GET(self) -> None:
        operator = self.app.is_operator(self.headers.get("Authorization", ""))
        if operator:
            self.tenant = ""
        elif not self.authorized(""):
            return
        if self.path == "/health":
            self.discard_body()
            self.send_json(200, self.app.health(self.tenant, self.balancer_check()))
        elif self.path == "/metrics":
            self.discard_body()
            if not self.app.may_read_metrics(operator):
                return self.refuse(Outcome(403, "unauthorized", "/metrics shows every tenant's requests: it is read "
                                           "with the operator's token (--metrics-token-file), not a tenant's"), "")
            self.send_metrics(self.app.metrics_text().encode())
        else:
            self.route_error()

    def balancer_check(self) -> bool:
        """Whether the generated HAProxy configuration's health check asks (it holds a drain's 503s: server.md §8):
        believed with the proxy's secret, or from anyone on a node given none (as before the secret existed)."""
        return BALANCER_CHECK_HEADER in self.headers and (
            self.app.credentials.proxy_secret is None or self.app.from_proxy(self.headers.get(PROXY_HEADER)))

    def proxy_wait_ms(self) -> float:
        """The wait in HAProxy's queue its X-Request-Start says, believed only from the proxy (its secret):
        a client's own stamp would forge queue time, and the queue-backlog alert with it."""
        trusted = self.app.from_proxy(self.headers.get(PROXY_HEADER))
        return proxy_queue_ms(self.headers.get("X-Request-Start") if trusted else None, self.head_arrived)

    def do_POST(self) -> None:
        request_id = self.request_id()
        self.client_request_id = self.canonical_uuid(CLIENT_REQUEST_ID_HEADER)
        if not self.authorized(request_id):
            return
        if self.path != "/execute":
            return self.route_error()
        started, self.request_bytes = time.monotonic(), 0
        self.stream = OutputStream(self, request_id) if self.wants_stream() else None
        self.answered = threading.Event()  # Job.answered
        with self.app.request_in_flight():  # a graceful shutdown waits until the answer is out
            try:
                outcome = self.outcome_of_post(request_id)
            except ClientGone as gone:
                self.answered.set()
                return self.cancelled(request_id, gone.where, started)
            outcome, size, lost = self.send_outcome(request_id, outcome)
            answered_at = time.monotonic()  # before the worker's disposal, which `answered` wakes, takes the CPU
            self.answered.set()
        fields = {"client_request_id": self.client_request_id,
                  "request_bytes": self.request_bytes, "tenant": self.tenant or None,
                  **request_fields(request_id, outcome, started, answered_at)}
        if size is None:
            self.disconnected("response", error=lost, **fields)
        else:
            self.app.log.event("request_finished", response_bytes=size, **fields)

    def client_gone(self) -> bool:
        """Whether the client has left: its FIN (a close, or a half-close: HAProxy reads that as
        gone too) or a reset, even with bytes still unread before it.  Bytes alone on a live
        connection are a pipelined next request, not a goodbye; nothing is read here."""
        poller = select.poll()
        poller.register(self.connection, select.POLLRDHUP)  # POLLHUP and POLLERR are always reported
        return bool(poller.poll(0))

    def cancelled(self, request_id: str, where: str, started: float) -> None:
        """The one log line for a request stopped because its client left `where` (the event's `phase`);
        nothing is answered."""
        self.close_connection = True
        if self.stream is not None:  # its sender thread ends with the frames it has
            self.stream.end_output()
        self.app.log.event("request_cancelled", "WARNING", request_id=request_id,
                           client_request_id=self.client_request_id, tenant=self.tenant or None,
                           phase=where, peer=self.client_address[0], request_bytes=self.request_bytes,
                           total_ms=(time.monotonic() - started) * 1e3)

    def wants_stream(self) -> bool:
        """docs/protocol.md §13: exactly one `X-KCoral-Stream: output` on an HTTP/1.1 request (chunked needs 1.1)."""
        return self.headers.get_all(STREAM_HEADER) == ["output"] and self.request_version >= "HTTP/1.1"

    def request_id(self) -> str:
        """docs/protocol.md §4.2: the client's X-Request-ID if it is exactly one canonical UUID."""
        return self.canonical_uuid("X-Request-ID") or str(uuid.uuid4())

    def canonical_uuid(self, header: str) -> str | None:
        """The header's value if the request has exactly one and it is a UUID in canonical form
        (so nothing else, however long or strange, reaches the log); None otherwise."""
        values = self.headers.get_all(header) or []
        if len(values) == 1:
            try:
                if str(uuid.UUID(values[0])) == values[0]:
                    return values[0]
            except ValueError:
                pass
        return None

    def authorized(self, request_id: str) -> bool:
        tenant = self.app.tenant_of(self.headers.get("Authorization", ""))
        if tenant is not None:
            self.tenant = tenant
            return True
        self.discard_body()
        self.refuse(Outcome(401, "unauthorized", "missing or invalid bearer token"), request_id,
                    {"WWW-Authenticate": "Bearer"})
        return False

    def outcome_of_post(self, request_id: str) -> Outcome:
        """Read the body and execute it -> Outcome; a body that could not be read is answered here."""
        try:
            return self.read_and_execute(request_id)
        except ValidationError as exc:  # refused while reading the body (chunked framing, 100-continue)
            return Outcome(400, "parse", str(exc))
        except BodyCut as cut:
            self.close_connection = True
            return self.cut_outcome(cut.reason)
        except ClientGone:
            raise  # do_POST logs it; nobody is answered
        except (ConnectionError, TimeoutError):  # body cut short; a half-closed client can still read this
            self.close_connection = True
            return Outcome(400, "parse", "request body ended before Content-Length bytes arrived")
        except Exception as exc:  # never let a bug take the connection down silently
            self.app.log.event("server_error", "ERROR", request_id=request_id, error=repr(exc))
            return Outcome(500, "engine", "internal server error")

    def read_and_execute(self, request_id: str) -> Outcome:
        """Read the body (admitted against the senders' caps and the in-flight budget first) and
        hand it to the app."""
        config = self.app.config
        limit = config.max_request_bytes
        chunked = "Transfer-Encoding" in self.headers  # framing_problem let only exactly `chunked` through
        size = declared_length(self.headers.get("Content-Length", "0"))
        assert size is not None  # parse_request (framing_problem) refused any other Content-Length
        if size > limit:
            self.close_connection = True  # the body stays unread
            return Outcome(413, "request_too_large", request_too_large_message(size, limit))
        reservation = BodyReservation(self.app.bodies, limit if chunked else size, config.body_admission_wait_seconds)
        try:
            body = self.read_admitted_body(size if not chunked else None, reservation)
            if isinstance(body, Outcome):
                return body
            self.request_bytes = len(body)
            return self.app.handle_execute(request_id, body, self.headers.get("Content-Type"),
                                           self.proxy_wait_ms(),
                                           self.stream.feed if self.stream else None,
                                           tenant=self.tenant, client_gone=self.client_gone,
                                           answered=self.answered)
        finally:
            reservation.release()

    def read_admitted_body(self, size: int | None, reservation: BodyReservation) -> bytearray | Outcome:
        """The body of `size` bytes (None: chunked), once this connection may send one (BodySenders)
        and the budget has room for its first bytes -> the body, or the refusal."""
        if self.expects_continue:
            keep_open, self.close_connection = not self.close_connection, True  # a refusal leaves the body unsent
            request_boundary(self.headers.get("Content-Type"))
        with self.server.senders.admit(self.tenant, self.client_address[0]) as refusal:
            if refusal is not None or not reservation.grow():
                self.close_connection = True
                return refusal or (self.app.refuse_while_draining() if self.app.closing
                                   else Outcome(503, "busy", "server saturated"))
            if self.expects_continue:
                self.send_response_only(100)
                self.end_headers()
                self.close_connection = not keep_open
            body = (self.read_chunked(self.app.config.max_request_bytes, reservation) if size is None
                    else self.read_body(size, reservation))
        self.body_done = body is not None
        if body is None:  # chunked, past the limit: its whole size is unknown
            return Outcome(413, "request_too_large", request_too_large_message(None, self.app.config.max_request_bytes))
        return body

    def read_body(self, size: int, reservation: BodyReservation | None = None) -> bytearray:
        """Read `size` body bytes under the guard's rate rule (and the body budget) -> a new buffer."""
        body = bytearray()  # plain pages, as kcoral_worker.recv_raw says why
        self.watch("body")
        try:
            self.read_into(body, size, reservation)
        finally:
            self.unwatch()
        return body

    def read_into(self, body: bytearray, size: int, reservation: BodyReservation | None) -> None:
        """Append `size` bytes to `body`, one socket read at a time (the guard sees the progress).
        The buffer grows by at most one read ahead of the bytes received, and within the body's
        reservation: what a client declares costs nothing until it arrives."""
        filled, end = len(body), len(body) + size
        while filled < end:
            if filled == len(body):
                room = end - filled if reservation is None else min(end - filled, self.budget_room(reservation))
                body += ZEROS[:min(room, len(ZEROS))]  # realloc grows large buffers in place (mremap)
            with memoryview(body)[filled:] as view:  # released before the next growth
                n = self.rfile.readinto1(view)
            if not n:
                if self.cut_reason:
                    raise BodyCut(self.cut_reason)
                raise ConnectionError("client closed the connection mid-body")
            filled += n
            self.phase.received += n
            if reservation is not None:
                reservation.received += n

    def budget_room(self, reservation: BodyReservation) -> int:
        """Bytes the body may read now; waits for the budget to grow its reservation first, unwatched
        meanwhile (the body is not slow: the server is)."""
        if reservation.room() > 0:
            return reservation.room()
        self.unwatch()
        grown = reservation.grow()
        self.watch("body")
        if not grown:
            raise BodyCut("shutdown" if self.app.closing else "budget")
        return reservation.room()

    def read_chunked(self, limit: int, reservation: BodyReservation) -> bytearray | None:
        self.watch("body")
        try:
            return self.read_chunks(limit, reservation)
        finally:
            self.unwatch()

    def read_chunks(self, limit: int, reservation: BodyReservation) -> bytearray | None:
        body = bytearray()
        while True:
            line = self.rfile.readline(1024).split(b";")[0].strip()
            if self.cut_reason:
                raise BodyCut(self.cut_reason)
            if not re.fullmatch(rb"[0-9A-Fa-f]+", line):  # int() would also take "-5", "+5", "0x5"
                self.close_connection = True
                raise ValidationError("malformed chunked request body")
            size = int(line, 16)
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass
                return body
            if len(body) + size > limit:
                self.close_connection = True
                return None
            self.read_into(body, size, reservation)
            self.rfile.readline(1024)

    def cut_outcome(self, reason: str) -> Outcome:
        if reason == "body_rate":
            config = self.app.config
            self.disconnected("body", reason=reason)
            return Outcome(408, "parse", f"request body slower than {config.body_rate_min_bytes} bytes per "
                                         f"{config.body_rate_window_seconds:g} s")
        if reason == "body_average":
            self.disconnected("body", reason=reason)
            return Outcome(408, "parse", f"request body averaged less than "
                                         f"{self.app.config.body_min_average_bytes_per_second} bytes per second "
                                         "(--body-min-average-bytes-per-second)")
        if reason == "budget":  # read halfway, no room for the rest within the admission wait
            return Outcome(503, "busy", "server saturated")
        return self.app.refuse_while_draining()

    def send_outcome(self, request_id: str, outcome: Outcome) -> tuple[Outcome, int | None, str | None]:
        """-> (the outcome sent, bytes sent, None), or (outcome, None, why) when the client
        stopped reading or went away."""
        try:
            return outcome, self.respond(request_id, outcome), None
        except OSError as exc:  # the send timeout, or a reset
            self.close_connection = True
            return outcome, None, type(exc).__name__
        except Exception as exc:  # e.g. a result that cannot be encoded: nothing was written yet
            self.app.log.event("server_error", "ERROR", request_id=request_id, error=repr(exc))
            failure = Outcome(500, "engine", "internal server error")
            return failure, self.respond(request_id, failure), None

    def respond(self, request_id: str, outcome: Outcome) -> int:
        """Send an Outcome; -> bytes sent."""
        if self.stream is not None and self.stream.end_output():  # output went out: the answer is its last frame
            return self.stream.finish(*self.answer_pieces(request_id, outcome))
        status, content_type, pieces = self.answer_pieces(request_id, outcome)
        total = sum(len(p) for p in pieces)
        self.send_response(status)
        self.send_common_headers(content_type, total, {"X-Request-ID": request_id,
                                                       **({"Retry-After": "1"} if status in (429, 503) else {})})
        self.send_pieces(pieces)
        return total

    def answer_pieces(self, request_id: str, outcome: Outcome) -> tuple[int, str, list[Buffer]]:
        """What an answer sends, as (status, content type, body pieces): the results (JSON, or
        multipart with their parts) within --max-response-bytes, else the ERROR body."""
        if outcome.http_status == 200:
            pieces: list[Buffer]
            if outcome.parts:
                content_type, pieces = multipart_result(outcome.body, outcome.parts)
            else:
                content_type, pieces = "application/json", json_pieces(outcome.body)
            if sum(len(p) for p in pieces) <= self.app.config.max_response_bytes:
                return 200, content_type, pieces
            outcome = Outcome(500, "response_too_large", "results exceed the configured response-size limit")
        body = error_body(request_id, outcome.kind, outcome.message, outcome)
        return outcome.http_status, "application/json", [json_bytes(body)]

    def send_all(self, data: Buffer) -> None:
        """Write in slices, each under the send timeout: a client that stops reading is dropped."""
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, SEND_SLICE):
            self.wfile.write(view[start:start + SEND_SLICE])

    def send_pieces(self, pieces: list[Buffer]) -> None:
        """Send the pieces with sendmsg, many per call: a folder's ~1500 pieces (part header, data,
        CRLF per file) take a few system calls instead of one write each.  The socket is
        non-blocking under its timeout, so each call sends what fits and waits at most the send
        timeout for room: a client that stops reading is dropped, as with send_all."""
        kcoral_worker.write_batches(self.connection.sendmsg, pieces)

    def send_json(self, status: int, body: Json, headers: ExtraHeaders = ()) -> int:
        encoded = json_bytes(body)
        self.send_response(status)
        self.send_common_headers("application/json", len(encoded), dict(headers))
        self.send_all(encoded)
        return len(encoded)

    def send_error_body(self, status: int, request_id: str, kind: str, message: str,
                        headers: ExtraHeaders = (), outcome: Outcome | None = None) -> int:
        body = error_body(request_id, kind, message, outcome)
        return self.send_json(status, body, {"X-Request-ID": request_id, **dict(headers)})

    def send_metrics(self, text: bytes) -> None:
        self.send_response(200)
        self.send_common_headers("text/plain; version=0.0.4; charset=utf-8", len(text), {})
        self.send_all(text)

    def send_common_headers(self, content_type: str, length: int, headers: Mapping[str, str]) -> None:
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.send_header("X-KCoral-Instance", self.app.instance_id)
        self.send_client_request_id()
        for name, value in headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()

    def send_client_request_id(self) -> None:
        """Every answer to a POST names the client's id (docs/operations.md, "Trace a failed request")."""
        if self.client_request_id:
            self.send_header(CLIENT_REQUEST_ID_HEADER, self.client_request_id)

    def route_error(self) -> None:
        self.discard_body()
        if self.path in ("/health", "/metrics", "/execute"):
            allow = "POST" if self.path == "/execute" else "GET"
            self.send_json(405, {"detail": "Method Not Allowed"}, {"Allow": allow})
        else:
            self.send_json(404, {"detail": "Not Found"})

    def discard_body(self) -> None:
        """Skip a small unread body so the connection stays usable; close it otherwise (also when
        the client awaits `100 Continue`: it has sent nothing and needs no body read)."""
        if self.body_done:
            return
        size = declared_length(self.headers.get("Content-Length", "0"))
        assert size is not None  # a body is pending only once parse_request (framing_problem) accepted the head
        if self.headers.get("Transfer-Encoding") or self.expects_continue or size > DRAIN_LIMIT:
            self.close_connection = True  # finish() lingers
            return
        try:
            self.read_body(size)
            self.body_done = True
        except (OSError, BodyCut):
            self.close_connection = True

    def refuse(self, outcome: Outcome, request_id: str, headers: ExtraHeaders = ()) -> None:
        """Answer a request refused before it ran (its head, its token) -> one request_refused event."""
        size = None
        try:
            size = self.send_error_body(outcome.http_status, request_id, outcome.kind, outcome.message, headers)
        finally:  # also when the client is gone (OSError): the refusal is logged either way
            self.app.log.event("request_refused", "WARNING", peer=self.client_address[0], response_bytes=size,
                               **request_fields(request_id, outcome, self.head_started, time.monotonic()))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """What http.server rejects itself (bad request line, oversized headers) gets the
        ERROR JSON body (docs/protocol.md §9.8) rather than an HTML page.  (An unknown method never gets
        here: handle_one_request routes it to 404/405.)"""
        self.close_connection = True
        short = self.responses.get(code, ("error",))[0]
        self.refuse(Outcome(code, "parse" if code < 500 else "engine", message or short), str(uuid.uuid4()))

    def disconnected(self, phase: str, **fields: Any) -> None:
        """The one log line for a client that went away (or was cut off)."""
        self.app.log.event("client_disconnected", "WARNING", peer=self.client_address[0], phase=phase, **fields)

    def finish(self) -> None:
        self.unwatch()  # whatever ended the connection, the guard forgets it
        super().finish()
        if self.close_connection and self.body_left_unread() and not self.cut_reason:
            self.linger()

    def body_left_unread(self) -> bool:
        if self.body_done:
            return False
        return "Transfer-Encoding" in self.headers or declared_length(self.headers.get("Content-Length", "0")) != 0

    def linger(self) -> None:
        """Stop sending, then read and drop what the client still sends until it closes, for at
        most --lingering-close-seconds (a time bound alone: dropped bytes cost no memory).  A
        client sends its whole body before it reads the answer; closing with bytes of it unread
        makes the kernel answer them with a reset, which breaks the client's send and can
        destroy the refusal before it is read."""
        deadline = time.monotonic() + self.app.config.lingering_close_seconds
        sink = bytearray(1 << 16)
        try:
            self.connection.shutdown(socket.SHUT_WR)
            while (wait := deadline - time.monotonic()) > 0:
                self.connection.settimeout(wait)
                if not self.connection.recv_into(sink):
                    return
        except OSError:  # reset, or the time is up
            pass

    def log_message(self, format: str, *args: Any) -> None:  # one structured line per request instead
        pass

    @property
    def app(self) -> KCoralServer:
        return self.server.app


class OutputStream:
    """Our extension (docs/protocol.md §13): the answer to a request with `X-KCoral-Stream: output`,
    once the program has printed something, is a chunked body of frames: each output chunk as the
    OutputReader reads it, then the answer itself (its status, content type and body) as the last frame.
    A program that prints nothing gets the plain answer.

    The reader thread calls `feed`, which only queues: a client slow to read must not stall it,
    or the worker would block on its pipe and the captured output would lose its tail.  A sender
    thread, started with the first output, writes the frames; the handler thread then ends the output
    (waits for the queue to empty) and `finish`es with the answer."""

    def __init__(self, handler: RequestHandler, request_id: str) -> None:
        self.handler = handler
        self.request_id = request_id
        self.frames: queue.SimpleQueue[tuple[str, bytes] | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.open = True
        self.sender: threading.Thread | None = None
        self.sent = 0  # bytes of body written
        self.failure: OSError | None = None  # the client stopped reading or went away

    def feed(self, stream: str, data: bytes) -> None:
        with self.lock:
            if not self.open:  # the answer is being sent: later output (an escaped process's) is dropped
                return
            if self.sender is None:
                self.sender = threading.Thread(target=self.send_frames, name="kcoral-stream-sender", daemon=True)
                self.sender.start()
            self.frames.put((stream, data))

    def send_frames(self) -> None:
        self.write_head()
        while (frame := self.frames.get()) is not None:
            self.write_frame(frame[0].encode(), [frame[1]])

    def end_output(self) -> bool:
        """No more output frames; -> whether the stream began (then `finish` must end it)."""
        with self.lock:
            self.open = False
            sender = self.sender
        if sender is None:
            return False
        self.frames.put(None)
        sender.join()
        return True

    def finish(self, status: int, content_type: str, pieces: list[Buffer]) -> int:
        """The last frame, `result <length> <status> <content type>`, and the body's end -> bytes sent."""
        self.write_frame(b"result", pieces, f" {status} {content_type}".encode())
        self.write(b"0\r\n\r\n")
        if self.failure is not None:
            raise self.failure
        return self.sent

    def write_head(self) -> None:
        handler = self.handler
        try:
            handler.send_response(200)
            for name, value in (("Content-Type", STREAM_MEDIA_TYPE), ("Transfer-Encoding", "chunked"),
                                (STREAM_HEADER, "output"), ("X-KCoral-Instance", handler.app.instance_id),
                                ("X-Request-ID", self.request_id)):
                handler.send_header(name, value)
            handler.send_client_request_id()
            if handler.close_connection:
                handler.send_header("Connection", "close")
            handler.end_headers()
        except OSError as exc:
            self.failure = exc

    def write_frame(self, name: bytes, pieces: list[Buffer], rest: bytes = b"") -> None:
        """One frame, `<name> <length><rest>` LF payload, as one HTTP chunk."""
        length = sum(memoryview(p).nbytes for p in pieces)
        head = name + b" %d" % length + rest + b"\n"
        self.write(b"%x\r\n" % (len(head) + length) + head)
        for piece in pieces:
            self.write(piece)
        self.write(b"\r\n")

    def write(self, data: Buffer) -> None:
        if self.failure is not None:
            return
        try:
            self.handler.send_all(data)
            self.sent += memoryview(data).nbytes
        except OSError as exc:  # the send timeout or a reset: the program runs on, its answer is lost
            self.failure = exc


def framing_problem(headers: email.message.Message) -> str | None:
    """RFC 9112 §6 checks http.server leaves out: a request whose length two parsers (a proxy
    in front, and us) could read differently is refused, so no request hides in another's body."""
    for name, value in headers.items():
        if CONTROL_CHARS.search(value):
            return f"control character in the {name} header"
    lengths = headers.get_all("Content-Length") or []
    if len(lengths) > 1:  # even equal ones (RFC 9110 §8.6 allows refusing them): one rule, one reading
        return "conflicting Content-Length headers"
    if lengths and declared_length(lengths[0]) is None:  # `5, 5`, `+5`, `0x5`, `5 5`: one run of digits only
        return "invalid Content-Length header"
    encodings = headers.get_all("Transfer-Encoding") or []
    if encodings and lengths:
        return "Transfer-Encoding together with Content-Length"
    if encodings and [e.strip().lower() for e in encodings] != ["chunked"]:
        return "unsupported Transfer-Encoding (only chunked is accepted)"
    return None


def declared_length(value: str) -> int | None:
    """A Content-Length value -> int, or None unless it is ASCII digits (between optional spaces
    and tabs, which RFC 9110 §5.5 does not count as part of a field value).

    str.isdigit() also accepts "²", and int() refuses strings of more than
    4300 digits, so huge values are capped instead of converted.
    """
    value = value.strip(" \t")
    if not value.isascii() or not value.isdigit():
        return None
    digits = value.lstrip("0") or "0"
    return int(digits) if len(digits) <= 30 else 1 << 100


PROXY_STAMP = re.compile(r"t=(\d{1,19})")


def proxy_queue_ms(stamp: str | None, arrived: float) -> float:
    """How long a request waited in the proxy in front of us, in ms: the HAProxy config that
    haproxy-config writes stamps `X-Request-Start: t=<microseconds since the epoch>` once it has
    read the request head.  0 without a stamp, or with one from the future or over an hour old
    (unsynchronised clocks, or not a proxy's stamp at all)."""
    match = PROXY_STAMP.fullmatch(stamp or "")
    if match is None:
        return 0.0
    waited = arrived * 1e3 - int(match[1]) / 1e3
    return waited if 0 <= waited <= 3.6e6 else 0.0


def request_fields(request_id: str, outcome: Outcome, started: float, ended: float) -> dict[str, Any]:
    """What every request event says about a request (request_finished, request_refused, a disconnect);
    its total_ms runs from `started` to `ended`, when its answer was sent (or given up on)."""
    body = outcome.body or {}
    return {"request_id": request_id, "http_status": outcome.http_status, "status": body.get("status", "ERROR"),
            "error_kind": (body.get("error") or {}).get("kind") or outcome.kind or None,
            "worker_id": outcome.worker_id or None, "queue_ms": body.get("queue_ms"),
            "lease_wait_ms": body.get("lease_wait_ms"), "lease_held_ms": body.get("lease_held_ms"),
            "elapsed_ms": body.get("elapsed_ms"), "total_ms": (ended - started) * 1e3}


def multipart_result(body: Json, parts: list[Buffer]) -> tuple[str, list[Buffer]]:
    """docs/protocol.md §9.2: a result with binary parts -> (Content-Type, the response body as pieces to send)."""
    boundary = "kcoral-" + secrets.token_hex(16)  # 128 random bits: no payload can contain it by chance
    pieces: list[Buffer] = [b"--" + boundary.encode() + b'\r\nContent-Disposition: form-data; name="result"\r\n'
                            b"Content-Type: application/json\r\n\r\n", *json_pieces(body), b"\r\n"]
    for number, part in enumerate(parts):
        pieces.append(f'--{boundary}\r\nContent-Disposition: form-data; name="return:{number}"\r\n'
                      f"Content-Type: application/octet-stream\r\n\r\n".encode())
        pieces.append(part)
        pieces.append(b"\r\n")
    pieces.append(f"--{boundary}--\r\n".encode())
    return f"multipart/form-data; boundary={boundary}", pieces


def error_body(request_id: str, kind: str, message: str, outcome: Outcome | None = None) -> dict[str, Json]:
    """docs/protocol.md §9.8's ERROR body, with an outcome's extra fields (a 504's), which a 0.1.1 client ignores."""
    extra = outcome or Outcome()
    return {"status": "ERROR", "request_id": request_id, **extra.body_fields,
            "error": {"kind": kind, "message": message, **extra.error_fields}}


def json_bytes(value: Json) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (e.g. from a "\ud800" escape) has no UTF-8 form
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("ascii")


LONG_TEXT_CHARS = 64 << 10  # json_pieces escapes a top-level string this long by itself
SHORT_ESCAPES = {8: b"\\b", 9: b"\\t", 10: b"\\n", 12: b"\\f", 13: b"\\r"}
JSON_ESCAPES = [(b"\\", b"\\\\"), (b'"', b'\\"'),  # the backslashes first, as json escapes them
                *((bytes([c]), SHORT_ESCAPES.get(c, b"\\u%04x" % c)) for c in range(32))]
NEEDS_NO_ESCAPE = bytes(b for b in range(256) if bytes([b]) not in dict(JSON_ESCAPES))


def json_pieces(body: Json) -> list[Buffer]:
    """json_bytes(body), byte for byte, as pieces to send: its long top-level strings (a program's
    captured output) escaped by bytes.replace, a scan per character that needs escaping (a
    memchr each, mostly finding none), where the json module's encoder builds a new string
    character by character and encodes it again: 4 MiB of printed lines 16 → 5 ms.  Each
    string's place in the rest's JSON is held by a random mark no other value can contain."""
    texts = {key: value for key, value in (body.items() if isinstance(body, dict) else ())
             if isinstance(value, str) and len(value) >= LONG_TEXT_CHARS}
    if not texts:
        return [json_bytes(body)]
    marks = {key: f'"kcoral-{secrets.token_hex(16)}"' for key in texts}
    try:
        encoded = {key: value.encode("utf-8") for key, value in texts.items()}
        marked = {**typing.cast(dict, body), **{key: mark[1:-1] for key, mark in marks.items()}}
        rest = json.dumps(marked, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:  # json_bytes escapes everything then
        return [json_bytes(body)]
    pieces: list[Buffer] = []
    for key in sorted(texts, key=lambda key: rest.index(marks[key].encode())):
        before, _, rest = rest.partition(marks[key].encode())
        pieces += [before, b'"', json_escaped(encoded[key]), b'"']
    return [*pieces, rest]


def json_escaped(text: bytes) -> bytes:
    """UTF-8 text escaped as the json module escapes a string's characters (ensure_ascii=False).
    One pass finds which of the 34 characters occur (what deleting all others leaves), so only
    those get a replace: 34 scans of 4 MiB took 5.3 ms, the pass 1.9."""
    present = set(text.translate(None, NEEDS_NO_ESCAPE))
    for char, escape in JSON_ESCAPES:
        if char[0] in present:
            text = text.replace(char, escape)
    return text


@dataclasses.dataclass
class Phase:
    """Where a connection is in its request: "idle" (keep-alive, waiting for a request),
    "header" (request line and headers) or "body"; `received` counts body bytes."""
    name: str
    since: float
    received: int = 0
    window_start: float = 0.0
    window_bytes: int = 0


class ConnectionGuard:
    """Deadlines that no socket timeout can express: a socket timeout bounds one read, so a
    header or body trickling in a byte at a time never trips it.  One thread checks every
    watched connection a few times a second and cuts the read side of those past their
    deadline; the handler's read then ends and it answers 408 (or just closes)."""

    TICK = 0.25

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.watched: dict[RequestHandler, Phase] = {}
        self.closed_phases: dict[str, str] = {}  # phase name -> why any connection entering it is cut
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="kcoral-connection-guard", daemon=True)
        self.thread.start()

    def enter(self, handler: RequestHandler, name: str) -> Phase:
        now = time.monotonic()
        phase = Phase(name, now, window_start=now)
        with self.lock:
            self.watched[handler] = phase
            reason = self.closed_phases.get(name)
        if reason is not None:  # a body that reaches its read after shutdown began is cut as those before it were
            self.cut(handler, reason, phase)
        return phase

    def leave(self, handler: RequestHandler) -> None:
        with self.lock:
            self.watched.pop(handler, None)

    def run(self) -> None:
        while not self.stopped.wait(self.TICK):
            now = time.monotonic()
            with self.lock:
                expired = [(h, phase, reason) for h, phase in self.watched.items()
                           if (reason := self.expired(phase, now)) is not None]
            for handler, phase, reason in expired:
                self.cut(handler, reason, phase)

    def expired(self, phase: Phase, now: float) -> str | None:
        config = self.config
        if phase.name == "idle":
            return "idle" if now - phase.since >= config.keepalive_timeout_seconds else None
        if phase.name == "header":
            return "header_timeout" if now - phase.since >= config.header_timeout_seconds else None
        if now - phase.window_start < config.body_rate_window_seconds:
            return None
        if phase.received - phase.window_bytes < config.body_rate_min_bytes:
            return "body_rate"
        if phase.received < config.body_min_average_bytes_per_second * (now - phase.since):
            return "body_average"
        phase.window_start, phase.window_bytes = now, phase.received  # the next window
        return None

    def cut(self, handler: RequestHandler, reason: str, phase: Phase | None = None) -> None:
        """Cut the read side of `handler`'s connection if it is still in `phase` (any phase: None)."""
        with self.lock:
            current = self.watched.get(handler)
            if current is None or (phase is not None and current is not phase):
                return  # it moved on meanwhile
            del self.watched[handler]
        handler.cut_reason = reason
        try:
            handler.connection.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def cut_idle(self, idle_for: float) -> int:
        """Close keep-alive connections idle for `idle_for` seconds or more -> how many."""
        now = time.monotonic()
        with self.lock:
            idle = [(h, phase) for h, phase in self.watched.items()
                    if phase.name == "idle" and now - phase.since >= idle_for]
        for handler, phase in idle:
            self.cut(handler, "idle", phase)
        return len(idle)

    def cut_phase(self, name: str, reason: str) -> None:
        """Cut every connection in phase `name`, now and from now on (shutdown: the bodies still arriving)."""
        with self.lock:
            self.closed_phases[name] = reason
            found = [(h, phase) for h, phase in self.watched.items() if phase.name == name]
        for handler, phase in found:
            self.cut(handler, reason, phase)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()  # within a TICK: stop leaves no thread behind


class BodyBudget:
    """Admission of request bodies against a global in-memory budget, first come first served, so
    memory stays bounded however many clients upload at once.  Bodies reserve it as their bytes
    arrive, a step ahead (BodyReservation), not their declared size: a client trickling a body it
    declared huge holds a step, not the budget.  When the budget is full, the first body waiting
    may take all it still declared beyond it, provided no body does already: bodies read halfway
    then never wait on each other for ever, and memory stays below the budget plus one body."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self.queue: collections.deque[object] = collections.deque()
        self.closed = False
        self.cond = threading.Condition()

    def reserve(self, held: int, wanted: int, declared: int, timeout: float) -> int | None:
        """Grow a reservation of `held` bytes to `wanted` (or to `declared`, beyond the budget) -> the
        new reservation, or None after `timeout` s or on shutdown."""
        ticket = object()

        def turn() -> int | None:
            if self.queue[0] is not ticket:
                return None
            if self.in_use + wanted - held <= self.capacity:
                grown = wanted
            elif self.in_use <= self.capacity:  # no body is beyond the budget: this one may be
                grown = declared
            else:
                return None
            self.in_use += grown - held
            return grown

        with self.cond:
            self.queue.append(ticket)
            return wait_turn(self.cond, self.queue, ticket, turn, time.monotonic() + timeout, lambda: self.closed)

    def release(self, size: int) -> None:
        with self.cond:
            self.in_use -= size
            self.cond.notify_all()

    def refuse_waiters(self) -> None:
        """Admit no more bodies; those waiting for room are refused."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class BodyReservation:
    """One body's share of the BodyBudget: `held` bytes, kept a STEP ahead of the `received` ones."""

    STEP = 256 << 10  # small, so that a thousand connections each trickling a byte hold little

    def __init__(self, budget: BodyBudget, declared: int, timeout: float) -> None:
        self.budget, self.declared, self.timeout = budget, declared, timeout
        self.held = self.received = 0

    def room(self) -> int:
        return self.held - self.received

    def grow(self) -> bool:
        """Room for the next bytes -> False after the admission wait, or on shutdown."""
        wanted = min(self.declared, self.received + self.STEP)
        held = self.budget.reserve(self.held, max(wanted, self.held), self.declared, self.timeout)
        if held is None:
            return False
        self.held = held
        return True

    def release(self) -> None:
        self.budget.release(self.held)
        self.held = 0


class BodyCut(Exception):
    """The connection guard cut a request body (too slow, or the server is stopping)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BodySenders:
    """Connections sending a request body, counted per named tenant and per client address, so
    that one tenant's (or one address's) slow bodies cannot hold every connection; and never
    more than --max-connections less --reserved-connections, so /health and /metrics are
    answered while every body slot is taken.  (The anonymous tenant is everyone without a name:
    its clients are held apart by address only.)"""

    def __init__(self, config: ServerConfig, max_connections: int) -> None:
        quarter = max(1, max_connections // 4)
        reserved = config.reserved_connections or max(2, max_connections // 8)
        self.total = max(1, max_connections - reserved)
        self.per_tenant = config.max_bodies_per_tenant or quarter
        self.per_address = config.max_bodies_per_address or quarter
        self.tenants: collections.Counter[str] = collections.Counter()
        self.addresses: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def admit(self, tenant: str, address: str) -> Iterator[Outcome | None]:
        """While the body arrives: None when admitted, else the refusal to answer (429/503 busy)."""
        with self.lock:
            refusal = self.refusal(tenant, address)
            if refusal is None:
                self.tenants[tenant] += 1
                self.addresses[address] += 1
        try:
            yield refusal
        finally:
            if refusal is None:
                with self.lock:  # no zero counts kept: a count per address ever seen would grow for ever
                    self.tenants -= collections.Counter({tenant: 1})
                    self.addresses -= collections.Counter({address: 1})

    def refusal(self, tenant: str, address: str) -> Outcome | None:
        if tenant and self.tenants[tenant] >= self.per_tenant:
            return Outcome(429, "busy", f"tenant {tenant} is sending {self.per_tenant} request bodies already, "
                                        "its limit (--max-bodies-per-tenant); retry once one has arrived")
        if self.addresses[address] >= self.per_address:
            return Outcome(429, "busy", f"{address} is sending {self.per_address} request bodies already, the "
                                        "limit per client address (--max-bodies-per-address)")
        if self.addresses.total() >= self.total:
            return Outcome(503, "busy", f"{self.total} request bodies are arriving already; the other connections "
                                        "are kept for /health and /metrics (--reserved-connections)")
        return None


def default_max_connections() -> int:
    """A quarter of the fd limit (a connection in a request may hold a few more fds: the staged
    blobs' memfd, pipes, cache files), so fds run out after connections do."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(8, min(1024, (soft - 64) // 4))


ACCEPT_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


# --- 2. the application: a Job, its Outcome, KCoralServer.handle_execute, the lifecycle -----------

@dataclasses.dataclass
class Job:
    request_id: str
    program: ValidProgram
    blobs: Blobs
    timeout: float
    output_limit: int
    proxy_queue_ms: float = 0.0  # waited in HAProxy before reaching us: part of the queue_ms answered
    on_output: Callable[[str, bytes], None] | None = None  # ("stdout"|"stderr", bytes kept) as captured
    tenant: str = ""  # the name its token has in --token-file ("": anonymous)
    client_gone: Callable[[], bool] | None = None  # whether its client closed the connection (ClientGone)
    # set once its answer is written (or will not be): what waits for the answer to have the CPU to itself
    answered: threading.Event = dataclasses.field(default_factory=threading.Event)
    # hash -> the blob in a SealedBlob of its own, once staging made one: the cache keeps it (run_program)
    sealed: dict[str, memoryview] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Outcome:
    http_status: int = 200
    kind: str = ""                 # error kind of a non-200 answer
    message: str = ""
    body: dict[str, Json] | None = None  # COMPLETED/FAILED JSON
    parts: list[Buffer] = dataclasses.field(default_factory=list)
    worker_id: str = ""
    # a 504's extra fields (docs/protocol.md §9.8): the instruction running, inside "error"; the output, beside it
    error_fields: dict[str, Json] = dataclasses.field(default_factory=dict)
    body_fields: dict[str, Json] = dataclasses.field(default_factory=dict)


BEARER_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")  # RFC 6750 b64token: never a comma or white space
TOKEN_FILE_LIMIT = 64 << 10


def split_tokens(text: str, source: str) -> list[str]:
    """Bearer tokens separated by commas or white space (one a line in a file) -> the list.
    ValueError names `source` and the token's position, never the token."""
    tokens = text.replace(",", " ").split()
    if not tokens:
        raise ValueError(f"{source} holds no token")
    for number, token in enumerate(tokens, 1):
        if not BEARER_TOKEN.fullmatch(token):
            raise ValueError(f"{source}: token {number} is not a bearer token "
                             "(letters, digits and -._~+/, then optional '=')")
    return tokens


def read_private_file(path: str, flag: str) -> str:
    """A secret's file: a regular file of at most 64 KiB that only its owner may access (a secret that
    group or others can read, or add to, is none); ValueError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not hang the start
        with open(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{flag} {path} is not a regular file")
            if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ValueError(f"{flag} {path} is accessible to group or others (mode "
                                 f"{stat.S_IMODE(info.st_mode):o}); chmod 600 it")
            data = f.read(TOKEN_FILE_LIMIT + 1)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None
    if len(data) > TOKEN_FILE_LIMIT:
        raise ValueError(f"{flag} {path} is larger than {TOKEN_FILE_LIMIT} bytes")
    return data.decode("ascii", "replace")


def read_token_file(path: str, flag: str = "--token-file") -> dict[str, str]:
    """The tokens of a token file, each with its tenant's name ("": anonymous)."""
    return token_file_tenants(read_private_file(path, flag), f"{flag} {path}")


def read_proxy_secret(path: str, flag: str = "--proxy-secret-file") -> str:
    """The one token of a --proxy-secret-file: what the proxy, and only the proxy, sends in PROXY_HEADER."""
    secret = split_tokens(read_private_file(path, flag), f"{flag} {path}")
    if len(secret) != 1:
        raise ValueError(f"{flag} {path}: expected one secret, found {len(secret)}")
    return secret[0]


TENANT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")  # safe as a metrics label, a log field, an HAProxy word


def token_file_tenants(text: str, source: str) -> dict[str, str]:
    """A token file's lines, `TOKEN` (anonymous) or `NAME TOKEN` -> {token: name or ""}.  A name is
    only a label: it is never accepted as a token, so a name that is also a token is refused."""
    tenants: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if len(words) > 2 or (len(words) == 2 and not TENANT_NAME.fullmatch(words[0])):
            raise ValueError(f"{source}, line {number}: expected TOKEN or NAME TOKEN (a name is a letter, then "
                             "up to 63 letters, digits and _.-)")
        if words:
            name, token = words[0] if len(words) == 2 else "", words[-1]
            if not BEARER_TOKEN.fullmatch(token):
                raise ValueError(f"{source}, line {number}: not a bearer token (letters, digits and -._~+/, "
                                 "then optional '=')")
            if tenants.setdefault(token, name) != name:
                raise ValueError(f"{source}, line {number}: the token is given twice, with different names")
    if not tenants:
        raise ValueError(f"{source} holds no token")
    return tenants


def configured_tenants(token: str | None, token_file: str | None) -> dict[str, str]:
    """--token's tokens (anonymous) and --token-file's -> {token: tenant name or ""}, in that order."""
    tenants = dict.fromkeys(split_tokens(token, "--token"), "") if token is not None else {}
    if token_file:
        for accepted, name in read_token_file(token_file).items():
            if tenants.setdefault(accepted, name) != name:
                raise ValueError(f"--token-file {token_file}: a token of --token is given a name there")
    if set(tenants.values()) & set(tenants):
        raise ValueError("a tenant's name in --token-file is also a token; names are labels, never tokens")
    return tenants


@dataclasses.dataclass(frozen=True)
class Credentials:
    """Who may call, read again on SIGHUP: the tenants' `Authorization` values ({} for no check), the
    operator's (they read /metrics, docs/operations.md "Roles"), and the proxy's secret."""
    tenants: dict[bytes, str]  # `Bearer <token>` -> its tenant's name ("": anonymous)
    operators: frozenset[bytes]  # `Bearer <token>` of --metrics-token-file
    proxy_secret: bytes | None  # of --proxy-secret-file


def accepted_credentials(config: ServerConfig) -> Credentials:
    """Every `Authorization` value let in, each tenant's with its tenant's name, and the proxy's secret."""
    tenants = configured_tenants(config.token, config.token_file)
    operators = read_token_file(config.metrics_token_file, "--metrics-token-file") if config.metrics_token_file else {}
    if set(operators) & set(tenants):
        raise ValueError("a token of --metrics-token-file is also a tenant's: the operator's tokens run nothing")
    secret = read_proxy_secret(config.proxy_secret_file) if config.proxy_secret_file else None
    return Credentials({f"Bearer {token}".encode(): name for token, name in tenants.items()},
                       frozenset(f"Bearer {token}".encode() for token in operators),
                       secret.encode() if secret else None)


class KCoralServer:
    """Caches, pool and HTTP server of one instance.  `create_app(config)` builds one.

    Callers use: `start()` (workers up, listening on a background thread; embedding, tests),
    `url`, `serve_forever()` (blocks until SIGTERM/SIGINT, then `stop()`; SIGHUP: `reload()`),
    `stop()` (graceful: drain, wait for requests in flight, release everything).
    The handler calls: `tenant_of`, `health`, `request_in_flight`, `handle_execute`,
    `refuse_while_draining`.
    """

    def __init__(self, config: ServerConfig | None = None) -> None:
        config = config or ServerConfig()
        validate_config(config)
        self.config = config
        try:
            self.credentials = accepted_credentials(config)
        except ValueError as exc:
            raise SystemExit(f"kcoral: {exc}") from None
        self.log = EventLog(config)
        self.log.metrics.declare_tenants(self.credentials.tenants.values())
        self.instance_id = str(uuid.uuid4())
        self.started_at = utc_now().isoformat(timespec="microseconds").replace("+00:00", "Z")
        self.blob_store = BlobStore(config)
        self.in_flight = 0
        self.in_flight_cond = threading.Condition()
        self.bodies = BodyBudget(config.max_body_bytes_in_flight)
        self.last_post = -math.inf  # time.monotonic() of the latest POST, for the drain's quiet period
        self.last_health_check = -math.inf  # time.monotonic() of a balancer's latest health check
        self.drain_health_checks: list[float] = []  # when they were answered capacity 0, since the signal
        self.drain_started = math.inf
        self.closing = False
        self.pool: Pool  # from start() on
        self.httpd: KCoralHTTPServer  # from start() on

    def start(self) -> KCoralServer:
        """Start workers and listen; returns once requests are accepted."""
        run_dir = self.log.open()
        removed = remove_dead_workspaces(tempfile.gettempdir())
        if removed:
            self.log.event("stale_workspaces_removed", count=removed)
        become_subreaper()
        isolate_import_path()
        sandbox, why_not = resolve_sandbox(self.config)
        if why_not:
            self.log.event("sandbox_off", "WARNING", reason=why_not)
        self.config = dataclasses.replace(self.config, sandbox=sandbox, cgroup=enter_delegated_cgroup(self.config))
        device, gpu_ids, gpu_names = resolve_device(self.config)
        slots = len(gpu_ids) * self.config.workers_per_gpu if device == "cuda" else self.config.num_workers
        self.config = dataclasses.replace(self.config, **machine_quotas(self.config, slots))
        if sandbox == "none" and os.getuid() == 0:
            self.log.event("unsandboxed_as_root", "WARNING",
                           effect="every program runs as root with every capability: any request can take "
                                  "over this machine",
                           remedy="use --sandbox bubblewrap, or run as an unprivileged user")
        kcoral_worker.set_oom_score(-900)  # the kernel's last choice (needs CAP_SYS_RESOURCE; else it stays)
        kcoral_worker.keep_freed_memory(FRONT_END_HEAP_BLOCK_BYTES * 2, FRONT_END_HEAP_BLOCK_BYTES)
        self.device = device
        self.pool = Pool(self.config, device, gpu_ids, gpu_names, self.log)
        self.target, self.versions = describe_runtime(device, self.pool)
        self.gpu_count = len(gpu_ids)
        self.httpd = KCoralHTTPServer((self.config.host, self.config.port), RequestHandler, self)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="kcoral-http", daemon=True)
        self.thread.start()
        self.log.event("server_started", url=self.url, device=device, sandbox=self.config.sandbox,
                       workers=len(self.pool.slots), run_dir=run_dir, instance_id=self.instance_id,
                       oom_score_adj=kcoral_worker.oom_score(),
                       **{name: getattr(self.config, name) for name in QUOTA_NAMES})
        return self

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Serve until SIGTERM/SIGINT, then drain in-flight requests and exit cleanly.  SIGHUP reloads."""
        # The handlers only note the signal: one runs between any two steps of this thread, and
        # would deadlock on a lock the step holds (an Event's, the log's).  SIGHUP's default
        # would end the server.
        received: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda number, _: received.append(number))
        self.start()
        notify_systemd("READY=1")  # listening, workers up: /health answers
        watchdog, pinged = watchdog_interval(), -math.inf
        while signal.SIGTERM not in received and signal.SIGINT not in received:
            if signal.SIGHUP in received:
                received.remove(signal.SIGHUP)
                self.reload()
            if watchdog and time.monotonic() - pinged >= watchdog and self.thread.is_alive():
                notify_systemd("WATCHDOG=1")  # WatchdogSec= (docs/kcoral.service): the server still serves
                pinged = time.monotonic()
            time.sleep(0.1)
        notify_systemd("STOPPING=1")
        self.stop()

    def reload(self) -> None:
        """SIGHUP: reopen the event log by name (after logrotate moved it) and read --token-file
        again (tokens rotate without a restart).  A token file that no longer reads keeps the
        tokens in use."""
        self.log.reopen()
        config = self.config
        if config.token_file or config.metrics_token_file or config.proxy_secret_file:
            try:
                self.credentials = accepted_credentials(config)
                self.log.metrics.declare_tenants(self.credentials.tenants.values())
                self.log.event("tokens_reloaded", tokens=len(self.credentials.tenants),
                               operator_tokens=len(self.credentials.operators))
            except ValueError as exc:
                self.log.event("tokens_reload_failed", "ERROR", error=str(exc))

    def tenant_of(self, authorization: str) -> str | None:
        """Our extension: with tokens configured, every endpoint needs `Authorization: Bearer <token>`
        with one of them -> its tenant's name ("": anonymous, or no tokens configured); None: refused.
        Each comparison takes constant time, and every token is compared."""
        credentials = self.credentials.tenants
        given = authorization.encode("utf-8", "replace")
        matches = [name for accepted, name in credentials.items()
                   if hmac.compare_digest(given, accepted)]  # no early exit
        return matches[0] if matches else None if credentials else ""

    def is_operator(self, authorization: str) -> bool:
        """Whether `authorization` is one of --metrics-token-file's (constant time, every token compared)."""
        given = authorization.encode("utf-8", "replace")
        return sum(hmac.compare_digest(given, accepted) for accepted in self.credentials.operators) > 0

    def may_read_metrics(self, operator: bool) -> bool:
        """/metrics shows every tenant's requests, so no tenant reads it (docs/operations.md "Roles"):
        the operator's tokens do; without them, the tokens of a node that names no tenant (one
        anonymous tenant, or no token at all) read it as before roles existed."""
        if self.credentials.operators:
            return operator
        return not any(self.credentials.tenants.values())

    def from_proxy(self, secret: str | None) -> bool:
        """Whether a request carries the proxy's secret (PROXY_HEADER): only then are the headers the proxy
        sets believed (X-Request-Start, the health check's), which a client sending straight to the
        node could otherwise forge.  False when no --proxy-secret-file is given."""
        expected = self.credentials.proxy_secret
        return expected is not None and hmac.compare_digest((secret or "").encode("utf-8", "replace"), expected)

    def metrics_text(self) -> str:
        """GET /metrics: the event-fed counters plus the gauges read now (docs/operations.md)."""
        load, blob_store = self.pool.load(), self.blob_store
        gauges: list[tuple[str, Labels, float]] = [
            ("kcoral_requests_in_progress", (), load["requests_in_progress"]),
            ("kcoral_requests_waiting", (), load["requests_waiting"]),
            ("kcoral_capacity", (), load["request_capacity"]),
            ("kcoral_info", (("version", __version__), ("device", self.device), ("sandbox", self.config.sandbox)), 1)]
        caches: list[tuple[str, MemoryCache | DiskCache | None]] = [
            ("memory", blob_store.memory), ("disk", blob_store.disk)]
        for name, cache in caches:
            if cache is None:
                continue
            labels = (("cache", name),)
            with blob_store.lock:
                gauges += [("kcoral_cache_hits_total", labels, blob_store.hits[name]),
                           ("kcoral_cache_misses_total", labels, blob_store.misses[name])]
            size, entries = (cache.size, len(cache)) if isinstance(cache, MemoryCache) else (cache.total, cache.files)
            gauges += [("kcoral_cache_evictions_total", labels, cache.evictions),
                       ("kcoral_cache_bytes", labels, size), ("kcoral_cache_entries", labels, entries)]
        tenants = self.log.metrics.declared_tenants()  # every name the token file has given, and "" (anonymous)
        gauges += [("kcoral_busy_seconds_total", (("tenant", name),) if name else (), seconds)
                   for name, seconds in self.pool.busy_seconds(tenants).items()]
        names = [name for name in tenants if name]
        for name, (running, waiting) in self.pool.tenant_load(names).items():
            gauges += [("kcoral_tenant_requests_running", (("tenant", name),), running),
                       ("kcoral_tenant_requests_waiting", (("tenant", name),), waiting)]
        if self.pool.arbiter is not None:
            with self.pool.arbiter.cond:
                busy = dict(self.pool.arbiter.busy_seconds)
            gauges += [("kcoral_gpu_lease_busy_seconds_total", (("gpu", str(g)),), s) for g, s in busy.items()]
        return self.log.metrics.render(gauges)

    def health(self, tenant: str = "", balancer_check: bool = False) -> dict[str, Any]:
        """GET /health, with the caller's `tenant`'s counts; `balancer_check`: read by the health
        check of the HAProxy configuration that haproxy-config writes (BALANCER_CHECK_HEADER),
        which refuse_while_draining waits for."""
        if balancer_check:
            with self.in_flight_cond:
                self.last_health_check = time.monotonic()
                if self.closing:
                    self.drain_health_checks.append(self.last_health_check)
        return {"status": "ok", "instance_id": self.instance_id, "started_at": self.started_at,
                "gpu_count": self.gpu_count, "load": self.pool.load(tenant),
                "target": self.target, "versions": self.versions, "sandbox": self.config.sandbox,
                "version": __version__,
                "limits": {"max_request_bytes": {"value": self.config.max_request_bytes,
                                                 "enforced": "front-end: 413 request_too_large beyond it"},
                           **{name: {"value": getattr(self.config, name), "enforced": how,
                                     **({"unseen": memory_unseen(self.config)} if name == "memory_limit_bytes" else {})}
                              for name, how in quota_enforcement(self.config).items()}}}

    @contextlib.contextmanager
    def request_in_flight(self) -> Iterator[None]:
        """Counts a POST from its arrival until its answer is out: close() waits for none left."""
        with self.in_flight_cond:
            self.in_flight += 1
            self.last_post = time.monotonic()
        try:
            yield
        finally:
            with self.in_flight_cond:
                self.in_flight -= 1
                self.in_flight_cond.notify_all()

    def handle_execute(self, request_id: str, body: Body, content_type: str | None,
                       proxy_queue_ms: float = 0.0, on_output: Callable[[str, bytes], None] | None = None,
                       tenant: str = "", client_gone: Callable[[], bool] | None = None,
                       answered: threading.Event | None = None) -> Outcome:
        """A request body, read -> Outcome.  The checks run in protocol order (docs/protocol.md §4.7): the first
        that fails decides the answer.
        ClientGone when `client_gone` says the client left while the program waited or ran."""
        try:
            parts = split_request(body, content_type, self.config)  # envelope and parts
            data, supplied = parts.program_json, parts.supplied
            assert data is not None  # split_request refused a request without a program part
            program = parts.program()                                    # strict JSON, then the program
            check_no_unreferenced_blobs(program, supplied)
            disk_writes = self.blob_store.keep_file_blobs(program, supplied, tenant)  # cached even if refused below
            try:
                blobs, missing = self.blob_store.resolve(program, supplied, tenant)
                check_tensor_sizes(program, blobs)
                if missing:
                    return Outcome(body={"status": "CACHE_MISS", "request_id": request_id,
                                         "missing_blobs": missing})
                self.check_gpu_count(program)
                return self.run_program(request_id, data, program, blobs, proxy_queue_ms, on_output,
                                        tenant, client_gone, answered)
            finally:
                if disk_writes is not None:  # once answered, the client may count on its file blobs being cached
                    self.blob_store.settle_file_blobs(disk_writes)
        except RequestTooLarge as exc:
            return Outcome(413, "request_too_large", str(exc))
        except ValidationError as exc:
            return Outcome(400, "parse", str(exc), error_fields=getattr(exc, "instruction", {}))

    def check_gpu_count(self, program: ValidProgram) -> None:
        gpu_count = program.options.get("gpu_count")
        if gpu_count and gpu_count > self.gpu_count:
            raise ValidationError("gpu_count exceeds this GPU server's configured capacity")

    def run_program(self, request_id: str, data: memoryview, program: ValidProgram, blobs: Blobs,
                    proxy_queue_ms: float = 0.0, on_output: Callable[[str, bytes], None] | None = None,
                    tenant: str = "", client_gone: Callable[[], bool] | None = None,
                    answered: threading.Event | None = None) -> Outcome:
        """A valid program with all its blobs -> a worker's Outcome (or 503 busy: nothing ran)."""
        if self.closing:
            return self.refuse_while_draining()
        self.log.save_program(request_id, data)
        options, config = program.options, self.config
        job = Job(request_id, program, blobs,
                  timeout=min(options.get("timeout_seconds", config.default_timeout_seconds),
                              config.max_timeout_seconds),
                  output_limit=min(options.get("output_limit_bytes", config.output_limit_bytes),
                                   config.max_output_limit_bytes),
                  proxy_queue_ms=proxy_queue_ms, on_output=on_output, tenant=tenant, client_gone=client_gone,
                  answered=answered or threading.Event())
        with self.blob_store.pinned(program):
            outcome = self.pool.run_job(job)
            self.blob_store.keep_sealed(blobs, job.sealed)
        return self.refuse_while_draining() if outcome.http_status == 503 and self.closing else outcome

    def refuse_while_draining(self) -> Outcome:
        """503 busy for a request that arrived during shutdown: nothing of it ran, so a load
        balancer may retry it on another node, provided it has taken this node out by then (least
        connections would pick this node again, the one with the fewest connections; a retry
        comes straight back while the other nodes are full).  So the answer waits `drain_seconds`
        after the signal and, on a node that the generated HAProxy configuration was checking,
        until it has answered capacity 0 to TAKEN_OUT_AFTER_CHECKS of its checks, plus
        CHECK_MARGIN_SECONDS (HAProxy marks a node down at its second failed check); at most ten
        times `drain_seconds`."""
        drain = self.config.drain_seconds
        checked = self.drain_started - self.last_health_check < HEALTH_CHECKED_WITHIN_SECONDS
        give_up = self.drain_started + 10 * drain
        with self.in_flight_cond:
            while time.monotonic() < give_up and not self.taken_out(checked):
                self.in_flight_cond.wait(0.05)
        return Outcome(503, "busy", "server is shutting down")

    def taken_out(self, checked: bool) -> bool:
        """Whether a balancer has stopped choosing this draining node (refuse_while_draining)."""
        now, reads = time.monotonic(), self.drain_health_checks
        if now < self.drain_started + self.config.drain_seconds:
            return False
        return not checked or (len(reads) >= TAKEN_OUT_AFTER_CHECKS
                               and now >= reads[TAKEN_OUT_AFTER_CHECKS - 1] + CHECK_MARGIN_SECONDS)

    def stop(self) -> None:
        """Graceful shutdown: capacity 0, new programs 503, in-flight ones finish."""
        self.drain_started = time.monotonic()
        self.closing = True
        self.pool.drain()
        self.bodies.refuse_waiters()
        self.httpd.guard.cut_phase("body", "shutdown")  # uploads still arriving; executions finish
        with self.in_flight_cond:
            self.log.event("shutdown_started", remaining=self.in_flight)
            while self.in_flight:
                self.in_flight_cond.wait()
            self.wait_for_quiet()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.pool.stop()
        self.log.event("server_stopped")
        self.log.close()

    def wait_for_quiet(self) -> None:
        """Behind a load balancer, requests keep coming until its health check sees capacity 0.
        Each gets 503 busy (see `refuse_while_draining`); closing the port instead would reset
        the connections queued on it after their requests were sent, which no balancer may
        safely retry.  So the port closes only once POSTs have stopped for `drain_seconds`
        (waiting at most ten times that).  Called with in_flight_cond held."""
        quiet = self.config.drain_seconds
        give_up = time.monotonic() + 10 * quiet
        while self.in_flight or time.monotonic() < min(self.last_post + quiet, give_up):
            self.in_flight_cond.wait(0.05)


# The front-end's allocator (kcoral_worker.keep_freed_memory) takes blocks under this size from its heaps
# and keeps what it frees for reuse, up to twice this size free at a heap's top: by default glibc maps
# each block over ~4 MiB afresh and returns it at its free, so every 4 MiB answer of captured output
# faulted ~13 MiB in again (3 300 faults, 7 ms of CPU).  Larger blocks, a large body once it has grown
# past this size among them, are mapped still and returned at once.  The price, measured: 8 concurrent
# 24 MiB uploads peaked 124-134 MiB over idle, not 80-93 (each body's first 8 MiB, freed in a heap);
# with 32 MiB and 64 MiB, 228-232.
FRONT_END_HEAP_BLOCK_BYTES = 8 << 20

# The generated HAProxy configuration checks /health every second with this header (`fall 2`): it takes
# a node that answers capacity 0 out at the second such answer; the margin covers its handling of it.
BALANCER_CHECK_HEADER = "X-KCoral-Health-Check"
PROXY_HEADER = "X-KCoral-Proxy"  # the proxy's secret (--proxy-secret-file), set by HAProxy on every request
HEALTH_CHECKED_WITHIN_SECONDS = 5.0
TAKEN_OUT_AFTER_CHECKS = 2
CHECK_MARGIN_SECONDS = 0.2


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings under systemd's WatchdogSec= (half its WATCHDOG_USEC, as
    sd_watchdog_enabled(3) advises), for this process only; None without a watchdog."""
    usec, pid = os.environ.get("WATCHDOG_USEC", ""), os.environ.get("WATCHDOG_PID", str(os.getpid()))
    return int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and pid == str(os.getpid()) else None


def notify_systemd(state: str) -> None:
    """sd_notify(3) with the standard library: under `Type=notify` (docs/kcoral.service) systemd
    counts the service started at READY=1, so units ordered after it and `systemctl start` wait
    until the node answers.  Nothing outside systemd (no NOTIFY_SOCKET)."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(state.encode(), address)
    except OSError as exc:  # systemd then fails the start at its timeout: say why
        print(f"kcoral: cannot notify systemd ({state}) at {address!r}: {exc}", file=sys.stderr)


def create_app(config: ServerConfig | None = None) -> KCoralServer:
    """A server for embedding and tests: `create_app(cfg).start()`, then `.url`, then `.stop()`."""
    return KCoralServer(config)


# --- 3. wire rules: strict JSON and multipart (docs/protocol.md §4.3-4.6, 5.1) --------------------

class RequestTooLarge(ValidationError):
    """A request beyond one of the size limits (parts, program, instructions, arguments): 413
    request_too_large rather than 400, since a valid program can be this large."""


def split_request(body: Body, content_type: str | None, limits: ServerConfig = DEFAULT_LIMITS) -> RequestParts:
    """docs/protocol.md §4.3-4.7 -> the request's parts, in the published package's check order: each part's
    headers as it is parsed (§4.5), then its name, content type and hash (§4.6), whose failure waits
    until every later part's headers have passed (step 2 before step 3)."""
    parts, failure = RequestParts(limits), None
    allowed = limits.max_request_parts
    view = memoryview(body)
    ranges = multipart_ranges(body, request_boundary(content_type), limits)
    for count, (headers, start, end) in enumerate(ranges, 1):
        name, media, payload = *check_part_headers(headers), view[start:end]
        if count > allowed:
            refuse_extra_part(parts, name, media, payload, failure)
        if name == "program" and len(payload) > limits.max_program_bytes:
            raise RequestTooLarge(f"'program' part exceeds {limits.max_program_bytes} bytes")
        if failure is None:
            try:
                parts.add(name, media, payload)
            except ValidationError as exc:
                failure = exc
        if count == 1 and failure is None and name == "program":
            allowed = parts.parts_allowed()
    if failure is not None:
        raise failure
    if parts.program_json is None:
        raise ValidationError("missing 'program' part")
    return parts


@dataclasses.dataclass
class RequestParts:
    """A request split into its parts: the program part's JSON and the blob parts by hash.  The
    program is decoded and validated once, when first asked for (`program()`)."""
    limits: ServerConfig
    program_json: memoryview | None = None
    supplied: dict[str, memoryview] = dataclasses.field(default_factory=dict)  # hash -> blob part
    checked: ValidProgram | ValidationError | None = None

    def add(self, name: str, media: str, payload: memoryview) -> None:
        """docs/protocol.md §4.6 for one part."""
        if name == "program":
            if self.program_json is not None:
                raise ValidationError("duplicate 'program' part")
            if media != "application/json":
                raise ValidationError("'program' part must be application/json")
            self.program_json = payload
            return
        match = BLOB_PART.fullmatch(name)
        if not match:
            raise ValidationError(f"unexpected part name {name[:80]!r}")
        digest = match.group(1)
        if digest in self.supplied:
            raise ValidationError(f"duplicate blob part {digest}")
        if media != "application/octet-stream":
            raise ValidationError(f"blob part {digest} must be application/octet-stream")
        if hashlib.sha256(payload).hexdigest() != digest:
            raise ValidationError(f"blob hash mismatch for part {digest}")
        self.supplied[digest] = payload

    def program(self) -> ValidProgram:
        """The program part decoded (§5.1) and validated (§5, 6); its error, raised again if asked twice."""
        if self.checked is None:
            assert self.program_json is not None  # asked for once the program part is in (split_request)
            try:
                self.checked = parse_program(decode_program(self.program_json, self.limits), self.limits)
            except ValidationError as exc:
                self.checked = exc
        if isinstance(self.checked, ValidationError):
            raise self.checked
        return self.checked

    def parts_allowed(self) -> int:
        """Parts a request may have once its first part, the program, is known: one per blob it
        references, plus the program; more are unreferenced or duplicates, a 400 whatever follows.
        An invalid program leaves the hard cap (its error comes later, in protocol order), unless
        it is too large: the size limits come first."""
        try:
            return len(self.program().blob_kinds) + 1
        except RequestTooLarge:
            raise
        except ValidationError:
            return self.limits.max_request_parts


def refuse_extra_part(parts: RequestParts, name: str, media: str, payload: memoryview,
                      failure: ValidationError | None) -> NoReturn:
    """A part beyond the valid program's blobs plus one: what the published package would answer once it read
    the rest, as far as the parts read so far tell (a later part's bad headers would have won, §4.7):
    an earlier part's error, this part's, or the unreferenced blobs, one of which there must be."""
    if failure is not None:
        raise failure
    parts.add(name, media, payload)
    check_no_unreferenced_blobs(parts.program(), parts.supplied)
    raise ValidationError("more parts than the program references blobs")  # not reached: one is unreferenced


def strict_json(data: Buffer) -> Json:
    """Decode UTF-8 JSON, refusing a BOM, duplicate keys and NaN/Infinity."""
    def pairs(items: list[tuple[str, Json]]) -> dict[str, Json]:
        obj = dict(items)
        if len(obj) != len(items):
            raise ValidationError("duplicate key in JSON object")
        return obj

    def constant(name: str) -> NoReturn:
        raise ValidationError(f"{name} is not valid JSON")

    try:
        text = bytes(data).decode("utf-8")
        if text.startswith("\ufeff"):
            raise ValidationError("JSON must not start with a byte-order mark")
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except RecursionError:
        raise ValidationError("JSON is nested too deeply") from None
    except UnicodeDecodeError:
        raise ValidationError("JSON is not valid UTF-8") from None
    except ValidationError:
        raise
    except ValueError as exc:  # also integers beyond the interpreter's digit limit
        raise ValidationError(f"invalid JSON: {exc}") from None


TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
MEDIA = re.compile(rf"{TOKEN.pattern}(?:/{TOKEN.pattern})?")  # `form-data`, `type/subtype`


HEADER_PIECE = re.compile(r'(?:[^;"]++|"(?:[^"\\]++|\\.)*+")*+', re.DOTALL)  # possessive: no backtracking


def header_pieces(value: str) -> list[str]:
    """`a; b="x;y"` -> ["a", ' b="x;y"']: split at the semicolons outside quoted strings (a backslash
    escapes the next character inside one).  A regex, not a loop per character: every part of a
    request has two such headers."""
    pieces, pos = [], 0
    while True:
        piece = HEADER_PIECE.match(value, pos)
        assert piece is not None  # the pattern matches the empty string too
        end = piece.end()
        if end < len(value) and value[end] == '"':
            raise ValidationError("unterminated quoted string in header")
        pieces.append(value[pos:end])
        if end == len(value):
            return pieces
        pos = end + 1


@functools.lru_cache(maxsize=64)  # a request's parts repeat their Content-Type values
def parse_header_params(value: str) -> tuple[str, dict[str, str]]:
    """`type; k=v; k="quoted"` -> (lower-cased type, {lower-cased k: v}); callers must not change the dict."""
    pieces = header_pieces(value)
    media = pieces[0].strip().lower()
    if not MEDIA.fullmatch(media):
        raise ValidationError(f"malformed header value {pieces[0].strip()[:80]!r}")
    params = {}
    for piece in pieces[1:]:
        if not piece.strip():
            continue
        key, eq, raw = piece.partition("=")
        key, raw = key.strip().lower(), raw.strip()
        if not eq or not TOKEN.fullmatch(key):
            raise ValidationError(f"malformed header parameter {piece.strip()!r}")
        if raw.startswith('"'):
            if len(raw) < 2 or not raw.endswith('"'):
                raise ValidationError("malformed quoted header parameter")
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1]) if "\\" in raw else raw[1:-1]
        elif not raw or re.search(r'[\s"]', raw):  # lenient: senders leave `name=blob:<hex>` unquoted
            raise ValidationError(f"malformed header parameter {piece.strip()!r}")
        if key in params:
            raise ValidationError(f"header parameter {key!r} given twice")
        params[key] = raw
    return media, params


def request_boundary(content_type: str | None) -> bytes:
    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        raise ValidationError("expected a multipart/form-data request")
    media, params = parse_header_params(content_type)
    if media != "multipart/form-data":
        raise ValidationError("expected a multipart/form-data request")
    boundary = params.get("boundary", "")
    if not boundary or "\r" in boundary or "\n" in boundary:
        raise ValidationError("multipart request needs a non-empty boundary")
    return boundary.encode("latin-1", "replace")


def multipart_ranges(body: Body, boundary: bytes,
                     limits: ServerConfig = DEFAULT_LIMITS) -> Iterator[tuple[PartHeaders, int, int]]:
    """A multipart body's parts as (headers, payload start, payload end), one at a time: the caller
    checks each part before the next is parsed, so a body of a million tiny parts is refused at the
    first bad one, or at `max_request_parts`, not after all are parsed."""
    delimiter = b"--" + boundary
    pos = find_delimiter(body, delimiter, 0)
    if pos < 0:
        raise ValidationError("multipart body has no delimiter")
    count = 0
    while True:
        j = pos + len(delimiter)
        if body[j:j + 2] == b"--":
            if not count:
                raise ValidationError("multipart body has no parts")
            check_close_delimiter_line(body, j + 2)
            return
        if count == limits.max_request_parts:
            raise RequestTooLarge(f"request has more than {limits.max_request_parts} multipart parts")
        j = body.find(b"\n", j) + 1  # a delimiter line always ends (find_delimiter checked)
        following = find_delimiter(body, delimiter, j)
        if following < 0:
            raise ValidationError("multipart body has no closing delimiter")
        end = following - 1
        if end > j and body[end - 1] == 0x0D:
            end -= 1
        headers, payload_start = parse_part_headers(body, j, end, limits)
        count += 1
        yield headers, payload_start, end
        pos = following


def find_delimiter(body: Body, delimiter: bytes, start: int) -> int:
    """Position of the next real delimiter line (docs/protocol.md §4.4), or -1."""
    while True:
        i = body.find(delimiter, start)
        if i < 0:
            return -1
        if i == 0 or body[i - 1] == 0x0A:
            j = i + len(delimiter)
            if body[j:j + 2] == b"--":
                return i
            while j < len(body) and body[j] in b" \t":
                j += 1
            if body[j:j + 1] == b"\n" or body[j:j + 2] == b"\r\n":
                return i
        start = i + 1


def check_close_delimiter_line(body: Body, start: int) -> None:
    """RFC 2046: only transport padding may follow the close delimiter on its line (the
    published package answers 400 for `--B--junk`); the epilogue starts on the next line."""
    end = body.find(b"\n", start)
    rest = bytes(body[start:len(body) if end < 0 else end]).rstrip(b"\r")
    if rest.strip(b" \t"):
        raise ValidationError("unexpected bytes after the closing multipart delimiter")


# A blob part's header block as our client writes it, byte for byte (client._multipart_chunks): what
# parse_part_headers makes of it, without the line parser (split_request of a 500-file folder: 11.2 -> 8.8 ms)
PLAIN_BLOB_HEADERS = re.compile(rb'Content-Disposition: form-data; name="blob:([0-9a-f]{64})"\r\n'
                                rb'Content-Type: application/octet-stream\r\n\r\n')


def plain_blob_headers(digest: bytes) -> PartHeaders:
    return {"content-disposition": [f'form-data; name="blob:{digest.decode()}"'],
            "content-type": ["application/octet-stream"]}


FIRST_LINE_EMPTY = re.compile(rb"\r*\n")
EMPTY_LINE = re.compile(rb"\n\r*\n")  # a line of nothing but CRs is empty too


def parse_part_headers(body: Body, start: int, end: int, limits: ServerConfig) -> tuple[PartHeaders, int]:
    """Header block up to the first empty line -> ({lower name: [values]}, payload start).  Its lines
    and bytes are capped: each part costs at most that much parsing."""
    plain = PLAIN_BLOB_HEADERS.match(body, start, end)
    if plain and plain.end() - start <= limits.max_part_header_bytes and limits.max_part_header_lines >= 2:
        return plain_blob_headers(plain.group(1)), plain.end()
    first = FIRST_LINE_EMPTY.match(body, start, end)
    if first:
        return {}, first.end()
    stop = min(end, start + limits.max_part_header_bytes)
    blank = EMPTY_LINE.search(body, start, stop)
    if blank is None and stop < end:
        raise ValidationError(f"multipart part headers exceed {limits.max_part_header_bytes} bytes")
    if blank is None:
        raise ValidationError("multipart part has no end of headers")
    lines = bytes(body[start:blank.start()]).decode("utf-8", "surrogateescape").split("\n")
    if len(lines) > limits.max_part_header_lines:
        raise ValidationError(f"multipart part has more than {limits.max_part_header_lines} header lines")
    headers: PartHeaders = {}
    last = None
    for line in lines:
        line = line.rstrip("\r")
        if line[0] in " \t" and last is not None:
            headers[last][-1] += " " + line.strip()
            continue
        name, colon, value = line.partition(":")
        if not colon or not TOKEN.fullmatch(name):
            raise ValidationError(f"malformed multipart header line {line[:80]!r}")
        last = name.lower()
        headers.setdefault(last, []).append(value.strip())
    return headers, blank.end()


PLAIN_DISPOSITION = re.compile(r'form-data; name="([^"\\]+)"')  # parse_header_params' result, without its cost


def check_part_headers(headers: PartHeaders) -> tuple[str, str]:
    """docs/protocol.md §4.5 -> the part's name and media type."""
    for required in ("content-disposition", "content-type"):
        if len(headers.get(required, ())) != 1:
            raise ValidationError(f"each part needs exactly one {required} header")
    plain = PLAIN_DISPOSITION.fullmatch(headers["content-disposition"][0])  # what clients write: parsed alike
    disposition, params = ("form-data", {"name": plain.group(1)}) if plain else \
        parse_header_params(headers["content-disposition"][0])
    if disposition != "form-data":
        raise ValidationError("part disposition must be form-data")
    if not params.get("name"):
        raise ValidationError("part needs a non-empty name")
    media, _ = parse_header_params(headers["content-type"][0])
    if media.startswith("multipart/"):
        raise ValidationError("nested multipart parts are not supported")
    encodings = headers.get("content-transfer-encoding", [])
    if len(encodings) > 1 or any(e.strip().lower() not in ("binary", "8bit") for e in encodings):
        raise ValidationError("content-transfer-encoding must be binary or 8bit")
    return params["name"], media


BLOB_PART = re.compile(r"blob:([0-9a-f]{64})")
HASH = re.compile(r"[0-9a-f]{64}")


# --- 4. wire rules: program validation (docs/protocol.md §5, 6) -----------------------------------

JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def decode_program(data: memoryview, limits: ServerConfig) -> Json:
    """strict_json, once the program's JSON values are counted: decoding costs about 60 bytes per value
    (`[[],[],...]` ~20 times its size), so the count is capped first.  Its commas and opening
    brackets outside strings bound it, found at C speed once the strings are cut out."""
    structure = JSON_STRING.sub(b"", data)
    values = structure.count(b",") + structure.count(b"[") + structure.count(b"{")
    if values > limits.max_program_values:
        raise RequestTooLarge(f"'program' holds more than {limits.max_program_values} JSON values")
    return strict_json(data)


UPLOAD_FIELDS = {"module": {"source"}, "tensor": {"blob", "dtype", "shape"}, "bytes": {"blob"},
                 "library": {"blob"}, "file": {"blob", "path"}}


@dataclasses.dataclass
class ValidProgram:
    instructions: list[Instruction]
    options: dict[str, Json]
    blob_kinds: dict[str, set[str]]  # hash -> {"file", "memory"}, in order of first reference
    tensor_sizes: list[tuple[str, str, int]]  # (instruction id, hash, expected byte count)


def parse_program(body: Json, limits: ServerConfig = DEFAULT_LIMITS) -> ValidProgram:
    """Validate a decoded program object; ValidationError names the offending field."""
    if not isinstance(body, dict):
        raise ValidationError("program must be a JSON object")
    unknown = set(body) - {"instructions", "options"}
    if unknown:
        raise ValidationError(f"unknown program field(s): {sorted(unknown)}")
    instructions = body.get("instructions")
    if not isinstance(instructions, list) or not instructions:
        raise ValidationError("'instructions' must be a non-empty array")
    if len(instructions) > limits.max_program_instructions:
        raise RequestTooLarge(f"program has more than {limits.max_program_instructions} instructions")
    options = check_options(body.get("options", {}))
    program = ValidProgram(instructions, options, {}, [])
    ids, keys, paths = set[str](), set[str](), dict[str, str]()
    for index, ins in enumerate(instructions):
        where = f"instruction {index}"
        if not isinstance(ins, dict):
            raise ValidationError(f"{where} must be an object")
        op = ins.get("op")
        try:
            if op not in ("upload", "get_function", "run", "return"):
                raise ValidationError(f"{where}: unknown op {brief(op)}")
            if op != "return":
                check_id(ins, ids, where)
            check_instruction(program, ins, op, ids, keys, paths, f"{where} ({op})", limits)
        except ValidationError as exc:
            exc.instruction = instruction_fields(index, ins)  # type: ignore[attr-defined]  # read by handle_execute
            raise
        if op != "return":
            ids.add(ins["id"])
    return program


def instruction_fields(index: int, ins: dict[str, Json]) -> dict[str, Json]:
    """A refused instruction named as fields of the 400's `error` (docs/protocol.md §9.8), as a FAILED
    result names the failing one: its index, and its op and id where they are well-formed."""
    op, ident = ins.get("op"), ins.get("id")
    return {"instruction_index": index,
            "instruction_op": op if op in ("upload", "get_function", "run", "return") else None,
            "instruction_id": ident if isinstance(ident, str) else None}


def is_integer(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_ARG_DEPTH = 400  # programs reach the worker as JSON, whose decoder recurses once per level: well within its limit


def check_options(options: Json) -> dict[str, Json]:
    if not isinstance(options, dict):
        raise ValidationError("'options' must be an object")
    unknown = set(options) - {"timeout_seconds", "output_limit_bytes", "gpu_count"}
    if unknown:
        raise ValidationError(f"unknown option(s): {sorted(unknown)}")
    if "timeout_seconds" in options:
        t = options["timeout_seconds"]
        # compared, not converted: an integer past float's range (JSON allows 10**400) is a finite number
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < math.inf:
            raise ValidationError("options.timeout_seconds must be a finite number > 0")
    if "output_limit_bytes" in options:
        n = options["output_limit_bytes"]
        if not is_integer(n) or n < 0:
            raise ValidationError("options.output_limit_bytes must be an integer >= 0")
    if "gpu_count" in options:
        n = options["gpu_count"]
        if not is_integer(n) or not 1 <= n <= 8:
            raise ValidationError("options.gpu_count must be an integer from 1 to 8")
    return options


def check_instruction(program: ValidProgram, ins: Instruction, op: str, ids: set[str], keys: set[str],
                      paths: dict[str, str], where: str, limits: ServerConfig) -> None:
    if op == "upload":
        kind = ins.get("kind")
        if not isinstance(kind, str) or kind not in UPLOAD_FIELDS:  # a list is unhashable
            raise ValidationError(f"{where}: unknown kind {brief(kind)}")
        check_fields(ins, {"op", "id", "kind"} | UPLOAD_FIELDS[kind], set(), where)
        check_upload(program, ins, kind, paths, where)
    elif op == "get_function":
        check_fields(ins, {"op", "id", "module", "name"}, {"cpu_only"}, where)
        check_ref(ins["module"], ids, where, "module")
        if not isinstance(ins["name"], str) or not ins["name"]:
            raise ValidationError(f"{where}: 'name' must be a non-empty string")
        if not isinstance(ins.get("cpu_only", False), bool):
            raise ValidationError(f"{where}: 'cpu_only' must be a boolean")
    elif op == "run":
        check_fields(ins, {"op", "id", "fn"}, {"args"}, where)
        check_ref(ins["fn"], ids, where, "fn")
        args = ins.get("args", [])
        if not isinstance(args, list):
            raise ValidationError(f"{where}: 'args' must be an array")
        if len(args) > limits.max_run_args:
            raise RequestTooLarge(f"{where}: more than {limits.max_run_args} arguments")
        for position, arg in enumerate(args):
            if is_ref(arg):
                check_ref(arg, ids, where, f"args[{position}]")
        check_literals(args, where)
    else:
        check_return(ins, ids, keys, where)


def check_id(ins: Instruction, ids: set[str], where: str) -> None:
    if "id" not in ins:
        raise ValidationError(f"{where}: missing field 'id'")
    value = ins["id"]
    if not isinstance(value, str) or not value:
        raise ValidationError(f"{where}: 'id' must be a non-empty string")
    if value in ids:
        raise ValidationError(f"{where}: duplicate instruction id {value!r}")


def check_fields(ins: Instruction, required: set[str], optional: set[str], where: str) -> None:
    unknown = set(ins) - required - optional
    if unknown:
        raise ValidationError(f"{where}: unknown field(s) {sorted(unknown)}")
    missing = required - set(ins)
    if missing:
        raise ValidationError(f"{where}: missing field(s) {sorted(missing)}")


def check_ref(value: Json, ids: set[str], where: str, field: str) -> None:
    if not is_ref(value):
        raise ValidationError(f"{where}: '{field}' must be {{'$ref': id}}")
    if value["$ref"] not in ids:
        raise ValidationError(f"{where}: '{field}' references unknown/forward handle {value['$ref']!r}")


def check_path(value: Json, where: str) -> str:
    try:
        return normalize_path(value)
    except ValidationError as exc:
        raise ValidationError(f"{where}: invalid 'path': {exc}") from None


def check_upload(program: ValidProgram, ins: Instruction, kind: str, paths: dict[str, str], where: str) -> None:
    if kind == "module":
        if not isinstance(ins["source"], str):
            raise ValidationError(f"{where}: 'source' must be a string")
        return
    blob = ins["blob"]
    if not isinstance(blob, str) or not HASH.fullmatch(blob):
        raise ValidationError(f"{where}: 'blob' must be a lowercase SHA-256 hex string")
    program.blob_kinds.setdefault(blob, set()).add("file" if kind == "file" else "memory")
    if kind == "tensor":
        dtype, shape = ins["dtype"], ins["shape"]
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise ValidationError(f"{where}: unsupported dtype {brief(dtype)}")
        if not isinstance(shape, list) or not all(is_integer(d) and d >= 0 for d in shape):
            raise ValidationError(f"{where}: 'shape' must be an array of non-negative integers")
        program.tensor_sizes.append((ins["id"], blob, tensor_byte_count(shape, DTYPE_SIZES[dtype])))
    elif kind == "file":
        path = check_path(ins["path"], where)
        claim_file_path(paths, path, where)
        ins["path"] = path


def claim_file_path(paths: dict[str, str], path: str, where: str) -> None:
    """docs/protocol.md §6.8 in one pass per path: `paths` maps each earlier file path to itself and each of
    their parent directories to the first file below it (a pairwise check is quadratic)."""
    parents = [path[:i] for i, ch in enumerate(path) if ch == "/"]
    earlier = paths.get(path)
    if earlier == path:
        raise ValidationError(f"{where}: duplicate file upload path {path!r}")
    if earlier is not None:
        raise ValidationError(f"{where}: conflicting file upload paths {earlier!r} and {path!r}")
    for parent in parents:
        if paths.get(parent) == parent:
            raise ValidationError(f"{where}: conflicting file upload paths {parent!r} and {path!r}")
    paths[path] = path
    for parent in parents:
        paths.setdefault(parent, path)


def check_return(ins: Instruction, ids: set[str], keys: set[str], where: str) -> None:
    if "kind" in ins:
        check_fields(ins, {"op", "key", "kind", "path"}, set(), where)
        if ins["kind"] not in ("file", "folder"):
            raise ValidationError(f"{where}: 'kind' must be 'file' or 'folder'")
    else:
        check_fields(ins, {"op", "key", "value"}, set(), where)
    key = ins["key"]
    if not isinstance(key, str) or not key:
        raise ValidationError(f"{where}: 'key' must be a non-empty string")
    if key in keys:
        raise ValidationError(f"{where}: duplicate return key {key!r}")
    keys.add(key)
    if "kind" not in ins:
        check_ref(ins["value"], ids, where, "value")
    elif isinstance(ins["path"], dict):
        check_ref(ins["path"], ids, where, "path")
    else:
        ins["path"] = check_path(ins["path"], where)


def check_literals(args: list[Json], where: str) -> None:
    """Run arguments hold finite numbers only (1e400 decodes to inf, docs/protocol.md §5.1) and nest at
    most MAX_ARG_DEPTH levels; walked without recursion."""
    stack = [(args, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise ValidationError(f"{where}: 'args' holds a number that is not finite")
        if isinstance(v, (list, dict)):
            if depth > MAX_ARG_DEPTH:
                raise ValidationError(f"{where}: 'args' nested deeper than {MAX_ARG_DEPTH} levels")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


def brief(value: object) -> str:
    """A value for an error message: repr() of a deeply nested one would overflow the stack."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return repr(value)[:80]
    return f"<{type(value).__name__}>"


def tensor_byte_count(shape: list[int], itemsize: int) -> int:
    """product(shape) * itemsize, stopping at 2**64: no blob is that long, and the exact
    product of 100 000 huge dimensions takes seconds and has too many digits to print."""
    if 0 in shape:
        return 0
    total = itemsize
    for d in shape:
        total *= d
        if total >= 1 << 64:
            return 1 << 64
    return total


def check_no_unreferenced_blobs(program: ValidProgram, supplied: dict[str, memoryview]) -> None:
    extra = [h for h in supplied if h not in program.blob_kinds]
    if extra:
        raise ValidationError(f"unreferenced blob part(s): {', '.join(extra)}")


def check_tensor_sizes(program: ValidProgram, blobs: Blobs) -> None:
    """docs/protocol.md §7.3: a tensor's blob holds exactly product(shape) * itemsize bytes (checked once present)."""
    for ident, digest, expected in program.tensor_sizes:
        if digest in blobs and len(blobs[digest]) != expected:
            raise ValidationError(f"tensor upload {ident!r} expects "
                                  f"{expected if expected < 1 << 64 else 'at least 2**64'} bytes, "
                                  f"got {len(blobs[digest])}")


# --- 5. the blob store (docs/protocol.md §7.4, 7.5) -----------------------------------------------

def pinned_bytes(data: Buffer) -> int:
    """What keeping `data` alive costs: a view pins the whole buffer it was cut from."""
    owner = data.obj if isinstance(data, memoryview) else data
    return memoryview(owner).nbytes


CACHE_ENTRY_OVERHEAD = 384  # bytes an entry costs beyond its payload (tests/test_bounds.py measures ~330)
UNWRITTEN_LIMIT = 64 << 20  # request bodies kept alive for file blobs not yet in the disk cache


class BlobStore:
    """What survives between requests: blobs by SHA-256, in memory (bytes, tensors and
    libraries) and on disk (file uploads), docs/protocol.md §7.4-7.5.

    A blob is present for a tenant only once that tenant has supplied its bytes: otherwise a
    CACHE_MISS would tell one tenant which files another has sent (a guessed hash answered as
    present is a confirmed guess).  Storage stays shared: each copy records its suppliers.  On a
    server without named tenants every client is the anonymous tenant "", as one."""

    def __init__(self, config: ServerConfig) -> None:
        self.memory = MemoryCache(config.cache_capacity_bytes, config.cache_max_entries)
        self.disk = (DiskCache(config.disk_cache_dir, config.disk_cache_capacity_mbytes << 20,
                               config.disk_cache_max_files)
                     if config.disk_cache_dir and config.disk_cache_capacity_mbytes > 0 else None)
        self.hits = {"memory": 0, "disk": 0}  # lookups of blobs a request referenced but did not supply
        self.misses = {"memory": 0, "disk": 0}
        self.lock = threading.Lock()
        # file blobs on their way to the disk cache: (tenant, hash) -> (data, writes pending), and the
        # bytes of request bodies those views keep alive (charged once per request)
        self.unwritten: dict[tuple[str, str], tuple[Buffer, int]] = {}
        self.unwritten_bytes = 0

    def keep_file_blobs(self, program: ValidProgram, supplied: dict[str, memoryview],
                        tenant: str = "") -> threading.Thread | None:
        """Keep supplied file-upload blobs for the disk cache -> the thread that will write them,
        for `settle_file_blobs`, or None.

        Until the writes land, `resolve` finds the blobs in `unwritten`: a later request never
        misses them.  They start once the request has run (settle_file_blobs): creating hundreds
        of small files takes a core for a while, which the request's worker, creating its own
        copies in the workspace, needs more.
        (Not a daemon: an exiting server finishes its writes rather than leaving staging files.)
        """
        items = [(digest, data) for digest, data in supplied.items() if "file" in program.blob_kinds[digest]]
        if not items or self.disk is None:
            return None
        charge = pinned_bytes(items[0][1])  # every part is a view of the one request body
        with self.lock:
            for digest, data in items:
                key = (tenant, digest)
                self.unwritten[key] = (data, self.unwritten.get(key, (data, 0))[1] + 1)
            self.unwritten_bytes += charge
        return threading.Thread(target=self.write_file_blobs, args=(self.disk, items, charge, tenant),
                                name="kcoral-write-blobs", daemon=False)  # a connection's thread is a daemon

    def write_file_blobs(self, disk: DiskCache, items: list[tuple[str, Buffer]], charge: int, tenant: str) -> None:
        try:
            disk.put_all(items, tenant)
        finally:
            with self.lock:
                for digest, _ in items:
                    data, pending = self.unwritten[tenant, digest]
                    if pending > 1:
                        self.unwritten[tenant, digest] = (data, pending - 1)
                    else:
                        del self.unwritten[tenant, digest]
                self.unwritten_bytes -= charge

    def settle_file_blobs(self, writes: threading.Thread) -> None:
        """Once the request has run, before it is answered: start its disk writes.  Its file blobs
        may still be on their way to the disk when the answer goes out (`resolve` serves them
        from `unwritten` meanwhile), unless the bodies kept alive for that exceed UNWRITTEN_LIMIT:
        then the answer waits for its writes, and the disk, not memory, sets the pace."""
        writes.start()
        with self.lock:
            over = self.unwritten_bytes > UNWRITTEN_LIMIT
        if over:
            writes.join()

    def unwritten_blob(self, digest: str, tenant: str) -> Buffer | None:
        with self.lock:
            entry = self.unwritten.get((tenant, digest))
        return None if entry is None else entry[0]

    def resolve(self, program: ValidProgram, supplied: dict[str, memoryview],
                tenant: str = "") -> tuple[Blobs, list[str]]:
        """docs/protocol.md §7.1: supplied parts go into the memory cache (the disk cache: keep_file_blobs),
        then every referenced blob is looked up, supplied parts first, the rest among those
        `tenant` supplied before -> (blobs, missing)."""
        for digest, part in supplied.items():
            if "memory" in program.blob_kinds[digest]:
                # a small blob must not keep a large request body alive in the cache
                keep = part if len(part) * 2 >= len(typing.cast(Body, part.obj)) else bytes(part)  # a view of the body
                self.memory.put(digest, keep, tenant)
        blobs: Blobs = {}
        missing: list[str] = []
        for digest, kinds in program.blob_kinds.items():
            data: Buffer | None = supplied.get(digest)
            if data is None and "file" in kinds and self.disk is not None:
                data = self.unwritten_blob(digest, tenant)
                data = self.count_lookup("disk", data if data is not None else self.disk.get(digest, tenant))
            if data is None and "memory" in kinds:
                data = self.count_lookup("memory", self.memory.get(digest, tenant))
            if data is None:
                missing.append(digest)
            else:
                blobs[digest] = data
        return blobs, missing

    def count_lookup(self, cache: str, found: Buffer | None) -> Buffer | None:
        """A referenced blob the request did not supply, looked up in `cache` -> `found`, counted."""
        with self.lock:
            (self.hits if found is not None else self.misses)[cache] += 1
        return found

    def keep_sealed(self, blobs: Blobs, sealed: dict[str, memoryview]) -> None:
        """After a run: the large blobs its staging sealed (Execution.stage_blobs) stay cached as those."""
        for digest, view in sealed.items():
            self.memory.replace(digest, blobs[digest], view)

    @contextlib.contextmanager
    def pinned(self, program: ValidProgram) -> Iterator[None]:
        """While a program runs, the memory blobs it uses stay cached (its retry would need them)."""
        memory = [h for h, kinds in program.blob_kinds.items() if "memory" in kinds]
        self.memory.pin(memory)
        try:
            yield
        finally:
            self.memory.unpin(memory)


class MemoryCache:
    """LRU of blob bytes by SHA-256, each with the tenants that supplied it (found only for
    them); pinned entries are never evicted.

    Entries are charged for the memory they keep alive (pinned_bytes) plus CACHE_ENTRY_OVERHEAD
    (key, tuple, buffer object, dict slot: ~330 B, which 20 000 blobs of 8 bytes each would
    otherwise not be charged at all).  Pinned entries wait in `held`, outside the LRU order, so
    eviction only ever pops from the LRU end of `entries`: amortized O(1) per insert.
    """

    def __init__(self, capacity: int, max_entries: int) -> None:
        self.capacity = capacity
        self.max_entries = max_entries
        # hash -> (data, cost, its suppliers); pinned entries wait in `held`
        self.entries: collections.OrderedDict[str, tuple[Buffer, int, frozenset[str]]] = collections.OrderedDict()
        self.held: dict[str, tuple[Buffer, int, frozenset[str]]] = {}
        self.only: dict[str, frozenset[str]] = {}  # one shared set per lone supplier: an entry costs no more
        self.size = 0
        self.pins: collections.Counter[str] = collections.Counter()
        self.evictions = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries) + len(self.held)

    def get(self, digest: str, tenant: str = "") -> Buffer | None:
        with self.lock:
            entry = self.entries.get(digest) or self.held.get(digest)
            if entry is None or tenant not in entry[2]:
                return None
            if digest in self.entries:
                self.entries.move_to_end(digest)
            return entry[0]

    def put(self, digest: str, data: Buffer, tenant: str = "") -> None:
        cost = pinned_bytes(data) + CACHE_ENTRY_OVERHEAD
        if cost * 4 > self.capacity:
            return
        with self.lock:
            for where in (self.entries, self.held):
                if digest in where:
                    kept, kept_cost, suppliers = where[digest]
                    if tenant not in suppliers:
                        where[digest] = (kept, kept_cost, suppliers | self.only_by(tenant))
                    if where is self.entries:
                        self.entries.move_to_end(digest)
                    return
            (self.held if self.pins[digest] else self.entries)[digest] = (data, cost, self.only_by(tenant))
            self.size += cost
            self.evict()

    def replace(self, digest: str, data: Buffer, sealed: memoryview) -> None:
        """The same bytes in a SealedBlob in place of `data`, if the entry still holds it: its suppliers
        stay, and the request body it was a view of need no longer be kept."""
        with self.lock:
            for where in (self.entries, self.held):
                kept, cost, suppliers = where.get(digest, (None, 0, frozenset()))
                if kept is data:
                    where[digest] = (sealed, pinned_bytes(sealed) + CACHE_ENTRY_OVERHEAD, suppliers)
                    self.size += where[digest][1] - cost
            self.evict()

    def only_by(self, tenant: str) -> frozenset[str]:
        return self.only.setdefault(tenant, frozenset((tenant,)))

    def evict(self) -> None:
        """Least recently used unpinned entries go while over the byte or entry budget (lock held)."""
        while self.entries and (self.size > self.capacity or len(self) > self.max_entries):
            self.size -= self.entries.popitem(last=False)[1][1]
            self.evictions += 1

    def pin(self, digests: list[str]) -> None:
        with self.lock:
            self.pins.update(digests)
            for d in digests:
                if d in self.entries:
                    self.held[d] = self.entries.pop(d)

    def unpin(self, digests: list[str]) -> None:
        with self.lock:
            self.pins.subtract(digests)
            for d in digests:
                if self.pins[d] <= 0:
                    del self.pins[d]
                    if d in self.held:
                        self.entries[d] = self.held.pop(d)  # most recently used: its program just ran
            self.evict()


DISK_BLOCK = 4096  # the block of ext4, xfs and tmpfs as formatted by default


def disk_cost(info: os.stat_result) -> int:
    """What a file costs its file system: the blocks it occupies (a 1-byte file takes a whole block), and
    never less than its size in whole DISK_BLOCKs: ext4 reports no blocks at all for a file whose
    blocks writeback is allocating at that moment, and one such read let the cache keep a block more
    than its capacity."""
    return max(info.st_blocks * 512, -(-info.st_size // DISK_BLOCK) * DISK_BLOCK)


def staging_name(directory: str) -> str:
    """A name no other writer uses in `directory`, for a file renamed into place once whole."""
    return f"{directory}/.tmp-{secrets.token_hex(8)}"


class DiskCache:
    """Blobs of file uploads under <dir>/v1/<ab>/<hash>; persistent, verified on read.

    Each tenant that supplied a blob holds a hard link to it, <hash>+<tenant> ("+" alone for
    the anonymous tenant): one copy on disk, and who may find it survives a restart.  A blob is
    found for a tenant only while its link is the same file as <hash>.  Every disk problem is a
    miss or an ignored write: the cache can never make a request fail.  A blob's file is
    charged the blocks it occupies (disk_cost) and counted once, whatever its links: a file
    system runs out of inodes long before thousands of 1-byte blobs fill a byte budget.  Once
    over either budget, eviction takes both down to nine tenths of it, so the directory is
    scanned once per tenth of the budget written, not on every put.
    """

    def __init__(self, directory: str, capacity_bytes: int, max_files: int) -> None:
        self.root = os.path.join(directory, "v1")
        self.capacity = capacity_bytes
        self.max_files = max_files
        self.total = 0
        self.files = 0
        self.evictions = 0
        self.lock = threading.Lock()
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            spread_subdirectories(self.root)  # the <ab> directories, created as blobs arrive
            self.evict()
        except OSError:
            pass

    def path(self, digest: str) -> str:
        return os.path.join(self.root, digest[:2], digest)

    def get(self, digest: str, tenant: str = "") -> bytearray | None:
        path = self.path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with open(fd, "rb") as f:
                info = os.fstat(fd)
                if stat.S_ISREG(info.st_mode):
                    if not os.path.samestat(info, os.lstat(path + "+" + tenant)):
                        return None  # not supplied by this tenant (or supplied before the blob was replaced)
                    data = bytearray(info.st_size)
                    if f.readinto(data) == info.st_size and hashlib.sha256(data).hexdigest() == digest:
                        os.utime(fd)
                        return data
        except FileNotFoundError:
            return None
        except OSError:
            pass
        self.discard(path)  # else put() finds the damaged entry "present" and never replaces it
        return None

    @staticmethod
    def discard(path: str) -> None:
        try:
            os.unlink(path)
        except IsADirectoryError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass

    def put(self, digest: str, data: Buffer, tenant: str = "") -> None:
        if len(data) > self.capacity:
            return
        try:
            target = self.path(digest)
            name = target + "+" + tenant
            if os.path.exists(target):
                os.utime(target)
                self.link(target, name)
            else:
                self.write(target, data, name)
        except OSError:
            pass

    def write(self, target: str, data: Buffer, name: str) -> None:
        """A new blob at `target`, with the tenant's link `name`: written under a staging name,
        linked, then renamed into place.  Six system calls where a folder's 500 small blobs took
        ten each (a tempfile name, its directory made again, the link staged and renamed): 100 ms
        of the front-end's CPU per such request on a VM, twice the rest of its work."""
        directory = os.path.dirname(target)
        staging, flags = staging_name(directory), os.O_WRONLY | os.O_EXCL | NEW_FILE_FLAGS
        try:
            fd = os.open(staging, flags, 0o600)
        except FileNotFoundError:  # the blob's <ab> directory, made as the first blob arrives
            os.makedirs(directory, mode=0o700, exist_ok=True)
            fd = os.open(staging, flags, 0o600)
        try:
            with open(fd, "wb") as f:
                f.write(data)
                f.flush()
                cost = disk_cost(os.fstat(fd))
            try:
                os.link(staging, name, follow_symlinks=False)
                linked = True
            except FileExistsError:  # a link to an earlier copy: replaced below, once this one is in place
                linked = False
            os.replace(staging, target)
        except BaseException:
            os.unlink(staging)
            raise
        if not linked:
            self.link(target, name)
        with self.lock:
            self.total += cost
            self.files += 1
            over = self.total > self.capacity or self.files > self.max_files
        if over:
            self.evict()

    @staticmethod
    def link(target: str, name: str) -> None:
        """Point the tenant's link `name` at `target` (replacing a link to an earlier copy)."""
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.lstat(target), os.lstat(name)):
                return
        staging = staging_name(os.path.dirname(target))
        os.link(target, staging, follow_symlinks=False)
        os.replace(staging, name)

    def put_all(self, items: list[tuple[str, Buffer]], tenant: str = "") -> None:
        for digest, data in items:
            self.put(digest, data, tenant)

    def evict(self) -> None:
        """Remove least recently used blobs, each with its links, while over nine tenths of either
        budget (writers serialised by a lock file)."""
        with self.lock, open(os.path.join(self.root, ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            blobs: dict[tuple[int, int], tuple[int, int, list[str]]] = {}  # file -> (mtime, cost, its names)
            for sub in os.scandir(self.root):
                if sub.is_dir(follow_symlinks=False):
                    for entry in os.scandir(sub.path):
                        if entry.is_file(follow_symlinks=False):
                            info = entry.stat(follow_symlinks=False)
                            blobs.setdefault((info.st_dev, info.st_ino),
                                             (info.st_mtime_ns, disk_cost(info), []))[2].append(entry.path)
            entries = sorted(blobs.values())
            self.total, self.files = sum(cost for _, cost, _ in entries), len(entries)
            if self.total <= self.capacity and self.files <= self.max_files:
                return
            bytes_left, files_left = self.capacity - self.capacity // 10, self.max_files - self.max_files // 10
            for _, cost, paths in entries:
                if self.total <= bytes_left and self.files <= files_left:
                    break
                try:
                    for path in sorted(paths, reverse=True):  # the links first: <hash>+... sorts after <hash>
                        os.unlink(path)
                    self.total -= cost
                    self.files -= 1
                    self.evictions += 1
                except OSError:
                    pass


# --- 6. the pool: slots, the fair order, spare workers (docs/server.md §3) ------------------------

class TenantLimit(Exception):
    """A tenant's request over --max-waiting-per-tenant: answered 429 before it waits."""


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: tickets are told apart by identity
class Ticket:
    """A request waiting for a slot: its tenant's requests in flight when it arrived (its rank), then
    its arrival number."""
    rank: int
    number: int
    tenant: str


class FairQueue:
    """The requests waiting for a slot, one FIFO queue per tenant.  The next slot goes to the head with
    the lowest (rank, arrival): a request's rank is how many of its tenant's requests were in flight
    (running or waiting) when it arrived, so every tenant's k-th request goes before anyone's (k+1)-th,
    and one tenant's backlog delays another's first request by at most one request per slot.  One
    tenant alone is served first come, first served, as before tenants existed."""

    def __init__(self) -> None:
        self.tenants: dict[str, collections.deque[Ticket]] = {}
        self.arrivals = 0

    def __len__(self) -> int:
        return sum(len(line) for line in self.tenants.values())

    def waiting(self, tenant: str) -> int:
        return len(self.tenants.get(tenant, ()))

    def add(self, tenant: str, running: int) -> Ticket:
        self.arrivals += 1
        ticket = Ticket(running + self.waiting(tenant), self.arrivals, tenant)
        self.tenants.setdefault(tenant, collections.deque()).append(ticket)
        return ticket

    def remove(self, ticket: Ticket) -> None:
        line = self.tenants[ticket.tenant]
        line.remove(ticket)
        if not line:
            del self.tenants[ticket.tenant]

    def first(self, eligible: Callable[[str], bool]) -> Ticket | None:
        """The ticket served next among the tenants `eligible` says may take a slot now."""
        heads = [line[0] for tenant, line in self.tenants.items() if eligible(tenant)]
        return min(heads, key=lambda t: (t.rank, t.number), default=None)


class Slot:
    def __init__(self, name: str, gpus: list[int]) -> None:
        self.name = name
        self.gpus = gpus
        self.worker: Worker | None = None
        self.template: SandboxTemplate | None = None  # under --sandbox bubblewrap
        self.spare: SpareWorker | None = None  # the next worker, starting while `worker` serves its last request
        self.tenant = ""  # whose request holds the slot
        self.since: float | None = None  # time.monotonic() it was taken, None while free (Pool.busy_seconds)


class SpareWorker:
    """A slot's next worker, started in the background while the current one serves its last
    request, so that neither its start nor (on GPU) its CUDA context is on the next request's path.

    Unless a request is `queued` for a slot already, its fork waits until that request is answered
    or has run SPARE_DELAY_SECONDS: a short request is over before then, and a fork of the template
    (page tables for all of torch) and the new worker's start would take the CPU its answer needs,
    more than doubling it on two cores.  With one queued the next request is certain, and the slot
    would stand idle for the spare's start after the answer (4-5 ms here, of every request in a burst)."""

    def __init__(self, pool: Pool, slot: Slot, answered: threading.Event, queued: bool) -> None:
        self.worker: Worker | None = None
        self.error = ""
        self.request_done = threading.Event()  # set once the running request is done (with the GPU, too)
        self.thread = pool.helpers.start(self.start, pool, slot, answered, queued, name=f"kcoral-spare-{slot.name}")

    def start(self, pool: Pool, slot: Slot, answered: threading.Event, queued: bool) -> None:
        if not queued:
            answered.wait(SPARE_DELAY_SECONDS)
        try:
            self.worker = pool.start_worker(slot.gpus, before_gpu=self.request_done)
        except Exception as exc:  # reported by whoever takes it; as text, since a traceback kept here
            self.error = f"{type(exc).__name__}: {exc}"  # would keep a failed start's pipes open (a cycle)

    def take(self) -> Worker:
        """The started worker, once it is ready; its start-up failure re-raised."""
        self.thread.join()
        if self.worker is None:
            raise WorkerCrashed(f"the spare worker did not start: {self.error}")
        return self.worker


# SpareWorker, Pool.replace: what waits for a request's answer waits this long at most (a slow
# client's answer may take minutes): several trivial requests; under a third of a warm worker's start on GPU
SPARE_DELAY_SECONDS = 0.05


class Pool:
    """Worker slots, FIFO scheduling, execution of jobs, and worker replacement.

    Callers use: `run_job(job)` -> Outcome (waits for a slot, runs one `Execution`, replaces
    the worker it used), `load()` for /health, `drain()` then `stop()` at shutdown.
    `run_multi_gpu` is run_job's path for gpu_count > 1 (a dedicated worker over n leases)."""

    def __init__(self, config: ServerConfig, device: str, gpu_ids: list[int], gpu_names: dict[int, str],
                 log: EventLog) -> None:
        self.config = config
        self.device = device
        self.gpu_names = gpu_names
        self.log = log
        self.context = multiprocessing.get_context("forkserver")
        prepare_template_imports(config.prepare_timeout_seconds, log=log)
        # torch and tvm_ffi in the template keep their imports off every fresh worker's critical path;
        # GPU workers pin CUDA_VISIBLE_DEVICES after the fork, before CUDA starts (never in the template)
        preload = ["kcoral", "kcoral_worker", "numpy"]
        preload += [m for m in ("torch", "tvm_ffi") if importlib.util.find_spec(m)]
        self.context.set_forkserver_preload(preload)
        start_forkserver(self.context)
        if device == "cuda":
            self.arbiter: LeaseArbiter | None = LeaseArbiter(gpu_ids)
            self.slots = [Slot(f"gpu{g}/w{i}", [g]) for g in gpu_ids
                          for i in range(config.workers_per_gpu)]
        else:
            self.arbiter = None
            self.slots = [Slot(f"cpu/w{i}", []) for i in range(config.num_workers)]
        self.cond = threading.Condition()
        self.idle = []
        self.waiters = FairQueue()
        self.in_progress = 0
        self.running: collections.Counter[str] = collections.Counter()  # requests holding a slot, per tenant
        self.busy: dict[str, float] = collections.defaultdict(float)  # seconds slots were held, per tenant (freed)
        self.closing = False  # draining: no new request is queued
        self.refusing = False  # nor does a queued one get a slot (quarantine: its GPUs may still be in use)
        self.replacing: set[Helper] = set()  # each leaves when done: nothing stays per request
        self.helpers = Helpers()
        if config.sandbox == "bubblewrap":  # probed by resolve_sandbox
            if device == "cuda":
                ensure_gpu_control_nodes(log)
            for slot in self.slots:  # the containers import in parallel
                slot.template = SandboxTemplate(config, device, slot.gpus)
        for slot in self.slots:
            slot.worker = self.start_slot_worker(slot)
            self.idle.append(slot)

    def start_slot_worker(self, slot: Slot) -> Worker:
        """The slot's next worker.  Under the sandbox, from the slot's container, started again if a
        program killed or stopped its template (a container that failed to fork is closed)."""
        try:
            return self.start_worker(slot.gpus, self.live_template(slot))
        except WorkerCrashed:
            if slot.template is None or slot.template.alive():
                raise
            return self.start_worker(slot.gpus, self.live_template(slot))

    def start_worker(self, gpus: list[int], template: SandboxTemplate | None = None,
                     before_gpu: threading.Event | None = None) -> Worker:
        """A ready worker; on GPU, its CUDA context created under the lease (a spare's only once
        `before_gpu` is set: the request it is the spare for goes first)."""
        worker = Worker(self, gpus, template=template)  # pinning and imports are host work: no lease yet
        if self.arbiter is not None:
            if before_gpu is not None:
                before_gpu.wait()
            # context creation must not overlap someone else's measurement
            self.arbiter.acquire(STARTUP_OWNER, gpus)
            try:
                worker.initialize(self.gpu_names[gpus[0]])
            finally:
                self.arbiter.release(STARTUP_OWNER, gpus)
        return worker

    def live_template(self, slot: Slot) -> SandboxTemplate | None:
        """The slot's sandbox template, a new one if the old one is gone; None without a sandbox."""
        if slot.template is not None and not slot.template.alive():
            slot.template.kill()
            slot.template = SandboxTemplate(self.config, self.device, slot.gpus)
        return slot.template

    def run_job(self, job: Job) -> Outcome:
        """Run a job on the next free slot -> Outcome (503 when none frees up in time)."""
        start = time.monotonic()
        try:
            slot = self.acquire(self.config.worker_wait_timeout_seconds, job.tenant, job.client_gone)
        except TenantLimit as exc:
            return Outcome(429, "busy", str(exc))
        if slot is None:  # nothing ran: a cohort's HAProxy retries a 503 on another node
            return Outcome(503, "busy", "server saturated" if not self.closing else "server is shutting down")
        queue_ms = job.proxy_queue_ms + (time.monotonic() - start) * 1e3
        retire, cleanup = True, None
        try:
            if slot.worker is not None and not slot.worker.process.is_alive():
                # it died while idle (a program killed the forkserver, say): a fresh one, not a 500
                self.end_worker(slot.worker)
                slot.worker = None
                try:
                    slot.worker = self.start_slot_worker(slot)
                except Exception as exc:
                    self.log.event("worker_replace_failed", "ERROR", worker_id=slot.name, error=str(exc))
            if slot.worker is None:
                return Outcome(500, "engine", "worker crashed", worker_id=slot.name)
            gpu_count = job.program.options.get("gpu_count")
            if gpu_count:
                outcome, retire = self.run_multi_gpu(slot, job, gpu_count, queue_ms), False
            else:
                self.start_spare(slot, job.answered)
                execution = Execution(self, slot.worker, slot.gpus, job, queue_ms)
                execution.keep_workspace = True  # a retired worker's goes after the answer, with the worker
                try:
                    outcome, retire = execution.run()
                finally:
                    if slot.spare is not None:
                        slot.spare.request_done.set()
                    if retire:  # removed on the replacement thread, once the worker's tree is gone
                        cleanup = execution.remove_root if slot.worker.template is None else None
                    else:
                        execution.remove_workspace()
            outcome.worker_id = slot.name
            return outcome
        finally:
            self.release(slot, retire, cleanup, job.answered)

    def start_spare(self, slot: Slot, answered: threading.Event) -> None:
        """docs/server.md §1.3: when this request is the worker's last, start the next one now.  Not in a
        sandbox, whose container forks one worker at a time (its next one waits for this one's exit)."""
        limit, worker = self.config.max_requests_per_worker, slot.worker
        if (slot.spare is None and slot.template is None and worker is not None and limit
                and worker.served + 1 >= limit and not self.closing):
            with self.cond:
                queued = len(self.waiters) > 0
            slot.spare = SpareWorker(self, slot, answered, queued)

    def acquire(self, timeout: float, tenant: str = "", client_gone: Callable[[], bool] | None = None) -> Slot | None:
        """Wait for an idle slot, in the FairQueue's order; None after `timeout` seconds, when the
        pool was draining already, or once it refuses the queued (`drain`).  TenantLimit when the
        tenant has --max-waiting-per-tenant waiting already; ClientGone when `client_gone` says so
        (checked every CLIENT_CHECK_SECONDS)."""
        deadline = time.monotonic() + timeout
        limit = self.config.max_waiting_per_tenant
        with self.cond:
            if self.closing:
                return None
            if limit and self.waiters.waiting(tenant) >= limit:
                raise TenantLimit(f"tenant {tenant or '(anonymous)'} has {limit} requests waiting already, the "
                                  "most it may (--max-waiting-per-tenant); retry once one has started")
            ticket = self.waiters.add(tenant, self.running[tenant])

            def turn() -> Slot | None:
                if not self.idle or self.waiters.first(self.may_start) is not ticket:
                    return None
                slot = min(self.idle, key=self.gpu_load)
                self.idle.remove(slot)
                self.in_progress += 1
                self.running[tenant] += 1
                slot.tenant, slot.since = tenant, time.monotonic()
                return slot

            return wait_turn(self.cond, self.waiters, ticket, turn, deadline, lambda: self.refusing,
                             client_gone, "queue")

    def may_start(self, tenant: str) -> bool:
        """Whether the tenant is under --max-running-per-tenant.  Called with the lock held."""
        limit = self.config.max_running_per_tenant
        return not limit or self.running[tenant] < limit

    def gpu_load(self, slot: Slot) -> tuple[int, int]:
        """Prefer the GPU with the fewest assigned requests (ties: configured order)."""
        busy = [s for s in self.slots if s not in self.idle]
        return sum(1 for s in busy if s.gpus == slot.gpus), self.slots.index(slot)

    def release(self, slot: Slot, retire: bool, cleanup: Callable[[], None] | None = None,
                answered: threading.Event | None = None) -> None:
        """Give the slot back; a retired worker is disposed of (and `cleanup` run) on the replacement
        thread, once the request is `answered`."""
        if retire:
            retired, slot.worker = slot.worker, None
            with self.cond:  # held until it is listed: replace() takes it off the list at its end
                self.free(slot)
                self.replacing.add(self.helpers.start(self.replace, slot, retired, cleanup, answered,
                                                      name=f"kcoral-replace-{slot.name}"))
        else:
            with self.cond:
                self.free(slot)
                self.idle.append(slot)
                self.cond.notify_all()

    def free(self, slot: Slot) -> None:
        """The slot's request is done: its time held counts to its tenant's busy seconds.  Called with the lock held."""
        self.in_progress -= 1
        self.running[slot.tenant] -= 1
        if slot.since is not None:
            self.busy[slot.tenant] += time.monotonic() - slot.since
        slot.since = None

    def end_worker(self, worker: Worker, grace: float = 0, orphans: bool = False) -> bool:
        """The one way a worker ends once it has served (or failed to serve) a request: kill its
        tree; its GPUs are quarantined when the kill cannot be confirmed.
        -> whether it is confirmed gone.  A tree still in its exit (Worker.exiting: a kernel
        spinning at the kill keeps the driver busy) runs no program code any more: it counts as
        gone, and the slot's next worker, whose CUDA start under the lease probes the GPU,
        decides (replace)."""
        gone = worker.kill(grace, orphans=orphans)
        if not gone and self.arbiter is not None:
            if worker.exiting:
                self.log.event("worker_exit_slow", "WARNING", gpu_ids=list(worker.gpus),
                               reason="killed, its process tree is still in its exit (the GPU's teardown)")
                return True
            self.quarantine(worker.gpus, "a worker's process tree outlived SIGKILL")
        return gone

    def replace(self, slot: Slot, retired: Worker | None = None, cleanup: Callable[[], None] | None = None,
                answered: threading.Event | None = None) -> None:
        """Off the request's critical path: once the request is `answered` (its answer needs the CPU),
        dispose of the retired worker (its tree and pipe, then `cleanup`: its workspace) and put the
        slot's next worker in place, the spare started during the request if there is one.  On GPU the
        disposal comes first: a GPU whose old tree is not confirmed gone is quarantined and gets no
        worker.  On CPU nothing waits on that verdict, so a slot with a spare serves again first and the
        disposal (the retired worker's exit: milliseconds of unmapping) follows.  (The retired worker's
        program was stopped before the answer: Execution.retire_worker.)"""
        if answered is not None:
            answered.wait(SPARE_DELAY_SECONDS)
        spare, slot.spare = slot.spare, None
        serve_first = spare is not None and self.arbiter is None
        if serve_first:
            self.install_next_worker(slot, spare, retired, gone=True)
        gone = retired is None or self.end_worker(retired)
        if cleanup is not None:
            cleanup()
        if not serve_first:
            self.install_next_worker(slot, spare, retired, gone)
        with self.cond:
            self.replacing.discard(self.helpers.current())

    def install_next_worker(self, slot: Slot, spare: SpareWorker | None, retired: Worker | None, gone: bool) -> None:
        """The slot's next worker in place (none on a GPU whose retired tree is not `gone`), then the slot idle."""
        try:
            if not gone and self.arbiter is not None:  # its GPU is quarantined: no replacement there
                if spare is not None:
                    self.end_worker(spare.take())
                slot.worker = None
            else:
                slot.worker = self.next_worker(slot, spare)
                self.log.metrics.add("kcoral_worker_replacements_total")
        except Exception as exc:
            slot.worker = None
            self.log.event("worker_replace_failed", "ERROR", worker_id=slot.name, error=str(exc))
            if retired is not None and retired.exiting and self.arbiter is not None:  # the probe failed
                self.quarantine(slot.gpus, f"after a worker's slow exit its GPU failed the probe: {exc}")
        with self.cond:
            self.idle.append(slot)
            self.cond.notify_all()

    def next_worker(self, slot: Slot, spare: SpareWorker | None) -> Worker:
        """The spare if it started, else a worker started now (a spare's failure may have been passing)."""
        if spare is not None:
            try:
                return spare.take()
            except Exception as exc:
                self.log.event("spare_worker_failed", "WARNING", worker_id=slot.name, error=str(exc))
        return self.start_slot_worker(slot)

    def quarantine(self, gpus: list[int], reason: str) -> None:
        """docs/server.md §2.1: a tree whose exit is unconfirmed may still use its GPUs.  Nobody gets
        them again, and the pool begins shutting down (later requests: 503 busy)."""
        self.log.event("gpu_quarantined", "ERROR", gpu_ids=list(gpus), reason=reason)
        assert self.arbiter is not None  # only GPU pools quarantine (end_worker)
        self.arbiter.quarantine(gpus)
        self.drain(refuse_queued=True)

    def run_multi_gpu(self, slot: Slot, job: Job, count: int, queue_ms: float) -> Outcome:
        """docs/protocol.md §8.9: a dedicated worker that sees `count` GPUs, started under all their leases.
        Under the sandbox, its own container showing exactly these GPUs: a cold start of seconds,
        begun before the leases are waited for (for the GPUs most likely granted; started again in
        the rare case others free up first), so that nobody's lease waits for a container."""
        assert self.arbiter is not None  # a CPU server has no GPUs to count: check_gpu_count refused gpu_count
        sandboxed = self.config.sandbox == "bubblewrap"
        expected = self.arbiter.likely_grant(count)
        template = SandboxTemplate(self.config, self.device, expected) if sandboxed else None
        try:
            try:
                gpus, wait_ms = self.arbiter.acquire(job.request_id, count=count, client_gone=job.client_gone)
            except LeaseRefused as exc:
                return Outcome(503, "busy", str(exc))
            if template is not None and set(gpus) != set(expected):
                template.kill()
                template = SandboxTemplate(self.config, self.device, gpus)
            return self.run_dedicated_worker(job, gpus, wait_ms, queue_ms, template)
        finally:
            if template is not None:
                template.kill()

    def run_dedicated_worker(self, job: Job, gpus: list[int], wait_ms: float, queue_ms: float,
                             template: SandboxTemplate | None) -> Outcome:
        assert self.arbiter is not None  # as in run_multi_gpu
        started = time.monotonic()
        step_timeout = min(WORKER_STEP_SECONDS, job.timeout)  # start-up is part of the request's timeout
        try:
            worker = Worker(self, gpus, step_timeout, template=template)
            worker.initialize(self.gpu_names[gpus[0]], step_timeout)
        except WorkerStartTimeout:
            return Outcome(504, "timeout", "execution timed out while the multi-GPU worker started")
        except WorkerCrashed:
            return Outcome(500, "engine", "multi-GPU worker failed to start")
        finally:
            self.arbiter.release(job.request_id, gpus)
        startup_s = time.monotonic() - started
        if startup_s >= job.timeout:
            self.end_worker(worker)
            return Outcome(504, "timeout", "execution timed out")
        job.timeout -= startup_s
        execution = Execution(self, worker, gpus, job, queue_ms)
        execution.lease_wait_ms, execution.lease_held_ms = wait_ms, startup_s * 1e3
        execution.single_use = True  # so it exits under the lease, inside the request
        outcome, _ = execution.run()
        self.end_worker(worker)
        if outcome.body is not None:
            outcome.body["gpu_ids"] = list(gpus)
            outcome.body["gpu_count"] = len(gpus)
        return outcome

    def load(self, tenant: str = "") -> dict[str, Any]:
        # A slot whose worker is being replaced still counts: it is back within tens of ms, and
        # with one request per worker a 1-worker node would otherwise read as full after every
        # request (a load balancer sizing or checking on it would take it out of rotation).
        with self.cond:
            capacity = 0 if self.closing else len(self.slots)
            load: dict[str, Any] = {"request_capacity": capacity, "requests_in_progress": self.in_progress,
                                    "requests_waiting": len(self.waiters)}
            if tenant:  # a named tenant's caller also sees its own share
                load["tenant"] = {"name": tenant, "requests_running": self.running[tenant],
                                  "requests_waiting": self.waiters.waiting(tenant)}
            return load

    def busy_seconds(self, tenants: Iterable[str]) -> dict[str, float]:
        """{tenant: seconds its requests have held slots}, the ones holding one now included up to now, so
        that rate() of it is the tenant's share of the node's slots however long its requests run."""
        now = time.monotonic()
        with self.cond:
            held = [(slot.tenant, now - slot.since) for slot in self.slots if slot.since is not None]
            return {name: self.busy[name] + sum(seconds for tenant, seconds in held if tenant == name)
                    for name in tenants}

    def tenant_load(self, tenants: Iterable[str]) -> dict[str, tuple[int, int]]:
        """{tenant: (requests running, requests waiting)} for /metrics."""
        with self.cond:
            return {name: (self.running[name], self.waiters.waiting(name)) for name in tenants}

    def drain(self, refuse_queued: bool = False) -> None:
        """Capacity 0: new requests are refused; those admitted run to the end, the queued ones
        too (a graceful shutdown shows no client a 503 for a request it took: docs/server.md §8),
        unless `refuse_queued` (a quarantine, whose GPUs may never be free again: 503 busy, which
        a balancer retries elsewhere)."""
        with self.cond:
            self.closing = True
            self.refusing = self.refusing or refuse_queued
            self.cond.notify_all()
        if self.arbiter is not None and refuse_queued:
            self.arbiter.refuse_waiters()

    def stop(self) -> None:
        """Once drained and idle: end every worker and sandbox (and wait for replacements under way)."""
        with self.cond:
            running = list(self.replacing)
        for helper in running:
            helper.join()
        for slot in self.slots:
            if slot.spare is not None:  # a request that ended in a crash leaves its slot's spare unused
                with contextlib.suppress(Exception):
                    slot.spare.take().stop(self.config.worker_termination_grace_seconds)
            if slot.worker is not None:
                slot.worker.stop(self.config.worker_termination_grace_seconds)
            if slot.template is not None:
                slot.template.kill()


# --- 7. one execution: a request's conversation with its worker, and its output -------------------

class SealedBlob(mmap.mmap):
    """A blob alone in a sealed memfd, where kcoral_worker.MappedBytes maps it (blob_layout), read here
    through a read-only mapping.  Staging makes one of each large blob (Execution.stage_blobs) and
    the memory cache then keeps it instead of the request body's bytes (BlobStore.keep_sealed): a
    later request hands the worker the same file.  Two fds each (the mapping's own): the cache
    holds at most its capacity over kcoral_worker.SEALED_BLOB_BYTES of them, 1024 by default."""
    fd: int

    @classmethod
    def of(cls, data: Buffer) -> memoryview:
        """`data` in a SealedBlob: itself if it is one's view, else a new one holding a copy -> the blob's view."""
        view = memoryview(data).cast("B")
        if isinstance(view.obj, SealedBlob):
            return view
        fd = os.memfd_create("kcoral-blobs", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            start = kcoral_worker.MappedBytes.HEADER
            os.ftruncate(fd, start + view.nbytes + 1)
            write_all_at(fd, view, start)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, STAGED_SEALS)
            blob = cls(fd, start + view.nbytes + 1, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        blob.fd = fd
        return memoryview(blob)[start:start + view.nbytes]

    def __del__(self) -> None:
        os.close(self.fd)


class Execution:
    """One job on one worker: the message loop, timeout, crash attribution, teardown.

    Callers use: `run()` -> (Outcome, retire the worker?).  In order it sends the JobRequest
    (`send_job`), follows the worker's messages (`converse`: the blobs, when the worker asks for
    them, the returned values, the lease), turns a timeout, crash or oversized answer into its
    error, and removes the workspace."""
    lease_since: float | None  # time.monotonic() when the GPU lease was granted; None while not held
    retiring: bool  # the worker exits after this request (JobRequest.retire, or it reported a poisoned context)
    reader: OutputReader | None  # reads the program's stdout and stderr, when captured
    last_index: int | None  # the instruction the worker last reported starting (reported_start)
    progress: int | None  # the progress pipe's read end (kcoral_worker.announced_by_record)
    results: dict[str, Json]  # return key -> encoded value
    parts: list[Buffer]  # the raw parts those values refer to
    output: tuple[str, str, bool, bool] | None  # (stdout, stderr, truncated flags), once collected
    truncation: dict[str, Json]  # with `output`: OutputReader.truncation_fields
    job_index: dict[str, tuple[int, int, int]]  # blob_index: where stage_blobs puts each blob
    staged_files: list[int]  # blob_index: the staged files' sizes

    def __init__(self, pool: Pool, worker: Worker, gpus: list[int], job: Job, queue_ms: float) -> None:
        self.pool = pool
        self.config = pool.config
        self.worker = worker
        self.gpus = gpus
        self.job = job
        self.queue_ms = queue_ms
        self.lease_wait_ms = 0.0
        self.lease_held_ms = 0.0
        self.lease_since = None
        self.single_use = False
        self.keep_workspace = False  # True: the caller removes it (remove_workspace), after the answer
        self.last_index = None
        self.staged = False  # stage_blobs ran
        self.results = {}
        self.parts = []
        self.response_bytes = 0  # announced so far: returned parts and the frames describing them
        self.return_keys = {ins["key"] for ins in job.program.instructions if ins["op"] == "return"}
        # <root>/work is the program's working directory (its blobs are staged in a memfd: stage_blobs).
        # In a sandbox it is in the worker's own tmpfs, SANDBOX_ROOT, which no host path reaches.
        if worker.template is None:
            self.root: str | None = tempfile.mkdtemp(prefix=workspace_prefix(os.getpid()))
            spread_subdirectories(self.root)
        else:
            self.root = None
        self.inside = self.root or SANDBOX_ROOT

    def run(self) -> tuple[Outcome, bool]:
        """-> (Outcome, whether the worker must be retired)."""
        started = time.monotonic()
        self.deadline = started + self.job.timeout
        self.last_moment = started + 2 * self.job.timeout
        self.reader, self.output, self.program_done, self.progress = None, None, False, None
        self.oom_kills = oom_kill_count()
        # with a delegated cgroup the kernel holds the limit; without, the front-end samples
        root = delegated_cgroup(self.config)
        self.cgroup = RequestCgroup(root, self.job.request_id, self.worker.pid, self.config) if root else None
        limit = 0 if self.cgroup else self.config.memory_limit_bytes or 0
        self.memory = MemoryWatch(self.pool.helpers, self.worker.pid, limit, sandboxed=self.worker.template is not None)
        try:
            self.send_job()
            error, retire = self.converse(), False
            self.program_done = True
            self.worker.served += 1
            if self.retiring:
                error, retire = self.retire_worker(error), True
            elif group_members(self.worker.pid, exclude=(self.worker.pid,)):
                error, retire = self.background_processes(error), True
        except TimeoutError:
            if not self.end_worker_under_lease():
                return Outcome(500, "engine", "the timed-out worker could not be confirmed gone"), True
            return self.timeout_outcome(), True
        except WorkerCrashed:
            exit_code = self.exit_code_of_crashed_worker()
            self.count_crash(exit_code)
            if not self.end_worker_under_lease():
                return Outcome(500, "engine", "the crashed worker could not be confirmed gone"), True
            if self.last_index is None:
                return Outcome(500, "engine", f"worker crashed: {self.crash_cause(exit_code)}"), True
            error, retire = self.crash_error(exit_code), True
        except ResponseTooLarge:  # the program ran; what it returned is dropped (docs/protocol.md §11)
            if not self.end_worker_under_lease():
                return Outcome(500, "engine", "the worker could not be confirmed gone"), True
            return Outcome(500, "response_too_large", "results exceed the configured response-size limit"), True
        except LeaseRefused as exc:  # its GPU was quarantined while it waited
            self.pool.end_worker(self.worker, self.config.worker_termination_grace_seconds, orphans=True)
            return Outcome(503, "busy", str(exc)), True
        except ClientGone:  # nobody waits for the answer: the worker goes as a timed-out one does
            self.end_worker_under_lease()
            raise
        finally:
            self.memory.stop()
            if self.cgroup is not None:
                self.cgroup.leave(self.worker.pid, self.pool.log)
            self.release_lease()
            if self.progress is not None:
                os.close(self.progress)
            output = self.captured_output()
            if not self.keep_workspace:
                self.remove_workspace()
        body = {"status": "FAILED" if error else "COMPLETED", "request_id": self.job.request_id,
                "queue_ms": self.queue_ms, "elapsed_ms": (time.monotonic() - started) * 1e3,
                "lease_wait_ms": self.lease_wait_ms, "lease_held_ms": self.lease_held_ms,
                "stdout": output[0], "stderr": output[1],
                "stdout_truncated": output[2], "stderr_truncated": output[3], **self.truncation,
                "results": self.results}
        if error:
            body["error"] = error
        return Outcome(body=body, parts=self.parts), retire

    def captured_output(self) -> tuple[str, str, bool, bool]:
        """(stdout, stderr, stdout_truncated, stderr_truncated), collected once the worker is gone."""
        if self.output is None:
            self.output = self.reader.result(wait=2.0) if self.reader else ("", "", False, False)
            self.truncation = self.reader.truncation_fields(self.config.max_output_limit_bytes) if self.reader else {}
        return self.output

    def timeout_outcome(self) -> Outcome:
        """504 naming the limit and the instruction that was running (or the teardown after it), with
        the output captured until the kill: what a user needs to tell a hang from a slow loop."""
        self.reported_start()
        output = dict(zip(("stdout", "stderr", "stdout_truncated", "stderr_truncated"), self.captured_output()))
        output.update(self.truncation)
        message = f"execution timed out after {self.job.timeout:g} s"
        if self.last_index is None:
            return Outcome(504, "timeout", f"{message} before the first instruction started", body_fields=output)
        ins = self.job.program.instructions[self.last_index]
        label = f"instruction {self.last_index} ({ins['op']} {ins.get('id', ins.get('key'))!r:.80})"
        where = f"in the worker's teardown after {label}" if self.program_done else f"in {label}"
        fields = {"instruction_index": self.last_index, "instruction_op": ins["op"], "instruction_id": ins.get("id")}
        return Outcome(504, "timeout", f"{message} {where}", error_fields=fields, body_fields=output)

    def send_job(self) -> None:
        program = self.job.program
        limit = self.config.max_requests_per_worker
        if self.root is not None:
            make_spread_directory(os.path.join(self.root, "work"))
        request = kcoral_worker.JobRequest(
            instructions=program.instructions,
            retire=self.single_use or (bool(limit) and self.worker.served + 1 >= limit),
            workspace=os.path.join(self.inside, "work"),
            blob_index=self.blob_index(), capture=self.job.output_limit > 0,
            grace=self.config.worker_termination_grace_seconds, max_response_bytes=self.config.max_response_bytes,
            max_response_parts=self.config.max_response_parts,
            progress=any(map(kcoral_worker.announced_by_record, range(len(program.instructions)))))
        self.retiring = request.retire
        conn = self.worker.conn
        try:
            kcoral_worker.send_message(conn, request)
            if request.capture:
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                for fd in (out_w, err_w):  # 16x fewer wake-ups than the default 64 KiB for a chatty program
                    with contextlib.suppress(OSError):  # over the user's pipe quota: the default size
                        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
                self.reader = OutputReader(self.pool.helpers, out_r, err_r, self.job.output_limit, self.job.on_output)
                try:
                    for fd in (out_w, err_w):
                        reduction.send_handle(conn, fd, self.worker.pid)
                finally:  # the reader sees end-of-file once the worker's copies are gone too
                    os.close(out_w)
                    os.close(err_w)
            if request.progress:
                self.progress, progress_w = os.pipe()
                os.set_blocking(self.progress, False)
                try:
                    reduction.send_handle(conn, progress_w, self.worker.pid)
                finally:
                    os.close(progress_w)
        except OSError as exc:
            raise WorkerCrashed(str(exc)) from exc

    def reported_start(self) -> None:
        """Take the progress pipe's announcements into last_index: the highest index reported on
        either channel is the last instruction started (kcoral_worker.announced_by_record).  The
        worker is gone (or done); an index out of range or not later than the last message is
        ignored (the worker ran uploaded code, which may have written there).  Reads are bounded:
        a process the program forked may still hold the pipe."""
        if self.progress is None or self.last_index is None:
            return
        tail = b""
        with contextlib.suppress(OSError):  # BlockingIOError: drained
            for _ in range(PROGRESS_READS):
                chunk = os.read(self.progress, 1 << 16)
                if not chunk:
                    break
                tail = (tail + chunk)[-kcoral_worker.PROGRESS_RECORD.size:]
        if len(tail) == kcoral_worker.PROGRESS_RECORD.size:
            (index,) = kcoral_worker.PROGRESS_RECORD.unpack(tail)
            instructions = self.job.program.instructions
            if self.last_index < index < len(instructions):
                self.last_index = index

    def blob_index(self) -> dict[str, tuple[int, int, int]]:
        """{hash: (file, offset, size)}: where stage_blobs puts each of the job's blobs
        (kcoral_worker.blob_layout), kept for it with the files' sizes."""
        sizes = [memoryview(data).nbytes for data in self.job.blobs.values()]
        places, self.staged_files = kcoral_worker.blob_layout(sizes)
        self.job_index = {digest: (*place, size) for digest, place, size in zip(self.job.blobs, places, sizes)}
        return self.job_index

    def stage_blobs(self) -> None:
        """Answer the worker's StageBlobs: the job's blobs, as blob_index places them, in sealed
        memfds passed to it, file 0 first.  Asked for once, when the program first needs a blob's
        bytes: a program that only returns its `bytes` uploads has nothing copied (the answer
        sends the front-end's own copies).

        The smaller blobs share one file, because creating a file costs far more than writing it
        (500 small uploads would be 500 inodes); each large one is a SealedBlob of its own, which
        the memory cache then keeps in place of the request body's bytes (Job.sealed): a later
        request's worker gets the same file, with no copy at all.  In memory, because the blobs
        are in memory already (a disk file's page cache is slower to fill, docs/performance.md),
        and passed as fds, so they have no path anyone could open or swap.  The seals forbid any
        write, resize or unsealing: what the worker reads is what the front-end staged, whatever
        the program does with the fd.
        """
        if self.staged or not self.job.blobs:
            raise WorkerCrashed("protocol violation: blobs asked for twice, or by a job without any")
        self.staged = True
        try:
            for fd in self.staged_fds():
                info = os.fstat(fd)
                self.memory.exempt.add((info.st_dev, info.st_ino))  # sealed, the size the request was
                reduction.send_handle(self.worker.conn, fd, self.worker.pid)
        except OSError as exc:
            raise WorkerCrashed(str(exc)) from exc

    def staged_fds(self) -> Iterator[int]:
        """The staged files' fds, by file number, each open while it is passed."""
        for number, size in enumerate(self.staged_files):
            held = [digest for digest, (file, _, _) in self.job_index.items() if file == number]
            if self.job_index[held[0]][2] >= kcoral_worker.SEALED_BLOB_BYTES:  # a file of its own
                # the answer still sends job.blobs' resident pages; the cache takes the sealed copy
                sealed = self.job.sealed[held[0]] = SealedBlob.of(self.job.blobs[held[0]])
                yield typing.cast(SealedBlob, sealed.obj).fd
                continue
            fd = os.memfd_create("kcoral-blobs", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, size)
                for digest in held:
                    write_all_at(fd, self.job.blobs[digest], self.job_index[digest][1])
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, STAGED_SEALS)
                yield fd
            finally:  # the worker holds its own copy of the fd: the memory goes with its last reference
                os.close(fd)

    def converse(self) -> ErrorObject | None:
        """Follow the worker's messages until it reports the program done; -> error or None.

        Each message is checked against what the protocol allows at this point (an instruction
        index in range, a return key of the program's not seen yet, a lease asked for only when
        not held, sizes within the response budget): anything else is WorkerCrashed."""
        conn = self.worker.conn
        while True:
            self.wait_for_worker()
            room, sizes = self.config.max_response_bytes - self.response_bytes, list[int]()
            try:
                message = receive_checked(conn, WORKER_MESSAGES, self.deadline, "",
                                          CONTROL_MESSAGE_BYTES + max(room, 0), sizes)
            except WorkerStartTimeout:
                raise TimeoutError from None
            match message:
                case kcoral_worker.InstructionStarted():
                    if not 0 <= message.index < len(self.job.program.instructions):
                        raise WorkerCrashed("protocol violation: an instruction index out of range")
                    self.last_index = message.index
                case kcoral_worker.ReturnValue():
                    self.receive_return(message, sizes[0])
                case kcoral_worker.StageBlobs():
                    self.stage_blobs()
                case kcoral_worker.AcquireLease():
                    if self.pool.arbiter is None or self.lease_since is not None:
                        raise WorkerCrashed("protocol violation: a lease asked for while held, or on a CPU worker")
                    self.hold_lease(client_gone=self.job.client_gone)
                    try:
                        kcoral_worker.send_message(conn, kcoral_worker.LeaseGranted())
                    except OSError as exc:
                        raise WorkerCrashed(str(exc)) from exc
                case kcoral_worker.ReleaseLease():
                    if self.lease_since is None:
                        raise WorkerCrashed("protocol violation: a lease released while not held")
                    self.release_lease()
                case kcoral_worker.RequestDone():
                    self.retiring = self.retiring or message.poisoned
                    return self.attribute_gpu_access(self.checked_error(message.error))

    def wait_for_worker(self) -> None:
        """Wait until the worker has something to say (or the deadline passes: `receive_checked` then raises the
        timeout), checking every CLIENT_CHECK_SECONDS that the client is still there (ClientGone)."""
        client_gone = self.job.client_gone
        while client_gone is not None and time.monotonic() < self.deadline:
            try:
                kcoral_worker.wait_readable(self.worker.conn.fileno(),
                                            min(self.deadline, time.monotonic() + CLIENT_CHECK_SECONDS))
                return
            except TimeoutError:
                if client_gone():
                    raise ClientGone("running") from None

    def receive_return(self, message: kcoral_worker.ReturnValue, frame_bytes: int) -> None:
        """Take one returned value and its parts off the pipe, counting every announced byte
        against --max-response-bytes (and every part against --max-response-parts) before
        reading it: a worker cannot make the front-end hold more than the response may carry."""
        if message.key not in self.return_keys or message.key in self.results:
            raise WorkerCrashed("protocol violation: a return key the program does not have, or twice")
        self.response_bytes += frame_bytes  # about what the value's JSON adds to the response
        if self.response_bytes > self.config.max_response_bytes:
            raise ResponseTooLarge
        sent: list[tuple[int, int]] = []  # (index in self.parts, size) of the parts that follow on the pipe
        for part in message.parts:  # a size to read off the pipe, or a blob of ours
            if len(self.parts) >= self.config.max_response_parts:
                raise ResponseTooLarge
            if isinstance(part, str):
                if part not in self.job.blobs:
                    raise WorkerCrashed(f"protocol violation: an unknown blob {part!r:.80} returned")
                size = memoryview(self.job.blobs[part]).nbytes
            else:
                size = part
            if size < 0 or self.response_bytes + size > self.config.max_response_bytes:
                raise ResponseTooLarge
            self.response_bytes += size
            if isinstance(part, str):  # returned unchanged
                self.parts.append(self.job.blobs[part])
            else:
                sent.append((len(self.parts), size))
                self.parts.append(b"")
        try:  # all of them in one read: a folder's 500 files are not 500 reads
            data = memoryview(recv_raw(self.worker.conn, sum(size for _, size in sent), self.deadline))
        except (EOFError, OSError) as exc:  # TimeoutError included: a stalled part is no answer
            raise WorkerCrashed(f"the pipe broke in a returned part: {exc}") from None
        offset = 0
        for index, size in sent:
            self.parts[index] = data[offset:offset + size]
            offset += size
        self.results[message.key] = message.encoded

    def hold_lease(self, deadline: float | None = None, client_gone: Callable[[], bool] | None = None) -> None:
        """Wait for the lease, until `deadline` (default: the request's last moment).  Lease waits
        do not consume the timeout, up to one timeout's worth in all: a request waiting behind
        others still ends by twice its timeout (docs/server.md §2.3)."""
        assert self.pool.arbiter is not None  # callers checked: only GPU workers ask for the lease
        asked_at = time.monotonic()
        _, wait_ms = self.pool.arbiter.acquire(self.job.request_id, self.gpus, deadline=deadline or self.last_moment,
                                               client_gone=client_gone)
        self.lease_wait_ms += wait_ms
        self.deadline = min(self.deadline + time.monotonic() - asked_at, self.last_moment)
        self.lease_since = time.monotonic()

    def release_lease(self) -> None:
        if self.lease_since is not None:
            assert self.pool.arbiter is not None  # held: hold_lease checked
            self.pool.arbiter.release(self.job.request_id, self.gpus)
            self.lease_held_ms += (time.monotonic() - self.lease_since) * 1e3
            self.lease_since = None

    def checked_error(self, error: ErrorObject | None) -> ErrorObject | None:
        """A FAILED result's error object as the worker reported it, held to its shape
        (docs/protocol.md §9.7): it goes into the response and the log."""
        if error is None:
            return None
        shape: dict[str, type | tuple[type, ...]] = {
            "kind": str, "message": str, "instruction_index": int, "instruction_op": str,
            "instruction_id": (str, type(None)), "traceback": str}
        extra: dict[str, type | tuple[type, ...]] = {"cuda_call": str, "location": str, "lease_time": (int, float)}
        instructions = self.job.program.instructions
        if (not set(shape) <= set(error) <= set(shape) | set(extra)
                or not all(isinstance(error[k], t) and type(error[k]) is not bool
                           for k, t in {**shape, **extra}.items() if k in error)
                or error["kind"] not in kcoral_worker.ERROR_KINDS
                or not 0 <= error["instruction_index"] < len(instructions)):
            raise WorkerCrashed("protocol violation: a malformed error object")
        return error

    def attribute_gpu_access(self, error: ErrorObject | None) -> ErrorObject | None:
        """docs/server.md §6: name the request that held our GPU(s) when a cpu_only call entered CUDA."""
        if error is None or error["kind"] != "gpu_access":
            return error
        when = error.pop("lease_time", None)
        who = self.pool.arbiter.holder_at(self.gpus, when) if when and self.pool.arbiter else None
        error.setdefault("cuda_call", "unknown")  # an ExecutionError("gpu_access") raised by uploaded code
        error.setdefault("location", "an unknown call site")
        error["interfered_request_id"] = who if who not in (self.job.request_id, STARTUP_OWNER) else None
        self.pool.log.event("gpu_access_violation", "WARNING", request_id=self.job.request_id,
                            gpu_id=self.gpus[0] if self.gpus else None, instruction_id=error["instruction_id"],
                            cuda_call=error["cuda_call"], location=error["location"],
                            interfered_request_id=error["interfered_request_id"])
        return error

    def retire_worker(self, error: ErrorObject | None) -> ErrorObject | None:
        """The worker's last request is done and it exits: the answer waits until it has begun its exit
        (its exit code set, nothing of the program running any more) and its group is killed, not for
        the exit itself: a torch-sized process takes milliseconds to tear down, which the disposal
        after the answer waits for and reaps, its tree swept as every retired worker's is
        (Pool.replace).  On a GPU the whole exit is waited for: its CUDA teardown happens under this
        request's lease.  Counts toward the timeout."""
        if self.pool.arbiter is not None:
            self.worker.process.join(max(0.0, self.deadline - time.monotonic()))
            code = self.worker.process.exitcode
            if code is None:
                raise TimeoutError
        else:
            code = exit_code_once_exiting(self.worker.pid, self.deadline)
            # reaped already, or its parent (which reports the exit, and kills it dying) killed: as before,
            # the status its Process gets (a program that killed the forkserver fails: 255)
            if code is None or self.worker.parent_dying():
                self.worker.process.join(max(0.0, self.deadline - time.monotonic()))
                code = self.worker.process.exitcode
                if code is None:
                    raise TimeoutError
        self.worker.halt()  # what the program left running the worker ended and reported (terminate_descendants)
        if code != 0 and error is None:
            return self.teardown_error(f"worker exited with code {code} during teardown")
        return error

    def background_processes(self, error: ErrorObject | None) -> ErrorObject | None:
        kill_group(self.worker.pid, self.config.worker_termination_grace_seconds, exclude=(self.worker.pid,))
        if error is None:
            return self.teardown_error("program left background processes running; they were terminated")
        return error

    def exit_code_of_crashed_worker(self) -> int | None:
        """How the worker ended, read before we kill what is left (which would blur it): its pipe
        closed because it died, so its status comes at once; None if it still runs (it broke the
        protocol instead) or none came in time."""
        self.worker.process.join(CRASH_STATUS_WAIT_SECONDS)
        return self.worker.process.exitcode

    def crash_error(self, exit_code: int | None) -> ErrorObject:
        error = self.teardown_error(self.crash_cause(exit_code))
        error["instruction_index"] = self.last_index
        return error

    def crash_kind(self, exit_code: int | None) -> str:
        """How the worker died, one of CRASH_CAUSES: over its memory limit, the kernel's OOM killer (a
        SIGKILL nobody here sent while the kernel, or this service's cgroup, counted an OOM kill), a
        signal, an exit, or alive but breaking the protocol."""
        if self.memory.exceeded or (self.cgroup is not None and self.cgroup.oom_killed()):
            return "memory_limit"
        if exit_code == -signal.SIGKILL and oom_kill_count() > self.oom_kills:
            return "oom"
        return "protocol" if exit_code is None else "signal" if exit_code < 0 else "exit"

    def count_crash(self, exit_code: int | None) -> None:
        """A worker that died while the program's instructions ran died of the program (its own signal,
        exit, memory, or bytes it wrote on the pipe): counted apart, by cause, so that a tenant cannot
        raise the worker-crash alert.  A death outside them is the server's fault."""
        self.pool.log.event("worker_crashed", "WARNING", request_id=self.job.request_id, pid=self.worker.pid,
                            cause=self.crash_kind(exit_code), exit_code=exit_code,
                            by="server" if self.last_index is None else "program")

    def crash_cause(self, exit_code: int | None) -> str:
        """Why the worker died, in words: its memory, the OOM killer, or its own status (`worker_exit_cause`)."""
        kind = self.crash_kind(exit_code)
        if kind == "memory_limit" and self.memory.exceeded:
            return (f"the request's processes used {self.memory.exceeded} bytes of memory, over the "
                    f"{self.memory.limit} of --memory-limit-bytes; they were stopped")
        if kind == "memory_limit":  # the cgroup's own kill
            return (f"the request's processes used all the {self.config.memory_limit_bytes} bytes of "
                    "--memory-limit-bytes; the kernel stopped them (its cgroup's memory.max)")
        if kind == "oom":
            return ("out of memory: the kernel's OOM killer ended the worker (signal 9, SIGKILL); the machine "
                    "or this service ran out of memory")
        return "worker exited while executing the instruction" + worker_exit_cause(exit_code)

    def teardown_error(self, message: str) -> ErrorObject:
        self.reported_start()
        index = self.last_index or 0
        ins = self.job.program.instructions[index]
        return {"kind": "runtime", "message": message, "instruction_index": index,
                "instruction_op": ins["op"], "instruction_id": ins.get("id"), "traceback": ""}

    def end_worker_under_lease(self) -> bool:
        """Pool.end_worker, holding the GPU lease: its CUDA teardown must not overlap someone's measurement.
        -> whether it is confirmed gone (if not, the pool quarantines its GPUs)."""
        if self.pool.arbiter is not None and self.lease_since is None:
            try:
                self.hold_lease(time.monotonic() + self.job.timeout)
            except LeaseRefused:  # quarantined already: nobody else will use it
                pass
            except TimeoutError:  # every holder ends by its own deadline: this is no normal wait
                self.pool.log.event("lease_wait_for_kill_timed_out", "WARNING", request_id=self.job.request_id)
        return self.pool.end_worker(self.worker, self.config.worker_termination_grace_seconds, orphans=True)

    def remove_workspace(self) -> None:
        """Remove an unsandboxed workspace on a thread of its own: the answer needs nothing from it
        any more (results and parts are in memory), and its unlinks (500 for a folder upload) need
        not delay it.  Not a daemon thread: an exiting server still finishes the removal."""
        if self.worker.template is None:
            threading.Thread(target=self.remove_root, name="remove-workspace").start()

    def remove_root(self) -> None:
        assert self.root is not None  # unsandboxed: the caller checked
        failed = remove_tree(self.root)
        if failed:
            self.pool.log.event("cleanup_failed", "ERROR", path=self.root, error=str(failed))


CRASH_STATUS_WAIT_SECONDS = 1.0  # Execution.exit_code_of_crashed_worker
HALTED_EXIT_SECONDS = 5.0  # Worker.kill: a halted worker's exit waited for before its tree is swept
EXIT_POLL_SECONDS = 0.0002  # exit_code_once_exiting: a worker begins its exit microseconds after its last message


def exit_code_once_exiting(pid: int, deadline: float) -> int | None:
    """The exit code (negative: the signal) of a process that is exiting, read as soon as it is set:
    its /proc stat shows it in its exit with its memory detached (the exit sets the code before it
    detaches the memory, and frees it after), or a zombie.  Before the slow part of an exit, and
    before the reaping.  None once it is gone (reaped); TimeoutError at `deadline`."""
    while (fields := kcoral_worker.proc_stat(pid)) is not None:
        if fields[0] == b"Z" or int(fields[6]) & kcoral_worker.PF_EXITING and int(fields[20]) == 0:
            return os.waitstatus_to_exitcode(int(fields[49]))
        if time.monotonic() >= deadline:
            raise TimeoutError
        time.sleep(EXIT_POLL_SECONDS)
    return None
FAULT_SIGNALS = (signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL)  # faulthandler's


def worker_exit_cause(exit_code: int | None) -> str:
    """": <the cause>" for a worker that died mid-instruction ("" when unknown): the signal by number,
    name and meaning and where faulthandler left the Python frames (kcoral_worker.worker_main), or
    the exit status."""
    if exit_code is None:
        return ""
    if exit_code >= 0:
        return f": it exited with status {exit_code} (os._exit, sys.exit or a native exit())"
    number = -exit_code
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    cause = f": killed by signal {number} ({name}, {signal.strsignal(number) or 'unknown'})"
    if number in FAULT_SIGNALS:
        cause += "; the Python frames it crashed in are in stderr, under \"Stack (most recent call first)\""
    return cause


STAGED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # Execution.stage_blobs
PIPE_BYTES = 1 << 20  # capture pipe capacity (Linux's default pipe-max-size) and OutputReader's read size


CAPTURED_TAIL_BYTES = 64 << 10  # of a truncated stream, its end kept beside its head: where the error usually is


class OutputReader:
    """Reads a worker's stdout/stderr pipes, keeping the first `limit` bytes of each and, past
    them, the last min(limit, CAPTURED_TAIL_BYTES); what it keeps within `limit` also goes to
    `on_output` as it arrives (a streamed answer, docs/protocol.md §13)."""

    def __init__(self, helpers: Helpers, out_fd: int, err_fd: int, limit: int,
                 on_output: Callable[[str, bytes], None] | None = None) -> None:
        self.limit = limit
        self.data = {out_fd: bytearray(), err_fd: bytearray()}
        self.tails = {out_fd: bytearray(), err_fd: bytearray()}
        self.produced = {out_fd: 0, err_fd: 0}
        self.fds = (out_fd, err_fd)
        self.names = {out_fd: "stdout", err_fd: "stderr"}
        self.on_output = on_output
        self.thread = helpers.start(self.read_until_closed, name="kcoral-output-reader")

    def read_until_closed(self) -> None:
        tail_bytes = min(self.limit, CAPTURED_TAIL_BYTES)
        with selectors.DefaultSelector() as sel:
            for fd in self.fds:
                sel.register(fd, selectors.EVENT_READ)
            open_fds = len(self.fds)
            while open_fds:
                for key, _ in sel.select():
                    chunk = os.read(key.fd, PIPE_BYTES)
                    if not chunk:
                        sel.unregister(key.fd)
                        os.close(key.fd)
                        open_fds -= 1
                        continue
                    self.produced[key.fd] += len(chunk)
                    room = self.limit - len(self.data[key.fd])
                    if room > 0:
                        self.data[key.fd] += chunk[:room]
                        if self.on_output:
                            self.on_output(self.names[key.fd], chunk[:room])
                    if len(chunk) > room:
                        tail = self.tails[key.fd]
                        tail += chunk[max(room, 0):]
                        if len(tail) > 2 * tail_bytes:  # trimmed now and then, not per chunk
                            del tail[:-tail_bytes]

    def result(self, wait: float) -> tuple[str, str, bool, bool]:
        """(stdout, stderr, stdout_truncated, stderr_truncated) once the writers are gone.

        A process that escaped the group may hold a pipe open; then the
        thread keeps reading (and closes the pipe) on its own.
        """
        self.thread.join(wait)
        texts = [(self.data[fd].decode("utf-8", "replace"), self.produced[fd] > self.limit) for fd in self.fds]
        return texts[0][0], texts[1][0], texts[0][1], texts[1][1]

    def truncation_fields(self, max_limit: int) -> dict[str, Json]:
        """For a stream cut at the limit, what an answer adds beside its `*_truncated` flag (docs/protocol.md
        §8.7): the bytes it produced, its end, the limit applied and the server's cap on it; {} when none was."""
        fields: dict[str, Json] = {}
        for fd in self.fds:
            if self.produced[fd] > self.limit:
                name = self.names[fd]
                tail = bytes(self.tails[fd][-min(self.limit, CAPTURED_TAIL_BYTES):])
                start = next((i for i, byte in enumerate(tail[:4]) if byte & 0xC0 != 0x80), 0)  # whole characters
                fields[f"{name}_bytes"] = self.produced[fd]
                fields[f"{name}_tail"] = tail[start:].decode("utf-8", "replace")
        if fields:
            fields.update(output_limit_bytes=self.limit, max_output_limit_bytes=max_limit)
        return fields


# --- 8. a request's limits: its cgroup and its memory watch (docs/sandbox.md) ---------------------

def enter_delegated_cgroup(config: ServerConfig) -> str:
    """--cgroup resolved at start -> the delegated cgroup v2 directory requests get children in, or
    "none".  The server first moves itself into a leaf of its own, SERVER_CGROUP (cgroup v2 lets
    only a cgroup without processes give its children controllers), then enables memory and pids
    for the children.  auto finds the server's own cgroup, only when it is v2 and writable."""
    root = own_delegated_cgroup() if config.cgroup == "auto" else config.cgroup
    if root in (None, "none"):
        return "none"
    assert root is not None  # narrowed above
    os.makedirs(os.path.join(root, SERVER_CGROUP), exist_ok=True)
    write_cgroup(os.path.join(root, SERVER_CGROUP), "cgroup.procs", os.getpid())
    write_cgroup(root, "cgroup.subtree_control", "+memory +pids")
    return root


SERVER_CGROUP = "kcoral-server"  # the front-end's own leaf in the delegated subtree


def own_delegated_cgroup() -> str | None:
    """The server's cgroup when it is cgroup v2 (one `0::` line), writable and offers memory and pids."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
        if len(lines) != 1 or not lines[0].startswith("0::"):
            return None  # cgroup v1 or hybrid: nothing to delegate
        path = "/sys/fs/cgroup" + lines[0][3:]
        with open(os.path.join(path, "cgroup.controllers")) as f:
            controllers = set(f.read().split())
    except OSError:
        return None
    writable = all(os.access(os.path.join(path, name), os.W_OK) for name in ("cgroup.procs", "cgroup.subtree_control"))
    return path if writable and {"memory", "pids"} <= controllers else None


def write_cgroup(path: str, name: str, value: object) -> None:
    with open(os.path.join(path, name), "w") as f:
        f.write(f"{value}\n")


class RequestCgroup:
    """A request's own child of the delegated cgroup: its worker (and all it starts) is charged
    there, the kernel kills the whole group beyond memory.max (memory.oom.group), with no swap to
    spill into, and refuses a fork beyond pids.max.  Removed once its processes are gone."""

    def __init__(self, root: str, request_id: str, pid: int, config: ServerConfig) -> None:
        self.root, self.path = root, os.path.join(root, f"request-{request_id}")
        os.mkdir(self.path)
        write_cgroup(self.path, "memory.max", config.memory_limit_bytes or "max")
        write_cgroup(self.path, "pids.max", config.process_limit or "max")
        for name, value in (("memory.swap.max", 0), ("memory.oom.group", 1)):
            with contextlib.suppress(FileNotFoundError, PermissionError):  # a kernel without swap accounting
                write_cgroup(self.path, name, value)
        write_cgroup(self.path, "cgroup.procs", pid)

    def oom_killed(self) -> bool:
        """Whether the kernel killed in this cgroup for its memory.max (memory.events)."""
        with contextlib.suppress(OSError, ValueError), open(os.path.join(self.path, "memory.events")) as f:
            return any(line.split()[0] in ("oom_kill", "oom_group_kill") and int(line.split()[1]) > 0 for line in f)
        return False

    def leave(self, pid: int | None, log: EventLog) -> None:
        """A worker that serves on goes back to the server's leaf; the cgroup is removed once empty,
        on a thread of its own (the killed processes may take a moment to exit)."""
        if pid is not None and is_live(pid):
            with contextlib.suppress(OSError):
                write_cgroup(os.path.join(self.root, SERVER_CGROUP), "cgroup.procs", pid)
        threading.Thread(target=self.remove, args=(log,), name="remove-cgroup").start()

    def remove(self, log: EventLog) -> None:
        deadline = time.monotonic() + CGROUP_REMOVE_SECONDS
        while True:
            try:
                os.rmdir(self.path)
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    log.event("cgroup_not_removed", "WARNING", path=self.path, error=str(exc))
                    return
            time.sleep(0.05)


CGROUP_REMOVE_SECONDS = 5.0


class MemoryWatch:
    """Samples the memory a running request holds (its worker and every descendant: `request_memory`)
    and SIGKILLs the worker when it holds more than `limit` bytes (0: no limit); `exceeded` is then
    what it measured.  Every MEMORY_SAMPLE_SECONDS, and every MEMORY_CLOSE_SAMPLE_SECONDS once past
    half the limit: a burst (3 GiB touched at once) is then caught within a few tens of MiB of the
    limit, while a request far below it costs ten reads a second.  The kernel's OOM killer, which
    takes workers first (oom_score_adj), covers what a sample can still miss.

    A sandboxed request has its own IPC namespace: the watch's thread enters it first (`enter_ipc`),
    to bound its System V shared memory and message queues (`IPC_LIMITS`) and to count the shared
    memory segments no process maps any more.  `exempt` holds the (device, inode) of memory files
    the front-end itself passed in (the staged blobs), which are not the request's doing."""

    def __init__(self, helpers: Helpers, pid: int, limit: int, sandboxed: bool) -> None:
        self.pid, self.limit = pid, limit
        self.exceeded = 0
        self.exempt: set[tuple[int, int]] = set()
        self.own_ipc = False  # whether the thread is in the request's IPC namespace
        self.stopped, self.entered = threading.Event(), threading.Event()
        # a thread that entered the request's IPC namespace (a sandboxed request's) ends with it
        self.thread = helpers.start(self.watch, sandboxed, name="memory-watch", reuse=not sandboxed) if limit else None
        if self.thread is not None:
            if sandboxed:  # the IPC limits are set before the program starts
                self.entered.wait(MEMORY_SAMPLE_SECONDS)

    def watch(self, sandboxed: bool) -> None:
        try:
            self.own_ipc = sandboxed and enter_ipc(self.pid, self.limit)
        finally:
            self.entered.set()
        interval = MEMORY_SAMPLE_SECONDS
        while not self.stopped.wait(interval):
            used = request_memory([self.pid] + descendants(self.pid), self.limit, self.exempt, self.own_ipc)
            if used > self.limit:
                self.exceeded = used
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(self.pid, signal.SIGKILL)
                return
            interval = MEMORY_SAMPLE_SECONDS if used < self.limit // 2 else MEMORY_CLOSE_SAMPLE_SECONDS

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()


MEMORY_SAMPLE_SECONDS = 0.1
MEMORY_CLOSE_SAMPLE_SECONDS = 0.005  # past half the limit: about 15 MiB touched between two samples
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# a request's own IPC namespace: System V shared memory within its memory limit (set by enter_ipc),
# and few, small message queues (the kernel's defaults allow 32 000 System V queues of 16 KiB each,
# 500 MiB that no process's memory shows)
IPC_LIMITS = {"kernel/shmmni": 256, "kernel/msgmni": 16, "kernel/msgmnb": 16384, "kernel/msgmax": 8192,
              "fs/mqueue/queues_max": 16, "fs/mqueue/msg_max": 10, "fs/mqueue/msgsize_max": 8192}
PROCESS_MEMORY_FIELDS = (b"RssAnon:", b"RssShmem:", b"VmPTE:")  # of /proc/PID/status, in KiB


def enter_ipc(pid: int, limit: int) -> bool:
    """Move the calling thread (only it: setns) into the IPC namespace of the sandboxed worker
    `pid` and set that namespace's limits: System V shared memory at most `limit` bytes all
    together, IPC_LIMITS for the rest.  -> whether it could: it takes the host's root (the
    namespace's sysctls belong to its user namespace's root, which only a root server maps)."""
    try:
        fd = os.open(f"/proc/{pid}/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
        try:
            kcoral_worker.libc_call("setns", fd, kcoral_worker.CLONE_NEWIPC)
        finally:
            os.close(fd)
        limits = {**IPC_LIMITS, "kernel/shmmax": limit, "kernel/shmall": -(-limit // PAGE_BYTES)}
        for name, value in limits.items():
            with open(f"/proc/sys/{name}", "w") as f:
                f.write(str(value))
    except OSError:
        return False
    return True


def request_memory(pids: list[int], limit: int, exempt: Iterable[tuple[int, int]], own_ipc: bool) -> int:
    """Bytes the request holds: each process's anonymous and shared resident memory (shared
    anonymous maps, memfd and System V pages it maps) and page tables; memory files (memfd) its
    processes hold open but map nowhere; and, when the calling thread is in its IPC namespace,
    System V segments no process maps.  The resident sum counts the pages a fork shares with its
    template once per process: only when the total is over `limit` are the shares weighed (PSS,
    smaps_rollup), so that forked helpers are not charged for torch's pages over and over."""
    resident, page_tables = 0, 0
    for pid in pids:
        fields = process_memory(pid)
        resident += fields.get(b"RssAnon:", 0) + fields.get(b"RssShmem:", 0)
        page_tables += fields.get(b"VmPTE:", 0)
    held = unmapped_memory_files(pids, exempt) + (unattached_shared_memory() if own_ipc else 0)
    if resident + page_tables + held <= limit:
        return resident + page_tables + held
    weighed = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            weighed += sum(int(line.split()[1]) * 1024 for line in f
                           if line.startswith((b"Pss_Anon:", b"Pss_Shmem:")))
    return weighed + page_tables + held


def process_memory(pid: int) -> dict[bytes, int]:
    """PROCESS_MEMORY_FIELDS of one process, in bytes ({} once it is gone)."""
    fields = {}
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(PROCESS_MEMORY_FIELDS):
                fields[line.split(b":")[0] + b":"] = int(line.split()[1]) * 1024
    return fields


def unmapped_memory_files(pids: list[int], exempt: Iterable[tuple[int, int]]) -> int:
    """Bytes of the memory files (memfd_create) the processes hold open, those `exempt` and those
    any of them maps aside (a mapped one's touched pages are its mappers' RssShmem): a memfd
    filled with write() and never mapped shows in no process's memory."""
    files: dict[tuple[int, int], int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                        info = os.stat(f"/proc/{pid}/fd/{fd}")
                        files[(info.st_dev, info.st_ino)] = info.st_blocks * 512
    for key in exempt:
        files.pop(key, None)
    if files:
        mapped: set[int] = set()
        for pid in pids:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", "rb") as f:
                mapped.update(int(line.split()[4]) for line in f if b" /memfd:" in line)
        files = {key: size for key, size in files.items() if key[1] not in mapped}
    return sum(files.values())


def unattached_shared_memory() -> int:
    """Resident bytes of the System V segments of the calling thread's IPC namespace that no
    process has attached (an attached one's pages are its attachers' RssShmem)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/sysvipc/shm", "rb") as f:
        header = f.readline().split()
        nattch, rss = header.index(b"nattch"), header.index(b"rss")
        return sum(int(row[rss]) for row in map(bytes.split, f) if len(row) > rss and row[nattch] == b"0")
    return 0


def oom_kill_count() -> int:
    """How many processes the kernel's OOM killer has ended: since boot (/proc/vmstat), plus those of this
    process's cgroup (its memory.events: a unit's MemoryMax), which a container's /proc/vmstat may not show."""
    return counter_in("/proc/vmstat", b"oom_kill ") + counter_in(own_cgroup_file("memory.events"), b"oom_kill ")


def counter_in(path: str, prefix: bytes) -> int:
    with contextlib.suppress(OSError, ValueError), open(path, "rb") as f:
        for line in f:
            if line.startswith(prefix):
                return int(line.split()[1])
    return 0


def own_cgroup_file(name: str) -> str:
    """/sys/fs/cgroup/<this process's cgroup (v2)>/<name>; a path that does not exist when unknown."""
    with contextlib.suppress(OSError), open("/proc/self/cgroup", "rb") as f:
        for line in f:
            if line.startswith(b"0::"):
                return os.path.join("/sys/fs/cgroup", line[3:].strip().decode().lstrip("/"), name)
    return "/nonexistent"


# --- 9. workspaces: private directories, removed without following a link -------------------------

WORKSPACE = re.compile(r"kcoral-(?:program|sandbox)-(\d+)\.(\d+)-")  # sandbox: left by earlier versions


def process_start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (/proc/PID/stat field 22), or None if
    it is gone: with the pid, it names one process even after the pid is reused."""
    fields = kcoral_worker.proc_stat(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (IndexError, ValueError):
        return None


@functools.cache  # the server's own for its lifetime: a /proc read less per request
def workspace_prefix(pid: int) -> str:
    """`kcoral-program-<server pid>.<its start ticks>-`: the owner is in the name, so the next
    start can tell the directories of a killed server from a live one's."""
    return f"kcoral-program-{pid}.{process_start_ticks(pid)}-"


def remove_dead_workspaces(directory: str) -> int:
    """Remove workspaces and sandbox directories whose owning server no longer runs (it was
    killed before its cleanup)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for name in names:
        match = WORKSPACE.match(name)
        if match and process_start_ticks(int(match.group(1))) != int(match.group(2)):
            remove_tree(os.path.join(directory, name))
            removed += 1
    return removed


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_TOPDIR_FL = 0x80086601, 0x40086602, 0x00020000  # linux/fs.h


def spread_subdirectories(path: str) -> None:
    """Ask the file system to place each new subdirectory of `path` in a block group of its own
    (ext4's top-directory hint, `chattr +T`), so that each request's `work` takes its inodes from
    a group where none were freed lately.

    ext4 without a journal, common on VM disks, allocates an inode by stepping over every inode
    of the group freed in the last minutes, reading its inode table block for each: creating
    files then costs many times more (docs/performance.md).  Where the hint is unknown (tmpfs,
    XFS) nothing changes."""
    with contextlib.suppress(OSError):
        fd = os.open(path, NOFOLLOW_DIR)
        try:
            flags = array.array("i", [0])
            fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags)
            if not flags[0] & FS_TOPDIR_FL:
                flags[0] |= FS_TOPDIR_FL
                fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags)
        finally:
            os.close(fd)


def make_spread_directory(path: str) -> None:
    """mkdir `path` (0700) in a parent given spread_subdirectories: under a random name first, then
    renamed, because ext4 starts its search for a spread directory's group from a hash of its
    name, and every request's `work` would land in the same group as the last one."""
    fresh = os.path.join(os.path.dirname(path), f".new-{secrets.token_hex(8)}")
    os.mkdir(fresh, 0o700)
    os.rename(fresh, path)


def remove_tree(path: str) -> OSError | None:
    """Remove a workspace or sandbox directory whatever a program did inside it: the path is
    the server's own (in its temporary directory), everything below it is treated as hostile.
    -> what stopped the removal, if anything (callers with a log report it as cleanup_failed)."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        parent_fd = os.open(parent, NOFOLLOW_DIR)
    except OSError as exc:
        return exc
    try:
        remove_entry_at(parent_fd, name)
    except OSError as exc:
        return exc
    finally:
        os.close(parent_fd)
    return None


def remove_entry_at(dir_fd: int, name: str) -> None:
    """Remove a file, link or directory tree named relative to an open directory."""
    with contextlib.suppress(FileNotFoundError):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except (IsADirectoryError, PermissionError):  # Linux's unlink() of a directory: EISDIR
            fd = os.open(name, NOFOLLOW_DIR, dir_fd=dir_fd)
            try:
                empty_directory_at(fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=dir_fd)


EMPTYING_DEPTH = 64  # open directories at most; deeper subtrees are moved up to the top first


def empty_directory_at(top: int) -> None:
    """Remove what the open directory `top` holds.

    Everything is opened relative to its parent without following a link, and each directory is
    made ours (0700) before it is emptied, so nothing a program renamed, linked or chmod-ed can
    steer the removal outside `top` or stop it.  Iterative, with at most EMPTYING_DEPTH
    directories open: a program may nest directories deeper than Python's recursion or the fd
    limit allows."""
    stack = [(os.dup(top), "")]  # (open directory, its name in the one below it on the stack)
    try:
        while stack:
            fd, name = stack[-1]
            os.fchmod(fd, 0o700)
            below = next_directory_to_empty(fd)
            if below is None:  # emptied: removed from its parent
                stack.pop()
                os.close(fd)
                if stack:
                    os.rmdir(name, dir_fd=stack[-1][0])
            elif len(stack) >= EMPTYING_DEPTH:
                os.rename(below, f".kcoral-deep-{secrets.token_hex(8)}", src_dir_fd=fd, dst_dir_fd=stack[0][0])
            else:
                stack.append((os.open(below, NOFOLLOW_DIR, dir_fd=fd), below))
    finally:
        for fd, _ in stack:
            os.close(fd)


def next_directory_to_empty(fd: int) -> str | None:
    """Unlink the files and links of the open directory `fd` up to its next directory -> that one's name."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                return entry.name
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.name, dir_fd=fd)
    return None


# --- 10. launching workers: the forkserver template and its imports, a Worker ---------------------

def isolate_import_path() -> None:
    """Drop the server's start directory from the import path its workers inherit: a `numpy.py`
    left where the server was started would otherwise be what every request imports.  Our own
    directory stays (the workers import kcoral_worker from it).  The forkserver, which puts its
    working directory first on its path, starts from our directory (`start_forkserver`);
    sandboxed workers start with `python -I`, which also leaves out the user's site-packages
    and PYTHON* variables."""
    start = os.getcwd()
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or start) != start or start == PROJECT_DIR]


def start_forkserver(context: multiprocessing.context.BaseContext) -> None:
    """Start the workers' template process from our own directory (see isolate_import_path);
    nothing else runs yet, so the process-wide chdir and environment are seen by no one."""
    start = os.getcwd()
    os.chdir(PROJECT_DIR)
    # It ignores SIGINT itself; SIGTERM it inherits blocked from this thread, and keeps so: a signal to
    # the whole tree must not take it (and, through their parent-death signal, the workers forked
    # from it) down mid-request.  Blocked, not ignored: a SIGTERM for us meanwhile waits, not lost.
    # (The resource tracker first: starting it unblocks SIGTERM in the thread that does.)
    multiprocessing.resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    os.environ[kcoral_worker.TEMPLATE_MARK] = "1"  # warmed, its memory in huge pages (prepare_template)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        del os.environ[kcoral_worker.TEMPLATE_MARK]
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.chdir(start)


WARM_TVM_FFI = "import torch, tvm_ffi"  # tvm_ffi builds its torch add-on on import when it must
# tvm_ffi only warns when that build fails: what the warm-up really did is whether torch.Tensor
# now carries the DLPack exchange API (which the add-on installs), told by the exit status
ADDON_MISSING_EXIT = 3
CHECK_TVM_FFI_ADDON = ("import sys, torch; sys.exit(0 if hasattr(torch.Tensor, '__dlpack_c_exchange_api__') "
                       f"or hasattr(torch.Tensor, '__c_dlpack_exchange_api__') else {ADDON_MISSING_EXIT})")


def prepare_template_imports(timeout: float, warm: str = WARM_TVM_FFI, log: EventLog | None = None) -> str:
    """Make the worker template's imports fast and free of CUDA before any worker starts.

    PYTORCH_NVML_BASED_CUDA_CHECK=1 lets `torch.cuda.is_available()` (tvm_ffi calls it on
    import) ask NVML instead of calling cuInit, so the template never holds CUDA state that
    its forks would inherit unusable.  With a torch that lacks the DLPack exchange API,
    `import tvm_ffi` compiles an add-on into its cache on first use (nvcc: minutes): that
    happens here, once, in a separate process within `timeout` seconds; if it fails or takes
    longer, or tvm_ffi swallowed a failed build (no DLPack exchange API afterwards), the add-on
    is disabled for this server so no worker can meet the slow path again.
    -> "native", "warmed", "disabled" or "absent" (also logged).
    """
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if not (importlib.util.find_spec("torch") and importlib.util.find_spec("tvm_ffi")):
        return "absent"
    if os.environ.get("TVM_FFI_DISABLE_TORCH_C_DLPACK", "0") != "0" or torch_has_dlpack_exchange_api():
        return "native"
    started = time.monotonic()
    try:
        subprocess.run([sys.executable, "-I", "-c", f"{warm}\n{CHECK_TVM_FFI_ADDON}"], check=True,
                       timeout=timeout, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        state, error = "warmed", None
    except (subprocess.SubprocessError, OSError) as exc:
        os.environ["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = "1"
        state, error = "disabled", warm_up_failure(exc)
    if log is not None:
        log.event("template_prepared", "WARNING" if error else "INFO", tvm_ffi_torch_addon=state,
                  seconds=round(time.monotonic() - started, 1), error=error)
    return state


def warm_up_failure(exc: subprocess.SubprocessError | OSError) -> str:
    """What went wrong in the tvm_ffi warm-up, for the log: a build tvm_ffi reported only as a
    warning is named as such, with the end of what it wrote."""
    stderr = getattr(exc, "stderr", None) or b""
    tail = stderr.decode(errors="replace").strip()[-300:]
    if isinstance(exc, subprocess.CalledProcessError) and exc.returncode == ADDON_MISSING_EXIT:
        return f"tvm_ffi's torch add-on was not built (tvm_ffi only warned): {tail or 'no output'}"
    return f"{type(exc).__name__}: {str(exc)[-300:]}" + (f"; {tail}" if tail else "")


def torch_has_dlpack_exchange_api() -> bool:
    """Whether the installed torch exports the DLPack exchange API itself (read, not imported)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None  # the caller checked that torch is installed
    for location in spec.submodule_search_locations or ():
        try:
            with open(os.path.join(location, "_tensor.py"), encoding="utf-8") as f:
                return "dlpack_exchange_api" in f.read()  # or its older name
        except OSError:
            pass
    return importlib.util.find_spec("torch_c_dlpack_ext") is not None


def process_parent(pid: int) -> int | None:
    """A process's parent pid (/proc/PID/stat field 4), None once it is gone."""
    fields = kcoral_worker.proc_stat(pid)
    return int(fields[1]) if fields is not None else None


class Worker:
    """One worker process forked from the template (a slot's sandbox template, if any), with its pipe."""
    process: SandboxedProcess | multiprocessing.process.BaseProcess

    def __init__(self, pool: Pool, gpus: list[int], step_timeout: float = WORKER_STEP_SECONDS,
                 template: SandboxTemplate | None = None) -> None:
        self.gpus = gpus
        self.template = template
        self.log = pool.log
        self.conn, child = pool.context.Pipe()
        visible = [pool.gpu_names[g] for g in gpus]
        if template is not None:
            try:
                self.process = template.fork(child, pool.device, visible, step_timeout)
            finally:
                child.close()
        else:
            self.process = pool.context.Process(target=kcoral_worker.worker_main,
                                                args=(child, pool.device, visible), name="kcoral-worker")
            self.process.start()
            # Process.start() on another thread polls every child multiprocessing tracks; two threads
            # reading one forkserver exit status make join() report 255 for a clean exit.  We track ours.
            multiprocessing.process._children.discard(self.process)  # type: ignore[attr-defined]  # private
            child.close()
        assert self.process.pid is not None  # started
        self.pid = self.process.pid
        self.parent = process_parent(self.pid)  # the forkserver or, sandboxed, the template
        self.served = 0
        self.exiting = False  # killed, but its tree outlived kill_wait in its exit (kill)
        self.halted = False  # its group SIGKILLed (halt), its exit perhaps still under way
        try:
            message = receive_checked(self.conn, (kcoral_worker.WorkerReady, kcoral_worker.WorkerFailed),
                             time.monotonic() + step_timeout, f"worker did not start within {step_timeout:.0f} s")
            if isinstance(message, kcoral_worker.WorkerFailed):
                raise WorkerCrashed(f"worker did not start: {message.reason:.500}")
        except WorkerCrashed:
            self.kill(0)
            raise
        self.log.metrics.add("kcoral_worker_starts_total")

    def initialize(self, expected_uuid: str, step_timeout: float = WORKER_STEP_SECONDS) -> None:
        """GPU workers: create the CUDA context (the caller holds the lease) and check the pinning."""
        try:
            try:
                kcoral_worker.send_message(self.conn, kcoral_worker.InitGpu())
            except OSError as exc:
                raise WorkerCrashed(str(exc)) from exc
            reply = receive_checked(self.conn, kcoral_worker.GpuInitialized, time.monotonic() + step_timeout,
                           f"worker did not initialize its GPU within {step_timeout:.0f} s")
            self.arch, self.cuda = reply.arch[:32], reply.cuda and reply.cuda[:32]
            if not same_gpu(reply.uuid, expected_uuid):
                raise WorkerCrashed(f"worker's device 0 is {reply.uuid:.80}, expected {expected_uuid}")
        except WorkerCrashed as exc:
            self.kill(0)
            kind = WorkerStartTimeout if isinstance(exc, WorkerStartTimeout) else WorkerCrashed
            raise kind(f"GPU worker failed to initialize: {str(exc) or type(exc).__name__}") from exc

    def kill(self, grace: float, orphans: bool = False) -> bool:
        """-> whether the whole tree is confirmed gone (else its GPUs must be quarantined).
        In a sandbox, survivors end with their container, which the slot then replaces."""
        if self.halted:  # its exit first: until then each sweep below finds it, and sweeps again
            self.process.join(HALTED_EXIT_SECONDS)
        if self.template is not None:  # its container holds exactly what this worker started
            gone = self.template.kill_requests(grace, self.pid)
            if not gone:
                self.log.event("sandbox_replaced", "WARNING", reason="processes outlived the request's kill sweeps")
                self.template.kill()
                gone = not is_live(self.template.pid or 0)
                self.exiting = self.exiting or not gone and killed_already(self.template.pid or 0)
        else:  # a tree found in its exit before is not waited for again (its disposal after the answer)
            gone = not self.exiting and kill_group(self.pid, grace, orphans=orphans)
            # still there past kill_wait, yet killed: a busy GPU's teardown, for the pool to probe (end_worker)
            self.exiting = self.exiting or not gone and all(map(killed_already, tree_members(self.pid, (), orphans)))
        self.process.join(5)
        self.conn.close()
        return gone

    def parent_dying(self) -> bool:
        """Whether the process that forked this worker is gone or in its exit (a program may kill it)."""
        return self.parent is None or killed_already(self.parent)

    def halt(self) -> None:
        """SIGKILL the worker's process group, now: the worker (every thread of its program) and
        anything in its group, a fork in progress included; their exit and reaping are left to `kill`."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.halted = True

    def stop(self, grace: float) -> None:
        """Tell an idle worker to exit; kill its group if it does not."""
        with contextlib.suppress(OSError):
            kcoral_worker.send_message(self.conn, kcoral_worker.StopWorker())
        self.process.join(grace)
        self.kill(grace)


# --- 11. GPUs and the lease (docs/server.md §1-2) -------------------------------------------------

def resolve_device(config: ServerConfig) -> tuple[str, list[int], dict[int, str]]:
    """-> ("cpu" | "cuda", configured GPU ids, {id: CUDA_VISIBLE_DEVICES name})."""
    uuids = nvml_gpu_ids() if config.device != "cpu" else []
    if config.device == "gpu" and not uuids:
        raise SystemExit("kcoral: --device gpu but no NVIDIA GPU is visible")
    if not uuids:
        if config.device == "auto":
            print("kcoral: no CUDA device found; serving on CPU workers", file=sys.stderr)
        return "cpu", [], {}
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        print("kcoral: ignoring CUDA_VISIBLE_DEVICES; --gpus takes physical ids", file=sys.stderr)
    gpu_ids = list(dict.fromkeys(config.gpus))
    bad = [g for g in gpu_ids if not 0 <= g < len(uuids)]
    if bad:
        raise SystemExit(f"kcoral: no such GPU(s): {bad}")
    return "cuda", gpu_ids, {g: uuids[g] for g in gpu_ids}


def describe_runtime(device: str, pool: Pool) -> tuple[dict[str, str], dict[str, str]]:
    """/health `target` and `versions` (docs/protocol.md §3)."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    if device == "cpu":
        tvm_ffi = version("apache-tvm-ffi")
        return {}, ({"tvm_ffi": tvm_ffi} if tvm_ffi else {})
    workers = [slot.worker for slot in pool.slots if slot.worker is not None]  # all of them: Pool() started each
    versions = {"torch": version("torch"), "cuda": workers[0].cuda, "tvm": version("apache-tvm") or version("tvm"),
                "tvm_ffi": version("apache-tvm-ffi"), "triton": version("triton"),
                "cutlass": version("nvidia-cutlass-dsl"), "flashinfer": version("flashinfer-python")}
    return {"arch": common_target(workers)}, {k: v for k, v in versions.items() if v}


def common_target(workers: list[Worker]) -> str:
    """The one compilation target of a GPU pool; start-up fails when its GPUs disagree (docs/server.md §1)."""
    arches = sorted({worker.arch for worker in workers})
    if len(arches) != 1:
        raise SystemExit(f"kcoral: the configured GPUs disagree on the target {arches}; a pool serves one target")
    return arches[0]


@functools.cache
def nvml() -> ctypes.CDLL | None:
    """NVML, initialised, without importing torch; None where there is none."""
    try:
        library = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    return library if library.nvmlInit_v2() == 0 else None


def nvml_gpu_ids() -> list[str]:
    """UUIDs of the visible NVIDIA GPUs through NVML; [] if none."""
    library = nvml()
    if library is None:
        return []
    count = ctypes.c_uint()
    if library.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return []
    uuids = []
    for index in range(count.value):
        handle, buf = ctypes.c_void_p(), ctypes.create_string_buffer(96)
        ok = (library.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0 and
              library.nvmlDeviceGetUUID(handle, buf, 96) == 0)
        uuids.append(buf.value.decode() if ok else str(index))
    return uuids


def same_gpu(seen: str, expected: str) -> bool:
    """docs/server.md §1.1: UUIDs compare without the GPU- prefix, case-insensitively; unknown ones pass."""
    def bare(name: str) -> str:
        return name.lower().removeprefix("gpu-")

    return not seen or not expected.lower().startswith("gpu-") or bare(seen) == bare(expected)


STARTUP_OWNER = "worker-startup"  # lease owner while a worker creates its CUDA context; not a request


class LeaseRefused(Exception):
    """A lease that will never be granted: its GPU is quarantined, or the server is shutting down."""


class LeaseArbiter:
    """One exclusive lease per GPU, granted strictly in arrival order (docs/server.md §2.1).

    Workers ask over their pipe and the request thread blocks here, so a
    killed holder cannot leak a lease: the thread that served it releases it.
    A request for "any n GPUs" that cannot be met blocks every GPU for later
    waiters, so the big job is not starved.
    """

    def __init__(self, gpu_ids: Iterable[int]) -> None:
        self.gpu_ids = list(gpu_ids)
        self.holder: dict[int, str | None] = {g: None for g in self.gpu_ids}
        self.queue: collections.deque[LeaseTicket] = collections.deque()
        self.history: dict[int, collections.deque[tuple[float, float | None, str]]] = {
            g: collections.deque(maxlen=256) for g in self.gpu_ids}  # (start, end or None while held, owner)
        self.quarantined: set[int] = set()
        self.busy_seconds = {g: 0.0 for g in self.gpu_ids}  # leases held and released, for /metrics
        self.closing = False
        self.cond = threading.Condition()

    def acquire(self, owner: str, gpus: list[int] | None = None, count: int | None = None,
                deadline: float | None = None, client_gone: Callable[[], bool] | None = None
                ) -> tuple[list[int], float]:
        """Block until `gpus` (or any `count` GPUs) are ours; returns (granted GPUs, wait ms).
        LeaseRefused when that can no longer happen (quarantine; "any n" waits at shutdown);
        TimeoutError once time.monotonic() passes `deadline`; ClientGone when `client_gone` says so."""
        start = time.monotonic()
        ticket = (object(), gpus, count)  # unique: queue.remove() must not take an equal twin

        def turn() -> list[int] | None:
            self.check_servable(gpus, count)
            return self.grantable(ticket)

        with self.cond:
            self.queue.append(ticket)
            granted = wait_turn(self.cond, self.queue, ticket, turn, deadline, client_gone=client_gone, where="lease")
            if granted is None:
                raise TimeoutError
            now = time.time()
            for g in granted:
                self.holder[g] = owner
                self.history[g].append((now, None, owner))
        return granted, (time.monotonic() - start) * 1e3

    def likely_grant(self, count: int) -> list[int]:
        """The `count` GPUs an "any n" request is most likely granted: free ones first, in configured order."""
        with self.cond:
            usable = [g for g in self.gpu_ids if g not in self.quarantined]
            return sorted(usable, key=lambda g: self.holder[g] is not None)[:count]

    def check_servable(self, gpus: list[int] | None, count: int | None) -> None:
        if count and self.closing:
            raise LeaseRefused("server is shutting down")
        if (count and count > len(self.gpu_ids) - len(self.quarantined)) or self.quarantined & set(gpus or ()):
            raise LeaseRefused("GPU quarantined: a worker's process tree could not be confirmed gone")

    def quarantine(self, gpus: Iterable[int]) -> None:
        """docs/server.md §2.1: never lend these GPUs again; waiters that need them are refused."""
        with self.cond:
            self.quarantined.update(gpus)
            self.cond.notify_all()

    def refuse_waiters(self) -> None:
        """A quarantine's refusal: requests still waiting for "any n" GPUs are refused (a graceful
        shutdown lets them run: the leases they wait for are released as the requests before finish)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    def grantable(self, ticket: LeaseTicket) -> list[int] | None:
        blocked: set[int] = set()
        for waiter in self.queue:
            _, gpus, count = waiter
            gpus = gpus or []  # None comes with a count: any `count` GPUs
            free = [g for g in self.gpu_ids if self.holder[g] is None and g not in blocked | self.quarantined]
            wanted = free[:count] if count else [g for g in gpus if g in free]
            enough = len(wanted) == (count or len(gpus))
            if waiter is ticket:
                return wanted if enough else None
            blocked.update(self.gpu_ids if count else gpus)
        return None  # not reached: acquire() queued the ticket

    def release(self, owner: str, gpus: Iterable[int]) -> None:
        with self.cond:
            now = time.time()
            for g in gpus:
                if self.holder[g] == owner:
                    self.holder[g] = None
                    start, _, who = self.history[g].pop()
                    self.history[g].append((start, now, who))
                    self.busy_seconds[g] += now - start
            self.cond.notify_all()

    def holder_at(self, gpus: Iterable[int], when: float) -> str | None:
        """Who held any of `gpus` at wall-clock time `when` (for gpu_access reports); None if nobody."""
        with self.cond:
            for g in gpus:
                for start, end, who in self.history[g]:
                    if start <= when and (end is None or when <= end):
                        return who
        return None


# --- 12. the sandbox (docs/sandbox.md) ------------------------------------------------------------

def resolve_sandbox(config: ServerConfig) -> tuple[str, str | None]:
    """--sandbox auto -> ("bubblewrap", None) when a working bwrap is found, else ("none", why,
    with how to get it, for the start-up warning); workers reused across requests
    (--max-requests-per-worker other than 1) are never sandboxed, since one process would
    serve several tenants.  Other values stand (bubblewrap is probed: no start without it)."""
    if config.sandbox == "bubblewrap":
        probe_bubblewrap(config)  # without a working bwrap the start stops: never unsandboxed
    if config.sandbox != "auto":
        return config.sandbox, None
    if config.max_requests_per_worker != 1:
        return "none", ("--max-requests-per-worker is not 1: workers serve several requests, which the "
                        "sandbox does not allow; pass --sandbox none to silence this")
    try:
        probe_bubblewrap(config)
    except SystemExit as exc:
        return "none", (f"{exc}; requests run unsandboxed (install bubblewrap, e.g. apt-get install "
                        "bubblewrap, or pass --sandbox none to silence this)")
    return "bubblewrap", None


SANDBOX_ROOT = kcoral_worker.SANDBOX_ROOT  # inside: the request's own tmpfs (work/, home/, cache/)
# empty mount points in the container: each request's worker mounts its own writable space on them
SANDBOX_DIRECTORIES = (SANDBOX_ROOT, *kcoral_worker.SANDBOX_SPACES)
CAPABILITY_NAMES = {kcoral_worker.CAP_SETGID: "CAP_SETGID", kcoral_worker.CAP_SETUID: "CAP_SETUID",
                    kcoral_worker.CAP_SETPCAP: "CAP_SETPCAP", kcoral_worker.CAP_SYS_ADMIN: "CAP_SYS_ADMIN",
                    kcoral_worker.CAP_SYS_RESOURCE: "CAP_SYS_RESOURCE"}
SANDBOX_ETC = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf",
               "hosts", "localtime", "ssl", "ca-certificates", "os-release", "debian_version", "gitconfig")
SYSTEM_TOPS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# exact names, never prefixes (an NVIDIA_API_KEY must not pass): locale, threads and the tool settings
# kernels need; the cache locations among them are replaced by the sandbox's own
SANDBOX_ENV_NAMES = (
    "PATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "TZ", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "LC_TIME",
    "LC_COLLATE", "LC_MONETARY", "LC_MESSAGES", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "CUDA_HOME", "CUDA_PATH", "CUDA_MODULE_LOADING", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS",
    "NVIDIA_DRIVER_CAPABILITIES", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN",
    "TORCH_CUDA_ARCH_LIST", "TORCH_SHOW_CPP_STACKTRACES", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
    "PYTORCH_NVML_BASED_CUDA_CHECK", "TRITON_PTXAS_PATH", "TVM_FFI_CUDA_ARCH_LIST")
SANDBOX_ADDONS = "/opt/kcoral-tvm-ffi"  # inside: the tvm_ffi torch add-on the server built (read-only)
KILL_SWEEP_SECONDS = 2.0  # SIGKILL sweeps over a container's request processes before it is ended whole
OUTPUT_TAIL_BYTES = 2048  # of what a sandbox's template printed, kept for the error that says why it failed
GPU_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-caps")
# the control nodes CUDA cannot do without, and what breaks inside a container started without them
REQUIRED_GPU_NODES = {"/dev/nvidiactl": "CUDA cannot initialise inside the sandbox",
                      "/dev/nvidia-uvm": "CUDA initialisation and cudaMalloc of managed memory may fail "
                                         "inside the sandbox"}


def probe_bubblewrap(config: ServerConfig) -> None:
    """--sandbox bubblewrap without a working bwrap stops the start-up; it never runs unsandboxed."""
    if shutil.which("bwrap") is None:
        raise SystemExit("kcoral: --sandbox bubblewrap needs bwrap on PATH (Debian: apt-get install bubblewrap)")
    project, _ = project_files()
    # the same filter as each request's, installed in a child: the start fails if it cannot be
    code = f"import sys; sys.path.insert(0, {project!r}); import kcoral_worker; kcoral_worker.check_seccomp()"
    try:
        process = start_container(config, [], [sys.executable, "-I", "-c", code], ())
        output = process.communicate(timeout=60)[0]
    except (OSError, subprocess.TimeoutExpired, WorkerCrashed) as exc:
        raise SystemExit(f"kcoral: --sandbox bubblewrap: bwrap does not work here: {exc}") from None
    if process.returncode != 0:
        lines = output.decode(errors="replace").strip().splitlines() or [f"exit code {process.returncode}"]
        raise SystemExit(f"kcoral: --sandbox bubblewrap: bwrap does not work here: {lines[-1]}")


def sandbox_ids(config: ServerConfig) -> tuple[int, int]:
    """(uid, gid) sandboxed programs run as: --sandbox-uid when the server is root, else the server's own."""
    if os.getuid() == 0:
        return config.sandbox_uid, config.sandbox_uid
    return os.getuid(), os.getgid()


def start_container(config: ServerConfig, gpus: list[int], command: list[str], pass_fds: Iterable[int]
                    ) -> subprocess.Popen:
    """bwrap running `command` as PID 1 of a new container, stdin /dev/null, stdout and stderr one
    pipe the caller reads.  As root, bwrap's own set-up needs the host's root mapped in the
    container's user namespace, and bwrap cannot map another uid: so the namespace waits, blocked,
    until we have mapped root (as its uid 0, for bwrap's set-up only) and the sandbox uid (as
    itself); the template leaves uid 0 before anything else runs (kcoral_worker.become_sandbox_user)."""
    args = IGNORING_TREE_SIGNALS + bwrap_command(config, gpus)
    popen: dict[str, Any] = {"env": sandbox_environment(), "stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE,
                             "stderr": subprocess.STDOUT}
    if os.getuid() != 0:
        return lasting_popen(args + command, pass_fds=tuple(pass_fds), **popen)
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    try:
        process = lasting_popen(args + ["--userns-block-fd", str(block_r), "--info-fd", str(info_w)] + command,
                                pass_fds=(*pass_fds, block_r, info_w), **popen)
    finally:
        os.close(block_r)
        os.close(info_w)
    try:
        uid, gid = sandbox_ids(config)
        child = container_pid(info_r, time.monotonic() + 30)
        for name, host in (("uid_map", uid), ("gid_map", gid)):
            with open(f"/proc/{child}/{name}", "w") as f:
                f.write(f"0 0 1\n{host} {host} 1\n")
        os.write(block_w, b"+")
    except (OSError, ValueError) as exc:
        process.kill()
        said = process.communicate()[0].decode(errors="replace").strip().splitlines()
        raise WorkerCrashed(said[-1] if said else f"the sandbox's user namespace could not be set up: {exc}") from None
    finally:
        os.close(info_r)
        os.close(block_w)
    return process


def container_pid(info: int, deadline: float) -> int:
    """The host pid of a container's first process, from bwrap's --info-fd JSON."""
    text = b""
    while b"}" not in text:
        wait_readable(info, deadline)
        chunk = os.read(info, 4096)
        if not chunk or len(text) > 1 << 16:
            raise ValueError(f"bwrap said {text[:200]!r} about its container")
        text += chunk
    pid = json.loads(text).get("child-pid")
    if type(pid) is not int:
        raise ValueError("bwrap named no container process")
    return pid


class SandboxTemplate:
    """A slot's bubblewrap container, whose PID 1 is a warm template that forks one worker at a time.

    Starting a container and importing torch takes seconds; forking a worker from a template
    that did both once takes milliseconds.  So a slot keeps its container, and each request gets
    a fresh process in namespaces of its own (kcoral_worker.fork_request): its own PIDs, /proc,
    writable tmpfs and IPC objects, all gone with it.  The template takes no signal from inside
    and cannot be traced or read (it is not dumpable); nothing but it lasts between requests.
    """
    pid: int | None  # the template, the container's PID 1, as a host pid, once ready()
    current: SandboxedProcess | None  # the worker it forked last

    def __init__(self, config: ServerConfig, device: str, gpus: list[int]) -> None:
        self.conn, child = multiprocessing.Pipe()
        project, _ = project_files()
        # as the unsandboxed template: GPU workers pin their device after the fork, before CUDA starts
        preload = ["numpy"] + [m for m in ("torch", "tvm_ffi") if importlib.util.find_spec(m)]
        import_env = {"TVM_FFI_CACHE_DIR": SANDBOX_ADDONS} if torch_addons() else {}
        uid, gid = sandbox_ids(config)
        space = kcoral_worker.RequestSpace(uid, gid, config.memory_limit_bytes or 0, config.disk_limit_bytes or 0,
                                           config.file_limit or 0, config.process_limit or 0, kept_mounts(config))
        frame = kcoral_worker.encode_message(space)[kcoral_worker.MESSAGE_HEADER.size:]
        code = (f"import sys; sys.path[:] = {[project, *server_import_path()]!r}; import kcoral_worker; "
                f"kcoral_worker.template_main({child.fileno()}, {preload!r}, {import_env!r}, {frame!r})")
        # -I: no start directory, user site or PYTHON* variables on the import path
        try:
            self.process = start_container(config, gpus, [sys.executable, "-I", "-c", code], (child.fileno(),))
        finally:
            child.close()
        assert isinstance(self.process.stdout, io.BufferedReader)  # start_container pipes it
        self.output = OutputTail(self.process.stdout)
        self.pid = self.current = None

    def ready(self, timeout: float) -> None:
        """Wait for the template's first message; find its host pid."""
        if self.pid is not None:
            return
        try:
            template_pid = receive_checked(self.conn, kcoral_worker.WorkerReady, time.monotonic() + timeout,
                                  f"the sandbox did not start within {timeout:.0f} s").pid
            self.pid = next((p for p in children_of(self.process.pid) if namespace_pids(p)[-1:] == [template_pid]),
                            None)
            if self.pid is None:
                raise WorkerCrashed("the sandbox's template is gone")
        except WorkerCrashed as exc:
            self.kill()
            raise type(exc)(f"{exc}{self.output.said()}") from None

    def alive(self) -> bool:
        return self.process.poll() is None and (self.pid is None or is_live(self.pid))

    def fork(self, conn: Connection, device: str, visible: list[str], timeout: float) -> SandboxedProcess:
        """A fresh worker for `conn` -> its SandboxedProcess.

        A template that does not answer takes its container down with it, so that the slot's
        next worker comes from a new one."""
        self.ready(timeout)
        try:
            if self.current is not None:  # its exit status comes first on the pipe
                self.current.join(5)
                if self.current.exitcode is None:
                    raise WorkerCrashed("the sandbox's previous worker did not exit")
            try:
                kcoral_worker.send_message(self.conn, kcoral_worker.ForkWorker(device, visible))
                reduction.send_handle(self.conn, conn.fileno(), self.pid)
            except OSError as exc:
                raise WorkerCrashed("the sandbox's template is gone") from exc
            forked = receive_checked(self.conn, kcoral_worker.WorkerForked, time.monotonic() + 60,
                            "the sandbox's template did not fork")
            # by its id in the container's namespace (the template's): PID 2 in its own
            worker = next((p for p in children_of(self.pid) if namespace_pids(p)[1:2] == [forked.pid]), None)
            if worker is None:
                raise WorkerCrashed("the sandbox's new worker is gone")
        except WorkerCrashed as exc:  # with what the template and the request's worker printed, if anything
            self.kill()
            raise type(exc)(f"{exc}{self.output.said()}") from None
        self.current = SandboxedProcess(self, worker)
        return self.current

    def kill_requests(self, grace: float, worker_pid: int) -> bool:
        """Kill the worker at once (the template then has its request's init killed, and the kernel
        ends everything in their namespace with the init), then everything else in a request's
        namespace below the template, SIGTERM first, SIGKILL after `grace`, sweep after sweep.
        -> whether it is all gone; if not, the caller ends the container.  One sweep that finds
        nothing is final: the init is listed until the kernel has emptied its namespace, and a
        listed init keeps the sweeps going (terminate's second look is for forks it could miss).
        The template's own child outside them, which makes the inits, lasts."""
        spared = [os.getpgid(self.pid)] if self.pid and is_live(self.pid) else []

        def in_requests() -> list[int]:
            return [pid for pid in descendants(self.pid) if len(namespace_pids(pid)) > 2]
        return kcoral_worker.terminate(in_requests, grace, KILL_SWEEP_SECONDS,
                                       keep_groups=spared, at_once=(worker_pid,), second_look=False)

    def kill(self) -> None:
        """End the container: its init, the template, is SIGKILLed, which takes down every process
        in its PID namespace at once (whatever forked, hid or ignored signals), and bwrap exits with it."""
        with contextlib.suppress(OSError):
            self.conn.close()
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class OutputTail:
    """What a container's template writes to stdout and stderr: read as it comes, so that it never
    blocks, and only the last OUTPUT_TAIL_BYTES kept, for the error that says why a sandbox failed."""

    def __init__(self, stream: io.BufferedReader) -> None:
        self.tail = b""
        threading.Thread(target=self.follow, args=(stream,), name="sandbox-output", daemon=True).start()

    def follow(self, stream: io.BufferedReader) -> None:
        with stream:
            while chunk := stream.read1(1 << 16):
                self.tail = (self.tail + chunk)[-OUTPUT_TAIL_BYTES:]

    def said(self) -> str:
        text = self.tail.decode(errors="replace").strip()
        return f"; it said: {text[-OUTPUT_TAIL_BYTES:]}" if text else ""


class SandboxedProcess:
    """The parts of multiprocessing.Process the pool uses, for a worker its template forked."""

    def __init__(self, template: SandboxTemplate, pid: int) -> None:
        self.template = template
        self.pid = pid
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is None:
            try:
                if self.template.conn.poll(timeout):
                    self.exitcode = receive_checked(self.template.conn, kcoral_worker.WorkerExited,
                                           time.monotonic() + 5, "the sandbox's template stalled").exit_code
            except WorkerCrashed:  # a template that breaks the protocol takes its container down
                self.template.kill()
                self.exitcode = -signal.SIGKILL

    def is_alive(self) -> bool:
        self.join(0)
        return self.exitcode is None


def bwrap_command(config: ServerConfig, gpus: list[int]) -> list[str]:
    """The bubblewrap command line of a slot's container (docs/server.md §3.1).

    Every namespace is new (no network, own PIDs), the template its PID 1 with only the
    capabilities it needs to give each request namespaces of its own (which drop them all); the
    system, the Python environment, our files and --sandbox-readonly-path entries read-only; the
    log directory, disk cache and the server's temporary directory hidden where they would
    otherwise show through one of those.  Nothing is writable: each request mounts its own tmpfs."""
    caps = kcoral_worker.TEMPLATE_CAPS + (kcoral_worker.ROOT_TEMPLATE_CAPS if os.getuid() == 0 else ())
    args = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--unshare-all", "--unshare-user", "--as-pid-1",
            "--cap-drop", "ALL", "--new-session", "--clearenv"]
    for cap in caps:
        args += ["--cap-add", CAPABILITY_NAMES[cap]]
    if os.getuid() != 0:  # as root, incompatible with mapping the uid ourselves; the worker's set-up forbids them
        args += ["--disable-userns"]
    for name, value in sandbox_environment().items():
        args += ["--setenv", name, value]
    for top in SYSTEM_TOPS:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    shown = shown_paths(config)
    addons = {addon: os.path.join(SANDBOX_ADDONS, os.path.basename(addon)) for addon in torch_addons()}
    # bwrap would make the directories above what it binds 0700: the sandbox's uid could not pass
    for parent in parent_directories([*shown, *addons.values(), *(f"/etc/{name}" for name in SANDBOX_ETC)]):
        args += ["--perms", "0755", "--dir", parent]
    for name in SANDBOX_ETC:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    args += ["--ro-bind", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev", "--dir", "/dev/mqueue"]
    for node in [gpu_device_node(g) for g in gpus] + list(GPU_CONTROL_NODES if gpus else ()):
        args += ["--dev-bind-try", node, node]
    args += nvidia_proc_args(gpus)
    for addon, inside in addons.items():
        args += ["--ro-bind", addon, inside]
    for directory in SANDBOX_DIRECTORIES:
        args += ["--dir", directory]
    hidden = [os.path.abspath(p) for p in (config.log_dir, config.disk_cache_dir, tempfile.gettempdir(),
                                           os.path.expanduser("~")) if p]
    hidden = [p for p in hidden if any(is_under(p, s) for s in shown)]
    # parents before children, so a hidden directory's tmpfs never covers a mount inside it
    for path, kind in sorted([(p, "--ro-bind") for p in shown] + [(p, "--tmpfs") for p in hidden]):
        args += [kind, path] if kind == "--tmpfs" else [kind, path, path]
    # Last, everything bwrap itself made writable becomes read-only (its root, /dev, the hiding
    # tmpfs mounts): a file left anywhere would otherwise be there for the next request.
    for path in ["/", "/dev", *hidden]:
        args += ["--remount-ro", path]
    return args + ["--chdir", "/"]


def sandbox_environment() -> dict[str, str]:
    """An allow-list of the server's variables, never its secrets; home, temporary files and the
    compiler/JIT caches all inside the request's own tmpfs, so they vanish with the request."""
    env = {k: v for k, v in os.environ.items() if k in SANDBOX_ENV_NAMES}
    for name in ("PATH", "LD_LIBRARY_PATH"):  # a directory that does not exist inside could not be created there
        if name in env:
            env[name] = ":".join(d for d in env[name].split(":") if shown_inside(d))
    cache = f"{SANDBOX_ROOT}/cache"
    env.update(HOME=f"{SANDBOX_ROOT}/home", TMPDIR="/tmp", XDG_CACHE_HOME=cache,
               TORCH_EXTENSIONS_DIR=f"{cache}/torch_extensions", TRITON_CACHE_DIR=f"{cache}/triton",
               CUDA_CACHE_PATH=f"{cache}/nv", TVM_FFI_CACHE_DIR=f"{cache}/tvm-ffi")
    return env


def is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def shown_inside(directory: str) -> bool:
    """Whether a host directory exists, read-only, inside every container (the system directories
    and the Python installation; not the operator's --sandbox-readonly-path entries)."""
    return (os.path.isabs(directory) and os.path.isdir(directory)
            and any(is_under(os.path.realpath(directory), top) for top in SYSTEM_TOPS + tuple(python_paths())))


def python_paths() -> list[str]:
    """What the interpreter needs to run our worker: its prefixes and import path, minus the
    server's working directory (only the project's own files are shown from there)."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix] + server_import_path()
    return sorted(set(map(os.path.abspath, paths)))


def server_import_path() -> list[str]:
    """The server's import path, in order, minus its working directory and ours.  A sandbox's
    `python -I` would drop what PYTHONPATH or the user site added to it (where the server's own
    torch or tvm_ffi may come from), so its template is handed this path; each entry is shown
    read-only (python_paths)."""
    project = os.path.dirname(os.path.abspath(kcoral_worker.__file__))
    skipped = {"", os.getcwd(), project}
    return [os.path.abspath(p) for p in sys.path if p not in skipped and os.path.exists(p)]


def project_files() -> tuple[str, list[str]]:
    project = os.path.dirname(os.path.abspath(kcoral_worker.__file__))
    names = ("kcoral_worker.py", "kcoral.py", "client.py")
    return project, [os.path.join(project, n) for n in names if os.path.exists(os.path.join(project, n))]


def shown_paths(config: ServerConfig) -> list[str]:
    """The host paths a sandbox shows read-only at the same place: Python, our files, the operator's."""
    _, files = project_files()
    return python_paths() + files + [os.path.abspath(p) for p in config.sandbox_readonly_paths]


def parent_directories(paths: list[str]) -> list[str]:
    """Every directory above `paths` that a container's root lacks (outside the system's), parents first."""
    parents = {os.path.dirname(path) for path in paths}
    while (more := {os.path.dirname(p) for p in parents} - parents):
        parents |= more
    return sorted(p for p in parents if p != "/" and not any(is_under(p, top) for top in SYSTEM_TOPS))


def kept_mounts(config: ServerConfig) -> list[str]:
    """The read-only paths a container shows inside /tmp, /var/tmp or /dev/shm (a checkout or a
    --sandbox-readonly-path under /tmp, say): each request's own writable space there keeps them."""
    return [path for path in shown_paths(config)
            if any(is_under(path, place) and path != place for place in kcoral_worker.SANDBOX_SPACES)]


def torch_addons() -> list[str]:
    """The tvm_ffi torch add-on(s) prepare_template_imports built into the host's cache, if any:
    the sandbox shows them so its template does not compile them again (minutes with nvcc)."""
    cache = os.path.expanduser(os.environ.get("TVM_FFI_CACHE_DIR", "~/.cache/tvm-ffi"))
    try:
        return [os.path.join(cache, n) for n in sorted(os.listdir(cache)) if n.startswith("libtorch_c_dlpack_addon")]
    except OSError:
        return []


def gpu_device_node(gpu_id: int) -> str:
    """/dev/nvidiaN of a physical GPU id: NVML's minor number, the id itself where NVML cannot say."""
    library, handle, minor = nvml(), ctypes.c_void_p(), ctypes.c_uint()
    if (library is not None and library.nvmlDeviceGetHandleByIndex_v2(gpu_id, ctypes.byref(handle)) == 0
            and library.nvmlDeviceGetMinorNumber(handle, ctypes.byref(minor)) == 0):
        return f"/dev/nvidia{minor.value}"
    return f"/dev/nvidia{gpu_id}"


def nvidia_proc_args(gpus: list[int]) -> list[str]:
    """bwrap arguments showing only these GPUs' folders in the container's /proc/driver/nvidia/gpus,
    as the NVIDIA container runtime does: a read-only tmpfs over it, with their own folders (matched
    by the device minor number their nodes have) bound back read-only."""
    folder = kcoral_worker.NVIDIA_PROC_GPUS
    if not gpus or not os.path.isdir(folder):
        return []
    minors = {gpu_device_node(g).removeprefix("/dev/nvidia") for g in gpus}
    args = ["--tmpfs", folder]
    for name in sorted(os.listdir(folder)):
        entry = os.path.join(folder, name)
        if device_minor(entry) in minors:
            args += ["--ro-bind", entry, entry]
    return args + ["--remount-ro", folder]


def device_minor(entry: str) -> str | None:
    """The `Device Minor:` of a /proc/driver/nvidia/gpus folder's information file."""
    try:
        with open(os.path.join(entry, "information")) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("Device Minor:")), None)
    except OSError:
        return None


def ensure_gpu_control_nodes(log: EventLog) -> list[str]:
    """The sandbox shows a device node only if it exists when the container starts, and on a freshly
    booted host /dev/nvidia-uvm does not until the first CUDA program's driver runs the setuid
    nvidia-modprobe, which cannot work inside a container.  So run it here, as the driver would
    (unprivileged: it is setuid root where installed), and warn about any node still missing.
    -> the required nodes still missing."""
    missing = [node for node in REQUIRED_GPU_NODES if not os.path.exists(node)]
    modprobe = shutil.which("nvidia-modprobe")
    if missing and modprobe:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([modprobe, "-u", "-c=0"], check=False, timeout=30, stdin=subprocess.DEVNULL,
                           capture_output=True)
        missing = [node for node in missing if not os.path.exists(node)]
    for node in missing:
        log.event("gpu_device_node_missing", "WARNING", node=node, effect=REQUIRED_GPU_NODES[node],
                  remedy="run nvidia-modprobe -u -c=0 (or load nvidia-uvm and create the node) and restart")
    return missing


def namespace_pids(pid: int) -> list[int]:
    """A process's id in each PID namespace it is in, the host's first (NSpid); [] once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return [int(n) for n in next(line for line in f if line.startswith("NSpid:")).split()[1:]]
    except (OSError, StopIteration, ValueError):
        return []


SPAWNS: dict[str, Any] = {"queue": None, "lock": threading.Lock()}


# bwrap and its container's init cannot be told to ignore SIGTERM and SIGINT; an ignored signal
# stays ignored across exec (the template inside then installs its own handlers)
IGNORING_TREE_SIGNALS = ["/bin/sh", "-c", 'trap "" TERM INT; exec "$@"', "sh"]


def lasting_popen(args: list[str], **options: Any) -> subprocess.Popen:
    """subprocess.Popen run by one thread that lives as long as the server.

    bwrap --die-with-parent ties a container to the *thread* that started it (PR_SET_PDEATHSIG),
    and the pool starts containers from threads that come and go.
    """
    with SPAWNS["lock"]:
        if SPAWNS["queue"] is None:
            SPAWNS["queue"] = queue.SimpleQueue()
            threading.Thread(target=serve_spawns, args=(SPAWNS["queue"],), name="kcoral-spawner",
                             daemon=True).start()
    reply: queue.SimpleQueue[subprocess.Popen | Exception] = queue.SimpleQueue()
    SPAWNS["queue"].put((args, options, reply))
    outcome = reply.get()
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def serve_spawns(requests: queue.SimpleQueue) -> None:
    while True:
        args, options, reply = requests.get()
        try:
            reply.put(subprocess.Popen(args, **options))
        except (OSError, ValueError, subprocess.SubprocessError) as exc:  # handed to the caller
            reply.put(exc)


# --- 13. what the application records: event log, saved programs, metrics (docs/server.md §10) ----

# The log and the saved programs hold every tenant's requests: they are for the server's user alone,
# whatever the umask (the modes are given where the files are created; a umask can only narrow them).
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
EVENTS_NAME = "events.jsonl"
NEW_FILE_FLAGS = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def console_value(value: Any) -> str:
    """A field as the console line shows it: floats rounded, and text that is not one plain word
    quoted and escaped as in JSON, so that no value (a program's message, say) can break the line
    or forge a field or a line of its own."""
    if isinstance(value, float):
        return str(round(value, 1))
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' ="\\'):
        return text
    return json.dumps(text)


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view[:1 << 30]):]


def write_all_at(fd: int, data: Buffer, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view[:1 << 30], offset)
        view, offset = view[written:], offset + written


def open_log_directory(path: str, name: str | None = None, parent: int | None = None) -> int:
    """The directory `name` under the open directory `parent` (or `path` itself), created 0700 if
    absent -> an fd on it.  One that another user owns or may write to is refused (SystemExit, one
    line): whoever can write there could read the log or swap its files."""
    if name is None:  # the log directory itself: its parents as for any directory, and it may be a link
        os.makedirs(path, PRIVATE_DIR_MODE, exist_ok=True)
        fd = os.open(path, DIRECTORY_FLAGS)
    else:  # below it, nothing is followed
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=parent)
        fd = os.open(name, DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    info = os.fstat(fd)
    problem = (f"is owned by uid {info.st_uid}, not by this server's user ({os.geteuid()})"
               if info.st_uid != os.geteuid() else "is writable by other users" if info.st_mode & stat.S_IWOTH
               else None)
    if problem:
        os.close(fd)
        raise SystemExit(f"kcoral: log directory {os.path.join(path, name) if name else path} {problem}; "
                         "give --log-dir a directory of your own")
    return fd


def open_run_directory(log_dir: str) -> tuple[int, str]:
    """A new <log_dir>/runs/<UTC timestamp>/ for this start -> (an fd on it, its path)."""
    top = open_log_directory(log_dir)
    try:
        runs = open_log_directory(log_dir, "runs", top)
    finally:
        os.close(top)
    try:
        while True:  # a name nobody has taken: another server may have started in the same microsecond
            stamp = utc_now().strftime("%Y%m%dT%H%M%S.%fZ")
            try:
                os.mkdir(stamp, PRIVATE_DIR_MODE, dir_fd=runs)
            except FileExistsError:
                continue
            return os.open(stamp, DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=runs), os.path.join(log_dir, "runs", stamp)
    finally:
        os.close(runs)


class SavedPrograms:
    """<run dir>/programs/<request_id>.json, bounded in bytes and in count: a new program makes
    room by removing the oldest, so the directory stays within its caps whatever the traffic."""

    def __init__(self, run_fd: int, config: ServerConfig) -> None:
        os.mkdir("programs", PRIVATE_DIR_MODE, dir_fd=run_fd)
        self.fd = os.open("programs", DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=run_fd)
        self.max_bytes = config.log_programs_max_bytes
        self.max_count = config.log_programs_max_count
        self.kept: collections.deque[tuple[str, int]] = collections.deque()  # (name, size), oldest first
        self.total = 0
        self.lock = threading.Lock()

    def save(self, request_id: str, data: Buffer) -> None:
        """Best effort: a program larger than the whole budget, or a request id seen before, is not saved."""
        size = memoryview(data).nbytes
        if size > self.max_bytes or self.max_count < 1:
            return
        name = f"{request_id}.json"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_EXCL | NEW_FILE_FLAGS, PRIVATE_FILE_MODE, dir_fd=self.fd)
        except OSError:
            return
        try:
            write_all(fd, data)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.fd)  # no half-written program is left behind
            return
        finally:
            os.close(fd)
        with self.lock:
            self.kept.append((name, size))
            self.total += size
            while self.total > self.max_bytes or len(self.kept) > self.max_count:
                oldest, oldest_size = self.kept.popleft()
                self.total -= oldest_size
                with contextlib.suppress(OSError):
                    os.unlink(oldest, dir_fd=self.fd)

    def close(self) -> None:
        os.close(self.fd)


class EventLog:
    """One server instance's event log: JSON lines in <run dir>/events.jsonl, rotated at
    `log_max_bytes` and reopened by name on SIGHUP, mirrored on stderr; its saved programs.

    Each server has its own, so two servers in one process (or one started after another
    stopped) never write into each other's files.  Logging is best effort: a failing write
    never fails a request."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.run_fd: int | None = None  # the run directory, held open: its files are found from it
        self.fd: int | None = None  # events.jsonl
        self.programs: SavedPrograms | None = None
        self.metrics = Metrics()  # fed by the events below, so the metrics and the log agree

    def open(self) -> str | None:
        """Create this start's run directory and open its log -> its path (None: no log file)."""
        config = self.config
        if not config.log_dir:
            return None
        try:
            self.run_fd, run_dir = open_run_directory(config.log_dir)
            self.fd = self.open_events()
            if config.log_programs:
                self.programs = SavedPrograms(self.run_fd, config)
        except OSError as exc:
            self.close()
            print(f"kcoral: cannot write logs under {config.log_dir}: {exc}", file=sys.stderr)
            return None
        return run_dir

    def open_events(self) -> int:
        return os.open(EVENTS_NAME, os.O_WRONLY | os.O_APPEND | NEW_FILE_FLAGS, PRIVATE_FILE_MODE, dir_fd=self.run_fd)

    def event(self, event: str, level: str = "INFO", **fields: Any) -> None:
        """One JSON line per event in the run's events.jsonl; request and lifecycle lines on stderr."""
        record = {"timestamp": utc_now().isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                  "level": level, "event": event, **fields}
        self.metrics.record(event, level, fields)
        with self.lock:
            if self.fd is not None:
                self.append((json.dumps(record, default=str) + "\n").encode())
            if self.config.log_console and event not in ("request_received",):
                shown = " ".join(f"{k}={console_value(v)}" for k, v in fields.items()
                                 if v is not None and k not in ("traceback", "versions", "config"))
                print(f"{record['timestamp']} {level} {event} {shown}"[:600], file=sys.stderr, flush=True)

    def append(self, line: bytes) -> None:
        """Write one record, rotating first when it would take the file past the cap (the size is
        the file's own, so a logrotate `copytruncate` is seen).  Called with the lock held."""
        limit = self.config.log_max_bytes
        assert self.fd is not None  # event() checked, under the lock; rotate() leaves one open or raises
        try:
            size = os.fstat(self.fd).st_size
            if limit and size and size + len(line) > limit:
                self.rotate()
            write_all(self.fd, line)
        except OSError:
            pass

    def rotate(self) -> None:
        """events.jsonl -> events.jsonl.1 -> .2 ... up to `log_backups` (the oldest goes), then a new
        events.jsonl.  Called with the lock held."""
        assert self.fd is not None  # append() checked
        os.close(self.fd)
        self.fd = None
        names = [EVENTS_NAME] + [f"{EVENTS_NAME}.{n}" for n in range(1, self.config.log_backups + 1)]
        try:
            if len(names) == 1:
                os.unlink(EVENTS_NAME, dir_fd=self.run_fd)
            for newer, older in reversed(list(zip(names, names[1:]))):
                with contextlib.suppress(FileNotFoundError):
                    os.rename(newer, older, src_dir_fd=self.run_fd, dst_dir_fd=self.run_fd)
        finally:
            self.fd = self.open_events()

    def reopen(self) -> None:
        """SIGHUP, after logrotate renamed events.jsonl: write to a file of that name again."""
        with self.lock:
            if self.run_fd is None:
                return
            if self.fd is not None:
                os.close(self.fd)
            try:
                self.fd = self.open_events()
            except OSError as exc:
                self.fd = None
                print(f"kcoral: cannot reopen {EVENTS_NAME}: {exc}", file=sys.stderr)
        self.event("log_reopened")

    def save_program(self, request_id: str, data: Buffer) -> None:
        if self.programs is not None:
            self.programs.save(request_id, data)

    def close(self) -> None:
        with self.lock:
            for fd in (self.fd, self.run_fd):
                if fd is not None:
                    os.close(fd)
            if self.programs is not None:
                self.programs.close()
            self.fd = self.run_fd = self.programs = None


# Prometheus text exposition format 0.0.4 (docs/operations.md, "Monitoring"): what GET /metrics serves
METRIC_HELP = {
    "kcoral_requests_total": ("counter", "Requests answered, by result status, HTTP code and error kind"),
    "kcoral_request_lease_wait_seconds": ("histogram", "Time a request's worker waited for the GPU lease"),
    "kcoral_request_lease_held_seconds": ("histogram", "Time a request's worker held the GPU lease"),
    "kcoral_request_duration_seconds": ("histogram", "Time from a request's first byte to its answer"),
    "kcoral_request_queue_seconds": ("histogram", "Time a request waited for a worker (and in HAProxy's queue)"),
    "kcoral_request_body_bytes_total": ("counter", "Bytes of request bodies read"),
    "kcoral_response_body_bytes_total": ("counter", "Bytes of response bodies sent"),
    "kcoral_events_total": ("counter", "Event log records, by event and level"),
    "kcoral_reads_refused_total": ("counter", "GET /health and /metrics refused for their token (probes, scrapes)"),
    "kcoral_requests_in_progress": ("gauge", "Requests running: holding a worker slot (as /health)"),
    "kcoral_busy_seconds_total": ("counter", "Seconds worker slots were held by requests, per tenant (running "
                                  "ones up to now): rate() is the busy share of the slots"),
    "kcoral_requests_waiting": ("gauge", "Requests waiting for a free worker"),
    "kcoral_capacity": ("gauge", "Requests this node runs at once (0 while draining)"),
    "kcoral_worker_starts_total": ("counter", "Worker processes started"),
    "kcoral_worker_crashes_total": ("counter", "Workers that died or broke the protocol outside the program's "
                                    "instructions: the server's faults"),
    "kcoral_program_crashes_total": ("counter", "Workers a program ended while its instructions ran (its own "
                                     "signal, exit, memory, or the OOM killer), by cause"),
    "kcoral_worker_replacements_total": ("counter", "Workers replaced after serving"),
    "kcoral_cache_hits_total": ("counter", "Blobs a request referenced without sending, found in the cache"),
    "kcoral_cache_misses_total": ("counter", "Blobs a request referenced without sending, not in the cache"),
    "kcoral_cache_evictions_total": ("counter", "Cache entries evicted to stay within the cache's budget"),
    "kcoral_cache_bytes": ("gauge", "Bytes the cache holds (the disk cache: blocks its files occupy)"),
    "kcoral_cache_entries": ("gauge", "Entries the cache holds"),
    "kcoral_gpu_lease_busy_seconds_total": ("counter", "Seconds of released GPU leases, by GPU"),
    "kcoral_tenant_requests_running": ("gauge", "Requests running, per tenant named in --token-file"),
    "kcoral_tenant_requests_waiting": ("gauge", "Requests waiting for a worker, per tenant named in --token-file"),
    "kcoral_info": ("gauge", "This node's version, device and sandbox mode (always 1)"),
    "kcoral_requests_cancelled_total": ("counter", "Requests stopped as their client left, by phase and tenant"),
}
# Upper bounds, seconds: 17 a decade (at most 15 % apart) from 1 ms to 60 s, where queue waits and
# executions lie, so that histogram_quantile's interpolation within one bucket, which can reach its
# upper bound when a few observations sit at its lower one, stays within 20 % of them (a third apart
# put two 1.03 s timeouts' p95 at 1.24 s); coarse beyond, up to the longest timeout.
DURATION_BUCKETS = (*sorted({float(f"{10 ** (k / 17 - 3):.3g}") for k in range(82)} | {60.0}),
                    120.0, 300.0, 600.0, 900.0)
TENANT_HISTOGRAMS = ("kcoral_request_queue_seconds", "kcoral_request_duration_seconds")  # labelled by tenant
KNOWN_KINDS = kcoral_worker.ERROR_KINDS | {"busy", "timeout", "request_too_large", "response_too_large",
                                           "unauthorized"}
Labels = tuple[tuple[str, str], ...]
# Every (status, code, kind) a node answers a POST with, and the ERROR events an operator alerts on:
# their series exist at 0 from the start, so that a ratio or increase() over them has a value on a
# node that never had one (Prometheus sees no increase in a series that first appears at 1).
ANSWERS = ((("COMPLETED", "200", ""), ("CACHE_MISS", "200", ""))
           + tuple(("FAILED", "200", kind) for kind in sorted(kcoral_worker.ERROR_KINDS))
           + tuple(("ERROR", code, kind) for code, kind in (
               ("400", "parse"), ("401", "unauthorized"), ("408", "parse"), ("413", "request_too_large"),
               ("429", "busy"), ("431", "parse"), ("500", "engine"), ("500", "response_too_large"), ("503", "busy"),
               ("504", "timeout"))))
CANCELLED_PHASES = ("queue", "lease", "running")  # wait_turn's phases, and the program's
CRASH_CAUSES = ("signal", "exit", "protocol", "memory_limit", "oom")  # Execution.crash_kind
ALERTED_EVENTS = ("gpu_quarantined", "worker_replace_failed", "cleanup_failed", "tokens_reload_failed", "server_error")


@dataclasses.dataclass
class Histogram:
    """Observations per bucket of DURATION_BUCKETS, the last one +Inf's (not cumulative: rendering adds them up)."""
    counts: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bucket_index(DURATION_BUCKETS, value)] += 1
        self.total += value

    def lines(self, name: str, labels: Labels = ()) -> list[str]:
        """The exposition's cumulative buckets (each counts every observation at or below its bound,
        so +Inf's equals _count), then _sum and _count."""
        lines, running = [], 0
        for bound, count in zip(DURATION_BUCKETS + (math.inf,), self.counts):
            running += count
            le = (("le", "+Inf" if bound == math.inf else f"{bound:g}"),)
            lines.append(f"{name}_bucket{label_text(labels + le)} {running}")
        return lines + [f"{name}_sum{label_text(labels)} {sample_value(self.total)}",
                        f"{name}_count{label_text(labels)} {running}"]


class Metrics:
    """Counters and histograms of one node, fed by its event log's records (`record`), and the
    text GET /metrics answers (`render`, given the gauges read at scrape time).

    Label values come from closed sets (result statuses, HTTP codes our code answers, error
    kinds, event names, GPU ids), never from what a client sends: the number of series stays
    bounded whatever the traffic."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counters: dict[tuple[str, Labels], float] = collections.defaultdict(float)
        for event in ALERTED_EVENTS:
            self.counters["kcoral_events_total", (("event", event), ("level", "ERROR"))] = 0
        for name in ("kcoral_reads_refused_total", "kcoral_request_body_bytes_total",
                     "kcoral_response_body_bytes_total", "kcoral_worker_starts_total",
                     "kcoral_worker_crashes_total", "kcoral_worker_replacements_total"):
            self.counters[name, ()] = 0
        for cause in CRASH_CAUSES:
            self.counters["kcoral_program_crashes_total", (("cause", cause),)] = 0
        self.histograms: dict[tuple[str, Labels], Histogram] = {
            (name, ()): Histogram() for name, (kind, _) in METRIC_HELP.items() if kind == "histogram"}
        self.tenants: set[str] = set()
        self.declare_tenants([""])

    def declare_tenants(self, names: Iterable[str]) -> None:
        """Every series of a request's tenant at 0, for each of `names` ("": anonymous) not seen yet: the
        token file's tenants have theirs from the start and from the SIGHUP that adds them, so increase()
        and ratios count each one's first request.  A tenant removed keeps its series until the restart."""
        with self.lock:
            for name in set(names) - self.tenants:
                self.tenants.add(name)
                tenant = (("tenant", name),) if name else ()
                for status, code, kind in ANSWERS:
                    self.counters["kcoral_requests_total", (("status", status), ("code", code), ("kind", kind),
                                                            *tenant)] += 0
                for phase in CANCELLED_PHASES:
                    self.counters["kcoral_requests_cancelled_total", (("phase", phase), *tenant)] += 0
                for histogram in TENANT_HISTOGRAMS:
                    self.histograms.setdefault((histogram, tenant), Histogram())

    def declared_tenants(self) -> list[str]:
        with self.lock:
            return sorted(self.tenants)

    def add(self, name: str, value: float = 1.0) -> None:
        with self.lock:
            self.counters[name, ()] += value

    def record(self, event: str, level: str, fields: dict[str, Any]) -> None:
        with self.lock:
            self.counters["kcoral_events_total", (("event", event), ("level", level))] += 1
            self.count_request(event, fields)
            if event == "worker_crashed":  # Execution.count_crash
                self.counters[("kcoral_worker_crashes_total", ()) if fields["by"] == "server" else
                              ("kcoral_program_crashes_total", (("cause", fields["cause"]),))] += 1
            if event == "request_cancelled":
                self.counters["kcoral_requests_cancelled_total", (("phase", fields["phase"]),
                                                                  *tenant_label(fields))] += 1

    def count_request(self, event: str, fields: dict[str, Any]) -> None:
        """A request's answer (sent, refused, or lost with the client), from its event's fields.
        Called with the lock held."""
        answered = event in ("request_finished", "request_refused") or (
            event == "client_disconnected" and fields.get("phase") == "response")
        if not answered or fields.get("http_status") is None:
            return
        if event == "request_refused" and fields.get("request_id") == "":
            # a GET (/health, /metrics) without the token: a probe or a scrape, not a client's request
            self.counters["kcoral_reads_refused_total", ()] += 1
            return
        kind = fields.get("error_kind") or ""
        labels = (("status", str(fields.get("status", "ERROR"))), ("code", str(fields["http_status"])),
                  ("kind", kind if kind in KNOWN_KINDS or not kind else "other"), *tenant_label(fields))
        self.counters["kcoral_requests_total", labels] += 1
        self.counters["kcoral_request_body_bytes_total", ()] += fields.get("request_bytes") or 0
        self.counters["kcoral_response_body_bytes_total", ()] += fields.get("response_bytes") or 0
        for name, field in (("kcoral_request_queue_seconds", "queue_ms"),
                            ("kcoral_request_lease_wait_seconds", "lease_wait_ms"),
                            ("kcoral_request_lease_held_seconds", "lease_held_ms"),
                            ("kcoral_request_duration_seconds", "total_ms")):
            if isinstance(fields.get(field), (int, float)):
                labels = tenant_label(fields) if name in TENANT_HISTOGRAMS else ()
                self.histograms.setdefault((name, labels), Histogram()).observe(fields[field] / 1e3)

    def render(self, gauges: list[tuple[str, Labels, float]]) -> str:
        """The exposition text: this node's counters and histograms, then `gauges` (name,
        labels, value: read from the pool, caches and lease just now)."""
        with self.lock:
            series = [(name, labels, value) for (name, labels), value in self.counters.items()]
            histograms = {key: histogram.lines(*key) for key, histogram in sorted(self.histograms.items())}
        series += gauges
        lines = []
        for name, (kind, text) in METRIC_HELP.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [line for (n, _), rendered in histograms.items() if n == name for line in rendered]
            lines += [f"{name}{label_text(labels)} {sample_value(value)}" for n, labels, value in sorted(series)
                      if n == name]
        return "\n".join(lines) + "\n"


def tenant_label(fields: dict[str, Any]) -> Labels:
    """A request event's tenant as a label: a name from --token-file (the server puts no other in its
    events), none for anonymous requests, so a server without named tokens keeps its series."""
    return (("tenant", fields["tenant"]),) if fields.get("tenant") else ()


def bucket_index(bounds: tuple[float, ...], value: float) -> int:
    """The index of the first bucket whose upper bound holds `value` (len(bounds): +Inf only)."""
    return next((i for i, bound in enumerate(bounds) if value <= bound), len(bounds))


def sample_value(value: float) -> str:
    """Exact: a byte counter past a million must not lose digits (`:g` keeps six)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def label_text(labels: Labels) -> str:
    if not labels:
        return ""
    escaped = (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, value in labels)
    return "{" + ",".join(f'{key}="{value}"' for (key, _), value in zip(labels, escaped)) + "}"


# --- 14. command line (docs/server.md §9.2) -------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["haproxy-config"]:
        return haproxy_config_main(argv[1:])
    if argv[:1] == ["run"]:  # the client-side command line lives in client.py
        sys.exit(load_client().run_command(argv[1:]))
    if argv[:1] == ["server"]:  # the published package's `kcoral server ...` spelling
        argv = argv[1:]
    KCoralServer(parse_args(argv)).serve_forever()


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field, named, defaulted and described by the field itself."""
    types_of = typing.get_type_hints(ServerConfig)  # the annotations are strings (postponed evaluation)
    for field in dataclasses.fields(ServerConfig):
        meta = field.metadata
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        default = meta["cli_default"] if meta["cli_default"] is not None else default
        if meta["env"] and meta["env"] in os.environ:
            default = os.environ[meta["env"]]
        flag = "--" + field.name.replace("_", "-")
        env_note = f" [env {meta['env']}]" if meta["env"] else ""
        if meta["flag"]:
            parser.add_argument(meta["flag"], dest=field.name, action="append", default=[], help=meta["help"])
        elif types_of[field.name] is bool:  # every boolean setting defaults to on; the flag turns it off
            parser.add_argument("--no-" + flag[2:], dest=field.name, action="store_false",
                                help=f"do not {meta['help']}")
        else:
            if isinstance(default, tuple):  # parsed from its string form like an env value
                default = ",".join(map(str, default))
            kind = next((t for t in (int, float) if types_of[field.name] in (t, t | None)), str)
            parser.add_argument(flag, type=kind, default=default, choices=meta["choices"],
                                help=meta["help"] + env_note + " (default: %(default)s)")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values, types_of = {}, typing.get_type_hints(ServerConfig)
    for field in dataclasses.fields(ServerConfig):
        value = getattr(args, field.name)
        if field.metadata["parse"]:
            value = field.metadata["parse"](value)
        elif field.metadata["flag"]:
            value = tuple(value)
        elif types_of[field.name] == str | None and value == "":  # '' disables, as in the published package
            value = None
        values[field.name] = value
    return ServerConfig(**values)


def parse_args(argv: list[str]) -> ServerConfig:
    p = argparse.ArgumentParser(
        prog="kcoral", allow_abbrev=False,
        usage="%(prog)s [server] [flags]\n       %(prog)s run TOOL [options] -- ARGS...\n"
              "       %(prog)s haproxy-config --listen HOST:PORT NODE_URL[=SLOTS]...",
        description="KCoral server: runs uploaded programs on GPU or CPU workers. "
                    "It executes arbitrary code by design; bind it to trusted networks.",
        epilog="`kcoral run --help` runs a local script or tool on a server; "
               "`kcoral haproxy-config --help` writes the HAProxy configuration of a cohort of servers.")
    p.add_argument("--version", action="version", version=f"kcoral {__version__}")
    add_config_flags(p)
    for flag in ("--router", "--node-id", "--node-token"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(arg == "--token" or arg.startswith("--token=") for arg in argv):
        print("kcoral: warning: --token on the command line is visible to every local user (ps, "
              "/proc/PID/cmdline); give it in KCORAL_TOKEN or --token-file instead", file=sys.stderr)
    if args.router or args.node_id or args.node_token:
        p.error("router mode is not implemented in this server; scale out behind HAProxy instead "
                "(python -m kcoral haproxy-config prints its configuration; see docs/scaling.md)")
    try:
        config = config_from_args(args)
        validate_config(config)
    except ValueError as exc:
        p.error(str(exc))
    return config


# --- 15. a cohort of nodes behind HAProxy (`python -m kcoral haproxy-config`, docs/scaling.md) ----

AFFINITY_HEADER = "X-KCoral-Affinity"  # client.py sets it to the sha256 of a request's largest blob
HAPROXY_TEMPLATE = """\
# HAProxy configuration for a KCoral cohort, generated by `python -m kcoral haproxy-config`
# (kcoral {version}).  Run it with `haproxy -W -f THIS_FILE`; regenerate it to add or remove a node
# (docs/operations.md: drain the node first).  Local edits belong in an --include file, or in
# sections of a second file given with another -f: changes made here are lost when it is regenerated.
# Nodes ({total} slots in all):
{node_list}
global
    maxconn 4096
    log stderr format raw local0 info   # one line per request (status, node, timings, retries)
{user_group}    # The master's pid in master-worker mode (-W, -Ws): signal it to reload, `kill -USR2
    # $(cat PIDFILE)`, never `pidof haproxy`, which names every HAProxy of the machine.
    # A -p on HAProxy's command line takes precedence.
    pidfile {pidfile}
    # The admin socket (`show stat`, `set server kcoral_spread/NODE state drain`:
    # docs/operations.md), for root only.  expose-fd listeners: a reload hands the listening
    # sockets over to the new process, so no connection is refused while it starts.
    stats socket {stats_socket} mode 600 level admin expose-fd listeners

defaults
    mode http
    log global
    option httplog
    option http-server-close      # a fresh node connection per request: a drained or restarted node
                                  # is never sent a request over a connection it has given up
    option abortonclose           # a client gone: its request leaves the queue, and the node sees the
                                  # connection close, so it stops the program (docs/scaling.md)
    timeout connect 3s
    # A client has this long for a request's line and headers (408 and close beyond it), and an
    # idle kept-alive connection is closed after the second: as the nodes' own limits, so that a
    # connection sending nothing, or a byte at a time, cannot be held.  The body is the nodes' to
    # police as it streams through (--body-rate-min-bytes, docs/server.md).
    timeout http-request {header_timeout}
    timeout http-keep-alive {keepalive_timeout}
    # server: the longest execution a node allows, plus teardown.  queue: queueing, not
    # refusal; beyond the cohort's slots a request waits here (FIFO) as long as a node would
    # have let it wait for a worker, then gets 503 busy.
    timeout client {server_timeout}
    timeout server {server_timeout}
    timeout queue {queue_timeout}
    timeout check 5s
    # Retries.  A POST /execute runs user code, so it is retried on another node ONLY when
    # nothing ran: the connection failed before the request was sent (conn-failure), or the
    # node answered 503 busy, which a KCoral node sends only before execution starts (it is
    # shutting down, or no worker freed up).  Never "empty-response", "junk-response" or
    # "response-timeout": a node killed mid-execution would have its program run twice.
    # Requests larger than tune.bufsize (16 KiB) cannot be replayed; their 503 reaches the client.
    retries 3
    retry-on conn-failure 503
    option redispatch 1           # every retry goes to another node
    # HAProxy's own answers keep the KCoral error shape, so clients report them clearly.
    http-error status 502 content-type application/json lf-string '{{"status":"ERROR","request_id":"%[unique-id]",\
"error":{{"kind":"engine","message":"the node failed before answering (it may have run the program); not retried"}}}}'
    http-error status 503 content-type application/json lf-string '{{"status":"ERROR","request_id":"%[unique-id]",\
"error":{{"kind":"busy","message":"no node of the cohort could take the request in time"}}}}' hdr Retry-After 1
    http-error status 504 content-type application/json lf-string '{{"status":"ERROR","request_id":"%[unique-id]",\
"error":{{"kind":"timeout","message":"the node did not answer within the proxy server timeout"}}}}'
    # Health: GET /health must answer 200 with a non-zero request_capacity (a node that has
    # begun a graceful shutdown reports 0, so HAProxy stops sending it work while it drains).
    # The header tells the node a balancer checks it: it holds the 503s of its drain until two
    # checks have taken it out here, so that their retries go to other nodes.
    option httpchk
    http-check send meth GET uri /health hdr {check_header} haproxy{check_auth}{check_secret}
    http-check expect status 200
    http-check expect ! rstring \\"request_capacity\\":0[,}}]
    # check: every second (every 250 ms while changing state); down after 2 failed checks, back
    # after 2 good ones.  A refused connection marks the node down at once: least connections
    # would otherwise keep choosing a dead node, the one with the fewest connections.  (Not
    # "observe layer7": it would also take a healthy node out for a program's 504 timeout.)
    default-server check inter 1s fastinter 250ms downinter 1s fall 2 rise 2 \
observe layer4 error-limit 1 on-error mark-down

frontend kcoral
    bind {listen}{tls}
    # Per client address (IPv4 ones are kept as IPv6-mapped): at most {source_connections} connections at once,
    # more are closed as they arrive.  Per client, at most {source_requests} requests in any 10 s, more are
    # answered 429 (and keep counting) without reaching a node: a client is its tenant when the token
    # file names the request's, else its address, so that tenants behind one address (a NAT) do not
    # use up each other's requests.  So no one source can hold the cohort's connections or fill its
    # queue.  deny, not return: HAProxy's exporter counts these 429s apart
    # (haproxy_frontend_requests_denied_total, the KCoralProxyRateLimited alert).
    stick-table type ipv6 size 100k expire 60s store conn_cur
    tcp-request connection track-sc0 src
    tcp-request connection reject if {{ sc_conn_cur(0) gt {source_connections} }}
{request_id}{tenant_names}{rate_key}    http-request set-var(txn.rate_key) src unless {{ var(txn.rate_key) -m found }}
    http-request track-sc2 var(txn.rate_key) table kcoral_rates
    http-request deny deny_status 429 content-type application/json lf-string '{{"status":"ERROR",\
"request_id":"%[unique-id]","error":{{"kind":"busy","message":"more than {source_requests} requests in 10 s from this \
client"}}}}' hdr Retry-After 10 if {{ sc_http_req_rate(2) gt {source_requests} }}
{token_check}{tenant_order}    # When HAProxy had the request's headers, in microseconds since the epoch: the time
    # from then to a node's reading it is the wait in HAProxy (its queue, retries).  set-header
    # replaces any value a client sent.
    http-request set-header X-Request-Start t=%[date(0,us)]{proxy_secret}
{local_edits}{routing}
backend kcoral_spread
    # Least connections; maxconn = the node's worker slots, the rest wait in HAProxy's queue.
    balance leastconn
{servers}
backend kcoral_affinity
    # Consistent hashing on the blob key with bounded load: a node takes at most 150% of the
    # average load, so one hot blob cannot pile its requests onto one node.  Each node is also
    # in kcoral_spread with its own maxconn: under mixed traffic a node can be sent up to twice
    # its slots, the excess waiting in the node's own FIFO queue (it is never refused).
    balance hdr({header})
    hash-type consistent
    hash-balance-factor 150
{servers}
backend kcoral_rates
    # requests in the last 10 s per client (frontend kcoral): its tenant's name, or its address
    stick-table type string len 64 size 100k expire 60s store http_req_rate(10s)
{tenant_table}{tenant_limits}{stats}"""
HAPROXY_ROUTING = """\
    # Requests carrying blobs (the client sends {header}) go where their largest blob is cached.
    use_backend kcoral_affinity if {{ req.hdr({header}) -m found }}
    default_backend kcoral_spread
"""


@dataclasses.dataclass(frozen=True)
class CohortNode:
    url: str
    address: str  # host:port
    slots: int | None  # None: read from the node's /health


def parse_node(text: str) -> CohortNode:
    """NODE_URL[=SLOTS] -> CohortNode (http:// URLs with a host and port, no path)."""
    url, _, slots = text.rpartition("=") if re.fullmatch(r".*=\d+", text) else (text, "", "")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/") \
            or parts.query or parts.fragment:
        raise ValueError(f"node {text!r}: expected http://HOST:PORT[=SLOTS]")
    if slots and int(slots) < 1:
        raise ValueError(f"node {text!r}: SLOTS must be at least 1")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return CohortNode(url.rstrip("/"), f"{host}:{port}", int(slots) if slots else None)


class NodeUnreachable(ValueError):
    """A node's /health did not answer at all (as opposed to answering something unusable)."""


def node_capacity(node: CohortNode, token: str | None, timeout: float = 10.0) -> int:
    """The node's /health load.request_capacity, read now."""
    request = urllib.request.Request(node.url + "/health",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            capacity = json.loads(response.read())["load"]["request_capacity"]
    except urllib.request.HTTPError as exc:
        # Never suggest URL=SLOTS here: without the token the health checks would be refused,
        # every node marked DOWN, and every client answered an instant 503.
        if exc.code == 401:
            raise ValueError(f"{node.url} requires a bearer token{' (not the one given)' if token else ''}: give "
                             "the nodes' token with --token-file, --token or KCORAL_TOKEN; HAProxy's health "
                             "checks must carry it") from None
        raise ValueError(f"{node.url}/health answered {exc.code}: not a KCoral node?") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{node.url}/health is not a KCoral node's health") from None
    except OSError as exc:
        raise NodeUnreachable(f"cannot read {node.url}/health ({getattr(exc, 'reason', exc)})") from None
    if not is_integer(capacity) or capacity < 1:
        raise ValueError(f"{node.url} reports request_capacity {capacity!r} (shutting down?); "
                         f"give its slots as {node.url}=SLOTS")
    return capacity


def with_slots(nodes: list[CohortNode], token: str | None) -> list[CohortNode]:
    """Each node with its slots, read from its /health where not given."""
    found, unreachable = {}, []
    for node in nodes:
        try:
            found[node.url] = node.slots or node_capacity(node, token)
        except NodeUnreachable as exc:
            unreachable.append(str(exc))
    with_token = "" if token else " (with the nodes' token, if they use one)"
    if len(unreachable) == len(nodes):  # more likely a network or firewall problem than a node's
        raise ValueError(f"no node answered: {'; '.join(unreachable)}; check that the nodes run and that this "
                         f"host reaches them, or give every node's slots as NODE_URL=SLOTS{with_token}")
    if unreachable:
        raise ValueError(f"{unreachable[0]}; start the node, or give its slots as NODE_URL=SLOTS{with_token}")
    return [dataclasses.replace(n, slots=found[n.url]) for n in nodes]


def server_id(address: str) -> int:
    """A stable HAProxy server id from the node's address: consistent hashing places servers
    on its ring by id, so a node keeps its blobs' keys when others are added or removed."""
    return 1 + int(hashlib.sha256(address.encode()).hexdigest()[:7], 16)


def haproxy_time(seconds: float) -> str:
    """HAProxy takes whole numbers with a unit."""
    return f"{seconds:.0f}s" if seconds == int(seconds) else f"{round(seconds * 1000)}ms"


HAPROXY_TOKEN_CHECK = """\
    # The token, checked here as the nodes check it (the first Authorization header): a request
    # without it never reaches a node, nor waits in the queue.  During a token rotation two are
    # accepted (docs/operations.md); the health checks send the first.
    http-request return status 401 content-type application/json lf-string '{{"status":"ERROR",\
"request_id":"%[unique-id]","error":{{"kind":"unauthorized","message":"missing or invalid bearer token"}}}}' \
hdr WWW-Authenticate Bearer unless {{ req.fhdr(authorization,1) -m str {accepted} }}
"""
# docs/operations.md, "Trace a failed request".  {{-m reg}} is HAProxy's, the rest str.format's.
HAPROXY_REQUEST_ID = """\
    # One id per request, end to end: the client's X-KCoral-Client-Request-ID when it sent exactly
    # one canonical UUID (the same for every attempt of one execute()), else a new one.  HAProxy
    # logs it beside the node it chose, passes it on in that header (the node logs it as
    # client_request_id) and puts it on every answer, its own errors included.  The line names the
    # request's tenant (from the token file's names; "-" without one).
    http-request set-var(txn.request_id) req.hdr({header}) if {{ req.hdr_cnt({header}) eq 1 }} \
{{ req.hdr({header}) -m reg ^[0-9a-f]{{8}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{12}}$ }}
    http-request set-var(txn.request_id) uuid unless {{ var(txn.request_id) -m found }}
    http-request del-header {header}
    unique-id-format %[var(txn.request_id)]
    unique-id-header {header}
    http-after-response set-header {header} %[unique-id]
    log-format "%ci:%cp [%tr] %ft %b/%s %TR/%Tw/%Tc/%Tr/%Ta %ST %B %CC %CS %tsc %ac/%fc/%bc/%sc/%rc %sq/%bq \
%hr %hs %{{+Q}}r tenant=%[var(txn.tenant)] request_id=%ID"
"""
HAPROXY_STATS = """
frontend kcoral_stats
    # Read only: the stats page at / and HAProxy's own Prometheus exporter at /metrics (each
    # node's state, sessions, queue and response times).  Bind it to a private address.
    bind {stats_listen}
    http-request set-log-level silent   # scrapes and page views: not requests to log
    http-request use-service prometheus-exporter if {{ path /metrics }}
    stats enable
    stats uri /
    stats refresh 10s
"""
HAPROXY_PROXY_SECRET = """
    # The nodes believe X-Request-Start (and the health check's header) only beside this secret
    # (their --proxy-secret-file, this file's): a client sending straight to a node cannot forge its
    # queue time.  set-header replaces any value a client sent.
    http-request set-header {header} {secret}"""
HAPROXY_TENANT_RATE_KEY = """\
    http-request set-var(txn.rate_key) var(txn.tenant) unless { var(txn.tenant) -m str -- - }
"""  # a value of HAPROXY_TEMPLATE's, not formatted: single braces
HAPROXY_TENANT_NAMES = """\
    # The request's tenant, by its token (the log line names it); bare tokens share the tenant "-".
{names}    http-request set-var(txn.tenant) str(-) unless {{ var(txn.tenant) -m found }}
"""
HAPROXY_TENANT_ORDER = """\
    # Fair order across tenants (docs/scaling.md): a request's priority class is the number of its
    # tenant's requests in flight here, itself included, so the queue takes every tenant's k-th
    # request before anyone's (k+1)-th.
    http-request track-sc1 var(txn.tenant) table kcoral_tenants
    http-request set-priority-class sc1_trackers
"""
HAPROXY_TENANT_TABLE = """
backend kcoral_tenants
    # requests in flight per tenant (its trackers), for the priority class set in frontend kcoral
    stick-table type string len 64 size 10k expire 1h
"""
# Per-tenant limits across the cohort (docs/scaling.md "Per-tenant limits"): the nodes' rule, held by the
# proxy for the whole cohort.  Only with --max-running-per-tenant; the nodes then run without their own.
HAPROXY_TENANT_GATE = """\
    # Per-tenant limits across the cohort: each tenant's requests pass a gate of its own (backend
    # kcoral_tenant_limits), which lets at most {running} of them into the cohort at once; the
    # rest wait at the gate, leaving the nodes' slots to the other tenants.
{waiting}    default_backend kcoral_tenant_limits
"""
HAPROXY_TENANT_WAITING = """\
    # A tenant with {waiting} requests waiting at its gate already: 429 busy, nothing ran.
    http-request set-var(txn.gate) str(kcoral_tenant_limits/),concat(,txn.tenant,)
    http-request deny deny_status 429 content-type application/json lf-string '{{"status":"ERROR",\
"request_id":"%[unique-id]","error":{{"kind":"busy","message":"tenant %[var(txn.tenant)] has {waiting} requests \
waiting already, the most it may (--max-waiting-per-tenant); retry once one has started"}}}}' hdr Retry-After 1 \
if {{ var(txn.gate),srv_queue ge {waiting} }}
"""
HAPROXY_TENANT_LIMITS = """
backend kcoral_tenant_limits
    # One gate per tenant (bare tokens share "-"): maxconn {running} is how many of its requests may
    # be in the cohort at once, at a node or in the cohort's queue; its others wait here, first
    # come, first served, up to --queue-timeout (then 503 busy).  Past its gate a request goes
    # through the local socket to frontend kcoral_cohort, which spreads it over the nodes.  The
    # server timeout covers the cohort's queue and the execution; a 503 from there is the cohort's
    # own answer, its retries done, so only a failed connection to the socket is retried, at the
    # same gate (another would be another tenant's).
    timeout server {gate_timeout}
    retry-on conn-failure
    no option redispatch
{use_servers}{servers}
frontend kcoral_cohort
    # Requests past their tenant's gate: only the gates reach this socket (mode 600).  The PROXY
    # protocol keeps the client's address for the log.  Each request has a log line here (its node)
    # and one in frontend kcoral (its gate: kcoral_tenant_limits/TENANT, and its wait there).
    bind unix@{socket} mode 600{owner} accept-proxy
"""  # then the request id, tenant and fair-order rules and the routing of frontend kcoral without gates
# The keywords that open a section: an --include file's lines all belong to frontend kcoral.
HAPROXY_SECTIONS = frozenset({"global", "defaults", "frontend", "backend", "listen", "resolvers", "peers",
                              "userlist", "mailers", "program", "http-errors", "ring", "cache"})


@dataclasses.dataclass(frozen=True)
class ProxyLimits:
    """What the proxy allows one client: header time, connections and request rate per address."""
    header_timeout: float = ServerConfig.header_timeout_seconds
    source_connections: int = 256
    source_requests: int = 1000  # per 10 s
    # the nodes' per-tenant limits, held cohort-wide (0: none)
    max_running_per_tenant: int = ServerConfig.max_running_per_tenant
    max_waiting_per_tenant: int = ServerConfig.max_waiting_per_tenant


@dataclasses.dataclass(frozen=True)
class ProxyRuntime:
    """How HAProxy runs: its user, pidfile and admin socket (Debian's paths), TLS, the stats listener
    and the local edits (already formatted by `local_edits`)."""
    pidfile: str = "/run/haproxy.pid"
    stats_socket: str = "/run/haproxy/admin.sock"
    user: str | None = None
    group: str | None = None
    tls_cert: str | None = None
    stats_listen: str | None = None
    local_edits: str = ""


def haproxy_config(listen: str, nodes: list[CohortNode], tokens: list[str], queue_timeout: float,
                   server_timeout: float, limits: ProxyLimits = ProxyLimits(),
                   runtime: ProxyRuntime = ProxyRuntime(), tenants: Mapping[str, str] | None = None,
                   proxy_secret: str | None = None) -> str:
    """The commented haproxy.cfg text for a cohort whose slots are all known; `tenants` ({token: name})
    orders its queue fairly across named tenants; `proxy_secret` is sent to the nodes on every request."""
    if len({n.address for n in nodes}) != len(nodes):
        raise ValueError("a node is listed twice")
    if len({server_id(n.address) for n in nodes}) != len(nodes):
        raise ValueError("two node addresses hash to the same HAProxy server id; change a port")
    accepted = " ".join(f'"Bearer {t}"' for t in tokens)
    servers = "".join(f"    server {n.address} {n.address} id {server_id(n.address)} maxconn {n.slots}\n"
                      for n in nodes)
    node_list = "\n".join(f"#   {n.url}  {n.slots} slot{'s' if n.slots != 1 else ''}" for n in nodes)
    user_group = "".join(f"    {key} {value}\n" for key, value in (("user", runtime.user), ("group", runtime.group))
                         if value)
    if user_group:
        user_group = "    # HAProxy starts as root (ports, certificate, this file), then runs as:\n" + user_group
    routing, tenant_limits = HAPROXY_ROUTING.format(header=AFFINITY_HEADER), ""
    request_id = HAPROXY_REQUEST_ID.format(header=CLIENT_REQUEST_ID_HEADER)
    order = tenant_order(tenants or {}, limits.max_running_per_tenant > 0)
    if limits.max_running_per_tenant:  # frontend kcoral sends to the gates, a frontend behind them to the nodes
        cohort_rules = request_id + order["tenant_names"] + order["tenant_order"] + routing
        routing, tenant_limits = gate_sections(limits, runtime, list((tenants or {}).values()),
                                               queue_timeout + server_timeout)
        tenant_limits += cohort_rules
        order["tenant_order"] = ""  # the fair order is the cohort's queue's, behind the gates
    return HAPROXY_TEMPLATE.format(
        version=__version__, total=sum(typing.cast(int, n.slots) for n in nodes), node_list=node_list, listen=listen,
        servers=servers, header=AFFINITY_HEADER, queue_timeout=haproxy_time(queue_timeout),
        server_timeout=haproxy_time(server_timeout), header_timeout=haproxy_time(limits.header_timeout),
        keepalive_timeout=haproxy_time(ServerConfig.keepalive_timeout_seconds),
        source_connections=limits.source_connections, source_requests=limits.source_requests,
        request_id=request_id, routing=routing,
        tenant_limits=tenant_limits,
        token_check=HAPROXY_TOKEN_CHECK.format(accepted=accepted) if tokens else "",
        rate_key=HAPROXY_TENANT_RATE_KEY if tenants else "",
        check_auth=f' hdr Authorization "Bearer {tokens[0]}"' if tokens else "", check_header=BALANCER_CHECK_HEADER,
        proxy_secret=HAPROXY_PROXY_SECRET.format(header=PROXY_HEADER, secret=proxy_secret) if proxy_secret else "",
        check_secret=f" hdr {PROXY_HEADER} {proxy_secret}" if proxy_secret else "",
        user_group=user_group, pidfile=runtime.pidfile, stats_socket=runtime.stats_socket,
        tls=f" ssl crt {runtime.tls_cert}" if runtime.tls_cert else "", local_edits=runtime.local_edits,
        stats=HAPROXY_STATS.format(stats_listen=runtime.stats_listen) if runtime.stats_listen else "",
        **order)


def tenant_order(tenants: Mapping[str, str], limited: bool = False) -> dict[str, str]:
    """The frontend's tenant rules and their table, for a cohort with named tenants ({token: name});
    none without, so a cohort of bare tokens keeps its plain first-come queue (`limited`: its one
    tenant "-" is still named, for its gate)."""
    names = "".join(f'    http-request set-var(txn.tenant) str({name}) if {{ req.fhdr(authorization,1) -m str '
                    f'"Bearer {token}" }}\n' for token, name in tenants.items())
    return {"tenant_names": HAPROXY_TENANT_NAMES.format(names=names) if tenants or limited else "",
            "tenant_order": HAPROXY_TENANT_ORDER if tenants else "",
            "tenant_table": HAPROXY_TENANT_TABLE if tenants else ""}


def gate_sections(limits: ProxyLimits, runtime: ProxyRuntime, names: list[str], gate_timeout: float) -> tuple[str, str]:
    """Frontend kcoral's routing through the tenants' gates, and the gates' backend with the frontend
    behind them (whose own rules the caller appends): a gate per named tenant and one for "-"."""
    socket_path = runtime.stats_socket + ".tenants"  # beside the admin socket, in a directory of HAProxy's own
    gates = sorted({name for name in names if name} | {"-"})
    waiting = limits.max_waiting_per_tenant
    front = HAPROXY_TENANT_GATE.format(running=limits.max_running_per_tenant,
                                       waiting=HAPROXY_TENANT_WAITING.format(waiting=waiting) if waiting else "")
    use_servers = "".join(f"    use-server {gate} if {{ var(txn.tenant) -m str -- {gate} }}\n" for gate in gates)
    servers = "".join(f"    server {gate} unix@{socket_path} maxconn {limits.max_running_per_tenant} send-proxy-v2 "
                      "no-check\n" for gate in gates)
    owner = f" user {runtime.user}" if runtime.user else ""
    backend = HAPROXY_TENANT_LIMITS.format(running=limits.max_running_per_tenant, use_servers=use_servers,
                                           gate_timeout=haproxy_time(gate_timeout), servers=servers,
                                           socket=socket_path, owner=owner)
    return front, backend


def local_edits(paths: list[str]) -> str:
    """The lines of each --include file, between markers, for frontend kcoral.  They are read at
    every generation, so edits kept in those files survive it."""
    blocks = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f.read().splitlines()]
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--include {path}: {getattr(exc, 'strerror', None) or exc}") from None
        for number, line in enumerate(lines, 1):
            if line.split(maxsplit=1)[:1] and line.split()[0] in HAPROXY_SECTIONS:
                raise ValueError(f"--include {path}, line {number}: {line.split()[0]!r} starts a section, but "
                                 "--include lines belong to frontend kcoral; give HAProxy sections of your own "
                                 "in a second file of their own (haproxy -f THIS -f THAT)")
        body = "".join(f"    {line}\n" if line else "\n" for line in lines)
        blocks.append(f"    # --- from {path} (--include): edit that file and regenerate, not these lines\n"
                      f"{body}    # --- end of {path}\n")
    return "".join(blocks)


def haproxy_word(value: str, flag: str) -> str:
    """A path or name written into haproxy.cfg as one word (HAProxy splits on spaces, # begins a comment)."""
    if not value or re.search(r"[\s#\\'\"]", value):
        raise ValueError(f"{flag} {value!r}: must be non-empty, without spaces, quotes, backslashes or #")
    return value


def proxy_tokens(args: argparse.Namespace) -> dict[str, str]:
    """--token (several separated by commas or white space) then --token-file's, each with its tenant's
    name: the proxy accepts each, and its health checks (and reading /health here) send the first."""
    return configured_tenants(args.token or None, args.token_file)


def write_private(path: str, text: str) -> None:
    """Write the configuration (it holds the token) as mode 0600, replacing the file in one step:
    a reload never reads half of it, and an older file's wider mode does not carry over."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                     prefix=f".{os.path.basename(path)}.")  # hidden: `haproxy -f DIR` skips it
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def haproxy_config_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kcoral haproxy-config", allow_abbrev=False,
                                description="Print an haproxy.cfg that spreads requests over a cohort of "
                                            "KCoral nodes: queueing, health checks, drain and failover, "
                                            "blob affinity.")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="address HAProxy binds")
    p.add_argument("nodes", nargs="+", metavar="NODE_URL[=SLOTS]",
                   help="a node, e.g. http://10.0.0.5:8000; SLOTS defaults to its /health request_capacity")
    p.add_argument("--token", default=os.environ.get("KCORAL_TOKEN"),
                   help="the nodes' bearer token (several, separated by commas, during a rotation): HAProxy "
                        "refuses requests without one (401) and sends the first with its health checks; also "
                        "for reading /health here [env KCORAL_TOKEN]")
    p.add_argument("--token-file", help="file of bearer tokens, one a line, as the nodes' --token-file "
                                        "(with --token, both sets are accepted); tenant names there "
                                        "(NAME TOKEN) order the queue fairly across tenants")
    p.add_argument("--proxy-secret-file", metavar="FILE",
                   help="file holding one secret (mode 0600), the nodes' own --proxy-secret-file: HAProxy sends it "
                        "on every request, so the nodes believe the X-Request-Start it sets")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write the configuration to FILE, mode 0600, replacing it in one step (default: stdout)")
    p.add_argument("--tls-cert", metavar="PEM", help="terminate TLS with this certificate (followed by its "
                                                     "private key) on the --listen address")
    p.add_argument("--user", help="run HAProxy as this user once started (global `user`)")
    p.add_argument("--group", help="run HAProxy as this group once started (global `group`)")
    p.add_argument("--pidfile", default=ProxyRuntime.pidfile,
                   help="where HAProxy writes its (master's) pid (default: %(default)s)")
    p.add_argument("--stats-socket", default=ProxyRuntime.stats_socket, metavar="PATH",
                   help="HAProxy's admin socket, mode 0600 (default: %(default)s)")
    p.add_argument("--stats-listen", metavar="HOST:PORT",
                   help="serve HAProxy's stats page at / and its Prometheus metrics at /metrics here (default: "
                        "none); bind it to a private address")
    p.add_argument("--include", action="append", default=[], metavar="FILE",
                   help="lines copied into frontend kcoral at every generation: local edits that survive it "
                        "(repeatable)")
    p.add_argument("--queue-timeout", type=float, default=ServerConfig.worker_wait_timeout_seconds,
                   help="seconds a request may wait in HAProxy's queue before 503 busy (default: %(default)s, "
                        "the nodes' default worker wait)")
    p.add_argument("--server-timeout", type=float, default=ServerConfig.max_timeout_seconds + 60,
                   help="seconds HAProxy waits for a node's answer (default: %(default)s, the nodes' default "
                        "maximum execution timeout plus a minute)")
    p.add_argument("--header-timeout", type=float, default=ProxyLimits.header_timeout,
                   help="seconds a client has to send a request's line and headers (default: %(default)s, "
                        "the nodes' default)")
    p.add_argument("--max-connections-per-source", type=int, default=ProxyLimits.source_connections,
                   help="connections one client address may hold open at once; more are closed on "
                        "arrival (default: %(default)s)")
    p.add_argument("--max-requests-per-source", type=int, default=ProxyLimits.source_requests,
                   help="requests one client address may send in any 10 s; more are answered 429 "
                        "(default: %(default)s)")
    for name in ("max_running_per_tenant", "max_waiting_per_tenant"):  # the nodes' rule, for the whole cohort
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(ProxyLimits, name),
                       help=f"the nodes' flag of this name, held by the proxy for the whole cohort: "
                            f"{ServerConfig.__dataclass_fields__[name].metadata['help'].replace(' on this node', '')}; "
                            "start the nodes without it (docs/scaling.md)")
    return p


LISTEN_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[\w.-]*):\d+")


def proxy_runtime(args: argparse.Namespace) -> ProxyRuntime:
    """The checked process, TLS, stats and --include settings."""
    if args.stats_listen is not None and not LISTEN_ADDRESS.fullmatch(args.stats_listen):
        raise ValueError(f"--stats-listen {args.stats_listen!r}: expected HOST:PORT")
    if args.stats_listen == args.listen:
        raise ValueError("--stats-listen must differ from --listen")
    for name, flag in ((args.user, "--user"), (args.group, "--group")):
        if name is not None and not re.fullmatch(r"[A-Za-z_][\w.-]*\$?", name):
            raise ValueError(f"{flag} {name!r}: expected a user or group name")
    tls_cert = haproxy_word(args.tls_cert, "--tls-cert") if args.tls_cert is not None else None
    return ProxyRuntime(pidfile=haproxy_word(args.pidfile, "--pidfile"),
                        stats_socket=haproxy_word(args.stats_socket, "--stats-socket"), user=args.user,
                        group=args.group, tls_cert=tls_cert, stats_listen=args.stats_listen,
                        local_edits=local_edits([haproxy_word(path, "--include") for path in args.include]))


def haproxy_config_main(argv: list[str]) -> None:
    p = haproxy_config_parser()
    args = p.parse_args(argv)
    if not LISTEN_ADDRESS.fullmatch(args.listen):
        p.error(f"--listen {args.listen!r}: expected HOST:PORT")
    if not all(0 < t < math.inf for t in (args.queue_timeout, args.server_timeout, args.header_timeout)):
        p.error("--queue-timeout, --server-timeout and --header-timeout must be positive numbers of seconds")
    if args.max_connections_per_source < 1 or args.max_requests_per_source < 1:
        p.error("--max-connections-per-source and --max-requests-per-source must be at least 1")
    if min(args.max_running_per_tenant, args.max_waiting_per_tenant) < 0:
        p.error("the per-tenant limits must be >= 0")
    if args.max_waiting_per_tenant and not args.max_running_per_tenant:
        p.error("--max-waiting-per-tenant counts the requests waiting at their tenant's gate, which "
                "--max-running-per-tenant sets: give both")
    try:
        tenants = proxy_tokens(args)
        tokens = list(tenants)
        runtime = proxy_runtime(args)
        nodes = with_slots([parse_node(text) for text in args.nodes], tokens[0] if tokens else None)
        limits = ProxyLimits(args.header_timeout, args.max_connections_per_source, args.max_requests_per_source,
                             args.max_running_per_tenant, args.max_waiting_per_tenant)
        secret = read_proxy_secret(args.proxy_secret_file) if args.proxy_secret_file else None
        text = haproxy_config(args.listen, nodes, tokens, args.queue_timeout, args.server_timeout, limits, runtime,
                              {token: name for token, name in tenants.items() if name}, secret)
    except ValueError as exc:
        p.error(str(exc))
    if not tokens:
        print("kcoral haproxy-config: warning: no token (--token-file, --token or KCORAL_TOKEN): the proxy lets "
              "any client send programs to the nodes, and its health checks carry none, so nodes started with "
              "a token answer them 401 and are all marked DOWN; start the nodes with a token and give it here",
              file=sys.stderr)
    if args.output:
        write_private(args.output, text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    # multiprocessing re-runs a `-m` main module in every worker it starts (compiling it
    # afresh when no .pyc is written): tens of ms per request.  Workers need nothing from it.
    sys.modules["__main__"] = types.ModuleType("__main__")
    main()
