"""kiln on the GPU at a real model's shape with random bf16 weights (no checkpoint needed):
compile time, load time (weights + KV cache + first-step graph capture), batch-1 decode
and one-prompt prefill speed.

    python bench/gpu_shape_decode.py --shape llama-3.1-8b|qwen3.6-27b|qwen3.6-35b-a3b [--context 512] [--steps 128]
        [--prefill 2048] [--compile-only] [--gemm-tma auto|on|off] [--gemm-fold auto|off]
        [--fuse-silu auto|off] [--fuse-rope auto|off] [--fuse-merge auto|off] [--pdl-plain named|none|wide:N]
        [--attn-tile N --attn-seg N] [--sched OP:KEY=JSON ...] [--json OUT]

Weights are a tiled pool of N(0, 0.02) values: right bytes and shapes for timing, not a
model (a stacked expert tensor or a GDN A_log alike). Hybrid shapes run their sequence in state
slot 1 (slot 0 is the null slot). Decode timing = wall time per engine step as the executor sees it (step inputs
staged and copied, the bucket's CUDA graph replayed, the logits row copied back).
"""
from __future__ import annotations

import argparse
import json
import time

import ml_dtypes
import numpy as np

from kiln.codegen.compile import compile_bundle
from kiln.codegen.triton.configs import Configs
from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.reference_shapes import HYBRID_SHAPES, SHAPES
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import default_passes, run_pipeline
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from kiln.schedules import Schedules



BS = 16  # KV block size of the bundles compiled here
ALL_SHAPES = {**SHAPES, **HYBRID_SHAPES}


def random_weights(seed: int = 0):
    pool = (np.random.default_rng(seed).standard_normal(1 << 22) * 0.02).astype(ml_dtypes.bfloat16)

    def load(name: str, shape) -> np.ndarray:
        if name.endswith("norm.weight"):
            return np.ones(shape, dtype=ml_dtypes.bfloat16)
        return np.resize(pool, shape)
    return load


def _events_ms(ex, run, reps: int) -> float:
    """GPU time of `run()` issued `reps` times back to back, between two events -> ms per run."""
    start, end = ex.ctx.event(), ex.ctx.event()
    ex.ctx.record(start)
    for _ in range(reps):
        run()
    ex.ctx.record(end)
    return ex.ctx.elapsed_ms(start, end) / reps


def gpu_only_decode_ms(ex, steps: int = 100) -> float:
    """GPU time of the batch-1 decode bucket alone: its captured graph replayed back to back."""
    graph = ex.graphs["d1x1"]
    return _events_ms(ex, lambda: ex.ctx.replay(graph), steps)


def gpu_only_prefill_ms(ex, tokens: int, reps: int = 5) -> float:
    """GPU time of one prompt's prefill of `tokens` tokens alone: its bucket's launches issued back to
    back `reps` times on the inputs the last step staged (prefill buckets run uncaptured; at ~50 ms of
    kernels a step the issue time hides behind the GPU), without the host's staging and read-back."""
    p = ex._pick(tokens, 1, 1)
    ex._launch_all(p)  # the first run after a decode step: not timed
    return _events_ms(ex, lambda: ex._launch_all(p), reps)


def _overrides(entries) -> list[tuple[str, tuple, dict]]:
    """--sched OP:K1,K2,...=JSON -> [(op, key prefix, fields)]: e.g.
    'gemm_reduction:4096,4096={"split_k": 2}' or 'gemm_tile:1,4096,4096={"block_n": 16}'."""
    out = []
    for e in entries or ():
        head, _, body = e.partition("=")
        op, _, key = head.partition(":")
        out.append((op, tuple(int(v) for v in key.split(",") if v), json.loads(body)))
    return out


def _lookup(a):
    sched = None if a.untuned else Schedules.read("sm_90")
    overrides = _overrides(getattr(a, "sched", None))

    def lookup(op, key):
        found = _schedule(op, key)
        for o, prefix, fields in overrides:
            if o == op and tuple(key[:len(prefix)]) == prefix:
                found = {**(found or {}), **fields}
        return found

    def _schedule(op, key):
        found = sched.lookup(op, key) if sched else None
        knobs = (("prefill_block_q", a.attn_block_q), ("prefill_num_warps", a.attn_warps),
                 ("prefill_num_stages", a.attn_stages), ("prefill_maxnreg", a.attn_maxnreg))
        knobs += (("tile", getattr(a, "attn_tile", None)), ("seg", getattr(a, "attn_seg", None)))
        if op == "paged_attention" and any(v for _, v in knobs):  # over the tuned entry's other knobs
            return {**(found or {}), **{k: v for k, v in knobs if v}}
        if op == "gemm_tile":  # A/Bs of the TMA loads (configs.with_tma) and of folded split-K (Configs.gemm_fold)
            word = {**({"tma": a.gemm_tma == "on"} if a.gemm_tma != "auto" else {}),
                    **({"fold": False} if a.gemm_fold == "off" else {})}
            return {**(found or {}), **word} if word else found
        return found
    return lookup


