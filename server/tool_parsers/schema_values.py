"""A qwen3_coder parameter's text -> the JSON value its schema type asks for (vLLM:
qwen3coder_tool_parser.py Qwen3CoderToolParser._convert_param_value).

The XML format writes every value as bare text (`<parameter=days>\\n3\\n</parameter>`); the
tool's JSON schema says whether "3" is the number 3 or the string "3". Text that does not
convert (a number field holding "three") stays a string rather than failing the call.
"""
from __future__ import annotations

import ast
import json
from typing import Any


def schema_type(schema: Any) -> str:
    """The first JSON type a (sub)schema names; 'string' when it names none."""
    if not isinstance(schema, dict):
        return "string"
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "null")
    if isinstance(t, str):
        return t
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            st = schema_type(sub)
            if st != "string":
                return st
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return "string"


def convert_value(text: str, schema: Any) -> Any:
    t = schema_type(schema)
    if text.lower() == "null" and t != "string":
        return None
    if t == "string":
        return text
    if t == "integer":
        try:
            return int(text)
        except ValueError:
            return _number(text) if _number(text) is not None else text
    if t == "number":
        n = _number(text)
        return text if n is None else n
    if t == "boolean":
        low = text.strip().lower()
        return {"true": True, "false": False}.get(low, text)
    if t in ("object", "array"):
        try:
            return json.loads(text)
        except ValueError:
            try:  # Python-style literals ({'a': 1}, True) that models sometimes write
                value = ast.literal_eval(text)
                json.dumps(value)  # tuples pass, sets and bytes do not
                return value
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return text
    return text


def _number(text: str):
    try:
        f = float(text)
    except ValueError:
        return None
    if f != f or f in (float("inf"), float("-inf")):
        return None
    return int(f) if f.is_integer() and "." not in text and "e" not in text.lower() else f
