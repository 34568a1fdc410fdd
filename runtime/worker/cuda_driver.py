"""A thin layer over cuda.bindings.driver: one context, device memory, cubin
modules, kernel launches, streams, events and CUDA graphs.

Everything the CUDA executor needs and nothing more; no PyTorch. Each call
checks its CUresult and raises CudaError naming the call. Objects are owned by
a CudaContext instance (no module-level state), so two engines in one process
each hold their own.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.errors import GPU_INSTALL_HINT, KilnError

log = logging.getLogger(__name__)


class CudaError(KilnError, RuntimeError):
    """No CUDA (driver, device or cuda-python), or a driver call failed: one sentence for the user."""


def _drv():
    try:
        from cuda.bindings import driver
    except ImportError as e:  # the gpu extra is not installed
        raise CudaError(f"cuda-python is not installed: {GPU_INSTALL_HINT}") from e
    return driver


def _check(result: tuple, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    drv = _drv()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else tuple(rest)


@dataclass
class Kernel:
    """A loaded kernel: its function handle and launch facts from Triton's metadata."""
    name: str
    function: Any
    num_warps: int
    shared: int  # dynamic shared memory bytes
    num_scratch: int = 2  # hidden pointer args Triton appends (global and profile scratch)
    scratch_size: int = 0  # global scratch bytes per program (e.g. TMA descriptors built on the device)
    pdl: bool = False  # compiled for programmatic dependent launch (codegen/triton/pdl.py)

    def scratch_bytes(self, grid) -> int:
        """The global scratch a launch over `grid` needs: scratch_size bytes per program."""
        return self.scratch_size * int(np.prod(grid)) if self.scratch_size else 0

    def hidden_args(self, scratch: int = 0) -> tuple[list, list]:
        """The trailing pointers Triton appends, as (values, ctypes): the global scratch (a
        buffer of scratch_bytes(grid), each program using its own slice) and the profile
        scratch (null)."""
        vals = ([scratch if self.scratch_size else 0] + [0] * self.num_scratch)[:self.num_scratch]
        return vals, [ctypes.c_void_p] * self.num_scratch


