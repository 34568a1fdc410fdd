"""Flat step inputs from per-sequence chunks.

One step computes, for each scheduled sequence, a chunk of its tokens starting
at its number of computed tokens. Prefill and decode are the same thing: a
decode is a chunk of one token. The arrays below are what every executor
(numpy now, CUDA later) takes; their names match the graph's step inputs.
"""
from __future__ import annotations

import itertools
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
    state_slot: int = -1  # a hybrid model's per-request state slot (Gated DeltaNet layers); -1: none


def prepare_step(chunks: Sequence[SeqChunk], block_size: int) -> dict[str, np.ndarray]:
    """Vectorised over tokens: a 256-sequence decode step is a handful of numpy calls plus
    one pass over the chunks to gather their token and block lists (host time per step is
    GPU idle time at small batch)."""
    n = len(chunks)
    lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int32, count=n)
    starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int32, count=n)
    qsl = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    T = int(qsl[-1])
    input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int32, count=T)
    nblocks = np.fromiter((len(c.block_ids) for c in chunks), dtype=np.int32, count=n)
    seq_lens = starts + lens
    short = np.flatnonzero(nblocks * block_size < seq_lens)
    if len(short):
        s = int(short[0])
        raise ValueError(f"sequence {s}: {nblocks[s]} blocks cannot hold {seq_lens[s]} tokens")
    mb = max(int(nblocks.max(initial=0)), 1)
    block_table = np.zeros((n, mb), dtype=np.int32)
    if n and all(isinstance(c.block_ids, np.ndarray) for c in chunks):  # the model runner's cached rows
        flat = np.concatenate([c.block_ids for c in chunks]).astype(np.int32, copy=False)
    else:
        flat = np.fromiter(itertools.chain.from_iterable(c.block_ids for c in chunks), dtype=np.int32,
                           count=int(nblocks.sum()))
    seq_of_block = np.repeat(np.arange(n), nblocks)
    block_table[seq_of_block, np.arange(len(flat)) - np.repeat(np.cumsum(nblocks) - nblocks, nblocks)] = flat
    seq_of_token = np.repeat(np.arange(n), lens)
    positions = (np.arange(T, dtype=np.int32) - qsl[:-1][seq_of_token] + starts[seq_of_token]).astype(np.int32)
    slots = (block_table[seq_of_token, positions // block_size] * block_size + positions % block_size).astype(np.int32)
    if any(c.all_logits for c in chunks):
        rows: list[int] = []
        for s, c in enumerate(chunks):
            if c.all_logits:
                rows.extend(range(qsl[s], qsl[s + 1]))
            elif c.sample and len(c.token_ids):
                rows.append(qsl[s + 1] - 1)
        logits_indices = np.array(rows, dtype=np.int32)
    else:
        wanted = np.fromiter((c.sample for c in chunks), dtype=bool, count=n) & (lens > 0)
        logits_indices = (qsl[1:] - 1)[wanted].astype(np.int32)
    return {
        "input_ids": input_ids, "positions": positions, "slot_mapping": slots,
        "block_table": block_table, "seq_lens": seq_lens.astype(np.int32), "query_start_loc": qsl,
        "logits_indices": logits_indices,
        "state_slots": np.fromiter((c.state_slot for c in chunks), dtype=np.int32, count=n),
    }
