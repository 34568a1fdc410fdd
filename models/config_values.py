"""The checked values of a config.json: each reader takes the dict, a key and the file's name, and
returns the value or raises ConfigError with one sentence naming the key and what it holds.

Why a module of its own (issue 42 #12): config.json is user input. `float("x")`, `int("abc")`,
`bool("false")` (True) and NaN used to pass through or raise bare tracebacks, and an absurd size
(num_hidden_layers: 1000000000) sized allocations before any weight was looked at.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from kiln.errors import ConfigError

# Bounds no real checkpoint comes near (the largest today: ~130 layers, widths of 16k-50k, vocabularies
# of 256k, contexts of 10M): a config past one is a lie, refused before anything is sized by it (issue
# 42 #12: num_hidden_layers 1e9 built graph nodes until the machine ran out of memory).
LIMITS = {"num_hidden_layers": 1024, "vocab_size": 1 << 24, "max_position_embeddings": 1 << 28,
          "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
          "num_experts": 1 << 14, "num_local_experts": 1 << 14, "num_experts_per_tok": 1 << 14}
MAX_WIDTH = 1 << 20  # hidden, intermediate and every other size not named above


def pos_int(d: Mapping[str, Any], key: str, source: str) -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {v!r}")
    if v > LIMITS.get(key, MAX_WIDTH):
        raise ConfigError(f"{source}: {key} is {v}, more than any model has (at most {LIMITS.get(key, MAX_WIDTH)})")
    return v


def opt_int(d: Mapping[str, Any], key: str, source: str, default: int) -> int:
    """An optional size that may be 0."""
    if d.get(key) in (None, 0):
        return default
    return pos_int(d, key, source)


def real(d: Mapping[str, Any], key: str, source: str, default: float, upper: float | None = None,
          inclusive: bool = False) -> float:
    """A finite number > 0 (and < upper, or <= upper when inclusive): NaN, infinities, strings
    and booleans are refused by name instead of failing (or silently running) later."""
    v = d.get(key)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    if ok and upper is not None:
        ok = v <= upper if inclusive else v < upper
    if not ok:
        bound = f" and {'at most' if inclusive else 'below'} {upper}" if upper is not None else ""
        raise ConfigError(f"{source}: {key} must be a finite number above 0{bound}, got {v!r}")
    return float(v)


def flag(d: Mapping[str, Any], key: str, source: str, default: bool = False) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):  # bool("false") is True: a string here would flip silently
        raise ConfigError(f"{source}: {key} must be true or false, got {v!r}")
    return v
