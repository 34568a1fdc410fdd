"""How one chat request's output is read and constrained: which reasoning parser, which
tool parser (or forced tool choice), and the grammar, if any (vLLM: serving_chat.py
create_chat_completion's tool_choice and reasoning set-up; protocol.py
_get_json_schema_from_tool for required / named tool choice).

tool_choice: "none" never parses calls; "auto" (the default when tools come and the server
was started with --enable-auto-tool-choice) lets the tool parser find calls; "required" and
a named function are enforced by a grammar over vLLM's JSON forms (a list of
{"name", "parameters"}, or the named function's arguments), so the model cannot answer in
prose. Constraints start after the reasoning (StructuredOutputsParams.reasoning_end).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kiln.runtime.sample.sampling_params import InvalidSamplingParamsError
from kiln.runtime.sample.structured_outputs import StructuredOutputsParams
from kiln.server.chat_output import ChoiceParser, ForcedToolChoice
from kiln.server.errors import bad_request
from kiln.server.protocol import BaseRequest, ChatCompletionRequest
from kiln.server.reasoning import PromptReasoning, ReasoningParser, get_reasoning_parser
from kiln.server.tool_parsers import ToolParser, get_tool_parser


@dataclass
class ChatOutputPlan:
    reasoning: Optional[ReasoningParser]
    prompt_state: PromptReasoning
    tools: Optional[ToolParser | ForcedToolChoice]
    structured: Optional[StructuredOutputsParams]

    def parser(self) -> ChoiceParser:
        return ChoiceParser(self.reasoning, self.prompt_state, self.tools)


def plan_chat_output(state, req: ChatCompletionRequest, prompt: str) -> ChatOutputPlan:
    cfg = state.config
    reasoning = get_reasoning_parser(cfg.reasoning_parser) if cfg.reasoning_parser else None
    prompt_state = reasoning.prompt_state(prompt) if reasoning else PromptReasoning.CLOSED
    auto_ok = cfg.enable_auto_tool_choice and cfg.tool_call_parser is not None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools and auto_ok else "none"
    tools, structured = None, req.structured
    if choice == "auto" and req.tools:
        if not auto_ok:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                              "to be set when the server starts.", "tool_choice")
        tools = get_tool_parser(cfg.tool_call_parser)(req.tools)
    elif choice == "required" or isinstance(choice, dict):
        if structured is not None:
            raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} and "
                              f"{structured['field']} cannot both be set.", "tool_choice")
        name = choice["name"] if isinstance(choice, dict) else None
        tools = ForcedToolChoice(name)
        structured = {"json": _forced_schema(req.tools, name), "field": "tools"}
    so = structured_params(state, req, structured, reasoning, prompt_state) if structured else None
    return ChatOutputPlan(reasoning, prompt_state, tools, so)


def structured_params(state, req: BaseRequest, kwargs: dict, reasoning: Optional[ReasoningParser] = None,
                      prompt_state: PromptReasoning = PromptReasoning.CLOSED) -> StructuredOutputsParams:
    """The request's grammar, compiled and checked now (a 400 before anything is queued)."""
    tok = state.engine.tokenizer
    if tok is None:
        raise bad_request("Structured output needs the model's tokenizer.", kwargs["field"])
    end, start = (), None
    if reasoning is not None and prompt_state is not PromptReasoning.CLOSED:
        end = tuple(tok.encode(reasoning.end_tag, add_special_tokens=False))
        if prompt_state is PromptReasoning.UNKNOWN:
            ids = tok.encode(reasoning.start_tag, add_special_tokens=False)
            if len(ids) == 1:
                start = ids[0]
            else:  # a multi-token tag cannot be told from the answer's first token: constrain at once
                end = ()
    try:
        return StructuredOutputsParams(**kwargs, reasoning_end=end, reasoning_start=start)
    except InvalidSamplingParamsError as e:
        raise bad_request(str(e), e.field) from None


def _forced_schema(tools: list, name: Optional[str]) -> dict:
    def params(fn: dict) -> dict:
        return fn.get("parameters") or {"type": "object", "properties": {}}

    fns = [t["function"] for t in tools]
    if name is not None:
        return params(next(fn for fn in fns if fn["name"] == name))
    one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                                "parameters": params(fn)},
               "required": ["name", "parameters"], "additionalProperties": False} for fn in fns]
    return {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
