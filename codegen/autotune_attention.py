"""Paged attention on the GPU across schedules: the cases, their device buffers, the sweep.

`build.py tune` (AttentionTuner) and bench/attn_sweep.py share this. An AttentionRig
holds one case's device buffers and records the wrapper's launches for a config; a
Bench (autotune.py) compiles them through the AOT path and times them under a CUDA graph.

What the tuner sweeps: the schedule knobs only, per kind of bucket (configs.AttentionConfig):
ATTENTION_PREFILL_KNOBS for prefill and mixed buckets, and for decode buckets by size class
(paged_attention_launch.decode_class) ATTENTION_DECODE_KNOBS (read whole), ATTENTION_SPLIT_KNOBS
(split-KV) and ATTENTION_ONE_KNOBS (one sequence). tile and seg, the reduction knobs, keep the
default's values (seg follows max_model_len). Rows per program, warps, stages, register caps and
V column parts only group rows (paged_attention.py), so every candidate must give the default's bits;
Bench.best checks that it does. Each decode class is timed at one case, split or not as the
bundle's plan is (lower.split_kv; split decode merges in the attention kernel, as in the plan):
the bundle's largest decode bucket with 1,500 keys per sequence (when it is read whole), 32
sequences (or that bucket, if smaller) at 1,500 keys, and batch 1 at 512 keys; a class with no
case keeps the default's knobs. The split and one classes run with the decode winner's block_q
(a second round). Prefill is timed at one prompt of 2,048 tokens (or max_num_batched_tokens) in
the mixed bucket that holds it. Last, AttentionConfig.route_mixed (a mixed bucket's decode rows in
a launch of the decode variant) on the winners' knobs, off against on, at the largest mixed bucket
filled as a throughput step fills it plus that prompt alone; without a bits check, since routing
gives the decode rows the decode kernel's bits, which over an e4m3 cache are not the prefill
kernel's. One entry per head shape (h, hkv, d), whatever max_model_len.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np

from kiln.codegen.autotune import BF16, REPS, Bench, Timed, Trial, record
from kiln.codegen.buckets import Bucket, pick_bucket
from kiln.codegen.lower import split_kv
from kiln.codegen.triton import paged_attention_launch as k_attn
from kiln.codegen.triton.configs import (ATTENTION_DECODE_KNOBS, ATTENTION_ONE_KNOBS, ATTENTION_PREFILL_KNOBS,
                                         ATTENTION_SPLIT_KNOBS, DEFAULT, AttentionConfig, attention_cache_key)
from kiln.codegen.triton.launch import Buf, cdiv, next_pow2
from kiln.graph import Graph, to_numpy
from kiln.schedules import Schedules

L2_FLUSH = 150e6  # bytes of distinct K/V between two reads of the same block (the H200's L2: 50 MB)


@dataclass(frozen=True)
class AttentionShape:
    h: int
    hkv: int
    d: int
    block_size: int
    max_model_len: int
    window: int = 0
    cache_dtype: str = "bfloat16"  # the KV cache's (numpy name): bfloat16, or float8_e4m3fn (--kv-cache-dtype fp8)


@dataclass(frozen=True)
class AttentionCase:
    name: str
    lens: tuple[int, ...]  # keys of each live sequence, this step's included
    counts: tuple[int, ...]  # its queries in this step
    tokens: int  # the bucket's T; tokens past the live ones are padding
    seqs: int  # the bucket's S; sequences past the live ones are empty
    decode: bool
    split: bool


def decode_case(seqs: int, keys: int, split: bool | None = None) -> AttentionCase:
    split = split_kv(Bucket(seqs, seqs, seqs, True)) if split is None else split
    return AttentionCase(f"decode{seqs}@{keys}", (keys,) * seqs, (1,) * seqs, seqs, seqs, True, split)


def prefill_case(n: int, bucket: Bucket | None = None) -> AttentionCase:
    t, s = (bucket.tokens, bucket.seqs) if bucket is not None else (n, 1)
    return AttentionCase(f"prefill{n}", (n,), (n,), t, s, False, False)


def spread_case(seqs: int, lo: int, hi: int, longest_first: bool = False, split: bool | None = None) -> AttentionCase:
    """A decode batch whose lengths spread evenly over lo..hi keys, in a seeded random order or
    longest first, as the runner orders a step (model_runner.ModelRunner._chunks)."""
    lens = np.linspace(lo, hi, seqs).round().astype(int)
    lens = lens[::-1] if longest_first else np.random.default_rng(0).permutation(lens)
    split = split_kv(Bucket(seqs, seqs, seqs, True)) if split is None else split
    return AttentionCase(f"decode{seqs}@{lo}-{hi}{'v' if longest_first else ''}", tuple(int(n) for n in lens),
                         (1,) * seqs, seqs, seqs, True, split)


def mixed_case(seqs: int, keys: int, prompt: int = 0) -> AttentionCase:
    """A mixed bucket's attention: `seqs` decoding sequences (one query each at `keys` keys) and,
    with `prompt`, a first prompt chunk of that many tokens, all in the prefill kernel as a
    chunked-prefill step runs them."""
    chunk = (prompt,) if prompt else ()
    return AttentionCase(f"mixed{seqs}@{keys}" + (f"+{prompt}" if prompt else ""), (keys,) * seqs + chunk,
                         (1,) * seqs + chunk, seqs + prompt, seqs + len(chunk), False, False)


def parse_case(name: str, split: bool | None = None) -> AttentionCase:
    """decode256@1500 (256 sequences at 1,500 keys; @1500 is the default), decode1@512, prefill2048,
    mixed512@1500[+1536] (mixed_case), decode512@1000-2000[v] (spread_case; v: longest first)."""
    if name.startswith("decode"):
        seqs, _, keys = name[len("decode"):].partition("@")
        if "-" in keys:  # decode512@1000-2000[v]: spread_case
            lo, _, hi = keys.rstrip("v").partition("-")
            return spread_case(int(seqs), int(lo), int(hi), keys.endswith("v"), split)
        return decode_case(int(seqs), int(keys or 1500), split)
    if name.startswith("mixed"):
        body, _, prompt = name[len("mixed"):].partition("+")
        seqs, _, keys = body.partition("@")
        return mixed_case(int(seqs), int(keys or 1500), int(prompt or 0))
    if name.startswith("prefill"):
        return prefill_case(int(name[len("prefill"):]))
    raise ValueError(f"unknown attention case {name!r} (decode<S>[@<keys>], prefill<N> or "
                     f"mixed<S>[@<keys>][+<prompt>])")


SPLIT_CASE_SEQS = 32  # the split class's case: this many sequences (or the largest decode bucket)


def attention_cases(buckets: list[Bucket], max_model_len: int, *, keys: tuple[int, int] = (1500, 512),
                    prompt: int = 2048) -> tuple[list[AttentionCase], AttentionCase, AttentionCase | None]:
    """-> (decode cases, prefill case, mixed case) of a bundle: one decode case per size class it
    has (decode_class_of): its largest decode bucket at keys[0] keys per sequence where that is
    read whole, min(32, largest) sequences at keys[0] where that is split, batch 1 at keys[1]; a
    prompt of `prompt` tokens (at most the largest mixed bucket) in the mixed bucket that holds
    it; and the largest mixed bucket full, as a throughput step fills it: as many decode rows at
    keys[0] as its sequences allow beside a prompt chunk (at most half its tokens), the chunk
    the rest (None where the bucket holds fewer than 2 sequences)."""
    top = max(b.seqs for b in buckets if b.decode)
    k0, k1 = min(keys[0], max_model_len), min(keys[1], max_model_len)
    cases = [decode_case(top, k0)]  # read whole, or (a small bundle) split, or one sequence
    if top > 1:
        cases += [decode_case(min(top, SPLIT_CASE_SEQS), k0), decode_case(1, k1)]
    decode: list[AttentionCase] = []
    for c in cases:  # the first case of each class
        if decode_class_of(c) not in {decode_class_of(x) for x in decode}:
            decode.append(c)
    mixed = [b for b in buckets if not b.decode]
    n = min(prompt, max(b.tokens for b in mixed), max_model_len)
    top = max(mixed, key=lambda b: (b.tokens, b.seqs))
    rows = min(top.seqs - 1, top.tokens // 2)
    chunk = min(top.tokens - rows, max_model_len)
    full = mixed_case(rows, k0, chunk) if rows >= 1 else None
    return decode, prefill_case(n, pick_bucket(mixed, n, 1, 1)), full


def decode_class_of(case: AttentionCase) -> str:
    return k_attn.decode_class(case.seqs, case.split)


def attention_shapes(graph: Graph, block_size: int, max_model_len: int) -> list[AttentionShape]:
    """One shape per distinct (h, hkv, d) of the graph's paged_attention nodes."""
    found: dict[tuple, AttentionShape] = {}
    for node in graph.topo_order():
        if node.op == "paged_attention":
            _, h, d = graph.tensors[node.outputs[0]].shape
            cache = graph.tensors[node.inputs[1]]
            found.setdefault((h, cache.shape[3], d), AttentionShape(
                h, cache.shape[3], d, block_size, max_model_len, node.attrs.get("sliding_window", 0),
                to_numpy(cache.dtype).name))
    return list(found.values())


