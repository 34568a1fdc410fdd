"""The offline API: `LLM(model=...).generate(prompts, SamplingParams)` and `.chat(...)`.

Ported in interface from vLLM's vllm/entrypoints/llm.py: the model path goes to
kiln.loader through build_engine (entrypoints/engine.py), and the engine it makes is
kiln.runtime's LLMEngine.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from kiln.entrypoints.engine import build_engine
from kiln.entrypoints.engine_args import EngineArgs
from kiln.runtime.engine.outputs import OutputKind, RequestOutput
from kiln.runtime.sample.sampling_params import SamplingParams
from kiln.runtime.text.chat_template import render_chat


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        self.args = EngineArgs(model=None if model is None else str(model), **kwargs)
        self.engine, self.model = build_engine(self.args)
        self.args = self.engine.engine_args  # the model's defaults filled in (prefix caching)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; -> one RequestOutput per prompt, in order.
        A prompt is text or a list of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("pass one SamplingParams or one per prompt")
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = self.engine.new_request_id()
                self.engine.add_request(rid, p, sp, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids) and self.engine.has_unfinished_requests():
            for ro in self.engine.step():
                if ro.finished:
                    done[ro.request_id] = ro
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, *,
             chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict] = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                    **(chat_template_kwargs or {})) for c in convs]
        return self.generate(prompts, sampling_params)

    def render_chat(self, messages: list[dict], *, chat_template: Optional[str] = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        tok = self.engine.tokenizer
        template = chat_template or self.args.chat_template or (tok.chat_template if tok else None)
        if template is None:
            raise ValueError("this model has no chat template; pass chat_template=")
        text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=tok.bos_token, eos_token=tok.eos_token, **kwargs)
        return tok.encode(text, add_special_tokens=False)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


__all__ = ["LLM", "EngineArgs", "SamplingParams", "OutputKind"]
