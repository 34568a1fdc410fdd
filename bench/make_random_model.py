"""A real checkpoint directory with random bf16 weights at a public model's shape, which kiln
and transformers both load: config.json, safetensors shards (+ index), a synthetic tokenizer.

    python bench/make_random_model.py --shape llama-3.1-8b --out DIR [--shard-gb 4] [--seed 0]
    python bench/make_random_model.py --shape qwen3.6-27b --dry-run   # the size it would write

Weights come from a tiled pool of N(0, 0.02) bf16 values (norms are 1), so writing the 16 GB of
an 8B model runs at disk speed: right bytes and shapes for timing, not a model. The safetensors
files are written here by hand (an 8-byte little-endian header length, the JSON header padded
to 8 bytes, then the raw tensor bytes), so no torch is needed. The tokenizer is a WordLevel
vocabulary of exactly vocab_size entries ("<unk>", "<s>", "</s>", then "t3", "t4", ...): every
id decodes to text, and benchmarks send token ids, never text.

The Qwen3.5/3.6 hybrids (qwen3.6-27b, qwen3.6-35b-a3b, tiny-qwen3.6, tiny-qwen3.6-moe) are written
as the published checkpoints ship them (../shared/specs/qwen3_5.md sections 1 and 8.2):
Qwen3_5(Moe)ForConditionalGeneration, the text fields nested under `text_config`, the text tower
under `model.language_model.`, `lm_head.weight` at top level; no vision tower and no MTP head (both
loaders skip them; transformers' ConditionalGeneration class reports model.visual.* missing). Their
zero-centred RMSNorms, which apply (1 + w), are written as 0 (scale 1), the Gated DeltaNet's gated
norm (plain w) as 1, A_log as log(uniform(1, 16)) and dt_bias as 1 (transformers' _init_weights), so
the GDN decays stay in (0, 1). MoE experts are per-expert tensors (mlp.experts.{e}.{gate,up,down}_proj),
the layout the official checkpoints have, which transformers' qwen3_5_moe_text conversion (qwen2_moe's
MergeModulelist + Concatenate) fuses into experts.gate_up_proj / experts.down_proj at load.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from kiln.models.reference_shapes import HYBRID_SHAPES, SHAPES, TEST_SHAPES

ALL_SHAPES = {**SHAPES, **HYBRID_SHAPES, **TEST_SHAPES}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
# architecture -> (config.json model_type, text_config model_type)
HYBRID_MODEL_TYPES = {"Qwen3_5ForConditionalGeneration": ("qwen3_5", "qwen3_5_text"),
                      "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "qwen3_5_moe_text")}
TEXT_PREFIX = "model.language_model."  # the hybrids' text tower (ConditionalGeneration)
UNK, BOS, EOS = "<unk>", "<s>", "</s>"  # ids 0, 1, 2
POOL_ELEMS = 1 << 24  # 32 MB of bf16 values, tiled into every weight
CHUNK_ELEMS = 1 << 23  # elements per write call


def hf_config(shape: str) -> dict:
    """The config.json of a shape: flat for llama / qwen3; for the hybrids the ConditionalGeneration
    form, the text tower's fields under text_config (the ids are the synthetic tokenizer's)."""
    cfg = copy.deepcopy(ALL_SHAPES[shape])
    arch = cfg["architectures"][0]
    common = dict(bos_token_id=1, eos_token_id=2, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
                  initializer_range=0.02, use_cache=True)
    if arch in HYBRID_MODEL_TYPES:
        outer_type, text_type = HYBRID_MODEL_TYPES[arch]
        del cfg["architectures"]
        cfg.update(common, model_type=text_type, dtype="bfloat16")
        return {"architectures": [arch], "model_type": outer_type, "text_config": dict(sorted(cfg.items())),
                "tie_word_embeddings": cfg["tie_word_embeddings"], "torch_dtype": "bfloat16"}
    cfg.update(model_type=MODEL_TYPES[arch], torch_dtype="bfloat16", **common)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and [out, in] shapes of a checkpoint of hf_config's, in file order."""
    if "text_config" in cfg:
        return _hybrid_weight_shapes(cfg)
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
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers", [])
        if cfg.get("num_experts") and layer not in dense and (layer + 1) % step == 0:
            # Qwen3-MoE: the router and per-expert tensors (transformers' save format)
            e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = (e, h)
            for x in range(e):
                out[p + f"mlp.experts.{x}.gate_proj.weight"] = (mi, h)
                out[p + f"mlp.experts.{x}.up_proj.weight"] = (mi, h)
                out[p + f"mlp.experts.{x}.down_proj.weight"] = (h, mi)
            continue
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    return out


