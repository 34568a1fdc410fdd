"""One request's mailbox on the caller's event loop (vLLM: RequestOutputCollector in
vllm/v1/engine/output_processor.py).

The engine thread puts outputs in (through loop.call_soon_threadsafe); the caller
awaits get(). It holds at most one item: a DELTA output arriving before the last
was taken is merged into it (text and tokens appended), so a slow consumer gets
fewer, larger deltas and memory stays bounded; CUMULATIVE and FINAL_ONLY outputs
simply replace the older one. An exception put in is raised by get().

A DELTA consumer may also bound how far it falls behind (limit_backlog, issue 42's slow
reader): once the merged, untaken output holds more than that many tokens of any one choice,
the pending output is dropped, the collector closes and on_overflow(tokens behind) runs, so a
consumer that stops taking (a streaming client that stops reading its socket) holds at most
that many tokens per choice here, however long the request runs.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional, Union

from kiln.runtime.engine.outputs import OutputKind, RequestOutput


class RequestOutputCollector:
    def __init__(self, output_kind: OutputKind, loop: asyncio.AbstractEventLoop) -> None:
        self.output_kind = output_kind
        self.loop = loop
        self._item: Union[RequestOutput, BaseException, None] = None
        self._closed = False
        self._ready = asyncio.Event()
        self._backlog_limit: Optional[int] = None
        self._on_overflow: Optional[Callable[[int], None]] = None

    def limit_backlog(self, tokens: int, on_overflow: Callable[[int], None]) -> None:
        """DELTA only: past `tokens` untaken tokens of one choice, drop them, close, on_overflow(n)."""
        self._backlog_limit, self._on_overflow = tokens, on_overflow

    def pending_tokens(self) -> int:
        """Tokens of the most-behind choice in the untaken output (0 when nothing waits)."""
        item = self._item
        if not isinstance(item, RequestOutput):
            return 0
        return max((len(c.token_ids) for c in item.outputs), default=0)

    def put(self, item: Union[RequestOutput, BaseException]) -> None:
        """On the event loop's thread."""
        if self._closed:
            return
        old = self._item
        if isinstance(item, RequestOutput) and isinstance(old, RequestOutput) \
                and self.output_kind == OutputKind.DELTA:
            item = merge_delta(old, item)
            if self._backlog_limit is not None:
                behind = max((len(c.token_ids) for c in item.outputs), default=0)
                if behind > self._backlog_limit:
                    self._item, self._closed = None, True
                    self._ready.set()
                    if self._on_overflow is not None:
                        self._on_overflow(behind)
                    return
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
    """Two consecutive DELTA outputs of one request as one (per completion index).

    `old` is the collector's own pending output, which no caller has seen, so it is extended in
    place, as vLLM's RequestOutput.add does: text and token ids (and logprobs) appended, the
    rest (finish and stop reasons, cumulative logprob, finished, metrics) taken from `new`."""
    comps = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = comps.get(c.index)
        if prev is None:
            comps[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            if prev.logprobs is None:
                prev.logprobs = list(c.logprobs)
            else:
                prev.logprobs.extend(c.logprobs)
        prev.cumulative_logprob, prev.finish_reason, prev.stop_reason = \
            c.cumulative_logprob, c.finish_reason, c.stop_reason
    if len(comps) != len(old.outputs):
        old.outputs = [comps[i] for i in sorted(comps)]
    if new.prompt_logprobs:
        old.prompt_logprobs = (old.prompt_logprobs or []) + new.prompt_logprobs
    old.finished, old.metrics, old.num_cached_tokens = new.finished, new.metrics, new.num_cached_tokens
    old.prompt, old.prompt_token_ids = new.prompt, new.prompt_token_ids
    return old
