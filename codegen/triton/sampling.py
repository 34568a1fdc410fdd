"""Sampling on the GPU: the numpy sampler's steps (runtime/sample/sampler.py, ported from vLLM V1
`vllm/v1/sample/sampler.py`) on f32 logits rows already in device memory.

The row kernels run one program per row and walk the vocabulary in BLOCK_V chunks, so
any V (152k for Qwen) works with fixed registers; a row is 4V bytes and stays in L2
between passes. sample_kernel instead splits each row over cdiv(V, BLOCK_V) programs and
runs in phases, one launch each (runtime/sample/phases.py): one program per row made a
128k-token row's top-k/top-p passes one SM's work, 3.3 ms a step on the H200. Rows are
addressed through `row_idx` (program j works on logits row row_idx[j]), so the sampled
rows of a step need not be contiguous.

  logits_processors_kernel  in place, from a compact CSR list per row: entries
      (token, additive bias, output count) cover logit_bias, bad words and min_tokens
      (bias -inf) and penalties (every listed token was seen in the prompt or the
      output: repetition; count > 0: frequency and presence, vLLM's formulas). A row
      in whitelist mode (allowed_token_ids) lists every allowed token and all others
      become -inf.
  sample_kernel             greedy argmax (temperature 0), or temperature, min_p,
      top-k, top-p and the exponential race with Philox noise seeded per row.
  logprobs_kernel           log_softmax of raw logits: a given token's logprob and
      rank, and the top K with `gather_logprobs`' tie rules.
  copy_rows_kernel          raw rows aside before the processors touch them.
  token_bitmask_kernel      a grammar's allowed tokens (llguidance's packed bitmask: token t is
      bit t % 32 of word t // 32 of its row) applied in place: -inf where the bit is clear
      (vLLM: apply_token_bitmask_inplace_triton), before anything else reads the rows.
  stage_inputs_kernel       a step's input block from its staging copy into place, with the
      tokens the step before sampled patched into its input ids on the device (async
      scheduling: the next step is launched before the ids reach the host). Not sampling,
      but the sampler's ids are what it feeds, so it is compiled and recorded beside them.

Top-k and top-p need no sort: the k-th largest value and the top-p cut are found by radix
searches over the order-preserving int32 image of the f32 values, one pass over the row per
digit, every program adding its part with integer atomics: top-k 8 bits a pass (4 counting
passes, tl.histogram), top-p 4 bits a pass (8 passes over the mass, in fixed point). Both
keep every token tied with the last kept one (a value cut), as the numpy reference does;
vLLM's sort-based top-p masks by sorted position and may drop some of the tokens tied with
its last kept one, in the sort's order.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.configs import ElementwiseConfig
from kiln.codegen.triton.launch import (KernelSpec, as_buf, check, check_dtype, check_inner_contiguous, launch,
                                        next_pow2, shape_of, strides_of)
from kiln.runtime.sample.phases import HIST_PASSES, PHASE_TOKEN, sample_phases, sample_scratch

NEG_INF = tl.constexpr(float("-inf"))
# Launch config of the bundle's row kernels (processors, logprobs, copy_rows): one program per
# row, so the block is wide to keep one SM's loads in flight, and the warps many: a row's
# passes are one SM's work. (H200, V = 128,256: the one-program sample kernel took greedy rows
# from 19.2 to 12.1 us with it instead of 2,048 x 8 warps; docs/bench/h200_sampler_sweep.json.)
DEFAULT_CONFIG = ElementwiseConfig(block=8192, num_warps=32)
# sample_kernel: a row is split over cdiv(V, 2,048) programs (63 for a 128k vocabulary), each
# pass over it is one launch of (rows, 63) programs
SAMPLE_CONFIG = ElementwiseConfig(block=2048, num_warps=4)


# -- helpers ------------------------------------------------------------------------------

@triton.jit
def _load_row(base, cols, V):
    x = tl.load(base + cols, mask=cols < V, other=NEG_INF)
    return tl.where(x != x, NEG_INF, x)  # NaN never wins


@triton.jit
def _key(x):
    # Order-preserving int32 image of f32: non-negative floats keep their bits, negative
    # ones flip all bits but the sign; -0.0 and +0.0 are one value, as in numpy.
    b = x.to(tl.int32, bitcast=True)
    k = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return tl.where(x == 0.0, 0, k)


@triton.jit
def _mul_rn(a, b, INTERPRET: tl.constexpr):
    """a * b rounded on its own: ptxas leaves mul.rn out of fma contraction, so
    f * c + p rounds as numpy's two operations do."""
    if INTERPRET:
        return a * b
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _first_max(best, best_idx, V):
    """Reduce per-lane (value, index) to the largest value and its lowest index. Every pass
    keeps a running best per lane and reduces once at its end: no barrier per chunk."""
    m = tl.max(best, axis=0)
    return m, tl.min(tl.where(best == m, best_idx, V), axis=0)


