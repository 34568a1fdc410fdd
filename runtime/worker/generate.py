"""Greedy generation over the CPU executor with a trivial block layout.

The foundation's generation loop: each sequence gets a fixed run of KV blocks
for prompt + max_tokens, all prompts prefill in one step, then every live
sequence decodes one token per step. The engine core (scheduler, KV cache
manager, sampler) replaces this for serving; this stays as the smallest
end-to-end path and as an oracle for batching invariance.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from kiln.runtime.worker.input_batch import SeqChunk, prepare_step


class Executor(Protocol):
    num_blocks: int

    def execute(self, inputs): ...


def greedy_generate(executor: Executor, block_size: int, prompts: Sequence[Sequence[int]],
                    max_tokens: int, eos_ids: set[int] | frozenset[int] = frozenset(),
                    logits_out: list | None = None) -> list[list[int]]:
    """-> generated token ids per prompt (stopping at the first EOS, which is included).
    If logits_out is a list, the logits of every step are appended to it ([L, V] each)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    need = [-(-(len(p) + max_tokens) // block_size) for p in prompts]
    if sum(need) > executor.num_blocks:
        raise ValueError(f"the KV cache has {executor.num_blocks} blocks; these prompts need {sum(need)}")
    if 0 < getattr(executor, "num_state_slots", 0) < len(prompts):
        raise ValueError(f"the executor has {executor.num_state_slots} state slots; {len(prompts)} prompts need one each")
    starts = np.concatenate([[0], np.cumsum(need)]).astype(int)
    blocks = [list(range(starts[i], starts[i + 1])) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    # sequence i also owns state slot i (a hybrid model's Gated DeltaNet state)
    chunks = [SeqChunk(seqs[i], 0, blocks[i], state_slot=i) for i in live]
    while live and chunks:
        logits = executor.execute(prepare_step(chunks, block_size))
        logits = next(iter(logits.values()))
        if logits_out is not None:
            logits_out.append(logits)
        next_ids = logits.argmax(axis=-1)
        still = []
        for i, tok in zip(live, next_ids.tolist()):
            out[i].append(tok)
            seqs[i].append(tok)
            if tok not in eos_ids and len(out[i]) < max_tokens:
                still.append(i)
        live = still
        chunks = [SeqChunk([seqs[i][-1]], len(seqs[i]) - 1, blocks[i], state_slot=i) for i in live]
    return out
