"""KCoral reference client: build programs, run them on a KCoral server, decode the results.

One self-contained file that can be vendored: it imports only the standard library and
NumPy at import time (``ml_dtypes`` when a bfloat16/float8 tensor is decoded; torch only
when the caller already uses it). The contract is docs/client.md; the wire format is
docs/protocol.md ("docs/protocol.md §n" below).

    from client import Client, Program

    program = Program()
    module = program.upload(kind="module", source="def add(a, b):\\n    return a + b\\n")
    add = program.get_function(module=module, name="add")
    program.return_(key="sum", value=program.run(fn=add, args=[1, 2]))
    with Client("http://127.0.0.1:8000") as client:
        print(client.execute(program)["sum"])
"""

from __future__ import annotations

import ast
import builtins
import codecs
import collections
import dataclasses
import errno
import functools
import hashlib
import http.client
import inspect
import io
import json
import math
import os
import pathlib
import re
import secrets
import select
import signal
import stat
import symtable
import sys
import textwrap
import threading
import time
import types
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Generic, ParamSpec, TypeGuard, TypeVar

import numpy as np

__all__ = [
    "Client", "KCoralError", "Program", "ProgramResult", "ProtocolError", "Register",
    "RemoteExecutionError", "RemoteFunction", "ReturnedFile", "ReturnedFolder",
    "TransportError", "ValidationError",
]


# ---------------------------------------------------------------------------
# Exceptions (docs/client.md §8)


class KCoralError(Exception):
    """The server answered with an HTTP status other than 200.

    A 504 from our server also says where the program was and what it had printed
    (docs/client.md §8): ``instruction_index``/``_op``/``_id`` (None when unknown) and
    ``stdout``/``stderr`` with their ``*_truncated`` flags ("" and False when not sent)."""

    def __init__(self, status_code: int, message: str, *, kind: str | None = None,
                 request_id: str | None = None, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.kind = kind
        self.request_id = request_id
        self.client_request_id: str | None = None  # set by Client.execute (docs/client.md §8)
        details = details or {}
        self.instruction_index: int | None = details.get("instruction_index")
        self.instruction_op: str | None = details.get("instruction_op")
        self.instruction_id: str | None = details.get("instruction_id")
        self.stdout: str = details.get("stdout", "")
        self.stderr: str = details.get("stderr", "")
        self.stdout_truncated: bool = details.get("stdout_truncated", False)
        self.stderr_truncated: bool = details.get("stderr_truncated", False)
        self.stdout_tail: str = details.get("stdout_tail", "")  # output cut at the limit: as ProgramResult's
        self.stderr_tail: str = details.get("stderr_tail", "")
        self.truncation: str = details.get("truncation", "")


class TransportError(Exception):
    """No HTTP response could be obtained; an execute may or may not have run."""

    client_request_id: str | None = None  # set by Client.execute (docs/client.md §8)


class ProtocolError(Exception):
    """The server's response violates the protocol."""

    client_request_id: str | None = None  # set by Client.execute (docs/client.md §8)


class ValidationError(ValueError):
    """A path or program is invalid (raised while building a Program)."""


class RemoteExecutionError(RuntimeError):
    """RemoteFunction.remote got a FAILED result; the whole result is in ``.result``."""

    def __init__(self, result: ProgramResult) -> None:
        error = result.error or {}
        super().__init__(f"Remote execution {result.request_id} failed: {error.get('kind') or 'unknown'}: "
                         f"{error.get('message') or 'no error details'}")
        self.result = result


# ---------------------------------------------------------------------------
# Protocol tables and shared rules

# docs/protocol.md §6.3: the only tensor dtypes, with their item sizes.
_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "float16": 2, "bfloat16": 2, "int32": 4, "float32": 4,
    "int64": 8, "float64": 8,
}
_NUMPY_DTYPES = {  # bool is decoded via uint8 (see _PartReader._tensor)
    "uint8": "u1", "int8": "i1", "int16": "<i2", "int32": "<i4",
    "int64": "<i8", "float16": "<f2", "float32": "<f4", "float64": "<f8",
}
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_RETURN_PART = re.compile(r"return:(0|[1-9][0-9]*)")
_ERROR_KINDS = frozenset({"parse", "compile", "runtime", "gpu_access", "correctness",
                          "serialization", "unavailable", "engine"})
_ERROR_KEYS = frozenset({"kind", "message", "instruction_index", "instruction_op", "instruction_id", "traceback"})
_GPU_ACCESS_KEYS = _ERROR_KEYS | {"cuda_call", "location", "interfered_request_id"}
_TIMINGS = ("queue_ms", "elapsed_ms", "lease_wait_ms", "lease_held_ms")


def _normalize_path(path: object) -> str:
    """Canonical form of a workspace path (docs/protocol.md §6.7), or ValidationError."""
    if not isinstance(path, str) or not path:
        raise ValidationError("path must be a non-empty string")
    if "\0" in path:
        raise ValidationError(f"path {path!r} contains NUL")
    if "\\" in path:
        raise ValidationError(f"path {path!r} contains a backslash")
    if path.startswith("/"):
        raise ValidationError(f"path {path!r} must be relative")
    components = path.split("/")
    if ".." in components:  # checked on the raw components: 'a/../b' is rejected, not simplified
        raise ValidationError(f"path {path!r} contains '..'")
    components = [c for c in components if c not in ("", ".")]
    if not components:
        raise ValidationError(f"path {path!r} names nothing")
    try:
        if any(len(c.encode("utf-8")) > 255 for c in components):
            raise ValidationError(f"path {path!r} has a component longer than 255 bytes")
        normalized = "/".join(components)
        if len(normalized.encode("utf-8")) > 4096:
            raise ValidationError(f"path {path!r} is longer than 4096 bytes")
    except UnicodeEncodeError:
        raise ValidationError(f"path {path!r} is not valid Unicode") from None
    return normalized


