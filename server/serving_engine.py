"""What the completion and chat handlers share (vLLM: serving_engine.py OpenAIServing):
model and length checks, SamplingParams, handing requests to the AsyncLLM and
reading their outputs back, Server-Sent Events, usage, and aborting the requests
of a client that went away.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional, Sequence

from tornado.iostream import StreamClosedError

from kiln.runtime.engine.async_llm import EngineDeadError
from kiln.runtime.engine.outputs import OutputKind, RequestOutput
from kiln.runtime.engine.output_collector import RequestOutputCollector
from kiln.runtime.sample.sampling_params import InvalidSamplingParamsError, SamplingParams
from kiln.server.base_handler import BaseHandler
from kiln.server.errors import APIError, bad_request
from kiln.server.protocol import BaseRequest
from kiln.server.state import OFF_LOOP_BYTES

logger = logging.getLogger("kiln.server")


class ClientGone(Exception):
    """The client closed the connection; stop producing its response."""


# json.dumps(obj, ensure_ascii=False) builds a JSONEncoder (and its C encoder) on every call;
# one shared instance gives the same text (it keeps no state between calls).
encode_json = json.JSONEncoder(ensure_ascii=False).encode


class StreamChunks:
    """The JSON text of a stream's chunks, {**head, "choices": choices[, "usage": usage]}, with
    the head (id, object, created, model: the same in every chunk) encoded once per stream.
    The text is what json.dumps(chunk, ensure_ascii=False) makes of the same dict."""

    def __init__(self, head: dict[str, Any]) -> None:
        if not head:
            raise ValueError("a stream chunk has a head")
        self.prefix = encode_json(head)[:-1] + ', "choices": '

    def __call__(self, choices: list, usage: Optional[dict[str, Any]] = None) -> str:
        if usage is None:
            return f"{self.prefix}{encode_json(choices)}}}"
        return f"{self.prefix}{encode_json(choices)}, \"usage\": {encode_json(usage)}}}"


class OpenAIServingHandler(BaseHandler):
    requires_auth = True

    def initialize(self, state) -> None:
        super().initialize(state)
        self.created = int(time.time())
        self._request_ids: list[str] = []

    # ------------------------------------------------------------ checks

    def check_model_name(self, name: Optional[str]) -> None:
        if name is not None and name not in self.state.config.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_request(self, req: BaseRequest) -> None:
        self.check_model_name(req.model)
        if req.priority != 0 and self.state.config.scheduling_policy != "priority":
            raise bad_request("priority is only accepted when the server runs with --scheduling-policy priority.",
                              "priority")
        if self.state.engine.errored:
            raise APIError(503, "The engine has stopped; the server cannot serve requests.", code="engine_dead")
        if self.state.draining:
            raise shutting_down()

    async def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool, param: str,
                       limit: Optional[int] = None) -> list[int]:
        """The prompt's token ids. A text whose length alone proves it has at least `limit` (default
        max_model_len) tokens is refused before it is tokenized, and a long one is tokenized on
        a worker thread (issue 42 #10: a 10 MB prompt froze every client for 8-10 s)."""
        engine = self.state.engine
        if isinstance(prompt, str):
            tok = engine.tokenizer
            if tok is None:
                raise bad_request("This model was loaded without a tokenizer; send token ids.", param)
            limit = engine.max_model_len if limit is None else limit
            at_least = len(prompt) // (2 * tok.max_token_chars)  # 2: what a normalizer may take out
            if at_least >= limit:
                raise bad_request(f"This model's maximum context length is {engine.max_model_len} tokens. However, "
                                  f"your request has at least {at_least} input tokens ({len(prompt)} characters). "
                                  "Please reduce the length of the input.", param, code="context_length_exceeded")
            if len(prompt) > OFF_LOOP_BYTES // 4:
                ids = await self.state.run_sized(len(prompt) * 4, tok.encode_long, prompt, add_special_tokens)
            else:
                ids = tok.encode(prompt, add_special_tokens=add_special_tokens)
            if not ids:
                raise bad_request(f"{param} is empty.", param)
            return ids
        bad = [t for t in prompt if not 0 <= t < engine.vocab_size]
        if bad:
            raise bad_request(f"{param} holds token ids outside the vocabulary [0, {engine.vocab_size}): "
                              f"{bad[:5]}.", param)
        return list(prompt)

    def max_tokens_for(self, num_prompt: int, req: BaseRequest, prompt_param: str,
                       default: Optional[int] = None) -> Optional[int]:
        """The max_tokens to run with; a prompt that leaves no room, or an explicit max_tokens
        past the context, is a 400 stating the numbers (vLLM _validate_input)."""
        limit = self.state.engine.max_model_len
        if num_prompt >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your request has "
                              f"{num_prompt} input tokens. Please reduce the length of the input.",
                              prompt_param, code="context_length_exceeded")
        if req.max_tokens is not None:
            if num_prompt + req.max_tokens > limit:
                raise bad_request(f"{req.max_tokens_param} is too large: {req.max_tokens}. This model's maximum "
                                  f"context length is {limit} tokens and your request has {num_prompt} input "
                                  f"tokens ({req.max_tokens} > {limit} - {num_prompt}).",
                                  req.max_tokens_param, code="context_length_exceeded")
            return req.max_tokens
        return None if default is None else min(default, limit - num_prompt)

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """Checks the engine would otherwise make inside a step, where a failure is the engine's."""
        engine = self.state.engine
        try:
            params.verify(engine.vocab_size)
            if params.bad_words:
                if engine.tokenizer is None:
                    raise bad_request("bad_words needs a tokenizer.", "bad_words")
                params.tokenize_bad_words(lambda s: engine.encode(s, add_special_tokens=False), engine.vocab_size)
        except InvalidSamplingParamsError as e:
            raise bad_request(str(e), e.field) from None
        return params

    def new_request_id(self, prefix: str, req: BaseRequest) -> tuple[str, str]:
        """-> (the response's id, the engine's id). A client's id (the body's `request_id`, else the
        X-Request-Id header) is echoed in the response, never trusted (issue 42 #1: two clients
        sending one id aborted each other's requests): the engine's id is the server's own, unique
        per request. The X-Request-Id response header echoes the client's header, else the id."""
        header = self.request.headers.get("X-Request-Id")
        if header is not None and not _is_request_id(header):
            raise bad_request(f"The X-Request-Id header must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
                              "characters.", "X-Request-Id")
        if req.request_id is not None and not 0 < len(req.request_id) <= MAX_REQUEST_ID_CHARS:
            raise bad_request(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters long, got "
                              f"{len(req.request_id)}.", "request_id")
        own = uuid.uuid4().hex
        response_id = f"{prefix}-{req.request_id or header or own}"
        if header is None:  # the response id, where a header can carry it (a body id may be any text)
            header = response_id if _is_request_id(response_id) else own
        self.set_header("X-Request-Id", header)
        return response_id, f"{prefix}-{own}"

    # ------------------------------------------------------------ engine

    async def submit(self, request_ids: Sequence[str], prompts: Sequence[list[int]],
                     params: Sequence[SamplingParams], *, stream: bool, priority: int = 0
                     ) -> list[RequestOutputCollector]:
        """Queue one engine request per prompt; a disconnect from here on aborts them all."""
        engine = self.state.engine
        self._admit(sum(sp.n for sp in params), "prompt" if len(prompts) > 1 else "n")
        self._request_ids = list(request_ids)
        kind = OutputKind.DELTA if stream else OutputKind.FINAL_ONLY
        collectors = []
        try:
            for rid, ids, sp in zip(request_ids, prompts, params):
                collectors.append(await engine.add_request(rid, ids, sp, output_kind=kind, priority=priority))
        except BaseException as e:
            engine.abort_nowait(self._request_ids)
            raise engine_error(e) from None
        # Registered once all are queued: a client gone already (or while queueing) aborts them now.
        self.on_close(lambda: engine.abort_nowait(self._request_ids))
        self._collectors = collectors
        if stream:
            limit = self.state.config.limits.max_stream_backlog_tokens
            for c in collectors:
                c.limit_backlog(limit, self._slow_reader)
        return collectors

    def _slow_reader(self, behind: int) -> None:
        """A stream's client fell `behind` tokens of one choice back (it stopped reading: the socket's
        buffers are full, send_event waits on flush and the collector merges what the engine makes).
        Past --max-stream-backlog-tokens the request is aborted and the connection closed, so one
        such client holds at most that many tokens per choice here (issue 42's slow reader); it
        cannot be told with an error event, since it reads nothing."""
        if self.client_gone:
            return
        logger.warning("%s %s: the client stopped reading (%d tokens behind, the limit is %d); request aborted",
                       self.request.method, self.request.path, behind,
                       self.state.config.limits.max_stream_backlog_tokens)
        self.client_gone = True
        self.state.engine.abort_nowait(self._request_ids)
        stream = getattr(self.request.connection, "stream", None)
        if stream is not None:
            stream.close()  # the pending flush raises StreamClosedError: send_event ends the response

    def _admit(self, seqs: int, param: str) -> None:
        """Count this request's sequences in, or refuse it: past --max-num-seqs running plus
        --max-waiting-requests waiting a 503 with Retry-After (the engine's queue stays bounded);
        one that could never fit a 400."""
        state = self.state
        running = getattr(state.engine.args, "max_num_seqs", 256)
        bound = running + state.config.limits.max_waiting_requests
        if seqs > bound:
            raise bad_request(f"This request runs {seqs} sequences (prompts x n); the server takes at most {bound} "
                              "at once.", param)
        if state.draining:
            raise shutting_down()
        if state.admitted + seqs > bound:
            raise APIError(503, f"The server is at its limit of {bound} sequences running or waiting; retry shortly.",
                           code="server_overloaded", headers={"Retry-After": "1"})
        state.admitted += seqs
        self._admitted = seqs
        state.active.add(self)

    def _release(self) -> None:
        seqs, self._admitted = getattr(self, "_admitted", 0), 0
        self.state.admitted -= seqs
        self.state.active.discard(self)

    def abort_for_shutdown(self) -> None:
        """The server stops: abort this request's engine requests; its response ends with an error
        (outputs() raises shutting_down() once the collectors close)."""
        self._shutdown_abort = True
        self.state.engine.abort_nowait(self._request_ids)

    def on_finish(self) -> None:
        self._release()

    def on_connection_close(self) -> None:
        self._release()
        super().on_connection_close()

    async def outputs(self, collectors: list[RequestOutputCollector]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, from every collector, until all finish.
        Ends early (without error) once the client has gone and the requests were aborted;
        an engine failure raises the APIError a client should see."""
        if len(collectors) == 1:
            while True:
                try:
                    ro = await collectors[0].get()
                except Exception as e:
                    raise engine_error(e) from None
                if ro is None:
                    self._raise_if_shut_down()
                    return
                yield 0, ro
                if ro.finished:
                    return
        # Bounded, so a reader that stops (a stream whose client stopped reading) leaves the outputs
        # in the collectors, which merge them and bound the backlog, not in this queue.
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(collectors))

        async def pump(i: int, c: RequestOutputCollector) -> None:
            try:
                while (ro := await c.get()) is not None:
                    await queue.put((i, ro, None))
                    if ro.finished:
                        break
            except Exception as e:  # the engine died: hand the error to the reader
                await queue.put((i, None, e))
            await queue.put((i, None, None))

        tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(collectors)]
        try:
            live = len(tasks)
            while live:
                i, ro, err = await queue.get()
                if err is not None:
                    raise engine_error(err) from None
                if ro is None:
                    self._raise_if_shut_down()
                    live -= 1
                    continue
                yield i, ro
        finally:
            for t in tasks:
                t.cancel()

    def _raise_if_shut_down(self) -> None:
        if getattr(self, "_shutdown_abort", False):
            raise shutting_down()

    # ------------------------------------------------------------ Server-Sent Events

    def start_stream(self) -> None:
        self.set_header("Content-Type", "text/event-stream; charset=utf-8")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")

    async def send_event(self, data: Any) -> None:
        if self.client_gone:
            raise ClientGone()
        payload = data if isinstance(data, str) else encode_json(data)
        self.write(f"data: {payload}\n\n")
        # --stream-send-timeout: a flush that waits this long (the client read nothing meanwhile) closes
        # the connection, so the stream's unread frames do not hold it forever: after the request finished
        # (the [DONE] flush) nothing else would, the backlog bound covers only tokens still coming
        stalled = asyncio.get_running_loop().call_later(self.state.config.stream_send_timeout, self._send_stalled)
        try:
            await self.flush()
        except StreamClosedError:
            self.client_gone = True
            self.state.engine.abort_nowait(self._request_ids)
            raise ClientGone() from None
        finally:
            stalled.cancel()

    def _send_stalled(self) -> None:
        """A write of this stream waited --stream-send-timeout seconds: the client stopped reading.
        The connection is closed (the pending flush raises StreamClosedError) and a request still
        running aborted. Like nginx's send_timeout (the time between two successive writes); vLLM has
        none: uvicorn's flow control waits for the client to drain without a limit
        (uvicorn/protocols/http/flow_control.py FlowControl.drain)."""
        stream = getattr(self.request.connection, "stream", None)
        if self.client_gone or stream is None or not stream.writing():
            return  # written meanwhile (a loop that was busy runs this timer and the write's callback together)
        logger.warning("%s %s: the client read nothing for %g s; connection closed", self.request.method,
                       self.request.path, self.state.config.stream_send_timeout)
        stream.close()

    async def run_stream(self, events: AsyncIterator[Any]) -> None:
        """Send each event (a dict, or its JSON text), then [DONE]; an error after the first byte
        goes out as an error event."""
        self.start_stream()
        try:
            try:
                async for event in events:
                    await self.send_event(event)
            except ClientGone:
                raise
            except Exception as e:
                await self.send_event(engine_error(e).body())
            await self.send_event("[DONE]")
        except ClientGone:
            return
        finally:
            await events.aclose()  # stops the fan-in tasks now, not when the generator is collected
        if not self.client_gone:
            self.finish()


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; this request was stopped.", code="shutting_down")


MAX_REQUEST_ID_CHARS = 256  # a client's request_id / X-Request-Id, echoed in every chunk and header


def _is_request_id(value: str) -> bool:
    """Echoable as a header: printable ASCII, bounded."""
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS + 16 and value.isascii() and value.isprintable()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def engine_error(e: BaseException) -> BaseException:
    """An exception from the engine as the APIError a client should see."""
    if isinstance(e, APIError) or isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
        return e
    if isinstance(e, EngineDeadError):
        return APIError(503, "The engine has stopped; the server cannot serve requests.", code="engine_dead")
    if isinstance(e, InvalidSamplingParamsError):
        return bad_request(str(e), e.field)
    if isinstance(e, ValueError):
        return bad_request(str(e))
    logger.error("request failed", exc_info=(type(e), e, e.__traceback__))
    return APIError(500, "Internal server error; the server log has the details.")
