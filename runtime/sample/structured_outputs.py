"""What a request's output must match: vLLM's StructuredOutputsParams
(vllm/sampling_params.py), compiled to one llguidance grammar.

Exactly one of json (a JSON schema, as a dict or its text), json_object, regex, choice
(a list of strings) or grammar (Lark, or GBNF, which llguidance converts) is set. The
grammar is compiled and checked when the params are made, so a bad schema or regex is an
InvalidSamplingParamsError (the server's 400) before the request is queued; the engine only
builds a matcher from `grammar_text`.

JSON is generated without free whitespace (llguidance's whitespace_flexible off, as
OpenAI's strict mode writes it): a model may not pad JSON with newlines forever, which a weak
or random model otherwise does.

reasoning_end / reasoning_start say when the constraint begins, for models that think first
(the server sets them from its reasoning parser and the prompt): with reasoning_end set, the
output is free until it has produced those token ids; with reasoning_start too, the first
token decides: that token opens reasoning, anything else is already the constrained answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from kiln.runtime.sample.sampling_params import InvalidSamplingParamsError

JSON_OPTIONS = {"whitespace_flexible": False}
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: Any = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    reasoning_end: tuple[int, ...] = ()
    reasoning_start: Optional[int] = None
    field: str = "structured_outputs"  # the request field named in errors
    grammar_text: str = ""  # the compiled llguidance grammar (set by __post_init__)

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidSamplingParamsError(
                self.field, f"{self.field} needs exactly one of {', '.join(KINDS)}; got "
                            f"{', '.join(set_) if set_ else 'none'}.")
        object.__setattr__(self, "reasoning_end", tuple(int(t) for t in self.reasoning_end))
        if not self.grammar_text:
            object.__setattr__(self, "grammar_text", self._compile(set_[0]))

    def _compile(self, kind: str) -> str:
        from llguidance import LLMatcher, gbnf_to_lark

        try:
            if kind == "json":
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema must be an object")
                text = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            elif kind == "json_object":
                text = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            elif kind == "regex":
                text = LLMatcher.grammar_from_regex(self.regex)
            elif kind == "choice":
                choices = list(self.choice)
                if not choices or not all(isinstance(c, str) for c in choices):
                    raise ValueError("choice must be a non-empty list of strings")
                text = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
            else:
                lark = self.grammar
                if "::=" in lark:  # GBNF (llama.cpp's form), which vLLM's guided_grammar also takes
                    lark = gbnf_to_lark.gbnf_to_lark(lark)
                text = LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError) as e:
            raise InvalidSamplingParamsError(self.field, f"{self.field}: invalid {kind}: {e}") from None
        error = LLMatcher.validate_grammar(text)
        if error:
            lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
            why = " ".join(lines[:1] + [ln for ln in lines[1:] if ln.startswith("error:")])
            raise InvalidSamplingParamsError(self.field, f"{self.field}: invalid {kind}: {why}")
        return text
