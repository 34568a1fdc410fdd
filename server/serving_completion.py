"""POST /v1/completions (vLLM: OpenAIServingCompletion).

One engine request per prompt (a list of prompts fans out); choice indexes run
prompt-major: prompt i's n choices are i*n .. i*n+n-1. echo puts the prompt text
(and, with logprobs, the prompt's logprobs) in front of each choice.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Optional

from kiln.runtime.engine.outputs import CompletionOutput, RequestOutput
from kiln.server.chat_plan import structured_params
from kiln.server.logprobs_format import TokenText, completion_logprobs, prompt_logprobs_json
from kiln.server.protocol import CompletionRequest, parse_completion_request
from kiln.server.serving_engine import OpenAIServingHandler, StreamChunks, usage

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions


@dataclass
class _Prompt:
    text: Optional[str]  # None for a token-id prompt until echo needs it
    ids: list[int]


class CompletionHandler(OpenAIServingHandler):
    async def post(self) -> None:
        req = parse_completion_request(await self.read_json(), self.state.config.limits)
        self.check_request(req)
        prompts = [_Prompt(p if isinstance(p, str) else None, await self.tokenize(p, req.add_special_tokens, "prompt"))
                   for p in req.prompts]
        structured = structured_params(self.state, req, req.structured) if req.structured else None
        params = []
        for p in prompts:
            max_tokens = self.max_tokens_for(len(p.ids), req, "prompt", default=DEFAULT_MAX_TOKENS)
            sp = req.to_sampling_params(max_tokens, req.logprobs, "logprobs", structured)
            if req.echo and req.logprobs is not None and sp.prompt_logprobs is None:
                sp = replace(sp, prompt_logprobs=req.logprobs)
            params.append(self.check_params(sp))
        base, engine_id = self.new_request_id("cmpl", req)
        ids = [engine_id] if len(prompts) == 1 else [f"{engine_id}-{i}" for i in range(len(prompts))]
        collectors = await self.submit(ids, [p.ids for p in prompts], params, stream=req.stream,
                                       priority=req.priority)
        fmt = _Formatter(self, req, prompts)
        if req.stream:
            await self.run_stream(self._stream(base, req, fmt, collectors))
            return
        finals: dict[int, RequestOutput] = {}
        async for i, ro in self.outputs(collectors):
            finals[i] = ro
        if self.client_gone:
            return
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        for i in range(len(prompts)):
            ro = finals[i]
            prompt_tokens += len(ro.prompt_token_ids)
            cached += ro.num_cached_tokens
            for c in sorted(ro.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                choices.append(fmt.choice(i, ro, c, first=True))
        self.write_json({"id": base, "object": "text_completion", "created": self.created,
                         "model": req.model or self.state.model_name, "choices": choices,
                         "usage": usage(prompt_tokens, completion_tokens, cached)})

    async def _stream(self, base: str, req: CompletionRequest, fmt: "_Formatter",
                      collectors: list) -> AsyncIterator[dict[str, Any] | str]:
        include_usage = req.stream_options.include_usage or self.state.config.enable_force_include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats
        head = {"id": base, "object": "text_completion", "created": self.created,
                "model": req.model or self.state.model_name}
        chunk = StreamChunks(head)
        started: set[int] = set()
        generated = [0] * len(collectors)
        prompt_lens = [len(p.ids) for p in fmt.prompts]
        cached = [0] * len(collectors)
        async for i, ro in self.outputs(collectors):
            cached[i] = ro.num_cached_tokens
            for c in ro.outputs:
                index = i * req.n + c.index
                first = index not in started
                generated[i] += len(c.token_ids)
                if not (c.text or c.token_ids or c.finish_reason or (first and req.echo)):
                    continue
                started.add(index)
                yield chunk([fmt.choice(i, ro, c, first=first)],
                            usage(prompt_lens[i], generated[i], cached[i]) if continuous else None)
        if include_usage:
            yield {**head, "choices": [], "usage": usage(sum(prompt_lens), sum(generated), sum(cached))}


class _Formatter:
    """One choice (whole, or one streamed delta) in OpenAI's completion shape."""

    def __init__(self, handler: CompletionHandler, req: CompletionRequest, prompts: list[_Prompt]) -> None:
        self.req = req
        self.prompts = prompts
        engine = handler.state.engine
        decode = (lambda t: engine.decode([t], skip_special_tokens=False)) if engine.tokenizer else str
        self.text_of = TokenText(decode, req.return_tokens_as_token_ids)
        self.engine = engine
        self.offsets: dict[int, int] = {}  # text offset reached per choice index (streaming logprobs)

    def prompt_text(self, i: int) -> str:
        p = self.prompts[i]
        if p.text is None:
            p.text = self.engine.decode(p.ids, skip_special_tokens=False) if self.engine.tokenizer else ""
        return p.text

    def choice(self, i: int, ro: RequestOutput, c: CompletionOutput, *, first: bool) -> dict[str, Any]:
        req = self.req
        index = i * req.n + c.index
        text = c.text
        echo = req.echo and first
        if echo:
            text = self.prompt_text(i) + text
        out: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if req.logprobs is not None:
            ids, positions = list(c.token_ids), list(c.logprobs or [])
            if echo:
                prompt_pos = list(ro.prompt_logprobs or [None] * len(ro.prompt_token_ids))
                ids, positions = list(ro.prompt_token_ids) + ids, prompt_pos + positions
            lp = completion_logprobs(ids, positions, req.logprobs, self.text_of, self.offsets.get(index, 0))
            if lp["tokens"]:
                self.offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            out["logprobs"] = lp
        if req.prompt_logprobs is not None and first:
            out["prompt_logprobs"] = prompt_logprobs_json(ro.prompt_logprobs)
        if req.return_token_ids:
            out["token_ids"] = list(c.token_ids)
            if first:
                out["prompt_token_ids"] = list(ro.prompt_token_ids)
        return out
