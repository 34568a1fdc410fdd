"""The scheduler and KV cache bookkeeping (vLLM V1 v1/core): pure Python over ints, no device, no model arrays."""
