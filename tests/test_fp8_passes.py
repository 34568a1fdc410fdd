"""The FP8 ops' numpy references (graph/fp8_ops.py) against vLLM's reference semantics written
here in torch, and the two FP8 fusions (passes/fuse_rmsnorm_quant.py, fuse_silu_mul_quant.py):
the fused graph gives exactly the unfused graph's numbers, and --dump-ir shows the fused ops."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.build import main as build_main
from kiln.graph.fp8_ops import linear_fp8, quantize_fp8
from kiln.models.quant_config import MIN_SCALE_GROUP, MIN_SCALE_TOKEN
from kiln.models.registry import get_graph_builder
from kiln.models.source import open_model
from kiln.passes.fuse_rmsnorm_quant import FuseRmsNormQuant
from kiln.passes.fuse_silu_mul_quant import FuseSiluMulQuant
from kiln.passes.pipeline import default_passes, run_pipeline
from kiln.runtime.worker.cpu_executor import CpuExecutor
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.fp8_checkpoints import make_fp8_checkpoint


def _torch_group_quant(x: np.ndarray, group: int, min_scale: float):
    """vLLM's native_per_token_group_quant_fp8 / ref_dynamic_per_token_quant, in torch."""
    t = torch.from_numpy(x).reshape(x.shape[0], -1, group)
    s = (t.abs().amax(-1, keepdim=True) / 448.0).clamp(min=min_scale)
    q = (t / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(x.shape).to(torch.float32).numpy(), s.squeeze(-1).numpy()


@pytest.mark.parametrize("group, min_scale", [(16, MIN_SCALE_GROUP), (128, MIN_SCALE_GROUP), (64, MIN_SCALE_TOKEN)])
def test_quant_fp8_is_vllms_reference(group, min_scale):
    rng = np.random.default_rng(group)
    x = (rng.standard_normal((9, 128)) * rng.uniform(0.01, 30, (9, 1))).astype(np.float32)
    x[3] = 0.0  # a zero row: the scale floor, zeros out
    q, s = quantize_fp8(x, (), group, min_scale)
    tq, ts = _torch_group_quant(x, group, min_scale)
    assert q.dtype.name == "float8_e4m3fn" and s.shape == (9, 128 // group)
    np.testing.assert_array_equal(q.astype(np.float32), tq)
    np.testing.assert_array_equal(s, ts)
    assert not q[3].astype(np.float32).any()
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 of itself, or 2^-10 scale in the subnormals
    err = np.abs(q.astype(np.float32).reshape(9, -1, group) * s[..., None] - x.reshape(9, -1, group))
    assert np.all(err <= np.maximum(2.0 ** -4 * np.abs(x.reshape(9, -1, group)), 2.0 ** -10 * s[..., None]) * 1.0001)


def test_static_quant_takes_the_largest_input_scale():
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32) * 3
    q, s = quantize_fp8(x, (np.array([0.01], np.float32), np.array([0.02], np.float32)), 32, 0.0)
    assert np.all(s == np.float32(0.02)) and s.shape == (4, 1)
    tq = torch.from_numpy(x / np.float32(0.02)).clamp(-448, 448).to(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(q.astype(np.float32), tq)


@pytest.mark.parametrize("n, k, block, groups", [(40, 64, (16, 16), 4), (48, 64, (1, 64), 1), (48, 64, (48, 64), 1)],
                         ids=["block-ragged-n", "channel", "tensor"])
def test_linear_fp8_is_the_dequantised_product(n, k, block, groups):
    """vLLM's native_w8a8_block_matmul: per k-block, (A_q @ B_q^T) * As * Bs, summed; here
    against the f64 product of the dequantised operands."""
    rng = np.random.default_rng(n + groups)
    x = rng.standard_normal((5, k)).astype(np.float32)
    xq, xs = quantize_fp8(x, (), k // groups, MIN_SCALE_GROUP)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bn, bk = block
    ws = rng.uniform(0.5, 2.0, (-(-n // bn), -(-k // bk))).astype(np.float32)
    wq = np.clip(w * 100, -448, 448).astype(xq.dtype)
    bias = rng.standard_normal(n).astype(np.float32)
    got = linear_fp8(xq, xs, wq, ws, bias, block=block, out_dtype="f32")
    a = xq.astype(np.float64) * np.repeat(xs, k // groups, axis=1)
    b = wq.astype(np.float64) * np.repeat(np.repeat(ws, bn, 0), bk, 1)[:n, :k]
    ref = a @ b.T + bias
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-6


@pytest.fixture(scope="module", params=["block", "channel", "modelopt"])
def fp8_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"fp8_{request.param}")
    make_fp8_checkpoint(d, "qwen3_qknorm", request.param, calib_prompts=[list(range(1, 60))])
    return d


def test_fused_graph_gives_the_unfused_numbers(fp8_dir):
    source = open_model(fp8_dir)
    fusions = (FuseRmsNormQuant, FuseSiluMulQuant)
    prompts = [np.random.default_rng(s).integers(0, 256, n).tolist() for s, n in enumerate((5, 21, 40))]
    chunks = [SeqChunk(p, 0, [3 * i, 3 * i + 1, 3 * i + 2]) for i, p in enumerate(prompts)]
    inputs = prepare_step(chunks, 16)
    inputs["logits_indices"] = np.arange(len(inputs["input_ids"]), dtype=np.int32)
    logits, ops = [], []
    for keep in (False, True):
        graph = get_graph_builder(source.config.architecture)(source.config)
        graph = run_pipeline(graph, [p for p in default_passes() if keep or not isinstance(p, fusions)])
        ops.append({n.op for n in graph.nodes.values()})
        ex = CpuExecutor(graph, source.weights.get, num_blocks=16)
        logits.append(ex.execute(inputs)[graph.outputs[0]])
    assert "add_rms_norm_quant" not in ops[0] and {"rms_norm_quant", "add_rms_norm_quant", "silu_mul_quant"} <= ops[1]
    np.testing.assert_array_equal(logits[0], logits[1])


def test_dump_ir_shows_the_fp8_fusions(fp8_dir, tmp_path):
    assert build_main(["compile", "--model", str(fp8_dir), "--target", "cpu", "--dump-ir", str(tmp_path)]) == 0
    dumps = sorted(tmp_path.glob("*.txt"))
    names = [d.name for d in dumps]
    assert any("fuse_rmsnorm_quant" in n for n in names) and any("fuse_silu_mul_quant" in n for n in names)
    final = dumps[-1].read_text()
    assert "= add_rms_norm_quant(" in final and "= silu_mul_quant(" in final and "= linear_fp8(" in final
    assert "= quant_fp8(" in dumps[0].read_text()  # before the passes, the quantisation is an op of its own
