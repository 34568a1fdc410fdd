"""The GPU launch plan, replayed on the CPU: lower a fused tiny model for several
buckets, relocate the plan's symbolic pointers into host buffers, run every
recorded launch under the Triton interpreter, and compare the logits with the
numpy executor on the same graph. This checks the lowering (buffers, offsets,
live-row counts, padding) without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.buckets import Bucket
from kiln.codegen.lower import MERGE_COUNTER, REGION_SHIFT, Regions, input_layout, lower_bucket
from kiln.codegen.triton.configs import DEFAULT, Configs
from kiln.codegen.triton.launch import Buf, launch
from kiln.graph import DType, to_numpy
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.graph.layout import stack_parts
from kiln.passes.pipeline import default_passes, run_pipeline
from kiln.passes.plan_memory import plan_memory
from kiln.runtime.worker.cpu_executor import CpuExecutor
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.codegen.helpers import same_bits
from tests.tiny_models import BASE

NB, BS, MAX_LEN = 24, 16, 128


def _host(arg, arrays):
    if not isinstance(arg, Buf):
        return arg
    region, off = arg.ptr >> REGION_SHIFT, arg.ptr & ((1 << REGION_SHIFT) - 1)
    base = arrays[region]
    item = np.dtype(arg.np_dtype).itemsize
    flat = base[off:].view(arg.np_dtype)
    view = np.lib.stride_tricks.as_strided(flat, shape=arg.shape, strides=[s * item for s in arg.strides])
    return Buf(view)


def _split_everything(op, key):
    # split-K 2 for every weight: the o_proj and down GEMMs then hand their partials to
    # add_rms_norm (no reduce launch), the q/k/v and gate/up GEMMs keep their reduce
    return {"split_k": 2, "block_k": 16} if op == "gemm_reduction" else None


def _fold_mixed(op, key):
    """_split_everything, and the GEMMs of more than 16 rows (the mixed bucket's) fold their
    splits (gemm.py FOLD) through the tile's word, as bench/gpu_shape_decode.py --gemm-fold
    sets it; decode keeps its partials. (Configs.gemm_fold's own rule folds only where the
    tiles fill an H200 twice, far past a tiny model.)"""
    return {"fold": key[0] > 16} if op == "gemm_tile" else _split_everything(op, key)


def _fold_mixed_through_memory(op, key):
    """_fold_mixed with tiles too large for two accumulators in registers (128 x 128, 4 warps:
    gemm.fold_through_memory), so the mixed bucket's GEMMs park their running sums in the
    workspace between splits."""
    if op == "gemm_tile" and key[0] > 16:
        return {"fold": True, "block_m": 128, "block_n": 128, "num_warps": 4}
    return _fold_mixed(op, key)


def _model(arch, fuse_silu=True, fuse_residual=True, fuse_rope=True):
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], "num_hidden_layers": 2,
                                    "max_position_embeddings": MAX_LEN})
    graph = run_pipeline(get_graph_builder(arch)(cfg, dtype=DType.bf16, block_size=BS),
                         default_passes(fuse_silu=fuse_silu, fuse_residual=fuse_residual, fuse_rope=fuse_rope))
    rng = np.random.default_rng(0)
    weights = {n: (rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 1.5 / shape[-1] ** 0.5)
                   + (1.0 if n.endswith("norm.weight") else 0.0)).astype(to_numpy(DType.bf16))
               for n, shape in graph.checkpoint_weights().items()}
    for t in graph.weights:  # the stacked weights (q/k/v, gate/up), as the executor uploads them
        if t.parts:
            weights[t.name] = stack_parts([weights[p] for p, _ in t.parts], t.interleave)
    return cfg, graph, weights


BUCKETS = [Bucket(4, 4, 4, True), Bucket(64, 4, 4, False)]  # decode, mixed


class _Plan:
    """The graph lowered for BUCKETS with `configs`, run launch by launch on host buffers."""

    def __init__(self, cfg, graph, weights, configs, fuse_merge=True):
        self.cfg, self.graph = cfg, graph
        self.mb = MAX_LEN // BS
        self.plan = plan_memory(graph, {"T": 64, "S": 4, "S1": 5, "L": 4, "MB": self.mb})
        self.regions = regions = Regions()
        regions.need("arena", self.plan.arena_bytes)
        self.lowered = {b: lower_bucket(graph, self.plan, b, max_blocks_per_seq=self.mb, regions=regions,
                                        max_model_len=MAX_LEN, configs=configs, fuse_merge=fuse_merge)
                        for b in BUCKETS}
        self.ref = CpuExecutor(graph, weights.__getitem__, NB)
        self.arrays = []
        for name in regions.names:
            kind, _, key = name.partition(":")
            if kind == "weight":
                self.arrays.append(weights[key].reshape(-1).view(np.uint8))
            elif kind == "state":
                self.arrays.append(np.zeros(self.ref.states[key].nbytes, np.uint8))
            elif kind == "const":
                self.arrays.append(np.ascontiguousarray(regions.consts[key]).reshape(-1).view(np.uint8))
            elif name == MERGE_COUNTER:  # zeroed at load, as the runtime does; the kernel keeps it so
                self.arrays.append(np.zeros(regions.sizes[name], np.uint8))
            else:
                self.arrays.append(np.full(regions.sizes[name], 0xFF, np.uint8))  # NaN bytes: stale reads show

    def launches(self, bucket):
        """[(spec, {argument name: value})] of the bucket's plan."""
        return [(spec, dict(zip(spec.signature, args))) for spec, args in self.lowered[bucket]]

    def step(self, bucket, chunks):
        """-> (the plan's logits, the numpy executor's)"""
        graph, regions, arrays = self.graph, self.regions, self.arrays
        inputs = prepare_step(chunks, BS)
        want = self.ref.execute(inputs)["logits" if "logits" in graph.outputs else graph.outputs[0]]
        buf = arrays[regions.names.index("inputs")]
        lay = input_layout(bucket, self.mb)
        s = len(inputs["seq_lens"])
        for name, (off, _, shape) in lay.items():
            v = buf[off: off + 4 * int(np.prod(shape))].view(np.int32).reshape(shape)
            arr = np.array([len(inputs["logits_indices"])]) if name == "num_logits" else inputs[name]
            fill = {"slot_mapping": -1, "query_start_loc": int(inputs["query_start_loc"][s])}.get(name, 0)
            v[...] = fill
            v[tuple(slice(0, d) for d in arr.shape)] = arr
        for spec, args in self.lowered[bucket]:
            launch(spec, [_host(a, arrays) for a in args])
        out = graph.tensors[graph.outputs[0]]
        n = len(inputs["logits_indices"])
        arena = arrays[regions.names.index("arena")]
        got = arena[self.plan.offsets[out.name]:].view(np.float32)[: n * self.cfg.vocab_size].reshape(n, -1)
        return got.copy(), want

    def prefill_then_decode(self):
        """A padded mixed step of three prompts, then a decode step of their next tokens:
        -> [(got, want)] for each, both checked against numpy."""
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 256, n).tolist() for n in (5, 33, 17)]
        blocks = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
        mixed = self.step(BUCKETS[1], [SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)])
        nxt = [int(t) for t in mixed[1].argmax(-1)]
        decode = self.step(BUCKETS[0], [SeqChunk([t], len(p), b) for t, p, b in zip(nxt, prompts, blocks)])
        for got, want in (mixed, decode):
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
        return mixed, decode


