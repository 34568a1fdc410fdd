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
