"""AsyncLLM: the engine behind an asyncio server (vLLM's vllm/v1/engine/async_llm.py).

vLLM runs the engine core in another process and talks to it over ZMQ; here the
LLMEngine runs on one thread of this process, and asyncio code talks to it
through two thread-safe channels:

- in: a command queue (add, abort, add a stat logger, stats) that only the
  engine thread drains, between steps. The engine is never touched from two
  threads, so it needs no locks of its own.
- out: after each step the engine thread hands every caller's new outputs to
  the caller's event loop with one `loop.call_soon_threadsafe` per loop; each
  request has a RequestOutputCollector there, which merges DELTA outputs when
  its consumer falls behind (vLLM's RequestOutputCollector).

The thread steps while there is work and sleeps on an Event when idle; numpy
releases the GIL inside BLAS, so the event loop keeps serving during steps. If
the engine raises, every pending request gets EngineDeadError and `errored`
turns true for good (the server's /health answers 503). Everything lives on the
instance: two AsyncLLMs in one process share nothing.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from kiln.runtime.engine.core_client import EngineCoreDeadError
from kiln.runtime.engine.llm_engine import LLMEngine
from kiln.runtime.engine.output_collector import RequestOutputCollector
from kiln.runtime.engine.outputs import OutputKind, RequestOutput
from kiln.runtime.sample.sampling_params import SamplingParams

logger = logging.getLogger("kiln.async_llm")

_instances = itertools.count()  # only names threads; carries no state between engines


class EngineDeadError(RuntimeError):
    """The engine loop stopped (it raised, or shutdown() ran); no request can be served."""


class RequestFailedError(ValueError):
    """The engine could not run this one request (FinishReason.ERROR: its own parameters failed
    inside a step, issue 42 #8); the engine and every other request go on. A ValueError: the
    server answers 400 with the message, or an error event once streaming."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine, *, args: Any = None, model: Any = None) -> None:
        self.engine = engine
        self.args = args  # the EngineArgs it was built from, if any
        self.model = model  # the loaded model (kiln.loader.LoadedModel), if any
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._inflight: Optional[concurrent.futures.Future] = None  # the command the engine thread runs
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._lock = threading.Lock()  # guards _collectors and the dead/stopped flags
        self._wake = threading.Event()
        self._dead_error: Optional[BaseException] = None
        self._stopping = False
        # Progress watch (issue 42 #7: a deadlocked engine-process pipe hung every client while
        # /health said 200): the engine thread stamps each step and command it finishes; busy
        # with no stamp for stall_timeout seconds, the engine counts as stalled (/health 503).
        # A step longer than this (a huge prefill chunk on a slow CPU) reads as a stall too.
        self.stall_timeout = 60.0
        self._last_progress = time.monotonic()
        self._idle = True
        self._thread = threading.Thread(target=self._run, name=f"kiln-engine-{next(_instances)}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- state

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self.errored

    @property
    def is_stopped(self) -> bool:
        return not self._thread.is_alive()

    @property
    def dead_error(self) -> Optional[BaseException]:
        return self._dead_error

    @property
    def stalled_for(self) -> float:
        """Seconds the engine thread has been busy without finishing a step or a command, once
        that passes stall_timeout; 0.0 while it makes progress or sits idle."""
        if self._idle or not self.is_running:
            return 0.0
        busy = time.monotonic() - self._last_progress
        return busy if busy > self.stall_timeout else 0.0

    async def check_health(self) -> None:
        """Raise EngineDeadError unless the engine loop is alive."""
        if not self.is_running:
            raise EngineDeadError(self._dead_message())

    def _dead_message(self) -> str:
        err = self._dead_error
        if err is None or isinstance(err, EngineDeadError):
            return str(err) if err else "the engine is not running"
        return f"the engine loop failed: {type(err).__name__}: {err}"

    # ---------------------------------------------------------------- tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine was loaded without a tokenizer")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            raise ValueError("this engine was loaded without a tokenizer")
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------- requests

    async def add_request(self, request_id: str, prompt: str | Sequence[int], params: Optional[SamplingParams] = None,
                          *, output_kind: OutputKind = OutputKind.DELTA, priority: int = 0) -> RequestOutputCollector:
        """Queue a request; -> its collector once the engine accepted it.
        A bad request raises here (ValueError and its kin), before any output."""
        loop = asyncio.get_running_loop()
        collector = RequestOutputCollector(output_kind, loop)
        with self._lock:
            if self._dead_error is not None or self._stopping:
                raise EngineDeadError(self._dead_message())
            if request_id in self._collectors:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._collectors[request_id] = collector
        fut = self._submit(lambda: self.engine.add_request(request_id, prompt, params, output_kind=output_kind,
                                                           priority=priority))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort_nowait([request_id])
            raise
        except BaseException:
            with self._lock:
                self._collectors.pop(request_id, None)
            raise
        return collector

    async def generate(self, prompt: str | Sequence[int], sampling_params: Optional[SamplingParams],
                       request_id: str, priority: int = 0, *,
                       output_kind: OutputKind = OutputKind.DELTA) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (DELTA by default: each holds what is new).
        Closing or cancelling the iteration aborts the request."""
        collector = await self.add_request(request_id, prompt, sampling_params, output_kind=output_kind,
                                           priority=priority)
        try:
            while True:
                out = await collector.get()
                if out is None:  # aborted
                    return
                yield out
                if out.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self.abort_nowait([request_id])
            raise

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests; their collectors end and their KV blocks return to the pool."""
        self.abort_nowait([request_id] if isinstance(request_id, str) else list(request_id))

    def abort_nowait(self, request_ids: Sequence[str]) -> None:
        """abort() for synchronous callers (a disconnect callback); thread-safe, never blocks."""
        request_ids = list(request_ids)
        with self._lock:
            collectors = [self._collectors.pop(r, None) for r in request_ids]
        for c in collectors:
            if c is not None:
                _call_on_loop(c.loop, c.close)
        self._submit(lambda: self.engine.abort_request(request_ids))  # a dead engine has nothing to free

    def add_stat_logger(self, stat_logger: Any) -> None:
        """Subscribe a logger (record(scheduler_stats, iteration_stats)); called on the engine thread."""
        self._submit(lambda: self.engine.stat_loggers.append(stat_logger))

    async def stats(self) -> dict[str, Any]:
        """engine.stats(), read on the engine thread between steps."""
        return await asyncio.wrap_future(self._submit(self.engine.stats))

    # ---------------------------------------------------------------- lifecycle

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still pending get EngineDeadError."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # _die sets the error under this lock, then fails what is queued
            dead = self._dead_error is not None
            if not dead:
                self._commands.append((fn, fut))
        if dead:
            fut.set_exception(EngineDeadError(self._dead_message()))
        self._wake.set()
        return fut

    # ---------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        stats_stale = False  # requests changed while idle: tell the stat loggers once
        try:
            while not self._stopping:
                self._wake.clear()
                stats_stale |= self._drain_commands()
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    self._last_progress = time.monotonic()
                    stats_stale = True
                    continue
                if stats_stale:
                    self._record_idle_stats()
                    stats_stale = False
                self._idle = True
                self._wake.wait()
                self._last_progress, self._idle = time.monotonic(), False
            err: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as e:  # the engine itself failed: every caller must hear of it
            logger.exception("engine loop failed")
            err = e
        self._die(err)

    def _drain_commands(self) -> bool:
        ran = False
        while self._commands:
            fn, fut = self._commands.popleft()
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            self._inflight = fut  # what escapes below ends the loop, and _die fails this caller too
            try:
                result = fn()
            except EngineCoreDeadError:  # the core process is gone: the engine's end, not a bad request
                raise
            except Exception as e:  # a bad request: its caller gets the error
                fut.set_exception(e)
            else:
                fut.set_result(result)
            self._inflight = None
            self._last_progress = time.monotonic()
        return ran

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for ro in outputs:
                c = self._collectors.pop(ro.request_id, None) if ro.finished else self._collectors.get(ro.request_id)
                if c is not None:
                    by_loop.setdefault(c.loop, []).append((c, _failure(ro) or ro))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                self.engine.abort_request([ro.request_id for _, ro in items])

    def _record_idle_stats(self) -> None:
        """Gauges (running, KV usage) after aborts or the last step, when no step will report them."""
        if self.engine.stat_loggers:
            self.engine.record_idle_stats()

    def _die(self, err: BaseException) -> None:
        stop_core = getattr(self.engine.core, "shutdown", None)  # an engine core process ends with us
        if stop_core is not None:
            stop_core()
        with self._lock:
            self._dead_error = err
            collectors, self._collectors = list(self._collectors.values()), {}
        dead = err if isinstance(err, EngineDeadError) else EngineDeadError(self._dead_message())
        inflight, self._inflight = self._inflight, None  # (after _dead_error: its caller may ask /health)
        if inflight is not None and not inflight.done():
            inflight.set_exception(dead)
        while self._commands:
            _, fut = self._commands.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(dead)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for c in collectors:
            by_loop.setdefault(c.loop, []).append((c, dead))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass


def _call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> None:
    """fn() now if this thread runs `loop`, else on that loop's thread (asyncio is not thread-safe)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn()
        return
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # that loop is closed: nobody waits on it
        pass


def _failure(ro: RequestOutput) -> Optional[RequestFailedError]:
    """The error a finished output with finish_reason "error" stands for, else None."""
    if ro.finished:
        for c in ro.outputs:
            if c.finish_reason == "error":
                return RequestFailedError(f"the engine could not run this request: {c.stop_reason}")
    return None


def _put_all(items: list) -> None:
    for collector, item in items:
        collector.put(item)


__all__ = ["AsyncLLM", "EngineDeadError", "RequestFailedError", "RequestOutputCollector"]
