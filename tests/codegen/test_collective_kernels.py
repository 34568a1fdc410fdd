"""The tensor-parallel kernels of the GPU design (codegen/triton/collective.py) under the
interpreter, against graph/collective_ops.py's references on fresh random partials: the
rank-order all-reduce bit for bit (f32 and bf16, 2 to 8 ranks), the all-gather of logit
columns cut to the vocabulary, the masked vocabulary lookup with the rank's first id read from
the device; rows past the live count (bucket padding) untouched. And each compiles for sm_90
and sm_121 ahead of time (compile only: nothing here has a GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton.collective import (all_gather, all_gather_spec, all_reduce, all_reduce_spec, barrier_spec,
                                            vocab_embedding, vocab_embedding_spec)
from kiln.graph.collective_ops import all_gather_reference, all_reduce_reference, vocab_parallel_embedding
from tests.codegen.helpers import BF16, require_interpreter


@pytest.fixture
def interpreter():
    require_interpreter()


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("world,dtype", [(2, np.float32), (3, BF16), (4, BF16), (8, np.float32)])
def test_all_reduce_is_the_rank_order_sum_bit_for_bit(world, dtype):
    rng = np.random.default_rng(world)
    parts = [rng.standard_normal((5, 1100)).astype(dtype) for _ in range(world)]  # 1100: a partial block
    out = np.full((5, 1100), 7, dtype)
    all_reduce(parts, out, n_rows=np.array([4], np.int32))  # 4 live rows of a 5-row bucket
    want = all_reduce_reference([p[:4] for p in parts])
    assert out.dtype == want.dtype and np.array_equal(out[:4].view(np.uint8), want.view(np.uint8))
    assert (out[4] == 7).all()


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("world,size", [(2, 256), (3, 250), (4, 1000)])
def test_all_gather_puts_the_ranks_columns_side_by_side(world, size):
    rng = np.random.default_rng(size)
    npart = -(-size // world)
    parts = [rng.standard_normal((3, npart)).astype(np.float32) for _ in range(world)]
    out = all_gather(parts, size)
    assert np.array_equal(out, all_gather_reference(parts, size=size))


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("start,end", [(0, 128), (128, 250), (256, 256)])
def test_vocab_embedding_is_the_masked_lookup(start, end):
    rng = np.random.default_rng(end)
    table = rng.standard_normal((128, 64)).astype(BF16)
    table[end - start:] = 0  # the padding rows
    ids = rng.integers(0, 250, 37).astype(np.int32)
    out = vocab_embedding(ids, table, np.array([start], np.int32), end - start)
    want = vocab_parallel_embedding(ids, table, vocab_start=start, vocab_end=end)
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16))


@pytest.mark.slow
def test_collective_kernels_compile_for_both_archs(tmp_path):
    from kiln.codegen.triton.aot import compile_specs

    specs = [all_reduce_spec(64, 4096, 2), all_reduce_spec(1, 4096, 8), all_gather_spec(8, 64128, 128256, 2),
             vocab_embedding_spec(64, 4096), barrier_spec(2), barrier_spec(8)]
    out = compile_specs([(s, a) for s in specs for a in ("sm_90", "sm_121")], cache_dir=tmp_path)
    assert len(out) == 12 and all(c.cubin[:4] == b"\x7fELF" for c in out)


@pytest.mark.usefixtures("interpreter")
def test_barrier_announces_its_epoch_to_every_rank_and_passes_once_all_have():
    """Rank 1 of 3 at its third barrier: ranks 0 and 2 have announced epoch 3 to it already (as
    they would from their GPUs); it writes 3 into every rank's flag slot for rank 1, advances its
    counter, and returns (a rank still at 2 would keep it waiting: not testable in one process)."""
    flags = [np.zeros(3, np.int32) for _ in range(3)]
    flags[1][:] = [3, 2, 3]  # rank 1's own array: 0 and 2 announced 3; its own slot is written by itself
    epoch, rank = np.array([2], np.int32), np.array([1], np.int32)
    from kiln.codegen.triton.collective import barrier

    barrier(flags, flags[1], epoch, rank)
    assert epoch[0] == 3
    assert [f[1] for f in flags] == [3, 3, 3]
    assert flags[0][0] == 0 and flags[2][2] == 0  # nothing else written
