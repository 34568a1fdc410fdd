"""Build a GPU bundle: fused graph -> memory plan -> per-bucket launch plans ->
cubins (compiled on this machine, no GPU needed) -> runtime/worker/bundle.py's format."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kiln.codegen.buckets import Bucket, make_buckets
from kiln.codegen.lower import COLLECTIVES, Regions, encode_args, encode_nccl, input_layout, is_hybrid, lower_bucket
from kiln.codegen.triton.collective import NcclCall
from kiln.codegen.triton.aot import cache_key, compile_specs, default_cache_dir
from kiln.codegen.triton.configs import DEFAULT, Configs
from kiln.codegen.triton.sampling import sampler_manifest, sampler_specs
from kiln.graph import Graph
from kiln.passes.plan_memory import plan_memory
from kiln.runtime.worker.bundle import Bundle, BundleError

TARGETS = {"sm_90": "sm_90", "sm_121": "sm_121"}
PDL_TARGETS = ("sm_90", "sm_121")  # griddepcontrol: sm_90 and later


PDL_PLAIN_RULES = ("named", "none", "wide:N")  # see pdl_launches


GEMM_KERNELS = ("gemm_kernel", "gemm_rope_kernel")  # the plain GEMM, and the q/k/v one with the preamble


def pdl_launches(launches: list, plain: str = "named") -> list:
    """The plan's launches compiled for programmatic dependent launch (codegen/triton/pdl.py),
    but the GEMMs that `plain` names, which go out plainly:
      named   (the default) a GEMM right behind another GEMM, or behind the attention kernel
              that merges its split-KV segments itself (MERGE). Measured on the H200, batch-1
              decode graph (docs/GPU_NOTES.md): the down GEMM launched early behind gate/up
              (SiLU in its epilogue) 4.45 ms, plainly 4.29; o_proj launched early behind the
              merging attention 4.51 ms, plainly 4.31 (4.36 with the merge as its own launch).
              Everywhere else the early launch helps (4.45 -> 4.39 ms when PDL came in).
      none    every launch early;
      wide:N  a GEMM behind any kernel of more than N programs: a general form of `named`
              (bench/gpu_shape_decode.py --pdl-plain). H200, 91d7b61: wide:132 and wide:264 time
              as `named` does (batch-1 decode graph 4.32 ms; none 4.67), so `named` stays."""
    wide = None
    if plain.startswith("wide:"):
        wide = int(plain[5:])
    elif plain not in ("named", "none"):
        raise ValueError(f"pdl plain rule {plain!r}: one of {', '.join(PDL_PLAIN_RULES)}")
    out, prev = [], None
    for spec, args in launches:
        if isinstance(spec, NcclCall):  # not a kernel; the launch after it goes out plainly (cuda_executor)
            out.append((spec, args))
            prev = spec
            continue
        go_plain = False
        if prev is not None and spec.kernel in GEMM_KERNELS:
            if wide is not None:
                go_plain = int(np.prod(prev.grid)) > wide
            elif plain == "named":
                go_plain = prev.kernel in GEMM_KERNELS or (
                    prev.kernel == "paged_attention_kernel" and bool(prev.constexprs.get("MERGE")))
        out.append((spec if go_plain else spec.with_pdl(), args))
        prev = spec
    return out


def plan_dims(buckets: list[Bucket], mb: int) -> dict[str, int]:
    """The dims the activation arena is planned for: every bucket's largest (one plan serves all)."""
    dims = {"T": max(b.tokens for b in buckets), "S": max(b.seqs for b in buckets),
            "L": max(b.logits for b in buckets), "MB": mb}
    dims["S1"] = dims["S"] + 1
    return dims