class AttentionRig:
    """Device buffers of one case: q and out [T, H, D], a paged KV cache, block tables,
    lengths, query offsets, positions, the split-KV workspaces and merge counters. The live sequences'
    blocks are scattered over the cache, in `copies` disjoint sets the launches take in
    turn, so that K/V that would fit in L2 (batch 1 at 512 keys: 2 MB) still comes from
    HBM, as in a step, where every layer's weights went through L2 since the last read."""

    def __init__(self, bench: Bench, shape: AttentionShape, case: AttentionCase, seed: int = 0) -> None:
        self.bench, self.shape, self.case = bench, shape, case
        sh, bs = shape, shape.block_size
        mb = cdiv(sh.max_model_len, bs)
        need = sum(cdiv(n, bs) for n in case.lens)
        cache_dt = np.dtype(getattr(ml_dtypes, sh.cache_dtype, sh.cache_dtype))  # ml_dtypes names bf16 and fp8
        self.kv_bytes = sum(case.lens) * sh.hkv * sh.d * 2 * cache_dt.itemsize
        self.copies = max(1, min(64, math.ceil(L2_FLUSH / (need * bs * sh.hkv * sh.d * 2 * cache_dt.itemsize))))
        self.reps = max(REPS, self.copies)
        nb = need * self.copies + 1
        self.cache = bench.buffer((nb, 2, bs, sh.hkv, sh.d), cache_dt)
        perm = np.random.default_rng(seed).permutation(nb - 1) + 1  # block 0: where padded rows point
        self.block_tables = []
        for c in range(self.copies):
            table, at = np.zeros((case.seqs, mb), np.int32), c * need
            for i, n in enumerate(case.lens):
                table[i, :cdiv(n, bs)] = perm[at:at + cdiv(n, bs)]
                at += cdiv(n, bs)
            self.block_tables.append(bench.buffer(table.shape, np.int32, table))
        live = sum(case.counts)
        lens = np.zeros(case.seqs, np.int32)
        lens[:len(case.lens)] = case.lens
        qsl = np.full(case.seqs + 1, live, np.int32)
        qsl[:len(case.counts) + 1] = np.concatenate([[0], np.cumsum(case.counts)])
        pos = np.zeros(case.tokens, np.int32)
        pos[:live] = np.concatenate([np.arange(n - c, n) for n, c in zip(case.lens, case.counts)])
        self.seq_lens = bench.buffer(lens.shape, np.int32, lens)
        self.qsl = bench.buffer(qsl.shape, np.int32, qsl)
        self.positions = bench.buffer(pos.shape, np.int32, pos)
        self.q = bench.buffer((case.tokens, sh.h, sh.d), BF16)
        self.out = bench.buffer((case.tokens, sh.h, sh.d), BF16)
        self._ws: dict[int, tuple[Buf, Buf]] = {}
        # zero, and left zero by every launch: one buffer serves all reps and replays
        self.counter = (bench.buffer((case.seqs, sh.hkv), np.int32, np.zeros((case.seqs, sh.hkv), np.int32))
                        if k_attn.merges_in_kernel(case.split, case.decode) else None)

    def workspace(self, seg: int) -> tuple[Buf, Buf] | None:
        if not self.case.split:
            return None
        if seg not in self._ws:
            t, segs, h, d = self.case.tokens, cdiv(self.shape.max_model_len, seg), self.shape.h, self.shape.d
            self._ws[seg] = (Buf(ptr=self.bench.malloc(t * segs * h * d * 4), shape=(t, segs, h, d), dtype=np.float32),
                             Buf(ptr=self.bench.malloc(t * segs * h * 2 * 4), shape=(t, segs, h, 2), dtype=np.float32))
        return self._ws[seg]

    def timed(self, cfg: AttentionConfig) -> Timed:
        sh, case = self.shape, self.case
        reps = [record(k_attn.paged_attention, self.q, self.cache, self.block_tables[r % self.copies], self.seq_lens,
                       self.qsl, self.out, scale=sh.d ** -0.5, sliding_window=sh.window, split=case.split,
                       max_model_len=sh.max_model_len, positions=self.positions, workspace=self.workspace(cfg.seg),
                       counter=self.counter, config=cfg, decode=case.decode) for r in range(self.reps)]
        return Timed(reps, output=self.output)

    def output(self) -> bytes:
        return self.bench.read(self.out.ptr, self.case.tokens * self.shape.h * self.shape.d * 2)