def _hybrid_weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """A Qwen3.5/3.6 ConditionalGeneration checkpoint's text tower and head (spec 8.2): per layer the
    gated attention (q_proj 2x wide: per head [query | gate]) or the Gated DeltaNet, then a dense MLP
    or a MoE block with per-expert tensors and a shared expert."""
    t = cfg["text_config"]
    h, v = t["hidden_size"], t["vocab_size"]
    d, nq, nkv = t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"]
    hk, hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv, kc = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
    conv_dim = 2 * hk * dk + hv * dv  # the conv's channels: q | k | v
    out: dict[str, tuple[int, ...]] = {TEXT_PREFIX + "embed_tokens.weight": (v, h)}
    for layer, kind in enumerate(t["layer_types"]):
        p = f"{TEXT_PREFIX}layers.{layer}."
        out[p + "input_layernorm.weight"] = (h,)
        if kind == "full_attention":
            a = p + "self_attn."
            out[a + "q_proj.weight"] = (2 * nq * d, h)
            out[a + "k_proj.weight"] = (nkv * d, h)
            out[a + "v_proj.weight"] = (nkv * d, h)
            out[a + "o_proj.weight"] = (h, nq * d)
            out[a + "q_norm.weight"] = (d,)
            out[a + "k_norm.weight"] = (d,)
        else:
            la = p + "linear_attn."
            out[la + "in_proj_qkv.weight"] = (conv_dim, h)
            out[la + "in_proj_z.weight"] = (hv * dv, h)
            out[la + "in_proj_b.weight"] = (hv, h)
            out[la + "in_proj_a.weight"] = (hv, h)
            out[la + "conv1d.weight"] = (conv_dim, 1, kc)
            out[la + "A_log"] = (hv,)
            out[la + "dt_bias"] = (hv,)
            out[la + "norm.weight"] = (dv,)
            out[la + "out_proj.weight"] = (h, hv * dv)
        out[p + "post_attention_layernorm.weight"] = (h,)
        m = p + "mlp."
        if t.get("num_experts"):
            ie, ish = t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
            out[m + "gate.weight"] = (t["num_experts"], h)
            for e in range(t["num_experts"]):
                out[f"{m}experts.{e}.gate_proj.weight"] = (ie, h)
                out[f"{m}experts.{e}.up_proj.weight"] = (ie, h)
                out[f"{m}experts.{e}.down_proj.weight"] = (h, ie)
            out[m + "shared_expert.gate_proj.weight"] = (ish, h)
            out[m + "shared_expert.up_proj.weight"] = (ish, h)
            out[m + "shared_expert.down_proj.weight"] = (h, ish)
            out[m + "shared_expert_gate.weight"] = (1, h)
        else:
            i = t["intermediate_size"]
            out[m + "gate_proj.weight"] = (i, h)
            out[m + "up_proj.weight"] = (i, h)
            out[m + "down_proj.weight"] = (h, i)
    out[TEXT_PREFIX + "norm.weight"] = (h,)
    if not t.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    return out


