"""Default launch configs per kernel, and the hook tuned schedules plug into.

Two kinds of knobs, kept apart on purpose (DESIGN "Invariance by construction"):
- reduction knobs change the order of floating-point sums: GEMM SPLIT_K (and the
  split boundaries its BLOCK_K sets), attention TILE/SEG, a norm's BLOCK/num_warps. They
  are chosen from the weight or model shape only, never from the bucket, so a token's
  numbers do not depend on its batch.
- schedule knobs (GEMM BLOCK_M/BLOCK_N/num_stages and the K block a program loads,
  GemmTile.block_k; attention rows per program and warps, elementwise block sizes,
  split-KV on/off; every MoE knob, path included: moe_config.py) may vary per bucket and
  may be tuned freely.

`Configs(lookup=...)` takes a callable `(op, key) -> dict | None` (schedules/ YAML
reader, later); a miss falls back to the defaults below and says so once.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kiln.schedules import ScheduleError

log = logging.getLogger(__name__)

Lookup = Callable[[str, tuple], Mapping[str, Any] | None]

SMS = {"sm_90": 132, "sm_121": 48}  # streaming multiprocessors: H200, GB10


@dataclass(frozen=True)
class GemmReduction:
    """Per weight [N, K], for every bucket: the K order of every output element."""
    block_k: int = 64  # split-K's ranges are whole blocks of it; a tile's default K block (GemmTile.block_k)
    split_k: int = 1  # >1: partial sums over fixed K ranges, summed in order 0..S-1

    def k_per_split(self, k: int) -> int:
        """K columns of each split (the last may hold fewer): whole blocks of block_k."""
        return -(-(-(-k // self.block_k)) // self.split_k) * self.block_k


@dataclass(frozen=True)
class GemmTile:
    """Per bucket: how output tiles are cut; leaves each element's K order alone."""
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # row blocks that walk W's column blocks together (L2 reuse of W)
    tma: bool | None = None  # load x and w through TMA descriptors (same bits); None: with_tma's rule
    fold: bool | None = None  # split-K added up inside each program (same bits); None: Configs.gemm_fold's rule
    # The K block each program loads and multiplies at a time; None: the weight's reduction's
    # (GemmReduction.block_k, which also sets where split-K's ranges start). The tensor core
    # chains a block's K in k=16 steps through the accumulator, so the sums do not depend on
    # it (H200: test_triton_gpu.py, 32/64/128 give the same rows); it sets the bytes in flight
    # per stage and the shared memory a tile takes (BLOCK_K 128 leaves a 128 x 256 tile 2
    # stages where 64 leaves it 4), so decode and prefill buckets want different ones.
    block_k: int | None = None


def with_tma(tile: GemmTile, arch: str) -> GemmTile:
    """A tile whose `tma` is unset gets the arch's rule: TMA loads on sm_90 for the wgmma tiles
    (BLOCK_M >= 64). H200, bench/gemm_tma_probe.py at the 2,048-token prefill shapes of
    Llama-3.1-8B: 656-710 TFLOP/s with pointer loads, 770-805 with TMA (cuBLAS 705-786), the
    same bits. sm_121 has TMA too, but it is not measured there, so it keeps pointer loads."""
    if tile.tma is not None:
        return tile
    return replace(tile, tma=arch == "sm_90" and tile.block_m >= 64)


