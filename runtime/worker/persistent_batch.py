"""The model runner's per-request token ids and block tables, kept as arrays across steps.

vLLM's GPU runner keeps an InputBatch whose numpy rows (token_ids_cpu, block_table,
num_tokens) are updated by the scheduler's diffs and gathered into a step's inputs with a
few vectorised calls. This is that idea for kiln: one row per request the runner holds,
written when the request arrives, when its blocks grow, when it is resynced and when it
samples a token, so a step's inputs cost a handful of numpy calls whatever the batch,
instead of a pass over per-request lists. `gather` gives exactly what
`input_batch.prepare_step` gives for the same chunks (tests/test_persistent_batch.py).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class PersistentBatch:
    def __init__(self, block_size: int, rows: int = 16, max_tokens: int = 256, max_blocks: int = 16) -> None:
        self.block_size = block_size
        self.token_ids = np.zeros((rows, max_tokens), np.int32)  # [R, L]: prompt + output tokens
        self.num_tokens = np.zeros(rows, np.int64)  # [R]
        self.block_table = np.zeros((rows, max_blocks), np.int32)  # [R, MB]: zero past num_blocks
        self.num_blocks = np.zeros(rows, np.int32)  # [R]
        self.state_slot = np.full(rows, -1, np.int32)  # [R]: a hybrid model's state slot, -1: none
        self._free = list(range(rows - 1, -1, -1))

    # -- rows ---------------------------------------------------------------------------
    def add(self, token_ids: Sequence[int], block_ids: Sequence[int], state_slot: int = -1) -> int:
        """A new request's row; -> its index."""
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self.set_tokens(row, token_ids)
        self.set_blocks(row, block_ids)
        self.state_slot[row] = state_slot
        return row

    def remove(self, row: int) -> None:
        self.block_table[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.num_tokens[row] = 0
        self.state_slot[row] = -1
        self._free.append(row)

    def _grow_rows(self) -> None:
        old = len(self.num_tokens)
        new = old * 2
        self.token_ids = _resized(self.token_ids, new, self.token_ids.shape[1])
        self.block_table = _resized(self.block_table, new, self.block_table.shape[1])
        self.num_tokens = np.concatenate([self.num_tokens, np.zeros(new - old, self.num_tokens.dtype)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(new - old, self.num_blocks.dtype)])
        self.state_slot = np.concatenate([self.state_slot, np.full(new - old, -1, np.int32)])
        self._free.extend(range(new - 1, old - 1, -1))

    def _ensure_tokens(self, n: int) -> None:
        if n > self.token_ids.shape[1]:
            self.token_ids = _resized(self.token_ids, len(self.token_ids), max(n, 2 * self.token_ids.shape[1]))

    def _ensure_blocks(self, n: int) -> None:
        if n > self.block_table.shape[1]:
            self.block_table = _resized(self.block_table, len(self.block_table),
                                        max(n, 2 * self.block_table.shape[1]))

    # -- tokens -------------------------------------------------------------------------
    def set_tokens(self, row: int, token_ids: Sequence[int]) -> None:
        """Replace the row's tokens (a new or resynced request)."""
        n = len(token_ids)
        self._ensure_tokens(n)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """One sampled token per row (rows distinct), after the row's last token."""
        if not len(rows):
            return
        at = self.num_tokens[rows]
        self._ensure_tokens(int(at.max()) + 1)
        self.token_ids[rows, at] = tokens
        self.num_tokens[rows] = at + 1

    # -- blocks -------------------------------------------------------------------------
    def set_blocks(self, row: int, block_ids: Sequence[int]) -> None:
        n = len(block_ids)
        self._ensure_blocks(n)
        self.block_table[row, n:self.num_blocks[row]] = 0
        self.block_table[row, :n] = block_ids
        self.num_blocks[row] = n

    def append_blocks(self, row: int, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        k = int(self.num_blocks[row])
        n = k + len(block_ids)
        self._ensure_blocks(n)
        self.block_table[row, k:n] = block_ids
        self.num_blocks[row] = n

    def block_ids(self, row: int) -> list[int]:
        return self.block_table[row, :self.num_blocks[row]].tolist()

    # -- one step -----------------------------------------------------------------------
    def gather(self, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray, sample: np.ndarray,
               all_logits: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The step inputs (input_batch.prepare_step's arrays, same dtypes) for chunks
        rows[i] computing lens[i] tokens from starts[i]; sample / all_logits as SeqChunk's."""
        bs = self.block_size
        n = len(rows)
        positions = starts.astype(np.int32)  # a copy: it is handed out (as the decode step's positions)
        lens = lens.astype(np.int32, copy=False)
        seq_lens = positions + lens
        qsl = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        T = int(qsl[-1])
        nblocks = self.num_blocks[rows]
        short = nblocks * bs < seq_lens
        if short.any():
            s = int(np.flatnonzero(short)[0])
            raise ValueError(f"sequence {s}: {nblocks[s]} blocks cannot hold {seq_lens[s]} tokens")
        mb = max(int(nblocks.max(initial=0)), 1)
        self._ensure_blocks(mb)
        block_table = self.block_table[rows, :mb]
        state_slots = self.state_slot[rows]
        decode = T == n and (n == 0 or int(lens.min()) == 1)  # every chunk is one token
        if not decode:
            seq_of_token = np.repeat(np.arange(n), lens)
            positions = (np.arange(T, dtype=np.int32) - qsl[:-1][seq_of_token] + positions[seq_of_token])
            rows = rows[seq_of_token]
        input_ids = self.token_ids[rows, positions]  # rows: each token's row from here on
        block, offset = np.divmod(positions, bs)
        slots = (self.block_table[rows, block] * bs + offset).astype(np.int32, copy=False)
        if all_logits is not None and all_logits.any():
            pieces = []
            for s in range(n):
                if all_logits[s]:
                    pieces.append(np.arange(qsl[s], qsl[s + 1], dtype=np.int32))
                elif sample[s] and lens[s]:
                    pieces.append(qsl[s + 1:s + 2] - 1)
            logits_indices = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)
        elif decode and sample.all():  # one logits row per token
            logits_indices = np.arange(n, dtype=np.int32)
        else:
            logits_indices = (qsl[1:] - 1)[sample & (lens > 0)].astype(np.int32)
        return {
            "input_ids": input_ids.astype(np.int32, copy=False), "positions": positions.astype(np.int32, copy=False),
            "slot_mapping": slots, "block_table": block_table, "seq_lens": seq_lens, "query_start_loc": qsl,
            "logits_indices": logits_indices, "state_slots": state_slots,
        }


def _resized(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    out = np.zeros((rows, cols), a.dtype)
    r, c = min(rows, a.shape[0]), min(cols, a.shape[1])
    out[:r, :c] = a[:r, :c]
    return out
