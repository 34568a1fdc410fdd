"""EngineArgs: what a user sets, from the CLI or LLM(...)'s keywords (vLLM's
vllm/engine/arg_utils.py EngineArgs, the subset kiln runs)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from kiln.errors import ConfigError


@dataclass(frozen=True)
class EngineArgs:
    """What a user sets (the CLI and LLM(...) keywords); vLLM's EngineArgs subset."""
    model: Optional[str] = None
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # None: on, except for hybrid (Gated DeltaNet) models, whose state is not prefix-cached yet
    enable_prefix_caching: Optional[bool] = None
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

    def with_model_defaults(self, cfg: Any) -> "EngineArgs":
        """The args with what depends on the model (a ModelConfig) decided: prefix caching is on
        by default, and off for a hybrid model, where asking for it is an error (its state
        slots would resume from a prefix they never computed)."""
        caching = self.enable_prefix_caching
        if cfg.is_hybrid:
            if caching:
                raise ConfigError(f"prefix caching is not supported for {cfg.architecture} (Gated DeltaNet "
                                  f"state is not cached yet): drop --enable-prefix-caching")
            caching = False
        elif caching is None:
            caching = True
        return dataclasses.replace(self, enable_prefix_caching=caching)
