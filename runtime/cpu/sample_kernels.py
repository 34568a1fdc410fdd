"""The sampler's hot path on the compiled CPU target: temperature, min_p, top-k, top-p and the
exponential race, without sorting the vocabulary.

The numpy sampler (runtime/sample/sampler.py, ops.py) is the oracle and the fallback: for the same
logits and noise these kernels give its tokens, bit for bit. What that takes, step by step:

- temperature: z = x / T in float32, as numpy divides. -0.0 becomes +0.0 (equal as values; one key).
- exp: the probabilities' exp(z - zmax) come from numpy's own np.exp (its SIMD exp differs from
  LLVM's in the last bit for about a third of inputs), in one vectorised pass between the two
  kernels. zmax does not change after it: min_p, top-k and top-p never cut the top token.
- sums: min_p and the race divide by numpy's float32 row sum, which is numpy's pairwise summation
  (numpy/_core/src/umath/loops_utils.h.src `pairwise_sum`: blocks of at most 128 summed in 8
  accumulators, halves split at a multiple of 8); `pairwise_sum` below follows it and
  CompiledSampler.supports checks it against numpy at the vocabulary size before it is used.
- top-k: the k-th largest value (with repeats) by a radix select on the order-preserving int image
  of z (11, 11, 10 bits): a histogram pass over the row, then only the tokens of the chosen bucket.
- top-p: the least value whose cumulative fixed-point mass (ops.MASS_ONE, exact integer sums)
  exceeds (1 - p) of the total, by a radix search over the same keys with masses in the
  histograms: the order of an integer sum does not change it, so no sort is needed
  (ops.apply_top_k_top_p sorts to find the same cut).
- the race: argmax over kept tokens of (e / S) / q, the first index among equals, with q the noise
  the numpy sampler draws (ops.draw_noise: the same generators, the same order of draws; numba
  draws it here, fill_exponential, through numpy's own bit generators).

vLLM's equivalents: vllm/v1/sample/ops/topk_topp_sampler.py (apply_top_k_top_p_pytorch sorts the
row; apply_top_k_only; random_sample's q.exponential_() and probs.div_(q).argmax()); its CPU
path now draws one seed per request and hashes noise per token, which kiln does not, so that a
seeded request keeps numpy's stream on every backend.

Only rows with top-k or top-p run the kernels (CompiledSampler.sample): the others have no sort to
avoid, and numpy's vectorised steps were as fast on them. Rows run in parallel (prange) on
KILN_CPU_THREADS threads, or on the count a ThreadChooser finds faster; kernels are cached on disk
by numba like the other compiled kernels (the compiled executor's warm_up compiles them).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np
from numba import njit, prange

NEG_INF = np.float32(-np.inf)
MASS_ONE = np.float32(2.0 ** 40)  # = ops.MASS_ONE
TINY = np.float32(np.finfo(np.float32).tiny)
SIGN = np.int64(0x80000000)
LOW32 = np.int64(0xFFFFFFFF)


@njit(cache=True)
def _block_sum(a, lo, n):
    """pairwise_sum's leaf: n <= 128 values in 8 accumulators, the rest one by one."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = lo + 8
    end8 = lo + n - n % 8
    while i < end8:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < lo + n:
        res += a[i]
        i += 1
    return res


@njit(cache=True)
def pairwise_sum(a, lo, n):
    """numpy's float32 pairwise sum of a[lo:lo + n] (loops_utils.h.src pairwise_sum), the sum
    `x.sum(axis=-1)` takes over a contiguous row: above 128 values, the sum of the two halves
    (the first a multiple of 8 long). numpy recurses; this walks the same tree with a stack
    (numba's disk cache crashed loading a recursive function's callers)."""
    if n <= 128:
        return _block_sum(a, lo, n)
    # entries (start, length); length -1 marks "add the two values on top of the value stack"
    todo_lo = np.empty(192, np.int64)
    todo_n = np.empty(192, np.int64)
    vals = np.empty(64, np.float32)
    sp = 1
    todo_lo[0] = lo
    todo_n[0] = n
    vp = 0
    while sp > 0:
        sp -= 1
        s, m = todo_lo[sp], todo_n[sp]
        if m < 0:
            vp -= 1
            vals[vp - 1] = vals[vp - 1] + vals[vp]
        elif m <= 128:
            vals[vp] = _block_sum(a, s, m)
            vp += 1
        else:
            m2 = m // 2
            m2 -= m2 % 8
            todo_n[sp] = -1  # popped last: left + right
            todo_lo[sp + 1] = s + m2
            todo_n[sp + 1] = m - m2
            todo_lo[sp + 2] = s
            todo_n[sp + 2] = m2
            sp += 3
    return vals[0]


