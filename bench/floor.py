"""The offline workloads' floor: the least time any engine could take for a set of requests on
this GPU, so that an output tok/s figure has a ceiling beside it (the throughput workloads'
"roofline", as batch-1 decode has the weight bytes over the copy bandwidth).

For a dense transformer (every layer full attention, no experts) and requests of in_len prompt
tokens and out_len output tokens each:

  matmul work   every token that passes through the layers (in_len + out_len - 1: the last output
                is sampled, never fed back) costs 2 x the layers' linear weights in FLOPs, and
                every output one LM-head row (2 x vocab x hidden); prompt attention is causal,
                4 x H x D FLOPs per (query, key) pair and layer (QK^T and PV), all at the
                matmul rate measured on the GPU;
  memory work   a decode token at position p reads p + 1 keys' K and V in every layer
                (2 x Hkv x D x the cache's itemsize), at the copy bandwidth.

Everything else (weight reads, which hide under the GEMMs' compute from ~206 rows a step on an
H200; activations; the decode attention's own FLOPs, 32 per cache byte at GQA 4 and e4m3; host
time) is left out, so it is a lower bound on the time, an upper bound on tok/s: an engine at 100 %
of both measured ceilings at once, one after the other, reaches it.
"""
from __future__ import annotations


def linear_params(cfg) -> tuple[int, int]:
    """(the linear weights of one layer, the LM head's) of a dense ModelConfig: q, k, v, o and
    the gated MLP's gate, up and down; vocab x hidden."""
    hd, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    attn = cfg.hidden_size * hd * (2 * h + 2 * kv)  # q and o: H x D each way, k and v: Hkv x D
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return attn + mlp, cfg.vocab_size * cfg.hidden_size


def work(cfg, in_lens, out_lens, kv_itemsize: int) -> dict:
    """-> {"matmul_flops", "kv_read_bytes"} of the requests (in_lens[i] prompt, out_lens[i]
    output tokens)."""
    layer, head = linear_params(cfg)
    L, H, D, Hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    fed = sum(i + o - 1 for i, o in zip(in_lens, out_lens))  # tokens through the layers
    pairs_prompt = sum(i * (i + 1) // 2 for i in in_lens)  # causal (query, key) pairs
    # decode tokens at positions i .. i + o - 2, each reading position + 1 keys
    keys_decode = sum((o - 1) * (i + 1) + (o - 1) * (o - 2) // 2 for i, o in zip(in_lens, out_lens))
    flops = 2 * layer * L * fed + 2 * head * sum(out_lens) + 4 * H * D * L * pairs_prompt
    return {"matmul_flops": flops, "kv_read_bytes": 2 * Hkv * D * kv_itemsize * L * keys_decode}


def floor(cfg, in_lens, out_lens, kv_itemsize: int, matmul_flops_s: float, bandwidth: float,
          capped_flops_s: float | None = None) -> dict:
    """The workload's floor at the measured rates (FLOP/s; bytes/s, read + write counted, as
    bench/device.py measures it) -> the JSON's roofline record. capped_flops_s: the matmul rate
    with the board held at its power limit (gpu_matmul_rate(warm_s=...)); the record then also
    carries the floor at that rate, under "power_capped"."""
    w = work(cfg, in_lens, out_lens, kv_itemsize)
    seconds = w["matmul_flops"] / matmul_flops_s + w["kv_read_bytes"] / bandwidth
    rec = {"tok_s": sum(out_lens) / seconds, "floor_s": seconds, **w,
           "matmul_TFLOPs": matmul_flops_s / 1e12, "copy_bandwidth_GBps": bandwidth / 1e9,
           "counts": "matmul FLOPs at the measured bf16 matmul rate + decode K/V bytes at the copy "
                     "bandwidth (bench/floor.py): weight reads, activations and host time left out"}
    if capped_flops_s:
        capped = w["matmul_flops"] / capped_flops_s + w["kv_read_bytes"] / bandwidth
        rec["power_capped"] = {"tok_s": sum(out_lens) / capped, "floor_s": capped,
                               "matmul_TFLOPs": capped_flops_s / 1e12}
    return rec


def gpu_matmul_rate(n: int = 8192, iters: int = 20, warm_s: float = 0.0) -> float | None:
    """FLOP/s of a bf16 n x n x n matmul on random data through torch (cuBLAS) under events,
    or None where torch has no CUDA (torch is a bench-only dependency, never the runtime's).
    warm_s > 0: matmuls run that long first, untimed, so that the timed ones find the board at
    its power limit. An H200 at 700 W holds its 1,980 MHz boost for ~0.1 s of tensor-core work,
    then settles at ~1,550-1,700 MHz (nvidia-smi: "SW power cap"); any workload that keeps the
    GEMMs busy for seconds, as the offline ones do, runs at that clock."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        c = a @ b
    if warm_s > 0:
        import time

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < warm_s:
            for _ in range(10):
                c = a @ b
            torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        c = a @ b
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del a, b, c
    torch.cuda.empty_cache()  # the engine sizes its KV cache from the memory left free
    return 2 * n ** 3 * iters / seconds