@dataclass(frozen=True)
class AttentionConfig:
    """Per model (H, Hkv, D). The reduction knobs are tile, decode_tile and seg; the rest only groups rows
    into programs (paged_attention.py: rows never mix), so decode and prefill buckets each
    take their own."""
    # decode buckets: query positions per program (rows = block_q * next_pow2(H // Hkv), >= 16)
    # (H200, Llama-8B heads, bench/attn_sweep.py: 256 sequences at 1,500 keys read K/V at
    # 4.26 TB/s with 2 warps, 3.84 with 4, 2.18 with 8)
    block_q: int = 4
    tile: int = 64        # keys per online-softmax step; tiles start at multiples of `tile`
    seg: int = 512        # keys per split-KV segment (a multiple of tile); segments fold in order
    # The decode variant's tile (every decode class, and a mixed bucket's routed decode launch);
    # None: `tile`. A reduction knob like tile, so never the tuner's. It may differ from `tile`
    # only where the decode kernel's bits are already its own: over an e4m3 cache, whose 16-row
    # decode programs (mma.sync) round the f16 dots differently from the 64-row prefill ones
    # (wgmma; GPU_NOTES), and with route_mixed, so that a step's decode rows take the decode
    # kernel in every bucket. Over a bf16 cache both kernels give the same bits, so it stays.
    # Configs.attention sets 32 for an e4m3 cache (H200, bench/attn_sweep.py, 512 sequences x
    # 1,500 keys: 474 us with 1-warp 32-key programs against 552 for the 64-key 2-warp default;
    # a 32-key prefill lost, 197 us against 139, so prefill keeps `tile`).
    decode_tile: int | None = None
    num_warps: int = 2
    num_stages: int = 2
    maxnreg: int | None = None  # a register cap for the decode buckets read whole (see below)
    # Decode buckets read whole (split_/one_key_halves: those classes; none falls back on
    # another): 2 loads and multiplies each tile's K and V as two halves of tile // 2 keys,
    # chained through the dots' accumulators (the same sums in the same order:
    # paged_attention._pv2), so half the operands are live at once. ptxas (sm_90, Llama-8B
    # heads, tile 64) spills less: e4m3 read whole, 2 warps, 1,000 -> 728 bytes a thread; bf16
    # 2 warps 4 stages 964 -> 236; the bf16 split class (2 warps, 3 stages, 168 registers)
    # 2,120 -> 840. H200, e4m3, 512 sequences x 1,500 keys (a hand-written variant): 555 us
    # whole, 521 in halves at 168 registers, 608 in halves uncapped. None: whole tiles.
    key_halves: int | None = None
    # prefill and mixed buckets: 64-row programs (2,048-token prefill: 16-row programs spent
    # 2.7 ms a layer, mostly waiting on memory; 64-row ones 183 us with 2 stages, 219 with 3)
    prefill_block_q: int = 16
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2
    prefill_maxnreg: int | None = None  # a register cap (ptxas), None: none (see maxnreg below)
    # Decode buckets by size class (paged_attention_launch.decode_class): the knobs above serve
    # those read whole (more than lower.SPLIT_KV_MAX_SEQS sequences); `split_*` the split-KV ones
    # of 2 or more sequences, `one_*` a single sequence (batch-1 latency: a few dozen programs).
    # None: the decode knob above; block_q serves all three. maxnreg caps a thread's registers
    # (ptxas) so that more programs share an SM. H200, Llama-8B heads, bf16 cache
    # (bench/attn_sweep.py): one sequence at 512 keys 7.6 us with 2 warps, 6.8 with 4; 32
    # sequences at 1,500 keys 88.1 us uncapped, 79.0 at 168 registers; 128 sequences (read
    # whole) 184.0 uncapped, 219.2 at 168.
    split_num_warps: int | None = None
    split_num_stages: int | None = None
    split_maxnreg: int | None = None
    split_key_halves: int | None = None  # as key_halves (below), for this class alone
    # The split and one-sequence classes' programs cut a KV head's V columns into this many parts
    # side by side (paged_attention.py DV_PARTS: the same bits), None: 1. More programs for a short
    # decode of few KV heads, fewer accumulators each (head_dim 256: see Configs.attention).
    split_dv_parts: int | None = None
    one_num_warps: int | None = None
    one_num_stages: int | None = None
    one_maxnreg: int | None = None
    one_key_halves: int | None = None
    one_dv_parts: int | None = None
    # Mixed buckets: their sequences of one query (the decode rows of a step that also runs a
    # prompt chunk) taken by a launch of the decode variant (16-row programs, the knobs of the
    # decode buckets read whole), the rest by the prefill variant (paged_attention_launch.
    # routes_mixed). Off: every row in the prefill variant's 64-row programs, a sixteenth of
    # them live for a decode row. Over an e4m3 cache routing also changes the decode rows'
    # bits to the decode steps' own (GPU_NOTES: 16- and 64-row programs round the f16 dots
    # differently). `build.py tune` times it off and on (autotune_attention, round 3).
    route_mixed: bool = False

    @property
    def tile_of_decode(self) -> int:
        """The keys per step of the decode variant (decode_tile, else tile)."""
        return self.decode_tile or self.tile


# AttentionConfig's schedule knobs, by the kind of bucket they serve (the tuner sweeps these
# and nothing else: tile, decode_tile and seg are its reduction knobs)
ATTENTION_DECODE_KNOBS = ("block_q", "num_warps", "num_stages", "maxnreg", "key_halves")
ATTENTION_SPLIT_KNOBS = ("split_num_warps", "split_num_stages", "split_maxnreg", "split_key_halves", "split_dv_parts")
ATTENTION_ONE_KNOBS = ("one_num_warps", "one_num_stages", "one_maxnreg", "one_key_halves", "one_dv_parts")
ATTENTION_PREFILL_KNOBS = ("prefill_block_q", "prefill_num_warps", "prefill_num_stages", "prefill_maxnreg")


