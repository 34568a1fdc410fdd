"""Typed tensors with symbolic dimensions.

A dimension is an int or a symbol (a str) bound when a step runs:
  T   tokens in the step (padded up to a bucket on the GPU)
  S   sequences in the step
  L   rows of logits wanted (one per sequence that samples)
  MB  max KV blocks per sequence in the block table
  NB  blocks in the paged KV cache (known only after memory profiling)
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Union

from kiln.graph.dtype import DType

Dim = Union[int, str]


class TensorKind(str, Enum):
    INPUT = "input"  # step metadata and token ids, fresh every step
    WEIGHT = "weight"  # read-only parameters, named as in the HF checkpoint
    STATE = "state"  # persists across steps (paged KV cache, recurrent state)
    ACTIVATION = "activation"  # produced and consumed inside one step


@dataclass(eq=False)
class Tensor:
    name: str
    dtype: DType
    shape: tuple[Dim, ...]
    kind: TensorKind = TensorKind.ACTIVATION
    # A weight made at load time by stacking checkpoint tensors along axis 0, as
    # ((name, rows), ...) (passes/merge_parallel_linears.py: q/k/v -> qkv, gate/up -> gate_up).
    parts: tuple[tuple[str, int], ...] = ()
    # > 0: the parts are stored block-interleaved in groups of this many rows (graph/layout.py;
    # passes/fuse_gate_up_silu.py: gate/up for the GEMM's SwiGLU epilogue); 0: one after another
    interleave: int = 0

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def symbols(self) -> set[str]:
        return {d for d in self.shape if isinstance(d, str)}

    def concrete_shape(self, dims: Mapping[str, int]) -> tuple[int, ...]:
        """Shape with every symbol replaced by its bound value."""
        try:
            return tuple(d if isinstance(d, int) else int(dims[d]) for d in self.shape)
        except KeyError as e:
            raise KeyError(f"dimension {e.args[0]!r} of tensor {self.name!r} is not bound") from None

    def __repr__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}] ({self.kind.value})"