def step_graph(cfg, fuse_silu: str = "auto", fuse_rope: str = "auto"):
    """The fused step graph, for an in-process A/B: fuse_silu="off" leaves out
    passes/fuse_gate_up_silu.py (the MLP's silu_mul a launch of its own after the gate/up GEMM),
    fuse_rope="off" passes/fuse_rope_into_linear.py (the attention preamble one after q/k/v)."""
    return run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16),
                        default_passes(fuse_silu=fuse_silu == "auto", fuse_rope=fuse_rope == "auto"))


def largest_plan(bundle) -> dict:
    """What the flags compiled into the bucket with the most tokens (a long prefill's): its
    launches by kernel, and how many GEMMs run split-K as partials (grid z > 1) rather than
    folded (with the tuned schedules, --gemm-fold auto leaves none of those at 2,048 tokens)."""
    meta, plans = bundle.manifest["kernels"], bundle.manifest["plans"]
    name = max(plans, key=lambda p: plans[p]["bucket"][0])
    by: dict[str, int] = {}
    partials = 0
    for key, grid, _ in plans[name]["launches"]:
        by[meta[key]["name"]] = by.get(meta[key]["name"], 0) + 1
        partials += meta[key]["name"] == "gemm_kernel" and grid[2] > 1
    print(f"plan {name}: {sum(by.values())} launches, {partials} GEMMs writing split-K partials; "
          + ", ".join(f"{n} x{c}" for n, c in sorted(by.items())))
    return {"bucket": name, "launches": sum(by.values()), "gemm_partials": partials, "by_kernel": by}


def profile(ex, step, what: str = "decode") -> dict:
    """Per-kernel GPU time of one decode step, summed by kernel (events between launches)."""
    per, plain_us = ex.profile(step)
    by: dict[str, list[float]] = {}
    for name, us in per:
        by.setdefault(name, []).append(us)
    total = sum(us for _, us in per)
    print(f"profile of one {what} step: {len(per)} launches, {total:.0f} us with events between "
          f"launches, {plain_us:.0f} us as the plain graph")
    for name, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:32s} {len(v):4d} x {np.mean(v):7.1f} us = {sum(v):8.0f} us ({sum(v) / total:5.1%})")
    return {"plain_graph_us": plain_us, "events_total_us": total,
            "kernels": {n: {"count": len(v), "total_us": sum(v)} for n, v in by.items()},
            "launches": per}


