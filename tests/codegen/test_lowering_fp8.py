"""Tiny FP8 models' GPU launch plans replayed on the CPU under the Triton interpreter (as
test_lowering.py does for bf16): every FP8 layout kiln runs (block-wise with 16-column groups,
compressed-tensors per channel, ModelOpt per tensor with static input scales), some linears left
bf16 by the config, a padded mixed step and the decode step after it, against the numpy
executor on the same bf16 graph.

Why node by node: the bf16 kernels before an FP8 linear (attention above all) differ from numpy
by bf16 roundings, as in test_lowering.py, and e4m3 turns such a difference into a whole e4m3
step (2^-4 to 2^-3 of the value) wherever it lands on the other side of a rounding boundary;
through two layers of a tiny random model that grew to ~8 % of the largest logit, too much for a
whole-plan tolerance to mean anything. So every node's launches are checked against its numpy
reference on the plan's own inputs (read from the arena before the launches run), with the
tolerance of its kernel: the FP8 GEMM within the f32 summation-order bound and a bf16 step
(test_fp8_kernels.py), the quantising producers with most e4m3 values the reference's bits and
the rest one step away, the bf16 ops within 2e-2 of their largest value (test_lowering.py's).
The first layer's FP8 ops come out bit-exact (its inputs are the embedding's, identical on
both sides). The logits of the whole plan are then only checked to be finite and close."""
from __future__ import annotations

import numpy as np
import pytest

import kiln.codegen.lower as L

from kiln.codegen.triton.configs import DEFAULT
from kiln.codegen.triton.launch import launch, recording
from kiln.graph import DType, to_numpy
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.worker.cpu_executor import run_reference
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.codegen.helpers import FP8, f32, require_interpreter
from tests.codegen.test_lowering import BS, BUCKETS, MAX_LEN, _host, _Plan
from tests.fp8_checkpoints import BLOCK_CONFIG, CHANNEL_CONFIG, MODELOPT_CONFIG
from tests.tiny_models import BASE

pytestmark = pytest.mark.usefixtures("interpreter")

SKIP = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"]
CONFIGS = {"block": {**BLOCK_CONFIG, "modules_to_not_convert": SKIP},
           "channel": {**CHANNEL_CONFIG, "ignore": ["lm_head", *SKIP]},
           "modelopt": MODELOPT_CONFIG}


@pytest.fixture
def interpreter():
    require_interpreter()


def fp8_model(arch: str, layout: str, seed: int = 0):
    """A tiny FP8 model's graph for a GPU target and random weights in its checkpoint layout:
    e4m3 values spread over e4m3's range, weight scales that make W = q * s about 1.5 / sqrt(K),
    static input scales about amax / 448 of the activations they quantise."""
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], "num_hidden_layers": 2,
                                    "max_position_embeddings": MAX_LEN, "quantization_config": CONFIGS[layout]})
    graph = run_pipeline(get_graph_builder(arch)(cfg, dtype=DType.bf16, block_size=BS))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in graph.checkpoint_weights().items():
        dtype = graph.tensors[name].dtype
        if dtype == DType.fp8e4m3:
            weights[name] = np.clip(rng.standard_normal(shape) * 100, -448, 448).astype(FP8)
        elif name.endswith("input_scale"):
            weights[name] = rng.uniform(0.005, 0.015, shape).astype(np.float32)
        elif name.endswith(("weight_scale", "weight_scale_inv")):
            k = graph.tensors[name.rsplit(".", 1)[0] + ".weight"].shape[1]
            weights[name] = (rng.uniform(0.5, 1.5, shape) * 1.5 / k ** 0.5 / 100).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 1.5 / shape[-1] ** 0.5)
                             + (1.0 if name.endswith("norm.weight") else 0.0)).astype(to_numpy(dtype))
    return cfg, graph, weights


QUANT_OPS = ("quant_fp8", "rms_norm_quant", "add_rms_norm_quant", "silu_mul_quant")


