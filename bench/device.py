"""What the benchmarks measure about the machine itself: its name and its copy bandwidth, and
the bare GPU time of kiln's batch-1 decode graph.

Copy bandwidth counts read + write, 2 x bytes / time, as nvidia's bandwidthTest does for a
device-to-device copy. That is how the performance issue's 4.27 TB/s for the H200 reads: its
roofline of 284 tok/s is 15.01 GB (the Llama-3.1-8B weights one token reads: all but one row of the
128,256-row embedding table) / 4.27 TB/s = 3.52 ms; counted as bytes / time it would claim 8.5
TB/s of traffic from a 4.8 TB/s memory.
"""
from __future__ import annotations

import time

import numpy as np


def device_name(target: str) -> str:
    if target == "cpu":
        return "cpu"
    from cuda.bindings import driver as drv

    drv.cuInit(0)
    err, dev = drv.cuDeviceGet(0)
    err, name = drv.cuDeviceGetName(256, dev)
    return name.split(b"\0")[0].decode() if err == drv.CUresult.CUDA_SUCCESS else "unknown GPU"


def copy_bandwidth(target: str) -> float:
    """Bytes per second, read + write counted."""
    return cpu_copy_bandwidth() if target == "cpu" else gpu_copy_bandwidth()


def cpu_copy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def gpu_copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """cuMemcpyDtoDAsync of 1 GiB between two device buffers, timed with events (after two warm-up copies)."""
    from kiln.runtime.cuda_driver import CudaContext, CudaError

    ctx = CudaContext()
    try:
        src, dst = ctx.malloc(nbytes), ctx.malloc(nbytes)
        ctx.memset(src, nbytes)
        ctx.memset(dst, nbytes)

        def copy() -> None:
            err, = ctx.drv.cuMemcpyDtoDAsync(dst, src, nbytes, ctx.stream)
            if err != ctx.drv.CUresult.CUDA_SUCCESS:
                raise CudaError(f"cuMemcpyDtoDAsync failed: {err}")
        for _ in range(2):
            copy()
        start, end = ctx.event(), ctx.event()
        ctx.record(start)
        for _ in range(iters):
            copy()
        ctx.record(end)
        seconds = ctx.elapsed_ms(start, end) / 1e3
    finally:
        ctx.close()
    return 2 * nbytes * iters / seconds


def gpu_only_decode_ms(executor, steps: int = 100) -> float | None:
    """GPU time of the batch-1 decode bucket alone: its captured graph replayed back to back
    (None when the executor holds no captured batch-1 graph)."""
    from kiln.bench.gpu_shape_decode import gpu_only_decode_ms as replay_ms

    if "d1x1" not in getattr(executor, "graphs", {}):
        return None
    return replay_ms(executor, steps)


def torch_graph_us(call, reps: int = 20) -> float:
    """A launch under torch (Triton JIT), timed as production runs it: one call to compile, then
    the best of 5 replays of a CUDA graph of `reps` calls -> microseconds per call."""
    import math

    import torch

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best
