"""The runtime: runs what build time produced, and never imports models, passes or codegen.

    core/    the scheduler and the KV cache's bookkeeping (pure Python over ints)
    engine/  the engine core, its process client, LLMEngine, AsyncLLM, outputs and stats
    sample/  sampling: params, metadata, the numpy and GPU samplers, logprobs
    worker/  the model runner, step inputs, the CPU and CUDA executors, bundles
    text/    tokenizers (HF and GGUF), the detokenizer, chat templates
"""
