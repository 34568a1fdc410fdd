"""What the benchmarks measure about the machine itself: its name and its copy bandwidth, the
bare GPU time of kiln's batch-1 decode graph, and the clock and power a workload ran at (PowerLog).

Copy bandwidth counts read + write, 2 x bytes / time, as nvidia's bandwidthTest does for a
device-to-device copy. That is how the performance issue's 4.27 TB/s for the H200 reads: its
roofline of 284 tok/s is 15.01 GB (the Llama-3.1-8B weights one token reads: all but one row of the
128,256-row embedding table) / 4.27 TB/s = 3.52 ms; counted as bytes / time it would claim 8.5
TB/s of traffic from a 4.8 TB/s memory.
"""
from __future__ import annotations

import subprocess
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
    from kiln.runtime.worker.cuda_driver import CudaContext, CudaError

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


# nvidia-smi's CSV for PowerLog: the SM clock, the board's power and the active clock-event
# reasons (a bit mask; 0x4 is "SW power cap": the driver holding the board to its power limit)
SMI_QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"
SW_POWER_CAP = 0x4


class PowerLog:
    """nvidia-smi sampling the GPU every `period_ms` while a workload runs (a context manager);
    summary() says at which SM clock and power the busy samples ran and how many of them the
    power limit held down. A GPU workload that keeps the tensor cores busy for more than ~0.1 s
    runs at the power limit, not at the boost clock (H200: 700 W, ~1,550-1,700 MHz against
    1,980), so a figure taken in a burst and one taken sustained differ by ~10-15 %.
    power.draw is a ~1 s average on Ampere and newer (the clock and the event reasons are not),
    so a workload whose GPU work is shorter than a second, such as five 2,048-token prefills
    (~0.25 s), gets few busy samples. Off (no summary) where nvidia-smi is not on PATH."""

    def __init__(self, period_ms: int = 100, busy_w: float = 150.0) -> None:
        self.period_ms, self.busy_w = period_ms, busy_w
        self.proc = None
        self.lines: list[str] = []

    def __enter__(self) -> "PowerLog":
        import shutil

        smi = shutil.which("nvidia-smi")
        if smi:
            self.proc = subprocess.Popen([smi, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits",
                                          "-lms", str(self.period_ms)], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                out, _ = self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, _ = self.proc.communicate()
            self.lines = out.splitlines()

    def summary(self) -> dict | None:
        return summarize_smi(self.lines, self.busy_w) if self.proc is not None else None


def summarize_smi(lines: list[str], busy_w: float = 150.0) -> dict | None:
    """PowerLog's samples ("MHz, W, 0xMASK" lines, units or not) -> {samples, busy_samples
    (above busy_w watts), and over the busy ones: sm_clock_mhz and power_w (median, min, max),
    power_capped (the share the SW power cap held)}; None without a busy sample."""
    import statistics

    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append((float(parts[0].split()[0]), float(parts[1].split()[0]), int(parts[2], 16)))
        except (IndexError, ValueError):  # "[N/A]" or a torn last line
            continue
    busy = [r for r in rows if r[1] > busy_w]
    if not busy:
        return None

    def stats(vals):
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return {"samples": len(rows), "busy_samples": len(busy), "sm_clock_mhz": stats([r[0] for r in busy]),
            "power_w": stats([r[1] for r in busy]),
            "power_capped": sum(bool(r[2] & SW_POWER_CAP) for r in busy) / len(busy)}