@njit(cache=True, inline="always")
def _key(bits):
    """Order-preserving image of a float32 (its int32 bits) in [0, 2^32): non-negative values
    get the sign bit set, negative ones all bits flipped. (No NaN reaches it; -0.0 was made +0.0.)"""
    b = np.int64(bits)
    return (b ^ ((b >> 31) | SIGN)) & LOW32


@njit(cache=True, fastmath={"nnan", "nsz"})
def _max_no_nan(z):
    """max(z) for a row without NaN (the caller checks): nnan lets LLVM vectorise the reduction;
    the maximum is the same in any order."""
    m = NEG_INF
    for i in range(z.size):
        m = max(m, z[i])
    return m


@njit(cache=True, error_model="numpy")
def _scale_row(x, t, z, d):
    """z = x / t (f32; -0.0 -> +0.0), d = z - max(z) -> (max, bad: a NaN or no finite max; d 0)."""
    V = z.size
    nan = 0
    for i in range(V):
        v = x[i] / t + np.float32(0.0)
        z[i] = v
        nan |= v != v
    m = _max_no_nan(z)
    if nan or not (m > NEG_INF and m < np.inf):
        d[:] = 0.0
        return m, True
    for i in range(V):
        d[i] = z[i] - m
    return m, False


@njit(cache=True, error_model="numpy", parallel=True)
def scale_rows(logits, rows, temperature, z, d, zmax, bad):
    """Row j: z[j] = logits[rows[j]] / temperature[rows[j]], d[j] = z[j] - zmax[j] (np.exp of it is
    every token's unnormalised probability); bad[j]: the numpy steps take the row."""
    for j in prange(z.shape[0]):
        zmax[j], bad[j] = _scale_row(logits[rows[j]], temperature[rows[j]], z[j], d[j])


@njit(cache=True, error_model="numpy")
def scale_rows_serial(logits, rows, temperature, z, d, zmax, bad):
    """scale_rows on the calling thread (one row, or one thread: no fork/join)."""
    for j in range(z.shape[0]):
        zmax[j], bad[j] = _scale_row(logits[rows[j]], temperature[rows[j]], z[j], d[j])


@njit(cache=True)
def _kth_largest_key(zb, V, k, idx, hist):
    """The key of the k-th largest of the V values (repeats counted; 1 <= k <= V): radix select,
    11 + 11 + 10 bits, the first level over the row, the others over the chosen bucket's tokens."""
    hist[:] = 0
    for i in range(V):
        hist[_key(zb[i]) >> 21] += 1
    rem = np.int64(k)
    d = 2047
    while hist[d] < rem:
        rem -= hist[d]
        d -= 1
    prefix = np.int64(d)
    n = 0
    for i in range(V):
        if _key(zb[i]) >> 21 == prefix:
            idx[n] = i
            n += 1
    for shift, width in ((10, 2047), (0, 1023)):
        hist[:width + 1] = 0
        for t in range(n):
            hist[(_key(zb[idx[t]]) >> shift) & width] += 1
        d = width
        while hist[d] < rem:
            rem -= hist[d]
            d -= 1
        prefix = (prefix << (11 if shift == 10 else 10)) | d
        m = 0
        for t in range(n):
            if _key(zb[idx[t]]) >> shift == prefix:
                idx[m] = idx[t]
                m += 1
        n = m
    return prefix


