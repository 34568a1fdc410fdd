"""Row and elementwise kernels on the GPU across configs: schedules/<arch>/rows.yaml.

The ops: every Configs.row op (rms_norm, for rms_norm and add_rms_norm; attention_preamble)
and Configs.elementwise op (silu_mul; gather_rows, for the embedding and the logits rows)
a plan launches; ROW_OPS says which kernel serves which op. They are found by lowering
the bundle's buckets (lower.py), so each is timed as the plan launches it: the same
strides, the same fused split-K partials (add_rms_norm's X_SPLIT, from the GEMM schedules
in force), the same integer hints. A candidate is the same lowering with its config in
place of the op's; its launches are relocated into device memory laid out as the
executor lays it out (one allocation per region the launches touch; step inputs with
every row live) and timed in three buckets, at about 1, 256 and 2,048 rows, each launch
weighted by how often a step runs it. The sum over the buckets chooses.

Invariance: a norm's num_warps (rms_norm's, and attention_preamble's when it normalises
q and k) sets how a row's sum of squares is spread over lanes and warps, that is the order
of the sum: a reduction knob. It is chosen once per (op, width), for every bucket, never
per bucket, and that is what keeps a token's numbers independent of its batch. The
elementwise kernels (silu_mul, gather_rows) and the preamble without q/k norm sum nothing:
their knobs are schedule knobs, and Bench.best refuses a candidate whose bits differ from
the default config's.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from kiln.codegen.autotune import REPS, Bench, Launch, Timed, Trial
from kiln.codegen.buckets import Bucket, pick_bucket
from kiln.codegen.compile import plan_dims
from kiln.codegen.lower import Regions, input_bytes, input_layout, lower_bucket
from kiln.codegen.triton.aot import cache_key
from kiln.codegen.triton.configs import DEFAULT, Configs, Lookup
from kiln.codegen.triton.launch import KernelSpec, cdiv, next_pow2
from kiln.graph import Graph, to_numpy
from kiln.passes.plan_memory import plan_memory
from kiln.runtime.worker.bundle import REGION_SHIFT
from kiln.schedules import Schedules

TUNED_ROWS = (1, 256, 2048)


@dataclass(frozen=True)
class RowOp:
    kernel: str  # what its launches run
    elementwise: bool  # Configs.elementwise (block, num_warps); else Configs.row (num_warps)
    width: Callable[[Mapping], int]  # a launch's constexprs -> the width Configs was asked for
    reduces: Callable[[Mapping], bool]  # a launch's constexprs -> does num_warps order a sum?
    outputs: tuple[str, ...]  # the arguments it writes


ROW_OPS = {  # Configs op name -> its kernel
    "rms_norm": RowOp("rms_norm_kernel", False, lambda c: c["N"], lambda c: True, ("y_ptr", "res_out_ptr")),
    "attention_preamble": RowOp("attention_preamble_kernel", False, lambda c: c["H"] * c["D"],
                                lambda c: c["QK_NORM"], ("q_out_ptr", "cache_ptr")),
    "silu_mul": RowOp("silu_mul_kernel", True, lambda c: c["N"], lambda c: False, ("out_ptr",)),
    "gather_rows": RowOp("gather_rows_kernel", True, lambda c: c["N"], lambda c: False, ("out_ptr",)),
}
_OP_OF_KERNEL = {o.kernel: name for name, o in ROW_OPS.items()}


def candidates(op: str, width: int) -> list[dict]:
    """The default config first (kiln's, not a tuned one), then the grid; only the knobs of
    Configs.row (num_warps) or Configs.elementwise (block, num_warps)."""
    if ROW_OPS[op].elementwise:
        d = DEFAULT.elementwise(op, width)
        blocks = sorted({min(b, next_pow2(width)) for b in (1024, 2048, 4096)})
        grid = [{"block": d.block, "num_warps": d.num_warps}] + [{"block": b, "num_warps": w}
                                                                 for b in blocks for w in (4, 8)]
    else:
        grid = [{"num_warps": DEFAULT.row(op, width).num_warps}] + [{"num_warps": w} for w in (2, 4, 8, 16)]
    return [c for i, c in enumerate(grid) if c not in grid[:i]]


def row_buckets(buckets: list[Bucket], rows: tuple[int, ...] = TUNED_ROWS) -> list[Bucket]:
    """The buckets `rows` tokens run in: decode buckets up to the largest, then mixed ones."""
    top = max(b.tokens for b in buckets if b.decode)
    most = max(b.tokens for b in buckets)
    out: list[Bucket] = []
    for r in rows:
        b = pick_bucket(buckets, r, r, r) if r <= top else pick_bucket(buckets, min(r, most), 1, 1)
        if b not in out:
            out.append(b)
    return out


class _PlanRig:
    """Device memory for the regions of one bucket's plan that the timed launches touch, one
    allocation per region as in runtime/worker/cuda_executor.py, pointers relocated from the
    plan's (region << REGION_SHIFT) + offset. What launches write (arena, workspaces, the KV
    cache) is restored from a pristine copy before each timing, so that what a launch
    writes depends on it alone, not on the launches timed before it in the shared arena."""

    def __init__(self, bench: Bench, graph: Graph, bucket: Bucket, regions: Regions, mb: int,
                 block_size: int) -> None:
        self.bench, self.graph, self.bucket, self.regions, self.mb = bench, graph, bucket, regions, mb
        self.block_size = block_size
        self.base: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}
        self.pristine: dict[str, int] = {}  # writable region -> its initial bytes

    def region(self, name: str) -> int:
        if name not in self.base:
            kind, _, rest = name.partition(":")
            if name == "inputs":
                buf = self.bench.buffer((input_bytes(self.bucket, self.mb),), np.uint8, self._inputs())
            elif kind == "const":
                arr = self.regions.consts[rest]
                buf = self.bench.buffer(arr.shape, arr.dtype, arr)
            elif kind in ("weight", "state"):
                t = self.graph.tensors[rest]
                nb = cdiv(self.bucket.tokens, self.block_size) + 1  # slot_mapping is 0..T-1
                buf = self.bench.buffer(t.concrete_shape({**self.bucket.dims(self.mb), "NB": nb}), to_numpy(t.dtype))
            else:  # the arena, workspaces
                buf = self.bench.buffer((self.regions.sizes[name],), np.uint8)
            self.base[name], self.nbytes[name] = buf.ptr, buf.np_dtype.itemsize * int(np.prod(buf.shape))
            if kind not in ("weight", "const") and name != "inputs":
                self.pristine[name] = self.bench.malloc(self.nbytes[name])
                self.bench.copy(self.pristine[name], buf.ptr, self.nbytes[name])
        return self.base[name]

    def _inputs(self) -> np.ndarray:
        """Step inputs with every row live: the tokens spread over the bucket's sequences, one
        logits row each (the layout is lower.input_layout's)."""
        b = self.bucket
        per = np.array([b.tokens // b.seqs + (i < b.tokens % b.seqs) for i in range(b.seqs)])
        qsl = np.concatenate([[0], np.cumsum(per)])
        vocab = self.graph.tensors[self.graph.outputs[0]].shape[1]
        values = {"input_ids": np.arange(b.tokens) * 7919 % vocab, "slot_mapping": np.arange(b.tokens),
                  "positions": np.concatenate([np.arange(n) for n in per]), "seq_lens": per,
                  "query_start_loc": qsl, "logits_indices": (qsl[1:] - 1)[:b.logits], "num_logits": [b.logits]}
        out = np.zeros(input_bytes(b, self.mb), np.uint8)
        for name, (off, _, shape) in input_layout(b, self.mb).items():
            arr = np.zeros(int(np.prod(shape)), np.int32)
            v = np.asarray(values.get(name, []), np.int32)
            arr[:len(v)] = v
            out[off:off + arr.nbytes] = arr.view(np.uint8)
        return out

    def reset(self) -> None:
        for name, src in self.pristine.items():
            self.bench.copy(self.base[name], src, self.nbytes[name])

    def _at(self, ptr: int) -> tuple[str, int]:
        return self.regions.names[ptr >> REGION_SHIFT], ptr & ((1 << REGION_SHIFT) - 1)

    def relocate(self, spec: KernelSpec, args: list) -> list:
        out = []
        for ty, a in zip(spec.signature.values(), args):
            if ty.startswith("*"):
                name, off = self._at(a.data_ptr())
                a = self.region(name) + off
            out.append(a)
        return out

    def output(self, spec: KernelSpec, args: list, names: tuple[str, ...]) -> Callable[[], bytes]:
        """-> what the launch wrote: each output's span (a state: the whole of it)."""
        spans = []
        for n in names:
            a = args[list(spec.signature).index(n)]
            name, off = self._at(a.data_ptr())
            if name.startswith("state:"):
                spans.append((self.region(name), self.nbytes[name]))
            else:
                last = sum((d - 1) * s for d, s in zip(a.shape, a.strides)) + 1 if all(a.shape) else 0
                spans.append((self.region(name) + off, last * a.np_dtype.itemsize))
        return lambda: b"".join(self.bench.read(p, n) for p, n in spans)


class RowTuner:
    def __init__(self, bench: Bench, graph: Graph, buckets: list[Bucket], *, lookup: Lookup | None,
                 max_model_len: int, block_size: int, rows: tuple[int, ...] = TUNED_ROWS) -> None:
        self.bench, self.graph, self.lookup = bench, graph, lookup
        self.max_model_len, self.block_size = max_model_len, block_size
        self.mb = cdiv(max_model_len, block_size)
        self.plan = plan_memory(graph, plan_dims(buckets, self.mb))
        self.buckets = row_buckets(buckets, rows)
        self.regions = {b: Regions() for b in self.buckets}
        for r in self.regions.values():
            r.need("arena", self.plan.arena_bytes)

    def _lower(self, bucket: Bucket, override: Mapping[tuple, dict]) -> list[Launch]:
        """The bucket's launches of the tuned kernels, under the schedules in force but for `override`."""
        def lookup(op: str, key: tuple):
            return override.get((op, key)) or (self.lookup(op, key) if self.lookup else None)
        launches = lower_bucket(self.graph, self.plan, bucket, max_blocks_per_seq=self.mb,
                                regions=self.regions[bucket], max_model_len=self.max_model_len,
                                configs=Configs(lookup=lookup), arch=self.bench.arch)
        return [(s, a) for s, a in launches if s.kernel in _OP_OF_KERNEL]

    @staticmethod
    def _group(spec: KernelSpec) -> tuple[str, int]:
        op = _OP_OF_KERNEL[spec.kernel]
        return op, ROW_OPS[op].width(spec.constexprs)

    def _variants(self, cands: Mapping[tuple, list[dict]]) -> dict[tuple, list]:
        """(group, candidate index) -> [(bucket, spec, args, count)]: the candidate's launches of
        the group in each bucket, one per distinct kernel, grid and scalars, with how many
        times a step runs it. One lowering per bucket serves the i-th candidate of every group."""
        found: dict[tuple, list] = {}
        for i in range(max(len(c) for c in cands.values())):
            override = {(op, (w,)): c[i] for (op, w), c in cands.items() if i < len(c)}
            for b in self.buckets:
                variants: dict[tuple, list] = {}
                for spec, args in self._lower(b, override):
                    g = self._group(spec)
                    if i < len(cands[g]):
                        scalars = tuple(a for a, ty in zip(args, spec.signature.values()) if not ty.startswith("*"))
                        key = (g, cache_key(spec, self.bench.arch), spec.grid, scalars)
                        variants.setdefault(key, [b, spec, args, 0])[3] += 1
                for key, v in variants.items():
                    found.setdefault((key[0], i), []).append(tuple(v))
        return found

    def trials(self) -> list[Trial]:
        groups = sorted({self._group(s) for s, _ in self._lower(self.buckets[0], {})})
        cands = {g: candidates(*g) for g in groups}
        found = self._variants(cands)
        rigs: dict[Bucket, _PlanRig] = {}

        def timed(launches: list, check: bool) -> list[Timed]:
            out = []
            for b, spec, args, count in launches:
                if b not in rigs:
                    rigs[b] = _PlanRig(self.bench, self.graph, b, self.regions[b], self.mb, self.block_size)
                rig, outputs = rigs[b], ROW_OPS[_OP_OF_KERNEL[spec.kernel]].outputs
                out.append(Timed([[(spec, rig.relocate(spec, args))]] * REPS, weight=count, setup=rig.reset,
                                 output=rig.output(spec, args, outputs) if check else None))
            return out
        trials = []
        for g in groups:
            # a reduction knob may change the bits (it is fixed per (op, width) instead); a schedule knob may not
            check = not any(ROW_OPS[g[0]].reduces(spec.constexprs) for _, spec, _, _ in found[(g, 0)])
            trials += [Trial(g, c, lambda launches=found[(g, i)], check=check: timed(launches, check), baseline=i == 0)
                       for i, c in enumerate(cands[g])]
        return trials

    def tune(self) -> Schedules:
        sched = Schedules(self.bench.arch)
        trials = self.trials()
        self.bench.progress(f"row kernels: {len(trials)} configs of {len({t.group for t in trials})} (op, width) over "
                            f"buckets {', '.join(b.name for b in self.buckets)}")
        for (op, width), w in sorted(self.bench.best(trials).items()):
            sched.entries.setdefault(op, []).append({"width": width, **w.cand, "us": round(w.us, 2)})
            was = f" (default {w.baseline_us:.1f} us)" if w.baseline_us is not None else ""
            self.bench.progress(f"  {op} width {width}: " + ", ".join(f"{k} {v}" for k, v in w.cand.items())
                                + f": {w.us:.1f} us a step summed over the buckets{was}")
        self.bench.free_all()
        return sched
