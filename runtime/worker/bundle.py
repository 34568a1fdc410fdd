"""The compiled artifact: what build time hands the runtime.

    bundle/
      manifest.yaml   format version, target, model config and its hash, tokenizer and
                      weight references (path + size + checksum of the original files),
                      buckets, the launch plan of each bucket, hashes of what it came from
      plans.json      the launch plan of every bucket (JSON: large, and fast to load)
      kernels/*.cubin one file per compiled kernel (GPU targets)
      consts/*.npy    small constant tables kernels read (RoPE cos/sin)

The runtime reads bundles and never imports passes, codegen or model builders:
that is what makes a bundle shippable. A bundle for another arch or another
model fails to load with one sentence.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kiln.errors import KilnError

FORMAT_VERSION = 4  # 2: a stacked weight's entry may end with its interleave (graph/layout.py), which a
# format-1 reader would ignore and upload the parts plainly stacked. 3: the sampler's sample
# kernel runs in phases over a row split between programs (runtime/sample/phases.py). 4: the
# step inputs go in through the sampler's stage kernel (runtime/worker/input_stager.py), not a copy
# to the inputs region; its feed kernel is gone
# A plan's pointer arguments are (region index << REGION_SHIFT) + byte offset; the runtime
# relocates them by region base address at load (codegen/lower.py writes them).
REGION_SHIFT = 44


class BundleError(KilnError, ValueError):
    """A bundle that is missing, corrupt, or built for something else."""


@dataclass
class Bundle:
    manifest: dict[str, Any]
    kernels: dict[str, bytes] = field(default_factory=dict)  # file stem -> cubin bytes
    consts: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return self.manifest["target"]

    def write(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        (out / "kernels").mkdir(parents=True, exist_ok=True)
        hashes = {}
        for name, blob in self.kernels.items():
            (out / "kernels" / f"{name}.cubin").write_bytes(blob)
            hashes[name] = hashlib.sha256(blob).hexdigest()
        (out / "consts").mkdir(exist_ok=True)
        for name, arr in self.consts.items():
            np.save(out / "consts" / f"{name}.npy", arr)
        manifest = dict(self.manifest, format_version=FORMAT_VERSION, kernel_sha256=hashes,
                        consts=sorted(self.consts))
        plans = manifest.pop("plans", None)
        if plans is not None:
            (out / "plans.json").write_text(json.dumps(plans, separators=(",", ":")))
            manifest["plans_sha256"] = hashlib.sha256((out / "plans.json").read_bytes()).hexdigest()
        tmp = out / "manifest.yaml.tmp"
        tmp.write_text(yaml.safe_dump(manifest, sort_keys=False, width=120))
        tmp.replace(out / "manifest.yaml")  # a half-written bundle never looks complete
        return out

    @classmethod
    def read(cls, path: str | Path, *, expect_target: str | None = None,
             expect_config_hash: str | None = None) -> "Bundle":
        path = Path(path)
        mf = path / "manifest.yaml"
        if not mf.is_file():
            raise BundleError(f"{path} is not a kiln bundle (no manifest.yaml)")
        try:
            manifest = yaml.safe_load(mf.read_text())
        except yaml.YAMLError as e:
            raise BundleError(f"{mf} is corrupt: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
            raise BundleError(f"{path} has bundle format {manifest.get('format_version') if isinstance(manifest, dict) else '?'}"
                              f"; this kiln reads format {FORMAT_VERSION}: recompile it")
        if expect_target is not None and manifest.get("target") != expect_target:
            raise BundleError(f"bundle {path} was compiled for {manifest.get('target')}, "
                              f"not for this device ({expect_target}): recompile with --target {expect_target}")
        if expect_config_hash is not None and manifest.get("config_hash") != expect_config_hash:
            raise BundleError(f"bundle {path} was compiled for another model "
                              f"(config hash {manifest.get('config_hash')}, the model's is {expect_config_hash})")
        kernels = {}
        for name, digest in (manifest.get("kernel_sha256") or {}).items():
            f = path / "kernels" / f"{name}.cubin"
            if not f.is_file():
                raise BundleError(f"bundle {path} is missing kernels/{name}.cubin")
            blob = f.read_bytes()
            if hashlib.sha256(blob).hexdigest() != digest:
                raise BundleError(f"bundle {path}: kernels/{name}.cubin does not match its checksum")
            kernels[name] = blob
        if manifest.get("plans_sha256"):
            blob = (path / "plans.json").read_bytes() if (path / "plans.json").is_file() else b""
            if hashlib.sha256(blob).hexdigest() != manifest["plans_sha256"]:
                raise BundleError(f"bundle {path}: plans.json is missing or does not match its checksum")
            manifest["plans"] = json.loads(blob)
        consts = {}
        for name in manifest.get("consts") or ():
            try:
                consts[name] = np.load(path / "consts" / f"{name}.npy")
            except (OSError, ValueError):
                raise BundleError(f"bundle {path}: consts/{name}.npy is missing or corrupt") from None
        return cls(manifest, kernels, consts)


def file_fingerprint(path: str | Path) -> dict[str, Any]:
    """A cheap identity of a weight file: path, size and a hash of its first and last MiB."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(-(1 << 20), 2)
            h.update(f.read())
    return {"path": str(p.resolve()), "size": size, "sha256_ends": h.hexdigest()}
