"""HF config dicts of public models' shapes, for benchmarks and tests that need a real
model's geometry with random weights (no checkpoint to download).

SHAPES: plain decoders (flat configs). HYBRID_SHAPES: the Qwen3.5/3.6 Gated DeltaNet hybrids, as
their text-tower fields (what a real checkpoint nests under `text_config`; bench/make_random_model.py
writes the nested Qwen3_5(Moe)ForConditionalGeneration config.json). ModelConfig.from_hf_dict
reads both forms."""
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
    # Qwen/Qwen3-30B-A3B: every layer MoE, 8 of 128 routed experts, no shared expert
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
                          rope_theta=1000000.0, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[]),
}


def _hybrid_layer_types(n_layers: int, interval: int = 4) -> list[str]:
    """Qwen3_5TextConfig's rule, which published configs also list: every interval-th layer is
    full attention (layers 3, 7, 11, ...), the others Gated DeltaNet."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]


# Qwen3.5/3.6 text towers (../shared/specs/qwen3_5.md section 1.3; Qwen3.6 has Qwen3.5's architecture
# and model_type). The RoPE of the published configs: theta 1e7 on the first quarter of each head
# (NeoX style), with interleaved MRoPE sections that are the plain 1-D rope for text.
_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                 "mrope_section": [11, 11, 10], "mrope_interleaved": True}
_QWEN3_5_COMMON = dict(vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6, head_dim=256,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       full_attention_interval=4, attn_output_gate=True, tie_word_embeddings=False,
                       mamba_ssm_dtype="float32", rope_parameters=_QWEN3_5_ROPE)

HYBRID_SHAPES: dict[str, dict] = {
    # Qwen/Qwen3.6-27B (= Qwen3.5-27B's shape): dense MLP in every layer
    "qwen3.6-27b": dict(_QWEN3_5_COMMON, architectures=["Qwen3_5ForConditionalGeneration"], hidden_size=5120,
                        intermediate_size=17408, num_hidden_layers=64, layer_types=_hybrid_layer_types(64),
                        num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
                        linear_num_value_heads=48),
    # Qwen/Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B's): every layer MoE, 8 of 256 routed experts + 1 shared
    "qwen3.6-35b-a3b": dict(_QWEN3_5_COMMON, architectures=["Qwen3_5MoeForConditionalGeneration"],
                            hidden_size=2048, num_hidden_layers=40, layer_types=_hybrid_layer_types(40),
                            num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16,
                            linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512),
}

# the tiny hybrids' heads of 32 rotate 8 dims: MRoPE sections of 4 frequencies in all (vLLM checks the sum)
_TINY_ROPE = dict(_QWEN3_5_ROPE, mrope_section=[2, 1, 1])

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
    # tiny-llama at widths of whole k-quant blocks (256 weights): the smallest Llama a Q4_K / Q6_K GGUF
    # can hold (bench/make_random_model.py --format q4k)
    "tiny-llama-k": dict(architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=256,
                         intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=500000.0,
                         tie_word_embeddings=False),
    # Qwen3.6-27B's structure: 3 Gated DeltaNet layers then 1 gated full-attention layer, Hq/Hkv 6,
    # Hv/Hk 3, a gated-attention head of 32 (8 rotary dims), GDN heads of 16, untied head
    "tiny-qwen3.6": dict(_QWEN3_5_COMMON, architectures=["Qwen3_5ForConditionalGeneration"], vocab_size=320,
                         hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                         layer_types=_hybrid_layer_types(4),
                         num_attention_heads=12, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                         linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=16,
                         max_position_embeddings=4096, rope_parameters=_TINY_ROPE),
    # Qwen3-30B-A3B's structure: every layer MoE (2 of 8 routed, no shared expert), q/k norms, untied head
    "tiny-qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=320, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=1000000.0,
                           tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # Qwen3.6-35B-A3B's structure: Hq/Hkv 8, Hv/Hk 2, every layer MoE (2 of 8 routed + 1 shared)
    "tiny-qwen3.6-moe": dict(_QWEN3_5_COMMON, architectures=["Qwen3_5MoeForConditionalGeneration"],
                             vocab_size=320, hidden_size=64, num_hidden_layers=4, layer_types=_hybrid_layer_types(4),
                             num_attention_heads=8, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, max_position_embeddings=4096,
                             rope_parameters=_TINY_ROPE),
}
