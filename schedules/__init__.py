"""Tuned kernel schedules, checked in as YAML: one file per arch and op family.

    schedules/sm_90/gemm.yaml
      compiler: triton 3.6.0
      gemm_reduction:                  # per weight [N, K]: the K order of every element
      - {n: 6144, k: 4096, block_k: 128, split_k: 2, us: 9.8}
      gemm_tile:                       # per (M bucket, N, K): how output tiles are cut
      - {m: 1, n: 6144, k: 4096, block_m: 16, block_n: 32, num_warps: 4, num_stages: 5, us: 9.8}
    schedules/sm_90/attention.yaml
      paged_attention:                 # per head shape: schedule knobs only (tile, seg stay the defaults)
      - {h: 32, hkv: 8, d: 128, block_q: 4, num_warps: 2, num_stages: 3, split_num_warps: 2,
         split_num_stages: 4, split_maxnreg: 168, one_num_warps: 4, one_num_stages: 2,
         prefill_block_q: 16, prefill_num_warps: 4, prefill_num_stages: 2, us: 420.0, split_us: 80.0,
         one_us: 7.0, prefill_us: 180.0}
    schedules/sm_90/rows.yaml
      rms_norm:                        # per row width; the op names are Configs.row/elementwise's
      - {width: 4096, num_warps: 8, us: 30.1}
      silu_mul:
      - {width: 14336, block: 2048, num_warps: 4, us: 25.0}
    schedules/sm_90/moe.yaml
      moe_experts:                     # per (bucket T, MoE layer shape, dtype): the path and both GEMMs' tiles
      - {t: 1, e: 128, h: 2048, i: 768, top_k: 8, dtype: bfloat16, path: decode, block_m: 16,
         gate_up_block_n: 32, gate_up_block_k: 128, ..., down_num_stages: 4, us: 41.0}

`build.py tune` writes them (codegen/autotune*.py); `Schedules.lookup` is the hook
codegen/triton/configs.Configs takes. A GEMM tile entry tuned for M serves every
bucket up to M (the smallest tuned M that holds the bucket; past the largest, the
largest); a MoE entry tuned for T tokens likewise. An attention entry serves every max_model_len of its head shape (it holds no
reduction knob; the default's seg follows max_model_len). Every YAML file of the arch
folder is read, whatever its name; `write(family)` rewrites one family's file only.
Entries written by another compiler version are ignored: a schedule is a measurement
of one compiler's code. This package imports nothing of kiln.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import yaml

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent


class ScheduleError(ValueError):
    """A schedules file that cannot be used as it stands (bad YAML, unknown fields)."""
# the fields of an entry that form its key (the rest is the config, plus the timings);
# ops not named here (row and elementwise kernels) are keyed by their row width
KEYS = {"gemm_reduction": ("n", "k"), "gemm_tile": ("n", "k"), "paged_attention": ("h", "hkv", "d", "cache"),
        "moe_experts": ("e", "h", "i", "top_k", "dtype")}
BUCKET_KEYS = ("m", "t")  # the bucket an entry was tuned at (gemm_tile: M rows; moe_experts: T tokens)
ROW_KEY = ("width",)
TIMINGS = {"us", "prefill_us", "split_us", "one_us", "mixed_us"}
NOT_CONFIG = {"m", "n", "k", "h", "hkv", "d", "cache", "width", "t", "e", "i", "top_k", "dtype"} | TIMINGS
# op -> the file (family) its entries are written to; other ops: "rows"
FAMILY = {"gemm_reduction": "gemm", "gemm_tile": "gemm", "paged_attention": "attention", "moe_experts": "moe"}
FAMILIES = ("gemm", "attention", "rows", "moe")


def family(op: str) -> str:
    return FAMILY.get(op, "rows")


def compiler_version() -> str:
    try:
        import triton
        return f"triton {triton.__version__}"
    except ImportError:
        return "triton (not installed)"


class Schedules:
    def __init__(self, arch: str, entries: Mapping[str, list[dict]] | None = None,
                 compiler: str | None = None) -> None:
        self.arch = arch
        self.compiler = compiler or compiler_version()
        self.entries: dict[str, list[dict]] = {op: list(v) for op, v in (entries or {}).items()}

    # -- files ------------------------------------------------------------------------
    @classmethod
    def read(cls, arch: str, root: Path | None = None) -> "Schedules":
        """Every YAML file under root/arch (default: this package's folder) whose compiler matches this one's."""
        root = Path(root) if root is not None else ROOT
        here = compiler_version()
        entries: dict[str, list[dict]] = {}
        for f in sorted((root / arch).glob("*.yaml")) if (root / arch).is_dir() else []:
            try:
                doc = yaml.safe_load(f.read_text()) or {}
            except yaml.YAMLError as e:
                raise ScheduleError(f"{f} is not valid YAML: {e}") from None
            if not isinstance(doc, dict) or not all(isinstance(v, list) for k, v in doc.items() if k != "compiler"):
                raise ScheduleError(f"{f} is not a schedules file (a mapping of op -> list of entries)")
            if doc.get("compiler") != here:
                log.warning("ignoring %s: tuned with %s, this is %s", f, doc.get("compiler"), here)
                continue
            for op, items in doc.items():
                if op != "compiler":
                    entries.setdefault(op, []).extend(items or [])
        return cls(arch, entries, here)

    def write(self, name: str, root: Path | None = None) -> Path:
        """root/arch/<name>.yaml with the entries of family `name` (gemm, attention, rows, moe) only:
        the other families keep their own files, tuned when they were."""
        if name not in FAMILIES:
            raise ValueError(f"unknown schedules family {name!r} (known: {', '.join(FAMILIES)})")
        path = (Path(root) if root is not None else ROOT) / self.arch / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        doc: dict[str, Any] = {"compiler": self.compiler}
        for op in sorted(op for op in self.entries if family(op) == name):
            doc[op] = sorted(self.entries[op], key=_file_order)
        header = "# written by `build.py tune` (codegen/autotune.py); timed on the GPU under CUDA graphs\n"
        path.write_text(header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=140))
        return path

    def merge(self, other: "Schedules") -> None:
        """Entries of `other` replace ours with the same key."""
        for op, items in other.entries.items():
            mine = self.entries.setdefault(op, [])
            for e in items:
                key = self._key(op, e)
                mine[:] = [x for x in mine if self._key(op, x) != key]
                mine.append(e)

    @staticmethod
    def _key(op: str, e: Mapping) -> tuple:
        return tuple(e.get(k) for k in KEYS.get(op, ROW_KEY) + tuple(b for b in BUCKET_KEYS if b in e))

    def digest(self) -> str:
        """What a bundle compiled with these schedules records, to notice a retune."""
        import hashlib
        blob = yaml.safe_dump({"compiler": self.compiler, **self.entries}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # -- the Configs hook ---------------------------------------------------------------
    def _covering(self, arch: str, hit: list[dict], field: str, at: int) -> dict | None:
        """The entry tuned at the smallest bucket size (field) that holds `at`; past the largest,
        the largest. None for another arch's key: a schedule is a measurement of this one."""
        if arch != self.arch or not hit:
            return None
        hit = sorted(hit, key=lambda e: e[field])
        up = [e for e in hit if e[field] >= at]
        return _config(up[0] if up else hit[-1])

    def lookup(self, op: str, key: tuple) -> dict | None:
        items = self.entries.get(op)
        if not items:
            return None
        if op == "gemm_reduction":
            n, k = key
            hit = [e for e in items if (e["n"], e["k"]) == (n, k)]
            return _config(hit[0]) if hit else None
        if op == "gemm_tile":
            m, n, k, arch = key
            return self._covering(arch, [e for e in items if (e["n"], e["k"]) == (n, k)], "m", m)
        if op == "moe_experts":  # (t, e, h, i, top_k, dtype, arch)
            t, arch = key[0], key[-1]
            return self._covering(arch, [e for e in items if tuple(e.get(f) for f in KEYS[op]) == key[1:-1]], "t", t)
        # paged_attention: (h, hkv, d, cache, max_model_len) -> its (h, hkv, d, cache) entry (cache:
        # None for a cache in the model's dtype, which the entries without the field serve); rows: (width,)
        fields = KEYS.get(op, ROW_KEY)
        hit = [e for e in items if tuple(e.get(f) for f in fields) == tuple(key[:len(fields)])]
        return _config(hit[0]) if hit else None


_ORDER = ("h", "hkv", "d", "width", "n", "k", "e", "i", "top_k", "m", "t")  # how a file lists an op's entries


def _file_order(e: Mapping) -> tuple:  # (then by cache and dtype)
    return tuple(e.get(k, 0) for k in _ORDER) + (e.get("cache", ""), e.get("dtype", ""))


def _config(e: Mapping) -> dict:
    return {k: v for k, v in e.items() if k not in NOT_CONFIG}