def _strict_json(data: bytes | bytearray | memoryview) -> Any:
    """Decode JSON the way the protocol demands (docs/protocol.md §5.1): UTF-8, no BOM, no duplicate
    keys, no NaN/Infinity, no trailing data. Raises ValueError."""
    if bytes(data[:3]) == b"\xef\xbb\xbf":
        raise ValueError("JSON starts with a byte order mark")
    try:
        return json.loads(str(data, "utf-8"), object_pairs_hook=_object_without_duplicates,
                          parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON is nested too deeply") from None


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate key in JSON object")
    return result


def _reject_constant(name: str) -> None:
    raise ValueError(f"JSON constant {name} is not allowed")


def _bytes_snapshot(value: object, error_message: str) -> bytes:
    """The bytes of a bytes-like value, copied so later mutation cannot change them."""
    if type(value) is bytes:  # immutable: sharing it is as good as a copy, and free
        return value
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(error_message) from None
    return view.tobytes()


# ---------------------------------------------------------------------------
# Program builder (docs/client.md §2-3)


@dataclasses.dataclass(frozen=True)
class Register:
    """A request-local reference to the value an earlier instruction produced."""

    id: str


class Program:
    """Builder for one self-contained program. Every method validates locally and either
    appends its instruction(s) or raises and leaves the program unchanged."""

    def __init__(self) -> None:
        self._instructions: list[dict[str, Any]] = []
        self._ids: set[str] = set()
        self._counter = 0
        self._return_keys: set[str] = set()
        self._file_paths: set[str] = set()  # normalised file-upload paths
        self._file_dirs: set[str] = set()   # every proper directory prefix of those paths
        self._blobs: dict[str, bytes] = {}  # sha256 -> bytes, in order of first reference

    @property
    def instructions(self) -> list[dict[str, Any]]:
        """A shallow copy of the wire instructions (treat the dicts as read-only)."""
        return list(self._instructions)

    # -- value-producing instructions

    def upload(self, *, id: str | None = None, kind: str, source: str | None = None,
               value: Any = None, dtype: str | None = None, shape: Any = None) -> Register:
        """Upload a module source, a tensor, raw bytes or a TVM FFI library."""
        self._check_custom_id(id)  # first, so a bad id records nothing (docs/client.md §3.1)
        if kind == "module":
            if not isinstance(source, str):
                raise TypeError("module upload requires a str 'source'")
            if value is not None or dtype is not None or shape is not None:
                raise TypeError("module upload takes only 'source'")
            return self._append("upload", id, {"kind": "module", "source": source})
        if kind == "tensor":
            if source is not None:
                raise TypeError("tensor upload takes no 'source'")
            dtype, shape, data = _tensor_payload(value, dtype, shape)
            return self._append_blob(id, "tensor", data, dtype=dtype, shape=shape)
        if kind in ("bytes", "library"):
            if source is not None or dtype is not None or shape is not None:
                raise TypeError(f"{kind} upload takes only 'value'")
            return self._append_blob(id, kind, _bytes_snapshot(value, f"{kind} upload requires a bytes-like 'value'"))
        raise ValueError("upload kind must be 'module', 'tensor', 'bytes', or 'library'")

    def upload_file(self, *, blob: Any, path: str, id: str | None = None) -> Register:
        """Upload bytes that the server writes to ``path`` in the request's workspace."""
        self._check_custom_id(id)
        path = _normalize_path(path)
        return self._append_files([(path, _bytes_snapshot(blob, "file upload requires a bytes-like 'blob'"))], id)[0]

    def upload_folder(self, folder: str | os.PathLike[str], *, path: str) -> None:
        """Snapshot a local directory tree as file uploads under ``path``, all or nothing."""
        base = _normalize_path(path)
        self._append_files(sorted((_normalize_path(f"{base}/{rel}"), data) for rel, data in _snapshot_folder(folder)))

    def get_function(self, *, id: str | None = None, module: Register | dict[str, str],
                     name: str, cpu_only: bool = False) -> Register:
        """Select ``name`` from an uploaded module (or library)."""
        module_id = self._existing_ref(module)
        if not isinstance(name, str) or not name:
            raise ValueError("get_function requires a non-empty str 'name'")
        if not isinstance(cpu_only, bool):
            raise TypeError("cpu_only must be a bool")
        self._check_custom_id(id)
        fields: dict[str, Any] = {"module": {"$ref": module_id}, "name": name}
        if cpu_only:
            fields["cpu_only"] = True
        return self._append("get_function", id, fields)

    def run(self, *, id: str | None = None, fn: Register, args: list[Any] | None = None) -> Register:
        """Call ``fn`` with ``args``; top-level Registers become references, the rest are
        JSON literals (not validated until execute serialises them, as in the published package)."""
        if not isinstance(fn, Register):
            raise TypeError("run requires a Register 'fn'")
        fn_id = self._existing_ref(fn)
        if not isinstance(args, (list, tuple, type(None))):
            raise TypeError("run 'args' must be a list")
        for index, arg in enumerate(args or []):
            if not isinstance(arg, Register):
                _refuse_nested_register(arg, f"args[{index}]", set())
        wire_args = [{"$ref": arg.id} if isinstance(arg, Register) else arg for arg in args or []]
        self._check_custom_id(id)
        return self._append("run", id, {"fn": {"$ref": fn_id}, "args": wire_args})

    # -- returns

    def return_(self, *, key: str, value: Register | dict[str, str]) -> None:
        """Return the value of an earlier instruction under ``key``."""
        self._check_return_key(key)
        ref = self._existing_ref(value)
        self._append_return({"op": "return", "key": key, "value": {"$ref": ref}})

    def return_file(self, *, key: str, path: str | Register) -> None:
        """Return the workspace file at ``path`` (as it is when this instruction runs)."""
        self._return_path("file", key, path)

    def return_folder(self, *, key: str, path: str | Register) -> None:
        """Return the workspace folder at ``path`` (as it is when this instruction runs)."""
        self._return_path("folder", key, path)

    # -- internals

    def _return_path(self, kind: str, key: str, path: str | Register) -> None:
        self._check_return_key(key)
        wire_path = {"$ref": self._existing_ref(path)} if isinstance(path, Register) else _normalize_path(path)
        self._append_return({"op": "return", "key": key, "kind": kind, "path": wire_path})

    def _check_custom_id(self, id: str | None) -> None:
        if id is not None and (not isinstance(id, str) or not id):
            raise ValueError("instruction id must be a non-empty str")
        if id in self._ids:
            raise ValueError(f"duplicate instruction id {id!r}")

    def _check_return_key(self, key: str) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError("return key must be a non-empty str")
        if key in self._return_keys:
            raise ValueError(f"duplicate return key {key!r}")

    def _existing_ref(self, ref: Register | dict[str, str]) -> str:
        if isinstance(ref, Register):
            ref_id = ref.id
        elif isinstance(ref, dict) and ref.keys() == {"$ref"} and isinstance(ref["$ref"], str):
            ref_id = ref["$ref"]
        else:
            raise TypeError("expected a Register or {'$ref': id}")
        if ref_id not in self._ids:
            raise ValueError(f"unknown instruction id {ref_id!r}")
        return ref_id

    def _with_file_paths(self, paths: list[str]) -> tuple[set[str], set[str]]:
        """The file-path sets after adding ``paths``, or ValidationError on a conflict
        (docs/protocol.md §6.8). The program's own sets are left untouched."""
        taken, dirs = set(self._file_paths), set(self._file_dirs)
        for path in paths:
            if path in taken:
                raise ValidationError(f"duplicate file upload path {path!r}")
            parts = path.split("/")
            prefixes = ["/".join(parts[:end]) for end in range(1, len(parts))]  # 'a/b/c' -> 'a', 'a/b'
            if path in dirs or any(prefix in taken for prefix in prefixes):
                raise ValidationError(f"conflicting file upload paths at {path!r}")
            taken.add(path)
            dirs.update(prefixes)
        return taken, dirs

    def _append_files(self, files: list[tuple[str, bytes]], id: str | None = None) -> list[Register]:
        """File uploads of (normalised path, bytes), all or nothing: the paths are checked first,
        and nothing can fail after that."""
        file_paths, file_dirs = self._with_file_paths([path for path, _ in files])
        registers = [self._append_blob(id, "file", data, path=path) for path, data in files]
        self._file_paths, self._file_dirs = file_paths, file_dirs
        return registers

    def _append_blob(self, id: str | None, kind: str, data: bytes, **fields: Any) -> Register:
        digest = hashlib.sha256(data).hexdigest()
        return self._append("upload", id, {"kind": kind, "blob": digest, **fields}, blob=(digest, data))

    def _append(self, op: str, id: str | None, fields: dict[str, Any],
                blob: tuple[str, bytes] | None = None) -> Register:
        if id is None:
            n = self._counter
            while f"{op}_{n}" in self._ids:
                n += 1
            self._counter = n + 1
            id = f"{op}_{n}"
        self._ids.add(id)
        self._instructions.append({"op": op, "id": id, **fields})
        if blob is not None:
            self._blobs.setdefault(*blob)
        return Register(id)

    def _append_return(self, instruction: dict[str, Any]) -> None:
        self._return_keys.add(instruction["key"])
        self._instructions.append(instruction)


def _refuse_nested_register(value: Any, where: str, containers: set[int]) -> None:
    """A Register inside a list or dict argument: the protocol resolves references only at the top
    level of `args` (docs/protocol.md §6.2), so it would reach execute() as an unserialisable object."""
    if isinstance(value, Register):
        raise TypeError(f"run {where} is {value!r} inside a list or dict: only a top-level argument can be a "
                        "Register; pass it as one of run's own args (args=[..., register, ...]) and build "
                        "the list or dict inside the function")
    if isinstance(value, (list, tuple, dict)) and id(value) not in containers:
        containers.add(id(value))  # a container that holds itself is json's to refuse, at execute
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            _refuse_nested_register(item, f"{where}[{key!r}]", containers)


def _tensor_payload(value: Any, dtype: Any, shape: Any) -> tuple[str, list[int], bytes]:
    """(wire dtype, shape, little-endian C-order bytes) for a tensor upload (docs/client.md §3.4)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        if dtype is None or shape is None:
            raise TypeError("raw tensor bytes require 'dtype' and 'shape'")
        wire_dtype, wire_shape = dtype, _shape_list(shape)
        data = _bytes_snapshot(value, "")
    else:
        wire_dtype, wire_shape, data = _array_payload(value)
        if dtype is not None and dtype != wire_dtype:
            raise ValueError(f"dtype {dtype!r} does not match the value's dtype {wire_dtype!r}")
        if shape is not None and list(shape) != wire_shape:
            raise ValueError(f"shape {list(shape)!r} does not match the value's shape {wire_shape!r}")
    if not isinstance(wire_dtype, str) or wire_dtype not in _ITEMSIZE:
        raise ValueError(f"unsupported tensor dtype {wire_dtype!r}")
    expected = math.prod(wire_shape) * _ITEMSIZE[wire_dtype]
    if len(data) != expected:
        raise ValueError(f"tensor of shape {wire_shape} and dtype {wire_dtype} needs "
                         f"{expected} bytes, got {len(data)}")
    return wire_dtype, wire_shape, data


def _shape_list(shape: Any) -> list[int]:
    dims = list(shape)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"tensor shape must be a sequence of non-negative ints, got {shape!r}")
    return [int(d) for d in dims]


def _array_payload(value: Any) -> tuple[str, list[int], bytes]:
    torch = sys.modules.get("torch")  # a torch.Tensor can only exist if torch is imported
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        # Viewed as bytes so that dtypes NumPy lacks (bfloat16, float8) convert too.
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return str(tensor.dtype).removeprefix("torch."), list(tensor.shape), data
    if not isinstance(value, np.ndarray) and hasattr(value, "__dlpack__"):
        try:
            value = np.from_dlpack(value)
        except Exception:  # e.g. a device NumPy cannot read: the duck-typed rule may still apply
            pass
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)  # note: makes a 0-d array 1-d, as the published client does
        if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
            array = array.astype(array.dtype.newbyteorder("<"))
        return array.dtype.name, list(array.shape), array.tobytes()
    if all(hasattr(value, name) for name in ("dtype", "shape", "tobytes")):
        return str(value.dtype), [int(d) for d in value.shape], value.tobytes()
    raise TypeError(f"cannot upload {type(value).__name__!r} as a tensor")


def _snapshot_folder(folder: str | os.PathLike[str]) -> list[tuple[str, bytes]]:
    """(relative path, contents) of every regular file under ``folder``, read without following symbolic
    links; each directory is opened relative to its parent so that a path swapped during the walk cannot redirect it."""
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"upload_folder: {os.fspath(folder)!r} is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", os.fspath(folder))
    fd = _open_same(folder, None, st, os.O_DIRECTORY)
    files: list[tuple[str, bytes]] = []
    try:
        _walk_folder(fd, "", {(st.st_dev, st.st_ino)}, files)
    finally:
        os.close(fd)
    return files


def _walk_folder(dir_fd: int, prefix: str, seen: set[tuple[int, int]], files: list[tuple[str, bytes]]) -> None:
    for name in sorted(os.listdir(dir_fd)):
        rel = prefix + name
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            if (st.st_dev, st.st_ino) in seen:
                raise ValueError(f"upload_folder: repeated directory {rel!r}")
            seen.add((st.st_dev, st.st_ino))
            sub_fd = _open_same(name, dir_fd, st, os.O_DIRECTORY)
            try:
                _walk_folder(sub_fd, rel + "/", seen, files)
            finally:
                os.close(sub_fd)
        elif stat.S_ISREG(st.st_mode):
            fd = _open_same(name, dir_fd, st, os.O_NONBLOCK)  # O_NONBLOCK: a swapped-in FIFO must not hang us
            try:
                with open(fd, "rb", closefd=False) as f:
                    data = f.read()
                if not _same_version(st, os.fstat(fd)) or len(data) != st.st_size:
                    raise ValueError(f"upload_folder: {rel!r} changed while being read")
            finally:
                os.close(fd)
            files.append((rel, data))
        else:
            raise ValueError(f"upload_folder: {rel!r} is a symbolic link or special file")


def _open_same(name: str | os.PathLike[str], dir_fd: int | None, expected: os.stat_result, flags: int) -> int:
    """Open ``name`` without following a link, and check it is still what was listed."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | flags, dir_fd=dir_fd)
    if not _same_version(expected, os.fstat(fd)):
        os.close(fd)
        raise ValueError(f"upload_folder: {os.fspath(name)!r} changed while being read")
    return fd


def _same_version(a: os.stat_result, b: os.stat_result) -> bool:
    return ((a.st_dev, a.st_ino, a.st_mode, a.st_size, a.st_mtime_ns, a.st_ctime_ns)
            == (b.st_dev, b.st_ino, b.st_mode, b.st_size, b.st_mtime_ns, b.st_ctime_ns))


# ---------------------------------------------------------------------------
# Returned files and folders (docs/client.md §6)


@dataclasses.dataclass(frozen=True, repr=False)
class ReturnedFile:
    """An in-memory snapshot of a file the program returned."""

    _data: bytes

    def __post_init__(self) -> None:
        if not isinstance(self._data, bytes):
            raise TypeError("ReturnedFile holds bytes")

    def __repr__(self) -> str:
        return f"ReturnedFile(size={len(self._data)})"

    def read_bytes(self) -> bytes:
        return self._data

    def save(self, destination: str | os.PathLike[str], *, overwrite: bool = False) -> pathlib.Path:
        """Write the contents to ``destination`` (mode 0600) atomically. An existing
        destination is an error unless ``overwrite`` is true and it is a regular file."""

        def publish(parent_fd: int, name: str) -> None:
            try:
                st: os.stat_result | None = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and not overwrite:
                raise FileExistsError(errno.EEXIST, "destination exists", os.fspath(destination))
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise ValueError("overwrite requires a regular file destination")
            staged = _write_new_file(parent_fd, f".kcoral-{secrets.token_hex(16)}", self._data)
            try:
                if overwrite:  # rename replaces whatever is there now, a symlink swapped in too, never following it
                    os.rename(staged, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
                else:  # link fails if the name appeared after the check: no silent overwrite
                    os.link(staged, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd, follow_symlinks=False)
            except BaseException:
                os.unlink(staged, dir_fd=parent_fd)
                raise
            if not overwrite:  # linked into place: the staged name goes
                os.unlink(staged, dir_fd=parent_fd)
        return _at_destination(destination, publish)


@dataclasses.dataclass(frozen=True)
class ReturnedFolder:
    """An in-memory snapshot of a folder the program returned. Paths are relative to
    the folder; ``directories`` lists every sub-directory, empty ones included."""

    files: Mapping[str, ReturnedFile]
    directories: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        files, directories = dict(self.files), tuple(self.directories)
        names = list(files) + list(directories)
        for name in names:
            if not isinstance(name, str) or _normalize_path(name) != name:
                raise ValueError(f"folder entry {name!r} is not a canonical path")
        if list(files) != sorted(files) or list(directories) != sorted(directories):
            raise ValueError("folder entries are not in sorted order")
        if len(set(names)) != len(names):
            raise ValueError("folder lists an entry twice")
        listed = set(directories)
        for name in names:
            parent = name.rpartition("/")[0]
            if parent and parent not in listed:
                raise ValueError(f"folder entry {name!r} has an unlisted parent directory")
        if not all(isinstance(f, ReturnedFile) for f in files.values()):
            raise TypeError("folder files must be ReturnedFile values")
        object.__setattr__(self, "files", types.MappingProxyType(files))
        object.__setattr__(self, "directories", directories)

    def save(self, destination: str | os.PathLike[str]) -> pathlib.Path:
        """Create ``destination`` (which must not exist) and write the tree into it.
        On failure the partial tree is removed and the exception re-raised."""

        def write_tree(parent_fd: int, name: str) -> None:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
            try:
                root_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
                try:
                    os.fchmod(root_fd, 0o700)  # the umask may have narrowed it
                    for directory in self.directories:
                        _in_directory(root_fd, directory, _make_directory)
                    for path, file in self.files.items():
                        _in_directory(root_fd, path, functools.partial(_write_new_file, data=file._data))
                finally:
                    os.close(root_fd)
            except BaseException:
                _remove_tree(parent_fd, name)
                raise
        return _at_destination(destination, write_tree)


def _at_destination(destination: str | os.PathLike[str], action: Callable[[int, str], object]) -> pathlib.Path:
    """Run ``action(fd of its parent directory, final name)`` for a local ``destination``;
    -> the destination as a Path."""
    path = os.fspath(destination)
    if not isinstance(path, str):
        raise TypeError("destination must be a str or path-like")
    components = path.split("/")
    if ".." in components or components[-1] in ("", ".", ".."):
        raise ValueError(f"destination {path!r} must name a file without '..' components")
    start_fd = os.open("/" if path.startswith("/") else ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        _in_directory(start_fd, path, action)
    finally:
        os.close(start_fd)
    return pathlib.Path(destination)


def _in_directory(start_fd: int, path: str, action: Callable[[int, str], object]) -> None:
    """Run ``action(dir_fd, name)`` for ``path`` below start_fd, opening each parent without
    following a symbolic link (a tree being written is visible, so it could be tampered with)."""
    *parents, name = path.split("/")
    fd = start_fd
    try:
        for parent in parents:
            if parent in ("", "."):  # 'a//b', './a'
                continue
            try:
                next_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise NotADirectoryError(errno.ENOTDIR, "symbolic link in destination path", path) from None
                raise
            if fd != start_fd:
                os.close(fd)
            fd = next_fd
        action(fd, name)
    finally:
        if fd != start_fd:
            os.close(fd)


def _make_directory(dir_fd: int, name: str) -> None:
    os.mkdir(name, 0o700, dir_fd=dir_fd)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o700)  # the umask may have narrowed it
    finally:
        os.close(fd)


def _write_new_file(dir_fd: int, name: str, data: bytes) -> str:
    """Create ``name`` exclusively with mode 0600 and write ``data``; return the name."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o600)  # the umask may have narrowed it
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
    except BaseException:
        _remove_tree(dir_fd, name)
        raise
    finally:
        os.close(fd)
    return name


def _remove_tree(dir_fd: int, name: str) -> None:
    """Best-effort removal of ``name`` under dir_fd, never following symbolic links."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                for child in os.listdir(fd):
                    _remove_tree(fd, child)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass  # cleanup after a failure: the original exception is what matters


# ---------------------------------------------------------------------------
# Results and response decoding (docs/client.md §5)


@dataclasses.dataclass
class ProgramResult:
    """The decoded answer to a COMPLETED or FAILED execution."""

    status: str
    request_id: str
    queue_ms: float
    elapsed_ms: float
    lease_wait_ms: float
    lease_held_ms: float
    results: dict[str, Any]
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    error: dict[str, Any] | None = None
    gpu_ids: tuple[int, ...] = ()
    # our server's account of output cut at the limit (docs/client.md §5.4): what each stream
    # produced in bytes (None when not cut), its end, and a sentence saying so ("" when nothing was cut)
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    truncation: str = ""
    # set by Client.execute: the id its attempts were sent under (about the call, not the answer: not compared)
    client_request_id: str | None = dataclasses.field(default=None, init=False, compare=False)
    # set by Client.execute: what getting the answer took (docs/client.md §5.6): blob bytes sent, blobs
    # the server already held (never sent), HTTP requests made (CACHE_MISS answers, blobs sent on their
    # own, a /health asked for the size limit, busy answers retried)
    blob_bytes_sent: int = dataclasses.field(default=0, init=False, compare=False)
    blobs_cached: int = dataclasses.field(default=0, init=False, compare=False)
    round_trips: int = dataclasses.field(default=0, init=False, compare=False)

    @property
    def completed(self) -> bool:
        return self.status == "COMPLETED"

    def __getitem__(self, key: str) -> Any:
        return self.results[key]


def _malformed(message: str) -> ProtocolError:
    return ProtocolError(f"malformed execution response: {message}")


def _decode_result(payload: dict[str, Any], parts: dict[str, memoryview]) -> ProgramResult:
    """Validate a COMPLETED/FAILED body strictly (docs/client.md §5.3) and decode its values."""
    status = payload.get("status")
    if status not in ("COMPLETED", "FAILED"):
        raise _malformed(f"unexpected status {status!r}")
    request_id = payload.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise _malformed("request_id must be a non-empty string")
    timings: dict[str, Any] = {name: _finite_number(payload.get(name), name) for name in _TIMINGS}
    for name in ("stdout", "stderr"):
        if not isinstance(payload.get(name), str):
            raise _malformed(f"{name} must be a string")
    for name in ("stdout_truncated", "stderr_truncated"):
        if not isinstance(payload.get(name, False), bool):
            raise _malformed(f"{name} must be a boolean")
    gpu_ids = _gpu_ids(payload)
    results = payload.get("results")
    if not isinstance(results, dict):
        raise _malformed("results must be an object")
    reader = _PartReader(parts)
    try:
        decoded = {key: reader.decode(value) for key, value in results.items()}
    except RecursionError:
        raise _malformed("results are nested too deeply") from None
    if status == "COMPLETED" and "error" in payload:
        raise _malformed("a COMPLETED response must not carry 'error'")
    if status == "FAILED" and "error" not in payload:
        raise _malformed("a FAILED response must carry 'error'")
    error = _validated_error(payload["error"]) if status == "FAILED" else None
    if reader.used != len(parts):
        raise _malformed("unreferenced binary response parts")
    return ProgramResult(
        status=status, request_id=request_id, **timings, results=decoded,
        stdout=payload["stdout"], stderr=payload["stderr"],
        stdout_truncated=payload.get("stdout_truncated", False),
        stderr_truncated=payload.get("stderr_truncated", False),
        error=error, gpu_ids=gpu_ids, **_truncation_details(payload))


def _truncation_details(body: dict[str, Any]) -> dict[str, Any]:
    """The fields our server adds beside a `*_truncated` flag (docs/protocol.md §8.7), those of the
    right type, and the sentence `truncation` made of them; a server that sends none gets none."""
    limit, cap = body.get("output_limit_bytes"), body.get("max_output_limit_bytes")
    details: dict[str, Any] = {}
    notes = []
    for name in ("stdout", "stderr"):
        produced, tail = body.get(f"{name}_bytes"), body.get(f"{name}_tail")
        if type(produced) is int and isinstance(tail, str) and type(limit) is int:
            details.update({f"{name}_bytes": produced, f"{name}_tail": tail})
            notes.append(f"{name} produced {produced} bytes: the first {limit} and the last "
                         f"{len(tail.encode())} are kept")
    if notes:
        allowed = "the server's cap" if limit == cap else f"this server allows up to {cap}"
        details["truncation"] = (f"output cut: {'; '.join(notes)} (output_limit_bytes {limit}, {allowed}; "
                                 "write large output to a file and return_file it)")
    return details


def _finite_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _malformed(f"{what} must be a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _malformed(f"{what} must be finite")
    return number


def _gpu_ids(payload: dict[str, Any]) -> tuple[int, ...]:
    if ("gpu_ids" in payload) != ("gpu_count" in payload):
        raise _malformed("gpu_ids and gpu_count must come together")
    if "gpu_ids" not in payload:
        return ()
    ids, count = payload["gpu_ids"], payload["gpu_count"]
    if (not isinstance(ids, list) or not 0 < len(ids) <= 8
            or any(type(i) is not int or i < 0 for i in ids) or len(set(ids)) != len(ids)):
        raise _malformed("gpu_ids must be 1 to 8 distinct non-negative integers")
    if type(count) is not int or count != len(ids):
        raise _malformed("gpu_count must equal the number of gpu_ids")
    return tuple(ids)


def _validated_error(error: Any) -> dict[str, Any]:
    if not isinstance(error, dict):
        raise _malformed("error must be an object")
    kind = error.get("kind")
    if not isinstance(kind, str) or kind not in _ERROR_KINDS:
        raise _malformed(f"unknown error kind {kind!r}")
    if error.keys() != (_GPU_ACCESS_KEYS if kind == "gpu_access" else _ERROR_KEYS):
        raise _malformed(f"error fields {sorted(error)} are not the protocol's")
    strings = ["message", "traceback"] + (["cuda_call", "location"] if kind == "gpu_access" else [])
    if not all(isinstance(error[name], str) for name in strings):
        raise _malformed(f"error fields {strings} must be strings")
    if type(error["instruction_index"]) is not int:
        raise _malformed("error instruction_index must be an integer")
    if error["instruction_op"] not in ("upload", "get_function", "run", "return"):
        raise _malformed(f"unknown error instruction_op {error['instruction_op']!r}")
    optional = ["instruction_id"] + (["interfered_request_id"] if kind == "gpu_access" else [])
    if not all(error[name] is None or isinstance(error[name], str) for name in optional):
        raise _malformed(f"error fields {optional} must be strings or null")
    return error


# Exact key sets of encoded values (docs/protocol.md §9.5).
_VALUE_KEYS = {
    "null": {"type"}, "boolean": {"type", "value"}, "integer": {"type", "value"},
    "number": {"type", "value"}, "string": {"type", "value"}, "array": {"type", "value"},
    "object": {"type", "value"}, "bytes": {"type", "part", "sha256"},
    "file": {"type", "size", "part", "sha256"}, "folder": {"type", "files", "directories"},
    "tensor": {"type", "dtype", "shape", "part", "sha256"},
}


class _PartReader:
    """Decodes encoded values, handing out the binary parts in depth-first order."""

    def __init__(self, parts: dict[str, memoryview]) -> None:
        self._parts = parts
        self.used = 0

    def decode(self, encoded: Any) -> Any:
        if not isinstance(encoded, dict) or not isinstance(encoded.get("type"), str):
            raise _malformed("an encoded value must be an object with a string 'type'")
        kind = encoded["type"]
        if kind not in _VALUE_KEYS:
            raise _malformed(f"unknown value type {kind!r}")
        if encoded.keys() != _VALUE_KEYS[kind]:
            raise _malformed(f"a {kind} value must have exactly the keys {sorted(_VALUE_KEYS[kind])}")
        value = encoded.get("value")
        if kind == "null":
            return None
        if kind == "number":
            return _finite_number(value, "a number value")
        expected_type = {"boolean": bool, "integer": int, "string": str, "array": list, "object": dict}.get(kind)
        if expected_type is not None:
            if type(value) is not expected_type:  # exact: a bool is not an integer
                raise _malformed(f"a {kind} value has a {type(value).__name__} payload")
            if isinstance(value, list):  # kind "array"
                return [self.decode(item) for item in value]
            if isinstance(value, dict):  # kind "object"
                return {key: self.decode(item) for key, item in value.items()}
            return value
        if kind == "bytes":
            return self._take(encoded, bytes)
        return {"file": self._file, "folder": self._folder, "tensor": self._tensor}[kind](encoded)

    def _take(self, encoded: dict[str, Any], copy: Callable[[memoryview], T]) -> T:
        """The part `encoded` names, checked against its sha256 and turned into its own object
        by `copy` (the body buffer it is a view of must not stay alive)."""
        name, digest = encoded["part"], encoded["sha256"]
        if not isinstance(name, str) or not _RETURN_PART.fullmatch(name):
            raise _malformed(f"bad binary part name {name!r}")
        if int(name.partition(":")[2]) != self.used:
            raise _malformed(f"binary part {name} is not numbered in depth-first order")
        data = self._parts.get(name)
        if data is None:
            raise _malformed(f"binary part {name} is missing")
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
            raise _malformed(f"bad sha256 for {name}")
        copied, actual = _copy_and_hash(data, copy)
        if actual != digest:
            raise _malformed(f"sha256 mismatch for {name}")
        self.used += 1
        return copied

    def _file(self, encoded: dict[str, Any]) -> ReturnedFile:
        size = encoded["size"]
        if type(size) is not int or size < 0:
            raise _malformed("a file size must be a non-negative integer")
        data = self._take(encoded, bytes)
        if len(data) != size:
            raise _malformed(f"file size {size} does not match its part ({len(data)} bytes)")
        return ReturnedFile(data)

    def _folder(self, encoded: dict[str, Any]) -> ReturnedFolder:
        files, directories = encoded["files"], encoded["directories"]
        if not isinstance(files, dict) or not isinstance(directories, list):
            raise _malformed("a folder needs a 'files' object and a 'directories' list")
        decoded = {}
        for path, child in files.items():
            if not isinstance(child, dict) or child.get("type") != "file":
                raise _malformed(f"folder entry {path!r} is not a file")
            decoded[path] = self.decode(child)
        try:
            return ReturnedFolder(decoded, tuple(directories))
        except (TypeError, ValueError) as exc:
            raise _malformed(f"invalid folder manifest: {exc}") from None

    def _tensor(self, encoded: dict[str, Any]) -> np.ndarray:
        dtype, shape = encoded["dtype"], encoded["shape"]
        if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
            raise _malformed(f"unsupported tensor dtype {dtype!r}")
        if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
            raise _malformed("a tensor shape must be a list of non-negative integers")
        size = math.prod(shape) * _ITEMSIZE[dtype]

        def to_array(data: memoryview) -> np.ndarray:
            if data.nbytes != size:
                raise _malformed(f"tensor part has {data.nbytes} bytes, not what {dtype}{shape} needs")
            if dtype == "bool":  # via uint8, so that bytes other than 0/1 become proper bools
                return np.frombuffer(data, np.uint8).reshape(shape).astype(bool)
            return np.frombuffer(data, _numpy_dtype(dtype)).reshape(shape).copy()
        return self._take(encoded, to_array)


def _copy_and_hash(data: memoryview, copy: Callable[[memoryview], T]) -> tuple[T, str]:
    """-> (copy(data), SHA-256 hex of data). A large part is hashed on a second thread while this one
    copies it: hashlib lets go of the GIL, so the two passes over the data overlap."""
    if data.nbytes < _PARALLEL_HASH_BYTES:
        return copy(data), hashlib.sha256(data).hexdigest()
    hashed: list[str] = []
    hasher = threading.Thread(target=lambda: hashed.append(hashlib.sha256(data).hexdigest()), daemon=True)
    hasher.start()
    copied = copy(data)
    hasher.join()
    return copied, hashed[0] if hashed else ""


def _numpy_dtype(name: str) -> np.dtype:
    if name in _ML_DTYPES:
        try:
            import ml_dtypes  # only needed for these dtypes; keeps the import-time deps to NumPy
        except ImportError:
            raise ImportError(f"a returned {name} tensor needs ml_dtypes to decode: pip install ml_dtypes") from None
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(_NUMPY_DTYPES[name])


# -- multipart (docs/protocol.md §4.4-4.5): responses are parsed with the rules servers apply to requests

_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_HEADER_VALUE = re.compile(rf"\s*({_TOKEN}(?:/{_TOKEN})?)\s*")
# Unquoted values are taken leniently (up to ';' or space), as MIME parsers commonly do.
_HEADER_PARAM = re.compile(rf';\s*(?:({_TOKEN})\s*=\s*(?:([^\s;"]+)|"((?:[^"\\\r\n]|\\.)*)")\s*)?')
_HEADER_LINE = re.compile(rb"([!-9;-~]+):[ \t]*(.*?)[ \t]*")  # field name: printable ASCII but ':'


def _parse_header_value(value: str) -> tuple[str, list[tuple[str, str]]]:
    """'type/sub; a=1; b="x"' -> ('type/sub', [('a', '1'), ('b', 'x')]), names lower-cased."""
    match = _HEADER_VALUE.match(value)
    if not match:
        raise ValueError(f"malformed header value {value!r}")
    params: list[tuple[str, str]] = []
    position = match.end()
    while position < len(value):
        param = _HEADER_PARAM.match(value, position)
        if not param:
            raise ValueError(f"malformed header parameters in {value!r}")
        if param.group(1):
            raw = param.group(2) if param.group(2) is not None else re.sub(r"\\(.)", r"\1", param.group(3))
            if any(name == param.group(1).lower() for name, _ in params):
                raise ValueError(f"header parameter {param.group(1)!r} given twice in {value!r}")
            params.append((param.group(1).lower(), raw))
        position = param.end()
    return match.group(1).lower(), params


def _multipart_boundary(content_type: str) -> str:
    media_type, params = _parse_header_value(content_type)
    boundaries = [v for k, v in params if k == "boundary"]
    if media_type != "multipart/form-data" or len(boundaries) != 1 or not boundaries[0] \
            or "\r" in boundaries[0] or "\n" in boundaries[0]:
        raise ValueError(f"bad multipart content type {content_type!r}")
    return boundaries[0]


_Body = bytes | bytearray  # a response body as received


def _parse_multipart(body: _Body, boundary: str) -> list[tuple[str, str, memoryview]]:
    """Split a multipart/form-data body into (name, media type, payload view) parts.
    Raises ValueError on any framing or part-header violation."""
    delimiter = b"--" + boundary.encode("utf-8")
    view = memoryview(body)
    found = _next_delimiter(body, delimiter, 0)
    if found is None:
        raise ValueError("no multipart delimiter")
    if found[2]:
        raise ValueError("multipart body has no parts")
    parts = []
    start = found[1]
    while True:
        found = _next_delimiter(body, delimiter, start)
        if found is None:
            raise ValueError("multipart body has no closing delimiter")
        end = found[0]
        if end == start:  # the line break before this delimiter belongs to the previous one
            raise ValueError("empty multipart part")
        end -= 2 if body[end - 2:end] == b"\r\n" else 1
        parts.append(_parse_part(body, view, start, end))
        if found[2]:
            return parts
        start = found[1]


def _next_delimiter(body: _Body, delimiter: bytes, start: int) -> tuple[int, int, bool] | None:
    """(position, end of its line, is closing) of the next delimiter line at or after start.
    A delimiter counts only at the body start or after LF, followed by optional spaces/tabs
    and a line break (or, for the closing one, the end of the body)."""
    position = start
    while (position := body.find(delimiter, position)) != -1:
        if position == 0 or body[position - 1] == 0x0A:
            cursor = position + len(delimiter)
            closing = body[cursor:cursor + 2] == b"--"
            cursor += 2 if closing else 0
            while cursor < len(body) and body[cursor] in b" \t":
                cursor += 1
            if body[cursor:cursor + 2] == b"\r\n":
                return position, cursor + 2, closing
            if body[cursor:cursor + 1] == b"\n":
                return position, cursor + 1, closing
            if closing and cursor == len(body):
                return position, cursor, closing
        position += 1
    return None


def _parse_part(body: _Body, view: memoryview, start: int, end: int) -> tuple[str, str, memoryview]:
    headers: list[list[str]] = []
    cursor = start
    while True:
        line_end = body.find(b"\n", cursor, end)
        if line_end == -1:
            raise ValueError("multipart part has no blank line after its headers")
        line = bytes(body[cursor:line_end]).removesuffix(b"\r")
        cursor = line_end + 1
        if not line:
            break
        if line[:1] in (b" ", b"\t"):  # folded continuation of the previous header
            if not headers:
                raise ValueError("multipart part starts with a continuation line")
            headers[-1][1] += " " + line.strip(b" \t").decode("utf-8")
            continue
        match = _HEADER_LINE.fullmatch(line)
        if not match:
            raise ValueError(f"malformed multipart header line {line!r}")
        headers.append([match.group(1).decode("ascii").lower(), match.group(2).decode("utf-8")])
    dispositions = [v for k, v in headers if k == "content-disposition"]
    content_types = [v for k, v in headers if k == "content-type"]
    encodings = [v for k, v in headers if k == "content-transfer-encoding"]
    if len(dispositions) != 1 or len(content_types) != 1:
        raise ValueError("a multipart part needs exactly one Content-Disposition and one Content-Type")
    disposition, params = _parse_header_value(dispositions[0])
    names = [v for k, v in params if k == "name"]
    if disposition != "form-data" or len(names) != 1 or not names[0]:
        raise ValueError(f"bad multipart Content-Disposition {dispositions[0]!r}")
    media_type = _parse_header_value(content_types[0])[0]
    if media_type.startswith("multipart/"):
        raise ValueError("nested multipart parts are not allowed")
    if any(e.strip().lower() not in ("binary", "8bit") for e in encodings):
        raise ValueError("multipart Content-Transfer-Encoding must be binary or 8bit")
    return names[0], media_type, view[cursor:end]


def _response_body(content_type: str, body: _Body) -> tuple[dict[str, Any], dict[str, memoryview]]:
    """(JSON object, binary parts by name) of a 200 /execute response (docs/client.md §5.2)."""
    media_type = content_type.partition(";")[0].strip().lower()
    try:
        if media_type == "application/json":
            payload = _strict_json(body)
            parts: dict[str, memoryview] = {}
        elif media_type == "multipart/form-data":
            payload, parts = _split_result_parts(_parse_multipart(body, _multipart_boundary(content_type)))
        else:
            raise ProtocolError(f"unexpected response content type {content_type!r}")
    except ValueError as exc:
        raise ProtocolError(f"malformed execution response: {exc}") from None
    if not isinstance(payload, dict):
        raise _malformed("the response JSON is not an object")
    return payload, parts


def _split_result_parts(parts: list[tuple[str, str, memoryview]]) -> tuple[Any, dict[str, memoryview]]:
    results = [p for p in parts if p[0] == "result"]
    if len(results) != 1 or results[0][1] != "application/json":
        raise ValueError("a multipart response needs exactly one application/json 'result' part")
    binary = {}
    for name, media_type, payload in parts:
        if name == "result":
            continue
        if name in binary or media_type != "application/octet-stream":
            raise ValueError(f"binary part {name!r} is duplicated or not application/octet-stream")
        binary[name] = payload
    return _strict_json(results[0][2]), binary


# ---------------------------------------------------------------------------
# HTTP client (docs/client.md §4)

_MAX_IDLE_CONNECTIONS = 8
_STREAM_HEADER = "X-KCoral-Stream"  # our server's streamed answer, asked for with "output" (docs/protocol.md §13)
_STREAM_FRAME_HEAD_BYTES = 4096  # a frame's head line: a name, a length, a status and a content type
_PARALLEL_HASH_BYTES = 1 << 20  # response parts this big are hashed while they are copied
_REMEMBERED_BLOBS_PER_INSTANCE = 4096
_REMEMBERED_INSTANCES = 4

_DEFAULT_EXECUTION_SECONDS = 300.0  # the server's timeout for a request that sets none (docs/protocol.md §5.3)
_LONGEST_SOCKET_WAIT_SECONDS = 1e8  # what settimeout accepts everywhere; years, so never the binding limit
_READ_PIECE_BYTES = 1 << 20  # a body of unknown length is read in pieces this big, to stop at the cap
_DEFAULT_MAX_RESPONSE_BYTES = (1 << 30) + (64 << 20)  # a returned 1 GiB tensor and more: the server's default
_ASSUMED_REQUEST_LIMIT = 64 << 20  # smaller requests are sent without asking the server's size limit first


class _Deadline:
    """The moment by which one exchange (sending, waiting, receiving) must be over. Every socket operation is
    given only the time left, so a server that stalls, or trickles a byte at a time, cannot hold the client past it."""

    def __init__(self, seconds: float, why: str) -> None:
        self.seconds, self.why = seconds, why
        self.at = time.monotonic() + seconds

    def run(self, sock: Any, operation: Callable[[], T]) -> T:
        """``operation()`` on ``sock`` within the time left; TimeoutError saying why otherwise."""
        left = self.at - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            sock.settimeout(min(left, _LONGEST_SOCKET_WAIT_SECONDS))
            return operation()
        except TimeoutError:
            raise TimeoutError(f"no complete answer within {self.seconds:g} s ({self.why})") from None


class _DeadlineReader(io.RawIOBase):
    """The response's socket reader, each read within the exchange's deadline."""

    def __init__(self, raw: Any, sock: Any, deadline: _Deadline) -> None:
        super().__init__()
        self._raw, self._sock, self._deadline = raw, sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        return self._deadline.run(self._sock, lambda: self._raw.readinto(buffer))

    def close(self) -> None:
        self._raw.close()  # the socket file's own close: the socket is released when both ends let go
        super().close()


class _DeadlineConnection:
    """Connecting is limited by connect_timeout_seconds; everything after it by the deadline
    `_exchange` sets for each request (docs/client.md §4.8)."""

    sock: Any
    deadline: _Deadline

    def send(self, data: Any) -> None:  # http.client sends the head and each body chunk through here
        self.deadline.run(self.sock, lambda: super(_DeadlineConnection, self).send(data))  # type: ignore[misc]

    def response_class(self, sock: Any, *args: Any, **kwargs: Any) -> http.client.HTTPResponse:
        response = http.client.HTTPResponse(sock, *args, **kwargs)
        response.fp = io.BufferedReader(_DeadlineReader(response.fp.detach(), sock, self.deadline))
        return response


# http.client only calls response_class(sock, method=...); typeshed declares it a type[HTTPResponse]
class _HTTPConnection(_DeadlineConnection, http.client.HTTPConnection):  # type: ignore[misc]
    pass


class _HTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):  # type: ignore[misc]  # as above
    pass


@dataclasses.dataclass
class _Response:
    status: int
    content_type: str
    instance: str | None  # X-KCoral-Instance: which server process answered
    node: str | None      # X-KCoral-Node: router affinity to echo on the next attempt
    body: _Body
    retry_after: float | None = None  # Retry-After in seconds (an HTTP date is not honoured)


@dataclasses.dataclass
class _Transfer:
    """What one execute sent, for ProgramResult's account of it."""

    round_trips: int = 0
    sent: set[str] = dataclasses.field(default_factory=set)  # hashes of the blobs sent
    sent_bytes: int = 0
    sent_separately: bool = False  # blobs too large for one request went in requests of their own

    def count(self, blobs: list[tuple[str, bytes]]) -> None:
        self.round_trips += 1
        self.sent.update(digest for digest, _ in blobs)
        self.sent_bytes += sum(len(data) for _, data in blobs)

    def report(self, result: ProgramResult, blobs: dict[str, bytes]) -> None:
        result.blob_bytes_sent, result.round_trips = self.sent_bytes, self.round_trips
        result.blobs_cached = len(blobs.keys() - self.sent)


class _BlobMemory:
    """Which blobs each recently seen server instance has confirmed holding, so that a client talking
    to a server that names its instance can skip the ask-first round trip. Entries are (hash, cache)
    pairs: file and in-memory blobs are separate caches (docs/protocol.md §7.1), and holding a hash in
    one says nothing of the other. Bounded: a few instances, an LRU of hashes each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[str, collections.OrderedDict[tuple[str, str], None]] = \
            collections.OrderedDict()
        self._current: str | None = None  # the instance of the latest response, if it named one

    def observe(self, instance: str | None) -> None:
        with self._lock:
            self._current = instance

    def current(self) -> str | None:
        with self._lock:
            return self._current

    def not_held(self, needs: dict[str, set[str]]) -> set[str] | None:
        """Hashes the current instance is not known to hold in every cache the program
        needs them in; None when the server does not name its instance."""
        with self._lock:
            if self._current is None:
                return None
            held: collections.abc.Mapping[tuple[str, str], None] = self._held.get(self._current, {})
            return {h for h, caches in needs.items() if any((h, c) not in held for c in caches)}

    def confirm(self, instance: str | None, needs: dict[str, set[str]], hashes: collections.abc.Iterable[str]) -> None:
        if instance is None:
            return
        with self._lock:
            held = self._held.pop(instance, None) or collections.OrderedDict()
            self._held[instance] = held
            if len(self._held) > _REMEMBERED_INSTANCES:
                self._held.popitem(last=False)
            for digest in hashes:
                for cache in needs[digest]:
                    held[(digest, cache)] = None
                    held.move_to_end((digest, cache))
            while len(held) > _REMEMBERED_BLOBS_PER_INSTANCE:
                held.popitem(last=False)

    def forget(self, instance: str | None, needs: dict[str, set[str]], hashes: collections.abc.Iterable[str]) -> None:
        with self._lock:
            held = self._held.get(instance) if instance is not None else None
            if held is None:
                return
            for digest in hashes:
                for cache in needs[digest]:
                    held.pop((digest, cache), None)


class Client:
    """A connection to one KCoral server. Safe to share between threads; connections are kept alive and reused.

    ``eager_upload_bytes``: when the server names its instance (X-KCoral-Instance), blobs it is not known to
    hold are sent with the first attempt if they total at most this many bytes, saving the CACHE_MISS round
    trip; 0 always asks first, as the published client does. Larger uploads always ask first: the server may
    hold them already.

    What a broken or hostile server can cost is bounded (docs/client.md §4.8): an answer larger
    than ``max_response_bytes`` is refused (ProtocolError), and every exchange has a deadline:
    ``execute`` waits the request's execution timeout plus ``response_margin_seconds``,
    ``health`` waits ``health_timeout_seconds`` (TransportError beyond it).

    ``retry_busy_seconds``: a 429 or 503 answer to ``execute`` that carries Retry-After is retried
    after the wait it names, for at most this many seconds of waiting in all (0, the default: never,
    the KCoralError is raised at once). Neither answer ran anything, so a retry runs nothing twice."""

    def __init__(self, base_url: str, *, headers: dict[str, str] | None = None,
                 connect_timeout_seconds: float = 10.0,
                 eager_upload_bytes: int = 8 * 1024 * 1024,
                 max_response_bytes: int = _DEFAULT_MAX_RESPONSE_BYTES,
                 response_margin_seconds: float = 1860.0,
                 health_timeout_seconds: float = 30.0,
                 retry_busy_seconds: float = 0.0) -> None:
        self.base_url = base_url.rstrip("/")
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        if type(eager_upload_bytes) is not int or eager_upload_bytes < 0:
            raise ValueError("eager_upload_bytes must be a non-negative int")
        if type(max_response_bytes) is not int or max_response_bytes < 1:
            raise ValueError("max_response_bytes must be a positive int")
        for name, seconds in (("response_margin_seconds", response_margin_seconds),
                              ("health_timeout_seconds", health_timeout_seconds)):
            if not _is_real(seconds) or not 0 < seconds < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds")
        if not _is_real(retry_busy_seconds) or not 0 <= retry_busy_seconds < math.inf:
            raise ValueError("retry_busy_seconds must be a non-negative number of seconds")
        self._connection_class = _HTTPSConnection if url.scheme == "https" else _HTTPConnection
        self._host, self._port, self._path = url.hostname, url.port, url.path
        self._headers = dict(headers or {})
        self._connect_timeout = connect_timeout_seconds
        self._eager_upload_bytes = eager_upload_bytes
        self._max_response_bytes = max_response_bytes
        self._response_margin = float(response_margin_seconds)
        self._health_timeout = float(health_timeout_seconds)
        self._retry_busy_seconds = float(retry_busy_seconds)
        self._request_limit: tuple[str | None, int | None] | None = None  # (instance, its max_request_bytes)
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self._closed = False
        self._memory = _BlobMemory()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release pooled connections; the client cannot be used afterwards."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def health(self) -> dict[str, Any]:
        """GET /health; the whole body, which must say status "ok"."""
        response = self._request("GET", "/health", deadline=_Deadline(self._health_timeout, "health_timeout_seconds"))
        if response.status != 200:
            raise _http_error(response)
        try:
            body = _strict_json(response.body)
        except ValueError as exc:
            raise ProtocolError(f"malformed health response: {exc}") from None
        if not isinstance(body, dict):
            raise ProtocolError("malformed health response: not a JSON object")
        if body.get("status") != "ok":
            raise ProtocolError(f"health status is not ok: {body.get('status')!r}")
        return body

    def target(self) -> dict[str, str]:
        """The server's compilation target, e.g. {"arch": "sm_100a"}."""
        target = self.health().get("target")
        if not isinstance(target, dict) or "arch" not in target:
            raise ProtocolError("the server reported no compilation target")
        return target

    def function(self, *, timeout: float | None = None, output_limit_bytes: int | None = None,
                 cpu_only: bool = False) -> Callable[[Callable[P, R]], RemoteFunction[P, R]]:
        """Decorator: turn a plain function into a RemoteFunction bound to this client."""
        def decorate(fn: Callable[P, R]) -> RemoteFunction[P, R]:
            return RemoteFunction(fn, client=self, timeout=timeout,
                                  output_limit_bytes=output_limit_bytes, cpu_only=cpu_only)
        return decorate

    def execute(self, program: Program, *, timeout_seconds: float | None = None,
                gpu_count: int | None = None, output_limit_bytes: int | None = None,
                on_output: Callable[[str, bytes], None] | None = None) -> ProgramResult:
        """Run ``program``; returns its COMPLETED or FAILED result. Blobs the server lacks are negotiated with at most
        three attempts (docs/client.md §4.2), all of them sent under one client request id so that the server's log
        links them: the result and any KCoralError, TransportError or ProtocolError raised carry it as
        ``client_request_id`` (docs/operations.md, "Trace a failed request": HAProxy logs it too).

        ``on_output("stdout" | "stderr", data)``, if given, receives the captured output while the
        program runs, from a server that streams it (ours, docs/protocol.md §13); the result still
        holds all of it. A server that does not stream calls it never."""
        client_request_id = str(uuid.uuid4())
        try:
            result = self._execute(program, client_request_id, timeout_seconds=timeout_seconds, gpu_count=gpu_count,
                                   output_limit_bytes=output_limit_bytes, on_output=on_output)
        except (KCoralError, TransportError, ProtocolError) as exc:
            exc.client_request_id = client_request_id
            raise
        result.client_request_id = client_request_id
        return result

    def _execute(self, program: Program, client_request_id: str, *, timeout_seconds: float | None,
                 gpu_count: int | None, output_limit_bytes: int | None,
                 on_output: Callable[[str, bytes], None] | None) -> ProgramResult:
        if not isinstance(program, Program):
            raise TypeError("execute expects a Program")
        if gpu_count is not None and (type(gpu_count) is not int or not 1 <= gpu_count <= 8):
            raise ValueError("gpu_count must be an int from 1 to 8")
        options = {"gpu_count": gpu_count, "timeout_seconds": timeout_seconds, "output_limit_bytes": output_limit_bytes}
        options = {name: value for name, value in options.items() if value is not None}
        body: dict[str, Any] = {"instructions": program.instructions}
        if options:
            body["options"] = options
        program_json = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        blobs = program._blobs
        needs = _blob_caches(program)
        unknown = self._memory.not_held(needs) or set()  # None: the server names no instance, so ask first
        eager = self._eager_upload_bytes > 0 and sum(len(blobs[h]) for h in unknown) <= self._eager_upload_bytes
        send = [h for h in blobs if h in unknown] if eager else []
        node = None
        affinity = _affinity_key(blobs)
        seconds = _execution_seconds(timeout_seconds) + self._response_margin
        transfer = _Transfer()
        for attempt in (1, 2, 3):
            if not self._fits(program_json, [(h, blobs[h]) for h in send], transfer):
                self._send_separately(program_json, blobs, needs, send, transfer, client_request_id)
                send = []
            response = self._post_retrying_busy(program_json, [(h, blobs[h]) for h in send], node, affinity,
                                                client_request_id, seconds, on_output, transfer)
            if response.status != 200:
                raise _http_error(response)
            payload, parts = _response_body(response.content_type, response.body)
            if payload.get("status") != "CACHE_MISS":
                result = _decode_result(payload, parts)
                self._memory.confirm(response.instance, needs, needs)
                transfer.report(result, blobs)
                return result
            if attempt == 1:
                missing = _missing_blobs(payload, parts, blobs)
                self._memory.forget(response.instance, needs, missing)
                self._memory.confirm(response.instance, needs, [h for h in needs if h not in missing])
                send = [h for h in blobs if h in missing]
            else:  # the cache changed under us: send everything (the published client's step 3)
                self._memory.forget(response.instance, needs, needs)
                send = list(blobs)
            node = response.node
        raise ProtocolError("the server still reports missing blobs after every blob was sent")

    # -- requests near the server's size limit (docs/client.md §4.10)

    def _fits(self, program_json: bytes, blobs: list[tuple[str, bytes]], transfer: _Transfer) -> bool:
        """Whether a request with these blobs is within the server's max_request_bytes. Only a large
        one asks (/health's `limits`, once per server instance); a server that does not say is sent it."""
        size = _request_size(program_json, blobs)
        if size <= _ASSUMED_REQUEST_LIMIT:
            return True
        limit = self._server_request_limit(transfer)
        return limit is None or size <= limit

    def _server_request_limit(self, transfer: _Transfer) -> int | None:
        instance = self._memory.current()
        known = self._request_limit
        if known is not None and known[0] == instance:
            return known[1]
        transfer.round_trips += 1
        try:
            health = self.health()
        except (KCoralError, TransportError, ProtocolError):
            return None  # the request itself will tell
        entry = health.get("limits", {}).get("max_request_bytes") if isinstance(health.get("limits"), dict) else None
        value = entry.get("value") if isinstance(entry, dict) else None
        limit = value if type(value) is int and value > 0 else None
        self._request_limit = (self._memory.current(), limit)
        return limit

    def _send_separately(self, program_json: bytes, blobs: dict[str, bytes], needs: dict[str, set[str]],
                         send: list[str], transfer: _Transfer, client_request_id: str) -> None:
        """Send the blobs of a request that would not fit in requests of their own, each under the
        limit, so that the program then finds them cached; KCoralError 413, in the server's words,
        when one blob alone is too large, or when they were sent separately once already."""
        limit = self._request_limit[1] if self._request_limit else None
        assert limit is not None  # _fits said no: it knows the limit
        groups = _pack_blobs([(h, blobs[h]) for h in send], needs, limit)
        if groups is None or transfer.sent_separately:
            size = _request_size(program_json, [(h, blobs[h]) for h in send])
            raise KCoralError(413, _request_too_large_message(size, limit), kind="request_too_large")
        transfer.sent_separately = True
        seconds = _DEFAULT_EXECUTION_SECONDS + self._response_margin
        for group in groups:
            program = json.dumps({"instructions": _caching_instructions(group, needs)}).encode()
            response = self._post_retrying_busy(program, [(h, blobs[h]) for h in group], None,
                                                _affinity_key({h: blobs[h] for h in group}), client_request_id,
                                                seconds, None, transfer)
            if response.status != 200:
                raise _http_error(response)
            self._memory.confirm(response.instance, needs, group)

    def _post_retrying_busy(self, program_json: bytes, blobs: list[tuple[str, bytes]], node: str | None,
                            affinity: str | None, client_request_id: str, seconds: float,
                            on_output: Callable[[str, bytes], None] | None, transfer: _Transfer) -> _Response:
        """One POST /execute, sent again after each 429/503 with Retry-After while retry_busy_seconds last."""
        waited = 0.0
        while True:
            deadline = _Deadline(seconds, "the request's timeout plus response_margin_seconds")
            response = self._post_execute(program_json, blobs, node, affinity, client_request_id, deadline, on_output)
            transfer.count(blobs)
            wait = response.retry_after
            if response.status not in (429, 503) or wait is None or waited + wait > self._retry_busy_seconds:
                return response
            time.sleep(wait)
            waited += wait

    # -- HTTP plumbing

    def _post_execute(self, program_json: bytes, blobs: list[tuple[str, bytes]], node: str | None,
                      affinity: str | None, client_request_id: str, deadline: _Deadline,
                      on_output: Callable[[str, bytes], None] | None = None) -> _Response:
        boundary = f"kcoral-{secrets.token_hex(16)}"
        chunks = _multipart_chunks(boundary, program_json, blobs)
        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}",
                   "Content-Length": str(sum(memoryview(c).nbytes for c in chunks)),
                   "X-KCoral-Client-Request-ID": client_request_id}
        optional = {"X-KCoral-Node": node, "X-KCoral-Affinity": affinity,
                    _STREAM_HEADER: "output" if on_output is not None else None}
        headers.update({name: value for name, value in optional.items() if value is not None})
        return self._request("POST", "/execute", headers, chunks, deadline=deadline, on_output=on_output)

    def _request(self, method: str, path: str, headers: dict[str, str] | None = None,
                 chunks: list[bytes | memoryview] | None = None, *, deadline: _Deadline,
                 on_output: Callable[[str, bytes], None] | None = None) -> _Response:
        conn = self._checkout()
        try:
            if conn.sock is None:  # a new connection: connect_timeout_seconds applies
                conn.connect()
            response, (status, content_type, body), reusable = _exchange(
                conn, method, self._path + path, _merge_headers(self._headers, headers or {}), chunks or [],
                deadline, self._max_response_bytes, on_output)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise TransportError(str(exc) or type(exc).__name__) from exc
        except BaseException:
            conn.close()
            raise
        self._checkin(conn, reusable)
        instance = (response.getheader("X-KCoral-Instance") or "").strip() or None
        self._memory.observe(instance)
        node = response.getheader("X-KCoral-Node")
        return _Response(status, content_type, instance, node if node and len(node) <= 512 else None, body,
                         _retry_after(response.getheader("Retry-After")))

    def _checkout(self) -> http.client.HTTPConnection:
        with self._lock:
            if self._closed:
                raise RuntimeError("Cannot send a request, as the client has been closed.")
            while self._idle:
                conn = self._idle.pop()
                if conn.sock is not None and not _peer_closed(conn.sock):
                    return conn
                conn.close()
        return self._connection_class(self._host, self._port, timeout=self._connect_timeout)

    def _checkin(self, conn: http.client.HTTPConnection, reusable: bool) -> None:
        with self._lock:
            if reusable and not self._closed and len(self._idle) < _MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()


