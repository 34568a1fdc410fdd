"""The cold-start workload: how long until a model serves its first token.

`build.py compile` three times in fresh processes, with kernel caches (KILN_CACHE_DIR,
TRITON_CACHE_DIR) in a new temporary directory:
  cold            empty kernel caches, a new bundle directory
  warm kernels    the same caches, another new bundle directory (lowering runs, no kernel compiles)
  cached bundle   the first bundle directory again (a matching bundle is read back, not rebuilt)
then, in a fresh process (this file run as a script): import kiln; LLM(...) from that bundle (bundle
load + weights to the device + KV cache); the first request of --input-len prompt tokens and
--output-len outputs (its prefill, then the batch-1 decode graph's capture on first use). Weights
come from the OS page cache when the files were read recently (as after the other workloads).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _compile_cmd(a, out: Path) -> list[str]:
    from kiln.bench.workloads import BUILD

    cmd = [sys.executable, str(BUILD), "compile", "--target", a.target, "--out", str(out),
           "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    return cmd + (["--model", str(a.model)] if a.model is not None else [])


def _timed(cmd: list[str], env: dict) -> float:
    from kiln.errors import KilnError

    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KilnError(f"`{' '.join(cmd[1:3])}` failed: {proc.stderr.strip()[-2000:]}")
    return time.perf_counter() - t0


def run_cold_start(a) -> dict:
    from kiln.errors import KilnError

    with tempfile.TemporaryDirectory(prefix="kiln-cold-") as tmp:
        tmp = Path(tmp)
        env = dict(os.environ, KILN_CACHE_DIR=str(tmp / "kiln-cache"), TRITON_CACHE_DIR=str(tmp / "triton-cache"))
        compile_s = {"cold": _timed(_compile_cmd(a, tmp / "bundle"), env),
                     "warm_kernels": _timed(_compile_cmd(a, tmp / "bundle2"), env),
                     "cached_bundle": _timed(_compile_cmd(a, tmp / "bundle"), env)}
        spec = {"model": a.model, "target": a.target, "bundle": None if a.target == "cpu" else str(tmp / "bundle"),
                "max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs,
                "max_num_batched_tokens": a.max_num_batched_tokens, "kv_cache_tokens": a.kv_cache_tokens,
                "input_len": a.input_len, "output_len": a.output_len, "seed": a.seed}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], env=env, capture_output=True, text=True)
        process_s = time.perf_counter() - t0
        if proc.returncode != 0:
            raise KilnError(f"the cold-start process failed: {proc.stderr.strip()[-2000:]}")
    load = json.loads(proc.stdout.strip().splitlines()[-1])
    if load["output_tokens"] != load["expected_output_tokens"]:
        raise KilnError(f"the first request produced {load['output_tokens']} tokens, "
                        f"not {load['expected_output_tokens']}")
    total = load["import_s"] + load["engine_init_s"] + load["first_request_s"]
    return {"metric": "cold_start_s", "value": total, "roofline": None, "compile_s": compile_s,
            "process_s": process_s, **load, "input_len": a.input_len}


def _child(spec: dict) -> None:
    """In a fresh process: time import, engine init and the first request; print one JSON line."""
    t_start = time.perf_counter()
    from kiln import LLM, SamplingParams

    t_import = time.perf_counter()
    llm = LLM(spec["model"], target=spec["target"], bundle_dir=spec["bundle"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              kv_cache_tokens=spec["kv_cache_tokens"])
    t_init = time.perf_counter()
    import numpy as np

    vocab = llm.engine.vocab_size
    prompt = np.random.default_rng(spec["seed"]).integers(min(3, vocab - 1), vocab, size=spec["input_len"]).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=spec["output_len"], ignore_eos=True, temperature=0))
    t_first = time.perf_counter()
    print(json.dumps({"import_s": t_import - t_start,
                      "engine_init_s": t_init - t_import, "first_request_s": t_first - t_init,
                      "output_tokens": len(out[0].outputs[0].token_ids), "expected_output_tokens": spec["output_len"]}),
          flush=True)
    if spec["target"] != "cpu":
        llm.model.executor.close()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
