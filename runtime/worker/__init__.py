"""Executing steps (vLLM V1 v1/worker): the model runner, step inputs, the CPU and CUDA executors, bundles."""