def _merge_headers(user: dict[str, str], ours: dict[str, str]) -> dict[str, str]:
    """The user's headers, except where the request's own framing headers must win."""
    overridden = {name.lower() for name in ours}
    return {**{k: v for k, v in user.items() if k.lower() not in overridden}, **ours}


def _exchange(conn: http.client.HTTPConnection, method: str, url: str, headers: dict[str, str],
              chunks: list[bytes | memoryview], deadline: _Deadline, limit: int,
              on_output: Callable[[str, bytes], None] | None = None) -> tuple[http.client.HTTPResponse, _Answer, bool]:
    """Send one request and read the whole response, at most ``limit`` body bytes, all before
    ``deadline``: (response, its answer, connection reusable)."""
    conn.deadline = deadline  # type: ignore[attr-defined]
    conn.putrequest(method, url, skip_host="host" in {k.lower() for k in headers}, skip_accept_encoding=True)
    for name, value in headers.items():
        conn.putheader(name, value)
    try:
        conn.endheaders()
        for chunk in chunks:  # each blob straight from its own buffer: nothing is concatenated
            conn.send(chunk)
    except OSError as send_error:
        # A server may answer (e.g. 413) and close without reading the whole body; its
        # answer explains more than the broken pipe does.
        try:
            response = conn.getresponse()
            return response, _read_answer(response, limit, on_output), False
        except (OSError, http.client.HTTPException):
            raise send_error from None
    response = conn.getresponse()
    return response, _read_answer(response, limit, on_output), not response.will_close


