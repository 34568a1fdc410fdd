"""How a step's input block reaches the device: off the main stream.

The host writes a step's inputs (input ids, positions, slots, block table, ...: the
bucket's layout in the bundle's "inputs" region) into one of two pinned buffers. One copy
takes them to a device staging buffer of the same turn on a side stream, where it runs
while the step before is still on the GPU; on the main stream the stage kernel
(codegen/triton/sampling.py stage_inputs_kernel) then moves them into the region the
plans read, patching in the ids the step before sampled (async scheduling: the host
staged placeholders there). Between two batch-1 decode graphs that is one small kernel
where it was two copies and a kernel, each copy a copy-engine round trip in the main
stream's queue (bench/engine_timeline.py).

Events order it: `uploaded[t]` behind turn t's copy (the main stream waits for it before
the kernel; the host waits for it before restaging the pinned buffer) and `consumed[t]`
behind turn t's kernel (the side stream waits for it before overwriting the device buffer).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.runtime.sample.gpu_sampler import _ALIGN, launch_named


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class InputStager:
    def __init__(self, ctx, kernel, role: dict, signature: list, dst_ptr: int, nbytes: int, max_tokens: int) -> None:
        """kernel: the loaded stage kernel; role: its manifest["sampler"]["stage"] entry (args,
        block); dst_ptr: the inputs region; nbytes: its size; max_tokens: the most input ids of
        any bucket (the feed map's room)."""
        self.ctx, self.kernel, self.names, self.sig = ctx, kernel, role["args"], signature
        self.block, self.dst = int(role["block"]), dst_ptr
        cap = _aligned(nbytes) + 4 * max_tokens
        self.host = [ctx.host_alloc(cap) for _ in range(2)]
        self.dev = [ctx.malloc(cap) for _ in range(2)]
        self.uploaded, self.consumed = [ctx.marker() for _ in range(2)], [ctx.marker() for _ in range(2)]
        for e in self.uploaded + self.consumed:
            ctx.record(e)
        self.stream = ctx.side_stream("in")
        self.turn = 0

    def buffer(self) -> np.ndarray:
        """The pinned buffer the next step's inputs go in (turn self.turn), once the copy that last
        read it has run."""
        self.ctx.event_sync(self.uploaded[self.turn])
        return self.host[self.turn]

    def put(self, nbytes: int, ids_off: int, n_ids: int,
            feed: Optional[tuple[int, np.ndarray, np.ndarray]] = None) -> None:
        """Queue buffer()[:nbytes] into the inputs region, then flip turns. ids_off, n_ids: the
        bucket's input ids (byte offset, count). feed: (device i32 ids, src_idx, dst_idx): input
        id dst_idx[j] becomes ids[src_idx[j]] on the device."""
        ctx, t = self.ctx, self.turn
        host, dev = self.host[t], self.dev[t]
        map_off, total, n_fed, ids = _aligned(nbytes), nbytes, 0, dev
        if feed is not None:
            ids, src_idx, dst_idx = feed
            fmap = host[map_off: map_off + 4 * n_ids].view(np.int32)
            fmap[:] = -1
            fmap[np.asarray(dst_idx)] = np.asarray(src_idx, np.int32)
            total, n_fed = map_off + 4 * n_ids, n_ids
        ctx.wait(self.consumed[t], stream=self.stream)  # the kernel that last read dev has run
        ctx.upload(dev, host[:total], sync=False, stream=self.stream)
        ctx.record(self.uploaded[t], stream=self.stream)
        ctx.wait(self.uploaded[t])
        n_words = nbytes // 4
        launch_named(ctx, self.kernel, -(-n_words // self.block), self.names, self.sig, src_ptr=dev, dst_ptr=self.dst,
                     map_ptr=dev + map_off, ids_ptr=ids, n_words=n_words, ids_off=ids_off // 4, n_ids=n_fed)
        ctx.record(self.consumed[t])
        self.turn ^= 1
