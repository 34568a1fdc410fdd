"""POST /v1/chat/completions (vLLM: OpenAIServingChat).

The conversation is rendered with the chat template (the server's --chat-template,
else the tokenizer's) exactly as the offline LLM.chat renders it, then runs as one
engine request with n choices. Streaming sends a role chunk per choice first, then
content deltas, the finish reason with the last delta, and a usage chunk when asked.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from kiln.errors import ChatTemplateError
from kiln.runtime.text.chat_template import render_chat
from kiln.runtime.engine.outputs import CompletionOutput, RequestOutput
from kiln.server.chat_output import ChoiceStream, message_fields
from kiln.server.chat_plan import ChatOutputPlan, plan_chat_output
from kiln.server.errors import bad_request
from kiln.server.logprobs_format import TokenText, chat_logprobs, prompt_logprobs_json
from kiln.server.protocol import ChatCompletionRequest, parse_chat_request
from kiln.server.serving_engine import OpenAIServingHandler, StreamChunks, usage

# Names render_chat binds itself; chat_template_kwargs may not rebind them.
_RESERVED = {"template", "messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
             "bos_token", "eos_token"}


class ChatCompletionHandler(OpenAIServingHandler):
    async def post(self) -> None:
        req = parse_chat_request(await self.read_json(), self.state.config.limits)
        self.check_request(req)
        prompt = await self.state.run_sized(self._body_size, render_prompt, self.state, req)
        plan = plan_chat_output(self.state, req, prompt)
        ids = await self.tokenize(prompt, req.add_special_tokens, "messages")
        max_tokens = self.max_tokens_for(len(ids), req, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.check_params(req.to_sampling_params(max_tokens, logprobs, "top_logprobs", plan.structured))
        rid, engine_id = self.new_request_id("chatcmpl", req)
        collectors = await self.submit([engine_id], [ids], [params], stream=req.stream, priority=req.priority)
        fmt = _Formatter(self, req, plan)
        head = {"id": rid, "created": self.created, "model": req.model or self.state.model_name}
        if req.stream:
            await self.run_stream(self._stream(head, req, fmt, collectors, len(ids)))
            return
        final = None
        async for _, ro in self.outputs(collectors):
            final = ro
        if self.client_gone or final is None:
            return
        choices = [fmt.choice(final, c) for c in sorted(final.outputs, key=lambda c: c.index)]
        body = {**head, "object": "chat.completion", "choices": choices,
                "usage": usage(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs),
                               final.num_cached_tokens)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = list(final.prompt_token_ids)
        self.write_json(body)

    async def _stream(self, head: dict, req: ChatCompletionRequest, fmt: "_Formatter", collectors: list,
                      num_prompt: int) -> AsyncIterator[dict[str, Any] | str]:
        include_usage = req.stream_options.include_usage or self.state.config.enable_force_include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats
        head = {**head, "object": "chat.completion.chunk"}
        generated, cached = 0, 0
        encode = StreamChunks(head)

        def chunk(choices: list) -> str:
            return encode(choices, usage(num_prompt, generated, cached) if continuous else None)

        for i in range(req.n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        echo = fmt.echo_text()
        if echo:
            for i in range(req.n):
                yield chunk([{"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}])
        async for _, ro in self.outputs(collectors):
            cached = ro.num_cached_tokens
            for c in ro.outputs:
                generated += len(c.token_ids)
                if c.text or c.token_ids or c.finish_reason:
                    yield chunk([fmt.delta(c)])
        if include_usage:
            yield {**head, "choices": [], "usage": usage(num_prompt, generated, cached)}


def render_prompt(state, req: ChatCompletionRequest) -> str:
    """The conversation as prompt text, rendered as the offline LLM.chat renders it."""
    template = state.chat_template()
    if template is None:
        raise bad_request("This model has no chat template; start the server with --chat-template.",
                          "messages")
    tok = state.engine.tokenizer
    kwargs = {k: v for k, v in req.chat_template_kwargs.items() if k not in _RESERVED}
    try:
        return render_chat(template, tool_arguments_as_objects(req.messages), add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, tools=req.tools,
                           documents=req.documents, bos_token=tok and tok.bos_token,
                           eos_token=tok and tok.eos_token, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None


def tool_arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Assistant tool calls carry their arguments as JSON text (OpenAI's form); templates
    iterate them as objects (`arguments|items`), so they get the parsed object, as vLLM and
    transformers hand it to them. Text that is not JSON passes as it is."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list) and any(isinstance(c, dict) for c in calls):
            m = {**m, "tool_calls": [_parsed_call(c) for c in calls]}
        out.append(m)
    return out


def _parsed_call(call):
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


class _Formatter:
    def __init__(self, handler: ChatCompletionHandler, req: ChatCompletionRequest, plan: ChatOutputPlan) -> None:
        self.req = req
        self.plan = plan
        self.streams: dict[int, ChoiceStream] = {}  # per choice index, while streaming
        engine = handler.state.engine
        decode = (lambda t: engine.decode([t], skip_special_tokens=False)) if engine.tokenizer else str
        self.text_of = TokenText(decode, req.return_tokens_as_token_ids)

    def echo_text(self) -> str:
        """vLLM's chat echo: the last message's content, when it is the assistant's own."""
        last = self.req.messages[-1]
        if self.req.echo and last.get("role") == "assistant" and isinstance(last.get("content"), str):
            return last["content"]
        return ""

    def logprobs(self, c: CompletionOutput):
        if not self.req.logprobs or c.logprobs is None:
            return None
        return chat_logprobs(c.token_ids, c.logprobs, self.req.top_logprobs or 0, self.text_of)

    def choice(self, ro: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        fields = message_fields(self.plan.parser().parse(c.text, final=True))
        if self.echo_text():
            fields["content"] = self.echo_text() + (fields["content"] or "")
        finish = "tool_calls" if fields["tool_calls"] else c.finish_reason
        out = {"index": c.index, "message": {"role": "assistant", **fields},
               "logprobs": self.logprobs(c), "finish_reason": finish, "stop_reason": c.stop_reason}
        if self.req.return_token_ids:
            out["token_ids"] = list(c.token_ids)
        return out

    def delta(self, c: CompletionOutput) -> dict[str, Any]:
        stream = self.streams.get(c.index)
        if stream is None:
            stream = self.streams[c.index] = ChoiceStream(self.plan.parser())
        delta = stream.delta(c.text, final=c.finish_reason is not None)
        finish = "tool_calls" if c.finish_reason is not None and stream.called else c.finish_reason
        out = {"index": c.index, "delta": delta, "logprobs": self.logprobs(c),
               "finish_reason": finish, "stop_reason": c.stop_reason}
        if self.req.return_token_ids:
            out["token_ids"] = list(c.token_ids)
        return out