_Answer = tuple[int, str, "bytes | bytearray"]  # (HTTP status, Content-Type, body)


def _read_answer(response: http.client.HTTPResponse, limit: int,
                 on_output: Callable[[str, bytes], None] | None) -> _Answer:
    """The answer a response carries: itself, or the last frame of a streamed one (only when asked for)."""
    if on_output is not None and response.getheader(_STREAM_HEADER) == "output":
        return _read_stream(response, limit, on_output)
    return response.status, response.getheader("Content-Type") or "", _read_body(response, limit)


def _read_stream(response: http.client.HTTPResponse, limit: int, on_output: Callable[[str, bytes], None]) -> _Answer:
    """docs/protocol.md §13: `stdout`/`stderr` frames go to ``on_output`` as they arrive; the
    `result` frame, which must be the last, is the answer. ``limit`` bounds all frames together."""
    received = 0
    while True:
        head = response.readline(_STREAM_FRAME_HEAD_BYTES)
        fields = head[:-1].decode("ascii", "replace").split(" ", 3) if head.endswith(b"\n") else []
        if len(fields) < 2 or not fields[1].isdigit() or not fields[1].isascii():
            raise ProtocolError(f"malformed output stream frame: {bytes(head[:80])!r}")
        length = int(fields[1])
        received += length
        if received > limit:
            raise _too_large("the server's streamed response runs past", limit)
        payload = response.read(length)
        if len(payload) != length:
            raise http.client.IncompleteRead(payload, length - len(payload))
        if fields[0] in ("stdout", "stderr") and len(fields) == 2:
            on_output(fields[0], payload)
        elif fields[0] == "result" and len(fields) == 4 and fields[2].isdigit() and fields[2].isascii():
            if response.read(1):
                raise ProtocolError("data after the last frame of an output stream")
            return int(fields[2]), fields[3], payload
        else:
            raise ProtocolError(f"malformed output stream frame: {bytes(head[:80])!r}")