def fixed_values(cfg: dict, shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """The tensors not drawn from the pool, as bf16 arrays: llama / qwen3 norms are 1; a hybrid's
    (1 + w) norms 0 and its GDN gated norm 1, A_log log(uniform(1, 16)), dt_bias 1."""
    rng = np.random.default_rng([seed, 1])  # apart from the pool's phases: llama / qwen3 files stay the same
    hybrid = "text_config" in cfg
    out: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        if name.endswith(".A_log") and hybrid:
            out[name] = np.log(rng.uniform(1.0, 16.0, n))
        elif name.endswith(".dt_bias") and hybrid:
            out[name] = np.ones(n)
        elif name.endswith("linear_attn.norm.weight") or (name.endswith("norm.weight") and not hybrid):
            out[name] = np.ones(n)
        elif name.endswith("norm.weight"):
            out[name] = np.zeros(n)
    return {k: a.astype(ml_dtypes.bfloat16) for k, a in out.items()}


def checkpoint_bytes(shape: str) -> int:
    """The bytes of a shape's safetensors data (bf16), headers aside: what --dry-run reports."""
    return sum(2 * math.prod(s) for s in weight_shapes(hf_config(shape)).values())


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
                      pool: np.ndarray, rng: np.random.Generator, progress=lambda n: None,
                      fixed: dict[str, np.ndarray] | None = None) -> None:
    """One shard: `fixed` tensors as given (None: the ones of every *norm.weight, llama's rule),
    every other a run of the pool from a random phase."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        n = 2 * math.prod(shapes[name])
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer keeps it
    if fixed is None:
        fixed = {n: np.ones(math.prod(shapes[n]), dtype=ml_dtypes.bfloat16) for n in names
                 if n.endswith("norm.weight")}
    pool_bytes = pool.view(np.uint8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            elems = math.prod(shapes[name])
            if name in fixed:
                f.write(np.ascontiguousarray(fixed[name], dtype=ml_dtypes.bfloat16).tobytes())
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
                      show_progress: bool = False, spill_dir: str | Path | None = None,
                      keep_gb: float = 0.0) -> Path:
    """Write the checkpoint into `out` (created; existing files of the same names are replaced); -> out.
    spill_dir: once `keep_gb` GB of shards are in `out`, the rest are written there and symlinked into
    `out` (a checkpoint larger than one filesystem: the 35B-A3B shape is 69 GB, the H200 machine's disk
    64 GiB, so part of it goes to /dev/shm)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape)
    shapes = weight_shapes(cfg)
    fixed = fixed_values(cfg, shapes, seed)
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
    kept = 0
    for fname, names in zip(files, shards):
        path = out / fname
        if spill_dir is not None and kept >= keep_gb * 1e9:
            Path(spill_dir).mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            path.symlink_to(Path(spill_dir).resolve() / fname)
        write_safetensors(path, names, shapes, pool, rng, bar.update if bar else lambda n: None, fixed)
        kept += sum(2 * math.prod(shapes[n]) for n in names)
    if bar:
        bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(out, cfg.get("text_config", cfg)["vocab_size"])
    return out


def _shape_list() -> str:
    lines = ["shapes:"]
    for name in sorted(ALL_SHAPES):
        arch = ALL_SHAPES[name]["architectures"][0]
        b = checkpoint_bytes(name)
        size = f"{b / 1e9:8.2f} GB" if b >= 1e8 else f"{b / 1e6:8.2f} MB"
        lines.append(f"  {name:18s} {arch:36s} {size}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=_shape_list(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(ALL_SHAPES))
    ap.add_argument("--out", help="checkpoint directory to write (required unless --dry-run)")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="largest shard size in GB (1e9 bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spill-dir", help="write the shards past --keep-gb here and symlink them into --out "
                    "(a checkpoint larger than --out's filesystem; e.g. /dev/shm)")
    ap.add_argument("--keep-gb", type=float, default=0.0, help="with --spill-dir: GB of shards kept in --out")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the tensor count, bytes and shards the shape would write; write nothing")
    a = ap.parse_args(argv)
    if a.dry_run:
        shapes = weight_shapes(hf_config(a.shape))
        total = checkpoint_bytes(a.shape)
        n_shards = len(plan_shards(shapes, int(a.shard_gb * 1e9)))
        print(f"{a.shape}: {len(shapes)} tensors, {total} bytes ({total / 1e9:.2f} GB, {total / 2**30:.2f} GiB), "
              f"{n_shards} shard(s) of at most {a.shard_gb:g} GB")
        return 0
    if not a.out:
        ap.error("--out is required (or pass --dry-run)")
    t0 = time.perf_counter()
    out = make_random_model(a.shape, a.out, shard_gb=a.shard_gb, seed=a.seed, show_progress=True,
                            spill_dir=a.spill_dir, keep_gb=a.keep_gb)
    print(f"wrote {a.shape} to {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