def parser() -> argparse.ArgumentParser:
    """The flags (bench/decode_timeline.py takes them too)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(ALL_SHAPES))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--no-batch-invariance", action="store_true",
                    help="compile the variant without split-K in prefill buckets, to measure what invariance costs")
    ap.add_argument("--untuned", action="store_true", help="ignore schedules/sm_90 (kiln's default configs)")
    ap.add_argument("--profile", action="store_true", help="time every kernel of the batch-1 decode step "
                    "and of the prefill step")
    ap.add_argument("--attn-block-q", type=int, help="paged attention query positions per program in prefill buckets")
    ap.add_argument("--gemm-tma", choices=("auto", "on", "off"), default="auto",
                    help="GEMM tiles load through TMA descriptors: auto = the arch's rule (sm_90, BLOCK_M >= 64)")
    ap.add_argument("--gemm-fold", choices=("auto", "off"), default="auto",
                    help="split-K GEMMs add their splits inside the program (same bits): auto = Configs.gemm_fold's "
                    "rule (the tiles fill the GPU twice), off = never (partials + reduce, as before)")
    ap.add_argument("--fuse-rope", choices=("auto", "off"), default="auto",
                    help="off: the attention preamble as its own launch, not in the q/k/v GEMM's epilogue (A/B)")
    ap.add_argument("--fuse-silu", choices=("auto", "off"), default="auto",
                    help="the MLP's silu_mul in the gate/up GEMM's epilogue (same bits; interleaved gate/up "
                    "weight): auto = passes/fuse_gate_up_silu.py, off = a silu_mul launch after the GEMM, as before")
    ap.add_argument("--fuse-merge", choices=("auto", "off"), default="auto",
                    help="split-KV decode merges its segments in the attention kernel (same bits): auto = on, "
                    "off = attention_merge_kernel after it, as before")
    ap.add_argument("--pdl", choices=("auto", "off"), default="auto",
                    help="programmatic dependent launch for the plans' kernels (auto: on for sm_90)")
    ap.add_argument("--pdl-plain", default="named",
                    help="which GEMMs launch without PDL (codegen/compile.py pdl_launches): named (a GEMM behind a "
                    "GEMM or behind the merging attention), none, or wide:N (a GEMM behind any kernel of more "
                    "than N programs)")
    ap.add_argument("--attn-warps", type=int, help="paged attention warps per program in prefill buckets")
    ap.add_argument("--attn-stages", type=int, help="paged attention pipeline stages in prefill buckets")
    ap.add_argument("--attn-maxnreg", type=int, help="paged attention register cap in prefill buckets")
    ap.add_argument("--attn-tile", type=int, help="paged attention keys per tile (a reduction knob: bits change)")
    ap.add_argument("--attn-seg", type=int, help="paged attention keys per split-KV segment (reduction knob)")
    ap.add_argument("--sched", nargs="+", metavar="OP:KEY=JSON",
                    help="schedule fields over the tuned entries whose key starts with KEY, e.g. "
                    "'gemm_reduction:4096,4096={\"split_k\": 2}' (an A/B of one knob without re-tuning)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--profile-batch", type=int, help="also profile a decode step of this many sequences, "
                    "each at --profile-context tokens (KV left as allocated: timing only)")
    ap.add_argument("--profile-context", type=int, default=1500)
    ap.add_argument("--json")
    return ap


def compile_for(a, res: dict):
    """The flags' bundle, compiled in-process -> (model config, fused graph, bundle); what it
    compiled goes into res."""
    import dataclasses

    cfg = ModelConfig.from_hf_dict(ALL_SHAPES[a.shape])
    t0 = time.perf_counter()
    graph = step_graph(cfg, a.fuse_silu, a.fuse_rope)
    bundle = compile_bundle(graph, target="sm_90", model_config=dataclasses.asdict(cfg),
                            config_hash=cfg.compute_hash(), max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                            max_num_batched_tokens=max(2048, a.prefill), block_size=BS,
                            batch_invariant=not a.no_batch_invariance,
                            configs=Configs(lookup=_lookup(a)), pdl=None if a.pdl == "auto" else False,
                            fuse_merge=a.fuse_merge == "auto", pdl_plain=a.pdl_plain)
    res["tuned"] = not a.untuned
    res["pdl"] = bundle.manifest["pdl"]
    res["pdl_plain"] = a.pdl_plain
    res["gemm_tma"] = a.gemm_tma
    res["gemm_fold"] = a.gemm_fold
    res["fuse_silu"], res["fuse_rope"] = a.fuse_silu, a.fuse_rope
    res["fuse_merge"] = a.fuse_merge
    res["attn_tile"], res["attn_seg"] = a.attn_tile, a.attn_seg
    res["silu_fused_layers"] = sum(n.op == "linear_silu_mul" for n in graph.nodes.values())
    res["compile_s"] = time.perf_counter() - t0
    res["kernels"] = len(bundle.kernels)
    print(f"compile: {res['compile_s']:.1f} s, {len(bundle.kernels)} kernels, {len(bundle.manifest['plans'])} buckets")
    res["largest_plan"] = largest_plan(bundle)
    return cfg, graph, bundle


def chunk(tokens, start: int, blocks, slot: int = 1) -> SeqChunk:
    """A step's row: a hybrid's sequence keeps its GDN state in `slot` (plain models have none)."""
    return SeqChunk(tokens, start, blocks, state_slot=slot)


def load_for(a, res: dict, cfg, graph, bundle, rng):
    """The bundle on the GPU with random weights, a --context prompt prefilled and the batch-1
    decode graph captured -> (executor, the sequence's blocks)."""
    from kiln.runtime.worker.cuda_executor import CudaExecutor

    shapes = graph.checkpoint_weights()  # the fused graph stacks some of them (q/k/v, gate/up)
    load = random_weights()
    t0 = time.perf_counter()
    nb = (a.max_model_len // BS) * 4 + (a.profile_batch or 0) * (a.profile_context // BS + 1)
    ex = CudaExecutor(bundle, lambda n: load(n, shapes[n]), num_blocks=nb)
    res["weights_gb"] = sum(int(np.prod(s)) * 2 for s in shapes.values()) / 1e9
    blocks = list(range(1, a.max_model_len // BS + 1))
    prompt = rng.integers(0, cfg.vocab_size, size=a.context).tolist()
    ex.execute(prepare_step([chunk(prompt, 0, blocks)], BS))
    ex.execute(prepare_step([chunk([1], a.context, blocks)], BS))  # captures the decode graph
    res["load_s"] = time.perf_counter() - t0
    print(f"load: {res['load_s']:.1f} s for {res['weights_gb']:.2f} GB of weights (incl. first prefill + capture)")
    return ex, blocks


def main() -> None:
    a = parser().parse_args()
    res: dict = {"shape": a.shape, "batch_invariant": not a.no_batch_invariance}
    cfg, graph, bundle = compile_for(a, res)
    if a.compile_only:
        return _dump(a, res)
    rng = np.random.default_rng(1)
    ex, blocks = load_for(a, res, cfg, graph, bundle, rng)
    bs = BS
    pos, tok = a.context + 1, 1
    t0 = time.perf_counter()
    toks = []
    for _ in range(a.steps):
        out = ex.execute(prepare_step([chunk([tok], pos, blocks)], bs))["logits"]
        tok, pos = int(out[0].argmax()), pos + 1
        toks.append(tok)
    res["decode_tokens"] = toks  # the greedy ids: an A/B of kernels that keep the bits must keep them
    dt = (time.perf_counter() - t0) / a.steps
    res["decode_tok_s"] = 1 / dt
    res["roofline_tok_s_at_4.27TBps"] = 4.27e12 / (res["weights_gb"] * 1e9)
    print(f"decode batch 1 at context {a.context}: {1 / dt:.1f} tok/s ({dt * 1e3:.2f} ms/step); "
          f"weight-bytes roofline at 4.27 TB/s: {res['roofline_tok_s_at_4.27TBps']:.0f} tok/s")
    res["decode_gpu_ms"] = gpu_only_decode_ms(ex)
    print(f"  of which GPU (graph replay alone): {res['decode_gpu_ms']:.2f} ms/step "
          f"= {1e3 / res['decode_gpu_ms']:.1f} tok/s; host side {dt * 1e3 - res['decode_gpu_ms']:.2f} ms")
    if a.profile:
        res["profile"] = profile(ex, prepare_step([chunk([tok], pos, blocks)], bs))
    if a.profile_batch:
        per, first = a.profile_context // bs + 1, a.max_model_len // bs * 4
        chunks = [chunk([1], a.profile_context, list(range(first + i * per, first + (i + 1) * per)), i + 1)
                  for i in range(a.profile_batch)]
        res["batch_profile"] = profile(ex, prepare_step(chunks, bs),
                                       f"{a.profile_batch}-sequence decode at {a.profile_context} tokens")
    p = rng.integers(0, cfg.vocab_size, size=a.prefill).tolist()
    ex.execute(prepare_step([chunk(p, 0, blocks)], bs))
    t0 = time.perf_counter()
    for _ in range(3):
        ex.execute(prepare_step([chunk(p, 0, blocks)], bs))
    dt = (time.perf_counter() - t0) / 3
    res["prefill_tok_s"] = a.prefill / dt
    if a.profile:
        res["prefill_profile"] = profile(ex, prepare_step([chunk(p, 0, blocks)], bs), f"{a.prefill}-token prefill")
    print(f"prefill {a.prefill} tokens: {a.prefill / dt:.0f} tok/s ({dt * 1e3:.1f} ms)")
    res["prefill_gpu_ms"] = gpu_only_prefill_ms(ex, a.prefill)
    print(f"  of which GPU (its launches alone, 5 back to back): {res['prefill_gpu_ms']:.2f} ms "
          f"= {a.prefill / res['prefill_gpu_ms'] * 1e3:.0f} tok/s")
    _dump(a, res)


def _dump(a, res) -> None:
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

