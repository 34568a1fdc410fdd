"""GPU peer: Hugging Face transformers on the same checkpoint as kiln (bench/make_random_model.py),
bf16, sdpa attention, greedy, batch 1.

    python bench/peers/hf_gpu.py --model DIR --workload decode [--compile] [--context 512] [--steps 128]
    python bench/peers/hf_gpu.py --model DIR --workload prefill [--input-len 2048]
        [--device cuda|cpu] [--repeats 3] [--json OUT]

decode, eager: the prompt of --context random ids through the model with a DynamicCache, then
  --steps one-token forwards, each fed the previous argmax (kept on the device: no host sync per
  step, which only flatters the peer); only the decode steps are timed.
decode, --compile (gpt-fast style): a StaticCache and torch.compile(mode="reduce-overhead",
  fullgraph=True) of the one-token forward (CUDA graphs under inductor); the prompt runs eager;
  two untimed warm-up rounds compile and record the graphs, then the timed rounds.
prefill: one forward of --input-len random ids with a fresh cache, logits of the last position
  only (logits_to_keep=1, as an engine computes them).
Medians over --repeats. Writes kiln's benchmark schema {workload, commit, gpu, metric, value,
roofline, peers, command} plus engine and versions.

torch and transformers are peers' dependencies, never kiln's: kiln does not import this file, and
`build.py bench --peers` runs it as a subprocess. --device cpu runs the same code on a tiny model
(the tests); --compile-backend eager checks the static-cache graph traces whole without inductor.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import transformers

REPO = Path(__file__).resolve().parents[2]
# transformers 5.2x renames forward's past_key_values to cache; the GPU machine's 5.17 knows only the old name
warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)


def load_model(path: str, device: str, dtype: torch.dtype):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", output_loading_info=True)
    missing = sorted(info["missing_keys"]) + sorted(info["unexpected_keys"])
    if missing:
        raise SystemExit(f"{path} does not match {type(model).__name__}: {missing[:5]}")
    return model.to(device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def next_token(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]


@torch.no_grad()
def decode_eager(model, prompt: torch.Tensor, steps: int, device: str) -> float:
    cache = transformers.DynamicCache(config=model.config)
    tok = next_token(model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = next_token(model(input_ids=tok, past_key_values=cache, use_cache=True).logits)
    sync(device)
    return (time.perf_counter() - t0) / steps


class CompiledDecoder:
    """gpt-fast's recipe on transformers: static cache, compiled one-token step, eager prefill."""

    def __init__(self, model, max_len: int, backend: str, fullgraph: bool):
        self.model = model
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)

        def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            out = model(input_ids=tok, cache_position=pos, past_key_values=self.cache, use_cache=True)
            return next_token(out.logits)
        if backend == "inductor":
            self.step = torch.compile(step, mode="reduce-overhead", fullgraph=fullgraph)
        else:
            self.step = torch.compile(step, backend=backend, fullgraph=fullgraph)

    @torch.no_grad()
    def run(self, prompt: torch.Tensor, steps: int, device: str) -> float:
        self.cache.reset()
        n = prompt.shape[1]
        pos = torch.arange(n, device=prompt.device)
        out = self.model(input_ids=prompt, cache_position=pos, past_key_values=self.cache, use_cache=True,
                         logits_to_keep=1)
        tok, pos = next_token(out.logits), torch.tensor([n], device=prompt.device)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            torch.compiler.cudagraph_mark_step_begin()
            tok = self.step(tok, pos).clone()  # the graph's output buffer is rewritten by the next replay
            pos += 1
        sync(device)
        return (time.perf_counter() - t0) / steps


@torch.no_grad()
def prefill(model, prompt: torch.Tensor, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=prompt, past_key_values=transformers.DynamicCache(config=model.config), use_cache=True,
                logits_to_keep=1)
    next_token(out.logits).item()  # the token on the host, as a server would need it
    sync(device)
    return time.perf_counter() - t0


def git_commit() -> str:
    """As bench/workloads.py's: KILN_COMMIT when set (a copied tree's .git may be stale; build.py
    bench runs this script with its own environment, so kiln and its peers report one commit)."""
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(a, model, vocab: int) -> dict:
    rng = np.random.default_rng(a.seed)

    def prompt(n: int) -> torch.Tensor:
        return torch.tensor([rng.integers(min(3, vocab - 1), vocab, size=n).tolist()], device=a.device)
    if a.workload == "prefill":
        prefill(model, prompt(a.input_len), a.device)  # warm-up at the same size
        runs = [prefill(model, prompt(a.input_len), a.device) for _ in range(a.repeats)]
        t = statistics.median(runs)
        return {"metric": "prefill_tok_s", "value": a.input_len / t, "ttft_ms": t * 1e3,
                "runs_tok_s": [a.input_len / r for r in runs], "input_len": a.input_len}
    if a.compile:
        dec = CompiledDecoder(model, a.context + a.steps + 16, a.compile_backend, not a.no_fullgraph)
        for _ in range(2):  # compile, then record the CUDA graphs: untimed
            dec.run(prompt(a.context), min(a.steps, 8), a.device)
        runs = [dec.run(prompt(a.context), a.steps, a.device) for _ in range(a.repeats)]
    else:
        decode_eager(model, prompt(16), 4, a.device)  # warm-up
        runs = [decode_eager(model, prompt(a.context), a.steps, a.device) for _ in range(a.repeats)]
    t = statistics.median(runs)
    return {"metric": "decode_tok_s", "value": 1 / t, "decode_ms": t * 1e3, "runs_tok_s": [1 / r for r in runs],
            "context": a.context, "steps": a.steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (bench/make_random_model.py)")
    ap.add_argument("--workload", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--compile", action="store_true", help="decode: static KV cache + torch.compile (gpt-fast)")
    ap.add_argument("--compile-backend", default="inductor", help="inductor (reduce-overhead) or e.g. eager")
    ap.add_argument("--no-fullgraph", action="store_true", help="let torch.compile break the graph")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    if a.compile and a.workload != "decode":
        ap.error("--compile applies to the decode workload (the one-token forward)")
    t0 = time.perf_counter()
    model = load_model(a.model, a.device, getattr(torch, a.dtype))
    load_s = time.perf_counter() - t0
    res = measure(a, model, model.config.vocab_size)
    engine = "transformers-compile" if a.compile else "transformers-eager"
    record = {"workload": a.workload, "commit": git_commit(),
              "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "metric": res.pop("metric"), "value": res.pop("value"), "roofline": None, "peers": {},
              "command": shlex.join(["python", "bench/peers/hf_gpu.py"] + (argv if argv is not None else sys.argv[1:])),
              "engine": engine, "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "dtype": a.dtype, "attention": "sdpa", "load_s": load_s, **res}
    if a.compile:
        record["compile"] = {"backend": a.compile_backend, "fullgraph": not a.no_fullgraph,
                             "mode": "reduce-overhead" if a.compile_backend == "inductor" else None}
    print(f"{engine} {a.workload}: {record['metric']} = {record['value']:.2f}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
