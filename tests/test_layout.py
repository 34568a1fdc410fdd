"""graph/layout.py: the rows of stacked weights as every executor stores them, and the CUDA
executor's strided part uploads checked against it on a fake device (no GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.graph.layout import part_copies, stack_parts, stacked_row_order
from kiln.runtime.worker.cuda_executor import CudaExecutor


def test_interleaved_gate_up_rows():
    order = stacked_row_order([48, 48], 16)
    # [g0..g15, u0..u15, g16..g31, u16..u31, g32..g47, u32..u47] in the plain stack's rows
    want = np.concatenate([np.arange(0, 16), 48 + np.arange(0, 16), np.arange(16, 32), 48 + np.arange(16, 32),
                           np.arange(32, 48), 48 + np.arange(32, 48)])
    np.testing.assert_array_equal(order, want)
    assert part_copies([48, 48], 16) == [(0, 16, 3, 32), (16, 16, 3, 32)]
    np.testing.assert_array_equal(stacked_row_order([8, 4, 4]), np.arange(16))  # plain: one after another
    assert part_copies([8, 4, 4]) == [(0, 8, 1, 8), (8, 4, 1, 4), (12, 4, 1, 4)]


@pytest.mark.parametrize("rows,g", [([64, 64], 16), ([32, 32, 32], 8), ([6, 2, 2], 0)])
def test_stack_parts_is_the_plain_stack_reordered(rows, g):
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((r, 5)).astype(np.float32) for r in rows]
    plain = np.concatenate(parts)
    stored = stack_parts(parts, g)
    np.testing.assert_array_equal(stored, plain[stacked_row_order(rows, g)])
    assert sorted(stacked_row_order(rows, g).tolist()) == list(range(sum(rows)))  # a permutation
    if g:  # and the SwiGLU epilogue's view of it: gate and up halves of each 2G group
        y = stored[:, 0].reshape(-1, len(rows), g)
        np.testing.assert_array_equal(y[:, 0].reshape(-1), parts[0][:, 0])
        np.testing.assert_array_equal(y[:, 1].reshape(-1), parts[1][:, 0])


def test_interleave_needs_equal_parts_of_whole_groups():
    with pytest.raises(ValueError, match="equal parts"):
        part_copies([32, 16], 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        part_copies([24, 24], 16)


class _FakeDevice:
    """malloc / upload / upload_2d on one host bytearray, as cuda_driver.CudaContext does them."""

    def __init__(self):
        self.mem = bytearray()

    def malloc(self, nbytes):
        ptr = len(self.mem)
        self.mem.extend(b"\xff" * nbytes)
        return ptr

    def upload(self, ptr, host):
        b = np.ascontiguousarray(host).tobytes()
        self.mem[ptr: ptr + len(b)] = b

    def upload_2d(self, ptr, host, *, width, height, dst_pitch):
        b = np.ascontiguousarray(host).tobytes()
        assert len(b) == width * height and dst_pitch >= width
        for j in range(height):
            self.mem[ptr + j * dst_pitch: ptr + j * dst_pitch + width] = b[j * width: (j + 1) * width]

    def to_device(self, host):
        ptr = self.malloc(host.nbytes)
        self.upload(ptr, host)
        return ptr


@pytest.mark.parametrize("parts,g", [((("gate", 64), ("up", 64)), 16), ((("q", 64), ("k", 32), ("v", 32)), 0)])
def test_cuda_executor_uploads_the_layout(parts, g):
    rng = np.random.default_rng(1)
    weights = {n: rng.standard_normal((r, 24)).astype(np.float32) for n, r in parts}

    class Exe:
        ctx = _FakeDevice()
        _weight = staticmethod(CudaExecutor._weight)

    exe = Exe()
    shape = [sum(r for _, r in parts), 24]
    ptr = CudaExecutor._upload_weight(exe, weights.__getitem__, "w", "f32", shape, [list(p) for p in parts],
                                      *([g] if g else []))
    got = np.frombuffer(bytes(exe.ctx.mem[ptr: ptr + 4 * shape[0] * 24]), np.float32).reshape(shape)
    np.testing.assert_array_equal(got, stack_parts([weights[n] for n, _ in parts], g))
