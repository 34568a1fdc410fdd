"""Peers in the same run: bench/peers/hf_gpu.py in a subprocess (torch and transformers never
enter kiln's process), before kiln's engine takes the GPU, and peer JSON files read back.

A peer result has the same schema as kiln's ({workload, commit, gpu, metric, value, ...}) plus
`engine`; `build.py bench` records it under peers[name] when its workload is the run's.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kiln.errors import KilnError

PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "hf_gpu.py"
# peer name -> (extra flags, the workloads it measures)
PEER_MODES = {"hf-eager": ([], ("decode", "prefill")), "hf-compile": (["--compile"], ("decode",))}
KEEP = ("engine", "metric", "value", "gpu", "commit", "command", "versions")


def peer_command(a, name: str, out: str) -> list[str]:
    flags, _ = PEER_MODES[name]
    cmd = [sys.executable, str(PEER_SCRIPT), "--model", str(a.model), "--workload", a.workload,
           "--device", "cpu" if a.target == "cpu" else "cuda", "--seed", str(a.seed), "--json", out, *flags]
    sizes = ["context", "steps", "repeats"] if a.workload == "decode" else ["input_len", "repeats"]
    for size in sizes:  # the sizes kiln runs at, so the numbers compare
        cmd += ["--" + size.replace("_", "-"), str(getattr(a, size))]
    return cmd


def run_peers(a) -> dict:
    """Run each requested peer that measures this workload; -> {name: result}."""
    if not a.peers:
        return {}
    if a.model is None or not Path(a.model).is_dir():
        raise KilnError("--peers needs --model to be a checkpoint directory that transformers can load")
    out: dict = {}
    for name in a.peers:
        if a.workload not in PEER_MODES[name][1]:
            print(f"[kiln] peer {name} does not measure {a.workload}; skipped", file=sys.stderr)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "peer.json")
            cmd = peer_command(a, name, path)
            print(f"[kiln] peer {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            if subprocess.run(cmd).returncode != 0:
                raise KilnError(f"peer {name} failed (its output is above)")
            out[name] = _keep(json.loads(Path(path).read_text()))
    return out


def read_peer_json(files: list[str], workload: str) -> dict:
    out: dict = {}
    for f in files:
        try:
            rec = json.loads(Path(f).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise KilnError(f"cannot read peer result {f}: {e}") from None
        if rec.get("workload") == workload:
            out[rec.get("engine") or Path(f).stem] = _keep(rec)
    return out


def _keep(rec: dict) -> dict:
    return {k: rec[k] for k in KEEP if k in rec}
