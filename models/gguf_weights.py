"""GGUF files (llama.cpp) as a weight source with Hugging Face names and layout.

A GGUF stores tensors under llama.cpp names, with shapes in ggml order (fastest axis
first, the reverse of numpy's), mostly quantized in blocks, and for the "llama"
architecture with the rows of q/k permuted for llama.cpp's rotary layout. We undo all
three, so that every tensor equals what transformers loads from the same file and one
graph builder serves safetensors and GGUF checkpoints alike.

The metadata is exposed as plain Python values; it is also where the config
(gguf_config.py) and the tokenizer (runtime/text/tokenizer.py) come from.
"""
from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kiln.errors import InvalidModelError
from kiln.models.gguf_config import TENSOR_NAMES_KEY, gguf_to_hf_config  # noqa: F401 (re-export)
from kiln.models.weights import WeightSource

# Per-layer leaf names, llama.cpp -> HF (llama and qwen3 share them).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts (qwen3moe; the shared expert of qwen2moe-style models): stacked experts
    # [E, I, H] / [E, H, I] under names models/moe_weights.py turns into the graph's stacked weights
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")

# Stored types returned as their own numpy dtype under keep_dtype=True; every other
# type is quantized blocks and always comes back dequantized to float32.
_NATIVE = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.BF16: np.dtype(ml_dtypes.bfloat16),
}
# Plain numeric types the reader already maps to numpy dtypes (not quantized, not float).
_PLAIN = {GGMLQuantizationType.F64, GGMLQuantizationType.I8, GGMLQuantizationType.I16,
          GGMLQuantizationType.I32, GGMLQuantizationType.I64}


