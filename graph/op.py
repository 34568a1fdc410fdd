"""Nodes and the op registry.

Each op has shape inference (on symbolic shapes) and a numpy reference. The
reference is the definition of the op: the numpy target runs it, and every GPU
kernel is tested against it.

State updates (writing the paged KV cache, later the Gated-DeltaNet recurrent
state) are ops whose output *aliases* one input (`inplace`): the output tensor
is the new version of the state, and consumers that must see the write take the
output, which puts the write before the read in topological order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from kiln.graph.dtype import DType
from kiln.graph.tensor import Dim, Tensor

# infer(inputs, attrs) -> [(dtype, shape)] for each output
InferFn = Callable[[Sequence[Tensor], Mapping[str, Any]], list[tuple[DType, tuple[Dim, ...]]]]
# reference(*arrays, **attrs) -> array or tuple of arrays (one per output)
ReferenceFn = Callable[..., Any]


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: InferFn
    reference: ReferenceFn
    num_inputs: tuple[int, int]  # (min, max); optional inputs are trailing
    inplace: Mapping[int, int] = field(default_factory=dict)  # output idx -> aliased input idx
    doc: str = ""


class OpRegistry:
    """Ops by name. A registry instance, not a module-level dict, so tests can build their own."""

    def __init__(self) -> None:
        self._ops: dict[str, OpDef] = {}

    def register(self, name: str, *, infer: InferFn, inputs: tuple[int, int] | int,
                 inplace: Mapping[int, int] | None = None):
        if isinstance(inputs, int):
            inputs = (inputs, inputs)

        def deco(ref: ReferenceFn) -> ReferenceFn:
            if name in self._ops:
                raise ValueError(f"op {name!r} registered twice")
            self._ops[name] = OpDef(name, infer, ref, inputs, dict(inplace or {}), ref.__doc__ or "")
            return ref

        return deco

    def __getitem__(self, name: str) -> OpDef:
        try:
            return self._ops[name]
        except KeyError:
            raise KeyError(f"unknown op {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._ops

    def names(self) -> list[str]:
        return sorted(self._ops)


@dataclass(eq=False)
class Node:
    name: str
    op: str
    inputs: list[str]  # tensor names; "" for an omitted optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        attrs = ", ".join(f"{k}={v!r}" for k, v in sorted(self.attrs.items()))
        ins = ", ".join(i or "_" for i in self.inputs)
        return f"{', '.join(self.outputs)} = {self.op}({ins}{'; ' + attrs if attrs else ''})"


def run_reference(opdef: OpDef, arrays: Sequence[np.ndarray | None], attrs: Mapping[str, Any]) -> tuple:
    out = opdef.reference(*arrays, **attrs)
    return out if isinstance(out, tuple) else (out,)