@pytest.mark.parametrize("arch,split", [("Qwen3ForCausalLM", False), ("LlamaForCausalLM", False),
                                        ("LlamaForCausalLM", True)])
def test_lowered_plan_matches_numpy(arch, split):
    cfg, graph, weights = _model(arch)
    run = _Plan(cfg, graph, weights, Configs(lookup=_split_everything) if split else DEFAULT)
    if split:  # o_proj and down leave their reduce to the add_rms_norm after them (the last
        # layer's down feeds the plain residual add before the final norm, and keeps it)
        kernels = [spec.kernel for spec, _ in run.lowered[BUCKETS[0]]]
        fused = sum(spec.constexprs.get("X_SPLIT", 0) == 2 for spec, _ in run.lowered[BUCKETS[0]])
        assert fused == 2 * cfg.num_hidden_layers - 1
        assert kernels.count("gemm_reduce_kernel") + fused == kernels.count("gemm_kernel")
    run.prefill_then_decode()


@pytest.mark.parametrize("through_memory", [False, True])
def test_folded_plan_gives_the_split_plans_bits(through_memory):
    """The same model lowered with split-K everywhere, once with partials (reduced by
    gemm_reduce_kernel, or by the add_rms_norm after o_proj and down) and once folded in the
    mixed bucket's GEMMs (in registers, or through the workspace for tiles too large for two
    accumulators): the logits of a mixed step and of the decode step after it are the
    same bits. The fold replaces the fused norms' partial sums there, so this also proves that
    the norm reading a folded GEMM's output rounds as the norm summing partials does. (The q/k/v
    GEMM stays a plain one here: with the preamble in its epilogue it always folds.)"""
    cfg, graph, weights = _model("LlamaForCausalLM", fuse_rope=False)
    split = _Plan(cfg, graph, weights, Configs(lookup=_split_everything))
    fold = _Plan(cfg, graph, weights, Configs(lookup=_fold_mixed_through_memory if through_memory else _fold_mixed))
    mixed = fold.launches(BUCKETS[1])
    gemms = [(spec.constexprs["FOLD"], spec.grid[2], a["M"]) for spec, a in mixed if spec.kernel == "gemm_kernel"]
    # q/k/v, o_proj, gate/up and down of every layer fold (one program per tile); the LM head
    # runs on the 4 sampled rows and keeps its partials and reduce
    assert [g for g in gemms if g[0]] == [(True, 1, 64)] * 4 * cfg.num_hidden_layers
    assert [spec.constexprs.get("FOLD_MEM", False) for spec, _ in mixed
            if spec.kernel == "gemm_kernel" and spec.constexprs["FOLD"]] == [through_memory] * 4 * cfg.num_hidden_layers
    assert [g for g in gemms if not g[0]] == [(False, 2, 4)]
    assert [a["M"] for spec, a in mixed if spec.kernel == "gemm_reduce_kernel"] == [4]
    assert not any(spec.constexprs.get("X_SPLIT") for spec, _ in mixed)
    assert any(spec.constexprs.get("X_SPLIT") for spec, _ in split.launches(BUCKETS[1]))
    assert [s for s, _ in fold.lowered[BUCKETS[0]]] == [s for s, _ in split.lowered[BUCKETS[0]]]  # decode
    for (got, _), (want, _), what in zip(fold.prefill_then_decode(), split.prefill_then_decode(),
                                         ("mixed", "decode")):
        assert same_bits(got, want), f"{what} step: the folded plan's logits differ from the split plan's"


