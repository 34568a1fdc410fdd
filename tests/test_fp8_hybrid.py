"""Block-wise FP8 Qwen3.5 hybrids on the cpu target (W8A8: graph/fp8_ops.py) against transformers.

The tiny hybrid of tests/tiny_models.py quantised by the test (tests/fp8_checkpoints.py) as Qwen's
Qwen3.5/3.6-*-FP8 checkpoints are: quant_method "fp8", fmt "e4m3", activation_scheme "dynamic",
weight_block_size, e4m3 `weight` + f32 `weight_scale_inv` for every Linear of the text tower
(gated attention q/k/v/o, Gated DeltaNet in_proj_qkv, in_proj_z, out_proj, MLP) but those
modules_to_not_convert lists by the file's names: lm_head, the embeddings, each GDN layer's conv1d,
in_proj_a and in_proj_b, the vision tower. Two cases: Qwen3_5ForCausalLM with 16x16 blocks (many
activation groups a token) and two more linears left bf16 (a GDN out_proj, an MLP down_proj), and
the ForConditionalGeneration layout the real checkpoints ship (model.language_model.* names, vision
tower) with their [128, 128] blocks, on a widened tiny model whose every quantised dimension is a
multiple of 128 as the real ones are.

Oracle (W8A8): transformers in f32 with the dequantised weights, every FP8 linear's input rounded
to e4m3 per token per 128 (16) columns by torch's float8 cast, scale max(amax, 1e-10) / 448 (vLLM's
native_per_token_group_quant_fp8, as tests/fp8_checkpoints.py quantize_activations). kiln's numpy
and torch add in different orders, so an activation lying on a rounding boundary to within the two
f32 results' difference may round to the neighbouring e4m3 value on one side: about one element in
4e4 here, and on these tiny random models (where the activation rounding as a whole moves the
logits by 20-70 %) one such flip moves a prompt's logits by up to 13 % (measured). So the oracle
is told kiln's rounding of each linear's input (kiln's quantised activations, read from the graph's
own tensors) and takes it wherever the two disagree, after checking that every disagreement is
one e4m3 step at a boundary: torch's value within 1e-5 of the group's amax of the midpoint between
the two (measured at most 1e-6). Everything else is torch's own arithmetic. With that, kiln's
logits are within 1e-3 of the oracle's (measured 1.1e-6), and 32 greedy steps equal the oracle's.
The unrounded (W8A16) model is also asserted to differ by far more than that, so a path that
skips the activation rounding, or a wrong scale, fails."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from kiln.loader import load
from kiln.runtime.worker.cpu_executor import CpuExecutor
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.fp8_checkpoints import _leaf, check_w8a8_greedy, check_w8a8_logits, hooked_logits, make_fp8_checkpoint
from tests.test_fp8_models import _prompts, _rel

# every quantised dimension a multiple of 128: hidden 256, q_proj 4 x 2 x 64, k/v 2 x 64, GDN
# q|k|v 2 x 32 + 2 x 32 + 4 x 32 = 256 and z 128, MLP 512
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32)
CASES = [  # (variant, weight_block_size, text-config overrides, modules left bf16 beyond Qwen's list)
    ("qwen3_5_causal", (16, 16), None, ("model.layers.0.linear_attn.out_proj", "model.layers.3.mlp.down_proj")),
    ("qwen3_5_conditional", (128, 128), WIDE, ()),
]
# 6 GDN layers x 3 (in_proj_qkv, in_proj_z, out_proj) + 2 attention layers x 4 + 8 MLPs x 3
N_FP8 = 6 * 3 + 2 * 4 + 8 * 3
TIE = 1e-5  # a disagreement's distance from the rounding boundary, in units of its group's amax


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0])
def hybrid(request, tmp_path_factory):
    variant, block, overrides, skip = request.param
    d = tmp_path_factory.mktemp(f"{variant}_fp8")
    w8a16 = make_fp8_checkpoint(d, variant, "block", block=block, not_converted=skip, hybrid_overrides=overrides)
    lm = load(d, kv_cache_tokens=2048, tokenizer=False)
    return request.param, d, lm, w8a16


class _Probe:
    """kiln's quantised input (e4m3 values, f32 scales) of every linear_fp8, by its node name, for
    one prompt run as one step; the executor keeps them as extra outputs."""

    def __init__(self, lm):
        assert isinstance(lm.executor, CpuExecutor), type(lm.executor)  # the numpy reference runs FP8
        self.lm, g = lm, lm.graph
        self.fp8 = {n.name: n for n in g.nodes.values() if n.op == "linear_fp8"}
        for t in sorted({t for n in self.fp8.values() for t in n.inputs[:2]}):
            if t not in g.outputs:
                g.outputs.append(t)
        lm.executor._last_use = lm.executor._compute_last_use()

    def run(self, prompt):
        """-> (every position's logits, acts) of `prompt` prefilled in one step."""
        return self.run_chunk(SeqChunk(prompt, 0, list(range(-(-len(prompt) // self.lm.block_size)))))

    def run_chunk(self, chunk: SeqChunk):
        inputs = prepare_step([chunk], self.lm.block_size)
        inputs["logits_indices"] = np.arange(len(chunk.token_ids), dtype=np.int32)
        out = self.lm.executor.execute(inputs)
        acts = {name: (out[n.inputs[0]].astype(np.float32), out[n.inputs[1]]) for name, n in self.fp8.items()}
        return out[self.lm.graph.outputs[0]], acts


def _told_oracle(model, acts, stats, min_scale: float | None = None):
    """Hooks making `model` (the W8A16 oracle) the W8A8 oracle that takes kiln's rounding of each
    boundary element (see the module docstring); returns the hook handles. The activation scale:
    max(amax, 1e-10) / 448 (per token group), or with min_scale max(amax / 448, min_scale) (per
    token: vLLM's ref_dynamic_per_token_quant clamps at 1 / (448 * 512))."""
    handles = []
    for name, mod in model.named_modules():
        if "layers" not in name.split(".") or _leaf(name) not in model.fp8_linears or name in model.fp8_skip:
            continue
        parts = name.split(".")
        kq, ks = acts[f"layers.{parts[parts.index('layers') + 1]}.{parts[-1]}"]

        def hook(m, args, kq=kq, ks=ks, name=name):
            x = args[0]
            groups = ks.shape[1]
            t = x.reshape(-1, groups, x.shape[-1] // groups)
            amax = t.abs().amax(-1, keepdim=True)
            s = amax.clamp(min=1e-10) / 448.0 if min_scale is None else (amax / 448.0).clamp(min=min_scale)
            y = (t / s).clamp(-448.0, 448.0)
            q = y.to(torch.float8_e4m3fn).to(torch.float32)
            theirs = torch.from_numpy(kq).reshape(q.shape)
            differ = q != theirs
            stats["elements"] += q.numel()
            if differ.any():
                # one step apart, torch's value on the boundary between them
                lo, hi = torch.minimum(q, theirs)[differ], torch.maximum(q, theirs)[differ]
                assert bool((_ordinal(hi) - _ordinal(lo) == 1).all()), \
                    f"{name}: kiln's e4m3 activation is not one step from torch's"
                dist = float(((y[differ] - (lo + hi) / 2).abs() / 448.0).max())
                assert dist <= TIE, f"{name}: kiln rounds an activation {dist:.1e} (of its group's amax) " \
                                    f"from the rounding boundary otherwise than torch"
                stats["ties"] += int(differ.sum())
                q = torch.where(differ, theirs, q)
            return ((q * s).reshape(x.shape),)
        handles.append(mod.register_forward_pre_hook(hook))
    return handles


def _ordinal(v: torch.Tensor) -> torch.Tensor:
    """e4m3 values -> their rank on the e4m3 number line (neighbours differ by 1, +-0 rank 0)."""
    code = v.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    return torch.where(code >= 128, -(code - 128), code)


def _oracle_logits(model, prompt, acts, stats, min_scale: float | None = None):
    return hooked_logits(model, prompt, _told_oracle(model, acts, stats, min_scale))


def test_hybrid_graph_is_fp8(hybrid):
    """The quantised linears are FP8 ops on e4m3 weights sharing one quantisation of each input;
    in_proj_a/in_proj_b and the config's extra skips stay plain bf16 linears."""
    (variant, block, _, skip), _, lm, _ = hybrid
    ops = [n.op for n in lm.graph.nodes.values()]
    assert ops.count("linear_fp8") == N_FP8 - len(skip), variant
    assert {"add_rms_norm_quant", "silu_mul_quant"} <= set(ops)
    w = lm.executor.weights
    assert w["model.layers.0.linear_attn.in_proj_qkv.weight"].dtype.name == "float8_e4m3fn"
    c = lm.source.config
    n, k = c.num_attention_heads * 2 * c.head_dim, c.hidden_size  # q_proj: per head [query | gate]
    assert w["model.layers.3.self_attn.q_proj.weight_scale_inv"].shape == (n // block[0], k // block[1])
    fp8_weights = {t.name for t in lm.graph.weights if t.dtype == "fp8e4m3"}
    plain = [f"model.layers.{i}.linear_attn.in_proj_{c}" for i in (0, 1, 2, 4, 5, 6) for c in "ab"] + list(skip)
    assert not any(p in name for p in plain for name in fp8_weights), variant


def test_hybrid_logits_match_w8a8_oracle(hybrid):
    (variant, *_), _, lm, w8a16 = hybrid
    check_w8a8_logits(_Probe(lm), _oracle_logits, w8a16, _prompts(256, seed=1), variant)


def test_hybrid_greedy_tokens_match_w8a8_oracle(hybrid):
    """32 greedy steps of kiln (the prompt's prefill, then one decode step a token, as
    runtime/worker/generate.py greedy_generate steps) equal the oracle's argmax at every position
    of the generated sequence, the oracle told the rounding kiln's steps made of each token."""
    (variant, *_), _, lm, w8a16 = hybrid
    (prompt,) = _prompts(256, seed=2, lens=(16,))
    check_w8a8_greedy(lm, _Probe(lm), _oracle_logits, w8a16, prompt, variant)


def test_transformers_reads_the_hybrid_checkpoint_as_we_dequantise(hybrid):
    """transformers loads the block-wise FP8 hybrid itself on CPU (FineGrainedFP8, dequantised, with
    the file's modules_to_not_convert): its logits equal the W8A16 oracle's, so the checkpoint the
    test writes (scale orientation, which modules stay bf16 under which names) is the layout it reads."""
    (variant, *_), path, _, w8a16 = hybrid
    cls = (transformers.Qwen3_5ForConditionalGeneration if variant == "qwen3_5_conditional"
           else transformers.AutoModelForCausalLM)
    hf = cls.from_pretrained(path, dtype=torch.float32).eval()
    p = torch.tensor([_prompts(256, seed=4, lens=(20,))[0]])
    with torch.no_grad():
        assert _rel(hf(p).logits[0].numpy(), w8a16(p).logits[0].numpy()) < 1e-5
