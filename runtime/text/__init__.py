"""Text in and out: tokenizers (HF and GGUF), the incremental detokenizer, sandboxed chat templates."""
