"""The NCCL binding's CPU-testable parts (runtime/worker/nccl.py): where the library is looked
for and the one sentence when it is nowhere; the data type and reduction enums against nccl.h
itself (the header the nvidia-nccl wheel ships); and, where the wheel is installed (the `gpu`
extra), the library's own answers without a GPU: its version, its error strings, unique ids,
and rank 0's id reaching every worker through the multi-process executor's channel."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import pytest

from kiln.runtime.worker import nccl
from kiln.runtime.worker.nccl import (DATA_TYPES, RED_OPS, NcclError, NcclLibrary, NcclNotFoundError,
                                      find_nccl_library, nccl_dtype, nccl_op)


def _installed() -> Path | None:
    return nccl._wheel_library()


needs_wheel = pytest.mark.skipif(_installed() is None, reason="the nvidia-nccl wheel is not installed (gpu extra)")


def test_the_environment_variables_come_first_and_a_wrong_path_is_one_sentence(tmp_path):
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"")
    assert find_nccl_library({"KILN_NCCL_LIBRARY": str(lib), "NCCL_LIBRARY": "/elsewhere"}) == str(lib)
    assert find_nccl_library({"NCCL_LIBRARY": str(lib)}) == str(lib)
    with pytest.raises(NcclNotFoundError) as e:
        find_nccl_library({"NCCL_LIBRARY": str(tmp_path / "none.so")})
    assert str(e.value) == f"NCCL_LIBRARY={tmp_path / 'none.so'} is not a file: point it at libnccl.so.2"


def test_no_library_anywhere_is_one_sentence_saying_what_to_install(monkeypatch):
    monkeypatch.setattr(nccl, "_wheel_library", lambda: None)
    monkeypatch.setattr(nccl.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(NcclNotFoundError) as e:
        find_nccl_library({})
    msg = str(e.value)
    assert "\n" not in msg and "pip install nvidia-nccl-cu13" in msg and "KILN_NCCL_LIBRARY" in msg


def test_a_file_that_is_not_a_library_is_refused_by_name(tmp_path):
    bad = tmp_path / "libnccl.so.2"
    bad.write_bytes(b"not an ELF file")
    with pytest.raises(NcclNotFoundError, match=re.escape(f"{bad} could not be loaded as NCCL")):
        NcclLibrary(str(bad))


def test_dtype_and_op_names_map_to_nccl_values_and_others_are_refused():
    assert nccl_dtype("bf16") == nccl_dtype("bfloat16") == DATA_TYPES["bf16"]
    assert nccl_dtype(np.float32) == nccl_dtype("float32") == nccl_dtype("f32") == DATA_TYPES["f32"]
    assert nccl_dtype(np.dtype(np.int32)) == DATA_TYPES["i32"]
    assert nccl_op("sum") == RED_OPS["sum"]
    with pytest.raises(NcclError, match="NCCL has no data type for 'fp8e4nv'"):
        nccl_dtype("fp8e4nv")
    with pytest.raises(NcclError, match="NCCL has no reduction 'mean'"):
        nccl_op("mean")


@needs_wheel
def test_enums_are_nccl_h_s():
    """The values against the header the wheel ships next to the library."""
    header = (_installed().parent.parent / "include" / "nccl.h").read_text()
    enum = {m[0]: int(m[1]) for m in re.findall(r"\b(nccl[A-Za-z0-9]+)\s*=\s*(\d+)", header)}
    names = {"i8": "ncclInt8", "u8": "ncclUint8", "i32": "ncclInt32", "u32": "ncclUint32", "i64": "ncclInt64",
             "u64": "ncclUint64", "f16": "ncclFloat16", "f32": "ncclFloat32", "f64": "ncclFloat64",
             "bf16": "ncclBfloat16"}
    assert {k: enum[v] for k, v in names.items()} == DATA_TYPES
    assert {k: enum[f"nccl{k.capitalize()}"] for k in RED_OPS} == RED_OPS
    assert enum["ncclSuccess"] == 0 and enum["ncclInvalidUsage"] == 5
    assert re.search(r"#define NCCL_UNIQUE_ID_BYTES (\d+)", header)[1] == str(nccl.UNIQUE_ID_BYTES)


@needs_wheel
def test_the_library_answers_without_a_gpu():
    lib = NcclLibrary()
    assert lib.path == str(_installed())
    major, minor, _ = lib.version()
    assert (major, minor) >= (2, 18)
    assert lib.error_string(4).startswith("invalid argument") and lib.error_string(0).startswith("no error")
    a, b = lib.unique_id(), lib.unique_id()
    assert len(a) == len(b) == 128 and a != b
    with pytest.raises(NcclError, match="an NCCL unique id is 128 bytes, got 5"):
        lib.comm_init_rank(2, b"short", 0)
    with pytest.raises(NcclError, match="ncclAllReduce failed: invalid argument"):
        lib.all_reduce(0, 0, 1, DATA_TYPES["f32"], RED_OPS["sum"], 0, 0)  # a null communicator


class _IdWorker:
    """What a GPU rank's make_worker would get, written down where the test reads it."""

    def __init__(self, boot, out: Path) -> None:
        (out / f"rank{boot.rank}").write_bytes(bytes([boot.world_size]) + boot.unique_id)
        self.num_blocks, self.num_state_slots = 10 + boot.rank, 0

    def execute(self, inputs):
        return {}


def _make_id_worker(out: str, rank: int, boot):
    assert boot.rank == rank
    return _IdWorker(boot, Path(out))


@needs_wheel
def test_rank_zeros_nccl_id_reaches_every_worker_over_the_executor_channel(tmp_path):
    from kiln.runtime.worker.multiproc_executor import MultiprocExecutor

    ex = MultiprocExecutor(functools.partial(_make_id_worker, str(tmp_path)), 3, nccl=True, start_timeout=120)
    try:
        got = [(tmp_path / f"rank{r}").read_bytes() for r in range(3)]
        assert all(g[0] == 3 and len(g) == 129 for g in got)
        assert got[0][1:] == got[1][1:] == got[2][1:]  # one id, rank 0's, on every rank
        assert ex.group is None  # GPU ranks: no shared-memory segment
        assert ex.num_blocks == 10  # the smallest rank's cache: every rank holds that many blocks
    finally:
        ex.shutdown()


def test_two_rank_reference_is_the_correctly_rounded_bf16_sum_in_either_order():
    """Why an N = 2 ncclAllReduce has the reference's bits (docs/TENSOR_PARALLEL.md): NCCL adds
    the two bf16 addends once, correctly rounded (__hadd; NVLS: f32 then one rounding), and the
    reference's f32 sum rounded once is that same correctly rounded sum, in either order. The
    exact sum (f64 holds any two bf16 summed) rounded once is the oracle."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from kiln.graph.collective_ops import all_reduce_reference

    rng = np.random.default_rng(7)
    n = 1 << 20
    a, b = ((rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(ml_dtypes.bfloat16)
            for _ in range(2))
    exact = (a.astype(np.float64) + b.astype(np.float64)).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(all_reduce_reference([a, b]).view(np.uint16), exact)
    assert np.array_equal(all_reduce_reference([b, a]).view(np.uint16), exact)
    # three addends: the order shows (which is why N > 2 does not use NCCL's reduction)
    c = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(ml_dtypes.bfloat16)
    bf = ml_dtypes.bfloat16
    hop = lambda x, y: (x.astype(np.float32) + y.astype(np.float32)).astype(bf)  # a ring hop rounds to bf16
    assert not np.array_equal(hop(hop(a, b), c).view(np.uint16), hop(hop(c, a), b).view(np.uint16))
