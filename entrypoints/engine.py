"""Building an engine from EngineArgs: the loader's LoadedModel wired into the runtime's
scheduler, model runner, engine core and LLMEngine (in this process, or with the core
in a child process)."""
from __future__ import annotations

import functools
import gc
from typing import Any

from kiln.entrypoints.engine_args import EngineArgs
from kiln.loader import context_length, load, load_frontend, load_tensor_parallel
from kiln.runtime.core.kv_cache_spec import full_attention_config, hybrid_config
from kiln.runtime.core.scheduler import Scheduler
from kiln.runtime.core.scheduler_config import CacheConfig, SchedulerConfig
from kiln.runtime.engine.core import EngineCore
from kiln.runtime.engine.core_client import EngineCoreClient
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.sample.grammar import GrammarTokenizer
from kiln.runtime.worker.model_runner import ModelRunner


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
    """-> (engine, the loaded model), both in this process."""
    # None: on cpu, loader.cpu_kv_blocks' default (65,536 tokens, at most 4 GiB); on a GPU, free memory
    kw = dict(target=args.target, block_size=args.block_size, kv_cache_tokens=args.kv_cache_tokens,
              tokenizer=not args.skip_tokenizer_init, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              bundle_dir=args.bundle_dir, kv_cache_dtype=args.kv_cache_dtype,
              num_state_snapshots=args.state_snapshots(), quantization=args.quantization)
    if args.tensor_parallel_size > 1 or args.distributed_executor_backend == "ray":
        lm = load_tensor_parallel(args.model, tensor_parallel_size=args.tensor_parallel_size,
                                  distributed_executor_backend=args.distributed_executor_backend, **kw)
    else:
        lm = load(args.model, **kw)
    cfg = lm.source.config
    args = args.with_model_defaults(cfg)
    max_len = context_length(cfg, args.max_model_len)
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=max_len, enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold, policy=args.scheduling_policy,
        async_scheduling=args.target != "cpu" if args.async_scheduling is None else args.async_scheduling)
    kv_cfg = kv_cache_config(cfg, lm, args.block_size, args.num_state_snapshots)
    # a GPU bundle's buckets hold a fixed number of logits rows (prompt logprobs need one per token)
    rows = max((p["logits"] for p in getattr(lm.executor, "buckets", ())), default=None)
    scheduler = Scheduler(sched_cfg, kv_cfg, CacheConfig(args.block_size, args.enable_prefix_caching),
                          max_num_logits_rows=rows)
    tok = lm.tokenizer
    eos = sorted(tok.eos_token_ids) if tok is not None else []
    runner = ModelRunner(lm.executor, args.block_size, cfg.vocab_size, eos_token_ids=eos,
                         encode=(lambda s: tok.encode(s, add_special_tokens=False)) if tok else None,
                         seed=args.seed,
                         grammar_tokenizer=GrammarTokenizer.from_tokenizer(tok, cfg.vocab_size) if tok else None)
    engine = LLMEngine(EngineCore(scheduler, runner), tok, max_model_len=max_len, vocab_size=cfg.vocab_size,
                       eos_token_ids=eos)
    engine.engine_args = args
    freeze_startup_heap()
    return engine, lm


def kv_cache_config(cfg, lm, block_size: int, num_state_snapshots: int = 0):
    """The scheduler's view of the executor's caches: the attention blocks, and for a hybrid
    model a second group of state slots, one per running request plus num_state_snapshots for
    prefix-cache snapshots (slot 0 is the null slot, so the executor holds num_state_slots - 1
    usable ones)."""
    kv_dtype = lm.graph.attrs["kv_cache_dtype"]
    if not cfg.is_hybrid:
        return full_attention_config(lm.executor.num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                                     kv_dtype)
    conv = next(t for t in lm.graph.states if t.name.startswith("gdn_conv."))
    ssm = next(t for t in lm.graph.states if t.name.startswith("gdn_ssm."))
    return hybrid_config(lm.executor.num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, kv_dtype,
                         num_state_slots=lm.executor.num_state_slots - 1, conv_shape=tuple(conv.shape[1:]),
                         ssm_shape=tuple(ssm.shape[1:]), conv_dtype=str(conv.dtype), ssm_dtype=str(ssm.dtype),
                         num_gdn_layers=sum(t == "linear_attention" for t in cfg.layer_types),
                         num_state_snapshots=num_state_snapshots)


def build_engine_process(args: EngineArgs) -> tuple[LLMEngine, None]:
    """-> an engine whose core runs in a child process; this process keeps the tokenizer."""
    cfg, tok = load_frontend(args.model, tokenizer=not args.skip_tokenizer_init, quantization=args.quantization)
    args = args.with_model_defaults(cfg)
    core = EngineCoreClient(functools.partial(build_engine, args))  # the child runs build_engine(args)
    eos = sorted(tok.eos_token_ids) if tok is not None else []
    max_len = context_length(cfg, args.max_model_len)
    engine = LLMEngine(core, tok, max_model_len=max_len, vocab_size=cfg.vocab_size, eos_token_ids=eos)
    engine.engine_args = args
    freeze_startup_heap()  # this process's own (the core process froze its heap in build_engine)
    return engine, None
