"""Request bodies of /v1/completions and /v1/chat/completions: parse, check types,
and turn the sampling fields into SamplingParams.

Fields follow OpenAI's API plus vLLM's extra sampling parameters
(vllm/entrypoints/openai/protocol.py: CompletionRequest, ChatCompletionRequest,
to_sampling_params, validate_stream_options, check_logprobs). Every error is an
APIError(400) naming the field as `param`. Unknown fields are ignored, as vLLM
does, so clients that send newer OpenAI fields keep working.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from kiln.runtime.sample.sampling_params import InvalidSamplingParamsError, SamplingParams
from kiln.server.errors import bad_request
from kiln.server.structured_request import check_tools, parse_tool_choice, response_format_kwargs, structured_kwargs

MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI allows 5 (completions) and 20 (chat)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (build.py serve's --max-* flags; issue 42 "Limits"). Past a
    limit is a 400 naming the field; past max_waiting_requests (sequences queued beyond what the
    engine runs at once, --max-num-seqs) a 503 with Retry-After."""
    max_n: int = 128  # OpenAI's own cap on n
    max_logprobs: int = MAX_LOGPROBS  # logprobs, top_logprobs, prompt_logprobs (vLLM's --max-logprobs)
    max_stop_strings: int = 16  # every stop string is matched against every new token's text
    max_stop_string_chars: int = 512
    max_messages: int = 4096
    max_waiting_requests: int = 1024
    # A stream whose client falls this many tokens of one choice behind the engine (it stopped
    # reading: its socket's buffers are full and the tokens since wait in the server) is aborted
    # and its connection closed (issue 42's slow reader).
    max_stream_backlog_tokens: int = 1024

# Sampling fields shared by both endpoints: name -> kind (see check_field).
SAMPLING_FIELDS = {
    "temperature": "number", "top_p": "number", "top_k": "int", "min_p": "number",
    "presence_penalty": "number", "frequency_penalty": "number", "repetition_penalty": "number",
    "seed": "int", "stop": "str_or_strs", "stop_token_ids": "ints", "include_stop_str_in_output": "bool",
    "ignore_eos": "bool", "min_tokens": "int", "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool", "logit_bias": "token_bias", "allowed_token_ids": "ints",
    "bad_words": "strs", "n": "int",
}


@dataclass
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass
class BaseRequest:
    model: Optional[str]
    stream: bool
    stream_options: StreamOptions
    sampling: dict[str, Any]  # SamplingParams keywords the client set (max_tokens, logprobs apart)
    max_tokens: Optional[int]  # None: as many as the context allows (chat) / the default (completions)
    max_tokens_param: str  # the field the client used, for error messages
    echo: bool
    priority: int
    request_id: Optional[str]
    add_special_tokens: bool
    return_tokens_as_token_ids: bool
    return_token_ids: bool
    prompt_logprobs: Optional[int]
    structured: Optional[dict]  # StructuredOutputsParams keywords (server/structured_request.py), or None

    @property
    def n(self) -> int:
        return self.sampling.get("n", 1)

    def to_sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                           logprobs_param: str, structured_outputs=None) -> SamplingParams:
        """SamplingParams for this request; a value out of range is a 400 naming its field."""
        kw = dict(self.sampling, structured_outputs=structured_outputs)
        if kw.get("logit_bias") is not None:  # OpenAI clamps nothing: it rejects; vLLM clamps. Reject.
            for tok, bias in kw["logit_bias"].items():
                if not -100 <= bias <= 100:
                    raise bad_request(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}.",
                                      "logit_bias")
        try:
            return SamplingParams(**kw, max_tokens=max_tokens, logprobs=logprobs,
                                  prompt_logprobs=self.prompt_logprobs)
        except InvalidSamplingParamsError as e:
            param = {"max_tokens": self.max_tokens_param, "logprobs": logprobs_param}.get(e.field, e.field)
            raise bad_request(str(e), param) from None


@dataclass
class CompletionRequest(BaseRequest):
    prompts: list = field(default_factory=list)  # each a str or a list of token ids
    logprobs: Optional[int] = None


@dataclass
class ChatCompletionRequest(BaseRequest):
    messages: list = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    tools: Optional[list] = None
    documents: Optional[list] = None
    tool_choice: Optional[str | dict] = None  # server/structured_request.py parse_tool_choice


