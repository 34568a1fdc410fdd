"""A real checkpoint directory with random bf16 weights at a public model's shape, which kiln
and transformers both load: config.json, safetensors shards (+ index), a synthetic tokenizer.

    python bench/make_random_model.py --shape llama-3.1-8b --out DIR [--shard-gb 4] [--seed 0]

Weights come from a tiled pool of N(0, 0.02) bf16 values (norms are 1), so writing the 16 GB of
an 8B model runs at disk speed: right bytes and shapes for timing, not a model. The safetensors
files are written here by hand (an 8-byte little-endian header length, the JSON header padded
to 8 bytes, then the raw tensor bytes), so no torch is needed. The tokenizer is a WordLevel
vocabulary of exactly vocab_size entries ("<unk>", "<s>", "</s>", then "t3", "t4", ...): every
id decodes to text, and benchmarks send token ids, never text.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from kiln.models.reference_shapes import SHAPES, TEST_SHAPES

ALL_SHAPES = {**SHAPES, **TEST_SHAPES}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
UNK, BOS, EOS = "<unk>", "<s>", "</s>"  # ids 0, 1, 2
POOL_ELEMS = 1 << 24  # 32 MB of bf16 values, tiled into every weight
CHUNK_ELEMS = 1 << 23  # elements per write call


def hf_config(shape: str) -> dict:
    cfg = dict(ALL_SHAPES[shape])
    arch = cfg["architectures"][0]
    cfg.update(model_type=MODEL_TYPES[arch], torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
               hidden_act="silu", attention_bias=False, attention_dropout=0.0, initializer_range=0.02,
               use_cache=True)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and [out, in] shapes of a llama or qwen3 checkpoint, in file order."""
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (nq * d, h)
        out[p + "self_attn.k_proj.weight"] = (nkv * d, h)
        out[p + "self_attn.v_proj.weight"] = (nkv * d, h)
        out[p + "self_attn.o_proj.weight"] = (h, nq * d)
        if cfg["model_type"] == "qwen3":
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    return out


def plan_shards(shapes: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    """Tensors in file order, cut into shards of at most shard_bytes (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = 2 * math.prod(shape)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_safetensors(path: Path, names: list[str], shapes: dict[str, tuple[int, ...]],
                      pool: np.ndarray, rng: np.random.Generator, progress=lambda n: None) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        n = 2 * math.prod(shapes[name])
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer keeps it
    one = np.ones(1, dtype=ml_dtypes.bfloat16).view(np.uint8)
    pool_bytes = pool.view(np.uint8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            elems = math.prod(shapes[name])
            if name.endswith("norm.weight"):
                f.write(np.tile(one, elems).tobytes())
                progress(2 * elems)
                continue
            start = int(rng.integers(0, len(pool)))  # a different phase per tensor
            done = 0
            while done < elems:
                k = min(elems - done, len(pool) - start, CHUNK_ELEMS)
                f.write(memoryview(pool_bytes[2 * start: 2 * (start + k)]))
                done += k
                start = (start + k) % len(pool)
                progress(2 * k)


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {UNK: 0, BOS: 1, EOS: 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([UNK, BOS, EOS])  # already in the vocabulary: marks them special, adds no ids
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
        "model_max_length": 1 << 30}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=1))


def make_random_model(shape: str, out: str | Path, *, shard_gb: float = 4.0, seed: int = 0,
                      show_progress: bool = False) -> Path:
    """Write the checkpoint into `out` (created; existing files of the same names are replaced); -> out."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape)
    shapes = weight_shapes(cfg)
    shards = plan_shards(shapes, int(shard_gb * 1e9))
    total = sum(2 * math.prod(s) for s in shapes.values())
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(min(POOL_ELEMS, max(total // 2, 1)), dtype=np.float32) * 0.02).astype(
        ml_dtypes.bfloat16)
    bar = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {shape}", file=sys.stderr)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for stale in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        if stale.exists() and stale.name not in files:
            stale.unlink()  # a leftover shard of another layout would confuse loaders
    for fname, names in zip(files, shards):
        write_safetensors(out / fname, names, shapes, pool, rng, bar.update if bar else lambda n: None)
    if bar:
        bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(out, cfg["vocab_size"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(ALL_SHAPES))
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="largest shard size in GB (1e9 bytes)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = make_random_model(a.shape, a.out, shard_gb=a.shard_gb, seed=a.seed, show_progress=True)
    print(f"wrote {a.shape} to {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
