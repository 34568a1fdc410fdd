"""The compiled CPU executor: the step graph as one plan of numba kernels over packed weights.

Beside CpuExecutor (the numpy reference, the oracle and the fallback) and with its interface:
execute(step inputs) -> {logits name: [L, V]}. Weights stay in their checkpoint's quantised
blocks (runtime/cpu/packed.py: GGUF Q4_0/Q4_1/Q4_K/Q8_0/Q6_K re-tiled, float checkpoints as f32
tiles); activations live in one arena (runtime/cpu/arena.py) that a step's plan
(runtime/cpu/plan.py) reads and writes with compiled kernels. Kernels compile once per machine
and are cached on disk by numba (`cache=True`); `warm_up` compiles (or loads) every kernel the
plan uses, reporting each, so the first step of a server does not stall.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Mapping

import ml_dtypes
import numpy as np

from kiln.errors import ConfigError, InvalidModelError
from kiln.graph import Graph, to_numpy
from kiln.graph.layout import stack_parts
from kiln.runtime.cpu.linear import GEMM_MIN_TOKENS
from kiln.runtime.cpu.packed import BLOCKS, PackedWeight, pack_float, pack_gguf
from kiln.runtime.cpu.plan import NotCompilable, Plan, StepContext, check_graph
from kiln.runtime.worker.cpu_executor import CpuExecutor, committed_zeros

WeightLoader = Callable[[str], np.ndarray]
# name -> (GGUF block type name, raw rows u8 [N, row_bytes]) or None where not stored in blocks
QuantizedLoader = Callable[[str], "tuple[str, np.ndarray] | None"]
LINEAR_OPS = ("linear", "linear_add", "linear_silu_mul", "linear_rope")


def cpu_threads() -> int | None:
    """KILN_CPU_THREADS, else None (every core numba sees, or one: ThreadChooser)."""
    import numba

    v = os.environ.get("KILN_CPU_THREADS")
    if v is None:
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"KILN_CPU_THREADS={v!r} is not a positive integer")
    return min(n, numba.config.NUMBA_NUM_THREADS)


def cpu_act_quant() -> str:
    """KILN_CPU_ACT_QUANT: "q8_1" rounds the activations of Q4 linears to q8_1 blocks as llama.cpp
    does (runtime/cpu/linear.py), unset or "none" keeps them f32 (the numpy target's semantics)."""
    v = os.environ.get("KILN_CPU_ACT_QUANT", "none")
    if v not in ("none", "q8_1"):
        raise ConfigError(f"KILN_CPU_ACT_QUANT={v!r} is not 'none' or 'q8_1'")
    return "" if v == "none" else v


class ThreadChooser:
    """How many threads decode steps use when KILN_CPU_THREADS does not say: all cores, unless one
    thread has been faster lately. On the 2-core machine with other work on it, every parallel
    loop waited for a core another process held: at load average ~11 a SmolLM2 decode step took
    1.7 s on two threads and 62 ms on one (2026-12-07, issue 43; every GEMV is parallel), while on
    quiet cores two threads win (the sum of the kernels' minimum times 13.9 -> 8.1 ms). So now and
    then a step runs with the other count, and the count whose recent time per token is lower runs
    the rest: a probe that loses doubles the gap to the next one (probe_every, 2x, ... up to
    max_gap steps: a 27x slower probe every 16 steps had made decode 3x slower than one thread),
    a probe that wins makes its count the one that runs. The running count's time is an
    exponential average; a probe's is its own measurement (the last one, minutes old, says
    little). While other processes keep more than cores - 0.5 cores busy (the 1-minute load
    average less the threads this executor runs), all cores are neither started with nor probed:
    one such probe cost as much as 20 steps on one thread, at load average 10.6 four of them took a
    third of a 128-token decode. The margin lets a peer benchmark run just before (two threads for
    30 s lift the 1-minute average by ~0.8) leave two threads to kiln on an otherwise idle machine."""

    def __init__(self, cores: int, probe_every: int = 16, max_gap: int = 512,
                 load: Callable[[], float] = lambda: os.getloadavg()[0]) -> None:
        self.cores, self.probe_every, self.max_gap, self.load = cores, probe_every, max_gap, load
        self.ema: dict[int, float] = {}
        self.best = cores
        self.steps = 0
        self.gap = probe_every
        self.next_probe = probe_every
        self.probing = False

    def _busy(self) -> bool:
        return self.load() - self.best > self.cores - 0.5

    def pick(self) -> int:
        if self.cores == 1:
            return 1
        self.steps += 1
        if self.steps == 1 and self._busy():
            self.best = 1
        other = 1 if self.best == self.cores else self.cores
        due = (other not in self.ema and self.steps > 1) or self.steps >= self.next_probe
        if due and other == self.cores and self._busy():
            self.next_probe = self.steps + self.gap  # ask again later
            return self.best
        if due:
            self.probing = other in self.ema  # else the other count's first measurement
            return other
        return self.best

    def record(self, threads: int, seconds_per_token: float) -> None:
        old = self.ema.get(threads)
        fresh = old is None or self.probing or threads != self.best
        self.ema[threads] = seconds_per_token if fresh else 0.7 * old + 0.3 * seconds_per_token
        self.best = min(self.ema, key=self.ema.get)
        if self.probing:
            self.probing = False
            self.gap = self.probe_every if self.best == threads else min(2 * self.gap, self.max_gap)
            self.next_probe = self.steps + self.gap


class CompiledCpuExecutor:
    def __init__(self, graph: Graph, load_weight: WeightLoader, num_blocks: int, num_state_slots: int = 0,
                 load_quantized: QuantizedLoader | None = None, load_stored: WeightLoader | None = None) -> None:
        graph.verify()
        check_graph(graph)  # NotCompilable before any weight is read
        import numba

        fixed = cpu_threads()
        self.threads = fixed or numba.config.NUMBA_NUM_THREADS
        self.chooser = ThreadChooser(self.threads)
        self.auto_threads = fixed is None
        numba.set_num_threads(self.threads)
        self.graph = graph
        self.num_blocks = num_blocks
        self.num_state_slots = 0
        packed = {n.inputs[1] for n in graph.nodes.values() if n.op in LINEAR_OPS}
        packed |= {n.inputs[1] for n in graph.nodes.values() if n.op == "embedding"}
        self.weights: dict[str, PackedWeight | np.ndarray] = {}
        for t in graph.weights:
            self.weights[t.name] = (self._pack(t, load_stored or load_weight, load_quantized) if t.name in packed
                                    else CpuExecutor._load(t, load_weight))
        dims = {"NB": num_blocks}
        self.states = {t.name: committed_zeros(t.concrete_shape(dims), np.float32) for t in graph.states}
        self.act_quant = cpu_act_quant()
        self.plan = Plan(graph, self.weights, self.states, self.act_quant)
        self._vocab = {n.inputs[0]: graph.tensors[n.inputs[1]].shape[0]
                       for n in graph.nodes.values() if n.op == "embedding"}
        self._max_pos = min([int(n.attrs.get("max_position", 2048)) for n in graph.nodes.values()
                             if n.op in ("linear_rope", "attention_preamble")] or [1 << 30])
        # The sampler's top-k / top-p / race compiled too (runtime/cpu/sample_kernels.py); the model
        # runner hands it to its Sampler. Its rows run on KILN_CPU_THREADS threads, else on the
        # count its own ThreadChooser finds faster for them.
        from kiln.runtime.cpu.sample_kernels import CompiledSampler

        self.compiled_sampler = (CompiledSampler(chooser=ThreadChooser(self.threads)) if self.auto_threads
                                 else CompiledSampler(threads=lambda: self.threads))

    @staticmethod
    def _pack(t, load_weight: WeightLoader, load_quantized: QuantizedLoader | None) -> PackedWeight:
        """load_weight: the stored dtype where the caller can give it (a bf16 weight stays bf16)"""
        names = [p for p, _ in t.parts] or [t.name]
        raws = [load_quantized(p) for p in names] if load_quantized else [None]
        kinds = {r[0] if r else None for r in raws}
        if len(kinds) == 1 and next(iter(kinds)) in BLOCKS:
            kind = next(iter(kinds))
            raw = stack_parts([r[1] for r in raws], t.interleave) if t.parts else raws[0][1]
            if raw.shape[0] != t.shape[0]:
                raise InvalidModelError(f"weight {t.name!r} has {raw.shape[0]} rows, the config implies {t.shape[0]}")
            return pack_gguf(kind, raw, int(t.shape[1]))
        # float checkpoints, other GGUF block types, or parts stored in different types: bf16 as
        # stored (widened in the kernels), anything else in f32 tiles
        stored = CpuExecutor._load_stored(t, load_weight)
        w = stored if stored.dtype == ml_dtypes.bfloat16 else np.ascontiguousarray(stored, dtype=to_numpy(t.dtype))
        return pack_float(w, source=",".join(sorted(str(k) for k in kinds)))

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())

    def copy_state_slots(self, copies) -> None:  # no recurrent state on this target
        if copies:
            raise NotCompilable("the compiled CPU target has no state slots")

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        inp = {t.name: np.ascontiguousarray(inputs[t.name], dtype=np.int32) for t in self.graph.inputs}
        for t in self.graph.inputs:
            if inp[t.name].ndim != t.rank:
                raise ValueError(f"step input {t.name} has rank {inp[t.name].ndim}, expected {t.rank}")
        for name, vocab in self._vocab.items():  # the kernels index without bounds checks
            ids = inp[name]
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise IndexError(f"token id out of range [0, {vocab}) in {name}")
        T = len(inp["input_ids"]) if "input_ids" in inp else len(inp["positions"])
        pos = inp.get("positions")
        if pos is not None and pos.size and (pos.min() < 0 or pos.max() >= self._max_pos):
            raise IndexError(f"position out of range [0, {self._max_pos})")
        L = len(inp["logits_indices"]) if "logits_indices" in inp else T
        qsl = inp["query_start_loc"]
        seq_of = np.repeat(np.arange(len(qsl) - 1, dtype=np.int32), np.diff(qsl))
        cap = max(16, 1 << (max(T, L) - 1).bit_length())
        sl = inp.get("seq_lens")
        ctx = StepContext(T, L, inp, seq_of, int(sl.max()) if sl is not None and sl.size else 0)
        fns = self.plan.bind(cap)
        # A step on the BLAS path leaves numba one thread: OpenBLAS's workers spin for a while
        # after each sgemm, and a parallel numba loop waiting on a core they hold took 25 ms for
        # an rms_norm (measured). Decode steps call no BLAS and use every thread.
        import numba

        decode = T < GEMM_MIN_TOKENS
        threads = 1 if not decode else self.chooser.pick() if self.auto_threads else self.threads
        numba.set_num_threads(threads)
        t0 = time.perf_counter()
        try:
            for fn in fns:
                fn(ctx)
        finally:
            numba.set_num_threads(self.threads)
        if decode and self.auto_threads:
            self.chooser.record(threads, (time.perf_counter() - t0) / T)
        out = {}
        for name in self.graph.outputs:
            base = self.plan._base(name)
            rows = L if self.plan.rows.get(name) == "L" else T
            out[name] = np.array(self.plan.buffer(base)[:rows])
        return out

    def warm_up(self, progress: Callable[[str], None] = lambda s: None, block_size: int = 16) -> float:
        """Compile (or load from numba's disk cache) every kernel the plan calls, by running one
        decode-sized and one prefill-sized step that write no KV slot. Kernels compiled now
        (not read from numba's cache) are reported through `progress` as they finish, after a first
        line saying what is happening, and then the total. -> seconds taken."""
        t0 = time.perf_counter()
        seen: set = set()
        todo = [k for s in self.plan.steps for k in s.kernels if not (k in seen or seen.add(k))]
        done: set = set()
        compiled = 0
        for T in (1, GEMM_MIN_TOKENS):
            nb = -(-T // block_size)
            if nb > self.num_blocks:
                continue
            step = {"input_ids": np.zeros(T, np.int32), "positions": np.arange(T, dtype=np.int32),
                    "slot_mapping": np.full(T, -1, np.int32), "block_table": np.arange(nb, dtype=np.int32)[None],
                    "seq_lens": np.array([T], np.int32), "query_start_loc": np.array([0, T], np.int32),
                    "logits_indices": np.array([T - 1], np.int32)}
            ctx = StepContext(T, 1, step, np.zeros(T, np.int32))
            for s, fn in zip(self.plan.steps, self.plan.bind(max(16, T))):
                t1 = time.perf_counter()
                fn(ctx)
                dt = time.perf_counter() - t1
                new = [k for k in s.kernels if k not in done]
                done.update(new)
                if any(k.stats.cache_misses for k in new):  # compiled now, not read from the cache
                    if not compiled:
                        progress(f"compiling {len(todo)} CPU kernels for this machine (first run only: "
                                 "numba caches them on disk)")
                    compiled += len(new)
                    progress(f"  {', '.join(k.__name__ for k in new)} ({len(done)}/{len(todo)}, {dt:.1f} s)")
        first = compiled == 0
        sampler = []  # the sampler's kernels: reported (as one) only when compiled now
        self.compiled_sampler.warm_up(sampler.append)
        if sampler:
            if first:
                progress("compiling the sampler's CPU kernels for this machine (first run only)")
            compiled += 1
            for line in sampler:
                progress(line)
        total = time.perf_counter() - t0
        if compiled:
            progress(f"CPU kernels ready in {total:.1f} s")
        return total
