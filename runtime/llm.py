"""The offline API: `LLM(model=...).generate(prompts, SamplingParams)` and `.chat(...)`.

Ported in interface from vLLM's vllm/entrypoints/llm.py. The runtime only
runs what build time produced: a model path is handed to `kiln.build.load`
(open, build the graph, run the passes, load weights), imported lazily so the
runtime package itself never imports models or passes.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from kiln.runtime.chat_template import render_chat
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.kv_cache_spec import full_attention_config
from kiln.runtime.llm_engine import LLMEngine
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.outputs import OutputKind, RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.scheduler_config import CacheConfig, SchedulerConfig


@dataclass(frozen=True)
class EngineArgs:
    """What a user sets (the CLI and LLM(...) keywords); vLLM's EngineArgs subset."""
    model: Optional[str] = None
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    kv_cache_tokens: Optional[int] = None  # KV cache size in tokens; None: 65536 on CPU, free memory on GPU
    target: str = "cpu"  # "cpu" (numpy) or a GPU arch: "sm_90", "sm_121"
    bundle_dir: Optional[str] = None  # where a GPU bundle is cached (reused when it matches)
    seed: Optional[int] = 0
    skip_tokenizer_init: bool = False
    chat_template: Optional[str] = None
    # Schedule the next step while the current one executes (vLLM's --async-scheduling); None:
    # on for a GPU target (the next step is queued before the last one is read back), off on CPU
    async_scheduling: Optional[bool] = None
    # KV cache element type (vLLM's --kv-cache-dtype): "auto" (the model's dtype), "fp8"/"fp8_e4m3"
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        from kiln.graph.dtype import kv_cache_dtype

        kv_cache_dtype(self.kv_cache_dtype)  # an unknown name fails here, before anything loads


def freeze_startup_heap() -> None:
    """Move every object alive after startup into the collector's permanent generation, which
    its passes skip (vLLM: vllm/utils/gc_utils.py freeze_gc_heap, at the end of
    EngineCore.__init__ and in the API server's startup). A GPU engine keeps its bundle's
    plans as Python lists: with an 8B bundle's manifest (43 buckets) alive, a full collection
    walked 171k objects and took 170-190 ms on the 2-core development machine (55 ms without
    it; nothing once frozen), a stall of whichever step it lands in. Garbage is collected
    first, so none is frozen; objects made later are collected as before."""
    gc.collect()
    gc.freeze()


def build_engine(args: EngineArgs) -> tuple[LLMEngine, Any]:
    """-> (engine, the loaded model) for the CPU target."""
    from kiln.build import load  # build-time work: see the module docstring

    kv_tokens = args.kv_cache_tokens if args.kv_cache_tokens or args.target != "cpu" else 65536
    lm = load(args.model, target=args.target, block_size=args.block_size, kv_cache_tokens=kv_tokens,
              tokenizer=not args.skip_tokenizer_init, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              bundle_dir=args.bundle_dir, kv_cache_dtype=args.kv_cache_dtype)
    cfg = lm.source.config
    max_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=max_len, enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold, policy=args.scheduling_policy,
        async_scheduling=args.target != "cpu" if args.async_scheduling is None else args.async_scheduling)
    kv_cfg = full_attention_config(lm.executor.num_blocks, args.block_size, cfg.num_key_value_heads,
                                   cfg.head_dim, lm.graph.attrs["kv_cache_dtype"])
    # a GPU bundle's buckets hold a fixed number of logits rows (prompt logprobs need one per token)
    rows = max((p["logits"] for p in getattr(lm.executor, "buckets", ())), default=None)
    scheduler = Scheduler(sched_cfg, kv_cfg, CacheConfig(args.block_size, args.enable_prefix_caching),
                          max_num_logits_rows=rows)
    tok = lm.tokenizer
    eos = sorted(tok.eos_token_ids) if tok is not None else []
    runner = ModelRunner(lm.executor, args.block_size, cfg.vocab_size, eos_token_ids=eos,
                         encode=(lambda s: tok.encode(s, add_special_tokens=False)) if tok else None,
                         seed=args.seed)
    engine = LLMEngine(EngineCore(scheduler, runner), tok, max_model_len=max_len, vocab_size=cfg.vocab_size,
                       eos_token_ids=eos)
    freeze_startup_heap()
    return engine, lm


def build_engine_process(args: EngineArgs) -> tuple[LLMEngine, None]:
    """-> an engine whose core runs in a child process; this process keeps the tokenizer."""
    from kiln.build import load_frontend  # build-time work: see the module docstring
    from kiln.runtime.engine_core_client import EngineCoreClient

    cfg, tok = load_frontend(args.model, tokenizer=not args.skip_tokenizer_init)
    core = EngineCoreClient(args)
    eos = sorted(tok.eos_token_ids) if tok is not None else []
    max_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    engine = LLMEngine(core, tok, max_model_len=max_len, vocab_size=cfg.vocab_size, eos_token_ids=eos)
    freeze_startup_heap()  # this process's own (the core process froze its heap in build_engine)
    return engine, None


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        self.args = EngineArgs(model=None if model is None else str(model), **kwargs)
        self.engine, self.model = build_engine(self.args)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; -> one RequestOutput per prompt, in order.
        A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("pass one SamplingParams or one per prompt")
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = self.engine.new_request_id()
                self.engine.add_request(rid, p, sp, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids) and self.engine.has_unfinished_requests():
            for ro in self.engine.step():
                if ro.finished:
                    done[ro.request_id] = ro
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, *,
             chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                    **(chat_template_kwargs or {})) for c in convs]
        return self.generate(prompts, sampling_params)

    def render_chat(self, messages: list[dict], *, chat_template: Optional[str] = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        tok = self.engine.tokenizer
        template = chat_template or self.args.chat_template or (tok.chat_template if tok else None)
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template=")
        text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=tok.bos_token, eos_token=tok.eos_token, **kwargs)
        return tok.encode(text, add_special_tokens=False)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


__all__ = ["LLM", "EngineArgs", "SamplingParams", "OutputKind", "build_engine"]
