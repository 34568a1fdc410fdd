"""NCCL through ctypes, no torch: the GPU collectives of a tensor-parallel plan (issue 44).

Why ctypes over the `nvidia-nccl-cu12`/`-cu13` wheel's libnccl.so.2 rather than nccl4py: it is
what vLLM runs in production (vllm/distributed/device_communicators/pynccl_wrapper.py,
NCCLLibrary: a pure-Python wrapper, so every call made while a CUDA graph captures is ours to
see, and any libnccl can be swapped in by path), it needs only the wheel that carries the
library (nccl4py, 0.6 on PyPI when this was written, is a pre-1.0 binding layer more between
kiln and the same library), and the entry points kiln calls are plain C functions of stable
signatures (nccl.h). Read from vLLM, written anew.

Finding the library (find_nccl_library), first hit wins:
  1. $KILN_NCCL_LIBRARY, then $NCCL_LIBRARY: a path to libnccl.so.2 (vLLM's VLLM_NCCL_SO_PATH);
  2. the nvidia-nccl-cu13 / -cu12 wheel: nvidia/nccl/lib/libnccl.so.2 (both wheels lay it out
     so), found with importlib without importing anything;
  3. the dynamic loader's search path: libnccl.so.2 (a system install, LD_LIBRARY_PATH).
None: NcclNotFoundError, one sentence saying what to install.

The library loads and ncclGetUniqueId works on a machine without a GPU (it only opens the
bootstrap socket), so the discovery, the error strings and the id exchange are tested on CPU;
ncclCommInitRank and the collectives need the GPUs.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

LIBRARY_ENV = ("KILN_NCCL_LIBRARY", "NCCL_LIBRARY")
SONAME = "libnccl.so.2"
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES

# ncclDataType_t (nccl.h): values, by kiln's dtype names (graph/dtype.py's str of a DType)
DATA_TYPES = {"i8": 0, "u8": 1, "i32": 2, "u32": 3, "i64": 4, "u64": 5, "f16": 6, "f32": 7, "f64": 8,
              "bf16": 9}
_NUMPY_NAMES = {"int8": "i8", "uint8": "u8", "int32": "i32", "uint32": "u32", "int64": "i64", "uint64": "u64",
                "float16": "f16", "float32": "f32", "float64": "f64", "bfloat16": "bf16"}
# ncclRedOp_t
RED_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
# ncclResult_t, for messages when ncclGetErrorString is not at hand
RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
           4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
           8: "ncclTimeout"}


class NcclError(KilnError, RuntimeError):
    """An NCCL call failed (its error string), or NCCL cannot be used here."""


class NcclNotFoundError(NcclError):
    """No libnccl.so.2 to load: one sentence saying how to get one."""


def nccl_dtype(name) -> int:
    """kiln's dtype name ('bf16', 'f32', ...) or a numpy dtype / its name -> ncclDataType_t."""
    key = _NUMPY_NAMES.get(name, name) if isinstance(name, str) else str(name)
    if key not in DATA_TYPES:
        try:
            key = _NUMPY_NAMES.get(np.dtype(name).name, key)
        except TypeError:
            pass
    if key not in DATA_TYPES:
        raise NcclError(f"NCCL has no data type for {name!r} (it takes {', '.join(DATA_TYPES)})")
    return DATA_TYPES[key]


def nccl_op(name: str) -> int:
    if name not in RED_OPS:
        raise NcclError(f"NCCL has no reduction {name!r} (it takes {', '.join(RED_OPS)})")
    return RED_OPS[name]


