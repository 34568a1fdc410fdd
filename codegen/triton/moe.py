"""The fused MoE layer on the GPU: which kernels run for a bucket, their default tiles, and the
wrappers that check and launch them (the kernels: moe_router.py, moe_align.py, moe_gemm.py).

    router:  moe_router(logits)                            -> topk_ids, topk_weights
    experts: moe_experts(x, topk_ids, topk_weights, w13, w2) -> y [T, H]

Paths for the experts, chosen per bucket by moe_path (a schedule choice, not a numerics one;
a bucket's schedules entry may take the other, and its own tiles: moe_config.py, Configs.moe):
- "decode" (T * k <= DECODE_MAX_ASSIGNMENTS): no sorting. moe_gate_up_kernel runs a program per
  (assignment, column block) reading only its expert's w13 rows, moe_down_kernel (SPLIT) a
  program per (assignment, column block) reading its expert's w2 rows and storing the expert's
  output row o, and moe_sum_kernel weights and adds each token's k rows in rank order: 3
  launches, the weights of the chosen experts streamed once per assignment (at batch 1, the k
  experts' weights, nothing else), by T * k * (N / BLOCK_N) programs in each GEMM, so that one
  token's 8 experts fill the SMs (issue 37: a program per (token, column block) walking the k
  experts one after another was latency-bound, 0.9 TB/s on the H200 at batch 1).
- "decode_token": the earlier decode form, kept as a schedule choice: moe_down_kernel a program
  per (token, column block) that reads its k experts' w2 rows and sums them in rank order
  itself: 2 launches, but only H / BLOCK_N programs a token.
- "grouped": moe_align sorts the assignments by expert into BLOCK_M-row blocks, then the grouped
  gate_up and down GEMMs read each chosen expert's weights once per column block for all its
  rows, and moe_sum weights and adds each token's k rows in rank order: 4 launches.
All give a token the same bits (moe_gemm.py: one K order per weight, the same epilogues, the
same rank-order sum of the same rounded products), so the path a bucket takes, and its tiles,
never change a token's output: a token alone in a decode bucket and the same token among 4,000
in a prefill bucket get identical rows. The threshold is only about speed: past a few dozen
assignments several land on one expert, and the grouped form reads its weights once for all.
(On the GPU the equality rests on 16-row mma.sync tiles and 64-row wgmma tiles giving the same
rows, as gemm.py measured for the dense GEMM on the H200; if an arch ever broke it, the rule
would have to become "decode path for every bucket of a family", never a per-batch choice.)
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from kiln.codegen.triton.launch import (KernelSpec, as_buf, check, check_dtype, check_inner_contiguous, dtype_name,
                                        launch, shape_of, strides_of)
from kiln.codegen.triton.moe_align import moe_align, moe_align_capacity, moe_align_spec
from kiln.codegen.triton.moe_gemm import Fp8Experts, MoeTile, moe_down_spec, moe_gate_up_spec, moe_sum_spec
from kiln.codegen.triton.nvfp4_gemm import SM90_MAX_ROWS
from kiln.graph.gguf_blocks import BLOCKS, row_bytes

DECODE_MAX_ASSIGNMENTS = 64  # T * k up to which a bucket takes the decode path (a speed knob)


DECODE_PATHS = ("decode", "decode_token")


def moe_path(t: int, top_k: int) -> str:
    return "decode" if t * top_k <= DECODE_MAX_ASSIGNMENTS else "grouped"


def moe_tiles(t: int, top_k: int, e: int, h: int, i: int, arch: str = "sm_90", path: str | None = None):
    """(gate_up tile, down tile) for a bucket: defaults until `build.py tune` sweeps them. Decode:
    16-wide column blocks, so that even one token's few experts spread over the SMs (at the
    Qwen3.6-35B-A3B shape, batch 1: 256 gate_up and 1,024 down programs of 2 warps), and stages
    enough to keep each program's whole K in flight, as the dense GEMM's tuned decode tiles
    (schedules/sm_90/gemm.yaml: 16-wide, 2 warps, 5-8 stages). decode_token: I / 32 gate_up
    blocks per assignment, H / 16 down blocks per token. Grouped: BLOCK_M near the mean rows per
    expert (16 while experts get a block or less, else 32, 64), 64-wide columns."""
    path = path or moe_path(t, top_k)
    if path == "decode":
        return (MoeTile(block_m=16, block_n=16, block_k=128, num_warps=2, num_stages=5),
                MoeTile(block_m=16, block_n=16, block_k=128, num_warps=2, num_stages=4))
    if path == "decode_token":
        return (MoeTile(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4),
                MoeTile(block_m=16, block_n=16, block_k=128, num_warps=4, num_stages=4))
    rows = t * top_k / e
    bm = 16 if rows <= 16 else 32 if rows <= 48 else 64
    tile = MoeTile(block_m=bm, block_n=64, block_k=64, num_warps=4, num_stages=3 if arch == "sm_90" else 2)
    return tile, tile


def gguf_tiles(tiles: tuple[MoeTile, MoeTile], h: int, i: int, step: int = 32) -> tuple[MoeTile, MoeTile]:
    """GGUF (and NVFP4) experts (moe_gemm.py): K steps that cut each weight's K into whole steps (the
    dequantised tile has no K mask; K is whole 32-weight GGUF blocks, 16-column NVFP4 groups, at
    least: `step`). A schedule knob: the sums do not move."""
    gu, dn = tiles
    return (gu if h % gu.block_k == 0 else replace(gu, block_k=step),
            dn if i % dn.block_k == 0 else replace(dn, block_k=step))


def fp8_tiles(tiles: tuple[MoeTile, MoeTile], arch: str) -> tuple[MoeTile, MoeTile]:
    """FP8 experts (moe_gemm.Fp8Experts): on sm_90 every tile 64 rows at least and whole warpgroups
    (e4m3 wgmma in every bucket); a schedule knob that moves no sum. The decode form's rows are
    Fp8Experts.decode_m whatever the tile says."""
    if arch != "sm_90":
        return tiles
    return tuple(replace(t, block_m=max(64, t.block_m), num_warps=max(4, -(-t.num_warps // 4) * 4)) for t in tiles)


def nvfp4_tiles(tiles: tuple[MoeTile, MoeTile], arch: str) -> tuple[MoeTile, MoeTile]:
    """NVFP4 experts (moe_gemm NV): on sm_90 at most 32 rows a tile, so that every bucket runs mma.sync
    (nvfp4_gemm.nvfp4_tile says why: a 64-row wgmma tile of the dequantised operand moved a few
    outputs by a bf16 ulp on the H100); the decode form's 16 rows already are. A schedule knob that
    moves no sum. Other archs keep the schedule's tiles."""
    if arch != "sm_90":
        return tiles
    return tuple(replace(t, block_m=min(SM90_MAX_ROWS, t.block_m)) for t in tiles)


