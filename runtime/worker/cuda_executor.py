"""The CUDA executor: replays a bundle's launch plans with cuda.bindings.

At load: one context; weights uploaded (cast to the bundle's dtypes on the host);
constant tables, the activation arena, the step-input block and workspaces
allocated once and zeroed; the KV cache sized from free memory; every kernel's cubin
loaded; every bucket's launches resolved into ready (values, types) tuples by
relocating the plan's symbolic pointers (region << 44 | offset) to real ones.
Per step: pad to the smallest bucket that holds it, the step inputs staged and
copied in off the main stream (runtime/worker/input_stager.py), the bucket's launches
(decode buckets replay a CUDA graph captured on first use), then the GpuSampler on
the logits rows, or one device->host copy of the sampled rows' logits.

A tensor-parallel rank (issue 44) gets `nccl`, its group's bootstrap: the communicator is made
once the context is current, the plan's NCCL entries are bound to it and issued on the step's
stream between the kernels, and `region_values` fills the rank's own scalars (its first
vocabulary id). A decode bucket with NCCL calls runs eagerly the first time and is captured
the second: NCCL connects its channels lazily on a call's first use, which must not happen
inside a capture.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Mapping

import numpy as np

from kiln.errors import InvalidModelError
from kiln.graph import DType, to_numpy
from kiln.graph.layout import part_copies
from kiln.runtime.worker.bundle import Bundle, BundleError
from kiln.runtime.worker.cuda_driver import CudaContext
from kiln.runtime.worker.input_stager import InputStager

_CTYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "fp32": ctypes.c_float, "u8": ctypes.c_uint8,
           "i1": ctypes.c_bool}
ARCH_OF_TARGET = {"sm_90": 90, "sm_121": 121}


class CudaExecutor:
    def __init__(self, bundle: Bundle, load_weight: Callable[[str], np.ndarray], *, num_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, use_cuda_graphs: bool = True,
                 ctx: CudaContext | None = None, num_state_slots: int | None = None, nccl=None,
                 region_values: Mapping[str, np.ndarray] | None = None) -> None:
        """num_state_slots: a hybrid model's Gated DeltaNet state slots (the NS dim of its
        gdn_* states; slot 0 is the null slot), by default one per sequence the bundle runs at
        once plus the null one. They are allocated before the KV cache takes what is left.
        nccl: a tensor-parallel rank's NcclBootstrap (runtime/worker/nccl.py), required by a
        bundle whose plans hold NCCL calls; region_values: region name -> the bytes it starts
        with (after the zeroing), e.g. "tp_vocab_start"."""
        m = bundle.manifest
        tp = m.get("tensor_parallel")
        if tp and tp.get("collective") != "nccl":
            raise BundleError(f"this bundle's collectives are {tp.get('collective')!r} kernels, which no runtime "
                              "runs yet: recompile it (NCCL is the default)")
        if tp and (nccl is None or nccl.world_size != tp["world_size"]):
            raise BundleError(f"this bundle is a rank's plan in a {tp['world_size']}-GPU tensor-parallel group: "
                              f"load it with tensor_parallel_size {tp['world_size']}")
        self.ctx = ctx or CudaContext()
        self.comm = None
        if tp:
            from kiln.runtime.worker.nccl import NcclCommunicator

            self.comm = NcclCommunicator(nccl)
        want = ARCH_OF_TARGET.get(m["target"])
        if want != self.ctx.arch:
            raise BundleError(f"this bundle was compiled for {m['target']}, but the GPU is sm_{self.ctx.arch}: "
                              f"recompile with --target sm_{self.ctx.arch}")
        self.manifest = m
        self.block_size = m["block_size"]
        self.mb = m["max_blocks_per_seq"]
        self.use_cuda_graphs = use_cuda_graphs
        bases: dict[str, int] = {}
        for name, (dtype, shape, *stack) in m["weights"].items():  # stack: [parts] or [parts, interleave]
            bases[f"weight:{name}"] = self._upload_weight(load_weight, name, dtype, shape, *stack)
        for name, arr in bundle.consts.items():
            bases[f"const:{name}"] = self.ctx.to_device(arr)
        for name, nbytes in m["region_bytes"].items():  # zeroed: the split-KV merge counters must start at 0
            bases[name] = self.ctx.malloc(nbytes)
            self.ctx.memset(bases[name], nbytes)
        for name, arr in (region_values or {}).items():
            if name in bases:  # a region the plans read (a bundle without the op has none)
                self.ctx.upload(bases[name], np.ascontiguousarray(arr))
        slotted = {n: v for n, v in m["states"].items() if v[1][0] == "NS"}
        self.num_state_slots = (m["max_num_seqs"] + 1 if num_state_slots is None else num_state_slots) if slotted else 0
        for name, (dtype, shape) in slotted.items():
            nbytes = self.num_state_slots * to_numpy(DType(dtype)).itemsize * int(np.prod(shape[1:]))
            bases[f"state:{name}"] = self.ctx.malloc(nbytes)
            self.ctx.memset(bases[f"state:{name}"], nbytes)
        # (base, bytes of one slot) of each slotted state, for copy_state_slots
        self._slot_rows = [(bases[f"state:{n}"], to_numpy(DType(d)).itemsize * int(np.prod(shape[1:])))
                           for n, (d, shape) in slotted.items()]
        self.num_blocks = self._alloc_states({n: v for n, v in m["states"].items() if n not in slotted}, bases,
                                             num_blocks, gpu_memory_utilization)
        self.bases = bases
        self.kernels = {k: self.ctx.load_kernel(bundle.kernels[k], meta["name"], meta["num_warps"], meta["shared"],
                                                meta["n_hidden"], meta.get("global_scratch_size", 0),
                                                meta.get("pdl", False))
                        for k, meta in m["kernels"].items()}
        # One global scratch buffer for every launch that needs one (the GEMMs that build TMA
        # descriptors on the device): launches run one after another on one stream, so they
        # share it; sized for the largest grid of any plan.
        need = max((self.kernels[key].scratch_bytes(grid) for p in m["plans"].values()
                    for key, grid, _ in p["launches"] if key != "nccl"), default=0)
        self.scratch = self.ctx.malloc(need) if need else 0
        ptr_of = [bases[r] if r in bases else None for r in m["regions"]]
        self.plans = {name: self._resolve(p, ptr_of) for name, p in m["plans"].items()}
        self.buckets = sorted(self.plans.values(), key=lambda p: (p["tokens"], p["seqs"], not p["decode"]))
        # the step inputs: two pinned staging buffers used in turn, so that a step can be staged
        # while the one before is still queued; copied in on a side stream, put in place (and
        # fed the ids the step before sampled) by the stage kernel
        if "stage" not in m.get("sampler", {}):
            raise BundleError("this bundle has no stage kernel for the step inputs: recompile it")
        role = m["sampler"]["stage"]
        self.stager = InputStager(self.ctx, self.kernels[role["kernel"]], role, m["kernels"][role["kernel"]]["signature"],
                                  bases["inputs"], m["region_bytes"]["inputs"],
                                  max(p["tokens"] for p in self.plans.values()))
        self._views: dict[tuple[int, str], dict[str, np.ndarray]] = {}  # (buffer, bucket) -> input views
        self.logits_offset, self.vocab = m["logits"]["offset"], m["logits"]["vocab"]
        max_rows = max(p["logits"] for p in self.plans.values())
        self.host_logits = self.ctx.host_alloc(max_rows * self.vocab * 4).view(np.float32).reshape(max_rows, -1)
        self.graphs: dict[str, object] = {}
        self._warm: set[str] = set()  # decode buckets with NCCL calls run once eagerly (see the module doc)

    # -- load ---------------------------------------------------------------------------
    def _upload_weight(self, load_weight, name: str, dtype: str, shape, parts: list | None = None,
                       interleave: int = 0) -> int:
        """One device buffer per weight; a stacked weight (merged q/k/v, gate/up) gets its
        parts copied in where graph/layout.py's part_copies puts them: at their row offsets, or
        interleaved in groups of `interleave` rows (the gate/up GEMM's SwiGLU epilogue) by one
        strided 2-D copy per part. No stacked host copy is ever made."""
        if not parts:
            return self.ctx.to_device(self._weight(load_weight, name, dtype, shape))
        rows = [r for _, r in parts]
        if sum(rows) != shape[0]:
            raise BundleError(f"the parts of {name!r} have {sum(rows)} rows, the bundle says {shape[0]}")
        row_bytes = to_numpy(DType(dtype)).itemsize * int(np.prod(shape[1:]))
        ptr = self.ctx.malloc(row_bytes * shape[0])
        for (part, r), (dst, chunk, chunks, pitch) in zip(parts, part_copies(rows, interleave)):
            arr = self._weight(load_weight, part, dtype, [r, *shape[1:]])
            if chunks == 1:
                self.ctx.upload(ptr + dst * row_bytes, arr)
            else:
                self.ctx.upload_2d(ptr + dst * row_bytes, arr, width=chunk * row_bytes, height=chunks,
                                   dst_pitch=pitch * row_bytes)
        return ptr

    @staticmethod
    def _weight(load_weight, name: str, dtype: str, shape) -> np.ndarray:
        try:
            arr = load_weight(name)
        except KeyError:
            raise InvalidModelError(f"weight {name!r} is missing from the model files") from None
        if list(arr.shape) != list(shape):
            raise InvalidModelError(f"weight {name!r} has shape {list(arr.shape)}, the bundle expects {shape}")
        return np.ascontiguousarray(arr.astype(to_numpy(DType(dtype)), copy=False))

    def _alloc_states(self, states: Mapping, bases: dict, num_blocks: int | None, util: float) -> int:
        per_block = 0
        for dtype, shape in states.values():
            per_block += to_numpy(DType(dtype)).itemsize * int(np.prod([d for d in shape[1:]]))
        if num_blocks is None:
            free, total = self.ctx.mem_info()
            budget = free - (1 - util) * total
            num_blocks = int(budget // per_block)
            if num_blocks < 2:
                raise BundleError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free)")
        for name, (dtype, shape) in states.items():
            nbytes = num_blocks * to_numpy(DType(dtype)).itemsize * int(np.prod(shape[1:]))
            bases[f"state:{name}"] = self.ctx.malloc(nbytes)
            self.ctx.memset(bases[f"state:{name}"], nbytes)
        return num_blocks

    def _resolve(self, plan: dict, ptr_of: list) -> dict:
        t, s, l_, decode = plan["bucket"]
        launches = []
        for key, grid, args in plan["launches"]:
            if key == "nccl":  # (an NCCL call, None grid, the bound call, None)
                launches.append((NcclLaunch(args["op"]), None, self._nccl_call(args, ptr_of), None))
                continue
            kernel = self.kernels[key]
            sig = self.manifest["kernels"][key]["signature"]
            vals, types = [], []
            for ty, a in zip(sig, args):
                if ty.startswith("*"):
                    vals.append(ptr_of[a[0]] + a[1])
                    types.append(ctypes.c_void_p)
                else:
                    vals.append(a)
                    types.append(_CTYPES[ty])
            hidden, hidden_types = kernel.hidden_args(self.scratch)
            vals += hidden
            types += hidden_types
            g = tuple(grid) + (1,) * (3 - len(grid))
            # PDL kernels overlap their predecessor's tail (codegen/triton/pdl.py); a plan's
            # first launch reads the inputs the stage kernel writes, and goes out plainly
            # and so does a launch behind an NCCL call (NCCL's kernel does not signal PDL)
            cfg = self.ctx.pdl_config(kernel, g) if kernel.pdl and launches and launches[-1][1] is not None else None
            launches.append((kernel, g, (tuple(vals), tuple(types)), cfg))
        return {"tokens": t, "seqs": s, "logits": l_, "decode": decode, "inputs": plan["inputs"],
                "launches": launches, "name": f"{'d' if decode else 'm'}{t}x{s}",
                "nccl": any(g is None for _, g, _, _ in launches)}

    def _nccl_call(self, args: dict, ptr_of: list):
        """A plan's NCCL entry bound to this rank's communicator, buffers and stream."""
        from kiln.runtime.worker.nccl import nccl_dtype, nccl_op

        send, recv = (ptr_of[args[k][0]] + args[k][1] for k in ("send", "recv"))
        lib, comm, stream = self.comm.lib, self.comm.comm, int(self.ctx.stream)
        dtype, count = nccl_dtype(args["dtype"]), int(args["count"])
        if args["op"] == "all_reduce":
            op = nccl_op(args.get("red", "sum"))
            return lambda: lib.all_reduce(send, recv, count, dtype, op, comm, stream)
        if args["op"] == "all_gather":
            return lambda: lib.all_gather(send, recv, count, dtype, comm, stream)
        raise BundleError(f"this bundle's plan holds an NCCL {args['op']!r}, which this kiln does not run")

    # -- one step -----------------------------------------------------------------------
    def _pick(self, t: int, s: int, l_: int) -> dict:
        decode = t == s == l_
        for p in self.buckets:
            if t <= p["tokens"] and s <= p["seqs"] and l_ <= p["logits"] and (decode or not p["decode"]):
                return p
        raise ValueError(f"no compiled bucket holds a step of {t} tokens and {s} sequences "
                         f"(largest: {self.buckets[-1]['tokens']} tokens)")

    def _stage(self, p: dict, inputs: Mapping[str, np.ndarray]) -> int:
        """Write the step's inputs into the stager's next pinned buffer, once the copy that last
        read it has run. -> bytes to copy in."""
        buf, turn = self.stager.buffer(), self.stager.turn
        s_live = len(inputs["seq_lens"])
        views = self._views.get((turn, p["name"]))
        if views is None:  # the bucket's input arrays in this staging buffer, made once
            views = self._views[(turn, p["name"])] = {
                name: buf[off: off + 4 * int(np.prod(shape))].view(np.int32).reshape(shape)
                for name, (off, shape) in p["inputs"].items()}

        def put(name: str, arr: np.ndarray, fill: int) -> None:
            view = views[name]
            view[...] = fill
            view[tuple(slice(0, d) for d in arr.shape)] = arr
        put("input_ids", inputs["input_ids"], 0)
        put("positions", inputs["positions"], 0)
        put("slot_mapping", inputs["slot_mapping"], -1)  # padded tokens write nothing
        bt = inputs["block_table"]
        if bt.shape[1] > self.mb:
            raise ValueError(f"a sequence needs {bt.shape[1]} blocks; the bundle allows {self.mb}")
        put("block_table", bt, 0)
        put("seq_lens", inputs["seq_lens"], 0)
        qsl = inputs["query_start_loc"]
        put("query_start_loc", qsl, int(qsl[s_live]))  # padded sequences are empty
        put("logits_indices", inputs["logits_indices"], 0)
        if "state_slots" in views:  # a hybrid's: padded sequences have none
            put("state_slots", inputs["state_slots"], -1)
        put("num_logits", np.array([len(inputs["logits_indices"])], np.int32), 0)
        off, shape = p["inputs"]["num_logits"]
        return off + 4

    def copy_state_slots(self, copies) -> None:
        """A hybrid model's state-slot copies (source, destination), in order, in every Gated
        DeltaNet state: device copies queued on the step stream, so they run after the steps
        queued before and ahead of the next one's launches (prefix-cache snapshots)."""
        for src, dst in copies:
            for base, row in self._slot_rows:
                self.ctx.copy(base + dst * row, base + src * row, row)

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        l_ = len(inputs["logits_indices"])
        self._launch_step(inputs)
        ctx = self.ctx
        if l_:
            ctx.download(self.bases["arena"] + self.logits_offset, self.host_logits[:l_])
        else:
            ctx.synchronize()
        return {"logits": self.host_logits[:l_].copy()}  # the pinned rows are reused next step

    # -- sampling on the device: the logits rows never cross to the host ----------------------
    def bind_thread(self) -> None:
        """Called once on a thread that will run steps (runtime/engine/core.py's worker thread under
        async scheduling): the context must be current there. cuda-bindings releases the GIL
        in its driver calls, so a step's synchronize lets the scheduler's thread run."""
        self.ctx.make_current()

    def make_sampler(self, seed: int | None = None):
        """A GpuSampler over this executor's logits rows (runtime/sample/gpu_sampler.py); None for a
        bundle compiled before the sampling kernels were part of bundles."""
        if "sampler" not in self.manifest:
            return None
        from kiln.runtime.sample.gpu_sampler import GpuSampler

        return GpuSampler(self.ctx, self.manifest, self.kernels, self.bases["arena"] + self.logits_offset, seed=seed)

    def execute_and_sample(self, inputs: Mapping[str, np.ndarray], sampler, rows, metadata, seeds=(), prompt=(),
                           bitmask=None):
        """One step whose logits stay on the device: the bucket's plan as in execute(), then
        `sampler` (make_sampler) on the same stream over logits rows `rows`; only the sampled
        ids (and the logprobs asked for) come back. -> GpuSampler.sample's result. metadata: the
        SamplingMetadata, or a function giving it, called once the step's launches are queued;
        bitmask likewise (the grammar masks, computed on the host while the GPU runs the model)."""
        self._launch_step(inputs)
        return sampler.sample(rows, _resolved(metadata), seeds, prompt, _resolved(bitmask))

    def launch_and_sample(self, inputs: Mapping[str, np.ndarray], sampler, rows, metadata, seeds=(), prompt=(),
                          feed=None, bitmask=None):
        """execute_and_sample without waiting: -> the GpuSampler handle to collect. feed:
        (handle of the step before, its sampled rows, token positions in this step's
        input_ids): those input ids are the ids that step sampled, put in on the device by the
        stage kernel (runtime/worker/input_stager.py; the host staged placeholders there)."""
        self._launch_step(inputs, feed=feed)
        return sampler.launch(rows, _resolved(metadata), seeds, prompt, _resolved(bitmask))

    def _launch_step(self, inputs: Mapping[str, np.ndarray], feed=None) -> None:
        """execute() up to the logits download: stage, upload, the bucket's launches (or graph)."""
        t, s, l_ = len(inputs["input_ids"]), len(inputs["seq_lens"]), len(inputs["logits_indices"])
        p = self._pick(t, s, l_)
        nbytes = self._stage(p, {k: np.asarray(v, dtype=np.int32) for k, v in inputs.items()})
        ctx = self.ctx
        if feed is not None:
            prev, src_idx, dst_idx = feed
            feed = (prev.ids_dev, src_idx, dst_idx)
        self.stager.put(nbytes, p["inputs"]["input_ids"][0], p["tokens"], feed)
        if p["decode"] and self.use_cuda_graphs and p["nccl"] and p["name"] not in self._warm:
            self._warm.add(p["name"])  # NCCL's lazy set-up for these calls happens now, not under capture
            self._launch_all(p)
        elif p["decode"] and self.use_cuda_graphs:
            graph = self.graphs.get(p["name"])
            if graph is None:
                ctx.begin_capture()
                self._launch_all(p)
                graph = self.graphs[p["name"]] = ctx.end_capture()
            ctx.replay(graph)
        else:
            self._launch_all(p)

    def _launch_all(self, p: dict) -> None:
        drv, stream = self.ctx.drv, self.ctx.stream
        for kernel, g, params, cfg in p["launches"]:
            if g is None:  # an NCCL call on the stream
                params()
            elif cfg is None:
                err, = drv.cuLaunchKernel(kernel.function, g[0], g[1], g[2], 32 * kernel.num_warps, 1, 1,
                                          kernel.shared, stream, params, 0)
            else:
                err, = drv.cuLaunchKernelEx(cfg, kernel.function, params, 0)
            if err != drv.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"launching {kernel.name} failed: {err}")

    def profile(self, inputs: Mapping[str, np.ndarray], reps: int = 5) -> tuple[list[tuple[str, float]], float]:
        """Time every launch of the step's bucket: -> ([(kernel grid, us)] in plan order, us of
        the bucket as one CUDA graph). Launches go out eagerly with an event between each,
        queued behind a replay of the step's graph so the host never starves the GPU; the
        events add a little time per launch, the plain graph's time is the truth."""
        t, s, l_ = len(inputs["input_ids"]), len(inputs["seq_lens"]), len(inputs["logits_indices"])
        p = self._pick(t, s, l_)
        nbytes = self._stage(p, {k: np.asarray(v, dtype=np.int32) for k, v in inputs.items()})
        ctx, drv = self.ctx, self.ctx.drv
        self.stager.put(nbytes, p["inputs"]["input_ids"][0], p["tokens"])
        ctx.synchronize()
        ctx.begin_capture()
        self._launch_all(p)
        plain = ctx.end_capture()
        events = [ctx.event() for _ in range(len(p["launches"]) + 1)]
        per, whole = np.zeros(len(p["launches"])), []
        for _ in range(reps):
            a, b = ctx.event(), ctx.event()
            ctx.record(a)
            ctx.replay(plain)
            ctx.record(b)
            ctx.replay(plain)  # keeps the GPU busy while the host queues the launches below
            ctx.record(events[0])
            for i, (kernel, g, params, _) in enumerate(p["launches"]):  # plainly: events sit between
                if g is None:
                    params()
                else:
                    drv.cuLaunchKernel(kernel.function, g[0], g[1], g[2], 32 * kernel.num_warps, 1, 1,
                                       kernel.shared, ctx.stream, params, 0)
                ctx.record(events[i + 1])
            ctx.synchronize()
            whole.append(ctx.elapsed_ms(a, b) * 1000)
            per += [ctx.elapsed_ms(events[i], events[i + 1]) * 1000 for i in range(len(per))]
        names = [f"{k.name}{list(g or ())}" for k, g, *_ in p["launches"]]
        return list(zip(names, (per / reps).tolist())), float(np.median(whole))

    def close(self) -> None:
        if self.comm is not None:
            self.ctx.synchronize()
            self.comm.close()
            self.comm = None
        self.ctx.close()


class NcclLaunch:
    """Stands where a plan's kernel would for an NCCL call (its name, for profiles)."""

    def __init__(self, op: str) -> None:
        self.name = f"nccl_{op}"


def _resolved(metadata):
    """A step's sampling metadata, built now if the caller passed a function that builds it
    (ModelRunner: so that the host builds it while the GPU runs the step's launches)."""
    return metadata() if callable(metadata) else metadata
