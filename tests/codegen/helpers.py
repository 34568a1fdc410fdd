"""Random inputs and the tolerance rule for kernel tests (DESIGN "Oracles")."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)  # an fp8 KV cache (--kv-cache-dtype fp8)


def rand(rng: np.random.Generator, shape, dtype=BF16, scale: float = 1.0) -> np.ndarray:
    """Fresh normal values, never zeros (a zero input hides a kernel that writes nothing)."""
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    x[x == 0] = 0.5
    return x.astype(dtype)


def f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def assert_close(actual, expected, rtol: float = 1e-2, atol: float | None = None, what: str = "") -> None:
    """|a - e| <= atol + rtol |e| elementwise; atol defaults to rtol * max|e| (bf16
    roundings of intermediates are relative to the operands, not to a small result).
    NaN or inf never passes."""
    a, e = f32(actual), f32(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.isfinite(a).all(), f"{what}: non-finite values in the kernel output"
    assert np.isfinite(e).all(), f"{what}: non-finite values in the reference"
    atol = rtol * float(np.abs(e).max()) if atol is None else atol
    err = np.abs(a - e)
    bad = err > atol + rtol * np.abs(e)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} off; worst {float(err.max()):.4g} "
                           f"(atol {atol:.3g}, rtol {rtol})")


def same_bits(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def require_interpreter():
    from kiln.codegen.triton.launch import interpreting

    if not interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run `pytest tests/codegen`")


_MMA_PROBE_HEAD = """
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.codegen.triton.launch import kernel_fn
"""
_MMA_PROBE_TAIL = """
out = {}
for key, cc, spec in specs():
    src = ASTSource(kernel_fn(spec), spec.full_signature(), spec.all_constexprs(), {})
    ptx = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                         options={"num_warps": spec.num_warps, "num_stages": spec.num_stages}).asm["ptx"]
    out[key] = sorted(set(re.findall(r"(wgmma\\.mma_async\\S*|mma\\.sync\\S*)", ptx)))
print(json.dumps(out))
"""


def mma_instructions(setup: str, timeout: int = 600) -> dict[str, list[str]]:
    """The tensor-core instructions (wgmma.mma_async / mma.sync, each form once) in the PTX of kernels
    compiled, not interpreted, in a fresh process (TRITON_INTERPRET unset there). setup: Python source
    that imports what it needs and defines specs(), yielding (key, compute capability, kernel spec).
    -> key -> its sorted instructions."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    r = subprocess.run([sys.executable, "-c", _MMA_PROBE_HEAD + setup + _MMA_PROBE_TAIL], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def compile_small_bundle(graph, cfg, target: str):
    """`graph` (of ModelConfig `cfg`) compiled for `target` at the bundle tests' sizes: max_model_len
    256, 8 sequences, a 64-token batch, 16-token blocks; every kernel an ELF cubin.
    -> (the bundle, its manifest's kernels, its manifest's plans)."""
    import dataclasses

    from kiln.codegen.compile import compile_bundle

    b = compile_bundle(graph, target=target, model_config=dataclasses.asdict(cfg), config_hash=cfg.compute_hash(),
                       max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16)
    assert all(blob[:4] == b"\x7fELF" for blob in b.kernels.values())
    return b, b.manifest["kernels"], b.manifest["plans"]
