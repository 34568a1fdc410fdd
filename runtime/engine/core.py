"""EngineCore: schedule -> execute -> update, one step at a time.

vLLM's EngineCore.step (vllm/v1/engine/core.py) without the process and
socket plumbing: a caller (LLM, AsyncLLM) owns it and calls step().

With async scheduling (SchedulerConfig.async_scheduling; vLLM's
step_with_batch_queue with a batch queue of depth 2), step() schedules step
N+1 while step N executes, then waits for N and updates from it. The runner's
execute_model runs on one dedicated worker thread, or on the caller's (see
the end of this docstring). With a worker:
  - the scheduler, the requests and the KV cache manager belong to the caller's
    thread only (step, add_request, abort_requests, make_stats, snapshot);
  - the runner (its per-request state, the persistent batch, the executor and
    its KV cache) belongs to the worker thread only: steps run there strictly
    in order, so step N has appended its sampled tokens to the runner's state
    before step N+1 gathers its inputs from that state;
  - a SchedulerOutput is built by the caller and only read afterwards (the
    scheduler builds fresh containers for every step), and a ModelRunnerOutput
    is read by the caller only after its future resolved.
KV blocks freed while a step that still writes them is in flight (a request
finished, aborted or preempted meanwhile) can only be handed to a step
scheduled later, which runs after it on the same thread. Full blocks are
published to the prefix cache only up to a request's known tokens.
When no request is left unfinished, the in-flight steps are waited for and
dropped (their requests are all gone), so an idle engine runs nothing.

On the GPU the runner goes further (ModelRunner.defer_outputs): execute_model
returns once step N is queued, with its sampled ids still on the device, and
step N+1's inputs get them there. execute_model(N+1) queues N+1 and then reads
N back (the GPU is busy with N+1 meanwhile), resolving N's PendingOutput; with
no N+1 scheduled, N is read back on its own (ModelRunner.collect).
Such a runner (ModelRunner.launches_ahead) runs on the caller's thread, with no
worker: execute_model only queues work, so the overlap a worker would add is
already there (the device runs N+1 while this thread updates from N and
schedules N+2, as vLLM's single-process async scheduling does), and a worker
would only add two thread hand-offs and GIL contention to every step (H200,
a tiny model at 64 sequences: 0.72 ms a step synchronous, 1.3 ms with the worker).
The worker serves runners whose execute_model computes (the numpy executor).
"""
from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Iterable

from kiln.runtime.worker.model_runner import ModelRunner
from kiln.runtime.core.request import Request, RequestStatus
from kiln.runtime.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kiln.runtime.core.scheduler import Scheduler
from kiln.runtime.core.scheduler_stats import SchedulerStats


