"""Bad input: one clear sentence, exit code 1 from build.py, a typed exception from the API."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.errors import (ConfigError, InvalidModelError, ModelNotFoundError,
                         UnsupportedArchitectureError)
from kiln.loader import load
from tests.tiny_models import make_tiny_model

REPO = Path(__file__).resolve().parent.parent


def run_generate(model: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "build.py"), "generate", "--model", str(model),
                           "--prompt", "hi", "--max-tokens", "2"], capture_output=True, text=True, timeout=300)


def assert_one_sentence(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model(d, "llama_gqa_untied")
    return d


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load(missing)
    assert_one_sentence(run_generate(missing), "does not exist")


def test_truncated_safetensors(tiny_dir, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(tiny_dir, bad)
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(InvalidModelError, match="model.safetensors"):
        load(bad)
    assert_one_sentence(run_generate(bad), "model.safetensors")


def test_truncated_gguf(smollm2_gguf, tmp_path):
    bad = tmp_path / "half.gguf"
    with open(smollm2_gguf, "rb") as f:
        bad.write_bytes(f.read(smollm2_gguf.stat().st_size // 2))
    with pytest.raises(InvalidModelError):
        load(bad)
    assert_one_sentence(run_generate(bad), "half.gguf")


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_architecture(tiny_dir, tmp_path):
    bad = _edit_config(tiny_dir, tmp_path / "m", architectures=["FancyNewModelForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="FancyNewModelForCausalLM"):
        load(bad)
    assert_one_sentence(run_generate(bad), "FancyNewModelForCausalLM", "not supported")


def test_config_missing_required_key(tiny_dir, tmp_path):
    bad = _edit_config(tiny_dir, tmp_path / "m", hidden_size=None)
    with pytest.raises(ConfigError, match="hidden_size"):
        load(bad)
    assert_one_sentence(run_generate(bad), "hidden_size")
