"""prepare_step (vectorised) against a per-token reading of what each step input means."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.worker.input_batch import SeqChunk, prepare_step

BS = 16


def _random_chunks(rng):
    chunks = []
    for _ in range(int(rng.integers(1, 9))):
        start, n = int(rng.integers(0, 60)), int(rng.integers(0, 40))
        need = -(-(start + n) // BS) + int(rng.integers(0, 3))
        chunks.append(SeqChunk(rng.integers(0, 300, n).tolist(), start, rng.permutation(200)[:need].tolist(),
                               sample=bool(rng.random() < 0.8), all_logits=bool(rng.random() < 0.2)))
    return chunks


@pytest.mark.parametrize("seed", range(40))
def test_every_token_lands_where_its_sequence_says(seed):
    rng = np.random.default_rng(seed)
    chunks = _random_chunks(rng)
    got = prepare_step(chunks, BS)
    assert all(v.dtype == np.int32 for v in got.values())
    t, rows = 0, []
    for s, c in enumerate(chunks):
        assert got["query_start_loc"][s] == t
        assert got["seq_lens"][s] == c.start_pos + len(c.token_ids)
        assert list(got["block_table"][s, :len(c.block_ids)]) == list(c.block_ids)
        assert not got["block_table"][s, len(c.block_ids):].any()
        for j, tok in enumerate(c.token_ids):
            pos = c.start_pos + j
            assert got["input_ids"][t + j] == tok and got["positions"][t + j] == pos
            assert got["slot_mapping"][t + j] == c.block_ids[pos // BS] * BS + pos % BS
        if c.all_logits:
            rows += range(t, t + len(c.token_ids))
        elif c.sample and c.token_ids:
            rows.append(t + len(c.token_ids) - 1)
        t += len(c.token_ids)
    assert got["query_start_loc"][-1] == t == len(got["input_ids"])
    assert list(got["logits_indices"]) == rows


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="sequence 1: 1 blocks cannot hold 17 tokens"):
        prepare_step([SeqChunk([1], 0, [0]), SeqChunk([1] * 17, 0, [3])], BS)
