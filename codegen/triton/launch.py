"""What every kernel wrapper shares: buffers, the KernelSpec, and the launch.

A wrapper describes each launch as a `KernelSpec` (module + kernel name, typed
signature, constexprs, grid, warps, divisibility hints) and hands it to `launch()`;
`aot.py` compiles the same spec to a cubin, and a bundle's plan can record it. So
the spec is the one source of truth for argument order, specialisation and grid.

Buffers are `Buf`s: a numpy array (interpreter) or a raw device pointer with shape
and dtype (GPU). Torch tensors also work where tests have them.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.graph.dtype import DType, to_numpy

# numpy dtype name -> Triton signature type
_SIG = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32",
        "int64": "i64", "uint8": "u8", "float8_e4m3fn": "fp8e4nv"}


class Buf:
    """A typed strided buffer: a numpy array (interpreter) or a raw device pointer.

    Exposes what Triton's launchers read (`data_ptr()`, `dtype`) and, for host
    arrays, the few torch-storage methods the interpreter calls; on host memory
    those are identities because the interpreter reads the pointer in place.
    """

    def __init__(self, array: np.ndarray | None = None, *, ptr: int | None = None,
                 shape: Sequence[int] = (), dtype: Any = None, strides: Sequence[int] | None = None):
        self.array = array
        if array is not None:
            self.ptr, self.shape, self.np_dtype = array.ctypes.data, tuple(array.shape), array.dtype
            self.strides = tuple(s // array.itemsize for s in array.strides)
        else:
            if ptr is None or dtype is None:
                raise ValueError("Buf needs an array, or ptr + shape + dtype")
            self.ptr, self.shape = int(ptr), tuple(int(d) for d in shape)
            self.np_dtype = to_numpy(DType(dtype)) if isinstance(dtype, (str, DType)) else np.dtype(dtype)
            self.strides = tuple(strides) if strides is not None else contiguous_strides(self.shape)

    @property
    def on_host(self) -> bool:
        return self.array is not None

    @property
    def dtype(self):
        return self.np_dtype

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self, dim: int | None = None):
        return self.strides if dim is None else self.strides[dim]

    # the interpreter's host round trip (GridExecutor._init_args_hst / _restore_args_dev)
    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args):
        return self

    def copy_(self, other):
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.shape

    def __repr__(self) -> str:
        where = "host" if self.on_host else f"0x{self.ptr:x}"
        return f"Buf({dtype_name(self)}{list(self.shape)} @ {where})"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def as_buf(x) -> Any:
    """numpy arrays become Bufs; Bufs and torch tensors pass through."""
    return Buf(x) if isinstance(x, np.ndarray) else x


def tail(x, start: int):
    """The elements of a 1-D buffer from `start` on, as a buffer (e.g. &query_start_loc[S],
    the live token count, passed where a kernel wants n_rows_ptr)."""
    if isinstance(x, Buf) and not x.on_host:
        return Buf(ptr=x.ptr + start * x.np_dtype.itemsize, shape=(x.shape[0] - start,), dtype=x.np_dtype)
    if isinstance(x, Buf):
        return Buf(x.array[start:])
    return x[start:]


_DTYPE_NAMES: dict = {}  # dtype object -> name (str() of a numpy dtype is slow, and lowering asks ~10^5 times)


def dtype_name(x) -> str:
    """'bfloat16', 'float32', 'int32', ... for numpy dtypes, Bufs and torch tensors."""
    d = getattr(x, "dtype", x)
    try:
        return _DTYPE_NAMES[d]
    except (KeyError, TypeError):
        name = str(d).split(".")[-1]
        try:
            _DTYPE_NAMES[d] = name
        except TypeError:
            pass
        return name


def sig_type(x) -> str:
    """Triton pointer type of a buffer, a dtype, or a dtype name: '*bf16', '*i32', ..."""
    return "*" + _SIG[x if isinstance(x, str) else dtype_name(x)]


def shape_of(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def strides_of(x) -> tuple[int, ...]:
    s = x.stride()
    return tuple(int(v) for v in s)


def is_host(x) -> bool:
    if isinstance(x, Buf):
        return x.on_host
    dev = getattr(x, "device", None)
    return dev is None or str(dev) == "cpu"


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_dtype(x, allowed: Sequence[str], name: str) -> None:
    check(dtype_name(x) in allowed, f"{name}: dtype {dtype_name(x)} not in {list(allowed)}")


def check_shape(x, shape: Sequence[int], name: str) -> None:
    check(shape_of(x) == tuple(shape), f"{name}: shape {list(shape_of(x))} != {list(shape)}")


def check_inner_contiguous(x, name: str, ndim_inner: int = 1) -> None:
    """The last `ndim_inner` dims are packed row-major (kernels index them as one run)."""
    shp, st = shape_of(x), strides_of(x)
    check(st[len(st) - ndim_inner:] == contiguous_strides(shp[len(shp) - ndim_inner:]),
          f"{name}: the last {ndim_inner} dim(s) must be contiguous, strides {list(st)}")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KernelSpec:
    """One launch: which kernel, its typed signature (non-constexpr args in order),
    the constexpr specialisation, the grid, and the launch config."""
    module: str
    kernel: str
    signature: Mapping[str, str]  # arg name -> Triton type ("*bf16", "i32", "fp32")
    constexprs: Mapping[str, Any]
    grid: tuple[int, ...]
    num_warps: int = 4
    num_stages: int = 2
    divisible: tuple[str, ...] = field(default=())  # AOT tt.divisibility=16 hints: 16-byte aligned
    # pointers, ints that are multiples of 16
    maxnreg: int | None = None  # a register cap per thread (ptxas), for more programs per SM; None: none

    def full_signature(self) -> dict[str, str]:
        """Signature for ASTSource: every kernel parameter, constexprs typed "constexpr"."""
        fn = kernel_fn(self)
        return {p.name: ("constexpr" if p.name in self.constexprs or p.is_constexpr else self.signature[p.name])
                for p in fn.params}  # a constexpr the spec leaves out takes its default (PDL=False)

    def all_constexprs(self) -> dict[str, Any]:
        """The spec's constexprs and every other constexpr of the kernel at its default, for
        ASTSource. Triton 3.6 keys its compile cache (ASTSource.hash) on the constexprs' values in
        parameter order without their names, so a spec that leaves a defaulted constexpr out
        shares a key with one that sets another: {MERGE: False, PDL: True} and {MERGE: False,
        ROUTE: True} were one key, and the second compile was handed the first's kernel. With
        every constexpr passed, each value has its place."""
        fn = kernel_fn(self)
        missing = [p.name for p in fn.params if p.is_constexpr and p.name not in self.constexprs and not p.has_default]
        check(not missing, f"{self.kernel}: no value for the constexprs {missing}")
        return {p.name: self.constexprs[p.name] if p.name in self.constexprs else p.default
                for p in fn.params if p.is_constexpr or p.name in self.constexprs}

    def with_pdl(self) -> KernelSpec:
        """This launch compiled for programmatic dependent launch (pdl.py), where the kernel
        has the PDL switch; unchanged otherwise."""
        if "PDL" not in kernel_fn(self).arg_names or self.constexprs.get("PDL"):
            return self
        return dataclasses.replace(self, constexprs={**self.constexprs, "PDL": True})


def kernel_fn(spec: KernelSpec):
    """The @triton.jit object named by `spec` (interpreted or compiled, as triton was imported)."""
    return getattr(importlib.import_module(spec.module), spec.kernel)


def interpreting() -> bool:
    """Triton decides interpret-or-compile once, when it is imported (its own
    triton.language helpers are built in that mode), so this is per process."""
    import triton

    return bool(triton.knobs.runtime.interpret)


# While set, launch() records (spec, args) instead of running: codegen/lower.py drives the
# wrappers with symbolic device pointers to build a bundle's launch plan.
_RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar("kiln_launch_recorder", default=None)


@contextlib.contextmanager
def recording():
    """with recording() as launches: ...  -> launches: [(KernelSpec, args)] in order."""
    launches: list = []
    token = _RECORDER.set(launches)
    try:
        yield launches
    finally:
        _RECORDER.reset(token)


def record_call(entry: Any) -> None:
    """Put a plan entry that is not a kernel (an NCCL call: codegen/triton/collective.py
    NcclCall) into the plan being recorded, in launch order. Such an entry only exists in a
    plan: outside recording() there is nothing to run it."""
    recorder = _RECORDER.get()
    if recorder is None:
        raise RuntimeError(f"{type(entry).__name__} is a plan entry: it can only be recorded into a plan")
    recorder.append((entry, None))


def launch(spec: KernelSpec, args: Sequence[Any]) -> None:
    """Run `spec` with positional non-constexpr `args` (Bufs, torch tensors, ints, floats).

    Under TRITON_INTERPRET=1 the buffers must be host arrays; otherwise device
    buffers go through Triton's JIT launcher (GPU tests). The production runtime
    does not come here: it launches the AOT cubin with the same argument order.
    """
    check(len(args) == len(spec.signature),
          f"{spec.kernel}: {len(args)} args for a signature of {len(spec.signature)}")
    spec = hint_ints(spec, args)
    recorder = _RECORDER.get()
    if recorder is not None:
        recorder.append((spec, list(args)))
        return
    interpret = interpreting()
    for a in args:
        if hasattr(a, "data_ptr") and is_host(a) != interpret:
            raise ValueError(f"{spec.kernel}: {a!r} is {'host' if is_host(a) else 'device'} memory but "
                             f"triton was imported {'with' if interpret else 'without'} TRITON_INTERPRET=1")
    if interpret:
        _interpreter_compat()
    fn = kernel_fn(spec)
    kw = dict(spec.constexprs)
    if "INTERPRET" in fn.arg_names:
        kw["INTERPRET"] = interpret
    if interpret:
        fn[spec.grid](*args, **kw)
    else:
        fn[spec.grid](*args, **kw, num_warps=spec.num_warps, num_stages=spec.num_stages)


def hint_ints(spec: KernelSpec, args: Sequence[Any]) -> KernelSpec:
    """`spec` with a divisibility hint on every integer argument that is a multiple of 16,
    as Triton's JIT gives a launch (it specializes on them). An AOT cubin is compiled
    from the spec alone: without the hints a stride of 1024 is an unknown int, every
    address built from it might be odd, and the loads go out 2 bytes at a time instead of
    16 (the paged attention kernel ran at half speed in the bundles, at full speed under
    the JIT). Safe because a plan's integer arguments are fixed when it is recorded
    (runtime/worker/cuda_executor.py passes them as recorded; only device memory changes)."""
    extra = tuple(n for n, a in zip(spec.signature, args)
                  if spec.signature[n] in ("i32", "i64") and isinstance(a, (int, np.integer))
                  and not isinstance(a, bool) and int(a) % 16 == 0 and n not in spec.divisible)
    return dataclasses.replace(spec, divisible=spec.divisible + extra) if extra else spec


def _interpreter_compat() -> None:
    """Three fixes to Triton 3.6's interpreter, so it computes what the GPU computes:
    - a scalar used as an index goes through int() of a shape-(1,) array, which
      numpy >= 2.4 refuses (`range(runtime_lo, runtime_hi)` in a kernel fails);
    - f32 -> bf16 casts truncate, where the GPU (cvt.rn.bf16.f32) and numpy round to
      nearest even; every kernel that stores bf16 would be a rounding off;
    - fp8 (e4m3) conversions round half up and do not saturate there; the GPU's
      cvt.rn.satfinite rounds to nearest even and clamps at +-448, as ml_dtypes after a clip.
    Patched once, only in the interpreter, only when kiln launches a kernel."""
    import ml_dtypes
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_kiln_compat", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    builder = interpreter.InterpreterBuilder
    cast_impl = builder.cast_impl

    def patched_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.asarray(src.data, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
            return interpreter.TensorHandle(data, dst_type.scalar)
        return cast_impl(self, src, dst_type)

    fp_to_fp = builder.create_fp_to_fp
    f8 = np.dtype(ml_dtypes.float8_e4m3fn)
    host = {tl.float32: (np.float32, np.float32), tl.bfloat16: (ml_dtypes.bfloat16, np.uint16),
            tl.float16: (np.float16, np.float16), tl.float8e4nv: (f8, np.uint8)}  # value type, storage type

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        s, d = src.dtype.scalar, dst_type.scalar
        if tl.float8e4nv not in (s, d) or s not in host or d not in host:
            return fp_to_fp(self, src, dst_type, rounding_mode)
        x = np.asarray(src.data).view(host[s][0]).astype(np.float32)
        if d == tl.float8e4nv:  # cvt.rn.satfinite: round to nearest even, saturate
            x = np.clip(x, -448.0, 448.0)
        return interpreter.TensorHandle(x.astype(host[d][0]).view(host[d][1]), d)

    interpreter._patch_lang_tensor = patched_tensor
    builder.cast_impl = patched_cast
    builder.create_fp_to_fp = patched_fp_to_fp
    interpreter._kiln_compat = True