def _wheel_library() -> Path | None:
    """libnccl.so.2 of an installed nvidia-nccl-cu13/-cu12 wheel (nvidia/nccl/lib/)."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "lib" / SONAME
        if p.is_file():
            return p
    return None


def find_nccl_library(environ=None) -> str:
    """The path (or soname) of the libnccl to load; NcclNotFoundError when there is none."""
    environ = os.environ if environ is None else environ
    for var in LIBRARY_ENV:
        path = environ.get(var)
        if path:
            if not Path(path).is_file():
                raise NcclNotFoundError(f"{var}={path} is not a file: point it at libnccl.so.2")
            return path
    wheel = _wheel_library()
    if wheel is not None:
        return str(wheel)
    found = ctypes.util.find_library("nccl")
    if found:
        return found
    raise NcclNotFoundError("tensor parallelism on the GPU needs NCCL, and no libnccl.so.2 was found: "
                            "pip install nvidia-nccl-cu13 (or -cu12, as the driver allows), "
                            "or set KILN_NCCL_LIBRARY to its path")


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


_c_comm = ctypes.c_void_p
_c_stream = ctypes.c_void_p
# (name, restype, argtypes), nccl.h
_FUNCTIONS = (
    ("ncclGetErrorString", ctypes.c_char_p, [ctypes.c_int]),
    ("ncclGetVersion", ctypes.c_int, [ctypes.POINTER(ctypes.c_int)]),
    ("ncclGetUniqueId", ctypes.c_int, [ctypes.POINTER(UniqueId)]),
    ("ncclCommInitRank", ctypes.c_int, [ctypes.POINTER(_c_comm), ctypes.c_int, UniqueId, ctypes.c_int]),
    ("ncclAllReduce", ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                     _c_comm, _c_stream]),
    ("ncclAllGather", ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, _c_comm,
                                     _c_stream]),
    ("ncclCommDestroy", ctypes.c_int, [_c_comm]),
    ("ncclCommAbort", ctypes.c_int, [_c_comm]),
)


class NcclLibrary:
    """One loaded libnccl and its typed entry points (no module-level state: each holder loads
    its own handle; the dynamic loader shares the mapping)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or find_nccl_library()
        try:
            self.lib = ctypes.CDLL(self.path)
        except OSError as e:
            raise NcclNotFoundError(f"{self.path} could not be loaded as NCCL ({e})") from None
        self.fn = {}
        for name, res, args in _FUNCTIONS:
            f = getattr(self.lib, name)
            f.restype, f.argtypes = res, args
            self.fn[name] = f

    def error_string(self, result: int) -> str:
        s = self.fn["ncclGetErrorString"](result)
        return s.decode() if s else RESULTS.get(result, f"NCCL result {result}")

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise NcclError(f"{what} failed: {self.error_string(result)}")

    def version(self) -> tuple[int, int, int]:
        """(major, minor, patch); NCCL >= 2.9 encodes it as major*10000 + minor*100 + patch."""
        v = ctypes.c_int()
        self.check(self.fn["ncclGetVersion"](ctypes.byref(v)), "ncclGetVersion")
        return v.value // 10000, v.value // 100 % 100, v.value % 100

    def unique_id(self) -> bytes:
        """A fresh communicator id (128 bytes). The calling process hosts the bootstrap root
        until the group has formed, so rank 0 makes it and the others get its bytes."""
        uid = UniqueId()
        self.check(self.fn["ncclGetUniqueId"](ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def comm_init_rank(self, world_size: int, unique_id: bytes, rank: int) -> int:
        """ncclCommInitRank on the device current on this thread (collective: every rank calls it)."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise NcclError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = UniqueId()
        ctypes.memmove(uid.internal, unique_id, UNIQUE_ID_BYTES)
        comm = _c_comm()
        self.check(self.fn["ncclCommInitRank"](ctypes.byref(comm), world_size, uid, rank),
                   f"ncclCommInitRank(rank {rank} of {world_size})")
        return comm.value

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int) -> None:
        self.check(self.fn["ncclAllReduce"](send, recv, count, dtype, op, comm, stream), "ncclAllReduce")

    def all_gather(self, send: int, recv: int, count: int, dtype: int, comm: int, stream: int) -> None:
        """recv: the ranks' `count` elements one after another in rank order."""
        self.check(self.fn["ncclAllGather"](send, recv, count, dtype, comm, stream), "ncclAllGather")

    def comm_destroy(self, comm: int) -> None:
        self.check(self.fn["ncclCommDestroy"](comm), "ncclCommDestroy")

    def comm_abort(self, comm: int) -> None:
        self.check(self.fn["ncclCommAbort"](comm), "ncclCommAbort")


@dataclass(frozen=True)
class NcclBootstrap:
    """What a tensor-parallel GPU worker needs to join its group: picklable, handed to its
    executor, which creates the communicator once its CUDA context is current."""
    unique_id: bytes
    world_size: int
    rank: int


def stream_handle(stream) -> int:
    """A cuda.bindings CUstream (or an int) -> the cudaStream_t value NCCL takes."""
    return int(stream) if stream is not None else 0


class NcclCommunicator:
    """One rank's communicator: made on the device current on this thread."""

    def __init__(self, boot: NcclBootstrap, lib: NcclLibrary | None = None) -> None:
        self.lib = lib or NcclLibrary()
        self.world_size, self.rank = boot.world_size, boot.rank
        self.comm = self.lib.comm_init_rank(boot.world_size, boot.unique_id, boot.rank)

    def all_reduce(self, send: int, recv: int, count: int, dtype, stream, op: str = "sum") -> None:
        self.lib.all_reduce(send, recv, count, nccl_dtype(dtype), nccl_op(op), self.comm, stream_handle(stream))

    def all_gather(self, send: int, recv: int, count: int, dtype, stream) -> None:
        self.lib.all_gather(send, recv, count, nccl_dtype(dtype), self.comm, stream_handle(stream))

    def close(self) -> None:
        """ncclCommDestroy waits for the peers' in-flight work; a group being torn down after a
        failure uses abort instead (the executor kills the processes anyway)."""
        if self.comm:
            comm, self.comm = self.comm, 0
            self.lib.comm_destroy(comm)