def _read_body(response: http.client.HTTPResponse, limit: int) -> _Body:
    """The whole body, read into one preallocated buffer when its length is known, so
    that binary parts can be views of it rather than copies. A body above ``limit`` bytes is
    refused: before any of it is read when its length is declared, at ``limit`` + 1 otherwise."""
    if response.chunked or response.length is None:
        growing = bytearray()
        while piece := response.read(min(_READ_PIECE_BYTES, limit + 1 - len(growing))):
            growing += piece
            if len(growing) > limit:
                raise _too_large("the server's response runs past", limit)
        return growing
    if response.length > limit:
        raise _too_large(f"the server declares a response of {response.length} bytes, above", limit)
    body = bytearray(response.length)
    view = memoryview(body)
    filled = 0
    while filled < len(body):
        count = response.readinto(view[filled:])
        if not count:
            raise http.client.IncompleteRead(b"", len(body) - filled)
        filled += count
    return body


def _too_large(what: str, limit: int) -> ProtocolError:
    return ProtocolError(f"{what} max_response_bytes ({limit} bytes); the program may have run (raise "
                         "Client(max_response_bytes=...) for a server with a larger limit)")


def _peer_closed(sock: Any) -> bool:
    """An idle keep-alive socket that is readable has been closed by the server (or holds
    junk); either way it must not carry the next request."""
    if hasattr(select, "poll"):  # poll, unlike select, works for descriptors >= 1024
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([sock], [], [], 0)[0])