def hf_name(gguf_name: str) -> str:
    """The HF name of a llama.cpp tensor; names we do not know (rope_freqs) stay as they are."""
    if m := _LAYER_RE.fullmatch(gguf_name):
        leaf = LAYER_NAMES.get(m[2])
        return f"model.layers.{m[1]}.{leaf}.{m[3]}" if leaf else gguf_name
    if (m := _GLOBAL_RE.fullmatch(gguf_name)) and m[1] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[m[1]]}.{m[2]}"
    return gguf_name


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute on q (n_head) or k (n_kv_head) rows.

    llama.cpp regroups each head's rows from HF's [first half | second half] of the
    rotary pairs to interleaved pairs: reshape(n_head, 2, d/2, ...).swapaxes(1, 2).
    The inverse reads the rows as (n_head, d/2, 2) and swaps back. Works on biases too.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _CheckedReader(GGUFReader):
    """GGUFReader that states how much tensor data a truncated file lacks.

    The stock reader fails on a short file with a numpy reshape error; the check below
    runs first, on the tensor table it has just parsed, and names the missing bytes.
    """

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path)

    def _build_tensors(self, start_offs, fields):
        need = self._tensor_bytes_needed(fields)
        have = len(self.data) - start_offs
        if need is not None and need > have:
            raise InvalidModelError(
                f"model file {self.path} is truncated or corrupt: expected {need} bytes of "
                f"tensor data, found {max(have, 0)}")
        super()._build_tensors(start_offs, fields)

    @staticmethod
    def _tensor_bytes_needed(fields) -> int | None:
        # Each tensor-info field's parts: name length, name, n_dims, dims (ggml order),
        # type, offset. A layout we do not recognise (a future gguf) skips the check and
        # leaves the stock reader to fail, rather than rejecting a good file.
        try:
            need = 0
            for field in fields:
                dims, raw_type, offset = field.parts[3], field.parts[4], field.parts[5]
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                need = max(need, int(offset[0]) + int(np.prod(dims)) * type_size // block)
            return need
        except (IndexError, KeyError, ValueError, TypeError):
            return None


def _count(metadata: dict, key: str, path: Path, default: int | None = None) -> int:
    """A positive integer of the metadata (a head or part count), or one sentence naming it."""
    v = metadata.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise InvalidModelError(f"model file {path} has {key} = {v!r} in its metadata, not a positive integer")
    return v


class GGUFWeights(WeightSource):
    """Tensors of one GGUF file under HF names, [out, in] layout, dequantized on demand."""

    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            reader = _CheckedReader(path)
            # (contents() decodes strings and arrays: a lying type or length fails here too)
            self.metadata = {name: field.contents() for name, field in reader.fields.items()}
        except InvalidModelError:
            raise
        except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as e:
            # Whatever gguf trips over in a damaged header; its message says where.
            raise InvalidModelError(f"model file {path} is truncated or corrupt: {e}") from None
        self.metadata[TENSOR_NAMES_KEY] = [t.name for t in reader.tensors]
        if _count(self.metadata, "split.count", path, 1) > 1:
            raise InvalidModelError(
                f"model file {path} is one part of a {self.metadata['split.count']}-file split GGUF; "
                "merge the parts with llama-gguf-split --merge first")
        self.architecture = self.metadata.get("general.architecture")
        self._tensors = {hf_name(t.name): t for t in reader.tensors}
        # llama.cpp permutes q/k rows only when converting to its "llama" architecture.
        self._heads: dict[str, int] = {}
        if self.architecture == "llama":
            if "llama.attention.head_count" not in self.metadata:
                raise InvalidModelError(f"model file {path} lacks llama.attention.head_count in its metadata")
            n_head = _count(self.metadata, "llama.attention.head_count", path)
            n_kv = _count(self.metadata, "llama.attention.head_count_kv", path, n_head)
            for name in self._tensors:
                if ".self_attn.q_proj." in name:
                    self._heads[name] = n_head
                elif ".self_attn.k_proj." in name:
                    self._heads[name] = n_kv
        # GGUF shapes are ggml `ne` (fastest axis first); reversed they are HF's [out, in].
        shapes = {n: tuple(int(d) for d in reversed(t.shape)) for n, t in self._tensors.items()}
        for n, shape in shapes.items():  # llama.cpp keeps the shared expert's gate as [H]; HF's is [1, H]
            if n.endswith(".mlp.shared_expert_gate.weight") and len(shape) == 1:
                shapes[n] = (1, *shape)
        super().__init__(path, shapes)

    @property
    def tied_embeddings(self) -> bool:
        """llama.cpp writes no output.weight when lm_head is the embedding matrix."""
        return "lm_head.weight" not in self._tensors

    def ggml_type(self, name: str) -> GGMLQuantizationType:
        self._check(name)
        return self._tensors[name].tensor_type

    def raw_blocks(self, name: str) -> np.ndarray:
        """A tensor's stored bytes, u8 [..., rows, bytes a row], rows in HF order (the q/k rows of a
        llama file un-permuted, each row's blocks moving with it): what a kernel that dequantises
        blocks itself reads (models/gguf_quant.py)."""
        self._check(name)
        w = np.asarray(self._tensors[name].data).view(np.uint8).reshape(*self._shapes[name][:-1], -1)
        return self._unpermute(name, w)

    def _unpermute(self, name: str, w: np.ndarray) -> np.ndarray:
        if name in self._heads:
            if w.shape[0] % (2 * self._heads[name]):
                raise InvalidModelError(f"model file {self.path}: {name} has {w.shape[0]} rows, which its "
                                        f"{self._heads[name]} heads do not divide into rotary pairs")
            w = unpermute_qk(w, self._heads[name])
        return w

    def _load(self, name: str, keep_dtype: bool) -> np.ndarray:
        t = self._tensors[name]
        shape = self._shapes[name]
        if keep_dtype and t.tensor_type in _NATIVE:
            w = np.asarray(t.data).view(_NATIVE[t.tensor_type]).reshape(shape)
        elif t.tensor_type in _PLAIN:
            w = np.asarray(t.data).reshape(shape)
        else:
            try:
                w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            except NotImplementedError:
                raise InvalidModelError(
                    f"model file {self.path} stores {name} as {t.tensor_type.name}, "
                    "which the gguf package cannot dequantize") from None
        return self._unpermute(name, w)

