"""One request's mailbox on the caller's event loop (vLLM: RequestOutputCollector in
vllm/v1/engine/output_processor.py).

The engine thread puts outputs in (through loop.call_soon_threadsafe); the caller
awaits get(). It holds at most one item: a DELTA output arriving before the last
was taken is merged into it (text and tokens appended), so a slow consumer gets
fewer, larger deltas and memory stays bounded; CUMULATIVE and FINAL_ONLY outputs
simply replace the older one. An exception put in is raised by get().
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional, Union

from kiln.runtime.outputs import CompletionOutput, OutputKind, RequestOutput


class RequestOutputCollector:
    def __init__(self, output_kind: OutputKind, loop: asyncio.AbstractEventLoop) -> None:
        self.output_kind = output_kind
        self.loop = loop
        self._item: Union[RequestOutput, BaseException, None] = None
        self._closed = False
        self._ready = asyncio.Event()

    def put(self, item: Union[RequestOutput, BaseException]) -> None:
        """On the event loop's thread."""
        if self._closed:
            return
        old = self._item
        if isinstance(item, RequestOutput) and isinstance(old, RequestOutput) \
                and self.output_kind == OutputKind.DELTA:
            item = merge_delta(old, item)
        elif isinstance(old, BaseException):
            return  # an error stays the last word
        self._item = item
        self._ready.set()

    def close(self) -> None:
        """The request was aborted: get() returns what is pending, then None."""
        self._closed = True
        self._ready.set()

    async def get(self) -> Optional[RequestOutput]:
        """The next output (merged), or None once the request was aborted."""
        while self._item is None:
            if self._closed:
                return None
            await self._ready.wait()
            self._ready.clear()
        return self._take()

    def get_nowait(self) -> Optional[RequestOutput]:
        return None if self._item is None else self._take()

    def _take(self) -> RequestOutput:
        item, self._item = self._item, None
        if isinstance(item, BaseException):
            raise item
        return item


def merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Two consecutive DELTA outputs of one request as one (per completion index)."""
    comps = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = comps.get(c.index)
        comps[c.index] = c if prev is None else _merge_completion(prev, c)
    prompt_logprobs = old.prompt_logprobs
    if new.prompt_logprobs:
        prompt_logprobs = (prompt_logprobs or []) + new.prompt_logprobs
    return dataclasses.replace(new, outputs=[comps[i] for i in sorted(comps)], prompt_logprobs=prompt_logprobs)


def _merge_completion(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    logprobs = a.logprobs
    if b.logprobs is not None:
        logprobs = (logprobs or []) + b.logprobs
    return dataclasses.replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids, logprobs=logprobs)
