"""The MoE experts layer's schedule for one bucket: which path runs it and the tiles of its two
GEMMs (codegen/triton/moe.py), as a `moe` schedules entry holds it and Configs.moe returns it.

Every field is a schedule knob, never a reduction knob (moe.py, moe_gemm.py): each output
element is one chain of dots over K from 0 whatever BLOCK_M/N/K, warps, stages or GROUP_M,
and the decode and grouped paths share that code and the rank-order sum. So a field may vary
per bucket, the tuner may pick the path as well as the tiles, and a token's bits stay those of
the default (autotune_moe.py refuses a candidate whose output differs from the default's).

The fields are flat (gate_up_*, down_*) so that a YAML entry names them one by one and
Configs._get can check them against this dataclass, as it does for the attention knobs.
block_m is one field for both GEMMs: in the grouped path moe_align sorts the rows into blocks
of it, and gate_up and down walk the same blocks. The decode paths ("decode", "decode_token":
moe.py) ignore it (16-row tiles, one live row each: moe_gemm._gemm_spec).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.codegen.triton.moe import moe_path, moe_tiles
from kiln.codegen.triton.moe_gemm import MoeTile

PATHS = ("decode", "decode_token", "grouped")
_TILE = ("block_n", "block_k", "num_warps", "num_stages", "group_m")  # a MoeTile's fields past block_m


@dataclass(frozen=True)
class MoeConfig:
    path: str = "grouped"
    block_m: int = 64  # grouped: the align step's block and both GEMMs' rows per program
    gate_up_block_n: int = 64
    gate_up_block_k: int = 64
    gate_up_num_warps: int = 4
    gate_up_num_stages: int = 3
    gate_up_group_m: int = 8
    down_block_n: int = 64
    down_block_k: int = 64
    down_num_warps: int = 4
    down_num_stages: int = 3
    down_group_m: int = 8

    def __post_init__(self) -> None:
        # a schedules entry is read into this: say what is wrong with it here, not in a kernel wrapper
        if self.path not in PATHS:
            raise ValueError(f"moe schedule: unknown path {self.path!r} (known: {', '.join(PATHS)})")
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"moe schedule: block_m {self.block_m} is not a power of two >= 16")

    @property
    def tiles(self) -> tuple[MoeTile, MoeTile]:
        """(gate_up tile, down tile), as moe.moe_experts takes them."""
        return tuple(MoeTile(self.block_m, *(getattr(self, f"{g}_{f}") for f in _TILE))  # type: ignore[return-value]
                     for g in ("gate_up", "down"))

    @classmethod
    def of(cls, path: str, gate_up: MoeTile, down: MoeTile) -> "MoeConfig":
        if path == "grouped" and gate_up.block_m != down.block_m:
            raise ValueError("moe schedule: gate_up and down share the align step's block_m")
        return cls(path, gate_up.block_m, *(getattr(gate_up, f) for f in _TILE), *(getattr(down, f) for f in _TILE))

    def with_tile(self, gemm: str, tile: MoeTile) -> "MoeConfig":
        """This config with gemm's ("gate_up" or "down") tile knobs but block_m (the shared one) from `tile`."""
        return replace(self, **{f"{gemm}_{f}": getattr(tile, f) for f in _TILE})

    def fields(self) -> dict:
        """The entry a schedules file holds for it (every knob, so that it reads on its own)."""
        return {"path": self.path, "block_m": self.block_m,
                **{f"{g}_{f}": getattr(self, f"{g}_{f}") for g in ("gate_up", "down") for f in _TILE}}


def default_moe_config(t: int, top_k: int, e: int, h: int, i: int, arch: str = "sm_90",
                       path: str | None = None) -> MoeConfig:
    """kiln's default for a bucket of T tokens (moe.moe_path, moe.moe_tiles): what a bucket without
    a schedules entry runs, and the bits every tuned candidate must give."""
    path = path or moe_path(t, top_k)
    return MoeConfig.of(path, *moe_tiles(t, top_k, e, h, i, arch, path))