# ------------------------------------------------------------------ parsing


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400: not JSON, not UTF-8, nested deeper than
    MAX_JSON_DEPTH, or holding a lone surrogate (issue 42 #11: each was a 500)."""
    if not raw:
        raise bad_request("The request body is empty; send a JSON object.")
    too_deep = bad_request(f"The request body is nested too deeply (more than {MAX_JSON_DEPTH} levels of "
                           "arrays and objects).", code="invalid_json")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        msg = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise bad_request(f"The request body is not valid JSON: {msg}.", code="invalid_json") from None
    except RecursionError:
        raise too_deep from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if (raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH) and _too_deep(body):
        raise too_deep
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise bad_request("The request body holds a lone UTF-16 surrogate escape (such as \\ud800), which is "
                          "not text; send valid Unicode.", code="invalid_json")
    return body


MAX_JSON_DEPTH = 64  # arrays and objects inside each other; a JSON schema or tool list needs far fewer
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _too_deep(value: Any) -> bool:
    """Whether arrays and objects nest past MAX_JSON_DEPTH (iteratively: the check itself must
    not recurse; scalars are skipped in C by the comprehensions)."""
    level, depth = [value], 1
    while level:
        if depth > MAX_JSON_DEPTH:
            return True
        nxt = []
        for v in level:
            items = v.values() if isinstance(v, dict) else v
            nxt += [x for x in items if type(x) is dict or type(x) is list]
        level, depth = nxt, depth + 1
    return False


def _has_lone_surrogate(value: Any) -> bool:
    """A str json.loads made from an unpaired \\ud800-\\udfff escape anywhere in value."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def parse_completion_request(body: dict[str, Any], limits: RequestLimits = RequestLimits()) -> CompletionRequest:
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported.", "suffix")
    prompts = _prompts(body)
    base = _base_fields(body, limits, max_tokens_names=("max_tokens",), default_add_special_tokens=True)
    logprobs = check_field(body, "logprobs", "int")
    if logprobs is not None and not 0 <= logprobs <= limits.max_logprobs:
        raise bad_request(f"logprobs must be between 0 and {limits.max_logprobs}, got {logprobs}.", "logprobs")
    best_of = check_field(body, "best_of", "int")
    if best_of is not None and best_of != base["sampling"].get("n", 1):
        raise bad_request("best_of other than n is not supported.", "best_of")
    return CompletionRequest(**base, prompts=prompts, logprobs=logprobs)


def parse_chat_request(body: dict[str, Any], limits: RequestLimits = RequestLimits()) -> ChatCompletionRequest:
    messages = _messages(body, limits)
    base = _base_fields(body, limits, max_tokens_names=("max_completion_tokens", "max_tokens"),
                        default_add_special_tokens=False)
    logprobs = bool(check_field(body, "logprobs", "bool"))
    top = check_field(body, "top_logprobs", "int")
    if top is not None:
        if not logprobs:  # vLLM check_logprobs
            raise bad_request("when using top_logprobs, logprobs must be set to true.", "top_logprobs")
        if not 0 <= top <= limits.max_logprobs:
            raise bad_request(f"top_logprobs must be between 0 and {limits.max_logprobs}, got {top}.",
                              "top_logprobs")
    if body.get("chat_template") is not None:
        raise bad_request("chat_template in a request is not accepted; start the server with --chat-template.",
                          "chat_template")
    fmt = response_format_kwargs(check_field(body, "response_format", "object"))
    if fmt is not None:
        if base["structured"] is not None:
            raise bad_request(f"response_format and {base['structured']['field']} cannot both be set.",
                              "response_format")
        base["structured"] = fmt
    tools = check_field(body, "tools", "list")
    check_tools(tools)
    tool_choice = parse_tool_choice(body, tools)
    add_gen = check_field(body, "add_generation_prompt", "bool")
    cont = bool(check_field(body, "continue_final_message", "bool"))
    if cont and add_gen:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true.",
                          "continue_final_message")
    return ChatCompletionRequest(
        **base, messages=messages, logprobs=logprobs, top_logprobs=top,
        add_generation_prompt=(not cont) if add_gen is None else add_gen, continue_final_message=cont,
        chat_template_kwargs=check_field(body, "chat_template_kwargs", "object") or {},
        tools=tools, documents=check_field(body, "documents", "list"), tool_choice=tool_choice)


def _base_fields(body: dict, limits: RequestLimits, *, max_tokens_names: tuple[str, ...],
                 default_add_special_tokens: bool) -> dict:
    model = check_field(body, "model", "str")
    stream = bool(check_field(body, "stream", "bool"))
    opts = check_field(body, "stream_options", "object")
    if opts is not None and not stream:  # vLLM validate_stream_options
        raise bad_request("stream_options can only be set when stream is true.", "stream_options")
    opts = opts or {}
    stream_options = StreamOptions(bool(check_field(opts, "include_usage", "bool", "stream_options.include_usage")),
                                   bool(check_field(opts, "continuous_usage_stats", "bool",
                                               "stream_options.continuous_usage_stats")))
    sampling = {k: v for k in SAMPLING_FIELDS if (v := check_field(body, k, SAMPLING_FIELDS[k])) is not None}
    _check_limits(sampling, limits)
    max_tokens, max_tokens_param = None, max_tokens_names[-1]
    for name in max_tokens_names:  # the first set wins: max_completion_tokens over max_tokens
        if (v := check_field(body, name, "int")) is not None:
            max_tokens, max_tokens_param = v, name
            break
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_param} must be at least 1, got {max_tokens}.", max_tokens_param)
    prompt_logprobs = check_field(body, "prompt_logprobs", "int")
    # -1 (the whole vocabulary at every prompt position) is refused as vLLM refuses it past its
    # max_logprobs cap of 20: it made 79-413 MB bodies (issue 42 #9)
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= limits.max_logprobs:
        raise bad_request(f"prompt_logprobs must be between 0 and {limits.max_logprobs}, got {prompt_logprobs}.",
                          "prompt_logprobs")
    add_special = check_field(body, "add_special_tokens", "bool")
    return dict(
        model=model, stream=stream, stream_options=stream_options, sampling=sampling,
        max_tokens=max_tokens, max_tokens_param=max_tokens_param, echo=bool(check_field(body, "echo", "bool")),
        priority=check_field(body, "priority", "int") or 0, request_id=check_field(body, "request_id", "str"),
        add_special_tokens=default_add_special_tokens if add_special is None else add_special,
        return_tokens_as_token_ids=bool(check_field(body, "return_tokens_as_token_ids", "bool")),
        return_token_ids=bool(check_field(body, "return_token_ids", "bool")), prompt_logprobs=prompt_logprobs,
        structured=structured_kwargs(body))


def _check_limits(sampling: dict, limits: RequestLimits) -> None:
    n = sampling.get("n")
    if n is not None and n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n}, got {n}.", "n")
    stop = sampling.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"stop may hold at most {limits.max_stop_strings} strings, got {len(stops)}.", "stop")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise bad_request(f"each stop string may be at most {limits.max_stop_string_chars} characters long, got "
                          f"{longest}.", "stop")


def _prompts(body: dict) -> list:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required.", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(_is_int(t) for t in p):
            return [list(p)]
        if all(isinstance(s, str) for s in p):
            return list(p)
        if all(isinstance(s, list) and s and all(_is_int(t) for t in s) for s in p):
            return [list(s) for s in p]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids, "
                      "or a list of lists of token ids, and not empty.", "prompt")


def _messages(body: dict, limits: RequestLimits) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("messages is required.", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages must be a non-empty list of message objects.", "messages")
    if len(msgs) > limits.max_messages:
        raise bad_request(f"messages may hold at most {limits.max_messages} messages, got {len(msgs)}.",
                          "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role.", f"messages[{i}]")
        out.append({**m, "content": _content(m.get("content"), i)})
    return out


def _content(content: Any, i: int) -> Any:
    """String content as is; a list of text parts joined by newlines (vLLM's 'string' format);
    null or absent content (an assistant's tool-call turn) renders as empty, as vLLM renders it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text") \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{i}].content: part type {kind!r} is not supported (text only).",
                                  f"messages[{i}].content")
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of content parts.",
                      f"messages[{i}].content")


# ------------------------------------------------------------------ type checks


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KIND_WORDS = {
    "bool": "a boolean", "int": "an integer", "number": "a number", "str": "a string",
    "str_or_strs": "a string or a list of strings", "strs": "a list of strings",
    "ints": "a list of integers", "object": "an object", "list": "a list",
    "token_bias": "an object mapping token ids to numbers",
}


def check_field(body: dict, name: str, kind: str, param: Optional[str] = None) -> Any:
    """body[name] if it is of `kind` (None if absent or null), else a 400 naming the field."""
    v = body.get(name)
    if v is None:
        return None
    ok, value = _convert(v, kind)
    if not ok:
        raise bad_request(f"{param or name} must be {_KIND_WORDS[kind]}, got {json.dumps(v)[:60]}.", param or name)
    return value


def _convert(v: Any, kind: str) -> tuple[bool, Any]:
    if kind == "bool":
        return isinstance(v, bool), v
    if kind == "int":
        if isinstance(v, float) and v.is_integer():  # 5.0 is 5, as pydantic's lax mode says
            return True, int(v)
        return _is_int(v), v
    if kind == "number":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return ok, float(v) if ok else v
    if kind == "str":
        return isinstance(v, str), v
    if kind == "str_or_strs":
        return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)), v
    if kind == "strs":
        return isinstance(v, list) and all(isinstance(s, str) for s in v), v
    if kind == "ints":
        return isinstance(v, list) and all(_is_int(t) for t in v), v
    if kind == "object":
        return isinstance(v, dict), v
    if kind == "token_bias":  # {"token id": bias}; JSON keys are strings
        if not isinstance(v, dict) or not all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                              for b in v.values()):
            return False, v
        try:
            return True, {int(k): float(b) for k, b in v.items()}
        except ValueError:
            return False, v
    if kind == "list":
        return isinstance(v, list), v
    raise AssertionError(kind)
