"""Typed errors a user can cause. Each carries one clear sentence.

build.py prints `str(err)` and exits 1; the Python API lets them propagate.
Everything else (a bug in kiln) is not a KilnError and keeps its traceback.
"""

# What a GPU target needs that `pip install -e .` does not bring (triton, cuda-python): the
# README's install command, named by every error that finds them missing.
GPU_INSTALL_HINT = "run `pip install -e '.[gpu]'` in the kiln checkout (README: serving on the H200)"


class KilnError(Exception):
    """Base of every error a user can cause and fix."""


class ModelNotFoundError(KilnError, FileNotFoundError):
    """The model path does not exist or holds no model files."""


class InvalidModelError(KilnError, ValueError):
    """A model file is truncated, corrupt or inconsistent with its config."""


class UnsupportedArchitectureError(KilnError, ValueError):
    """The model's architecture has no graph builder in kiln."""


class ConfigError(KilnError, ValueError):
    """A model config lacks a required key or holds an invalid value."""


class UnsupportedQuantizationError(KilnError, ValueError):
    """A checkpoint's quantization (method, scheme or layout) is one kiln cannot run: refused, never
    run as if unquantized."""


class ChatTemplateError(KilnError, ValueError):
    """A chat template failed to render: a syntax error, raise_exception(), or a sandbox refusal."""