@pytest.mark.parametrize("configs", ["default", "split", "fold"])
def test_fused_swiglu_plan_gives_the_unfused_plans_bits(configs):
    """passes/fuse_gate_up_silu.py: the gate/up GEMM with the SwiGLU epilogue over the
    interleaved weight, against the graph without that pass (gate/up GEMM, then silu_mul on its
    halves): the logits of a padded mixed step and of the decode step after it are the same
    bits, with split-K off (default), split-K partials reduced by gemm_reduce_kernel's epilogue
    (split) and split-K folded in the mixed bucket (fold). No silu_mul launch is left."""
    lookup = {"default": None, "split": _split_everything, "fold": _fold_mixed}[configs]
    cfg, fused_graph, fused_w = _model("LlamaForCausalLM")
    _, plain_graph, plain_w = _model("LlamaForCausalLM", fuse_silu=False)
    assert sum(n.op == "linear_silu_mul" for n in fused_graph.nodes.values()) == cfg.num_hidden_layers
    assert not any(n.op == "linear_silu_mul" for n in plain_graph.nodes.values())
    fused = _Plan(cfg, fused_graph, fused_w, Configs(lookup=lookup))
    plain = _Plan(cfg, plain_graph, plain_w, Configs(lookup=lookup))
    for b in BUCKETS:
        kernels = [spec.kernel for spec, _ in fused.lowered[b]]
        assert "silu_mul_kernel" not in kernels
        assert len(fused.lowered[b]) == len(plain.lowered[b]) - cfg.num_hidden_layers
        silu = [spec for spec, _ in fused.lowered[b] if spec.constexprs.get("SILU_GROUP")]
        assert len(silu) == cfg.num_hidden_layers * (2 if configs == "split" or (configs == "fold" and b.decode)
                                                     else 1)  # + the reduce kernel where split-K is not folded
    for (got, _), (want, _), what in zip(fused.prefill_then_decode(), plain.prefill_then_decode(),
                                         ("mixed", "decode")):
        assert same_bits(got, want), f"{what} step: the fused SwiGLU plan's logits differ from the unfused plan's"


