"""GpuSampler: the sampler on the logits rows a step's plan left in device memory.

The numpy Sampler (runtime/sample/sampler.py) is the semantic reference; this runs the same
steps with the bundle's sampling kernels (manifest["sampler"], compiled from
codegen/triton/sampling.py), on the executor's stream, right after the plan:

  upload    one pinned host buffer -> one async copy, on the side stream "in" (the main
            stream waits for it by an event): row indices, per-row knobs and Philox keys,
            the CSR processor entries (runtime/sample/sampler_inputs.py), prompt logprob rows and
            targets; skipped when the device copy holds those bytes already
  bitmask   the constrained rows' grammar masks (llguidance's packed bits, computed on the host
            while the step's model launches run) applied in place, before anything reads the rows
  copy_rows raw copies of the sampled rows, only when some row wants logprobs (the
            processors below work in place; vLLM computes raw logprobs before them too)
  logprobs  prompt-logprob rows (raw: the processors never touch them)
  processors, sample, then logprobs of the sampled tokens on the raw copies
  download  one copy back, on the side stream "out" behind an event after the kernels (the
            next step's kernels need not queue behind it): the sampled ids, plus the
            logprobs tensors when asked

sample() is launch() then collect(). Under async scheduling the model runner launches a
step, queues the next one (its input ids fed from this step's sampled ids on the device by
the executor's stage kernel, runtime/worker/input_stager.py), and only then collects: two steps'
pinned buffers are in use at a time.

Top-k logprobs beyond MAX_TOP_LOGPROBS (logprobs=-1 asks for the whole vocabulary)
are gathered on the host from downloaded raw rows instead: the kernel's top-K is K
passes over the row.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kiln.runtime.sample.phases import PHASE_TOKEN, sample_phases, sample_scratch
from kiln.runtime.sample.sampler import LogprobsTensors, SamplerOutput, compute_logprobs, gather_logprobs
from kiln.runtime.sample.sampler_inputs import SamplerInputs, row_seeds
from kiln.runtime.sample.metadata import SamplingMetadata

MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
_ALIGN = 64  # every staged array starts 16-byte aligned (the kernels' divisibility hints) and then some
_CTYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "fp32": ctypes.c_float}


@dataclass(frozen=True)
class PromptJob:
    """Prompt logprobs of one chunk: logits rows first_row.. score targets (the next prompt tokens)."""
    first_row: int
    targets: np.ndarray  # i32[n]
    k: int  # top logprobs wanted; the vocabulary size for -1


class _Pinned:
    """A pinned host buffer and its device twin, grown on demand. Growing keeps the old
    pinned block until the context closes (CudaContext frees host memory only then); sizes
    double, so that is less than the final size again."""

    def __init__(self, ctx, nbytes: int = 1 << 16) -> None:
        self.ctx, self.cap = ctx, 0
        self.host, self.dev = None, 0
        self.on_dev: bytes | None = None  # what the last upload left at dev (no kernel writes it)
        self.reserve(nbytes)

    def reserve(self, nbytes: int) -> None:
        if nbytes <= self.cap:
            return
        cap = max(nbytes, 2 * self.cap)
        if self.dev:
            self.ctx.free(self.dev)  # its last step is complete (GpuSampler._claim waited for it)
        self.host, self.dev, self.cap = self.ctx.host_alloc(cap), self.ctx.malloc(cap), cap
        self.on_dev = None

    def upload(self, nbytes: int, stream=None) -> bool:
        """host[:nbytes] -> dev on `stream`, unless dev holds those bytes already: a steady
        decode batch stages the same rows and knobs step after step, and each copy was a
        copy-engine round trip between the graph and the next (~2.6 us of the batch-1 step's
        ~33 us between graphs on the H200, bench/engine_timeline.py). The buffer's last step is
        complete when it is restaged (GpuSampler._claim), and kernels only read it. -> whether
        a copy was queued (the caller orders its readers after it)."""
        staged = self.host[:nbytes].tobytes()
        if staged == self.on_dev:
            return False
        self.ctx.upload(self.dev, self.host[:nbytes], sync=False, stream=stream)
        self.on_dev = staged
        return True


@dataclass
class SampleHandle:
    """A GpuSampler.launch() queued on the stream and not yet read back (collect)."""
    slot: int
    B: int
    k: Optional[int]
    gpu_k: bool
    kp: int
    gpu_kp: bool
    o_off: dict
    host: np.ndarray  # the pinned bytes the copy back lands in
    prompt: list
    on_gpu: list
    p_out: list
    ids_dev: int  # i32[B] on the device: the sampled ids, the next step's feed source
    host_gather: bool  # logprobs gathered from raw rows on the host: collect before the next launch


def _layout(specs: dict[str, tuple[np.dtype, int]]) -> tuple[dict[str, int], int]:
    """name -> byte offset for arrays of (dtype, count), each aligned; and the total."""
    offs, off = {}, 0
    for name, (dtype, n) in specs.items():
        offs[name] = off
        off += -(-np.dtype(dtype).itemsize * int(n) // _ALIGN) * _ALIGN
    return offs, off


class GpuSampler:
    def __init__(self, ctx, manifest: dict, kernels: dict, logits_ptr: int, seed: Optional[int] = None) -> None:
        self.ctx = ctx
        self.vocab = int(manifest["logits"]["vocab"])
        self.logits_ptr = logits_ptr  # f32[L, V] rows of the last step, in the arena
        self._rng = np.random.default_rng(seed)  # keys of unseeded rows (the numpy Sampler's only state)
        self._roles = {role: (kernels[s["kernel"]], s["args"], manifest["kernels"][s["kernel"]]["signature"])
                       for role, s in manifest["sampler"].items()}
        # Two sets of pinned buffers (inputs, outputs), one per step in flight, each with
        # markers: behind its upload (on "in"), its kernels (main) and its copy back (on "out").
        self._ins, self._outs = ([_Pinned(ctx), _Pinned(ctx)] for _ in range(2))
        self._in, self._out = ctx.side_stream("in"), ctx.side_stream("out")
        self._uploaded, self._sampled, self._events = ([ctx.marker(), ctx.marker()] for _ in range(3))
        for e in self._events:
            ctx.record(e)
        self._pending: list[Optional[SampleHandle]] = [None, None]
        self._turn, self._claimed = 0, None
        self._raw, self._raw_rows = 0, 0  # f32[rows, V] raw copies of sampled rows
        # the sample kernel's programs per row and its scratch (runtime/sample/phases.py), grown on demand
        meta = manifest["sampler"]["sample"]
        self._sample_programs, self._sample_pad = int(meta["programs"]), int(meta["np_pad"])
        self._scratch, self._scratch_rows = 0, 0
        self._mask_programs = int(manifest["sampler"].get("bitmask", {}).get("programs", 0))

    # -- one step -------------------------------------------------------------------------
    def sample(self, rows: Sequence[int], md: Optional[SamplingMetadata], seeds: Sequence[Optional[int]] = (),
               prompt: Sequence[PromptJob] = (), bitmask=None
               ) -> tuple[Optional[SamplerOutput], list[Optional[LogprobsTensors]]]:
        """rows[b]: the logits row of sampled request b (md's row b); seeds[b]: its
        SamplingParams.seed; bitmask: the constrained rows' allowed tokens
        (structured_output_manager.GrammarBitmask: rows index `rows`) or None.
        -> (SamplerOutput or None without rows, prompt logprobs per job)."""
        return self.collect(self.launch(rows, md, seeds, prompt, bitmask))

    @property
    def can_mask(self) -> bool:
        """Whether the bundle has the grammar-mask kernel (bundles compiled before it have not)."""
        return "bitmask" in self._roles

    def launch(self, rows: Sequence[int], md: Optional[SamplingMetadata], seeds: Sequence[Optional[int]] = (),
               prompt: Sequence[PromptJob] = (), bitmask=None) -> "SampleHandle":
        """sample() up to the copy back, queued on the stream: -> a handle for collect(). Two
        steps may be in flight (each has its own pinned buffers); a third launch needs the
        first one collected. The sampled ids stay on the device at handle.ids_dev for
        the next step's inputs (runtime/worker/input_stager.py)."""
        B, V = len(rows), self.vocab
        if B and (md is None or md.batch_size != B or md.vocab_size != V):
            raise ValueError(f"{B} sampled rows over a vocabulary of {V} do not match the sampling metadata")
        k = md.max_num_logprobs if B else None
        gpu_k = k is not None and k <= MAX_TOP_LOGPROBS
        on_gpu = [i for i, j in enumerate(prompt) if j.k <= MAX_TOP_LOGPROBS]  # the rest: on the host
        kp = max((prompt[i].k for i in on_gpu), default=0)
        P = sum(len(prompt[i].targets) for i in on_gpu)
        gpu_kp = P > 0
        if bitmask is not None and not len(bitmask.rows):
            bitmask = None
        if bitmask is not None and not self.can_mask:
            raise ValueError("this bundle has no grammar-mask kernel for structured output: recompile it")

        slot = self._claim()
        staged, inp = self._stage(slot, rows, md, seeds, [prompt[i] for i in on_gpu], bitmask)
        out_specs = {"ids": (np.int32, max(B, 1))}
        if gpu_k:
            out_specs.update(lp_ids=(np.int32, B * (k + 1)), lp=(np.float32, B * (k + 1)), lp_rank=(np.int32, B * (k + 1)))
        if gpu_kp:
            out_specs.update(p_ids=(np.int32, P * (kp + 1)), p_lp=(np.float32, P * (kp + 1)),
                             p_rank=(np.int32, P * (kp + 1)))
        o_off, o_bytes = _layout(out_specs)
        ob = self._outs[slot]
        ob.reserve(o_bytes)
        out = {n: ob.dev + off for n, off in o_off.items()}
        stride = V

        if bitmask is not None:  # first: raw logprobs see the grammar's cut too, as in the numpy Sampler
            self._launch("bitmask", (len(bitmask.rows), self._mask_programs), logits_ptr=self.logits_ptr,
                         row_idx_ptr=staged["g_rows"], bits_ptr=staged["g_bits"], stride=stride,
                         W=bitmask.bits.shape[1])
        if k is not None:  # raw copies before the processors write the rows
            self._reserve_raw(B)
            self._launch("copy_rows", B, src_ptr=self.logits_ptr, row_idx_ptr=staged["rows"], dst_ptr=self._raw,
                         stride=stride)
        p_out: list[Optional[LogprobsTensors]] = [None] * len(prompt)
        for i, j in enumerate(prompt):
            if j.k > MAX_TOP_LOGPROBS and len(j.targets):
                p_out[i] = self._prompt_on_host(j)
        if gpu_kp:
            self._launch("logprobs", P, logits_ptr=self.logits_ptr, row_idx_ptr=staged["p_rows"],
                         tok_ptr=staged["p_tok"], tok_idx_ptr=staged["iota"], ids_ptr=out["p_ids"],
                         lp_ptr=out["p_lp"], rank_ptr=out["p_rank"], stride=stride, K=kp)
        if B:
            if "start" in staged:
                self._launch("processors", B, logits_ptr=self.logits_ptr, row_idx_ptr=staged["rows"],
                             start_ptr=staged["start"], tok_ptr=staged["tok"], bias_ptr=staged["bias"],
                             count_ptr=staged["count"], mode_ptr=staged["mode"], rep_ptr=staged["rep"],
                             freq_ptr=staged["freq"], pres_ptr=staged["pres"], stride=stride)
            val, idx, hist = self._reserve_sample(B)
            for phase in sample_phases(inp.temperature, inp.top_k, inp.top_p, V):
                self._launch("sample", (B, 1 if phase == PHASE_TOKEN else self._sample_programs),
                             logits_ptr=self.logits_ptr, row_idx_ptr=staged["rows"], temp_ptr=staged["temp"],
                             top_k_ptr=staged["top_k"], top_p_ptr=staged["top_p"], min_p_ptr=staged["min_p"],
                             seed_ptr=staged["seeds"], out_ptr=out["ids"], masked_ptr=out["ids"], val_ptr=val,
                             idx_ptr=idx, hist_ptr=hist, stride=stride, phase=phase)
        if gpu_k:
            self._launch("logprobs", B, logits_ptr=self._raw, row_idx_ptr=staged["iota"], tok_ptr=out["ids"],
                         tok_idx_ptr=staged["iota"], ids_ptr=out["lp_ids"], lp_ptr=out["lp"],
                         rank_ptr=out["lp_rank"], stride=stride, K=k)
        host = ob.host[:o_bytes]
        ctx = self.ctx
        ctx.record(self._sampled[slot])
        ctx.wait(self._sampled[slot], stream=self._out)
        ctx.download_async(ob.dev, host, stream=self._out)  # one copy back
        ctx.record(self._events[slot], stream=self._out)
        h = SampleHandle(slot, B, k, gpu_k, kp, gpu_kp, o_off, host, list(prompt), on_gpu, p_out, out["ids"],
                         host_gather=k is not None and not gpu_k)
        self._pending[slot], self._claimed, self._turn = h, None, slot ^ 1
        return h

    def collect(self, h: "SampleHandle") -> tuple[Optional[SamplerOutput], list[Optional[LogprobsTensors]]]:
        """Wait for a launch()'s copy back and read it: -> as sample()."""
        if self._pending[h.slot] is not h:
            raise RuntimeError("this sampling step was collected already, or its buffers were reused")
        self.ctx.event_sync(self._events[h.slot])
        self._pending[h.slot] = None
        B, k, o_off, host, prompt = h.B, h.k, h.o_off, h.host, h.prompt

        def view(name, dtype, shape):
            n = int(np.prod(shape))
            return host[o_off[name]: o_off[name] + n * np.dtype(dtype).itemsize].view(dtype).reshape(shape).copy()

        result = None
        if B:
            ids = view("ids", np.int32, (B,))
            lp = None
            if h.gpu_k:
                lp = LogprobsTensors(view("lp_ids", np.int32, (B, k + 1)), view("lp", np.float32, (B, k + 1)),
                                     view("lp_rank", np.int32, (B, k + 1)))
            elif k is not None:  # a row asked for more than the kernel's top-K: gather on the host
                raw = np.empty((B, self.vocab), np.float32)
                self.ctx.download(self._raw, raw)  # (a later launch would overwrite the raw rows)
                lp = gather_logprobs(compute_logprobs(raw), k, ids)
            result = SamplerOutput(sampled_token_ids=ids, logprobs=lp)
        p_out = h.p_out
        if h.gpu_kp:
            P = sum(len(prompt[i].targets) for i in h.on_gpu)
            kp = h.kp
            all_p = LogprobsTensors(view("p_ids", np.int32, (P, kp + 1)), view("p_lp", np.float32, (P, kp + 1)),
                                    view("p_rank", np.int32, (P, kp + 1)))
            start = 0
            for i in h.on_gpu:
                n, kk = len(prompt[i].targets), prompt[i].k
                # a job keeps its own top k: the batch's extra columns are dropped
                p_out[i] = LogprobsTensors(all_p.token_ids[start:start + n, :kk + 1],
                                           all_p.logprobs[start:start + n, :kk + 1],
                                           all_p.ranks[start:start + n, :kk + 1])
                start += n
        return result, p_out

    @property
    def can_feed(self) -> bool:
        """Whether the bundle can feed one step's sampled ids (handle.ids_dev) into the next
        step's input ids on the device: its stage kernel, which CudaExecutor launches."""
        return "stage" in self._roles

    def _claim(self) -> int:
        """The pinned buffers of the step being launched: their last user (two launches ago)
        must be collected, and its copies done before they are rewritten."""
        if self._claimed is None:
            slot = self._turn
            if self._pending[slot] is not None:
                raise RuntimeError("two sampling steps are in flight: collect the older one first")
            self.ctx.event_sync(self._events[slot])
            self._claimed = slot
        return self._claimed

    # -- pieces ---------------------------------------------------------------------------
    def _stage(self, slot: int, rows, md, seeds, gpu_prompt: Sequence[PromptJob],
               bitmask=None) -> tuple[dict[str, int], Optional[SamplerInputs]]:
        """Pack this step's inputs into the pinned buffer, one async upload -> (name: device
        pointer, the sampled rows' SamplerInputs or None without rows)."""
        B = len(rows)
        arrays: dict[str, np.ndarray] = {}
        inp = None
        if B:
            inp = SamplerInputs.from_metadata(md)
            steps = [len(t) for t in md.output_token_ids]
            seeds = list(seeds) if len(seeds) else [None] * B
            keys = row_seeds(seeds, steps, self._rng)  # drawn for every row: the generator's stream stays
            keys[np.asarray(inp.temperature) == 0] = 0  # a greedy row reads no key (sample_kernel), so its bytes hold still
            arrays.update(rows=np.asarray(rows, np.int32), temp=inp.temperature, top_k=inp.top_k, top_p=inp.top_p,
                          min_p=inp.min_p, seeds=keys)
            if inp.has_processors:
                arrays.update(start=inp.start, tok=inp.tok, bias=inp.bias, count=inp.count, mode=inp.mode,
                              rep=inp.repetition, freq=inp.frequency, pres=inp.presence)
        if bitmask is not None:  # the masked rows' logits rows, and their bits (i32[K, W] row-major)
            arrays.update(g_rows=np.asarray(rows, np.int32)[np.asarray(bitmask.rows)],
                          g_bits=np.ascontiguousarray(bitmask.bits, np.int32).reshape(-1))
        P = 0
        if gpu_prompt:
            arrays.update(p_rows=np.concatenate([j.first_row + np.arange(len(j.targets)) for j in gpu_prompt])
                          .astype(np.int32),
                          p_tok=np.concatenate([np.asarray(j.targets, np.int32) for j in gpu_prompt]))
            P = len(arrays["p_rows"])
        arrays["iota"] = np.arange(max(B, P, 1), dtype=np.int32)
        offs, nbytes = _layout({n: (a.dtype, a.size) for n, a in arrays.items()})
        ib = self._ins[slot]
        ib.reserve(nbytes)
        buf = ib.host
        for name, a in arrays.items():
            buf[offs[name]: offs[name] + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        if ib.upload(nbytes, stream=self._in):
            self.ctx.record(self._uploaded[slot], stream=self._in)
            self.ctx.wait(self._uploaded[slot])
        return {name: ib.dev + off for name, off in offs.items()}, inp

    def _prompt_on_host(self, j: PromptJob) -> LogprobsTensors:
        """Prompt logprobs with more top entries than the kernel's: download the job's rows
        (contiguous; called before the processors run, though they never touch these rows)."""
        raw = np.empty((len(j.targets), self.vocab), np.float32)
        self.ctx.download(self.logits_ptr + 4 * self.vocab * j.first_row, raw)
        return gather_logprobs(compute_logprobs(raw), j.k, np.asarray(j.targets))

    def _reserve_sample(self, rows: int) -> tuple[int, int, int]:
        """-> (val, idx, hist) device pointers of the sample kernel's scratch for `rows` rows.
        (Phase 0 clears the histograms a step uses, so the allocation needs no zeroing.)"""
        if rows > self._scratch_rows:
            if self._scratch:
                self.ctx.synchronize()  # the stream's earlier phases may still use the old one
                self.ctx.free(self._scratch)
            self._scratch_rows = max(rows, 2 * self._scratch_rows)
            nbytes = sample_scratch(self._scratch_rows, self._sample_pad)[2]
            self._scratch = self.ctx.malloc(nbytes)
        o_idx, o_hist, _ = sample_scratch(self._scratch_rows, self._sample_pad)
        return self._scratch, self._scratch + o_idx, self._scratch + o_hist

    def _reserve_raw(self, rows: int) -> None:
        if rows > self._raw_rows:
            if self._raw:
                self.ctx.free(self._raw)
            self._raw_rows = max(rows, 2 * self._raw_rows)
            self._raw = self.ctx.malloc(4 * self.vocab * self._raw_rows)

    def _launch(self, role: str, grid: int | tuple[int, int], **args) -> None:
        kernel, names, sig = self._roles[role]
        launch_named(self.ctx, kernel, grid, names, sig, **args)


def launch_named(ctx, kernel, grid: int | tuple[int, int], names: Sequence[str], sig: Sequence[str], **args) -> None:
    """One launch of a kernel recorded by argument names (a bundle's sampler roles) on ctx's
    main stream: args by name, typed by the kernel's signature."""
    vals, types = [], []
    for name, ty in zip(names, sig):
        vals.append(int(args[name]) if ty.startswith(("*", "i")) else float(args[name]))
        types.append(ctypes.c_void_p if ty.startswith("*") else _CTYPES[ty])
    hidden, hidden_types = kernel.hidden_args()  # these kernels need no global scratch
    vals += hidden
    types += hidden_types
    drv = ctx.drv
    gx, gy = grid if isinstance(grid, tuple) else (grid, 1)
    err, = drv.cuLaunchKernel(kernel.function, gx, gy, 1, 32 * kernel.num_warps, 1, 1, kernel.shared,
                              ctx.stream, (tuple(vals), tuple(types)), 0)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"launching {kernel.name} failed: {err}")
