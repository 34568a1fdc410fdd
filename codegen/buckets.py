"""Shape buckets: the step sizes a bundle compiles a plan for.

Decode buckets follow vLLM's CUDA-graph capture sizes (1, 2, 4, then multiples
of 8 up to 512), trimmed by max_num_seqs: T = S = L = batch. Mixed buckets
(prefill, chunked prefill plus decodes) are token counts up to
max_num_batched_tokens with room for max_num_seqs sequences. A step runs in the
smallest bucket that holds it; padded tokens carry slot -1 and write nothing.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Bucket:
    tokens: int  # T
    seqs: int  # S
    logits: int  # L
    decode: bool  # every sequence computes one token (T == S == L): captured as a CUDA graph

    @property
    def name(self) -> str:
        return f"{'d' if self.decode else 'm'}{self.tokens}x{self.seqs}"

    def dims(self, max_blocks_per_seq: int) -> dict[str, int]:
        return {"T": self.tokens, "S": self.seqs, "S1": self.seqs + 1, "L": self.logits, "MB": max_blocks_per_seq}

    def holds(self, t: int, s: int, l_: int) -> bool:
        return t <= self.tokens and s <= self.seqs and l_ <= self.logits


def decode_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 513, 8))
    out = [s for s in sizes if s < max_num_seqs]
    return out + [max_num_seqs] if max_num_seqs <= 512 else out


def make_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> list[Bucket]:
    buckets = [Bucket(b, b, b, True) for b in decode_sizes(max_num_seqs)]
    t = 16
    while True:
        t = min(t, max_num_batched_tokens)
        s = min(max_num_seqs, t)
        buckets.append(Bucket(t, s, s, False))
        if t >= max_num_batched_tokens:
            break
        t *= 2
    return buckets


def pick_bucket(buckets: list[Bucket], t: int, s: int, l_: int) -> Bucket:
    decode = t == s == l_
    fits = [b for b in buckets if b.holds(t, s, l_) and (decode or not b.decode)]
    if not fits:
        raise ValueError(f"no bucket holds a step of {t} tokens, {s} sequences, {l_} logits rows")
    return min(fits, key=lambda b: (b.tokens, b.seqs, not b.decode))