def quantised_tiles(tiles: tuple[MoeTile, MoeTile], arch: str, *, fp8: bool = False,
                    nvfp4: bool = False) -> tuple[MoeTile, MoeTile]:
    """The tiles quantised experts run from the schedule's (bf16 experts') tiles: fp8_tiles or nvfp4_tiles
    (the lowering sizes the align step's scratch by them, moe_experts launches them)."""
    if fp8:
        return fp8_tiles(tiles, arch)
    return nvfp4_tiles(tiles, arch) if nvfp4 else tiles


def moe_experts_specs(t: int, top_k: int, e: int, h: int, i: int, dtype: str = "bfloat16", *,
                      path: str | None = None, tiles: tuple[MoeTile, MoeTile] | None = None,
                      arch: str = "sm_90", qtypes: tuple[str, str] | None = None,
                      fp8: Fp8Experts | None = None, nvfp4: bool = False) -> list[KernelSpec]:
    """The launches of one MoE experts layer for a bucket of T tokens, in order (the router's is
    moe_router_spec). qtypes: (w13's, w2's) GGUF block formats, for experts kept in their blocks;
    fp8: block-wise FP8 experts (x e4m3 with its scales; dtype: the activations')."""
    path = path or moe_path(t, top_k)
    gu, dn = tiles or moe_tiles(t, top_k, e, h, i, arch, path)
    q13, q2 = qtypes or (None, None)
    if qtypes:
        gu, dn = gguf_tiles((gu, dn), h, i)
    if fp8:
        gu, dn = fp8_tiles((gu, dn), fp8.arch)
    if nvfp4:
        gu, dn = gguf_tiles(nvfp4_tiles((gu, dn), arch), h, i, 16)
    q = dict(fp8=fp8, nvfp4=nvfp4)
    if path == "decode":
        return [moe_gate_up_spec(t, top_k, e, h, i, dtype, tile=gu, decode=True, qtype=q13, **q),
                moe_down_spec(t, top_k, e, h, i, dtype, tile=dn, decode=True, qtype=q2, split=True, **q),
                moe_sum_spec(t, top_k, h, dtype)]
    if path == "decode_token":
        return [moe_gate_up_spec(t, top_k, e, h, i, dtype, tile=gu, decode=True, qtype=q13, **q),
                moe_down_spec(t, top_k, e, h, i, dtype, tile=dn, decode=True, qtype=q2, **q)]
    check(path == "grouped", f"moe: unknown path {path!r}")
    check(gu.block_m == dn.block_m, "moe: gate_up and down share the align step's BLOCK_M")
    return [moe_align_spec(t, top_k, e, gu.block_m),
            moe_gate_up_spec(t, top_k, e, h, i, dtype, tile=gu, decode=False, qtype=q13, **q),
            moe_down_spec(t, top_k, e, h, i, dtype, tile=dn, decode=False, qtype=q2, **q),
            moe_sum_spec(t, top_k, h, dtype)]


