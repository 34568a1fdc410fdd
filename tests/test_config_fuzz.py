"""config.json that lies (issue 42 #12): every key from_hf_dict reads, given a hostile value
(strings, NaN, infinities, zero, negatives, absurd sizes, lists, objects, booleans), gives either a
ModelConfig whose sizes are positive and bounded and whose floats are finite, or one ConfigError
sentence; never another exception. The cases the issue names go through open_model and the
tokenizer too: num_hidden_layers 1e9 is refused before anything is sized by it."""
from __future__ import annotations

import json
import math
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.errors import ConfigError, InvalidModelError, KilnError
from kiln.models.config import ModelConfig
from kiln.models.config_values import LIMITS, MAX_WIDTH
from kiln.models.source import open_model
from kiln.runtime.text.tokenizer import Tokenizer

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False}
KEYS = sorted({*BASE, "head_dim", "partial_rotary_factor", "rope_scaling", "rope_parameters", "attention_bias",
               "mlp_bias", "hidden_act", "text_config", "num_experts", "num_experts_per_tok",
               "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step",
               "mlp_only_layers", "torch_dtype"})
HOSTILE = st.one_of(
    st.sampled_from([0, -1, -(1 << 40), 10 ** 9, 10 ** 30, float("nan"), float("inf"), -float("inf"), 0.0, 1e308,
                     "x", "abc", "", "2", True, False, None, [], [1], {}, {"rope_type": "yarn"}, {"factor": "x"}]),
    st.integers(-(1 << 70), 1 << 70), st.floats(), st.text(max_size=3),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def _sane(cfg: ModelConfig) -> None:
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "max_position_embeddings"):
        v = getattr(cfg, name)
        assert isinstance(v, int) and 0 < v <= LIMITS.get(name, MAX_WIDTH), (name, v)
    assert 0 <= cfg.intermediate_size <= MAX_WIDTH
    for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
        v = getattr(cfg, name)
        assert isinstance(v, float) and math.isfinite(v) and v > 0, (name, v)
    assert all(isinstance(getattr(cfg, f), bool) for f in ("tie_word_embeddings", "attention_bias", "mlp_bias"))


@settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.sampled_from(KEYS), HOSTILE), min_size=1, max_size=3))
def test_hostile_values_give_a_config_or_one_sentence(edits):
    d = dict(BASE)
    for key, value in edits:
        d[key] = value
    try:
        cfg = ModelConfig.from_hf_dict(d)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("config.json")
        return
    _sane(cfg)
    cfg.compute_hash()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.server.tiny_chat_model import make_tiny_chat_model
    return make_tiny_chat_model(tmp_path_factory.mktemp("config_fuzz"))


def _with_config(tmp_path, tiny_dir, **edits):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edits)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").unlink(missing_ok=True)
    return d


@pytest.mark.parametrize("edits, error, says", [
    ({"num_hidden_layers": 1_000_000_000}, ConfigError, "num_hidden_layers is 1000000000, more than any model"),
    ({"num_hidden_layers": 900}, InvalidModelError, "num_hidden_layers is 900, but the weights hold 2 layers"),
    ({"head_dim": 0}, ConfigError, "head_dim must be a positive integer, got 0"),
    ({"rope_theta": float("nan")}, ConfigError, "rope_theta must be a finite number above 0, got nan"),
    ({"rms_norm_eps": "x"}, ConfigError, "rms_norm_eps must be a finite number above 0 and below 1.0, got 'x'"),
    ({"tie_word_embeddings": "false"}, ConfigError, "tie_word_embeddings must be true or false"),
    ({"max_position_embeddings": "4096"}, ConfigError, "max_position_embeddings must be a positive integer"),
])
def test_the_issues_config_lies_are_one_sentence_at_open(tmp_path, tiny_dir, edits, error, says):
    with pytest.raises(error, match=says):
        open_model(_with_config(tmp_path, tiny_dir, **edits))


@pytest.mark.parametrize("value", ["abc", ["abc"], [1.5], -3, True])
def test_eos_token_id_that_is_not_an_id_is_one_sentence(tmp_path, tiny_dir, value):
    d = _with_config(tmp_path, tiny_dir, eos_token_id=value)
    with pytest.raises(KilnError, match=r"config\.json: eos_token_id must be a token id or a list of token ids"):
        Tokenizer.from_dir(d)