class _NodePlan(_Plan):
    """_Plan whose lowering remembers which launches each node made, so that a step can be
    replayed node by node."""

    def __init__(self, cfg, graph, weights):
        self.marks = {}
        self.inline = {}  # checked_step: the reference's values of the tensors the plan never stores
        lowering = self

        def lower(low):
            with recording() as launches:
                marks = []
                order = low.g.topo_order()
                low.position = {n.name: i for i, n in enumerate(order)}  # as _Lowerer.lower
                for node in order:
                    low.visited.add(node.name)
                    if node.name not in low.done:
                        getattr(low, f"op_{node.op}")(node)
                    marks.append((node, len(launches)))
            assert not low.moe_pending, f"MoE sums never launched for {sorted(low.moe_pending)}"
            lowering.marks[low.bucket] = (marks, low)
            return launches
        orig, L._Lowerer.lower = L._Lowerer.lower, lower
        try:
            super().__init__(cfg, graph, weights, DEFAULT)
        finally:
            L._Lowerer.lower = orig

    def check_prefill_then_decode(self) -> None:
        """Three prompts' prefill (BUCKETS[1]) then one decode step of each (BUCKETS[0]), every node
        checked (checked_step); the whole plan's logits finite and within a quarter of the largest
        (the module docstring says why not closer)."""
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 256, n).tolist() for n in (5, 33, 17)]
        blocks = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
        got, want = self.checked_step(BUCKETS[1], [SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)])
        nxt = [int(t) for t in want.argmax(-1)]
        steps = [(got, want), self.checked_step(BUCKETS[0], [SeqChunk([t], len(p), b)
                                                             for t, p, b in zip(nxt, prompts, blocks)])]
        for got, want in steps:
            assert np.isfinite(got).all()
            assert np.abs(got - want).max() <= 0.25 * np.abs(want).max()

    def read(self, low, name, live, inputs):
        """The plan's current value of tensor `name`, its live rows only; for a tensor the plan never
        stores (lower.py `unwritten`: a later launch computes it inline, as the norm after a MoE layer
        does its sum), the reference's value of it on the plan's inputs (checked_step)."""
        if name in self.inline:
            return self.inline[name]
        t = self.graph.tensors[name]
        if t.kind.name == "INPUT":
            return np.asarray(inputs[name])
        if t.kind.name == "STATE":  # the whole cache (the lowering's buffers say NB = 1)
            root = low.state_root(name)
            region = self.arrays[self.regions.names.index(f"state:{root}")]
            return region.view(self.ref.states[root].dtype).reshape(self.ref.states[root].shape).copy()
        arr = _host(low.buf(name), self.arrays).array
        rows = {"T": live, "L": len(inputs["logits_indices"])}.get(t.shape[0], arr.shape[0])
        return np.array(arr[:rows])

    def checked_step(self, bucket, chunks):
        """Run the bucket's plan on `chunks`, each node's launches checked against its reference
        on the plan's own inputs; -> (the plan's logits, the numpy executor's)."""
        inputs = prepare_step(chunks, BS)
        live = len(inputs["input_ids"])
        marks, low = self.marks[bucket]
        launches = self.lowered[bucket]
        self.stage(bucket, inputs)
        self.inline = {}
        prev = 0
        for node, end in marks:
            opdef = self.graph.registry[node.op]
            args = [self.read(low, t, live, inputs) if t else None for t in node.inputs]
            while args and args[-1] is None:
                args.pop()
            inline = [t in low.unwritten for t in node.outputs]
            want = (run_reference(opdef, args, node.attrs) if end > prev or node.op in ("reshape",) or any(inline)
                    else None)
            for spec, a in launches[prev:end]:
                launch(spec, [_host(x, self.arrays) for x in a])
            prev = end
            if want is None or node.op == "attention_preamble":  # (its cache write is checked by attention)
                continue
            for name, w, later in zip(node.outputs, want, inline):
                if later:  # checked where it is computed: in the outputs of the launch that reads it
                    self.inline[name] = w
                else:
                    _check_output(node, name, self.read(low, name, live, inputs), w)
        want = self.ref.execute(inputs)[self.graph.outputs[0]]
        return self.read(low, self.graph.outputs[0], live, inputs), want

    def stage(self, bucket, inputs):
        buf = self.arrays[self.regions.names.index("inputs")]
        s = len(inputs["seq_lens"])
        for name, (off, _, shape) in L.input_layout(bucket, self.mb).items():
            v = buf[off: off + 4 * int(np.prod(shape))].view(np.int32).reshape(shape)
            arr = np.array([len(inputs["logits_indices"])]) if name == "num_logits" else inputs[name]
            v[...] = {"slot_mapping": -1, "query_start_loc": int(inputs["query_start_loc"][s])}.get(name, 0)
            v[tuple(slice(0, d) for d in arr.shape)] = arr


def _check_output(node, name, got, want):
    what = f"{node.op} {name}"
    g, w = f32(got), f32(want)
    assert g.shape == w.shape, what
    assert np.isfinite(g).all(), f"{what}: non-finite"
    if got.dtype == FP8:
        exact = (np.ascontiguousarray(got).view(np.uint8) == np.ascontiguousarray(want).view(np.uint8)).mean()
        assert exact >= 0.97, f"{what}: only {exact:.1%} of the e4m3 values are the reference's"
        assert (np.abs(g - w) <= 2.0 ** -3 * np.abs(w) + 2.0 ** -6 * 448).all(), f"{what}: more than an e4m3 step"
    elif node.op in QUANT_OPS and name == node.outputs[1]:  # the scales: a bf16 step of an amax at most
        np.testing.assert_allclose(g, w, rtol=2.0 ** -7, atol=0, err_msg=what)
    elif node.op == "linear_fp8":  # a bf16 step plus the f32 order (test_fp8_kernels.py), with margin
        assert (np.abs(g - w) <= 2.0 ** -7 * np.abs(w) + 1e-3 * np.abs(w).max()).all(), what
    else:
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-2 * np.abs(w).max() + 1e-30, err_msg=what)


@pytest.mark.parametrize("arch,layout", [("LlamaForCausalLM", "block"), ("LlamaForCausalLM", "channel"),
                                         ("LlamaForCausalLM", "modelopt"), ("Qwen3ForCausalLM", "block")])
def test_fp8_plan_matches_numpy_node_by_node(arch, layout):
    cfg, graph, weights = fp8_model(arch, layout)
    run = _NodePlan(cfg, graph, weights)
    layers = cfg.num_hidden_layers
    for b in BUCKETS:
        kernels = [spec.kernel for spec, _ in run.lowered[b]]
        assert kernels.count("fp8_gemm_kernel") == 7 * layers - (len(SKIP) if layout != "modelopt" else 0)
        # every quantised linear's input is written by a quantising kernel, no bf16 round trip
        assert kernels.count("fp8_quant_kernel") == sum(n.op in QUANT_OPS for n in graph.nodes.values())
        if layout != "modelopt" and b.decode:  # layer 0's bf16 o_proj: linear_add, its residual added
            # by the quantising norm's launch right after it (lower._linear_add_then_norm_quant)
            specs = [spec for spec, _ in run.lowered[b]]
            assert any(a.kernel == "gemm_kernel" and c.kernel == "fp8_quant_kernel" and c.constexprs["MODE"] == 2
                       for a, c in zip(specs, specs[1:]))
    run.check_prefill_then_decode()