def compile_bundle(graph: Graph, *, target: str, model_config: dict[str, Any], config_hash: str,
                   max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                   buckets: list[Bucket] | None = None, configs: Configs = DEFAULT,
                   progress: Callable[[str], None] = lambda s: None, batch_invariant: bool = True,
                   pdl: bool | None = None, fuse_merge: bool = True, pdl_plain: str = "named",
                   bar: Callable[[str, int], Any] | None = None, collective: str = "nccl") -> Bundle:
    """collective: how a tensor-parallel graph's collectives run (codegen/lower.py COLLECTIVES):
    NCCL calls in the plan, or the peer-memory kernels.
    bar(desc, total): a tqdm-like bar (.update(n), .close()) moved as buckets are lowered and
    then as kernels compile (instead of a progress line per bucket).
    pdl: compile the plans' kernels for programmatic dependent launch (codegen/triton/pdl.py),
    but the GEMMs pdl_launches' rule `pdl_plain` names;
    None: wherever the target has it (sm_90 and later, i.e. every GPU target). fuse_merge:
    split-KV decode merges in the attention kernel (False: a merge launch, to A/B it)."""
    if target not in TARGETS:
        raise ValueError(f"unknown GPU target {target!r} (known: {', '.join(TARGETS)})")
    t0 = time.perf_counter()
    buckets = buckets or make_buckets(max_num_seqs, max_num_batched_tokens)
    mb = -(-max_model_len // block_size)
    plan = plan_memory(graph, plan_dims(buckets, mb))
    regions = Regions()
    regions.need("arena", plan.arena_bytes)
    recorded = {}
    lowering = bar(f"lowering {len(buckets)} buckets", len(buckets)) if bar is not None else None
    try:
        for i, b in enumerate(buckets):
            if lowering is None:
                progress(f"lowering bucket {b.name} ({i + 1}/{len(buckets)})")
            recorded[b] = lower_bucket(graph, plan, b, max_blocks_per_seq=mb, regions=regions,
                                       max_model_len=max_model_len, configs=configs, arch=target,
                                       batch_invariant=batch_invariant, fuse_merge=fuse_merge,
                                       collective=collective)
            if lowering is not None:
                lowering.update(1)
    finally:
        if lowering is not None:
            lowering.close()
    if pdl is None:
        pdl = target in PDL_TARGETS
    if pdl:  # the sampler's kernels (below) run after the graph, launched plainly
        recorded = {b: pdl_launches(launches, pdl_plain) for b, launches in recorded.items()}
    specs: dict[str, Any] = {}
    for launches in recorded.values():
        for spec, _ in launches:
            if not isinstance(spec, NcclCall):
                specs.setdefault(cache_key(spec, target), spec)
    # The sampler's kernels, for the model's vocabulary: the runtime launches them on the
    # logits rows the plan leaves in the arena (runtime/sample/gpu_sampler.py), by argument name.
    sampler = sampler_specs(int(graph.tensors[graph.outputs[0]].shape[1]))
    for spec in sampler.values():
        specs.setdefault(cache_key(spec, target), spec)
    compiling = bar(f"compiling {len(specs)} kernels for {target}", len(specs)) if bar is not None else None
    if compiling is None:
        progress(f"compiling {len(specs)} kernels for {target}")
    try:
        compiled = dict(zip(specs, compile_specs([(s, target) for s in specs.values()],
                                                 on_done=compiling.update if compiling is not None else None)))
    finally:
        if compiling is not None:
            compiling.close()
    kernels = {k: c.cubin for k, c in compiled.items()}
    kernel_meta = {k: {"name": c.name, "shared": c.shared, "num_warps": c.num_warps, "n_hidden": c.n_hidden,
                       "global_scratch_size": c.global_scratch_size, "pdl": bool(specs[k].constexprs.get("PDL")),
                       "signature": list(specs[k].signature.values())} for k, c in compiled.items()}
    plans = {}
    for b, launches in recorded.items():
        plans[b.name] = {
            "bucket": [b.tokens, b.seqs, b.logits, b.decode],
            "inputs": {n: [off, list(shape)] for n, (off, _, shape) in input_layout(b, mb, is_hybrid(graph)).items()},
            # an NCCL entry: ["nccl", [], {op, dtype, count, red, send, recv}] (codegen/lower.py encode_nccl)
            "launches": [["nccl", [], encode_nccl(spec)] if isinstance(spec, NcclCall)
                         else [cache_key(spec, target), list(spec.grid), encode_args(spec, args)]
                         for spec, args in launches],
        }
    out_name = graph.outputs[0]
    manifest = {
        "target": target, "config_hash": config_hash, "model_config": model_config,
        "block_size": block_size, "max_model_len": max_model_len, "batch_invariant": batch_invariant,
        "pdl": bool(pdl),
        # a tensor-parallel plan's group size and how its collectives run (None: one GPU)
        "tensor_parallel": _tensor_parallel(graph, collective),
        "kv_cache_dtype": graph.attrs.get("kv_cache_dtype"),
        "max_blocks_per_seq": mb,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "regions": regions.names, "region_bytes": regions.sizes,
        # name -> [dtype, shape] or [dtype, shape, [[part, rows], ...]] or [..., parts, G]: a
        # stacked weight (merged q/k/v, gate/up) is these checkpoint tensors one after another
        # along axis 0, or with G, interleaved in groups of G rows (graph/layout.py)
        "weights": {t.name: [str(t.dtype), list(t.shape)] + ([[list(p) for p in t.parts]] if t.parts else [])
                    + ([t.interleave] if t.interleave else []) for t in graph.weights},
        "states": {t.name: [str(t.dtype), [d if isinstance(d, int) else str(d) for d in t.shape]]
                   for t in graph.states},
        "logits": {"offset": plan.offsets[out_name], "dtype": str(graph.tensors[out_name].dtype),
                   "vocab": int(graph.tensors[out_name].shape[1])},
        "kernels": kernel_meta, "plans": plans,
        "sampler": sampler_manifest(sampler, lambda role, spec: cache_key(spec, target)),
        "compile_seconds": round(time.perf_counter() - t0, 2),
        # "op key" of each kernel config no schedules entry named (kiln's defaults ran instead)
        "default_configs": [f"{op} {key}" for op, key in configs.fallbacks],
    }
    consts = {k: np.ascontiguousarray(v) for k, v in regions.consts.items()}
    return Bundle(manifest, kernels, consts)


def _tensor_parallel(graph: Graph, collective: str) -> dict[str, Any] | None:
    sizes = {int(n.attrs["world_size"]) for n in graph.nodes.values() if n.op in ("all_reduce", "all_gather")}
    if not sizes:
        return None
    if collective not in COLLECTIVES:
        raise ValueError(f"collective {collective!r}: one of {', '.join(COLLECTIVES)}")
    return {"world_size": max(sizes), "collective": collective}


def compile_bundle_cached(graph: Graph, *, cache_tag: str, cache_dir: str | Path | None = None,
                          progress: Callable[[str], None] = lambda s: None, **kw: Any) -> Bundle:
    """compile_bundle, kept in the kernel cache by everything the bundle depends on: the fused
    graph, the compile parameters, `cache_tag` (the schedules' digest), kiln's codegen sources
    and the compiler version. Recompiling an unchanged model into a fresh directory then reads
    the bundle back (about a second for an 8B model) instead of lowering 43 buckets again.
    `configs` is not hashed: `cache_tag` must identify it (build.py passes the digest of the
    schedules its Configs reads)."""
    import triton

    h = hashlib.sha256()
    h.update(graph.dump().encode())
    h.update(repr(sorted((t.name, t.parts, t.interleave) for t in graph.weights)).encode())
    h.update(json.dumps({k: v for k, v in kw.items() if k not in ("configs", "bar")}, sort_keys=True, default=repr).encode())
    h.update(f"{cache_tag} triton {triton.__version__}".encode())
    here = Path(__file__).resolve().parent
    for f in sorted(here.rglob("*.py")) + [here.parent / "runtime" / "worker" / "bundle.py", here.parent / "passes" / "plan_memory.py"]:
        h.update(f.read_bytes())
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir().parent / "bundles"
    path = root / h.hexdigest()[:32]
    if (path / "manifest.yaml").is_file():
        try:
            bundle = Bundle.read(path)
            progress(f"unchanged since the last compile: the bundle comes from {path}")
            return bundle
        except BundleError:
            pass  # a damaged entry: compile again and overwrite it
    bundle = compile_bundle(graph, progress=progress, **kw)
    try:
        bundle.write(path)
    except OSError:
        pass  # a read-only cache only costs the next compile its time
    return bundle
