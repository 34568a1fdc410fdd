"""The command line as a newcomer meets it: every flag of every subcommand has a help line that
states its default, `compile` shows progress and a one-line summary (the full list of default
kernel configs only with --verbose, and in the bundle), and a GPU target without the gpu extra
names the README's install command."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.build import build_parser
from kiln.runtime.worker.bundle import Bundle
from tests.tiny_models import make_tiny_model

REPO = Path(__file__).resolve().parents[1]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_subcommand_is_there():
    assert set(subcommands()) == {"generate", "compile", "tune", "serve", "bench"}


@pytest.mark.parametrize("name", ["generate", "compile", "tune", "serve", "bench"])
def test_every_flag_has_help_and_its_default(name):
    p = subcommands()[name]
    fmt = p._get_formatter()
    missing = []
    for action in p._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        text = fmt._expand_help(action) if action.help else ""
        if not text:
            missing.append(f"{flag}: no help")
        elif action.required:
            if "required" not in text:
                missing.append(f"{flag}: required, and its help does not say so")
        elif "default" not in text.lower():
            missing.append(f"{flag}: the help does not state the default ({text!r})")
    assert not missing, f"`{name} --help`:\n" + "\n".join(missing)


def test_serve_help_as_a_user_reads_it():
    out = subprocess.run([sys.executable, str(REPO / "build.py"), "serve", "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    blocks: dict[str, str] = {}  # flag -> its help text, one block per option as argparse prints them
    for line in out[out.index("options:"):].splitlines()[1:]:
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            blocks[flag] = line
        elif line.startswith("   "):
            blocks[flag] += " " + line.strip()
    for flag, default in [("--host", "127.0.0.1"), ("--max-num-seqs", "256"), ("--max-num-batched-tokens", "2048"),
                          ("--scheduling-policy", "fcfs")]:
        assert f"(default: {default})" in " ".join(blocks[flag].split()), blocks[flag]
    assert "default: on;" in " ".join(blocks["--enable-prefix-caching"].split())
    assert "default: max(1, max-num-seqs / 4)" in " ".join(blocks["--num-state-snapshots"].split())
    flat = " ".join(out.split())
    assert "(default: the model's context)" in flat  # --max-model-len: None, said in words


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_llama_cli")
    make_tiny_model(d, "llama_gqa_untied")
    return d


def compile_cli(model: Path, out: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    """`build.py compile` of a small bundle for sm_90 (no GPU), kernels cached under `cache`."""
    cmd = [sys.executable, str(REPO / "build.py"), "compile", "--model", str(model), "--target", "sm_90",
           "--out", str(out), "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
           *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "KILN_CACHE_DIR": str(cache)})


def test_compile_prints_a_summary_and_verbose_the_list(tiny_dir, tmp_path):
    """Fresh kernel cache: the bars count the buckets lowered and the kernels compiled; the
    default configs are one count in the summary, listed one per line with --verbose, and
    recorded in the bundle's manifest."""
    proc = compile_cli(tiny_dir, tmp_path / "b1", tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    manifest = Bundle.read(tmp_path / "b1").manifest
    n_kernels, n_buckets, defaults = len(manifest["kernels"]), len(manifest["plans"]), manifest["default_configs"]
    assert defaults and all(isinstance(d, str) for d in defaults)
    err = proc.stderr
    assert f"lowering {n_buckets} buckets" in err and f"{n_buckets}/{n_buckets}" in err
    assert f"compiling {n_kernels} kernels for sm_90" in err and f"{n_kernels}/{n_kernels}" in err
    summary = [ln for ln in err.splitlines() if "kernel configs use kiln's defaults" in ln]
    assert len(summary) == 1 and f"{len(defaults)} kernel configs" in summary[0] and "--verbose" in summary[0]
    assert len(summary[0]) < 300  # a summary, not the list
    assert not any(d in err for d in defaults)
    assert err.strip().splitlines()[-1].startswith(f"[kiln] wrote {tmp_path / 'b1'} for sm_90 in ")

    verbose = compile_cli(tiny_dir, tmp_path / "b2", tmp_path / "cache", "--verbose", "--no-progress")
    assert verbose.returncode == 0, verbose.stderr
    listed = [ln.strip()[len("default: "):] for ln in verbose.stderr.splitlines() if ln.startswith("  default: ")]
    assert listed == defaults
    assert "unchanged since the last compile" in verbose.stderr  # the same bundle, from the cache
    assert "kernels for sm_90:" not in verbose.stderr  # --no-progress: no bars


def test_gpu_target_without_the_gpu_extra_names_the_readme_install(tiny_dir, tmp_path):
    """No triton (compile) or no cuda-python (run): one sentence naming README's install command."""
    readme = (REPO / "README.md").read_text()
    assert "pip install -e '.[gpu]'" in readme
    code = ("import sys; sys.modules['triton'] = None; from kiln.build import main; "
            f"sys.exit(main(['compile', '--model', {str(tiny_dir)!r}, '--target', 'sm_90', '--out', "
            f"{str(tmp_path / 'b')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs triton" in proc.stderr and "pip install -e '.[gpu]'" in proc.stderr
    assert "kiln[gpu]" not in proc.stderr
    code = ("import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None\n"
            "from kiln.runtime.worker.cuda_driver import CudaError, _drv\n"
            "try:\n    _drv()\nexcept CudaError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "cuda-python is not installed" in out.stdout and "pip install -e '.[gpu]'" in out.stdout


def test_console_script_is_the_same_cli():
    """pyproject installs `kiln` as build.py's main."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"kiln": "kiln.build:main"}


def test_compile_needs_only_config_json(tiny_dir, tmp_path):
    """Compiling reads no weights: a directory holding only the model's config.json gives the same
    plans as the checkpoint (the weights are read at load)."""
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(Path(tiny_dir) / "config.json", bare / "config.json")
    full = compile_cli(tiny_dir, tmp_path / "b1", tmp_path / "cache", "--no-progress")
    only = compile_cli(bare, tmp_path / "b2", tmp_path / "cache", "--no-progress")
    assert full.returncode == 0 and only.returncode == 0, only.stderr
    assert Bundle.read(tmp_path / "b1").manifest["plans"] == Bundle.read(tmp_path / "b2").manifest["plans"]