@dataclass(frozen=True)
class RowConfig:
    """Row-wise kernels (norms, preamble): one program per row; fixed per row width."""
    num_warps: int = 4


@dataclass(frozen=True)
class ElementwiseConfig:
    block: int = 1024
    num_warps: int = 4


class Configs:
    def __init__(self, lookup: Lookup | None = None):
        self._lookup = lookup
        self.fallbacks: list[tuple[str, tuple]] = []  # (op, key) with no tuned entry, in order of asking

    def _get(self, op: str, key: tuple, default):
        found = self._lookup(op, key) if self._lookup else None
        if found is None:
            if self._lookup is not None and (op, key) not in self.fallbacks:
                self.fallbacks.append((op, key))
                log.info("no tuned schedule for %s %s; using the default %s", op, key, default)
            return default
        names = {f.name for f in fields(default)}
        unknown = set(found) - names
        if unknown:
            raise ScheduleError(f"the schedule for {op} {key} has unknown fields {sorted(unknown)} "
                                f"(known: {sorted(names)})")
        return replace(default, **found)

    def gemm_reduction(self, n: int, k: int) -> GemmReduction:
        # Split-K 2 where N alone gives a decode step too few programs on 132 SMs (H200,
        # M=1: q/k/v 6144x4096 2.4 -> 3.3 TB/s, down 4096x14336 1.9 -> 2.9 TB/s); a wide
        # N (gate_up 28672) reaches ~4 TB/s without and loses with it.
        split = 2 if n <= 8192 and k >= 4096 else 1
        default = GemmReduction(block_k=64 if k % 64 == 0 else 32, split_k=split)
        return self._get("gemm_reduction", (n, k), default)

    def gemm_tile(self, m: int, n: int, k: int, arch: str = "sm_90") -> GemmTile:
        if m <= 16:  # decode: memory-bound, many narrow programs streaming W
            default = GemmTile(block_m=16, block_n=32, num_warps=4, num_stages=4)
        elif m <= 64:
            default = GemmTile(block_m=64, block_n=64, num_warps=4, num_stages=4)
        elif m <= 1024 or arch != "sm_90":  # sm_121 has ~99 KiB of shared memory per block
            default = GemmTile(block_m=128, block_n=128, num_warps=8, num_stages=3)
        else:  # H200, 4096^3: 578 TFLOP/s (128x128: 507)
            default = GemmTile(block_m=128, block_n=256, num_warps=8, num_stages=3)
        return with_tma(self._get("gemm_tile", (m, n, k, arch), default), arch)

    def gemm_fold(self, m: int, n: int, k: int, tile: GemmTile, red: GemmReduction, arch: str = "sm_90") -> bool:
        """Whether a split-K GEMM adds its splits inside each program (gemm.py FOLD) rather than
        writing f32 partials for gemm_reduce_kernel or add_rms_norm: the same bits, without the
        partials' round trip and the reduce launch. The tile's `fold` where a schedule or an A/B
        flag sets it. Else where
        - the output tiles alone fill the GPU twice, so that the split's extra programs are not
          needed to keep the SMs busy (e.g. 128x128 tiles of Llama-3.1-8B's 2,048-token prefill;
          the 128x256 tiles tuned for it since the K block became a tile knob do not by this rule;
          down's folds through memory because its schedule says so), and
        - the running sum and the split's accumulator fit in registers side by side: at most 64
          f32 a thread each (ptxas, sm_90, TMA: 128x128 with 8 warps takes 154 registers
          folded, 90 not; 128x256 with 8 warps hits 255 and spills 1 KB a thread).
        Never where a split is one K block (gemm.py says why). A schedule may fold a tile whose two
        accumulators do not fit (`fold: true`, build.py tune's stage 2 times it): it folds through
        memory (gemm.fold_through_memory)."""
        if red.split_k == 1 or red.k_per_split(k) < 2 * (tile.block_k or red.block_k):  # a split of one K block
            return False
        if tile.fold is not None:
            return tile.fold
        tiles = -(-m // tile.block_m) * -(-n // tile.block_n)
        acc_regs = tile.block_m * tile.block_n // (32 * tile.num_warps)  # one f32 [BM, BN] tile, per thread
        return tiles >= 2 * SMS.get(arch, SMS["sm_90"]) and acc_regs <= 64

    def attention(self, h: int, hkv: int, d: int, max_model_len: int | None = None,
                  cache_dtype: str | None = None) -> AttentionConfig:
        """cache_dtype: the KV cache's numpy name. An e4m3 cache (--kv-cache-dtype fp8) has schedules
        of its own (`cache: float8_e4m3fn` in the YAML): its decode is compute-bound where a bf16
        cache's reads at the copy bandwidth, and the knobs differ (H200, bench/attn_sweep.py, 512
        sequences at 1,500 keys: e4m3 555 us with 2 stages, 601 with 4; bf16 tunes to 4). Without
        such an entry it takes the defaults, never the bf16 cache's. A cache in the model's own
        dtype (bfloat16, float16) uses the entries without `cache`."""
        default = AttentionConfig()
        if max_model_len is not None:
            # SEG sets how many programs a short decode gets (one per segment and KV head): at
            # batch 1 and 512 tokens, SEG 512 left 8 programs walking 8 tiles each (92 us per
            # layer on the H200). The smallest SEG that keeps the split workspace and grid to
            # at most 64 segments; fixed per bundle, so every bucket reduces the same way.
            seg = 1 << max(0, (-(-max_model_len // 64) - 1).bit_length())
            default = replace(default, seg=min(max(seg, default.tile), 512))
        if d > 128:
            default = replace(default, **wide_head(h, hkv, d))
        if attention_cache_key(cache_dtype) == "float8_e4m3fn":
            # see decode_tile; 1-warp programs and routed mixed buckets go with it (the
            # schedule knobs a tuned entry overrides: route_mixed must stay on, see the check in
            # paged_attention_launch)
            # (1 warp measured at head_dim 128; a wider head keeps wide_head's warps)
            default = replace(default, decode_tile=32, route_mixed=True, **({"num_warps": 1} if d <= 128 else {}))
        return self._get("paged_attention", (h, hkv, d, attention_cache_key(cache_dtype), max_model_len), default)

    def row(self, op: str, width: int) -> RowConfig:
        return self._get(op, (width,), RowConfig(num_warps=4 if width <= 4096 else 8))

    def elementwise(self, op: str, width: int) -> ElementwiseConfig:
        return self._get(op, (width,), ElementwiseConfig())

    def moe(self, t: int, top_k: int, e: int, h: int, i: int, dtype: str, arch: str = "sm_90"):
        """The MoE experts layer's path and tiles for a bucket of T tokens (moe_config.MoeConfig):
        schedule knobs only, so they may follow the bucket; dtype: the activations' numpy name."""
        # imported here: moe_config reads the kernels' defaults, and the kernels import this module
        from kiln.codegen.triton.moe_config import default_moe_config

        return self._get("moe_experts", (t, e, h, i, top_k, dtype, arch), default_moe_config(t, top_k, e, h, i, arch))


def wide_head(h: int, hkv: int, d: int) -> dict[str, int]:
    """The schedule knobs of a head wider than 128 (Qwen3.5/3.6: 256), where the defaults tuned
    at 128 spill and launch too few programs (GPU_NOTES "Attention at head_dim 256";
    ptxas, sm_90, 24 / 4 heads of 256, one sequence: 2 warps of 32-row programs 255 registers and
    3.2 KB of spill stores a thread, 32 live programs at 512 keys). Here: 16-row programs (the fewest
    query positions that fill tl.dot's rows: a decode program has one live), 4 warps (224
    registers read whole, no spills), and the split classes' V columns in parts (DV_PARTS: the
    same bits): 2 for the split buckets (162 registers), and for one sequence as many as bring
    a KV head's parts to 16, so that 8 segments (512 keys at max_model_len 4,096) are 128
    programs with 2-8 KV heads (128 registers), at least 32 columns a part. Prefill: 64-row programs
    on 8 warps (255 registers, no spills; the default 16 query positions are 128 rows at a GQA group
    of 8, which spilled 7.1 KB a thread on 4 warps, 64 rows on 4 warps 1.8 KB). All schedule knobs:
    the bits are the head_dim-128 defaults' (tile 64, seg by max_model_len)."""
    cols = 1 << max(0, (d - 1).bit_length())
    group = 1 << max(0, (h // hkv - 1).bit_length())
    one = max(1, min(16 // hkv, cols // 32))
    return dict(block_q=1, num_warps=4, num_stages=2, split_num_warps=4, split_num_stages=2, split_dv_parts=2,
                one_num_warps=4, one_num_stages=2, one_dv_parts=one, prefill_block_q=max(1, 64 // group),
                prefill_num_warps=8, prefill_num_stages=2)


def attention_cache_key(cache_dtype: str | None) -> str | None:
    """The `cache` field of a paged_attention schedule: None (no field) for a cache in a model
    dtype, else the cache's numpy name (float8_e4m3fn)."""
    return None if cache_dtype in (None, "bfloat16", "float16", "float32") else cache_dtype


DEFAULT = Configs()
