"""GGUF headers that lie (issue 42 #12), fuzzed with hypothesis (derandomized, bounded): a small
valid GGUF with bytes of its header (counts, string lengths, value types, tensor dims, types and
offsets) overwritten by hostile values, or cut short. Opening it, reading the config it implies and loading
every tensor either works or raises a KilnError sentence: never another exception, and never an
allocation sized by a header field (traced peak memory stays small for a 2 KB file)."""
from __future__ import annotations

import struct
import tracemalloc

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.errors import KilnError
from kiln.models.gguf_weights import GGUFWeights
from kiln.models.source import open_model


def _write_small_gguf(path) -> tuple[bytes, int]:
    """-> (the file's bytes, where its tensor data starts)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(3)
    w.add_token_list(["a", "b", "c"])
    w.add_string("general.name", "fuzz")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((8, 8)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    return data, gguf.GGUFReader(str(path)).tensors[0].data_offset


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return _write_small_gguf(tmp_path_factory.mktemp("gguf") / "base.gguf")


def _open_everything(path) -> None:
    tracemalloc.start()
    try:
        try:
            w = open_model(path).weights  # the header, the config it implies, the layer check
            for name in w.names():
                w.get(name)
        except KilnError as e:
            assert "\n" not in str(e)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak} bytes traced for a {path.stat().st_size}-byte file"


HOSTILE_WORDS = st.one_of(
    st.sampled_from([0, 1, 2, 7, 255, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63) - 1, (1 << 64) - 1]),
    st.integers(0, (1 << 64) - 1))


def test_the_unmutated_file_loads(small, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(small[0])
    w = GGUFWeights(path)
    assert sorted(w.names()) == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                                 "model.layers.0.self_attn.q_proj.weight"]


@settings(max_examples=300, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(where=st.integers(0, 4095), width=st.sampled_from([1, 2, 4, 8]), value=HOSTILE_WORDS)
def test_a_lying_header_word(small, tmp_path_factory, where, width, value):
    data, header_end = small
    pos = where % (header_end - width)
    word = struct.pack("<Q", value)[:width]
    path = tmp_path_factory.mktemp("g") / "m.gguf"
    path.write_bytes(data[:pos] + word + data[pos + width:])
    _open_everything(path)


@settings(max_examples=60, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 4095))
def test_a_file_cut_short(small, tmp_path_factory, cut):
    data, _ = small
    path = tmp_path_factory.mktemp("g") / "m.gguf"
    path.write_bytes(data[:cut % len(data)])
    _open_everything(path)
