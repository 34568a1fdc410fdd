"""The engine core in its own process (vLLM's EngineCoreProc + core_client).

The front process keeps HTTP, tokenisation, detokenisation and stop strings; the
child runs the scheduler, the model runner and the executor in a busy loop and
streams one message per step. Each side has its own interpreter, so JSON and
socket writes never take the GIL from a step. `EngineCoreClient` offers the
surface LLMEngine uses from an in-process EngineCore (add_request,
abort_requests, step, make_stats, snapshot, max_model_len), so LLMEngine and
AsyncLLM work unchanged on top of it.

Messages (pickled over a multiprocessing Pipe; the front writes through a PipeWriter thread,
so that a burst can never leave both sides blocked writing: runtime/engine/pipe_writer.py):
  front -> core: ("add", Request) | ("abort", ([ids], seq)) | ("shutdown", None)
  core -> front: ("ready", info) | ("failed", a KilnError's sentence: the engine could not be built)
                 | ("step", packed outputs, SchedulerStats, tokens, snapshot)
                 | ("idle", SchedulerStats, snapshot, seq) | ("rejected", id, message) | ("error", message)

"idle" is the core's report once it has nothing to run after aborts, naming the last abort
it applied: a front whose requests were all aborted waits for it, so its gauges (running
requests, KV and state usage) show the freed blocks rather than the last step's.
"""
from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any, Callable, Iterable

from kiln.errors import KilnError
from kiln.runtime.core.request import FinishReason, Request
from kiln.runtime.core.sched_output import EngineCoreOutput
from kiln.runtime.core.scheduler_stats import PrefixCacheStats, SchedulerStats
from kiln.runtime.engine.pipe_writer import PipeWriter


class EngineCoreDeadError(RuntimeError):
    pass


class EngineCoreStartError(EngineCoreDeadError, KilnError):
    """The core could not build its engine for a reason a user can fix (a KilnError in the child:
    a missing model, a GPU target without cuda-python or a driver): its one sentence."""


_FIELDS = ("request_id", "new_token_ids", "finish_reason", "new_logprobs", "new_prompt_logprobs", "stop_reason",
           "num_cached_tokens")  # EngineCoreOutput's, in order


def pack_outputs(outputs: list[EngineCoreOutput]) -> tuple[list, ...]:
    """A step's outputs as one list per field: pickle writes and reads lists of ids, token lists
    and Nones several times faster than one object per request (the core pays the writing,
    every step)."""
    return tuple([getattr(o, f) for o in outputs] for f in _FIELDS)


def unpack_outputs(packed: tuple[list, ...]) -> list[EngineCoreOutput]:
    return list(map(EngineCoreOutput, *packed))


def _core_main(build: Callable[[], tuple[Any, Any]], conn) -> None:
    """The child: build the engine (`build()` -> (LLMEngine, loaded model)), then step while
    there is work, block on the pipe when idle."""
    try:
        try:
            engine, _ = build()
        except KilnError as e:  # the user's to fix: one sentence, not the child's traceback
            conn.send(("failed", str(e)))
            return
        core = engine.core
        conn.send(("ready", {"max_model_len": core.max_model_len, "snapshot": core.snapshot()}))
        aborted = None  # the seq of the last abort applied, reported once idle
        while True:
            while conn.poll(0) or not core.has_unfinished_requests():
                if not conn.poll(0) and aborted is not None:  # idle after aborts: report the freed blocks
                    conn.send(("idle", core.make_stats(), core.snapshot(), aborted))
                    aborted = None
                cmd, payload = conn.recv()
                if cmd == "add":
                    try:
                        core.add_request(payload)
                    except ValueError as e:  # validated in front already; never kill the loop for one request
                        conn.send(("rejected", payload.request_id, str(e)))
                elif cmd == "abort":
                    ids, aborted = payload
                    core.abort_requests(ids)
                elif cmd == "shutdown":
                    return
            outputs = core.step()
            conn.send(("step", pack_outputs(outputs), core.make_stats(), core.last_step_tokens, core.snapshot()))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        return  # the front went away
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc(limit=20)))
        except (OSError, EOFError):
            pass


