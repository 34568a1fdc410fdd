"""The arena plan: no two live activations share bytes, reuse happens, and a step
run inside the planned arena gives the same logits as one with private buffers."""
from __future__ import annotations

import numpy as np

from kiln.graph import TensorKind, to_numpy
from kiln.graph.op import run_reference
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.passes.plan_memory import plan_memory
from kiln.runtime.worker.cpu_executor import CpuExecutor
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.tiny_models import BASE


def _graph():
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 3})
    return run_pipeline(get_graph_builder(cfg.architecture)(cfg))


def test_live_tensors_never_overlap_and_memory_is_reused():
    g = _graph()
    dims = {"T": 64, "S": 4, "S1": 5, "L": 4, "MB": 8}
    plan = plan_memory(g, dims)
    items = list(plan.lifetimes.items())
    for i, (a, (fa, la)) in enumerate(items):
        for b, (fb, lb) in items[i + 1:]:
            if fa <= lb and fb <= la:
                oa, ob = plan.offsets[a], plan.offsets[b]
                assert oa + plan.sizes[a] <= ob or ob + plan.sizes[b] <= oa, (a, b)
    assert plan.arena_bytes < sum(plan.sizes.values()) / 4
    assert plan.offsets["layers.0.q_heads"] == plan.offsets["layers.0.q_proj"]  # a view shares bytes


def test_step_in_the_arena_matches_private_buffers():
    g = _graph()
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(s).astype(np.float32) * 0.3 for n, s in g.checkpoint_weights().items()}
    chunks = [SeqChunk(rng.integers(0, 256, n).tolist(), 0, [3 * i, 3 * i + 1, 3 * i + 2])
              for i, n in enumerate((5, 40, 19))]
    inputs = prepare_step(chunks, 16)
    ref = CpuExecutor(g, weights.__getitem__, 16).execute(inputs)["lm_head"]

    dims = {"T": 64, "S": 3, "S1": 4, "L": 3, "MB": 3}  # planned for a bigger bucket than the step
    plan = plan_memory(g, dims)
    arena = np.full(plan.arena_bytes, 0xFF, dtype=np.uint8)  # NaN-filled: stale reads show
    ex = CpuExecutor(g, weights.__getitem__, 16)
    step_dims = {"T": len(inputs["input_ids"]), "S": 3, "S1": 4, "L": 3, "MB": 3, "NB": 16}
    env = {**{k: v for k, v in inputs.items()}, **ex.weights, **ex.states}
    for node in g.topo_order():
        args = [env[t] if t else None for t in node.inputs]
        while args and args[-1] is None:
            args.pop()
        outs = run_reference(g.registry[node.op], args, node.attrs)
        for name, arr in zip(node.outputs, outs):
            t = g.tensors[name]
            if t.kind != TensorKind.ACTIVATION or name in plan.aliases:  # views alias arena bytes already
                env[name] = arr
                continue
            shape = t.concrete_shape(step_dims)
            view = arena[plan.offsets[name]:].view(to_numpy(t.dtype))[: int(np.prod(shape))].reshape(shape)
            view[...] = arr
            env[name] = view
    np.testing.assert_array_equal(env["lm_head"], ref)
