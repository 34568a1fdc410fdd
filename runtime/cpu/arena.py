"""The step's activations in one preallocated f32 arena, laid out once per graph.

Every activation of the compiled CPU plan has a leading row dim (T tokens, or L logits rows) and
a fixed row width, so a buffer is `cap` rows x width and its place in the arena scales with the
capacity: offsets are planned once in units of row widths (first fit over the node order, a
buffer freed after its last reader, views such as reshape and slice_cols keeping their base
alive) and multiplied by `cap` when the arena is (re)allocated for a larger step.
"""
from __future__ import annotations

import numpy as np

ALIGN = 16  # floats: a buffer starts on a 64-byte line whatever the capacity


class ArenaLayout:
    def __init__(self) -> None:
        self.offsets: dict[str, tuple[int, int]] = {}  # buffer -> (offset, width) in row units
        self._free: list[tuple[int, int]] = []  # (offset, width), sorted, merged
        self.size = 0

    def alloc(self, name: str, width: int) -> None:
        width = -(-width // ALIGN) * ALIGN
        for i, (off, w) in enumerate(self._free):
            if w >= width:
                self._free[i:i + 1] = [(off + width, w - width)] if w > width else []
                self.offsets[name] = (off, width)
                return
        if self._free and self._free[-1][0] + self._free[-1][1] == self.size:  # grow the last hole
            off = self._free.pop()[0]
        else:
            off = self.size
        self.size = off + width
        self.offsets[name] = (off, width)

    def free(self, name: str) -> None:
        off, w = self.offsets[name]
        self._free.append((off, w))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for o, ww in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + ww)
            else:
                merged.append((o, ww))
        self._free = merged


class Arena:
    """The buffers of one layout at a capacity of `cap` rows."""

    def __init__(self, layout: ArenaLayout, cap: int) -> None:
        self.cap = cap
        self.mem = np.empty(layout.size * cap, np.float32)
        self.layout = layout

    def buffer(self, name: str, shape_after_rows: tuple[int, ...]) -> np.ndarray:
        off, _ = self.layout.offsets[name]
        n = int(np.prod(shape_after_rows, dtype=np.int64)) * self.cap
        return self.mem[off * self.cap: off * self.cap + n].reshape(self.cap, *shape_after_rows)