def _multipart_chunks(boundary: str, program_json: bytes, blobs: list[tuple[str, bytes]]) -> list[bytes | memoryview]:
    """The request body as a list of pieces: framing as small bytes, each blob as a view of
    its own buffer. The boundary holds 128 random bits drawn per request, so no payload can
    contain it by accident, and scanning every blob for it would cost a pass over the data."""
    framing = [f'--{boundary}\r\nContent-Disposition: form-data; name="program"\r\n'
               f"Content-Type: application/json\r\n\r\n".encode() + program_json]
    chunks: list[bytes | memoryview] = []
    for digest, data in blobs:
        framing.append(f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="blob:{digest}"\r\n'
                       f"Content-Type: application/octet-stream\r\n\r\n".encode())
        chunks += [b"".join(framing), memoryview(data)]
        framing = []
    framing.append(f"\r\n--{boundary}--\r\n".encode())
    chunks.append(b"".join(framing))
    return chunks


_REQUEST_SIZE_BOUNDARY = "kcoral-" + "0" * 32  # as long as _post_execute's: the same framing bytes


def _request_size(program_json: bytes, blobs: list[tuple[str, bytes]]) -> int:
    return sum(memoryview(c).nbytes for c in _multipart_chunks(_REQUEST_SIZE_BOUNDARY, program_json, blobs))


def _request_too_large_message(size: int | None, limit: int) -> str:
    """The 413's words, the server's and the client's refusal before sending alike (tests/test_shared_rules.py)."""
    what = f"request of {size} bytes" if size is not None else "request"
    return (f"{what} exceeds the server's size limit of {limit} bytes (max_request_bytes; the server's "
            "--max-request-bytes flag raises it)")


def _caching_instructions(digests: list[str], needs: dict[str, set[str]]) -> list[dict[str, Any]]:
    """A program that only uploads blobs, into each cache a later program needs them in: in memory
    as bytes, on disk as files (docs/protocol.md §7.1). Ids and paths come from the hash, so that
    what one blob adds to the request does not depend on its company (_pack_blobs)."""
    instructions = []
    for digest in digests:
        for cache in sorted(needs[digest]):
            fields = {"kind": "bytes"} if cache == "memory" else {"kind": "file", "path": f"blobs/{digest}"}
            instructions.append({"op": "upload", "id": f"{cache}_{digest}", **fields, "blob": digest})
    return instructions


def _caching_request_size(blobs: list[tuple[str, bytes]], needs: dict[str, set[str]]) -> int:
    program = json.dumps({"instructions": _caching_instructions([h for h, _ in blobs], needs)}).encode()
    return _request_size(program, blobs)


def _pack_blobs(blobs: list[tuple[str, bytes]], needs: dict[str, set[str]], limit: int) -> list[list[str]] | None:
    """Blobs in groups that each fit one caching request under ``limit``, largest first (first fit);
    None when one alone does not. A group's request is the empty one plus what each blob adds, and
    json's ", " between two blobs' instructions."""
    empty = _caching_request_size([], needs)
    groups: list[tuple[list[str], list[int]]] = []  # (hashes, [request size so far])
    for digest, data in sorted(blobs, key=lambda blob: -len(blob[1])):
        alone = _caching_request_size([(digest, data)], needs)
        if alone > limit:
            return None
        for digests, size in groups:
            if size[0] + alone - empty + len(", ") <= limit:
                digests.append(digest)
                size[0] += alone - empty + len(", ")
                break
        else:
            groups.append(([digest], [alone]))
    return [digests for digests, _ in groups]


def _retry_after(value: str | None) -> float | None:
    """Retry-After's delay-seconds (RFC 9110 §10.2.3); None when absent or an HTTP date."""
    value = (value or "").strip()
    return float(value) if value.isdigit() and value.isascii() and len(value) <= 9 else None


def _affinity_key(blobs: dict[str, bytes]) -> str | None:
    """The hash of the program's largest blob (ties: the smaller hash), or None without blobs. A cohort
    behind HAProxy hashes on it (`python -m kcoral haproxy-config`), so a program that reuses a large
    blob lands on the node that already caches it; a single server ignores the header."""
    if not blobs:
        return None
    return min(blobs, key=lambda digest: (-len(blobs[digest]), digest))


def _blob_caches(program: Program) -> dict[str, set[str]]:
    """hash -> the server caches the program needs it in ("file" and/or "memory")."""
    needs: dict[str, set[str]] = {}
    for instruction in program._instructions:
        if instruction["op"] == "upload" and "blob" in instruction:
            cache = "file" if instruction["kind"] == "file" else "memory"
            needs.setdefault(instruction["blob"], set()).add(cache)
    return needs


def _missing_blobs(payload: dict[str, Any], parts: dict[str, memoryview], blobs: dict[str, bytes]) -> set[str]:
    """Validate the first CACHE_MISS answer (docs/client.md §4.2) and return what it lists."""
    missing = payload.get("missing_blobs")
    if parts:
        raise ProtocolError("a CACHE_MISS response must not carry binary parts")
    if (not isinstance(missing, list) or not missing
            or not all(isinstance(h, str) and _SHA256_HEX.fullmatch(h) for h in missing)
            or len(set(missing)) != len(missing)):
        raise ProtocolError("CACHE_MISS missing_blobs must be a non-empty list of distinct sha256 hashes")
    if any(h not in blobs for h in missing):
        raise ProtocolError("server misses blobs with no local bytes to send")
    return set(missing)


def _is_real(value: object) -> TypeGuard[float]:  # an int or a float, not a bool
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _execution_seconds(timeout_seconds: object) -> float:
    """How long the server may execute the request: its timeout_seconds, or the server's default
    when it sets none (or sets one the server will refuse at once)."""
    if _is_real(timeout_seconds) and timeout_seconds > 0:
        return float(min(timeout_seconds, _LONGEST_SOCKET_WAIT_SECONDS))
    return _DEFAULT_EXECUTION_SECONDS


def _http_error(response: _Response) -> KCoralError:
    """A KCoralError from a non-200 response's body, whatever shape it has (docs/client.md §4.6)."""
    try:
        body = _strict_json(response.body)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    error = body.get("error")
    if isinstance(error, dict):
        message, kind = str(error.get("message", "server error")), error.get("kind")
    else:
        message, kind = (str(error) if error else f"HTTP {response.status}"), None
    return KCoralError(response.status, message, kind=kind, request_id=body.get("request_id"),
                       details=_error_details(body, error if isinstance(error, dict) else {}))


# What an ERROR body may add (our server's 504, docs/protocol.md §9.8): field -> (where, accepted types).
_ERROR_DETAILS = {"instruction_index": ("error", int), "instruction_op": ("error", str),
                  "instruction_id": ("error", str), "stdout": ("body", str), "stderr": ("body", str),
                  "stdout_truncated": ("body", bool), "stderr_truncated": ("body", bool)}


def _error_details(body: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """The extra fields of an ERROR body that have the right type; anything else is ignored, as
    a published client ignores them all."""
    details = {}
    for name, (where, kind) in _ERROR_DETAILS.items():
        value = (error if where == "error" else body).get(name)
        if type(value) is kind:
            details[name] = value
    return {**details, **_truncation_details(body)}


# ---------------------------------------------------------------------------
# Remote functions (docs/client.md §7)

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

# The entry point uploaded next to the user's function (docs/client.md §7.3). The function is
# bound as a default at definition time, so no parameter name can shadow it.
_INVOKER = '''
def {invoker}(nargs, names, literals, *values, _function={name}):
    values = [value["value"] if literal else value for value, literal in zip(values, literals)]
    return _function(*values[:nargs], **dict(zip(names, values[nargs:])))
'''


class RemoteFunction(Generic[P, R]):
    """A plain function that can also run on the server. Calling it runs it locally;
    ``remote``/``execute`` upload its source and arguments and run it there."""

    def __init__(self, fn: Callable[P, R], *, client: Client, timeout: float | None = None,
                 output_limit_bytes: int | None = None, cpu_only: bool = False) -> None:
        self._source, self._entry_point = _capture_source(fn)
        if not isinstance(cpu_only, bool):
            raise TypeError("cpu_only must be a bool")
        functools.update_wrapper(self, fn)
        self._signature = inspect.signature(fn)
        self._client = client
        self._timeout = timeout
        self._output_limit_bytes = output_limit_bytes
        self._cpu_only = cpu_only

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]

    def build_program(self, *args: P.args, **kwargs: P.kwargs) -> Program:
        """The program that calls the function with these arguments (docs/client.md §7.4)."""
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = (*bound.args, *bound.kwargs.values())
        program = Program()
        module = program.upload(id="module", kind="module", source=self._source)
        function = program.get_function(id="function", module=module, name=self._entry_point, cpu_only=self._cpu_only)
        encoded: list[Any] = []
        for index, value in enumerate(values):
            if isinstance(value, (bytes, bytearray, memoryview)):
                encoded.append(program.upload(id=f"arg_{index}", kind="bytes", value=value))
            elif isinstance(value, np.ndarray) or hasattr(value, "__dlpack__"):
                encoded.append(program.upload(id=f"arg_{index}", kind="tensor", value=value))
            else:
                # Wrapped, so that a user dict shaped like {"$ref": ...} stays a literal.
                encoded.append({"value": _json_literal(value)})
        literals = [not isinstance(value, Register) for value in encoded]
        output = program.run(id="output", fn=function, args=[len(bound.args), list(bound.kwargs), literals, *encoded])
        program.return_(key="output", value=output)
        return program

    def execute(self, *args: P.args, **kwargs: P.kwargs) -> ProgramResult:
        """Run remotely and return the full ProgramResult (COMPLETED or FAILED)."""
        return self._client.execute(self.build_program(*args, **kwargs), timeout_seconds=self._timeout,
                                    output_limit_bytes=self._output_limit_bytes)

    def remote(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """Run remotely and return the decoded return value; RemoteExecutionError if it failed."""
        result = self.execute(*args, **kwargs)
        if not result.completed:
            raise RemoteExecutionError(result)
        if "output" not in result.results:
            raise ProtocolError("the remote function's result has no 'output'")
        return result.results["output"]


def _capture_source(fn: Any) -> tuple[str, str]:
    """(module source, entry point name) for a remote function, per docs/client.md §7.2."""
    if (not inspect.isfunction(fn) or inspect.iscoroutinefunction(fn)
            or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)):
        raise TypeError(f"a remote function must be a plain def function, not {type(fn).__name__}")
    if fn.__closure__:
        raise ValueError(f"remote function {fn.__qualname__} cannot capture variables of an "
                         "enclosing function; pass them as arguments")
    if hasattr(fn, "__wrapped__"):
        raise ValueError(f"remote function {fn.__qualname__} is wrapped by another decorator")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise ValueError(f"cannot read the source of remote function {fn.__qualname__} "
                         f"(define it with def in a file): {exc}") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        raise ValueError(f"the source of remote function {fn.__qualname__} is not a single def statement")
    node = tree.body[0]
    if len(node.decorator_list) > 1:
        raise ValueError(f"remote function {fn.__qualname__} cannot have other decorators")
    _strip_local_only_syntax(node)
    source = "from __future__ import annotations\n\n" + ast.unparse(node) + "\n"
    _check_free_names(fn, source, node.name)
    entry_point = f"_kcoral_invoke_{node.name}"
    return source + _INVOKER.format(invoker=entry_point, name=node.name), entry_point