@triton.jit
def _row_argmax(base, V, BLOCK_V: tl.constexpr):
    """(max, index of its first occurrence); a row of -inf gives (-inf, 0) as numpy."""
    best = tl.full((BLOCK_V,), NEG_INF, tl.float32)
    best_idx = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=NEG_INF)
        x = tl.where(x != x, NEG_INF, x)  # NaN never wins
        better = x > best  # strictly: a lane keeps its earliest maximum
        best_idx = tl.where(better, cols, best_idx)
        best = tl.where(better, x, best)
    m, i = _first_max(best, best_idx, V)
    return m, tl.where(m > NEG_INF, i, 0)


@triton.jit
def _scaled(base, cols, V, temp, zmax, min_p):
    """(w, key(w)): z = x / T with min_p applied, -inf where p < min_p * p_max, i.e. where
    exp(z - zmax) < min_p (the reference compares softmax probabilities, p_i < p_max *
    min_p; the two differ only by rounding at the boundary)."""
    x = tl.load(base + cols, mask=cols < V, other=NEG_INF)
    z = tl.math.div_rn(tl.where(x != x, NEG_INF, x), temp)  # IEEE division, as numpy's logits / T
    if min_p > 0.0:  # (exp >= 0 always holds: without min_p, no exp per token and pass)
        w = tl.where((tl.exp(z - zmax) >= min_p) & (cols < V), z, NEG_INF)
    else:
        w = tl.where(cols < V, z, NEG_INF)
    # the order-preserving int32 image (see _key), inlined: the interpreter pays per call
    bits = w.to(tl.int32, bitcast=True)
    key = tl.where(w == 0.0, 0, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF))
    return w, key


# -- kernels ------------------------------------------------------------------------------

