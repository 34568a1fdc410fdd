"""The GPU launch plan, replayed on the CPU: lower a fused tiny model for several
buckets, relocate the plan's symbolic pointers into host buffers, run every
recorded launch under the Triton interpreter, and compare the logits with the
numpy executor on the same graph. This checks the lowering (buffers, offsets,
live-row counts, padding) without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.buckets import Bucket
from kiln.codegen.lower import REGION_SHIFT, Regions, input_layout, lower_bucket
from kiln.codegen.triton.configs import DEFAULT, Configs
from kiln.codegen.triton.launch import Buf, launch
from kiln.graph import DType, to_numpy
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.passes.plan_memory import plan_memory
from kiln.runtime.cpu_executor import CpuExecutor
from kiln.runtime.input_batch import SeqChunk, prepare_step
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


@pytest.mark.parametrize("arch,split", [("Qwen3ForCausalLM", False), ("LlamaForCausalLM", False),
                                        ("LlamaForCausalLM", True)])
def test_lowered_plan_matches_numpy(arch, split):
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], "num_hidden_layers": 2,
                                    "max_position_embeddings": MAX_LEN})
    graph = run_pipeline(get_graph_builder(arch)(cfg, dtype=DType.bf16, block_size=BS))
    rng = np.random.default_rng(0)
    weights = {n: (rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 1.5 / shape[-1] ** 0.5)
                   + (1.0 if n.endswith("norm.weight") else 0.0)).astype(to_numpy(DType.bf16))
               for n, shape in graph.checkpoint_weights().items()}
    for t in graph.weights:  # the stacked weights (q/k/v, gate/up), as the executor uploads them
        if t.parts:
            weights[t.name] = np.concatenate([weights[p] for p, _ in t.parts])
    mb = MAX_LEN // BS
    buckets = [Bucket(4, 4, 4, True), Bucket(64, 4, 4, False)]
    plan = plan_memory(graph, {"T": 64, "S": 4, "S1": 5, "L": 4, "MB": mb})
    regions = Regions()
    regions.need("arena", plan.arena_bytes)
    configs = Configs(lookup=_split_everything) if split else DEFAULT
    lowered = {b: lower_bucket(graph, plan, b, max_blocks_per_seq=mb, regions=regions, max_model_len=MAX_LEN,
                               configs=configs) for b in buckets}
    kernels = [spec.kernel for spec, _ in lowered[buckets[0]]]
    if split:  # o_proj and down leave their reduce to the add_rms_norm after them (the last
        # layer's down feeds the plain residual add before the final norm, and keeps it)
        fused = sum(spec.constexprs.get("X_SPLIT", 0) == 2 for spec, _ in lowered[buckets[0]])
        assert fused == 2 * cfg.num_hidden_layers - 1
        assert kernels.count("gemm_reduce_kernel") + fused == kernels.count("gemm_kernel")

    ref = CpuExecutor(graph, weights.__getitem__, NB)
    arrays = []
    for name in regions.names:
        kind, _, key = name.partition(":")
        if kind == "weight":
            arrays.append(weights[key].reshape(-1).view(np.uint8))
        elif kind == "state":
            arrays.append(np.zeros(ref.states[key].nbytes, np.uint8))
        elif kind == "const":
            arrays.append(np.ascontiguousarray(regions.consts[key]).reshape(-1).view(np.uint8))
        else:
            arrays.append(np.full(regions.sizes[name], 0xFF, np.uint8))  # NaN bytes: stale reads show

    def step(bucket, chunks):
        inputs = prepare_step(chunks, BS)
        want = ref.execute(inputs)["logits" if "logits" in graph.outputs else graph.outputs[0]]
        buf = arrays[regions.names.index("inputs")]
        lay = input_layout(bucket, mb)
        s = len(inputs["seq_lens"])
        for name, (off, _, shape) in lay.items():
            v = buf[off: off + 4 * int(np.prod(shape))].view(np.int32).reshape(shape)
            arr = np.array([len(inputs["logits_indices"])]) if name == "num_logits" else inputs[name]
            fill = {"slot_mapping": -1, "query_start_loc": int(inputs["query_start_loc"][s])}.get(name, 0)
            v[...] = fill
            v[tuple(slice(0, d) for d in arr.shape)] = arr
        for spec, args in lowered[bucket]:
            launch(spec, [_host(a, arrays) for a in args])
        out = graph.tensors[graph.outputs[0]]
        l_ = len(inputs["logits_indices"])
        got = arrays[regions.names.index("arena")][plan.offsets[out.name]:].view(np.float32)[: l_ * cfg.vocab_size].reshape(l_, -1)
        return got, want

    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 33, 17)]
    blocks = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    got, want = step(buckets[1], [SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)])  # mixed bucket, padded
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
    nxt = [int(t) for t in want.argmax(-1)]
    got, want = step(buckets[0], [SeqChunk([t], len(p), b) for t, p, b in zip(nxt, prompts, blocks)])  # decode
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
