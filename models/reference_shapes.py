"""HF config dicts of public models' shapes, for benchmarks and tests that need a real
model's geometry with random weights (no checkpoint to download)."""
from __future__ import annotations

SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1000000.0,
                     tie_word_embeddings=False),
}

# Not public models: a public shape's structure at a size whose random checkpoint is written and run
# on CPU in milliseconds (the benchmark harness's tests). Kept apart so loops over SHAPES stay 8B-sized.
TEST_SHAPES: dict[str, dict] = {
    # Llama-3.1-8B's structure: GQA, llama3 RoPE, untied head
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=500000.0,
                       tie_word_embeddings=False,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
}