class CudaContext:
    def __init__(self, device: int = 0) -> None:
        drv = _drv()
        self.drv = drv
        _check(drv.cuInit(0), "cuInit")
        self.device = _check(drv.cuDeviceGet(device), "cuDeviceGet")
        self.context = _check(drv.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        _check(drv.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self.stream = _check(drv.cuStreamCreate(0), "cuStreamCreate")
        self._side: dict[str, Any] = {}
        self._modules: list = []
        self._allocs: list[int] = []
        self._host_allocs: list[int] = []
        major = _check(drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device), "attr")
        minor = _check(drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device), "attr")
        self.arch = major * 10 + minor  # 90 on H100/H200, 121 on GB10

    def make_current(self) -> None:
        """Make this context current on the calling thread (a driver context is current per
        thread: async scheduling drives the executor from the engine's worker thread)."""
        _check(self.drv.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    # -- memory ------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        ptr = int(_check(self.drv.cuMemAlloc(max(int(nbytes), 1)), f"cuMemAlloc({nbytes})"))
        self._allocs.append(ptr)
        return ptr

    def free(self, ptr: int) -> None:
        _check(self.drv.cuMemFree(ptr), "cuMemFree")
        self._allocs.remove(ptr)

    def mem_info(self) -> tuple[int, int]:
        free, total = _check(self.drv.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory as a uint8 array: copies from it are truly asynchronous
        and run at full PCIe speed. Freed by close()."""
        ptr = int(_check(self.drv.cuMemHostAlloc(max(int(nbytes), 1), 0), f"cuMemHostAlloc({nbytes})"))
        self._host_allocs.append(ptr)
        return np.frombuffer((ctypes.c_uint8 * max(int(nbytes), 1)).from_address(ptr), dtype=np.uint8)

    def side_stream(self, name: str):
        """A second stream, one per name, made on first use (non-blocking: it never waits on the
        legacy default stream). The step's copies go there so that they run while the main
        stream's kernels do, ordered against them by events (record, wait), not by their place
        in one queue: each copy on the main stream cost the batch-1 decode step ~5-8 us between
        two graphs (bench/engine_timeline.py on the H200)."""
        if name not in self._side:
            self._side[name] = _check(self.drv.cuStreamCreate(1), "cuStreamCreate")  # 1: CU_STREAM_NON_BLOCKING
        return self._side[name]

    def upload(self, ptr: int, host: np.ndarray, *, sync: bool = True, stream=None) -> None:
        """host -> ptr on `stream` (the main one by default); sync: wait for it (on that stream)."""
        host = np.ascontiguousarray(host)
        stream = self.stream if stream is None else stream
        _check(self.drv.cuMemcpyHtoDAsync(ptr, host.ctypes.data, host.nbytes, stream), "cuMemcpyHtoDAsync")
        if sync:
            _check(self.drv.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def upload_2d(self, ptr: int, host: np.ndarray, *, width: int, height: int, dst_pitch: int) -> None:
        """host (contiguous: `height` runs of `width` bytes) to `height` runs at ptr, ptr +
        dst_pitch, ...: one cuMemcpy2DAsync on the stream, then a sync (as upload). An interleaved
        stacked weight's part goes in with one call (runtime/worker/cuda_executor.py)."""
        host = np.ascontiguousarray(host)
        assert host.nbytes == width * height and dst_pitch >= width
        drv = self.drv
        try:
            p = drv.CUDA_MEMCPY2D()
            p.srcMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_HOST
            p.srcHost = host.ctypes.data
            p.srcPitch = width
            p.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.dstDevice = ptr
            p.dstPitch = dst_pitch
            p.WidthInBytes = width
            p.Height = height
        except (AttributeError, TypeError) as e:  # a cuda-python whose struct differs: copy run by run
            log.warning("CUDA_MEMCPY2D unusable (%s); uploading %d runs one by one", e, height)
            for j in range(height):
                _check(drv.cuMemcpyHtoDAsync(ptr + j * dst_pitch, host.ctypes.data + j * width, width, self.stream),
                       "cuMemcpyHtoDAsync")
            self.synchronize()
            return
        _check(drv.cuMemcpy2DAsync(p, self.stream), "cuMemcpy2DAsync")
        self.synchronize()

    def download(self, ptr: int, out: np.ndarray) -> np.ndarray:
        assert out.flags["C_CONTIGUOUS"]
        _check(self.drv.cuMemcpyDtoHAsync(out.ctypes.data, ptr, out.nbytes, self.stream), "cuMemcpyDtoHAsync")
        self.synchronize()
        return out

    def download_async(self, ptr: int, out: np.ndarray, *, stream=None) -> np.ndarray:
        """Queue a copy into `out` (pinned, or the copy is synchronous) on `stream` (the main one
        by default); read it after an event recorded behind it has completed (event_sync)."""
        assert out.flags["C_CONTIGUOUS"]
        _check(self.drv.cuMemcpyDtoHAsync(out.ctypes.data, ptr, out.nbytes, self.stream if stream is None else stream),
               "cuMemcpyDtoHAsync")
        return out

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Device to device, on the stream."""
        _check(self.drv.cuMemcpyDtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def memset(self, ptr: int, nbytes: int) -> None:
        _check(self.drv.cuMemsetD8Async(ptr, 0, nbytes, self.stream), "cuMemsetD8Async")

    def to_device(self, host: np.ndarray) -> int:
        ptr = self.malloc(host.nbytes)
        self.upload(ptr, host)
        return ptr

    # -- modules and launches -------------------------------------------------------------
    def load_kernel(self, cubin: bytes, name: str, num_warps: int, shared: int, num_scratch: int = 2,
                    scratch_size: int = 0, pdl: bool = False) -> Kernel:
        module = _check(self.drv.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
        self._modules.append(module)
        fn = _check(self.drv.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")
        if shared > 48 * 1024:  # opt in to more than the default dynamic shared memory
            _check(self.drv.cuFuncSetAttribute(
                fn, self.drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
                "cuFuncSetAttribute")
        return Kernel(name, fn, num_warps, shared, num_scratch, scratch_size, pdl)

    def pdl_config(self, kernel: Kernel, grid) -> Any:
        """A launch config (for cuLaunchKernelEx) that lets `kernel` start while the kernel
        before it on the stream finishes: the programmatic-stream-serialization attribute.
        Only for a kernel compiled with PDL, which waits for its predecessor itself before
        touching memory (codegen/triton/pdl.py). Built once per launch of a plan."""
        drv = self.drv
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(d) for d in grid)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 32 * kernel.num_warps, 1, 1
        cfg.sharedMemBytes = kernel.shared
        cfg.hStream = self.stream
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        return cfg

    def synchronize(self) -> None:
        _check(self.drv.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    # -- timing and graphs ----------------------------------------------------------------
    def event(self):
        return _check(self.drv.cuEventCreate(0), "cuEventCreate")

    def record(self, event, *, stream=None) -> None:
        """Mark the point `stream` (the main one by default) has reached, for event_sync or wait."""
        _check(self.drv.cuEventRecord(event, self.stream if stream is None else stream), "cuEventRecord")

    def wait(self, event, *, stream=None) -> None:
        """Make `stream` (the main one by default) run what is queued on it next only after the
        work before `event`'s last record, on whichever stream that was, has run. The host goes on."""
        _check(self.drv.cuStreamWaitEvent(self.stream if stream is None else stream, event, 0), "cuStreamWaitEvent")

    def marker(self):
        """An event for ordering only (no timing: cheaper to record and to wait on)."""
        return _check(self.drv.cuEventCreate(2), "cuEventCreate")  # 2: CU_EVENT_DISABLE_TIMING

    def event_sync(self, event) -> None:
        """Wait for the work queued before `event`'s last record (the GIL is released meanwhile)."""
        _check(self.drv.cuEventSynchronize(event), "cuEventSynchronize")

    def elapsed_ms(self, start, end) -> float:
        _check(self.drv.cuEventSynchronize(end), "cuEventSynchronize")
        return float(_check(self.drv.cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def begin_capture(self) -> None:
        mode = self.drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _check(self.drv.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")

    def end_capture(self):
        graph = _check(self.drv.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        return _check(self.drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def replay(self, graph_exec) -> None:
        _check(self.drv.cuGraphLaunch(graph_exec, self.stream), "cuGraphLaunch")

    def close(self) -> None:
        for stream in self._side.values():
            self.drv.cuStreamSynchronize(stream)
            self.drv.cuStreamDestroy(stream)
        self._side.clear()
        for ptr in list(self._allocs):
            self.free(ptr)
        for m in self._modules:
            self.drv.cuModuleUnload(m)
        self._modules.clear()
        for ptr in self._host_allocs:
            self.drv.cuMemFreeHost(ptr)
        self._host_allocs.clear()