def _strip_local_only_syntax(node: ast.FunctionDef) -> None:
    """Remove what is evaluated in the caller's module: decorators, defaults (they are
    bound locally and sent as arguments) and annotations."""
    node.decorator_list = []
    node.returns = None
    arguments = node.args
    arguments.defaults = []
    arguments.kw_defaults = [None] * len(arguments.kwonlyargs)
    for arg in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg):
        if arg is not None:
            arg.annotation = None


def _check_free_names(fn: Any, source: str, name: str) -> None:
    """Reject names that would resolve to the caller's module globals: on the server the
    module is empty, so only builtins (and the function itself) exist there."""
    module_table = symtable.symtable(source, "<remote function>", "exec")
    pending = [t for t in module_table.get_children() if t.get_name() == name]
    rejected = set()
    while pending:
        table = pending.pop()
        pending.extend(table.get_children())
        for symbol in table.get_symbols():
            symbol_name = symbol.get_name()
            builtin = getattr(builtins, symbol_name, None)
            unshadowed_builtin = hasattr(builtins, symbol_name) and fn.__globals__.get(symbol_name, builtin) is builtin
            free = symbol.is_global() and symbol.is_referenced() and symbol_name != name and not unshadowed_builtin
            if symbol.is_declared_global() or free:
                rejected.add(symbol_name)
    if rejected:
        raise ValueError(f"remote function references external globals: {', '.join(sorted(rejected))}; "
                         "import dependencies inside the function and pass values as arguments")


def _json_literal(value: Any) -> Any:
    """A JSON round trip of a literal argument, after checking it holds only JSON types."""
    _check_literal(value, set())
    return json.loads(json.dumps(value, allow_nan=False))


def _check_literal(value: Any, containers: set[int]) -> None:
    if value is None or type(value) in (bool, int, float, str):
        return
    if type(value) not in (list, dict):
        raise TypeError(f"remote function arguments must be JSON values, bytes or arrays; "
                        f"got {type(value).__name__} (binary values must be whole arguments)")
    if id(value) in containers:
        raise ValueError("remote function argument contains itself")
    containers.add(id(value))
    if type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(f"remote function argument has a non-string dict key {key!r}")
            _check_literal(item, containers)
    else:
        for item in value:
            _check_literal(item, containers)
    containers.discard(id(value))


# ---------------------------------------------------------------------------
# Command line: `kcoral run TOOL [options] -- ARGS...` (the published 0.1.1 command line)
#
# The inputs travel as ordinary `file` uploads under inputs/, one blob per file, so the
# client's blob cache applies file by file: a second run of the same inputs uploads only
# what changed. One small module runs on the worker: it restores exec bits, starts the tool
# as a child of the worker (same process group, so the server's timeout also ends it; fd 1
# and 2 shared, so its output is the request's captured output) and copies the requested
# artifacts into outputs/, which comes back as a folder.

_PROCESS_LIMIT_NOTE = "kcoral: the request's processes and threads reached its process limit"
_RUNNER_SOURCE = '''
import os, resource, shutil, subprocess, sys, threading
from pathlib import Path

SANDBOX_ROOT = "/kcoral"  # a sandboxed request's tmpfs (docs/sandbox.md): where its limits are its own


def _command(tool, arguments, reports):
    if tool == "python":
        return [sys.executable, *arguments]
    if tool == "shell":
        return list(arguments)
    if tool == "compute-sanitizer":
        return ["compute-sanitizer", *arguments]
    cut = arguments.index("--")
    options, application = arguments[:cut], arguments[cut + 1:]
    if tool == "ncu":
        return ["ncu", "--config-file", "0", "--export", str(reports / "capture.ncu-rep"), *options, *application]
    return ["run-iket", *options, "--", *application]  # run-iket writes under KCORAL_OUTPUT_DIR


def _executable(name, workdir, path):
    if "/" in name:
        candidate = Path(name) if os.path.isabs(name) else workdir / name
        return str(candidate) if os.access(candidate, os.X_OK) and candidate.is_file() else None
    return shutil.which(name, path=path)


def _collect(workdir, reports, paths):
    missing = []
    for name in paths:
        source = workdir / name
        for depth in range(1, len(Path(name).parts) + 1):
            if (workdir / Path(*Path(name).parts[:depth])).is_symlink():
                raise ValueError(f"--fetch {name}: a symbolic link cannot be fetched")
        if not source.exists():
            missing.append(name)
        elif source.is_dir():
            shutil.copytree(source, reports / name, symlinks=True, dirs_exist_ok=True)
        else:
            (reports / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, reports / name)
    return missing


def _tasks():
    count = 0
    for pid in os.listdir("/proc"):
        try:
            count += len(os.listdir(f"/proc/{pid}/task")) if pid.isdigit() else 0
        except OSError:  # it ended meanwhile
            pass
    return count


def _watch_process_limit(stopped):
    # In a sandbox /proc shows the request's own PID namespace, whose tasks RLIMIT_NPROC counts.
    # Said as it happens: a tool stuck at the limit is often ended by the timeout, not by itself.
    limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if limit == resource.RLIM_INFINITY or not os.getcwd().startswith(SANDBOX_ROOT):
        return
    while not stopped.wait(0.2):
        if _tasks() + max(4, limit // 50) >= limit:
            print("@PROCESS_LIMIT_NOTE@ (--process-limit): new ones fail with EAGAIN", file=sys.stderr, flush=True)
            return


def _full_workspace(workdir):
    # The words of the program path's hint (kcoral_worker.limit_hint) for a tool that failed.
    if not str(workdir).startswith(SANDBOX_ROOT):
        return None
    space = os.statvfs(workdir)
    if space.f_files and not space.f_ffree:
        return f"the request's file limit, {space.f_files} files and directories, is reached: --file-limit"
    if space.f_bavail * space.f_frsize < 1 << 16:
        return (f"the request's disk limit, {space.f_blocks * space.f_frsize} bytes in its workspace, /tmp "
                "and /dev/shm together, is reached: --disk-limit-bytes")
    return None


def _oom_kills():
    try:
        with open("/proc/vmstat") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), 0)
    except OSError:
        return 0


def run(tool, arguments, overrides, executables, directories, fetch, expected):
    workdir = Path("inputs").absolute()
    reports = Path("outputs").absolute()
    for directory in ["", *directories]:
        (workdir / directory).mkdir(parents=True, exist_ok=True)
    reports.mkdir()
    for name in executables:
        (workdir / name).chmod(0o700)
    env = {**os.environ, **overrides, "KCORAL_DIR": str(workdir), "KCORAL_OUTPUT_DIR": str(reports)}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")  # a Python tool's prints reach the (streamed) output as they happen
    if tool == "ncu":
        env.setdefault("NCU_PROFILE", "1")
    command = _command(tool, arguments, reports)
    program = _executable(command[0], workdir, env["PATH"])
    if program is None:
        return {"returncode": None, "absent": command[0], "missing": []}
    stopped, oom_kills = threading.Event(), _oom_kills()
    watch = threading.Thread(target=_watch_process_limit, args=(stopped,), daemon=True)
    watch.start()  # before the tool: at the limit, no thread can start
    try:
        code = subprocess.run([program, *command[1:]], cwd=workdir, env=env, stdin=subprocess.DEVNULL).returncode
    finally:
        stopped.set()
    missing = [name for name in expected if not (reports / name).exists()]
    return {"returncode": code, "absent": None, "missing": missing + _collect(workdir, reports, fetch),
            "limit": _full_workspace(workdir) if code else None,
            "oom_killed": code == -9 and _oom_kills() > oom_kills}
'''
_REMOTE_RUNNER = _RUNNER_SOURCE.replace("@PROCESS_LIMIT_NOTE@", _PROCESS_LIMIT_NOTE)

_TOOLS = {
    "python": "run a script, -c code or -m module with the server's Python",
    "shell": "run an executable (e.g. a --send script) in the uploaded directory",
    "ncu": "profile an application with NVIDIA Nsight Compute; the report is saved in --out",
    "compute-sanitizer": "check an application with NVIDIA Compute Sanitizer",
    "run-iket": "profile an application with run-iket; its reports are saved in --out",
}
_PROFILERS = {"ncu": ("capture.ncu-rep",), "run-iket": ()}  # tool -> reports it must produce
_NCU_MANAGED = ("--export", "-o", "--import", "-i", "--mode", "--config-file", "--config-file-path")
_DEFAULT_OUTPUT_LIMIT = 256 * 1024 * 1024
_PROGRESS_BYTES = 16 * 1024 * 1024
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _CommandError(Exception):
    """A problem reported as one line and exit status 1 (not a usage error)."""


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The --send trees, read into memory: workspace-relative path -> bytes."""

    files: dict[str, bytes]
    executables: list[str]
    directories: list[str]


def run_command(argv: list[str], prog: str = "kcoral run") -> int:
    """`kcoral run ...`: the exit status of the remote process, 1 on any other failure;
    usage errors leave through argparse (SystemExit 2). ``prog``: how the usage lines name the command."""
    parser = _run_parser(prog)
    separated = "--" in argv  # the first '--' is ours; a later one is the tool's (a profiler's own, say)
    cut = argv.index("--") if separated else len(argv)
    args, extra = parser.parse_known_args(argv[:cut])
    tool_args = argv[cut + 1:]
    tool_parser = args.tool_parser
    unknown = [token for token in extra if token.startswith("-")]
    if unknown:
        tool_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra or not separated:
        tool_parser.error("separate KCoral options from tool arguments with '--'")
    if not tool_args:
        tool_parser.error("arguments are required after '--'")
    _check_usage(tool_parser, args, tool_args)
    try:
        return _run_remote(args, tool_args)
    except _CommandError as exc:
        _complain(f"kcoral run {args.tool}: {exc}")
    except TransportError as exc:
        _complain(f"kcoral run {args.tool}: cannot reach {args.url}: {exc}")
    except ProtocolError as exc:
        _complain(f"kcoral run {args.tool}: protocol error: {exc}")
    except KCoralError as exc:
        _complain(f"kcoral run {args.tool}: server error: {exc}")
    except KeyboardInterrupt:
        print(f"kcoral run {args.tool}: interrupted", file=sys.stderr)
        return 130
    return 1


def _complain(line: str) -> None:
    """One line on stderr; it may quote the server (error messages, remote names)."""
    print(_for_terminal(sys.stderr, line), file=sys.stderr)


def _run_parser(prog: str) -> Any:
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description="Run a tool on a remote KCoral server.")
    tools = parser.add_subparsers(dest="tool", required=True, metavar="TOOL")
    for tool, summary in _TOOLS.items():
        sub = tools.add_parser(tool, help=summary, description=f"Run {tool} on a KCoral worker: {summary}.",
                               usage=f"{prog} {tool} [options] -- ARGS...")
        sub.set_defaults(tool_parser=sub)
        sub.add_argument("--url", help="server URL; default: KCORAL_URL; cannot combine with --host or --port")
        sub.add_argument("--host", help="server hostname or IP; overrides KCORAL_URL (default with --port: 127.0.0.1)")
        sub.add_argument("--port", type=int, help="server port; overrides KCORAL_URL (default with --host: 8000)")
        sub.add_argument("--token", help="bearer token for a server started with --token; default: KCORAL_TOKEN")
        sub.add_argument("--timeout", type=float, default=300.0,
                         help="execution timeout in seconds (default: 300; server caps apply)")
        sub.add_argument("--output-limit-bytes", type=int, default=_DEFAULT_OUTPUT_LIMIT,
                         help=f"capture limit per stream in bytes (default: {_DEFAULT_OUTPUT_LIMIT}; "
                              "server caps apply)")
        sub.add_argument("--send", action="append", default=[], metavar="PATH",
                         help="upload a file or directory under its own name (exec bits kept); repeatable")
        sub.add_argument("-e", "--env", action="append", default=[], metavar="NAME[=VALUE]",
                         help="set a remote environment variable; NAME alone copies its local value")
        sub.add_argument("--out", required=tool in _PROFILERS, metavar="DIR",
                         help="new local directory for returned artifacts (must not exist)")
        if tool not in _PROFILERS:
            sub.add_argument("--fetch", action="append", default=[], metavar="PATH",
                             help="workspace file or directory to save in --out; repeatable")
    return parser


def _check_usage(parser: Any, args: Any, tool_args: list[str]) -> None:
    """Every check that needs neither the file system nor the server; also settles
    args.url, args.env (a dict) and args.fetch."""
    args.fetch = getattr(args, "fetch", [])
    args.url = _server_url(parser, args)
    args.token = args.token or os.environ.get("KCORAL_TOKEN") or None
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.output_limit_bytes <= 0:
        parser.error("--output-limit-bytes must be positive")
    if args.tool not in _PROFILERS and bool(args.fetch) != bool(args.out):
        parser.error("--fetch and --out must be used together")
    for path in args.fetch:
        try:
            _normalize_path(path)
        except (ValueError, TypeError):
            parser.error(f"--fetch {path!r}: expected a relative path inside the remote workspace")
    args.env = _environment(parser, args.env)
    if args.tool == "python":
        _check_python_args(parser, tool_args)
    elif args.tool in _PROFILERS:
        _check_profiler_args(parser, args.tool, tool_args)


def _server_url(parser: Any, args: Any) -> str:
    if args.url and (args.host or args.port):
        parser.error("--url cannot be combined with --host or --port")
    if args.host or args.port:
        if os.environ.get("KCORAL_URL"):
            print("kcoral: warning: --host/--port override KCORAL_URL", file=sys.stderr)
        host = args.host or "127.0.0.1"
        return f"http://[{host}]:{args.port or 8000}" if ":" in host else f"http://{host}:{args.port or 8000}"
    url: str = args.url or os.environ.get("KCORAL_URL", "")
    if not url:
        parser.error("set KCORAL_URL or pass --url, --host or --port")
    split = urllib.parse.urlsplit(url)
    if split.scheme not in ("http", "https") or not split.hostname:
        parser.error(f"server URL must start with http:// or https:// and name a host: {url!r}")
    return url


def _environment(parser: Any, entries: list[str]) -> dict[str, str]:
    env = {}
    for entry in entries:
        name, has_value, value = entry.partition("=")
        if not _ENV_NAME.fullmatch(name):
            parser.error(f"environment variable names must be identifiers: {entry!r}")
        if name == "CUDA_VISIBLE_DEVICES":
            parser.error("CUDA_VISIBLE_DEVICES is managed by the server")
        if not has_value and name not in os.environ:
            parser.error(f"local environment variable {name} is not set")
        env[name] = value if has_value else os.environ[name]
    return env


def _check_python_args(parser: Any, tool_args: list[str]) -> None:
    """The server's Python has no stdin and no terminal: a script, -c or -m is required."""
    remaining = iter(tool_args)
    for token in remaining:
        if token == "--":
            token = next(remaining, "-")
            if token != "-":
                return  # after Python's own '--' comes the script, whatever its name
        if token == "-":
            break
        if not token.startswith("-"):
            return  # the script
        if token == "--check-hash-based-pycs":
            next(remaining, None)
        if token.startswith("--"):
            continue
        for index, letter in enumerate(token[1:], start=1):
            if letter == "i":
                parser.error("interactive Python is unsupported (there is no remote terminal)")
            if letter in "cmWX":
                if not token[index + 1:] and next(remaining, None) is None:
                    parser.error(f"Python -{letter} requires an argument")
                if letter in "cm":
                    return
                break
    parser.error("a script, -c command or -m module is required; stdin execution is unsupported")