@pytest.mark.parametrize("configs", ["default", "split", "fold"])
def test_residual_epilogue_plan_gives_the_unfused_plans_bits(configs):
    """passes/fuse_residual_into_linear.py: o_proj and down add the residual in their epilogue
    where the bucket has more than 16 rows and the program stores y (the mixed bucket, unless
    split-K is left unfolded); elsewhere the norm's launch adds it as before. Against the graph
    without the pass, the logits of a padded mixed step and of the decode step after it are the
    same bits, and the decode bucket's plan is the same launches."""
    lookup = {"default": None, "split": _split_everything, "fold": _fold_mixed}[configs]
    cfg, fused_graph, w = _model("LlamaForCausalLM")
    _, plain_graph, _ = _model("LlamaForCausalLM", fuse_residual=False)
    assert sum(n.op == "linear_add" for n in fused_graph.nodes.values()) == 2 * cfg.num_hidden_layers - 1
    fused = _Plan(cfg, fused_graph, w, Configs(lookup=lookup))
    plain = _Plan(cfg, plain_graph, w, Configs(lookup=lookup))
    for b in BUCKETS:
        res = [spec for spec, _ in fused.lowered[b] if spec.constexprs.get("HAS_RES")]
        epilogue = not b.decode and configs != "split"  # 64 rows; split-K unfolded leaves it to the norm
        assert len(res) == (2 * cfg.num_hidden_layers - 1 if epilogue else 0)
        kernels = lambda plan: [spec.kernel for spec, _ in plan.lowered[b]]
        if epilogue:  # the same number of launches, the adds moved from the norms into the GEMMs
            assert len(kernels(fused)) == len(kernels(plain))
        else:  # the plan the graph had before the pass
            assert kernels(fused) == kernels(plain)
    for (got, _), (want, _), what in zip(fused.prefill_then_decode(), plain.prefill_then_decode(),
                                         ("mixed", "decode")):
        assert same_bits(got, want), f"{what} step: the residual-epilogue plan's logits differ from the unfused plan's"


@pytest.mark.parametrize("configs", ["default", "split"])
def test_rope_epilogue_plan_gives_the_unfused_plans_bits(configs):
    """The q/k/v GEMM with the attention preamble in its epilogue (gemm_rope_kernel: Llama's
    full-rotary neox heads, no q/k norm) in every bucket: one launch less a layer, and the
    logits of a padded mixed step and of the decode step after it (which reads the K/V the
    mixed step cached) are the bits of the plan with the preamble's own launch. "split":
    q/k/v in split-K 2, which the fused GEMM folds. Qwen3's q/k norm keeps the preamble."""
    lookup = {"default": None, "split": _split_everything}[configs]
    cfg, graph, w = _model("LlamaForCausalLM")
    _, plain_graph, _ = _model("LlamaForCausalLM", fuse_rope=False)
    assert sum(n.op == "linear_rope" for n in graph.nodes.values()) == cfg.num_hidden_layers
    fused = _Plan(cfg, graph, w, Configs(lookup=lookup))
    plain = _Plan(cfg, plain_graph, w, Configs(lookup=lookup))
    for b in BUCKETS:
        kernels = lambda plan: [spec.kernel for spec, _ in plan.lowered[b]]
        assert kernels(fused).count("gemm_rope_kernel") == cfg.num_hidden_layers
        assert "attention_preamble_kernel" not in kernels(fused)
        folded = kernels(plain).count("gemm_reduce_kernel") - kernels(fused).count("gemm_reduce_kernel")
        assert folded == (cfg.num_hidden_layers if configs == "split" else 0)  # q/k/v's reduce launch
        assert len(kernels(fused)) == len(kernels(plain)) - cfg.num_hidden_layers - folded
    for (got, _), (want, _), what in zip(fused.prefill_then_decode(), plain.prefill_then_decode(),
                                         ("mixed", "decode")):
        assert same_bits(got, want), f"{what} step: the rope-epilogue plan's logits differ from the unfused plan's"
    qcfg, qgraph, qw = _model("Qwen3ForCausalLM")
    qplan = _Plan(qcfg, qgraph, qw, Configs())
    for b in BUCKETS:
        names = [spec.kernel for spec, _ in qplan.lowered[b]]
        assert "gemm_rope_kernel" not in names and names.count("attention_preamble_kernel") == qcfg.num_hidden_layers


