"""A tiny Qwen3.5 hybrid's GPU launch plans replayed on the CPU under the Triton interpreter
(as test_lowering.py does for Llama): a mixed step of three prompts (one past two GDN
chunks), a mixed step where one sequence continues its prefill while two decode, and a decode
step, each against the numpy executor on the same bf16 graph, with the GDN conv and recurrent
states the plans write in their slots."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kiln.codegen.buckets import Bucket
from kiln.codegen.lower import MERGE_COUNTER, Regions, input_layout, lower_bucket
from kiln.codegen.triton.configs import DEFAULT
from kiln.codegen.triton.launch import launch
from kiln.graph import DType, to_numpy
from kiln.graph.layout import stack_parts
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.passes.plan_memory import plan_memory
from kiln.runtime.worker.cpu_executor import CpuExecutor
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.codegen.helpers import require_interpreter
from tests.codegen.test_lowering import _host
from tests.tiny_models import HYBRID_BASE

NB, BS, MAX_LEN, SLOTS = 32, 16, 256, 4
DECODE, MIXED = Bucket(4, 4, 4, True), Bucket(256, 4, 4, False)


@pytest.fixture
def interpreter():
    require_interpreter()


pytestmark = pytest.mark.usefixtures("interpreter")


def _model(hf: dict | None = None):
    """A 4-layer hybrid (or the config `hf`) as its fused bf16 graph, with random weights."""
    cfg = ModelConfig.from_hf_dict(hf or {**HYBRID_BASE, "architectures": ["Qwen3_5ForCausalLM"],
                                          "num_hidden_layers": 4, "max_position_embeddings": MAX_LEN})
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16, block_size=BS))
    rng = np.random.default_rng(0)
    weights = {}
    for n, shape in graph.checkpoint_weights().items():
        x = rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 1.0 / shape[-1] ** 0.5)
        weights[n] = x.astype(np.float32 if n.endswith(("A_log", "dt_bias")) else to_numpy(DType.bf16))
    for t in graph.weights:
        if t.parts:
            weights[t.name] = stack_parts([weights[p] for p, _ in t.parts], t.interleave)
    return cfg, graph, weights


class _HybridPlan:
    def __init__(self, cfg, graph, weights):
        self.cfg, self.graph, self.mb = cfg, graph, MAX_LEN // BS
        self.plan = plan_memory(graph, {"T": MIXED.tokens, "S": 4, "S1": 5, "L": 4, "MB": self.mb})
        self.regions = regions = Regions()
        regions.need("arena", self.plan.arena_bytes)
        self.lowered = {b: lower_bucket(graph, self.plan, b, max_blocks_per_seq=self.mb, regions=regions,
                                        max_model_len=MAX_LEN, configs=DEFAULT) for b in (DECODE, MIXED)}
        self.ref = CpuExecutor(graph, weights.__getitem__, NB, num_state_slots=SLOTS)
        self.arrays = []
        for name in regions.names:
            kind, _, key = name.partition(":")
            if kind == "weight":
                self.arrays.append(weights[key].reshape(-1).view(np.uint8))
            elif kind == "state":  # random, not zeros: a fresh sequence must not read its slot
                st = self.ref.states[key]
                self.arrays.append(np.random.default_rng(1).integers(0, 64, st.nbytes, dtype=np.uint8))
            elif kind == "const":
                self.arrays.append(np.ascontiguousarray(regions.consts[key]).reshape(-1).view(np.uint8))
            elif name == MERGE_COUNTER:  # zeroed at load, as the runtime does
                self.arrays.append(np.zeros(regions.sizes[name], np.uint8))
            else:
                self.arrays.append(np.full(regions.sizes[name], 0xFF, np.uint8))  # NaN bytes: stale reads show

    def state(self, key):
        arr = self.arrays[self.regions.names.index(f"state:{key}")]
        st = self.ref.states[key]
        return arr.view(st.dtype).reshape(st.shape)

    def step(self, bucket, chunks):
        inputs = prepare_step(chunks, BS)
        want = self.ref.execute(inputs)[self.graph.outputs[0]]
        buf = self.arrays[self.regions.names.index("inputs")]
        s = len(inputs["seq_lens"])
        for name, (off, _, shape) in input_layout(bucket, self.mb, hybrid=True).items():
            v = buf[off: off + 4 * int(np.prod(shape))].view(np.int32).reshape(shape)
            arr = np.array([len(inputs["logits_indices"])]) if name == "num_logits" else inputs[name]
            v[...] = {"slot_mapping": -1, "state_slots": -1, "query_start_loc": int(inputs["query_start_loc"][s])
                      }.get(name, 0)
            v[tuple(slice(0, d) for d in arr.shape)] = arr
        for spec, args in self.lowered[bucket]:
            launch(spec, [_host(a, self.arrays) for a in args])
        arena = self.arrays[self.regions.names.index("arena")]
        n = len(inputs["logits_indices"])
        got = arena[self.plan.offsets[self.graph.outputs[0]]:].view(np.float32)[: n * self.cfg.vocab_size]
        return got.reshape(n, -1).copy(), want


def test_hybrid_plan_matches_numpy():
    cfg, graph, weights = _model()
    run = _HybridPlan(cfg, graph, weights)
    kernels = Counter(spec.kernel for spec, _ in run.lowered[MIXED])
    gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    assert kernels["gdn_chunked_kernel"] == kernels["gdn_recurrent_kernel"] == kernels["causal_conv1d_kernel"] == gdn
    assert Counter(spec.kernel for spec, _ in run.lowered[DECODE])["gdn_chunked_kernel"] == 0
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 140, 70)]
    blocks = [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    slots = [1, 2, 3]
    # sequence 2 (70 tokens) prefills 40 now, 30 in the next step beside two decodes
    chunks = [SeqChunk(prompts[0], 0, blocks[0], state_slot=1), SeqChunk(prompts[1], 0, blocks[1], state_slot=2),
              SeqChunk(prompts[2][:40], 0, blocks[2], state_slot=3)]
    steps = [run.step(MIXED, chunks)]
    nxt = steps[0][1].argmax(-1)
    chunks = [SeqChunk([int(nxt[0])], 5, blocks[0], state_slot=1), SeqChunk([int(nxt[1])], 140, blocks[1], state_slot=2),
              SeqChunk(prompts[2][40:], 40, blocks[2], state_slot=3)]
    steps.append(run.step(MIXED, chunks))
    nxt2 = steps[1][1].argmax(-1)
    chunks = [SeqChunk([int(nxt2[0])], 6, blocks[0], state_slot=1), SeqChunk([int(nxt2[1])], 141, blocks[1], state_slot=2),
              SeqChunk([int(nxt2[2])], 70, blocks[2], state_slot=3)]
    steps.append(run.step(DECODE, chunks))
    for got, want in steps:
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
    for key, st in run.ref.states.items():  # the plans left the same states in the used slots
        if key.startswith("gdn_"):
            got = run.state(key)[1:4].astype(np.float32)
            want = st[1:4].astype(np.float32)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * max(np.abs(want).max(), 1e-3))


def test_fp8_hybrid_plan_matches_numpy():
    """A block-wise FP8 hybrid (tests/test_fp8_hybrid.py: in_proj_a/b left bf16 as Qwen's files
    leave them) lowered with the FP8 kernels: every FP8 linear one fp8_gemm_kernel launch reading
    the e4m3 input a quantising kernel wrote (the input norms, the gated attention's output, the
    gated RMSNorm's output, SwiGLU), the GDN kernels as in the bf16 plan; a mixed step and the
    decode step after it against the numpy executor on the same bf16 graph. Whole plan within 0.1
    of the largest logit (measured 1.3e-2 and 1.5e-2), not the bf16 plan's 2e-2: a bf16 rounding
    that lands on the other side of an e4m3 boundary moves that activation a whole e4m3 step
    (tests/codegen/test_lowering_fp8.py's docstring; it checks the FP8 kernels node by node); a
    wrong scale, group or operand order moves the logits by their own size."""
    from tests.codegen.helpers import FP8
    from tests.fp8_checkpoints import BLOCK_CONFIG

    skip = [f"model.layers.{i}.linear_attn.in_proj_{c}" for i in range(3) for c in "ab"]
    cfg = ModelConfig.from_hf_dict({**HYBRID_BASE, "architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 4,
                                    "max_position_embeddings": MAX_LEN,
                                    "quantization_config": {**BLOCK_CONFIG, "modules_to_not_convert": skip}})
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16, block_size=BS))
    rng = np.random.default_rng(0)
    weights = {}
    for n, shape in graph.checkpoint_weights().items():
        t = graph.tensors.get(n)  # None: a part of a merged weight (in_proj_b+in_proj_a), bf16
        if t is not None and t.dtype == DType.fp8e4m3:
            weights[n] = np.clip(rng.standard_normal(shape) * 100, -448, 448).astype(FP8)
        elif n.endswith("weight_scale_inv"):
            k = graph.tensors[n.rsplit(".", 1)[0] + ".weight"].shape[1]
            weights[n] = (rng.uniform(0.5, 1.5, shape) / k ** 0.5 / 100).astype(np.float32)
        else:
            x = rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 1.0 / shape[-1] ** 0.5)
            weights[n] = x.astype(np.float32 if n.endswith(("A_log", "dt_bias")) else to_numpy(DType.bf16))
    for t in graph.weights:
        if t.parts:
            weights[t.name] = stack_parts([weights[p] for p, _ in t.parts], t.interleave)
    run = _HybridPlan(cfg, graph, weights)
    n_fp8 = [n.op for n in graph.nodes.values()].count("linear_fp8")
    assert n_fp8 == 3 * 3 + 4 + 4 * 3
    for b in (MIXED, DECODE):
        kernels = Counter(spec.kernel for spec, _ in run.lowered[b])
        assert kernels["fp8_gemm_kernel"] == n_fp8, b
        assert kernels["causal_conv1d_kernel"] == 3, b
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 70)]
    blocks = [[1, 2], [3, 4, 5, 6, 7]]
    steps = [run.step(MIXED, [SeqChunk(p, 0, b, state_slot=i + 1) for i, (p, b) in enumerate(zip(prompts, blocks))])]
    nxt = steps[0][1].argmax(-1)
    steps.append(run.step(DECODE, [SeqChunk([int(t)], len(p), b, state_slot=i + 1)
                                   for i, (t, p, b) in enumerate(zip(nxt, prompts, blocks))]))
    for got, want in steps:
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()
