"""The CPU executor: runs a step Graph with the numpy reference of every op.

It holds the weights (cast once to the graph's dtype) and the persistent state
(the paged KV cache), binds the symbolic dims of each step from the input
arrays, and frees activations after their last use so a long prefill does not
keep every layer's temporaries alive.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from kiln.errors import InvalidModelError
from kiln.graph import Graph, TensorKind, to_numpy
from kiln.graph.collective_ops import COLLECTIVE_OPS
from kiln.graph.layout import stack_parts
from kiln.graph.op import run_reference

WeightLoader = Callable[[str], np.ndarray]


def committed_zeros(shape, dtype) -> np.ndarray:
    """A zeroed array whose every page is written now. np.zeros of a large shape is a fresh
    anonymous mapping the kernel backs page by page on first touch, so a paged KV cache made
    with it grew the engine's RSS by one block each time the allocator handed out a block
    never used before (0.70 MiB a request on SmolLM2, up to the whole cache after ~4,100
    requests: docs/BENCHMARKS.md, issue 42's soak). Written here, the cache is resident from
    the start, as a GPU cache is allocated and owned up front, and a host that cannot hold it
    fails at start rather than mid-run. (vLLM's CPU cache is torch.zeros, whose fill writes
    every page too: vllm/v1/worker/gpu_model_runner.py _allocate_kv_cache_tensors, which its
    CPU model runner inherits.)"""
    arr = np.empty(shape, dtype)
    arr.fill(0)
    return arr


class CpuExecutor:
    def __init__(self, graph: Graph, load_weight: WeightLoader, num_blocks: int, num_state_slots: int = 0,
                 comm=None) -> None:
        """num_state_slots: a hybrid model's per-request state slots (the `NS` dim of its
        Gated DeltaNet states; 0 for a graph without them). comm: a tensor-parallel rank's
        communicator (runtime/worker/shm_communicator.py), which runs the graph's collectives."""
        graph.verify()
        self.graph = graph
        self.comm = comm
        self.order = graph.topo_order()
        self.num_blocks = num_blocks
        self.num_state_slots = num_state_slots if any("NS" in t.shape for t in graph.states) else 0
        self.weights = {t.name: self._load(t, load_weight) for t in graph.weights}
        dims = {"NB": num_blocks, "NS": num_state_slots}
        self.states = {t.name: committed_zeros(t.concrete_shape(dims), to_numpy(t.dtype)) for t in graph.states}
        self._last_use = self._compute_last_use()

    @staticmethod
    def _load(t, load_weight: WeightLoader) -> np.ndarray:
        return np.ascontiguousarray(CpuExecutor._load_stored(t, load_weight), dtype=to_numpy(t.dtype))

    @staticmethod
    def _load_stored(t, load_weight: WeightLoader) -> np.ndarray:
        """A weight as the checkpoint stores it (its parts stacked), shape-checked."""
        try:
            # a stacked weight (passes/merge_parallel_linears.py) is its parts along axis 0, in
            # groups of t.interleave rows where the SwiGLU fusion asked (graph/layout.py)
            arr = (stack_parts([load_weight(p) for p, _ in t.parts], t.interleave) if t.parts
                   else load_weight(t.name))
        except KeyError as e:
            raise InvalidModelError(f"weight {e.args[0]!r} is missing from the model files") from None
        if tuple(arr.shape) != tuple(t.shape):
            raise InvalidModelError(f"weight {t.name!r} has shape {list(arr.shape)}, "
                                    f"the config implies {list(t.shape)}")
        return arr

    def _compute_last_use(self) -> dict[str, list[str]]:
        """node name -> activations that die after it."""
        last: dict[str, str] = {}
        for node in self.order:
            for t in node.inputs:
                if t and self.graph.tensors[t].kind == TensorKind.ACTIVATION:
                    last[t] = node.name
        dies: dict[str, list[str]] = {}
        for t, n in last.items():
            if t not in self.graph.outputs:
                dies.setdefault(n, []).append(t)
        return dies

    def copy_state_slots(self, copies) -> None:
        """A hybrid model's state-slot copies (source, destination), in order, in every
        Gated DeltaNet state (the prefix cache's snapshots saved and restored)."""
        slotted = [self.states[t.name] for t in self.graph.states if t.shape[0] == "NS"]
        for src, dst in copies:
            for arr in slotted:
                arr[dst] = arr[src]

    def execute(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        env: dict[str, np.ndarray] = {}
        for t in self.graph.inputs:
            arr = inputs[t.name]
            if arr.ndim != t.rank:
                raise ValueError(f"step input {t.name} has rank {arr.ndim}, expected {t.rank}")
            env[t.name] = np.asarray(arr, dtype=to_numpy(t.dtype))
        env.update(self.weights)
        env.update(self.states)
        for node in self.order:
            opdef = self.graph.registry[node.op]
            args = [env[t] if t else None for t in node.inputs]
            while args and args[-1] is None:
                args.pop()
            if node.op in COLLECTIVE_OPS and self.comm is not None:
                outs = (self.comm.all_reduce(args[0]) if node.op == "all_reduce"
                        else self.comm.all_gather(args[0], node.attrs["size"]),)
            else:
                outs = run_reference(opdef, args, node.attrs)
            for name, arr in zip(node.outputs, outs):
                env[name] = arr
            for dead in self._last_use.get(node.name, ()):
                env.pop(dead, None)
        return {name: env[name] for name in self.graph.outputs}