@njit(cache=True, error_model="numpy")
def _top_p_key(zb, e, cand, n, dense, p, idx, hist):
    """The key of the least value v among tokens cand[:n] (dense: tokens 0..n-1) whose fixed-point
    mass at or below v, as float64, exceeds (1 - p) times the total (ops.apply_top_k_top_p's cut);
    -1 if none does (the cut is then the top value). Masses int64(e * MASS_ONE) summed exactly:
    radix buckets 11 + 11 + 10 bits, as _kth_largest_key but from the bottom."""
    hist[:] = 0
    total = np.int64(0)
    if dense:
        for i in range(n):
            m = np.int64(e[i] * MASS_ONE)
            hist[_key(zb[i]) >> 21] += m
            total += m
    else:
        for t in range(n):
            i = cand[t]
            m = np.int64(e[i] * MASS_ONE)
            hist[_key(zb[i]) >> 21] += m
            total += m
    limit = (1.0 - np.float64(p)) * np.float64(total)
    below = np.int64(0)
    d = 0
    while d < 2048 and np.float64(below + hist[d]) <= limit:
        below += hist[d]
        d += 1
    if d == 2048:
        return np.int64(-1)
    prefix = np.int64(d)
    c = 0
    if dense:
        for i in range(n):
            if _key(zb[i]) >> 21 == prefix:
                idx[c] = i
                c += 1
    else:
        for t in range(n):
            i = cand[t]
            if _key(zb[i]) >> 21 == prefix:
                idx[c] = i
                c += 1
    for shift, width in ((10, 2047), (0, 1023)):
        hist[:width + 1] = 0
        for t in range(c):
            i = idx[t]
            hist[(_key(zb[i]) >> shift) & width] += np.int64(e[i] * MASS_ONE)
        d = 0
        # the bucket's own total brings the sum past the limit (the level above said so)
        while np.float64(below + hist[d]) <= limit:
            below += hist[d]
            d += 1
        prefix = (prefix << (11 if shift == 10 else 10)) | d
        m = 0
        for t in range(c):
            if _key(zb[idx[t]]) >> shift == prefix:
                idx[m] = idx[t]
                m += 1
        c = m
    return prefix


@njit(cache=True)
def _value(key):
    """The float32 whose _key is `key`."""
    bits = np.empty(1, np.int64)
    bits[0] = key - SIGN if key >= SIGN else (~key) & LOW32
    return bits.astype(np.uint32).view(np.int32).view(np.float32)[0]


@njit(cache=True, fastmath={"nnan", "nsz"})
def _max_ratio(r):
    """max(r) over ratios >= 0 (no NaN: the noise is at least float32's tiny)."""
    m = np.float32(0.0)
    for i in range(r.size):
        m = max(m, r[i])
    return m


@njit(cache=True, error_model="numpy")
def _sample_row(z, e, q, min_p, k, p, cand, idx, hist):
    """One row: z (scaled logits), e = exp(z - zmax) (both modified), q its noise -> token."""
    V = z.size
    zb = z.view(np.int32)
    if min_p > 0.0:  # ops.apply_min_p: probs = e / S; cut where probs < max(probs) * min_p
        s = pairwise_sum(e, 0, V)
        emax = np.float32(0.0)
        for i in range(V):
            emax = max(emax, e[i])
        threshold = (emax / s) * min_p
        for i in range(V):
            if e[i] / s < threshold:
                z[i] = NEG_INF
                e[i] = np.float32(0.0)
    cut = np.int64(0)  # keep tokens whose key is at least this (0: every value)
    n = V
    if k < V:  # ops.apply_top_k_only: cut below the k-th largest value
        cut = _kth_largest_key(zb, V, k, idx, hist)
        kth = _value(cut)
        n = 0
        for i in range(V):
            if z[i] >= kth:
                cand[n] = i
                n += 1
    if p < 1.0:  # (without top-k every token is a candidate: cand is not filled)
        g = _top_p_key(zb, e, cand, n, k >= V, p, idx, hist)
        if g < 0:  # nothing passes the limit: the top value's tokens stay
            g = _key(zb[np.argmax(z)])
        cut = max(cut, g)
    if cut > 0:  # (cut tokens below the kept value; -inf ones have e = 0 already)
        v = _value(cut)
        for i in range(V):
            e[i] = np.float32(0.0) if z[i] < v else e[i]
    # the race: numpy's softmax of the kept row (its pairwise sum), (e / S) / q, the first argmax
    s = pairwise_sum(e, 0, V)
    if k < V:  # every kept token is in cand[:n], in index order (the others' ratio is 0)
        best = np.float32(-1.0)
        tok = 0
        for t in range(n):
            i = cand[t]
            if e[i] > 0.0:
                r1 = (e[i] / s) / q[i]
                if r1 > best:
                    best = r1
                    tok = i
        return tok
    r = z  # z is spent: the ratios go there
    for i in range(V):
        r[i] = (e[i] / s) / q[i]
    best = _max_ratio(r)
    for i in range(V):
        if r[i] == best:
            return i
    return 0


@njit(cache=True, error_model="numpy", parallel=True)
def sample_scaled(z, e, q, min_p, top_k, top_p, bad, cand, idx, hist, out):
    """out[j] = the token of row j (min_p[j] 0, top_k[j] >= V, top_p[j] >= 1: off); rows with
    bad[j] are left to the numpy steps (out -1). z, e: scale_rows' z and np.exp(d), modified."""
    for j in prange(z.shape[0]):
        out[j] = -1 if bad[j] else _sample_row(z[j], e[j], q[j], min_p[j], top_k[j], top_p[j], cand[j],
                                                idx[j], hist[j])