class EngineCoreClient:
    """`build`: a picklable callable the child runs to make its engine (-> (LLMEngine, loaded
    model)), for example functools.partial(kiln.entrypoints.engine.build_engine, engine_args):
    the runtime starts the process, the level above it says what to load."""

    IDLE_REPORT_TIMEOUT = 30.0  # seconds a front with nothing left waits for the core's report after aborts

    def __init__(self, build: Callable[[], tuple[Any, Any]], *, start_timeout: float = 900.0) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no threads or device state inherited
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_core_main, args=(build, child), name="kiln-engine-core", daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout):
            self.shutdown()
            raise EngineCoreDeadError(f"the engine core did not start within {start_timeout:.0f} s")
        msg = self._recv()
        if msg[0] == "failed":
            self.process.join(10)
            raise EngineCoreStartError(msg[1])
        if msg[0] != "ready":
            raise EngineCoreDeadError(f"the engine core failed to start: {msg[-1]}")
        # every send goes through the writer thread: a blocking send here could deadlock against
        # the core's step sends under a burst (runtime/engine/pipe_writer.py)
        self._writer = PipeWriter(self._conn)
        self._max_model_len = msg[1]["max_model_len"]
        self._snapshot = msg[1]["snapshot"]
        self._unfinished: set[str] = set()
        self._pending_stats: list[SchedulerStats] = []
        self.last_step_tokens = 0
        self._abort_seq = 0  # aborts sent
        self._abort_acked = 0  # the last abort the core's idle report named

    def _recv(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            code = self.process.exitcode
            raise EngineCoreDeadError(f"the engine core process died (exit code {code})") from None

    def _send(self, msg: tuple) -> None:
        try:
            self._writer.send(msg)
        except (OSError, EOFError):
            raise EngineCoreDeadError("the engine core process is gone") from None

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def add_request(self, request: Request) -> None:
        self._send(("add", request))
        self._unfinished.add(request.request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        ids = [r for r in request_ids if r in self._unfinished]
        if ids:
            self._abort_seq += 1
            self._send(("abort", (ids, self._abort_seq)))
            self._unfinished.difference_update(ids)
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def step(self) -> list[EngineCoreOutput]:
        """The outputs of the core's next step (blocks until it arrives)."""
        if not self._unfinished:
            self._drain()
            return []
        return self._handle(self._recv())

    def _drain(self) -> None:
        """Read what the core has sent; with nothing left to run after aborts, wait (bounded)
        for its idle report, so the freed blocks show in the gauges."""
        while self._conn.poll(0):
            self._handle(self._recv())
        while self._abort_acked < self._abort_seq and not self._unfinished:
            if not self._conn.poll(self.IDLE_REPORT_TIMEOUT):
                break  # a core stuck in a long step: the gauges catch up at the next read
            self._handle(self._recv())

    def _handle(self, msg: tuple) -> list[EngineCoreOutput]:
        kind = msg[0]
        if kind == "error":
            raise EngineCoreDeadError(f"the engine core failed:\n{msg[1]}")
        if kind == "idle":
            _, stats, snapshot, seq = msg
            self._pending_stats.append(stats)
            self._snapshot, self._abort_acked = snapshot, max(self._abort_acked, seq)
            return []
        if kind == "rejected":
            _, rid, message = msg
            self._unfinished.discard(rid)
            return [EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT, stop_reason=message)]
        _, packed, stats, tokens, snapshot = msg
        outputs = unpack_outputs(packed)
        self._pending_stats.append(stats)
        self.last_step_tokens, self._snapshot = tokens, snapshot
        for o in outputs:
            if o.finish_reason is not None:
                self._unfinished.discard(o.request_id)
        return outputs

    def make_stats(self) -> SchedulerStats:
        """Counters summed over the steps received since the last call; gauges from the latest."""
        if not self._unfinished:
            self._drain()
        pending, self._pending_stats = self._pending_stats, []
        snap = self._snapshot
        pc = PrefixCacheStats()
        for s in pending:
            p = s.prefix_cache_stats
            pc.reset |= p.reset
            for f in ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits"):
                setattr(pc, f, getattr(pc, f) + getattr(p, f))
        return SchedulerStats(num_running_reqs=snap["num_running_reqs"], num_waiting_reqs=snap["num_waiting_reqs"],
                              kv_cache_usage=snap["kv_cache_usage"], state_usage=snap.get("state_usage", 0.0),
                              prefix_cache_stats=pc,
                              num_preemptions=sum(s.num_preemptions for s in pending))

    def snapshot(self) -> dict:
        if not self._unfinished:
            self._drain()
        return dict(self._snapshot)

    def shutdown(self, timeout: float = 10.0) -> None:
        writer = getattr(self, "_writer", None)  # (absent when the core failed to start)
        try:
            if writer is not None:
                writer.send(("shutdown", None))  # after whatever is still queued
                writer.close(timeout)
            else:
                self._conn.send(("shutdown", None))
        except (OSError, EOFError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