def _small_segments(op, key):
    """16-key segments: the decode step's sequences (5, 33 and 17 keys) span 1 to 3 of 8."""
    return {"tile": 16, "seg": 16} if op == "paged_attention" else None


def test_decode_plan_merges_split_kv_in_the_attention_kernel():
    """A split-KV decode bucket launches one attention kernel per layer, which merges its
    segments itself (MERGE); its counters are all zero again after the step; and the logits
    are the bits of the plan that merges in a second launch (attention_merge_kernel)."""
    cfg, graph, weights = _model("LlamaForCausalLM")
    configs = Configs(lookup=_small_segments)
    fused = _Plan(cfg, graph, weights, configs)
    decode = [spec for spec, _ in fused.lowered[BUCKETS[0]]]
    attn = [s for s in decode if s.kernel == "paged_attention_kernel"]
    assert len(attn) == cfg.num_hidden_layers
    assert all(s.constexprs["SPLIT"] and s.constexprs["MERGE"] and s.grid[2] == 8 for s in attn)
    assert "attention_merge_kernel" not in {s.kernel for s in decode}
    hkv = graph.tensors[next(n for n in graph.nodes.values() if n.op == "paged_attention").inputs[1]].shape[3]
    assert fused.regions.sizes[MERGE_COUNTER] == 4 * BUCKETS[0].seqs * hkv
    mixed = [spec for spec, _ in fused.lowered[BUCKETS[1]]]
    assert not any(s.constexprs.get("MERGE") for s in mixed)
    got = fused.prefill_then_decode()
    assert not fused.arrays[fused.regions.names.index(MERGE_COUNTER)].any(), "a merge counter was left nonzero"

    plain = _Plan(cfg, graph, weights, configs, fuse_merge=False)
    kernels = [spec.kernel for spec, _ in plain.lowered[BUCKETS[0]]]
    assert kernels.count("attention_merge_kernel") == cfg.num_hidden_layers
    assert len(kernels) == len(decode) + cfg.num_hidden_layers and MERGE_COUNTER not in plain.regions.names
    for (a, _), (b, _), what in zip(got, plain.prefill_then_decode(), ("mixed", "decode")):
        assert same_bits(a, b), f"{what} step: merging in the attention kernel changed the logits"


def _route_mixed(op, key):
    return {"route_mixed": True} if op == "paged_attention" else None


def test_routed_mixed_plan_gives_the_plain_plans_bits():
    """config.route_mixed: the mixed bucket's sequences of one query in a launch of the decode
    variant of their own, the rest in the prefill variant (two attention launches a layer; the
    decode bucket keeps its one). After a prefill and a decode step, a mixed step of two decode
    rows around a new prompt: the routed plan's logits are the unrouted plan's bits, and
    numpy's numbers."""
    cfg, graph, weights = _model("LlamaForCausalLM")
    plain = _Plan(cfg, graph, weights, DEFAULT)
    routed = _Plan(cfg, graph, weights, Configs(lookup=_route_mixed))
    attn = lambda p, b: [(s.constexprs["DECODE"], s.constexprs.get("ROUTE", False))  # noqa: E731
                         for s, _ in p.lowered[b] if s.kernel == "paged_attention_kernel"]
    layers = cfg.num_hidden_layers
    assert attn(routed, BUCKETS[1]) == [(True, True), (False, True)] * layers
    assert attn(plain, BUCKETS[1]) == [(False, False)] * layers
    assert [s for s, _ in routed.lowered[BUCKETS[0]]] == [s for s, _ in plain.lowered[BUCKETS[0]]]
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, 20).tolist()
    steps = []
    for p in (plain, routed):
        (_, mixed), (_, decode) = p.prefill_then_decode()
        a, c = int(decode[0].argmax()), int(decode[2].argmax())  # prompts of 5 and 17, one token each since
        steps.append(p.step(BUCKETS[1], [SeqChunk([a], 6, [1, 2, 3]), SeqChunk(prompt, 0, [11, 12]),
                                         SeqChunk([c], 18, [8, 9, 10])]))
    (want, ref), (got, _) = steps
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-2 * np.abs(ref).max())
    assert same_bits(got, want), "routing the mixed step's decode rows changed the logits"