@njit(cache=True, error_model="numpy")
def sample_scaled_serial(z, e, q, min_p, top_k, top_p, bad, cand, idx, hist, out):
    """sample_scaled on the calling thread."""
    for j in range(z.shape[0]):
        out[j] = -1 if bad[j] else _sample_row(z[j], e[j], q[j], min_p[j], top_k[j], top_p[j], cand[j],
                                                idx[j], hist[j])


@njit(cache=True)
def fill_exponential(gen, q, rows):
    """q[r] = Exp(1) noise from gen for r in rows, in that order, at least float32's tiny: the draws
    numpy's gen.standard_exponential((len(rows), V), dtype=np.float32) makes (numba's Generator
    calls the same bit generator through the same ziggurat), a fifth faster (ops.draw_noise)."""
    for r in rows:
        for i in range(q.shape[1]):
            q[r, i] = max(gen.standard_exponential(dtype=np.float32), TINY)


class CompiledSampler:
    """Steps 5-7 of the Sampler (temperature, min_p, top-k, top-p, the race) for its random rows,
    on the compiled CPU target. threads: how many threads the kernels use (KILN_CPU_THREADS), or
    None for numba's current setting; chooser: instead, a ThreadChooser
    (runtime/worker/compiled_cpu_executor.py) of its own that times the kernels per row and keeps
    the faster count, as decode steps do: on the shared 2-core machine a parallel region whose
    second thread waited for a core took 16 ms where one thread took 2-5 ms for 8 rows. Rows run
    in parallel only with several rows and threads."""

    def __init__(self, threads: Optional[Callable[[], int]] = None, chooser=None) -> None:
        self.threads = threads
        self.chooser = chooser
        self._checked: dict[int, bool] = {}
        self._scratch: dict[str, np.ndarray] = {}

    def supports(self, V: int) -> bool:
        """Whether numpy here sums a row of V float32 as pairwise_sum does (checked once per V)."""
        ok = self._checked.get(V)
        if ok is None:
            rng = np.random.default_rng(V)
            x = np.exp(rng.standard_normal((3, V)).astype(np.float32) * np.float32(4.0))
            want = x.sum(axis=-1)
            ok = all(pairwise_sum(x[j], 0, V) == want[j] for j in range(3))
            self._checked[V] = ok
            if not ok:
                import logging

                logging.getLogger(__name__).warning(
                    "this numpy sums float32 rows of %d in another order than kiln's compiled sampler "
                    "reproduces: sampling runs on numpy", V)
        return ok

    def draw_noise(self, B: int, V: int, generators, rng: np.random.Generator) -> np.ndarray:
        """ops.draw_noise's q, the same values from the same generators in the same order."""
        q = np.empty((B, V), dtype=np.float32)
        shared = np.array([i for i in range(B) if i not in generators], dtype=np.int64)
        if len(shared):
            fill_exponential(rng, q, shared)
        for i, gen in generators.items():
            fill_exponential(gen, q, np.array([i], dtype=np.int64))
        return q

    def _buf(self, name: str, shape: tuple, dtype) -> np.ndarray:
        b = self._scratch.get(name)
        need = shape[0] * shape[1]
        if b is None or b.size < need or b.dtype != dtype:
            b = np.empty(max(need, 1), dtype=dtype)
            self._scratch[name] = b
        return b[:need].reshape(shape)

    def sample(self, logits: np.ndarray, rows: np.ndarray, temperature: np.ndarray,
               min_p: Optional[np.ndarray], top_k: Optional[np.ndarray], top_p: Optional[np.ndarray],
               q: np.ndarray, threads: Optional[int] = None, every_row: bool = False) -> Optional[np.ndarray]:
        """logits: f32[B, V] after the processors; rows: the random rows; temperature: f32[B];
        min_p / top_k / top_p: per random row or None; q: ops.draw_noise's f32[len(rows), V].
        -> the rows' tokens (i64), or None where this vocabulary size is not supported here or no
        row has top-k or top-p. threads: override the count; every_row: every row through the
        kernels (tests).

        Rows with top-k or top-p run the kernels; the others (temperature and min_p alone: no
        sort to avoid) run numpy's vectorised steps, which were as fast or faster on them
        (V = 49,152: 0.12-0.19 ms a row against 0.25-0.30 ms; the race's exp is numpy's in both)."""
        from kiln.runtime.sample import ops

        B, V = logits.shape
        R = len(rows)
        k = np.full(R, V, np.int64) if top_k is None else np.minimum(np.asarray(top_k, dtype=np.int64), V)
        p = np.ones(R, np.float32) if top_p is None else np.ascontiguousarray(top_p, dtype=np.float32)
        hot = (k < V) | (p < 1.0) | every_row
        if not hot.any() or not self.supports(V):
            return None
        mp = np.zeros(R, np.float32) if min_p is None else np.ascontiguousarray(min_p, dtype=np.float32)
        out = np.empty(R, np.int64)
        numpy_rows = ~hot
        j = np.flatnonzero(hot)
        every = len(j) == R
        bad = self._kernels(logits, np.ascontiguousarray(rows[j], dtype=np.int64), temperature,
                            mp if every else mp[j], k if every else k[j], p if every else p[j],
                            np.ascontiguousarray(q if every else q[j], dtype=np.float32), out, j, threads)
        numpy_rows[j[bad]] = True
        if numpy_rows.any():  # no top-k / top-p, or a NaN / no finite logit: the numpy steps
            n = np.flatnonzero(numpy_rows)
            out[n] = ops.sample_rows(logits[rows[n]] / temperature[rows[n], None],
                                     None if min_p is None else mp[n], None if top_k is None else k[n],
                                     None if top_p is None else p[n], q[n])
        return out

    def _kernels(self, logits, rows, temperature, mp, k, p, q, out, at, threads) -> np.ndarray:
        """The kernels on rows `rows` of logits; tokens into out[at]. -> bad (numpy's rows)."""
        import numba

        R, V = len(rows), logits.shape[1]
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        temperature = np.ascontiguousarray(temperature, dtype=np.float32)
        z = self._buf("z", (R, V), np.float32)
        e = self._buf("e", (R, V), np.float32)
        cand = self._buf("cand", (R, V), np.int32)
        idx = self._buf("idx", (R, V), np.int32)
        hist = self._buf("hist", (R, 2048), np.int64)
        zmax = np.empty(R, np.float32)
        bad = np.empty(R, np.bool_)
        tok = np.empty(R, np.int64)
        chosen = threads is None and self.chooser is not None and R > 1
        if chosen:
            threads = self.chooser.pick()
        elif threads is None:
            threads = numba.get_num_threads() if self.threads is None else self.threads()
        threads = min(R, threads, numba.config.NUMBA_NUM_THREADS)
        t0 = time.perf_counter()
        if threads <= 1:  # one row or one thread: no parallel region (its join waits for every thread)
            scale_rows_serial(logits, rows, temperature, z, e, zmax, bad)
            np.exp(e, out=e)
            sample_scaled_serial(z, e, q, mp, k, p, bad, cand, idx, hist, tok)
        else:
            before = numba.get_num_threads()
            numba.set_num_threads(threads)
            try:
                scale_rows(logits, rows, temperature, z, e, zmax, bad)
                np.exp(e, out=e)
                sample_scaled(z, e, q, mp, k, p, bad, cand, idx, hist, tok)
            finally:
                numba.set_num_threads(before)
        if chosen:
            self.chooser.record(threads, (time.perf_counter() - t0) / R)
        out[at] = tok
        return bad

    def warm_up(self, progress: Callable[[str], None] = lambda s: None) -> float:
        """Compile (or load from numba's cache) the serial and the parallel kernels on a small
        batch; reports through `progress` when they were compiled now. -> seconds."""
        import numba

        t0 = time.perf_counter()
        rng = np.random.default_rng(0)
        V = 300
        x = rng.standard_normal((2, V)).astype(np.float32)
        q = rng.standard_exponential((2, V)).astype(np.float32)
        self.draw_noise(2, V, {1: np.random.default_rng(1)}, rng)
        for threads in (1, 2):
            self.sample(x, np.arange(2), np.ones(2, np.float32), np.array([0.1, 0.0], np.float32),
                        np.array([5, V]), np.array([0.9, 1.0], np.float32), q,
                        threads=min(threads, numba.config.NUMBA_NUM_THREADS), every_row=True)
        kernels = (fill_exponential, _block_sum, pairwise_sum, _scale_row, scale_rows, scale_rows_serial, sample_scaled,
                   sample_scaled_serial, _sample_row, _kth_largest_key, _top_p_key)
        dt = time.perf_counter() - t0
        if any(f.stats.cache_misses for f in kernels):
            progress(f"  sampler kernels ({dt:.1f} s)")
        return dt
