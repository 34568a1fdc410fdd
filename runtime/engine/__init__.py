"""The engine loop (vLLM V1 v1/engine): the engine core and its process client, LLMEngine, AsyncLLM, outputs, stats."""
