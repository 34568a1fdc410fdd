"""`build.py serve` refuses what it cannot serve before it loads anything, in one sentence and
exit 1 (issue 42 #5, #6, #12): a port already in use, a chat template that does not parse (the
flag's, or the model's own, found at load rather than at the first request), and a GPU target
on a machine without cuda-python or a driver."""
from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

BUILD = Path(__file__).resolve().parents[2] / "build.py"


def serve(*args: str, pre: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """build.py serve in a fresh interpreter (pre: Python run first, to hide a module)."""
    code = f"{pre}\nimport sys\nfrom kiln.build import main\nsys.exit(main(['serve', *sys.argv[1:]]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)


def one_sentence(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    assert "serving" not in proc.stdout
    return lines[0]


def test_port_in_use_is_reported_before_the_model_loads(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        # the model does not exist: had it been loaded first, that would be the error
        err = one_sentence(serve("--port", str(port), "--model", str(tmp_path / "no-such-model")))
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err


def test_chat_template_flag_that_does_not_parse(tmp_path):
    err = one_sentence(serve("--port", "0", "--model", str(tmp_path / "no-such-model"),
                             "--chat-template", "{% for m in messages %}{{ m.content }"))
    assert "chat template" in err and "line 1" in err


def test_models_own_template_that_does_not_parse(tiny_chat_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_chat_dir, broken)
    cfg = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{% if %}"}))
    err = one_sentence(serve("--port", "0", "--model", str(broken), "--kv-cache-tokens", "1024"))
    assert "chat template" in err and "syntax error" in err


@pytest.mark.parametrize("engine_process", ["--engine-process", "--no-engine-process"])
def test_gpu_target_without_cuda_python(tiny_chat_dir, engine_process):
    hide = "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None"
    err = one_sentence(serve("--port", "0", "--model", str(tiny_chat_dir), "--target", "sm_90", engine_process,
                             pre=hide))
    assert "cuda-python is not installed" in err and "pip install -e '.[gpu]'" in err and "kiln[gpu]" not in err


@pytest.mark.skipif(importlib.util.find_spec("cuda") is None, reason="cuda-python is not installed here")
@pytest.mark.parametrize("engine_process", ["--engine-process", "--no-engine-process"])
def test_gpu_target_without_a_driver(tiny_chat_dir, engine_process):
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a GPU")
    err = one_sentence(serve("--port", "0", "--model", str(tiny_chat_dir), "--target", "sm_90", engine_process))
    assert "sm_90" in err and "driver" in err
