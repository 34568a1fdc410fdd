"""Build a GPU bundle: fused graph -> memory plan -> per-bucket launch plans ->
cubins (compiled on this machine, no GPU needed) -> runtime/bundle.py's format."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from kiln.codegen.buckets import Bucket, make_buckets
from kiln.codegen.lower import Regions, encode_args, input_layout, lower_bucket
from kiln.codegen.triton.aot import cache_key, compile_specs
from kiln.codegen.triton.configs import DEFAULT, Configs
from kiln.codegen.triton.sampling import sampler_specs
from kiln.graph import Graph
from kiln.passes.plan_memory import plan_memory
from kiln.runtime.bundle import Bundle

TARGETS = {"sm_90": "sm_90", "sm_121": "sm_121"}


def compile_bundle(graph: Graph, *, target: str, model_config: dict[str, Any], config_hash: str,
                   max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                   buckets: list[Bucket] | None = None, configs: Configs = DEFAULT,
                   progress: Callable[[str], None] = lambda s: None, batch_invariant: bool = True) -> Bundle:
    if target not in TARGETS:
        raise ValueError(f"unknown GPU target {target!r} (known: {', '.join(TARGETS)})")
    t0 = time.perf_counter()
    buckets = buckets or make_buckets(max_num_seqs, max_num_batched_tokens)
    mb = -(-max_model_len // block_size)
    biggest = max(buckets, key=lambda b: (b.tokens, b.seqs))
    dims = {"T": max(b.tokens for b in buckets), "S": max(b.seqs for b in buckets),
            "L": max(b.logits for b in buckets), "MB": mb}
    dims["S1"] = dims["S"] + 1
    plan = plan_memory(graph, dims)
    regions = Regions()
    regions.need("arena", plan.arena_bytes)
    recorded = {}
    for i, b in enumerate(buckets):
        progress(f"lowering bucket {b.name} ({i + 1}/{len(buckets)})")
        recorded[b] = lower_bucket(graph, plan, b, max_blocks_per_seq=mb, regions=regions,
                                   max_model_len=max_model_len, configs=configs, arch=target,
                                   batch_invariant=batch_invariant)
    specs: dict[str, Any] = {}
    for launches in recorded.values():
        for spec, _ in launches:
            specs.setdefault(cache_key(spec, target), spec)
    # The sampler's kernels, for the model's vocabulary: the runtime launches them on the
    # logits rows the plan leaves in the arena (runtime/gpu_sampler.py), by argument name.
    sampler = sampler_specs(int(graph.tensors[graph.outputs[0]].shape[1]))
    for spec in sampler.values():
        specs.setdefault(cache_key(spec, target), spec)
    progress(f"compiling {len(specs)} kernels for {target}")
    compiled = dict(zip(specs, compile_specs([(s, target) for s in specs.values()])))
    kernels = {k: c.cubin for k, c in compiled.items()}
    kernel_meta = {k: {"name": c.name, "shared": c.shared, "num_warps": c.num_warps, "n_hidden": c.n_hidden,
                       "signature": list(specs[k].signature.values())} for k, c in compiled.items()}
    plans = {}
    for b, launches in recorded.items():
        plans[b.name] = {
            "bucket": [b.tokens, b.seqs, b.logits, b.decode],
            "inputs": {n: [off, list(shape)] for n, (off, _, shape) in input_layout(b, mb).items()},
            "launches": [[cache_key(spec, target), list(spec.grid), encode_args(spec, args)]
                         for spec, args in launches],
        }
    out_name = graph.outputs[0]
    manifest = {
        "target": target, "config_hash": config_hash, "model_config": model_config,
        "block_size": block_size, "max_model_len": max_model_len, "batch_invariant": batch_invariant,
        "max_blocks_per_seq": mb,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "regions": regions.names, "region_bytes": regions.sizes,
        # name -> [dtype, shape] or [dtype, shape, [[part, rows], ...]]: a stacked weight (merged
        # q/k/v, gate/up) is these checkpoint tensors one after another along axis 0
        "weights": {t.name: [str(t.dtype), list(t.shape)] + ([[list(p) for p in t.parts]] if t.parts else [])
                    for t in graph.weights},
        "states": {t.name: [str(t.dtype), [d if isinstance(d, int) else str(d) for d in t.shape]]
                   for t in graph.states},
        "logits": {"offset": plan.offsets[out_name], "dtype": str(graph.tensors[out_name].dtype),
                   "vocab": int(graph.tensors[out_name].shape[1])},
        "kernels": kernel_meta, "plans": plans,
        "sampler": {role: {"kernel": cache_key(spec, target), "args": list(spec.signature)}
                    for role, spec in sampler.items()},
        "compile_seconds": round(time.perf_counter() - t0, 2),
    }
    consts = {k: np.ascontiguousarray(v) for k, v in regions.consts.items()}
    return Bundle(manifest, kernels, consts)
