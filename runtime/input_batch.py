"""Flat step inputs from per-sequence chunks.

One step computes, for each scheduled sequence, a chunk of its tokens starting
at its number of computed tokens. Prefill and decode are the same thing: a
decode is a chunk of one token. The arrays below are what every executor
(numpy now, CUDA later) takes; their names match the graph's step inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class SeqChunk:
    token_ids: Sequence[int]  # the tokens computed this step
    start_pos: int  # tokens of this sequence already in the KV cache
    block_ids: Sequence[int]  # the sequence's block table (covers start_pos + len(token_ids))
    sample: bool = True  # whether the last token's logits are wanted
    all_logits: bool = False  # logits of every token of the chunk (prompt logprobs), in order


def prepare_step(chunks: Sequence[SeqChunk], block_size: int) -> dict[str, np.ndarray]:
    lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int32)
    qsl = np.zeros(len(chunks) + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    T = int(qsl[-1])
    input_ids = np.empty(T, dtype=np.int32)
    positions = np.empty(T, dtype=np.int32)
    slots = np.empty(T, dtype=np.int32)
    mb = max((len(c.block_ids) for c in chunks), default=1) or 1
    block_table = np.zeros((len(chunks), mb), dtype=np.int32)
    for s, c in enumerate(chunks):
        a, b = qsl[s], qsl[s + 1]
        pos = np.arange(c.start_pos, c.start_pos + (b - a), dtype=np.int32)
        blocks = np.asarray(c.block_ids, dtype=np.int32)
        if len(blocks) * block_size < c.start_pos + (b - a):
            raise ValueError(f"sequence {s}: {len(blocks)} blocks cannot hold {c.start_pos + b - a} tokens")
        input_ids[a:b] = c.token_ids
        positions[a:b] = pos
        slots[a:b] = blocks[pos // block_size] * block_size + pos % block_size
        block_table[s, : len(blocks)] = blocks
    seq_lens = np.array([c.start_pos + len(c.token_ids) for c in chunks], dtype=np.int32)
    rows: list[int] = []
    for s, c in enumerate(chunks):
        if c.all_logits:
            rows.extend(range(qsl[s], qsl[s + 1]))
        elif c.sample and len(c.token_ids):
            rows.append(qsl[s + 1] - 1)
    logits_indices = np.array(rows, dtype=np.int32)
    return {
        "input_ids": input_ids, "positions": positions, "slot_mapping": slots,
        "block_table": block_table, "seq_lens": seq_lens, "query_start_loc": qsl,
        "logits_indices": logits_indices,
    }