# -- candidates ---------------------------------------------------------------------------
def _halves_can_keep_bits(shape: AttentionShape, default: AttentionConfig) -> bool:
    """Whether a decode tile in key halves can give the whole tile's bits, so that the sweep tries
    them: halves of at least 16 keys, and of at least 32 over an e4m3 cache. (H200: `build.py tune`
    refused every 16-key-half candidate of a 32-key e4m3 tile for changing the bits; 32-key halves of
    a 64-key e4m3 tile, and 16-key halves over a bf16 cache, give the whole tile's.)"""
    least = 32 if shape.cache_dtype == "float8_e4m3fn" else 16
    return default.tile_of_decode // 2 >= least


def _wide(shape: AttentionShape) -> bool:
    """A head wider than 128 (Qwen3.5/3.6: 256): the decode sweep moves up a warp count (ptxas, sm_90,
    16-row decode programs at 256: 1 and 2 warps spill, 4 and 8 do not) and sweeps the split classes'
    V column parts (configs.wide_head)."""
    return next_pow2(shape.d) > 128


def _decode_grid(shape: AttentionShape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """-> (warps, stages) a decode sweep tries."""
    return ((2, 4, 8) if _wide(shape) else (1, 2, 4)), (2, 3, 4)


def decode_candidates(shape: AttentionShape, default: AttentionConfig) -> list[AttentionConfig]:
    """The default first, then rows per program (the fewest query positions that fill tl.dot's
    16 rows, and twice that) x warps x stages, and the fewest rows x warps x stages in key halves,
    uncapped or under a 168-register cap; each schedule the kernel would see once."""
    bq0 = k_attn.attention_block_q(shape.h, shape.hkv, replace(default, block_q=1), decode=True)
    warps, stages = _decode_grid(shape)
    grid = [replace(default, block_q=bq, num_warps=w, num_stages=s)
            for bq in (bq0, 2 * bq0) for w in warps for s in stages]
    if _halves_can_keep_bits(shape, default):
        grid += [replace(default, block_q=bq0, num_warps=w, num_stages=s, key_halves=2, maxnreg=r)
                 for w in warps for s in stages for r in (None, 168)]
    return _distinct(shape, [default] + grid, decode=True)


def class_candidates(shape: AttentionShape, default: AttentionConfig, cls: str) -> list[AttentionConfig]:
    """A split or one-sequence decode class: the default first (its knobs unset: the decode
    ones), then warps x stages x register cap x key halves, each schedule once (block_q: the
    default's); a wide head (_wide) x V column parts 1-8 as well (parts of >= 32 columns), under
    no cap or 168 (at 128 the parted programs need no cap: ptxas gives them 128 registers)."""
    halves = (None, 2) if _halves_can_keep_bits(shape, default) else (None,)
    warps, stages = _decode_grid(shape)
    caps = (None, 168) if _wide(shape) else (None, 168, 128)
    parts = tuple(p for p in (1, 2, 4, 8) if next_pow2(shape.d) // p >= 32) if _wide(shape) else (None,)
    grid = [replace(default, **{f"{cls}_num_warps": w, f"{cls}_num_stages": s, f"{cls}_maxnreg": r,
                                f"{cls}_key_halves": kh, f"{cls}_dv_parts": p})
            for w in warps for s in stages for r in caps for kh in halves for p in parts]
    if not _wide(shape):  # the default's parts (unset: 1)
        grid = [replace(c, **{f"{cls}_dv_parts": getattr(default, f"{cls}_dv_parts")}) for c in grid]
    seen, out = set(), []
    for c in [default] + grid:
        n, split = 1 if cls == "one" else 2, cls == "split"
        key = k_attn.decode_launch(c, n, split) + (k_attn.decode_halves(c, n, split),
                                                   k_attn.decode_dv_parts(c, n, split))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def prefill_candidates(shape: AttentionShape, default: AttentionConfig) -> list[AttentionConfig]:
    """The default first, then query positions per program x warps x stages, and the default's
    rows on 4 warps with 1 stage, uncapped or under a 168-register cap, or 2 stages capped (Llama-8B
    heads, 64 rows, sm_90: 1 stage takes 209 registers and 51 KB of shared memory, 2 programs an SM;
    capped, 3. H200, bench/attn_sweep.py, 2,048-token prefill: e4m3 152.5 -> 139.5 us, bf16 140.1 ->
    151.4. A 128 cap spilled (210-258 us), 128-row programs under a cap ran 3-4x slower, and ptxas
    could not fit some at all, which would stop the sweep). Over an e4m3 cache,
    only programs on the default's side of 64 rows: its f16 dots round differently on mma.sync
    (< 64 rows) and wgmma (the known gap, the strict xfail in test_triton_gpu.py; H200: the
    32-row candidates changed the bits), so the others would fail the tuner's bits check."""
    if _wide(shape):  # (configs.wide_head: 64 rows on 8 warps; caps left out, ptxas may refuse them)
        bq = default.prefill_block_q
        grid = [replace(default, prefill_block_q=b, prefill_num_warps=w, prefill_num_stages=s)
                for b in (max(1, bq // 2), bq, 2 * bq) for w in (4, 8) for s in (1, 2, 3)]
    else:
        grid = [replace(default, prefill_block_q=bq, prefill_num_warps=w, prefill_num_stages=s)
                for bq in (8, 16, 32) for w in (4, 8) for s in (2, 3)]
        grid += [replace(default, prefill_num_warps=4, prefill_num_stages=s, prefill_maxnreg=r)
                 for s, r in ((1, None), (1, 168), (2, 168))]
    if shape.cache_dtype == "float8_e4m3fn":
        wgmma = lambda c: _rows(shape, c) >= 64  # noqa: E731
        grid = [c for c in grid if wgmma(c) == wgmma(default)]
    return _distinct(shape, [default] + grid, decode=False)


def _rows(shape: AttentionShape, c: AttentionConfig) -> int:
    """A prefill program's rows: its query positions x the padded GQA group."""
    return k_attn.attention_block_q(shape.h, shape.hkv, c, decode=False) * next_pow2(shape.h // shape.hkv)


def _distinct(shape: AttentionShape, cands: list[AttentionConfig], decode: bool) -> list[AttentionConfig]:
    seen, out = set(), []
    for c in cands:
        knobs = ATTENTION_DECODE_KNOBS if decode else ATTENTION_PREFILL_KNOBS
        key = (k_attn.attention_block_q(shape.h, shape.hkv, c, decode),) + tuple(getattr(c, k) for k in knobs[1:])
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


# -- the sweep ----------------------------------------------------------------------------
class AttentionTuner:
    def __init__(self, bench: Bench) -> None:
        self.bench, self.progress = bench, bench.progress

    def tune(self, shapes: list[AttentionShape], decode: list[AttentionCase], prefill: AttentionCase,
             mixed: AttentionCase | None = None) -> Schedules:
        sched = Schedules(self.bench.arch)
        for sh in shapes:
            sched.entries.setdefault("paged_attention", []).append(self._tune(sh, decode, prefill, mixed))
            self.bench.free_all()
        return sched

    def _tune(self, sh: AttentionShape, decode: list[AttentionCase], prefill: AttentionCase,
              mixed: AttentionCase | None = None) -> dict:
        default = DEFAULT.attention(sh.h, sh.hkv, sh.d, sh.max_model_len, sh.cache_dtype)
        cache = attention_cache_key(sh.cache_dtype)
        rigs: dict[AttentionCase, AttentionRig] = {}
        by_class = {decode_class_of(c): c for c in decode}

        def timed(cfg: AttentionConfig, cases: list[AttentionCase]) -> list[Timed]:
            for case in cases:
                if case not in rigs:
                    rigs[case] = AttentionRig(self.bench, sh, case)
            return [rigs[case].timed(cfg) for case in cases]

        def trials(rounds) -> list[Trial]:
            return [Trial((sh.h, sh.hkv, sh.d, cache, phase), c, lambda c=c, cases=cases: timed(c, cases),
                          baseline=i == 0) for phase, cases, cands in rounds for i, c in enumerate(cands)]
        # round 1: decode buckets read whole (block_q, warps, stages) and prefill
        first = [("prefill", [prefill], prefill_candidates(sh, default))]
        if "decode" in by_class:
            first.insert(0, ("decode", [by_class["decode"]], decode_candidates(sh, default)))
        # round 2: the split and one-sequence classes from round 1's decode winner (its block_q;
        # its warps and stages where a class's knobs stay unset)
        second = lambda base: [(cls, [by_class[cls]], class_candidates(sh, base, cls))  # noqa: E731
                               for cls in ("split", "one") if cls in by_class]
        n = sum(len(c) for _, _, c in first + second(default)) + 2 * (mixed is not None)
        self.progress(f"paged_attention [{sh.h}, {sh.hkv}, {sh.d}]{f' ({cache} cache)' if cache else ''}: "
                      f"{n} schedules over {', '.join(c.name for c in decode + [prefill] + [mixed] if c)} "
                      f"(tile {default.tile}, seg {default.seg}"
                      + (f", decode tile {default.decode_tile})" if default.decode_tile else ")"))
        won = self.bench.best(trials(first))
        group = lambda phase: (sh.h, sh.hkv, sh.d, cache, phase)  # noqa: E731
        base = won[group("decode")].cand if "decode" in by_class else default
        won.update(self.bench.best(trials(second(base))))
        entry = {"h": sh.h, "hkv": sh.hkv, "d": sh.d, **({"cache": cache} if cache else {})}
        tuned = default
        for phase, knobs, timing in (("decode", ATTENTION_DECODE_KNOBS, "us"),
                                     ("split", ATTENTION_SPLIT_KNOBS, "split_us"),
                                     ("one", ATTENTION_ONE_KNOBS, "one_us"),
                                     ("prefill", ATTENTION_PREFILL_KNOBS, "prefill_us")):
            w = won.get(group(phase))
            cand = w.cand if w is not None else base if phase == "decode" else default  # no case: defaults
            entry.update({k: getattr(cand, k) for k in knobs if getattr(cand, k) is not None})  # unset: omitted
            tuned = replace(tuned, **{k: getattr(cand, k) for k in knobs})
            if w is None:
                continue
            entry[timing] = round(w.us, 2)
            was = f" (default {w.baseline_us:.1f} us)" if w.baseline_us is not None else ""
            self.progress(f"  {phase}: " + ", ".join(f"{k} {getattr(w.cand, k)}" for k in knobs)
                          + f": {w.us:.1f} us{was}")
        if mixed is not None:
            # round 3: the winners' knobs with and without route_mixed, timed at a mixed step (decode
            # rows beside a prompt chunk) and the prompt alone (which pays the routed decode launch
            # for nothing). No bits check: routing moves the decode rows to the decode kernel, whose
            # bits differ from the prefill kernel's over an e4m3 cache (and are a decode step's).
            # A decode_tile of its own needs routing (paged_attention_launch checks it): routed alone.
            ways = ((False, True) if tuned.tile_of_decode == tuned.tile else (True,))
            rounds = [Trial(group("mixed"), c, lambda c=c: [replace(t, output=None) for t in timed(c, [mixed, prefill])],
                            baseline=i == 0) for i, c in enumerate(replace(tuned, route_mixed=r) for r in ways)]
            w = self.bench.best(rounds)[group("mixed")]
            if w.cand.route_mixed:
                entry["route_mixed"] = True
            entry["mixed_us"] = round(w.us, 2)
            self.progress(f"  mixed ({mixed.name} + {prefill.name}): route_mixed {w.cand.route_mixed}: "
                          f"{w.us:.1f} us" + (f" (unrouted {w.baseline_us:.1f} us)" if len(ways) > 1
                                               else " (a decode_tile of its own: routed)"))
        return entry