@triton.jit
def logits_processors_kernel(logits_ptr, row_idx_ptr, start_ptr, tok_ptr, bias_ptr, count_ptr, mode_ptr,
                             rep_ptr, freq_ptr, pres_ptr, stride,
                             V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_E: tl.constexpr,
                             INTERPRET: tl.constexpr):
    # grid: (B,); logits: f32[*, V] (row row_idx[b]), entries start[b]..start[b+1]-1 of
    # tok/bias/count (count -1: not seen, bias only), mode[b] 1: whitelist.
    # Host guarantees: a token appears once per row; in whitelist mode only allowed tokens.
    b = tl.program_id(0)
    base = logits_ptr + tl.load(row_idx_ptr + b).to(tl.int64) * stride
    e_lo = tl.load(start_ptr + b)
    e_hi = tl.load(start_ptr + b + 1)
    whitelist = tl.load(mode_ptr + b) != 0
    rep = tl.load(rep_ptr + b)
    freq = tl.load(freq_ptr + b)
    pres = tl.load(pres_ptr + b)
    for e0 in range(e_lo, e_hi, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        m = e < e_hi
        tok = tl.load(tok_ptr + e, mask=m, other=0)
        cnt = tl.load(count_ptr + e, mask=m, other=-1)
        x = tl.load(base + tok, mask=m, other=0.0) + tl.load(bias_ptr + e, mask=m, other=0.0)
        # vLLM apply_penalties: repetition on tokens of the prompt or the output (divide
        # positive logits, multiply the others), then frequency and presence on the output.
        seen = cnt >= 0
        x = tl.where(seen & (x > 0), tl.math.div_rn(x, rep), tl.where(seen, x * rep, x))
        fc = _mul_rn(tl.zeros_like(x) + freq, cnt.to(tl.float32), INTERPRET)
        x = tl.where(cnt > 0, x - (fc + pres), x)
        if whitelist:
            tl.store(bias_ptr + e, x, mask=m)  # the bias slot (read above by this thread) keeps it
        else:
            tl.store(base + tok, x, mask=m)
    if whitelist:
        tl.debug_barrier()  # every saved value is written before the row is cleared
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            tl.store(base + cols, tl.full((BLOCK_V,), NEG_INF, tl.float32), mask=cols < V)
        tl.debug_barrier()
        for e0 in range(e_lo, e_hi, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            m = e < e_hi
            tok = tl.load(tok_ptr + e, mask=m, other=0)
            tl.store(base + tok, tl.load(bias_ptr + e, mask=m, other=0.0), mask=m)


@triton.jit
def _radix(kw):
    """The key as uint32 in the same order (the sign bit flipped): radix digits from the top."""
    return kw.to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _split_max(val_ptr, idx_ptr, b, V, NP, NP_PAD: tl.constexpr):
    """Row b's (max, index of its first occurrence) from its programs' phase-0 partials."""
    j = tl.arange(0, NP_PAD)
    v = tl.load(val_ptr + b * 2 * NP_PAD + j, mask=j < NP, other=NEG_INF)
    i = tl.load(idx_ptr + b * 2 * NP_PAD + j, mask=j < NP, other=V)
    m = tl.max(v, axis=0)
    return m, tl.min(tl.where(v == m, i, V), axis=0)


@triton.jit
def _top_k_replay(hist_row, k, npass):
    """The radix select's state after `npass` of its 4 count passes (8-bit digits, hist_row[p]
    the counts of pass p): (the digits chosen, k minus the tokens above them). After all 4
    the digits are the k-th largest key: the largest t with #(key >= t) >= k."""
    bins = tl.arange(0, 256)
    prefix = tl.full((), 0, tl.uint32)
    k_rem = k.to(tl.int64)
    for p in tl.static_range(4):
        if p < npass:
            h = tl.load(hist_row + p * 256 + bins)
            at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # [d]: #(digit >= d)
            d = tl.max(tl.where(at_or_above >= k_rem, bins, 0), axis=0)  # d = 0 holds: all >= k_rem
            k_rem -= tl.sum(tl.where(bins > d, h, 0), axis=0)
            prefix = (prefix << 8) | d.to(tl.uint32)
    return prefix, k_rem


@triton.jit
def _top_p_replay(hist_row, top_p, npass):
    """The top-p search's state after `npass` of its 8 mass passes (4-bit digits, hist_row[4 + q]
    the fixed-point mass of each digit of pass q): (the digits chosen, the mass under them).
    Each pass keeps the largest digit whose lower digits' mass, with the mass below, stays
    within the limit (1 - p) x the total: after all 8 the digits are the largest t whose
    strictly smaller tokens hold at most 1 - p of the mass (the mass is non-decreasing in t)."""
    bins = tl.arange(0, 16)
    total = tl.sum(tl.load(hist_row + 4 * 256 + bins), axis=0)  # pass 0 counts every token
    limit = (1.0 - top_p.to(tl.float64)) * total.to(tl.float64)
    prefix = tl.full((), 0, tl.uint32)
    below = tl.zeros((), tl.int64)
    for q in tl.static_range(8):
        if q < npass:
            c = tl.cumsum(tl.load(hist_row + (4 + q) * 256 + bins), axis=0)
            d = tl.minimum(tl.sum(((below + c).to(tl.float64) <= limit).to(tl.int32), axis=0), 15)
            below += tl.max(tl.where(bins < d, c, 0), axis=0)  # c[d - 1]: the fits are a prefix
            prefix = (prefix << 4) | d.to(tl.uint32)
    return prefix, below


@triton.jit
def _unradix(prefix):
    return (prefix ^ 0x80000000).to(tl.int32, bitcast=True)


TOKEN = tl.constexpr(PHASE_TOKEN)  # sample_kernel's last phase (runtime/sample/phases.py)
HIST_ROW = tl.constexpr(HIST_PASSES * 256)  # i64 histogram entries per sampled row
MASS_ONE = tl.constexpr(1099511627776.0)  # 2^40: masses (a token's exp(z - zmax) <= 1) in fixed point


@triton.jit
def sample_kernel(logits_ptr, row_idx_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, out_ptr,
                  masked_ptr, val_ptr, idx_ptr, hist_ptr, stride, phase,
                  V: tl.constexpr, BLOCK_V: tl.constexpr, NP_PAD: tl.constexpr, WRITE_MASKED: tl.constexpr):
    # One launch per phase (runtime/sample/phases.py); grid (B, NP = cdiv(V, BLOCK_V)), the
    # last phase (B, 1). Program (b, j) owns tokens [j BLOCK_V, (j + 1) BLOCK_V) of row b.
    # logits: f32[*, V] processed; temp[b] 0: greedy; top_k[b] V: off; top_p[b] 1: off;
    # seed: i64[B] Philox key of this row this step; out: i32[B].
    # Scratch: val f32 / idx i32 [B, 2, NP_PAD], the programs' (max, index) of phases 0 and 13;
    # hist i64[B, 12, 256], cleared in phase 0 (so a step never inherits a failed one's): the top-k
    # counts (passes 0-3) and the top-p masses (4-11), added with integer atomics: exact, so
    # neither the programs' order nor the batch changes a row's numbers (each program's own
    # sums depend only on its tokens and the launch config).
    # WRITE_MASKED (tests): masked[b] = z after min_p / top-k / top-p, -inf where cut.
    b, j = tl.program_id(0), tl.program_id(1)
    NP: tl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
    base = logits_ptr + tl.load(row_idx_ptr + b).to(tl.int64) * stride
    hist_row = hist_ptr + b.to(tl.int64) * HIST_ROW
    cols = j * BLOCK_V + tl.arange(0, BLOCK_V)
    if phase == 0:  # this program's (max, first index); program 0 clears the row's histograms
        if j == 0:
            for p in tl.static_range(HIST_ROW // 256):
                tl.store(hist_row + p * 256 + tl.arange(0, 256), tl.zeros((256,), tl.int64))
        m, i = _first_max(_load_row(base, cols, V), cols, V)
        tl.store(val_ptr + b * 2 * NP_PAD + j, m)
        tl.store(idx_ptr + b * 2 * NP_PAD + j, tl.where(m > NEG_INF, i, j * BLOCK_V))
        return
    xmax, argmax = _split_max(val_ptr, idx_ptr, b, V, NP, NP_PAD)
    temp = tl.load(temp_ptr + b)
    random = (temp > 0) & (xmax > NEG_INF)
    if phase == TOKEN:  # (grid (B, 1)) the row's token
        tok = argmax
        if random:
            m, i = _split_max(val_ptr + NP_PAD, idx_ptr + NP_PAD, b, V, NP, NP_PAD)
            tok = tl.where(m >= 0.0, i, argmax)  # nothing kept (cannot happen: the top token stays)
        tl.store(out_ptr + b, tl.where(xmax > NEG_INF, tok, 0))
        return
    if random:
        zmax = tl.math.div_rn(xmax, temp)  # division rounds monotonically: max(x / T) = max(x) / T
        min_p = tl.load(min_p_ptr + b)
        k = tl.load(top_k_ptr + b)
        top_p = tl.load(top_p_ptr + b)
        in_row = cols < V
        if phase <= 4:  # top-k count pass phase - 1
            if k < V:
                w, kw = _scaled(base, cols, V, temp, zmax, min_p)
                u = _radix(kw)
                prefix, _ = _top_k_replay(hist_row, k, phase - 1)
                shift = (4 - phase) * 8
                m = in_row & (((u >> shift) >> 8) == prefix)  # (not u >> (shift + 8): >> 32 is undefined)
                if tl.max(m.to(tl.int32), axis=0) > 0:  # past the first pass most chunks hold none
                    h = tl.histogram(((u >> shift) & 0xFF).to(tl.int32), 256, mask=m)
                    tl.atomic_add(hist_row + (phase - 1) * 256 + tl.arange(0, 256), h.to(tl.int64), sem="relaxed")
        else:
            kth = tl.full((), -2147483648, tl.int32)
            if k < V:
                kth = _unradix(_top_k_replay(hist_row, k, 4)[0])
            if phase <= 12:  # top-p mass pass phase - 5, among the tokens at or above kth
                if top_p < 1.0:
                    w, kw = _scaled(base, cols, V, temp, zmax, min_p)
                    u = _radix(kw)
                    prefix, _ = _top_p_replay(hist_row, top_p, phase - 5)
                    shift = (12 - phase) * 4
                    m = in_row & (kw >= kth) & (((u >> shift) >> 4) == prefix)
                    if tl.max(m.to(tl.int32), axis=0) > 0:  # (with top-k, or past the first passes: few)
                        e = tl.where(m, tl.exp(w - zmax), 0.0)
                        dig = ((u >> shift) & 0xF).to(tl.int32)
                        bins = tl.arange(0, 16)
                        h = tl.zeros((16,), tl.float32)
                        for d in tl.static_range(16):  # (a [BLOCK_V, 16] sum would not fit in registers)
                            h = tl.where(bins == d, tl.sum(tl.where(dig == d, e, 0.0), axis=0), h)
                        # This program's f32 sums (its tokens and its layout fix their order) go in
                        # as fixed-point integers: the row's totals do not depend on program order.
                        tl.atomic_add(hist_row + (4 + phase - 5) * 256 + bins, (h * MASS_ONE).to(tl.int64),
                                      sem="relaxed")
            else:  # phase 13: the exponential race over the kept tokens
                cut = kth
                if top_p < 1.0:
                    prefix, _ = _top_p_replay(hist_row, top_p, 8)
                    cut = tl.maximum(cut, tl.minimum(_unradix(prefix), _key(zmax)))
                # argmax p_i / q_i with q_i ~ Exp(1) draws i with probability p_i; p_i / q_i =
                # exp(z_i - zmax) / (S q_i), S common to the row. Noise is keyed by (row seed,
                # token id), so a row's draw does not depend on its batch.
                w, kw = _scaled(base, cols, V, temp, zmax, min_p)
                keep = (kw >= cut) & (w > NEG_INF)
                if WRITE_MASKED:
                    tl.store(masked_ptr + b.to(tl.int64) * V + cols, tl.where(keep, w, NEG_INF), mask=in_row)
                m = tl.full((), -1.0, tl.float32)  # nothing kept here (with top-k: most chunks)
                i = j * BLOCK_V
                if tl.max(keep.to(tl.int32), axis=0) > 0:
                    q = -tl.log(tl.rand(tl.load(seed_ptr + b), cols))  # u in [0, 1): q in (0, inf]
                    m, i = _first_max(tl.where(keep, tl.exp(w - zmax) / q, -1.0), cols, V)
                tl.store(val_ptr + b * 2 * NP_PAD + NP_PAD + j, m)
                tl.store(idx_ptr + b * 2 * NP_PAD + NP_PAD + j, i)


@triton.jit
def _logprob(base, cols, V, xmax, log_s):
    # log_softmax as numpy's: (x - max) - log(sum(exp(x - max)))
    x = tl.load(base + cols, mask=cols < V, other=NEG_INF)
    return (tl.where(x != x, NEG_INF, x) - xmax) - log_s


@triton.jit
def logprobs_kernel(logits_ptr, row_idx_ptr, tok_ptr, tok_idx_ptr, ids_ptr, lp_ptr, rank_ptr, stride, K,
                    V: tl.constexpr, BLOCK_V: tl.constexpr):
    # grid: (R,); logits: f32[*, V] raw (row row_idx[r]); the given token tok[tok_idx[r]];
    # out ids/lp/rank: [R, K+1], column 0 the given token, 1..K the top K by logprob, ties
    # by lower id; rank = 1 + number of entries with a strictly greater logprob.
    r = tl.program_id(0)
    base = logits_ptr + tl.load(row_idx_ptr + r).to(tl.int64) * stride
    tok = tl.load(tok_ptr + tl.load(tok_idx_ptr + r))
    xmax, _ = _row_argmax(base, V, BLOCK_V)
    s = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        s += tl.exp(_load_row(base, cols, V) - xmax)
    log_s = tl.log(tl.sum(s, axis=0))
    tok_lp = (tl.load(base + tok) - xmax) - log_s
    above = tl.zeros((BLOCK_V,), tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        lp = _logprob(base, cols, V, xmax, log_s)
        above += ((lp > tok_lp) & (cols < V)).to(tl.int32)
    out = r.to(tl.int64) * (K + 1)
    tl.store(ids_ptr + out, tok)
    tl.store(lp_ptr + out, tok_lp)
    tl.store(rank_ptr + out, tl.sum(above, axis=0) + 1)
    # Top K by selection: pass c takes the largest entry after entry c-1 in the order
    # (logprob descending, id ascending): K passes (the runtime asks K <= 20, vLLM's default
    # max_logprobs, and gathers larger K on the host).
    prev_lp = tl.full((), float("inf"), tl.float32)
    prev_id = tl.full((), -1, tl.int32)
    prev_rank = tl.full((), 0, tl.int32)
    for c in range(K):
        lane = tl.full((BLOCK_V,), NEG_INF, tl.float32)
        lane_id = tl.full((BLOCK_V,), V, tl.int32)  # V: no candidate in this lane yet
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            lp = _logprob(base, cols, V, xmax, log_s)
            cand = (cols < V) & ((lp < prev_lp) | ((lp == prev_lp) & (cols > prev_id)))
            better = cand & ((lane_id == V) | (lp > lane))
            lane_id = tl.where(better, cols, lane_id)
            lane = tl.where(better, lp, lane)
        best, best_id = _first_max(tl.where(lane_id < V, lane, NEG_INF), lane_id, V)
        # entries above this one are all earlier in the list: rank = 1 + first equal position
        rank = tl.where(best == prev_lp, prev_rank, c + 1)
        tl.store(ids_ptr + out + 1 + c, best_id)
        tl.store(lp_ptr + out + 1 + c, best)
        tl.store(rank_ptr + out + 1 + c, rank)
        prev_lp = best
        prev_id = best_id
        prev_rank = rank


@triton.jit
def copy_rows_kernel(src_ptr, row_idx_ptr, dst_ptr, stride, V: tl.constexpr, BLOCK_V: tl.constexpr):
    # grid: (R,); dst[r] = src[row_idx[r]], dst: f32[R, V] packed
    r = tl.program_id(0)
    base = src_ptr + tl.load(row_idx_ptr + r).to(tl.int64) * stride
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        tl.store(dst_ptr + r.to(tl.int64) * V + cols, tl.load(base + cols, mask=cols < V), mask=cols < V)


@triton.jit
def token_bitmask_kernel(logits_ptr, row_idx_ptr, bits_ptr, stride, W, V: tl.constexpr, BLOCK_V: tl.constexpr):
    # grid: (K, cdiv(V, BLOCK_V)); bits: i32[K, W] packed little-endian (token t: bit t % 32 of
    # word t // 32); logits[row_idx[k], t] = -inf where that bit is clear. A token whose word lies
    # past W (a grammar vocabulary smaller than the logits') is never allowed.
    k = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    word = cols // 32
    # each word is read by 32 neighbouring lanes: one load per word reaches DRAM, the rest L1
    packed = tl.load(bits_ptr + k.to(tl.int64) * W + word, mask=(cols < V) & (word < W), other=0)
    banned = ((packed >> (cols % 32)) & 1) == 0
    base = logits_ptr + tl.load(row_idx_ptr + k).to(tl.int64) * stride
    tl.store(base + cols, tl.full((BLOCK_V,), float("-inf"), tl.float32), mask=(cols < V) & banned)


@triton.jit
def stage_inputs_kernel(src_ptr, dst_ptr, map_ptr, ids_ptr, n_words, ids_off, n_ids, BLOCK: tl.constexpr):
    # grid: (cdiv(n_words, BLOCK),); dst[i] = src[i] (i32 words), except at the n_ids input ids from
    # word ids_off on: there, where map[j] >= 0, dst[ids_off + j] = ids[map[j]] (a sampled id)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n_words
    v = tl.load(src_ptr + offs, mask=live)
    j = offs - ids_off
    fed = live & (j >= 0) & (j < n_ids)
    s = tl.load(map_ptr + j, mask=fed, other=-1)
    fed = fed & (s >= 0)
    v = tl.where(fed, tl.load(ids_ptr + s, mask=fed, other=0), v)
    tl.store(dst_ptr + offs, v, mask=live)


# -- specs --------------------------------------------------------------------------------

BLOCK_E = 128  # CSR entries per chunk
_P = "*fp32"
SIGNATURES = {
    "processors": dict(logits_ptr=_P, row_idx_ptr="*i32", start_ptr="*i32", tok_ptr="*i32", bias_ptr=_P,
                       count_ptr="*i32", mode_ptr="*i32", rep_ptr=_P, freq_ptr=_P, pres_ptr=_P, stride="i32"),
    "sample": dict(logits_ptr=_P, row_idx_ptr="*i32", temp_ptr=_P, top_k_ptr="*i32", top_p_ptr=_P,
                   min_p_ptr=_P, seed_ptr="*i64", out_ptr="*i32", masked_ptr=_P, val_ptr=_P, idx_ptr="*i32",
                   hist_ptr="*i64", stride="i32", phase="i32"),
    "logprobs": dict(logits_ptr=_P, row_idx_ptr="*i32", tok_ptr="*i32", tok_idx_ptr="*i32", ids_ptr="*i32",
                     lp_ptr=_P, rank_ptr="*i32", stride="i32", K="i32"),
    "copy_rows": dict(src_ptr=_P, row_idx_ptr="*i32", dst_ptr=_P, stride="i32"),
    "bitmask": dict(logits_ptr=_P, row_idx_ptr="*i32", bits_ptr="*i32", stride="i32", W="i32"),
    "stage": dict(src_ptr="*i32", dst_ptr="*i32", map_ptr="*i32", ids_ptr="*i32", n_words="i32", ids_off="i32",
                  n_ids="i32"),
}
STAGE_BLOCK = 1024  # i32 words a stage_inputs program moves: a batch-1 decode step's inputs are one program
_KERNELS = {"processors": "logits_processors_kernel", "sample": "sample_kernel", "logprobs": "logprobs_kernel",
            "copy_rows": "copy_rows_kernel", "stage": "stage_inputs_kernel", "bitmask": "token_bitmask_kernel"}
BITMASK_CONFIG = ElementwiseConfig(block=4096, num_warps=4)  # a 152k row: 38 programs of 128 words


def sampling_spec(role: str, vocab: int, rows: int = 1, *, config: ElementwiseConfig | None = None,
                  write_masked: bool = False) -> KernelSpec:
    """The launch of one sampling kernel over `rows` rows of a vocabulary of `vocab`.
    The grid is the row count of a step: a bundle records the spec once, the runtime
    launches it with the rows it has."""
    sig = SIGNATURES[role]
    if role == "stage":  # rows: the programs (words / STAGE_BLOCK); every pointer is 16-byte aligned
        return KernelSpec(module=__name__, kernel=_KERNELS[role], signature=sig, constexprs=dict(BLOCK=STAGE_BLOCK),
                          grid=(rows,), num_warps=4, num_stages=1,
                          divisible=("src_ptr", "dst_ptr", "map_ptr", "ids_ptr"))
    if role == "sample":  # one program per BLOCK_V tokens of a row: its own launch config
        config = config or SAMPLE_CONFIG
        np_ = -(-vocab // config.block)
        return KernelSpec(module=__name__, kernel=_KERNELS[role], signature=sig,
                          constexprs=dict(V=vocab, BLOCK_V=config.block, NP_PAD=next_pow2(np_),
                                          WRITE_MASKED=write_masked),
                          grid=(rows, np_), num_warps=config.num_warps, num_stages=1,
                          divisible=tuple(a for a, t in sig.items() if t.startswith("*")))
    if role == "bitmask":  # (rows, programs per row), as the sample kernel
        config = config or BITMASK_CONFIG
        return KernelSpec(module=__name__, kernel=_KERNELS[role], signature=sig,
                          constexprs=dict(V=vocab, BLOCK_V=config.block), grid=(rows, -(-vocab // config.block)),
                          num_warps=config.num_warps, num_stages=1,
                          divisible=tuple(a for a, t in sig.items() if t.startswith("*")))
    config = config or DEFAULT_CONFIG
    const = dict(V=vocab, BLOCK_V=config.block)
    if role == "processors":
        const.update(BLOCK_E=BLOCK_E, INTERPRET=False)  # launch() sets INTERPRET under the interpreter
    return KernelSpec(module=__name__, kernel=_KERNELS[role], signature=sig, constexprs=const, grid=(rows,),
                      num_warps=config.num_warps, num_stages=1,
                      divisible=tuple(a for a, t in sig.items() if t.startswith("*")))


def sampler_specs(vocab: int, config: ElementwiseConfig | None = None) -> dict[str, KernelSpec]:
    """role -> spec: what compile_bundle compiles for a model's vocabulary (config None: each
    role's own default, SAMPLE_CONFIG for the sample kernel, DEFAULT_CONFIG for the others)."""
    return {role: sampling_spec(role, vocab, config=config) for role in SIGNATURES}


def sampler_manifest(specs: dict[str, KernelSpec], key) -> dict:
    """A bundle manifest's "sampler" entry, what runtime/sample/gpu_sampler.py launches by: role ->
    its kernel (key(role, spec)), argument names, and for the sample kernel the programs a row
    is split over and their padded count (its scratch layout, runtime/sample/phases.py)."""
    return {role: {"kernel": key(role, spec), "args": list(spec.signature),
                   **({"programs": spec.grid[1], "np_pad": spec.constexprs["NP_PAD"]} if role == "sample" else {}),
                   **({"programs": spec.grid[1]} if role == "bitmask" else {}),
                   **({"block": spec.constexprs["BLOCK"]} if role == "stage" else {})}
            for role, spec in specs.items()}


# -- wrappers (numpy arrays under the interpreter, device Bufs on a GPU) ---------------------

def _logits(logits):
    logits = as_buf(logits)
    check(len(shape_of(logits)) == 2, "sampling: logits must be [rows, V]")
    check_dtype(logits, ("float32",), "sampling logits")
    check_inner_contiguous(logits, "sampling logits")
    return logits


def _i32(x):
    return as_buf(np.ascontiguousarray(x, dtype=np.int32)) if isinstance(x, (np.ndarray, list)) else x


def _f32(x):
    return as_buf(np.ascontiguousarray(x, dtype=np.float32)) if isinstance(x, (np.ndarray, list)) else x


def apply_logits_processors(logits, row_idx, start, tok, bias, count, mode, rep, freq, pres, *,
                            config: ElementwiseConfig = DEFAULT_CONFIG):
    """In place on logits[row_idx[b]] (f32[*, V]). `bias` is overwritten (whitelist rows
    keep their new values there)."""
    logits = _logits(logits)
    n = len(row_idx)
    spec = sampling_spec("processors", shape_of(logits)[1], n, config=config)
    bias = as_buf(bias)
    launch(spec, [logits, _i32(row_idx), _i32(start), _i32(tok), bias, _i32(count), _i32(mode), _f32(rep),
                  _f32(freq), _f32(pres), strides_of(logits)[0]])


def sample(logits, row_idx, temperature, top_k, top_p, min_p, seeds, *, masked=None,
           config: ElementwiseConfig | None = None) -> np.ndarray:
    """-> i32[B]: the token of each row; masked (f32[B, V], optional): the kept z values.
    Launches sample_kernel's phases (sample_phases) one after the other over a zeroed scratch."""
    logits = _logits(logits)
    n = len(row_idx)
    v = shape_of(logits)[1]
    out = as_buf(np.empty(n, np.int32))
    write = masked is not None
    masked = as_buf(masked) if write else out  # never written when WRITE_MASKED is off
    spec = sampling_spec("sample", v, n, config=config, write_masked=write)
    o_idx, o_hist, nbytes = sample_scratch(n, spec.constexprs["NP_PAD"])
    scratch = np.full(nbytes, 0xFF, np.uint8)  # garbage: phase 0 clears what the passes add into
    val, idx, hist = (as_buf(scratch[a:b].view(dt)) for a, b, dt in
                      ((0, o_idx, np.float32), (o_idx, o_hist, np.int32), (o_hist, nbytes, np.int64)))
    args = [logits, _i32(row_idx), _f32(temperature), _i32(top_k), _f32(top_p), _f32(min_p),
            as_buf(np.ascontiguousarray(seeds, dtype=np.int64)), out, masked, val, idx, hist, strides_of(logits)[0]]
    for phase in sample_phases(temperature, top_k, top_p, v):
        launch(dataclasses.replace(spec, grid=(n, 1)) if phase == PHASE_TOKEN else spec, args + [phase])
    return out.array


def logprobs(logits, row_idx, tokens, k: int, tok_idx=None, *,
             config: ElementwiseConfig = DEFAULT_CONFIG) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (ids i32[R, k+1], logprobs f32[R, k+1], ranks i32[R, k+1]) as gather_logprobs."""
    logits = _logits(logits)
    n = len(row_idx)
    tok_idx = np.arange(n, dtype=np.int32) if tok_idx is None else tok_idx
    ids, lp, rank = (np.empty((n, k + 1), dt) for dt in (np.int32, np.float32, np.int32))
    spec = sampling_spec("logprobs", shape_of(logits)[1], n, config=config)
    launch(spec, [logits, _i32(row_idx), _i32(tokens), _i32(tok_idx), as_buf(ids), as_buf(lp), as_buf(rank),
                  strides_of(logits)[0], int(k)])
    return ids, lp, rank


def stage_inputs(src, dst, ids_off: int, feed_map=None, ids=None) -> None:
    """dst[:len(src)] = src (i32), in place on dst, then dst[ids_off + j] = ids[feed_map[j]]
    wherever feed_map[j] >= 0 (feed_map None: nothing fed)."""
    n = len(src)
    n_ids = 0 if feed_map is None else len(feed_map)
    check(ids_off + n_ids <= n, "stage_inputs: the fed input ids lie outside the staged words")
    feed_map = np.full(1, -1, np.int32) if feed_map is None else feed_map
    ids = np.zeros(1, np.int32) if ids is None else ids
    launch(sampling_spec("stage", 0, -(-n // STAGE_BLOCK)),
           [_i32(src), as_buf(dst), _i32(feed_map), _i32(ids), n, int(ids_off), n_ids])


def apply_token_bitmask(logits, row_idx, bits, *, config: ElementwiseConfig | None = None) -> None:
    """In place: logits[row_idx[k], t] = -inf where bit t of bits[k] (i32[K, W]) is clear."""
    logits = _logits(logits)
    bits = np.ascontiguousarray(bits, dtype=np.int32)
    check(bits.ndim == 2 and bits.shape[0] == len(row_idx), "apply_token_bitmask: one bits row per logits row")
    spec = sampling_spec("bitmask", shape_of(logits)[1], len(row_idx), config=config)
    launch(spec, [logits, _i32(row_idx), as_buf(bits), strides_of(logits)[0], bits.shape[1]])


def copy_rows(logits, row_idx, *, config: ElementwiseConfig = DEFAULT_CONFIG) -> np.ndarray:
    logits = _logits(logits)
    n, v = len(row_idx), shape_of(logits)[1]
    out = np.empty((n, v), np.float32)
    launch(sampling_spec("copy_rows", v, n, config=config), [logits, _i32(row_idx), as_buf(out),
                                                             strides_of(logits)[0]])
    return out