def _check_profiler_args(parser: Any, tool: str, tool_args: list[str]) -> None:
    if "--" not in tool_args:
        parser.error("separate profiler options from the application with another '--'")
    cut = tool_args.index("--")
    if cut + 1 == len(tool_args):
        parser.error("an application is required after the second '--'")
    if tool == "ncu":
        for option in tool_args[:cut]:
            if option.split("=", 1)[0] in _NCU_MANAGED:
                parser.error(f"{option.split('=', 1)[0]} conflicts with the report kcoral manages in --out")


def _run_remote(args: Any, tool_args: list[str]) -> int:
    out = pathlib.Path(args.out) if args.out else None
    if out is not None and (out.exists() or out.is_symlink()):
        raise _CommandError(f"--out {args.out} already exists; choose a new directory")
    inputs = _read_inputs(args.send)
    try:
        program = _tool_program(args, tool_args, inputs, want_outputs=out is not None)
    except ValidationError as exc:  # a file name the protocol cannot carry (a backslash, say)
        raise _CommandError(f"--send: {exc}") from None
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else None
    output = _LiveOutput()
    with _ProgressClient(args.url, headers=headers) as client:
        try:
            result = client.execute(program, timeout_seconds=args.timeout, output_limit_bytes=args.output_limit_bytes,
                                    on_output=output.show)
        except KCoralError as exc:  # a timeout keeps what the tool printed until it was killed
            output.finish(exc)
            if exc.kind == "timeout":
                _complain(f"kcoral run {args.tool}: {_timeout_message(args, exc)}")
                return _TIMED_OUT
            raise
    output.finish(result)
    if not result.completed:
        return _explain_failure(args, result.error or {})
    outcome = result["outcome"]
    if outcome["absent"]:
        raise _CommandError(f"{outcome['absent']} is not installed on the server (or is not executable there)")
    artifacts = result["artifacts"] if out is not None else None
    if artifacts is not None and (artifacts.files or artifacts.directories):  # nothing fetched: no empty --out
        try:
            artifacts.save(out)
        except OSError as exc:
            raise _CommandError(f"cannot save the artifacts in {out}: {exc.strerror or exc}") from None
        print(f"kcoral: saved artifacts to {out}", file=sys.stderr)
    for name in outcome["missing"]:
        what = f"--fetch {name}" if name in args.fetch else f"the {args.tool} report {name}"
        _complain(f"kcoral run {args.tool}: {what}: no such file or directory in the remote working directory")
    code = outcome["returncode"]
    if outcome.get("limit"):
        _complain(f"kcoral run {args.tool}: {outcome['limit']}")
    if code < 0:  # killed by signal N: said, and the shell's 128+N
        oom = "; by the kernel's OOM killer: the server ran out of memory" if outcome.get("oom_killed") else ""
        _complain(f"kcoral run {args.tool}: {args.tool} was killed by {_signal_words(-code)}{oom}")
        return 128 - code
    return 1 if code == 0 and outcome["missing"] else code


_TIMED_OUT = 124  # as timeout(1)
_STOPPED_FOR_MEMORY = 128 + 9  # the server SIGKILLs a request over its memory limit


def _signal_words(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    return f"signal {number} ({name}, {signal.strsignal(number) or 'unknown'})"


def _explain_failure(args: Any, error: dict[str, Any]) -> int:
    """A FAILED program, in one line: the runner itself failed, or the server stopped the request (its
    memory limit, the OOM killer, a crash) -> the exit status."""
    message = (str(error.get("message") or "").strip().splitlines() or ["the program failed"])[0]
    _complain(f"kcoral run {args.tool}: {error.get('kind', 'error')}: {message}")
    stopped = "--memory-limit-bytes" in message or "OOM killer" in message
    return _STOPPED_FOR_MEMORY if stopped else 1


def _timeout_message(args: Any, exc: KCoralError) -> str:
    """A 504 in the words of the command line: the tool and --timeout, not the program's instructions;
    and the process limit, when the tool was stuck at it."""
    if exc.instruction_op == "run" and "teardown" not in exc.message:
        stuck = ("; it was at its process limit, where new processes fail with EAGAIN: --process-limit"
                 if _PROCESS_LIMIT_NOTE in exc.stderr + exc.stderr_tail else "")
        return (f"{args.tool} timed out: still running after --timeout {args.timeout:g} s{stuck} "
                "(its output so far is above)")
    return f"timed out after --timeout {args.timeout:g} s, outside {args.tool} itself ({exc.message})"


def _tool_program(args: Any, tool_args: list[str], inputs: _Inputs, *, want_outputs: bool) -> Program:
    program = Program()
    for path, data in inputs.files.items():
        program.upload_file(blob=data, path=f"inputs/{path}")
    runner = program.get_function(module=program.upload(kind="module", source=_REMOTE_RUNNER), name="run")
    outcome = program.run(fn=runner, args=[args.tool, tool_args, args.env, inputs.executables,
                                           inputs.directories, args.fetch, list(_PROFILERS.get(args.tool, ()))])
    program.return_(key="outcome", value=outcome)
    if want_outputs:
        program.return_folder(key="artifacts", path="outputs")
    return program


def _read_inputs(paths: list[str]) -> _Inputs:
    """Read every --send path. Each keeps its own name (its last component); symlinks and
    special files are refused rather than silently followed or skipped."""
    inputs = _Inputs({}, [], [])
    names: set[str] = set()
    for path in paths:
        name = os.path.basename(os.path.normpath(path))
        if name in ("", ".", "..", "/"):
            raise _CommandError(f"--send {path}: cannot tell which name to upload it under")
        if name in names:
            raise _CommandError(f"--send {path}: another input is already named {name!r}")
        names.add(name)
        _read_entry(path, None, path, name, inputs)
    return inputs


def _read_entry(name: str, dir_fd: int | None, local: str, remote: str, inputs: _Inputs) -> None:
    """Read ``name`` (relative to ``dir_fd`` below the top level) into ``inputs``. What is read
    is what was opened: never a link (O_NOFOLLOW, directories walked by descriptor), never a
    FIFO, device or socket (judged by fstat of the open descriptor; O_NONBLOCK so that a FIFO
    swapped in cannot hang the open). The lstat first only spares opening what it already refuses."""
    try:
        _refuse_unless_file_or_directory(os.lstat(name, dir_fd=dir_fd), local)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the final component became a link after the lstat
            raise _CommandError(f"--send: {local} is a symbolic link; send its target instead") from None
        raise _CommandError(f"--send {local}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        _refuse_unless_file_or_directory(info, local)
        if stat.S_ISDIR(info.st_mode):
            inputs.directories.append(remote)
            for entry in sorted(os.listdir(fd)):
                _read_entry(entry, fd, os.path.join(local, entry), f"{remote}/{entry}", inputs)
            return
        with open(fd, "rb", closefd=False) as f:
            inputs.files[remote] = f.read()
        if info.st_mode & 0o111:
            inputs.executables.append(remote)
    except OSError as exc:
        raise _CommandError(f"--send {local}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _refuse_unless_file_or_directory(info: os.stat_result, local: str) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise _CommandError(f"--send: {local} is a symbolic link; send its target instead")
    if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
        raise _CommandError(f"--send: {local} is not a regular file or directory")


# C0 controls but newline and tab, DEL, and the C1 controls (U+0080-U+009F; U+009B alone starts
# a control sequence on many terminals): what a terminal would act on rather than print.
_TERMINAL_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _for_terminal(stream: Any, text: str) -> str:
    """Remote text as it may be written to ``stream``: on a terminal, its control characters
    become visible escapes (\\x1b), so a server cannot move the cursor, retitle the window or
    fake local output; anywhere else (a pipe, a file) exactly as received."""
    if not stream.isatty():
        return text
    return _TERMINAL_CONTROLS.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


class _LiveOutput:
    """The remote output on the local stdout/stderr: each chunk as our server streams it (docs/protocol.md
    §13), then what the answer holds beyond what was shown (all of it, from a server that does not
    stream). The streamed bytes are the answer's, so the text decoded from them is a prefix of its text."""

    def __init__(self) -> None:
        self.decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")}
        self.shown = {"stdout": 0, "stderr": 0}  # characters written

    def show(self, name: str, data: bytes) -> None:
        self.write(name, self.decoders[name].decode(data))

    def write(self, name: str, text: str) -> None:
        stream = sys.stdout if name == "stdout" else sys.stderr
        stream.write(_for_terminal(stream, text))
        stream.flush()
        self.shown[name] += len(text)

    def finish(self, answer: ProgramResult | KCoralError) -> None:
        """What the answer holds beyond what was shown; of output cut at the limit, its end after a
        marker line, and a sentence saying what was cut (from a server that says)."""
        for name in ("stdout", "stderr"):
            self.write(name, getattr(answer, name)[self.shown[name]:])
            tail = getattr(answer, f"{name}_tail")
            if tail:
                self.write(name, f"\n[kcoral: {name} cut here; its last {len(tail.encode())} bytes follow]\n{tail}")
        if answer.truncation:
            print(f"kcoral: {answer.truncation}", file=sys.stderr)
        elif answer.stdout_truncated or answer.stderr_truncated:
            print("kcoral: remote output was truncated (see --output-limit-bytes)", file=sys.stderr)


class _ProgressClient(Client):
    """A Client that says on a terminal's stderr when it actually sends a large upload
    (blobs the server already holds are never sent, so a cached rerun prints nothing)."""

    def _post_execute(self, program_json: bytes, blobs: list[tuple[str, bytes]], *rest: Any, **kw: Any) -> _Response:
        size = sum(len(data) for _, data in blobs)
        if size <= _PROGRESS_BYTES or not sys.stderr.isatty():
            return super()._post_execute(program_json, blobs, *rest, **kw)
        print(f"kcoral: uploading {len(blobs)} blobs, {size / 2**20:.1f} MiB ...", end="", file=sys.stderr, flush=True)
        try:
            response = super()._post_execute(program_json, blobs, *rest, **kw)
        except BaseException:
            print(" failed", file=sys.stderr)
            raise
        print(" sent", file=sys.stderr)
        return response


_VENDORED_HELP = """\
usage: python client.py run TOOL [options] -- ARGS...
       python client.py --help

The KCoral client in one file: stdlib and NumPy only (ml_dtypes to decode bfloat16 and float8).

As a library (docs/client.md), under the name it has in your project:
    from client import Client, Program    # this file, copied into your project as client.py
    from kcoral import Client, Program    # the same client, from the installed kcoral package

As a command, `python client.py run` is `kcoral run` (docs/cli.md): it sends local files to a
KCoral server (KCORAL_URL, or --url), runs a tool there and prints its output here, e.g.
    python client.py run python --send bench.py -- bench.py --size 4096
`python client.py run TOOL --help` lists a tool's options. For the docs' `kcoral run ...` lines
as written, in the directory that holds this file:
    alias kcoral="python $PWD/client.py"

"""


def main(argv: list[str]) -> int:
    """A vendored copy's command line: `python client.py run ...` is `kcoral run ...`."""
    if argv[:1] == ["run"]:
        return run_command(argv[1:], "python client.py run")
    asked = argv[:1] in (["-h"], ["--help"])
    print(_VENDORED_HELP + _run_parser("python client.py run").format_help(), end="",
          file=sys.stdout if asked else sys.stderr)
    return 0 if asked else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
