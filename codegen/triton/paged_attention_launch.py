"""The wrapper of paged_attention.py: checks, grid, workspace, and the split-KV merge.

Grid (fixed by the bucket, so the plan captures as one CUDA graph; lengths and block
tables are read from device memory):
  axis 0: decode buckets (one query per sequence): S programs, program s for sequence s.
          Otherwise (T + S (2 BLOCK_Q - 2)) // BLOCK_Q programs. Sequence s owns programs
          from start(s) = (qsl[s] + s (2 BLOCK_Q - 2)) // BLOCK_Q; it needs at most
          (n_s + 2 BLOCK_Q - 2) // BLOCK_Q of them (its queries may straddle one
          more absolutely aligned q block than cdiv(n_s, BLOCK_Q)), and start(s+1) -
          start(s) is at least that. Programs past a sequence's blocks return.
  axis 1: Hkv (each program serves the H / Hkv query heads of one KV head: GQA rows), times a
          decode bucket's column parts (decode_dv_parts: each part V's D / parts columns)
  axis 2: MAX_SEGS = cdiv(max_model_len, SEG) when split, else 1.
Split needs f32 workspaces ws_acc [T, MAX_SEGS, H, D] and ws_ml [T, MAX_SEGS, H, 2]. A
decode batch merges the segments in the attention kernel (MERGE): that needs an i32
counter [S, Hkv], zero before the launch (the kernel leaves it zero). Otherwise (prefill
and mixed batches, or fuse_merge=False) the merge is a second launch, grid
(T, cdiv(H, BLOCK_H)), that needs `positions` (the step input). Both give the same bits.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from kiln.codegen.triton.configs import DEFAULT, AttentionConfig, Configs
from kiln.codegen.triton.launch import (KernelSpec, as_buf, cdiv, check, check_dtype, check_inner_contiguous,
                                        check_shape, dtype_name, launch, next_pow2, shape_of, sig_type, strides_of,
                                        tail)

MODULE = "kiln.codegen.triton.paged_attention"


def attention_block_q(h: int, hkv: int, config: AttentionConfig, decode: bool = False) -> int:
    """Query positions per program: at least enough rows (BLOCK_Q * G_PAD) for tl.dot's 16."""
    bq = config.block_q if decode else config.prefill_block_q
    return max(next_pow2(bq), cdiv(16, next_pow2(h // hkv)))


def decode_class(num_seqs: int, split: bool) -> str:
    """A decode bucket's size class, whose knobs launch it (AttentionConfig): "one" sequence,
    "split" (split-KV, 2 or more sequences) or "decode" (read whole)."""
    return "one" if num_seqs == 1 else "split" if split else "decode"


def decode_launch(config: AttentionConfig, num_seqs: int, split: bool) -> tuple[int, int, int | None]:
    """-> (warps, stages, maxnreg) of a decode bucket: its class's knobs, the decode ones where unset."""
    cls = decode_class(num_seqs, split)
    if cls == "decode":
        return config.num_warps, config.num_stages, config.maxnreg
    warps, stages, cap = (getattr(config, f"{cls}_{k}") for k in ("num_warps", "num_stages", "maxnreg"))
    return warps or config.num_warps, stages or config.num_stages, cap


def decode_halves(config: AttentionConfig, num_seqs: int, split: bool) -> int:
    """Key halves a tile of a decode bucket's programs takes: its class's knob, 1 where unset."""
    cls = decode_class(num_seqs, split)
    return getattr(config, "key_halves" if cls == "decode" else f"{cls}_key_halves") or 1


def decode_dv_parts(config: AttentionConfig, num_seqs: int, split: bool) -> int:
    """V column parts of a decode bucket's programs (paged_attention.py DV_PARTS): its class's knob
    (`split_dv_parts`, `one_dv_parts`), 1 where unset and for the buckets read whole."""
    cls = decode_class(num_seqs, split)
    return 1 if cls == "decode" else getattr(config, f"{cls}_dv_parts") or 1


def merges_in_kernel(split: bool, decode: bool, fuse_merge: bool = True) -> bool:
    """Whether the attention kernel merges its split-KV segments itself (no merge launch)."""
    return split and decode and fuse_merge


def routes_mixed(config: AttentionConfig, split: bool, decode: bool) -> bool:
    """Whether a batch's sequences of one query go to a launch of the decode variant of their
    own (config.route_mixed, in a mixed bucket: never split)."""
    return config.route_mixed and not split and not decode


def paged_attention_specs(t: int, h: int, hkv: int, d: int, bs: int, num_seqs: int, *, split: bool,
                          max_model_len: int, dtype: str = "bfloat16", out_dtype: str | None = None,
                          config: AttentionConfig, decode: bool = False,
                          cache_dtype: str | None = None, fuse_merge: bool = True) -> list[KernelSpec]:
    """decode: every sequence has exactly one query (t == num_seqs), so program s serves
    sequence s; the rows per program are the config's block_q, the warps, stages and register
    cap its bucket's size class's (decode_launch).
    fuse_merge: a split decode merges in the attention kernel (merges_in_kernel); False keeps
    the merge launch.
    routes_mixed: two launches of the one kernel, the decode variant over the sequences of one
    query (grid: every sequence slot; the knobs of the decode buckets read whole) and the
    prefill variant over the others, each returning at once for the other's sequences."""
    # Mixed buckets are never split (lower.split_kv), so routing gives every decode row the decode kernel.
    check(decode or config.tile_of_decode == config.tile or config.route_mixed,
          "paged_attention: a decode_tile of its own needs route_mixed (a mixed bucket's decode rows must "
          "take the decode kernel, as in a decode step)")
    if routes_mixed(config, split, decode):
        kw = dict(split=False, max_model_len=max_model_len, dtype=dtype, out_dtype=out_dtype,
                  config=replace(config, route_mixed=False), cache_dtype=cache_dtype)
        one = paged_attention_specs(num_seqs, h, hkv, d, bs, num_seqs, decode=True, **kw)[0]
        one = replace(one, constexprs={**one.constexprs, "ROUTE": True}, grid=(max(1, num_seqs), one.grid[1], 1))
        rest = paged_attention_specs(t, h, hkv, d, bs, num_seqs, **{**kw, "config": replace(config, decode_tile=None,
                                                                                         route_mixed=False)})[0]
        return [one, replace(rest, constexprs={**rest.constexprs, "ROUTE": True})]
    for name, tile in (("tile", config.tile), ("decode_tile", config.tile_of_decode)):
        check(config.seg % tile == 0, f"paged_attention: seg must be a multiple of {name}")
        check(tile >= 16 and tile == next_pow2(tile), f"paged_attention: {name} must be a power of 2 >= 16")
    check(not decode or t == num_seqs, f"paged_attention: a decode batch has one query per sequence "
          f"({t} queries, {num_seqs} sequences)")
    tile = config.tile_of_decode if decode else config.tile
    halves = decode_halves(config, num_seqs, split) if decode else 1
    check(halves in (1, 2) and tile // halves >= 16,
          f"paged_attention: key_halves {halves} of a {tile}-key tile (1 or 2 halves of >= 16 keys)")
    bq = attention_block_q(h, hkv, config, decode)
    parts = decode_dv_parts(config, num_seqs, split) if decode else 1
    check(parts == next_pow2(parts) and next_pow2(d) // parts >= 16,
          f"paged_attention: dv_parts {parts} of {next_pow2(d)} columns (a power of 2, parts of >= 16 columns)")
    fused = merges_in_kernel(split, decode, fuse_merge)
    max_segs = cdiv(max_model_len, config.seg) if split else 1
    warps, stages, maxnreg = (decode_launch(config, num_seqs, split) if decode
                              else (config.prefill_num_warps, config.prefill_num_stages, config.prefill_maxnreg))
    p, o = sig_type(dtype), sig_type(out_dtype or dtype)
    i32 = lambda *names: {n: "i32" for n in names}
    main = KernelSpec(
        module=MODULE, kernel="paged_attention_kernel",
        signature=dict(q_ptr=p, **i32("stride_qt", "stride_qh"), cache_ptr=sig_type(cache_dtype or dtype),
                       **i32("stride_cb", "stride_ckv", "stride_cp", "stride_ch"), bt_ptr="*i32", stride_bt="i32",
                       seq_lens_ptr="*i32", qsl_ptr="*i32", num_seqs="i32", out_ptr=o,
                       **i32("stride_ot", "stride_oh"), ws_acc_ptr="*fp32", ws_ml_ptr="*fp32", cnt_ptr="*i32",
                       qk_scale="fp32", window="i32"),
        constexprs=dict(H=h, HKV=hkv, D=d, BLOCK_D=next_pow2(d), BS=bs, G_PAD=next_pow2(h // hkv), BLOCK_Q=bq,
                        TILE=tile, SEG=config.seg, MAX_SEGS=max_segs, SPLIT=split, DECODE=decode,
                        INTERPRET=False, MERGE=fused, **({"HALVES": halves} if halves > 1 else {}),
                        **({"DV_PARTS": parts} if parts > 1 else {})),
        grid=(max(1, num_seqs if decode else (t + num_seqs * (2 * bq - 2)) // bq), hkv * parts, max_segs),
        num_warps=warps, num_stages=stages, maxnreg=maxnreg,
        divisible=("q_ptr", "cache_ptr", "bt_ptr", "seq_lens_ptr", "qsl_ptr", "out_ptr", "ws_acc_ptr", "ws_ml_ptr"))
    if not split or fused:
        return [main]
    block_h = min(next_pow2(h), 4)  # more programs: a batch-1 merge is latency, not bandwidth
    merge = KernelSpec(
        module=MODULE, kernel="attention_merge_kernel",
        signature=dict(ws_acc_ptr="*fp32", ws_ml_ptr="*fp32", positions_ptr="*i32", n_rows_ptr="*i32", out_ptr=o,
                       **i32("stride_ot", "stride_oh", "window")),
        constexprs=dict(H=h, D=d, BLOCK_H=block_h, BLOCK_D=next_pow2(d), SEG=config.seg, MAX_SEGS=max_segs),
        grid=(t, cdiv(h, block_h)), num_warps=4, num_stages=1,
        divisible=("ws_acc_ptr", "ws_ml_ptr", "positions_ptr", "n_rows_ptr", "out_ptr"))
    return [main, merge]


def paged_attention(q, cache, block_table, seq_lens, query_start_loc, out=None, *, scale: float,
                    sliding_window: int = 0, split: bool = False, max_model_len: int | None = None,
                    positions=None, workspace=None, counter=None, config: AttentionConfig | None = None,
                    configs: Configs = DEFAULT, decode: bool = False, fuse_merge: bool = True):
    """q: [T, H, D]; cache: [NB, 2, BS, Hkv, D]; block_table: i32[S, MB]; seq_lens: i32[S];
    query_start_loc: i32[S+1] -> out: [T, H, D]. Split: workspace (ws_acc, ws_ml), and
    positions i32[T] for a merge launch or a zeroed counter i32[S, Hkv] for the merge in
    the kernel (merges_in_kernel); on the host each may be None. max_model_len defaults to
    MB * BS. decode: one query per sequence (T == S), served by the decode kernel variant.
    config.route_mixed: a mixed batch in two launches (paged_attention_specs)."""
    q, cache, block_table, seq_lens, query_start_loc, out, positions, counter = map(
        as_buf, (q, cache, block_table, seq_lens, query_start_loc, out, positions, counter))
    t, h, d = shape_of(q)
    _, two, bs, hkv, d2 = shape_of(cache)
    check(two == 2 and d2 == d, f"paged_attention: cache {list(shape_of(cache))} does not fit q {[t, h, d]}")
    check(h % hkv == 0, f"paged_attention: H={h} is not a multiple of Hkv={hkv}")
    check(dtype_name(cache) in (dtype_name(q), "float8_e4m3fn"),
          f"paged_attention: cache dtype {dtype_name(cache)} is neither q's ({dtype_name(q)}) nor float8_e4m3fn")
    check_inner_contiguous(q, "paged_attention q", 2)
    check_inner_contiguous(cache, "paged_attention cache", 2)
    s, mb = shape_of(block_table)
    for b, shp, name in ((block_table, (s, mb), "block_table"), (seq_lens, (s,), "seq_lens"),
                         (query_start_loc, (s + 1,), "query_start_loc")):
        check_shape(b, shp, name)
        check_dtype(b, ("int32",), name)
    check_inner_contiguous(block_table, "block_table")
    if getattr(seq_lens, "on_host", False) and s:  # device lengths cannot be checked here
        check(int(seq_lens.array.max()) <= mb * bs, f"paged_attention: a sequence is longer than "
              f"its block table ({mb} blocks of {bs})")
    out = out if out is not None else as_buf(np.empty((t, h, d), dtype=q.dtype))
    check(shape_of(out) == (t, h, d), "paged_attention: bad out")
    check_inner_contiguous(out, "paged_attention out", 2)
    max_model_len = max_model_len or mb * bs
    config = config or configs.attention(h, hkv, d, max_model_len, dtype_name(cache))
    specs = paged_attention_specs(t, h, hkv, d, bs, s, split=split, max_model_len=max_model_len,
                                  dtype=dtype_name(q), out_dtype=dtype_name(out), config=config, decode=decode,
                                  cache_dtype=dtype_name(cache), fuse_merge=fuse_merge)
    max_segs, fused = specs[0].constexprs["MAX_SEGS"], specs[0].constexprs["MERGE"]
    if split:
        if workspace is None:
            check(getattr(out, "on_host", False), "paged_attention: split needs device workspaces "
                  f"f32[{t}, {max_segs}, {h}, {d}] and f32[{t}, {max_segs}, {h}, 2]")
            workspace = (np.empty((t, max_segs, h, d), np.float32), np.empty((t, max_segs, h, 2), np.float32))
        ws_acc, ws_ml = map(as_buf, workspace)
        check_shape(ws_acc, (t, max_segs, h, d), "paged_attention ws_acc")
        check_shape(ws_ml, (t, max_segs, h, 2), "paged_attention ws_ml")
        if fused:
            if counter is None:
                check(getattr(out, "on_host", False), f"paged_attention: a split decode needs a zeroed device "
                      f"counter i32[{s}, {hkv}]")
                counter = as_buf(np.zeros((s, hkv), np.int32))
            check_shape(counter, (s, hkv), "paged_attention counter")
            check_dtype(counter, ("int32",), "paged_attention counter")
        else:
            if positions is None:
                check(getattr(out, "on_host", False), "paged_attention: split needs `positions` on the device")
                positions = as_buf(_positions(query_start_loc.array, seq_lens.array, t))
            check_shape(positions, (t,), "positions")
    else:
        ws_acc = ws_ml = out  # unused
    if not fused:
        counter = seq_lens  # unused (an i32 buffer, as the signature says)
    sq, sc, so = strides_of(q), strides_of(cache), strides_of(out)
    qk_scale = float(scale) * math.log2(math.e)
    args = [q, sq[0], sq[1], cache, sc[0], sc[1], sc[2], sc[3], block_table, strides_of(block_table)[0],
            seq_lens, query_start_loc, s, out, so[0], so[1], ws_acc, ws_ml, counter, qk_scale, int(sliding_window)]
    launch(specs[0], args)
    if routes_mixed(config, split, decode):
        launch(specs[1], args)
    elif split and not fused:  # n_rows_ptr = &query_start_loc[S]: the live token count
        launch(specs[1], [ws_acc, ws_ml, positions, tail(query_start_loc, s), out, so[0], so[1], int(sliding_window)])
    return out.array if getattr(out, "on_host", False) else out


def _positions(qsl: np.ndarray, seq_lens: np.ndarray, t: int) -> np.ndarray:
    """Host helper: each token's position, from the varlen metadata (padding -> 0)."""
    pos = np.zeros(t, np.int32)
    for s in range(len(seq_lens)):
        q0, q1 = int(qsl[s]), int(qsl[s + 1])
        pos[q0:q1] = np.arange(int(seq_lens[s]) - (q1 - q0), int(seq_lens[s]))
    return pos
