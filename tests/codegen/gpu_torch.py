"""What the torch-backed GPU kernel tests share (test_moe_gpu.py, test_gdn_gpu.py): the module-wide
skip when no CUDA device or the interpreter is on, and host <-> device copies that keep bf16 as bf16.
torch only holds device memory here."""
from __future__ import annotations

import numpy as np
import pytest

from tests.codegen.helpers import BF16, FP8, f32

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module", autouse=True)
def cuda():
    from kiln.codegen.triton.launch import interpreting

    if interpreting():
        pytest.skip("triton is in interpreter mode; run with TRITON_INTERPRET=0")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def dev(x: np.ndarray):
    if x.dtype == BF16:
        return torch.from_numpy(f32(x)).to("cuda", torch.bfloat16)
    if x.dtype == FP8:  # the same bytes, as torch.float8_e4m3fn
        return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).to("cuda").view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(x)).to("cuda")


def host(t) -> np.ndarray:
    torch.cuda.synchronize()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).cpu().numpy().view(FP8)
    return t.float().cpu().numpy().astype(BF16) if t.dtype == torch.bfloat16 else t.cpu().numpy()
