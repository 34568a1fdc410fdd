"""Llama-3.1-8B and Qwen3-8B shapes with random weights, against transformers on CUDA:
kiln's bf16 logits are within the error transformers' own bf16 path has against the f32
truth, and greedy agreement is reported (exact counts)."""
from __future__ import annotations

import gc
import os

import ml_dtypes
import numpy as np
import pytest

from kiln.graph import DType
from kiln.loader import compile_model
from kiln.models.config import ModelConfig
from kiln.models.reference_shapes import SHAPES
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.worker.generate import greedy_generate
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")



class _Source:  # what compile_model needs of a ModelSource
    def __init__(self, cfg):
        self.config = cfg


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_8b_shape_against_transformers(shape, gpu_target, tmp_path):
    from kiln.runtime.worker.cuda_executor import CudaExecutor

    d = dict(SHAPES[shape], max_position_embeddings=8192)  # a short context keeps transformers' RoPE cache small
    if os.environ.get("KILN_8B_LAYERS"):  # a shallower model of the same widths, to separate depth from width
        d["num_hidden_layers"] = int(os.environ["KILN_8B_LAYERS"])
    hf_cfg = (transformers.LlamaConfig if shape.startswith("llama") else transformers.Qwen3Config)(**d)
    torch.manual_seed(0)
    cls = getattr(transformers, d["architectures"][0])
    with torch.device("cuda"):
        model = cls(hf_cfg).to(torch.bfloat16).eval()
        # the truth: the same bf16 weights in an f32 model built fresh, so its RoPE inv_freq buffer was
        # never rounded to bf16 (casting a model to bf16 and back keeps the rounded buffer)
        truth_model = cls(hf_cfg).eval()
    truth_model.load_state_dict(model.state_dict())
    state = {k: v.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16) for k, v in model.state_dict().items()}
    cfg = ModelConfig.from_hf_dict(d)
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))
    bundle = compile_model(_Source(cfg), graph, target=gpu_target, block_size=16, max_model_len=1024,
                           max_num_seqs=8, max_num_batched_tokens=512)
    ex = CudaExecutor(bundle, state.__getitem__, num_blocks=256)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (17, 64, 100, 130)]
    chunks, nxt = [], iter(range(1, 256))
    for p in prompts:
        chunks.append(SeqChunk(p, 0, [next(nxt) for _ in range(-(-(len(p) + 16) // 16))]))
    ours = ex.execute(prepare_step(chunks, 16))["logits"]
    err_kiln, err_hf = [], []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            theirs = model(ids).logits[0, -1].float()
            truth = truth_model(ids).logits[0, -1].float()
        truth, theirs = truth.cpu().numpy(), theirs.cpu().numpy()
        scale = np.abs(truth).max()
        err_kiln.append(np.abs(ours[i] - truth).max() / scale)
        err_hf.append(np.abs(theirs - truth).max() / scale)
    got = greedy_generate(ex, 16, prompts, 16)
    same = 0
    for p, g in zip(prompts, got):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        same += g == ref
    print(f"\n[{shape}] max relative logit error vs f32: kiln bf16 {max(err_kiln):.2e}, transformers bf16 "
          f"{max(err_hf):.2e}; greedy 16 steps identical to transformers bf16 on {same}/{len(prompts)} prompts")
    ex.close()
    del model, truth_model, state
    gc.collect()
    torch.cuda.empty_cache()
    assert np.isfinite(ours).all()
    assert max(err_kiln) <= 1.5 * max(err_hf) + 1e-3