class InjectedFault(RuntimeError):
    """What KILN_FAULT_AFTER_STEPS makes a step raise."""


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps = 0
        self.last_step_tokens = 0
        self.async_scheduling = scheduler.async_scheduling
        # async scheduling: scheduled steps in flight, oldest first (at most 2)
        self._batch_queue: collections.deque[tuple[SchedulerOutput, Future]] = collections.deque()
        # empty steps (no tokens: they only tell the runner to drop finished requests) sent
        # while another step was in flight; waited for with the next one
        self._side_futures: list[Future] = []
        self._worker: ThreadPoolExecutor | None = None
        self._inline: bool | None = None  # run execute_model on this thread (decided at the first step)
        # The thread that last drove the runner here. A driver context is current per thread: the one
        # that loaded the model has it; another that steps (AsyncLLM's engine thread) binds it first.
        self._driver = threading.get_ident()
        if self.async_scheduling:
            runner.defer_outputs = True
        # A test hook (issue 42 "Faults"): with KILN_FAULT_AFTER_STEPS=N in the environment, the
        # step after N steps raises as a failing executor would, so the server's handling of an
        # engine that dies can be tested on a real engine. Unset, it costs one comparison a step.
        self._fault_after = int(os.environ.get("KILN_FAULT_AFTER_STEPS", "0") or 0)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def _bind_caller(self) -> None:
        """Make the executor's device context current on a thread that drives the runner here for
        the first time (synchronous steps, and async steps of a runner that only queues work)."""
        tid = threading.get_ident()
        if tid != self._driver:
            self._driver = tid
            bind = getattr(self.runner.executor, "bind_thread", None)
            if bind is not None:
                bind()

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        self._bind_caller()
        aborted = self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        if self._batch_queue and not self.scheduler.has_unfinished_requests():
            self._drain()
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """One engine step; -> per-request news in scheduling order."""
        self._bind_caller()
        if self.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return []
        so = self.scheduler.schedule()
        runner_out = self._execute(so)
        return self._finish_step(so, runner_out)

    def _execute(self, so: SchedulerOutput):
        if self._fault_after and self.num_steps >= self._fault_after:
            raise InjectedFault(f"injected executor fault after {self.num_steps} steps (KILN_FAULT_AFTER_STEPS)")
        return self.runner.execute_model(so)

    def _finish_step(self, so: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(so, runner_out)
        self.num_steps += 1
        self.last_step_tokens = so.total_num_scheduled_tokens
        for rid, lps in runner_out.prompt_logprobs.items():
            if lps is None:
                continue
            if rid in outputs:
                outputs[rid].new_prompt_logprobs = lps
            elif rid in self.scheduler.requests:  # a partial prefill chunk: no token yet
                outputs[rid] = EngineCoreOutput(rid, [], new_prompt_logprobs=lps)
        return list(outputs.values())

    # ------------------------------------------------------------ async scheduling

    def _submit(self, so: SchedulerOutput) -> Future:
        if self._inline is None:  # (read late: tests swap the runner's sampler after construction)
            self._inline = bool(getattr(self.runner, "launches_ahead", False))
        if self._inline:
            fut: Future = Future()
            try:
                fut.set_result(self._execute(so))
            except BaseException as e:  # raised where the worker's would be: at result()
                fut.set_exception(e)
            return fut
        if self._worker is None:
            # an executor bound to a thread-local state (the CUDA context) is bound to the worker
            bind = getattr(self.runner.executor, "bind_thread", None)
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-execute", initializer=bind)
        return self._worker.submit(self._execute, so)

    def _step_async(self) -> list[EngineCoreOutput]:
        """Keep up to two steps in flight; -> the outputs of the oldest, once it is done.
        Scheduling the next step (and, in the caller, processing these outputs) overlaps the
        execution of the one submitted before it."""
        q, sched = self._batch_queue, self.scheduler
        # A step that already failed (an inline launch raises at once) stops further launches:
        # its error is raised below when it reaches the head, and nothing runs after it.
        while len(q) < 2 and sched.has_unfinished_requests() and not (q and _failed(q[-1][1])):
            so = sched.schedule()
            fut = self._submit(so)
            if so.total_num_scheduled_tokens == 0:
                # Nothing to run now (every running request waits on its in-flight tokens, or
                # nothing fits): the runner still has to drop the finished requests, in order.
                if q:
                    self._side_futures.append(fut)
                else:
                    q.append((so, fut))  # as the synchronous step: an empty step of its own
                break
            q.append((so, fut))
        if not q:
            return []
        so, fut = q.popleft()
        runner_out = fut.result()
        if not isinstance(runner_out, ModelRunnerOutput):  # a PendingOutput: read back by the runner
            runner_out = self._collect(runner_out, q[0][1] if q else None)
        if self._side_futures:
            self._check_side_futures()
        outputs = self._finish_step(so, runner_out)
        if q and not sched.has_unfinished_requests():
            self._drain()
        return outputs

    def _collect(self, pending, next_fut: Future | None) -> ModelRunnerOutput:
        """The output of a step the runner returned before it ran: the next step, once queued,
        reads it back (ModelRunner._execute_sampling_on_device); without one, the runner's thread
        reads it back (ModelRunner.collect)."""
        if next_fut is not None:
            wait([pending.future, next_fut], return_when=FIRST_COMPLETED)
            if not pending.future.done():
                next_fut.result()  # raises what the runner raised
        if pending.future.done():
            return pending.future.result()
        return self._on_runner_thread(self.runner.collect, pending)

    def _on_runner_thread(self, fn, *args):
        """fn(*args) on the thread that runs the runner: this one, or the worker."""
        if self._worker is None:
            return fn(*args)
        return self._worker.submit(fn, *args).result()

    def _check_side_futures(self) -> None:
        pending = []
        for f in self._side_futures:
            if f.done():
                f.result()  # raises what the runner raised
            else:
                pending.append(f)
        self._side_futures = pending

    def _drain(self) -> None:
        """Wait for the steps in flight once no request is left: every request they ran is
        finished, so they have nothing to report (update_from_output would drop it all)."""
        while self._batch_queue:
            _, fut = self._batch_queue.popleft()
            fut.result()
        for f in self._side_futures:
            f.result()
        self._side_futures = []
        if (self._worker is not None or self._inline) and hasattr(self.runner, "flush"):
            self._on_runner_thread(self.runner.flush)  # placeholders settle before rows are reused

    def shutdown(self) -> None:
        """Wait for the steps in flight and stop the worker thread (async scheduling)."""
        self._bind_caller()
        self._drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    @property
    def max_model_len(self) -> int:
        """The longest request the scheduler accepts (capped by what the KV cache holds)."""
        return self.scheduler.max_model_len

    def snapshot(self) -> dict:
        """Gauges an operator reads, without resetting any counter."""
        s = self.scheduler
        return {"num_running_reqs": len(s.running), "num_waiting_reqs": len(s.waiting),
                "kv_cache_usage": s.kv_cache_manager.usage, "state_usage": s.kv_cache_manager.state_usage,
                "num_free_blocks": s.kv_cache_manager.block_pool.get_num_free_blocks(),
                "num_total_blocks": s.kv_cache_config.num_blocks}


def _failed(fut: Future) -> bool:
    """Whether fut is done with an exception (never waits)."""
    return fut.done() and not fut.cancelled() and fut.exception() is not None
