"""The request fields that constrain output, read into StructuredOutputsParams keywords
(vLLM: protocol.py ChatCompletionRequest/CompletionRequest to_sampling_params, the
structured_outputs field and the older guided_* names; OpenAI's response_format).

At most one constraint per request; the grammar itself is compiled and checked when the
handler builds StructuredOutputsParams, which names the field in its 400.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from kiln.server.errors import bad_request

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_kwargs(body: dict) -> Optional[dict[str, Any]]:
    """vLLM's `structured_outputs` object, or one guided_* field -> keywords (with `field`)."""
    found = []
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object.", "structured_outputs")
        kinds = {k: v for k, v in so.items() if k in _KINDS and v not in (None, False)}
        unknown = [k for k, v in so.items() if v is not None and k not in _KINDS
                   and k not in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                                 "whitespace_pattern")]
        if unknown:
            raise bad_request(f"structured_outputs.{unknown[0]} is not supported (use one of "
                              f"{', '.join(_KINDS)}).", "structured_outputs")
        found.append(("structured_outputs", kinds))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {kind: body[name]}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]} cannot both be set.", found[1][0])
    field, kw = found[0]
    if "regex" in kw and not isinstance(kw["regex"], str):
        raise bad_request(f"{field}: regex must be a string.", field)
    if "grammar" in kw and not isinstance(kw["grammar"], str):
        raise bad_request(f"{field}: grammar must be a string.", field)
    return {**kw, "field": field}


def response_format_kwargs(fmt: Optional[dict]) -> Optional[dict[str, Any]]:
    """OpenAI's response_format: text (nothing), json_object, json_schema."""
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True, "field": "response_format"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object.", "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:  # OpenAI: a missing schema accepts any JSON object
            schema = {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise bad_request(f"response_format.json_schema.schema is not valid JSON: {e}.",
                                  "response_format") from None
        return {"json": schema, "field": "response_format"}
    raise bad_request(f"response_format type {kind!r} is not supported; use text, json_object or json_schema.",
                      "response_format")


_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_tools(tools: Optional[list]) -> None:
    """Each tool is {"type": "function", "function": {"name", "parameters": a JSON schema}}.
    The schema's shape is checked here; llguidance compiles it when a grammar needs it."""
    for i, t in enumerate(tools or []):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"{p} must be {{'type': 'function', 'function': {{...}}}}.", p)
        fn = t["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"{p}.function.name must be a non-empty string.", p)
        params = fn.get("parameters")
        if params is not None:
            why = _schema_problem(params)
            if why:
                raise bad_request(f"{p}.function.parameters is not a valid JSON schema: {why}.", p)


def _schema_problem(schema: Any, depth: int = 0) -> Optional[str]:
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"a schema must be an object, got {json.dumps(schema)[:40]}"
    if depth > 32:
        return "nested too deeply"
    t = schema.get("type")
    types = t if isinstance(t, list) else [t] if t is not None else []
    bad = [x for x in types if x not in _SCHEMA_TYPES]
    if bad:
        return f"unknown type {json.dumps(bad[0])}"
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            return "properties must be an object"
        for sub in props.values():
            if (why := _schema_problem(sub, depth + 1)):
                return why
    req = schema.get("required")
    if req is not None and not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
        return "required must be a list of strings"
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), (dict, bool)):
            if (why := _schema_problem(schema[key], depth + 1)):
                return why
        elif schema.get(key) is not None:
            return f"{key} must be a schema"
    for key in ("anyOf", "oneOf", "allOf"):
        subs = schema.get(key)
        if subs is not None:
            if not isinstance(subs, list):
                return f"{key} must be a list"
            for sub in subs:
                if (why := _schema_problem(sub, depth + 1)):
                    return why
    return None


def parse_tool_choice(body: dict, tools: Optional[list]) -> Optional[str | dict]:
    """"none", "auto", "required", or the named function's name as {"name": ...}; None when
    absent (the handler decides: auto where the server parses calls, else none)."""
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools.", "tool_choice")
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools "
                              f"({', '.join(names) or 'none given'}).", "tool_choice")
        return {"name": name}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