def moe_workspace(t: int, top_k: int, e: int, h: int, i: int, dtype: str, *, path: str,
                  block_m: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The device scratch a path needs: name -> (shape, dtype name)."""
    ws = {"a": ((t * top_k, i), dtype)}
    if path == "decode":
        ws["o"] = ((t * top_k, h), dtype)
    if path == "grouped":
        em = moe_align_capacity(t, top_k, e, block_m)
        ws |= {"sorted_ids": ((em,), "int32"), "block_expert": ((em // block_m,), "int32"),
               "n_post": ((1,), "int32"), "o": ((t * top_k, h), dtype)}
    return ws


def _unwrap(b):
    return b.array if getattr(b, "on_host", False) else b


def _check_layer(x, topk_ids, topk_weights, w13, w2, qtypes=None, fp8=None, nvfp4=None):
    check(len(shape_of(x)) == 2, "moe: x must be [T, H]")
    check_dtype(x, ("float8_e4m3fn",) if fp8 else ("bfloat16", "float16", "float32"), "moe x")
    check_inner_contiguous(x, "moe x")
    t, h = shape_of(x)
    check(len(shape_of(w13)) == 3 and shape_of(w13)[1] % 2 == 0, f"moe: w13 {list(shape_of(w13))} is not [E, 2I, H]")
    e, i = shape_of(w13)[0], shape_of(w13)[1] // 2
    if qtypes:  # GGUF blocks: rows of row_bytes(qtype, K) bytes
        check(all(q in BLOCKS for q in qtypes) and dtype_name(x) != "float32", f"moe: GGUF experts {qtypes} "
              f"need block formats kiln computes in and bf16/f16 activations")
        check(dtype_name(w13) == dtype_name(w2) == "uint8", "moe: GGUF experts are u8 blocks")
        check(h % BLOCKS[qtypes[0]][0] == 0 and shape_of(w13)[2] == row_bytes(qtypes[0], h),
              f"moe: w13 {list(shape_of(w13))} is not [E, 2I, {qtypes[0]} rows of {h}]")
        check(i % BLOCKS[qtypes[1]][0] == 0 and shape_of(w2) == (e, h, row_bytes(qtypes[1], i)),
              f"moe: w2 {list(shape_of(w2))} is not [{e}, {h}, {qtypes[1]} rows of {i}]")
    elif nvfp4:  # packed e2m1 pairs, e4m3 block scales per 16 columns, f32 per-tensor scales
        (s13, g13, s2, g2) = nvfp4
        check(dtype_name(x) != "float32" and h % 16 == 0 and i % 16 == 0, f"moe: NVFP4 experts need bf16/f16 "
              f"activations and H={h}, I={i} whole 16-column groups")
        check(dtype_name(w13) == dtype_name(w2) == "uint8" and shape_of(w13)[2] == h // 2
              and shape_of(w2) == (e, h, i // 2), f"moe: NVFP4 experts must be u8 [E, 2I, {h // 2}] and "
              f"[{e}, {h}, {i // 2}]")
        for b, shape, d, name in ((s13, (e, 2 * i, h // 16), "float8_e4m3fn", "s13"), (g13, (e, 2), "float32", "g13"),
                                  (s2, (e, h, i // 16), "float8_e4m3fn", "s2"), (g2, (e, 1), "float32", "g2")):
            check(shape_of(b) == shape and dtype_name(b) == d, f"moe: NVFP4 scales {name} must be {d}{list(shape)}")
            check_inner_contiguous(b, f"moe {name}", len(shape))
    else:
        check(shape_of(w13)[2] == h, f"moe: w13 {list(shape_of(w13))} is not [E, 2I, {h}]")
        check(shape_of(w2) == (e, h, i), f"moe: w2 {list(shape_of(w2))} is not [{e}, {h}, {i}]")
        check(dtype_name(w13) == dtype_name(x) and dtype_name(w2) == dtype_name(x), "moe: x, w13, w2 dtypes differ")
    if fp8:  # (xs, s13, s2): the scales of x [T, H / bk], w13 [E, 2I / bn, H / bk], w2 [E, ceil(H / bn), I / bk]
        (xs, s13, s2), (bn, bk) = fp8
        check(h % bk == 0 and i % bk == 0 and i % bn == 0, f"moe: FP8 experts of H={h}, I={i} are not whole "
              f"[{bn}, {bk}] blocks")
        for b, shape, name in ((xs, (t, h // bk), "xs"), (s13, (e, 2 * i // bn, h // bk), "s13"),
                               (s2, (e, -(-h // bn), i // bk), "s2")):
            check(shape_of(b) == shape and dtype_name(b) == "float32",
                  f"moe: FP8 scales {name} must be f32{list(shape)}")
            check_inner_contiguous(b, f"moe {name}", len(shape))
    for b, name in ((w13, "w13"), (w2, "w2")):
        check_inner_contiguous(b, f"moe {name}", 3)
    check(len(shape_of(topk_ids)) == 2 and shape_of(topk_ids)[0] == t, "moe: topk_ids must be [T, k]")
    k = shape_of(topk_ids)[1]
    check(dtype_name(topk_ids) == "int32" and tuple(strides_of(topk_ids)) == (k, 1), "moe: topk_ids packed i32")
    check(shape_of(topk_weights) == (t, k) and dtype_name(topk_weights) == "float32"
          and tuple(strides_of(topk_weights)) == (k, 1), "moe: topk_weights packed f32[T, k]")
    return t, h, e, i, k


def moe_experts(x, topk_ids, topk_weights, w13, w2, out=None, *, path: str | None = None,
                tiles: tuple[MoeTile, MoeTile] | None = None, n_rows=None, workspace: dict | None = None,
                arch: str = "sm_90", qtypes: tuple[str, str] | None = None, defer_sum: bool = False,
                fp8: tuple | None = None, block: tuple[int, int] | None = None, min_scale: float = 0.0,
                nvfp4: tuple | None = None):
    """x: [T, H] (rows may be strided), topk_ids i32[T, k], topk_weights f32[T, k], w13 [E, 2I, H],
    w2 [E, H, I] -> y [T, H] in x's dtype (the graph op moe_experts). n_rows: i32[1] live tokens
    (default T; rows past it are not written). workspace: moe_workspace's buffers by name
    (allocated here for host arrays). qtypes: (w13's, w2's) GGUF block formats, w13 and w2 then
    u8 rows of blocks [E, 2I, RB], [E, H, RB'] (moe_experts_gguf). defer_sum (the "decode" and
    "grouped" paths): the expert rows are left in workspace["o"] and the rank-order sum is not
    launched (out is not written): moe_sum does it later, with the shared expert's add.
    fp8: (xs, s13, s2) for block-wise FP8 experts (moe_experts_fp8): x, w13, w2 e4m3, xs f32 [T, H / bk]
    x's scales, s13 and s2 the weights' per [bn, bk] = block; out (default bf16) sets the activation
    dtype; the intermediate is quantised with min_scale inside the down GEMM.
    nvfp4: (s13, g13, s2, g2) for ModelOpt NVFP4 experts (moe_experts_nvfp4, W4A16): w13 u8 [E, 2I, H/2],
    w2 u8 [E, H, I/2], s13 / s2 their e4m3 block scales, g13 f32 [E, 2] / g2 [E, 1] their per-tensor
    scales; x in the activation dtype."""
    x, topk_ids, topk_weights, w13, w2, out, n_rows = map(as_buf, (x, topk_ids, topk_weights, w13, w2, out, n_rows))
    fp8 = (tuple(map(as_buf, fp8)), tuple(block)) if fp8 is not None else None
    nvfp4 = tuple(map(as_buf, nvfp4)) if nvfp4 is not None else None
    t, h, e, i, k = _check_layer(x, topk_ids, topk_weights, w13, w2, qtypes, fp8, nvfp4)
    path = path or moe_path(t, k)
    check(not (defer_sum and path == "decode_token"), "moe: the decode_token path sums in its down GEMM")
    gu, dn = quantised_tiles(tiles or moe_tiles(t, k, e, h, i, arch, path), arch, fp8=fp8 is not None,
                             nvfp4=nvfp4 is not None)
    if out is None:
        import ml_dtypes
        out = as_buf(np.empty((t, h), ml_dtypes.bfloat16 if fp8 else x.dtype))
    dt = dtype_name(out) if fp8 else dtype_name(x)  # the activation dtype
    check(shape_of(out) == (t, h) and dtype_name(out) == dt and dt != "float8_e4m3fn",
          f"moe: out must be [{t}, {h}] {dt}")
    act = np.dtype(out.dtype) if getattr(out, "on_host", False) else None
    check_inner_contiguous(out, "moe out")
    n_rows = n_rows if n_rows is not None else as_buf(np.array([t], np.int32))
    need = moe_workspace(t, k, e, h, i, dt, path=path, block_m=gu.block_m)
    ws = {n: as_buf(b) for n, b in (workspace or {}).items()}
    for name, (shape, d) in need.items():
        if name not in ws:
            check(getattr(x, "on_host", False), f"moe: device buffers need workspace[{name!r}] {d}{list(shape)}")
            ws[name] = as_buf(np.empty(shape, act if d == dt else d))
        check(shape_of(ws[name]) == shape and dtype_name(ws[name]) == d, f"moe: workspace[{name!r}] must be "
              f"{d}{list(shape)}")
    spec8 = Fp8Experts(fp8[1], min_scale, arch) if fp8 else None
    specs = moe_experts_specs(t, k, e, h, i, dt, path=path, tiles=(gu, dn), arch=arch, qtypes=qtypes, fp8=spec8,
                              nvfp4=nvfp4 is not None)
    # FP8: x's and the weights' scales; NVFP4: the block and per-tensor scales; otherwise placeholders
    # of the types the specs give them
    (xs, s13, s2), sx = (fp8[0], strides_of(fp8[0][0])[0]) if fp8 else ((x, w13, w2), 0)
    g13, g2 = (w13, w2)
    if nvfp4:
        s13, g13, s2, g2 = nvfp4
    if path in DECODE_PATHS:
        gate_up, down = specs[:2]
        meta = [topk_ids, topk_ids, topk_ids, n_rows, n_rows, 0, t * k]  # no sorted rows: placeholders
        launch(gate_up, [x, w13, ws["a"], *meta, strides_of(x)[0], xs, s13, sx, g13])
        if path == "decode_token":
            launch(down, [ws["a"], w2, topk_weights, out, out, *meta, strides_of(out)[0], s2, g2])  # (o: unused)
            return _unwrap(out)
        launch(down, [ws["a"], w2, topk_weights, ws["o"], out, *meta, strides_of(out)[0], s2, g2])  # (y: unused)
        if not defer_sum:
            moe_sum(ws["o"], topk_weights, out, n_rows=n_rows)
        return _unwrap(out)
    align, gate_up, down, _ = specs
    moe_align(topk_ids, num_experts=e, block_m=gu.block_m, n_rows=n_rows, sorted_ids=ws["sorted_ids"],
              block_expert=ws["block_expert"], n_post=ws["n_post"])
    em = shape_of(ws["sorted_ids"])[0]
    meta = [topk_ids, ws["sorted_ids"], ws["block_expert"], ws["n_post"], n_rows, em, t * k]
    launch(gate_up, [x, w13, ws["a"], *meta, strides_of(x)[0], xs, s13, sx, g13])
    launch(down, [ws["a"], w2, topk_weights, ws["o"], out, *meta, strides_of(out)[0], s2, g2])
    if not defer_sum:
        moe_sum(ws["o"], topk_weights, out, n_rows=n_rows)
    return _unwrap(out)


def moe_sum_operands(o, topk_weights, t: int, h: int, dt: str, shared=None) -> tuple[list, str | None]:
    """The checked operands of a rank-order sum into [T, H] rows of dt (moe_sum_row in
    moe_gemm.py), whichever kernel runs it: o [T*k, H] packed, topk_weights f32[T, k] packed,
    shared None or (x [T, H] packed, gate [T, 1]) -> ([o, weights, x, gate, gate's row stride],
    the gate's dtype or None); without shared, x and gate are placeholders (o)."""
    o, topk_weights = as_buf(o), as_buf(topk_weights)
    k = shape_of(topk_weights)[1] if len(shape_of(topk_weights)) == 2 else 0
    check(shape_of(o) == (t * k, h) and tuple(strides_of(o)) == (h, 1) and dtype_name(o) == dt,
          f"moe_sum: o must be packed {dt}[{t * k}, {h}]")
    check(shape_of(topk_weights) == (t, k) and dtype_name(topk_weights) == "float32"
          and tuple(strides_of(topk_weights)) == (k, 1), "moe_sum: weights packed f32[T, k]")
    if shared is None:
        return [o, topk_weights, o, o, 0], None
    x, gate = (as_buf(b) for b in shared)
    check(shape_of(x) == (t, h) and tuple(strides_of(x)) == (h, 1) and dtype_name(x) == dt,
          f"moe_sum: the shared expert's x must be packed {dt}[{t}, {h}]")
    check(shape_of(gate) == (t, 1), f"moe_sum: the shared expert's gate must be [{t}, 1]")
    return [o, topk_weights, x, gate, strides_of(gate)[0]], dtype_name(gate)


def moe_sum(o, topk_weights, out, *, n_rows=None, shared=None):
    """o: [T*k, H] packed (each token's k expert rows, in rank order), topk_weights f32[T, k] ->
    out [T, H] = sum_j w[t, j] * o[t*k + j] in rank order, rounded (moe_sum_kernel). shared:
    (x [T, H] packed, gate [T, 1]): out = that sum + x * sigmoid(gate) instead, the graph's
    sigmoid_mul and add on the shared expert's output (models/moe.py), in this one launch.
    rms_norm.add_rms_norm(moe=...) and fp8_quant.add_rms_norm_quant(moe=...) compute the same rows
    inside the next norm's launch instead (lower.py _norm_takes_moe_sum)."""
    out, n_rows = as_buf(out), as_buf(n_rows)
    t, h = shape_of(out)
    dt = dtype_name(out)
    (o, topk_weights, x, gate, sgt), gate_dt = moe_sum_operands(o, topk_weights, t, h, dt, shared)
    check_inner_contiguous(out, "moe_sum out")
    n_rows = n_rows if n_rows is not None else as_buf(np.array([t], np.int32))
    spec = moe_sum_spec(t, shape_of(topk_weights)[1], h, dt, shared=gate_dt)
    launch(spec, [o, topk_weights, out, n_rows, strides_of(out)[0], x, gate, sgt])
    return _unwrap(out)
