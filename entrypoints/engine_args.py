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
    # None: on (hybrid models too: their Gated DeltaNet state is snapshotted at block-aligned
    # chunk ends, runtime/core/single_type_kv_cache_manager.py MambaManager)
    enable_prefix_caching: Optional[bool] = None
    # A hybrid model's state slots kept for prefix-cache snapshots, beside the max_num_seqs
    # running ones (each as large as a running slot). None: max(1, max_num_seqs // 4) with
    # prefix caching on, else 0. Ignored for models without Gated DeltaNet state.
    num_state_snapshots: Optional[int] = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    kv_cache_tokens: Optional[int] = None  # KV cache size in tokens; None: 65536 (at most 4 GiB) on CPU, free memory on GPU
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
    # vLLM's --quantization: the checkpoint's method (fp8, compressed-tensors, modelopt, modelopt_fp4,
    # gguf), checked against its own config; None: the checkpoint's. "fp8" on an unquantised
    # checkpoint quantises its linears at load (online FP8, models/fp8_online.py)
    quantization: Optional[str] = None
    # vLLM's --tensor-parallel-size: the model split over this many worker processes (issue 44)
    tensor_parallel_size: int = 1
    # vLLM's --distributed-executor-backend: "mp" (worker processes on this host; the default) or
    # "ray" (Ray actors placed by a placement group); None: mp when tensor_parallel_size > 1
    distributed_executor_backend: Optional[str] = None

    def __post_init__(self) -> None:
        from kiln.graph.dtype import kv_cache_dtype

        kv_cache_dtype(self.kv_cache_dtype)  # an unknown name fails here, before anything loads
        from kiln.loader import check_quantization_name

        check_quantization_name(self.quantization)  # likewise (awq, gptq, ...: one sentence)
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ConfigError(f"distributed_executor_backend must be mp or ray, got "
                              f"{self.distributed_executor_backend!r}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}")
        if self.num_state_snapshots and self.enable_prefix_caching is False:
            raise ValueError("num_state_snapshots needs prefix caching (they hold cached prefixes' state)")

    def with_model_defaults(self, cfg: Any) -> "EngineArgs":
        """The args with what depends on the model (a ModelConfig) decided: prefix caching is on
        by default, for a hybrid model too (with its state snapshots)."""
        caching = True if self.enable_prefix_caching is None else self.enable_prefix_caching
        return dataclasses.replace(self, enable_prefix_caching=caching,
                                   num_state_snapshots=self.state_snapshots(caching) if cfg.is_hybrid else 0)

    def state_snapshots(self, caching: bool | None = None) -> int:
        """How many snapshot slots a hybrid model gets (prefix caching `caching`, default as set)."""
        caching = self.enable_prefix_caching is not False if caching is None else caching
        if not caching:
            return 0
        if self.num_state_snapshots is not None:
            return self.num_state_snapshots
        return max(1, self.max_num_seqs // 4)
