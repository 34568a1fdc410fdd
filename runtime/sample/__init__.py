"""Sampling (vLLM V1 v1/sample): SamplingParams, the batch metadata, the numpy and GPU samplers, logprobs."""
