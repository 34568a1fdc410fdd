"""kiln: an LLM inference and serving engine that compiles models ahead of time."""

from kiln.errors import (  # noqa: F401
    ChatTemplateError,
    ConfigError,
    InvalidModelError,
    KilnError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # `from kiln import LLM, SamplingParams, AsyncLLM` without importing the engine on `import kiln`
    if name in ("LLM", "EngineArgs"):
        from kiln.entrypoints import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from kiln.runtime.sample.sampling_params import SamplingParams

        return SamplingParams
    if name == "AsyncLLM":
        from kiln.entrypoints.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
