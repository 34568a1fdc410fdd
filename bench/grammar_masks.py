"""Host time of structured output per engine step (issue 41): the grammar masks of a batch of
constrained requests (StructuredOutputManager.bitmask, llguidance one matcher after another) and
the matchers taking their tokens (accept), with the real SmolLM2 tokenizer (49,152 tokens).
Not a dependency of any test.

    python bench/grammar_masks.py [--model GGUF] [--batch 64] [--steps 200] [--json OUT]

Each of --batch rows holds a constrained request (JSON schemas like the server tests', and the
tool_choice=required array); its "model" draws uniformly among the tokens its mask allows
(seeded), which walks grammars through strings, numbers and structure as garbage models do; a
request that ends (EOS drawn, or 120 tokens) is replaced by a fresh one with the next schema,
so the batch stays full. Reported per step: the median and p90 of bitmask() and accept(), then
the same with one constrained row among --batch (the rest unconstrained) and with none, and the
mask fill through llguidance's parallel executor (LLExecutor, its default threads) on the same
seeded walk for comparison.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kiln.loader import default_model_path
from kiln.models.weights import open_weights
from kiln.runtime.sample.grammar import GrammarTokenizer, RequestGrammar
from kiln.runtime.sample.structured_output_manager import GrammarBitmask, StructuredOutputManager
from kiln.runtime.sample.structured_outputs import StructuredOutputsParams
from kiln.runtime.text.tokenizer import Tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["name", "zip"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 4}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "x": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
     "required": ["colour", "n", "x"], "additionalProperties": False},
    {"type": "array", "minItems": 1, "maxItems": 2, "items": {"anyOf": [  # tool_choice "required"
        {"type": "object", "properties": {"name": {"enum": ["get_weather"]}, "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}},
         "required": ["name", "parameters"], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"enum": ["get_time"]}, "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
            "additionalProperties": False}}, "required": ["name", "parameters"], "additionalProperties": False}]}},
]
MAX_TOKENS = 120


def _stats(xs) -> dict:
    a = np.asarray(xs) * 1e3
    return {"median_ms": round(float(np.median(a)), 3), "p90_ms": round(float(np.percentile(a, 90)), 3),
            "mean_ms": round(float(a.mean()), 3)}


def run(gt: GrammarTokenizer, batch: int, constrained: int, steps: int, seed: int = 0, par=None) -> dict:
    params = [StructuredOutputsParams(json=s) for s in SCHEMAS]
    mgr = StructuredOutputManager(gt)
    rng = np.random.default_rng(seed)
    made = [0]

    def fresh():
        made[0] += 1
        return [RequestGrammar(gt, params[made[0] % len(params)]), 0]

    rows = [fresh() if i < constrained else None for i in range(batch)]
    eos = set(gt.eos_token_ids)
    t_mask, t_accept, t_par = [], [], []
    for _ in range(steps):
        grammars = [r[0] if r else None for r in rows]
        if par is not None:  # the masks through llguidance's thread pool instead (no dead-end handling)
            from llguidance.numpy import fill_next_token_bitmask_par

            live = [i for i, g in enumerate(grammars) if g is not None]
            bits = np.zeros((len(live), (gt.vocab_size + 31) // 32), np.int32)
            t0 = time.perf_counter()
            fill_next_token_bitmask_par(par, [(grammars[i].matcher, k) for k, i in enumerate(live)], bits)
            t_par.append(time.perf_counter() - t0)
            mask = GrammarBitmask(np.asarray(live, np.int64), bits)
        else:
            t0 = time.perf_counter()
            mask = mgr.bitmask(grammars)
            t_mask.append(time.perf_counter() - t0)
        tokens = [0] * batch
        if mask is not None:
            allowed = np.unpackbits(mask.bits.view(np.uint8), axis=1, bitorder="little")[:, :gt.vocab_size]
            for k, i in enumerate(mask.rows.tolist()):
                tokens[i] = int(rng.choice(np.flatnonzero(allowed[k])))
        t0 = time.perf_counter()
        mgr.accept(grammars, tokens)
        t_accept.append(time.perf_counter() - t0)
        for i, r in enumerate(rows):
            if r is not None:
                r[1] += 1
                if tokens[i] in eos or r[0].dead or r[1] >= MAX_TOKENS:
                    rows[i] = fresh()
    out = {"batch": batch, "constrained": constrained, "steps": steps, "requests_started": made[0],
           "accept": _stats(t_accept)}
    out["bitmask_par" if par is not None else "bitmask"] = _stats(t_par if par is not None else t_mask)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    meta = open_weights(args.model or default_model_path()).metadata
    tok = Tokenizer.from_gguf_metadata(meta)
    t0 = time.perf_counter()
    gt = GrammarTokenizer.from_tokenizer(tok, tok.vocab_size)
    gt.ll  # built once per model
    build_s = time.perf_counter() - t0
    import llguidance

    results = {"vocab": gt.vocab_size, "tokenizer_build_s": round(build_s, 3), "runs": [
        run(gt, args.batch, args.batch, args.steps),
        run(gt, args.batch, args.batch, args.steps, par=llguidance.LLExecutor()),
        run(gt, args.batch, 1, args.steps),
        run(gt, args.batch, 0, args.steps)]}
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
