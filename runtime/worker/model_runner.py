"""The model runner: applies a SchedulerOutput to its per-request state, runs
one step on an executor, samples, and hands back ModelRunnerOutput.

As vLLM's GPUModelRunner keeps a persistent InputBatch updated by diffs, this one
keeps, per request, the prompt, the tokens sampled so far and the sampling state
(seeded generator, tokenised bad words), and in a PersistentBatch (one row per
request: token ids, block table) what the flat step arrays are gathered from
(runtime/worker/persistent_batch.py; runtime/worker/input_batch.py's prepare_step is the reference). The executor is anything
with `execute(inputs) -> {name: logits}` and `num_blocks`: numpy now, CUDA later.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kiln.runtime.sample.gpu_sampler import PromptJob
from kiln.runtime.worker.persistent_batch import PersistentBatch
from kiln.runtime.sample.sampler import LogprobsTensors, Sampler, compute_logprobs, gather_logprobs
from kiln.runtime.sample.metadata import SamplingMetadata
from kiln.runtime.sample.sampling_params import SamplingParams
from kiln.runtime.sample.structured_output_manager import StructuredOutputManager
from kiln.runtime.core.sched_output import CachedRequestData, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("kiln.model_runner")


@dataclass(eq=False)  # identity equality: the sampling-metadata cache keys on the batch's states
class RunnerRequestState:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    row: int  # its row in the runner's PersistentBatch (token ids, block table)
    output_token_ids: list[int] = field(default_factory=list)
    generator: np.random.Generator | None = None
    bad_words_token_ids: list | None = None
    prompt_logprobs_done: int = 0  # prompt positions already scored (a resumed request skips them)
    grammar: object = None  # its RequestGrammar when its output is constrained (structured output)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """prompt + output [start:stop] without concatenating them (a decode step asks for one
        token of a sequence that may be thousands long)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]


@dataclass(eq=False)
class PendingOutput:
    """A step launched with its results still on the device (ModelRunner.defer_outputs):
    its sampled requests hold a placeholder token until collect() reads the ids back."""
    plan: "StepPlan"
    sample_idx: list[int]
    states: list[RunnerRequestState]
    handle: object  # GpuSampler.launch's
    jobs: list[str]  # request ids of the prompt-logprob jobs, in order
    prompt_lps: dict
    spots: list[tuple[int, int]]  # per sampled state: (index in its output ids, index in its batch row)
    output: ModelRunnerOutput | None = None
    future: Future = field(default_factory=Future)  # resolved with `output` by ModelRunner.collect
    failed: dict = field(default_factory=dict)  # ModelRunnerOutput.failed of its step
    grammars: list | None = None  # per sampled state, its RequestGrammar or None (None: none constrained)


@dataclass
class StepPlan:
    """The scheduled chunks of one step, in runner order (longest context first: _chunks)."""
    ids: list[str]
    states: list[RunnerRequestState]
    rows: np.ndarray  # intp[n]: PersistentBatch rows
    starts: np.ndarray  # i64[n]: tokens already computed
    lens: np.ndarray  # i64[n]: tokens computed this step
    sample: np.ndarray  # bool[n]: the chunk reaches the request's last token
    all_logits: np.ndarray | None  # bool[n]: prompt-logprob chunks (None: no request asks for them)

    @property
    def sample_idx(self) -> list[int]:
        return np.flatnonzero(self.sample).tolist()


def _without(so: SchedulerOutput, failed: set[str]) -> SchedulerOutput:
    """The step less the requests that failed to start (the scheduler's own output is left as it
    is: update_from_output finishes them from ModelRunnerOutput.failed)."""
    tokens = {rid: n for rid, n in so.num_scheduled_tokens.items() if rid not in failed}
    c = so.scheduled_cached_reqs
    keep = [i for i, rid in enumerate(c.req_ids) if rid not in failed]
    if len(keep) < len(c.req_ids):
        c = CachedRequestData([c.req_ids[i] for i in keep], c.resumed_req_ids - failed,
                              [c.new_token_ids[i] for i in keep],
                              {r: t for r, t in c.all_token_ids.items() if r not in failed},
                              [c.new_block_ids[i] for i in keep], [c.num_computed_tokens[i] for i in keep],
                              [c.num_output_tokens[i] for i in keep])
    return dataclasses.replace(so, scheduled_new_reqs=[n for n in so.scheduled_new_reqs if n.req_id not in failed],
                               scheduled_cached_reqs=c, num_scheduled_tokens=tokens,
                               total_num_scheduled_tokens=sum(tokens.values()))


def _reads_tokens(params: SamplingParams) -> bool:
    """Whether sampling with `params` reads the request's tokens on the host (penalties, bad
    words: SamplingMetadata's no_penalties and bad_words_token_ids), so that a step feeding it
    device-sampled ids must wait for them."""
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.bad_words)


class ModelRunner:
    def __init__(self, executor, block_size: int, vocab_size: int, *, eos_token_ids: Sequence[int] = (),
                 encode: Callable[[str], list[int]] | None = None, seed: int | None = None,
                 gpu_sampling: bool = True, grammar_tokenizer=None) -> None:
        self.executor = executor
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.encode = encode  # for bad_words; None when running on token ids only
        # the compiled CPU target's sampling kernels where the executor has them (same tokens)
        self.sampler = Sampler(seed, compiled=getattr(executor, "compiled_sampler", None))
        # An executor that can sample where its logits are (CudaExecutor) does: only token
        # ids and asked-for logprobs come back. The numpy Sampler stays the reference.
        make = getattr(executor, "make_sampler", None) if gpu_sampling else None
        self.gpu_sampler = make(seed) if make is not None else None
        self.requests: dict[str, RunnerRequestState] = {}
        self.structured = StructuredOutputManager(grammar_tokenizer)  # costs nothing until a request is constrained
        self.batch = PersistentBatch(block_size)
        self._num_prompt_logprobs = 0  # held requests with prompt_logprobs set
        self._md_key: tuple = ()  # the states the cached SamplingMetadata was built for
        self._md: SamplingMetadata | None = None
        self._md_min_tokens = False
        # Async scheduling (runtime/engine/core.py) sets this: steps sampling on the device return a
        # PendingOutput, and the next step is launched with the sampled ids fed to its inputs
        # on the device before this one's ids are read back (vLLM: AsyncGPUModelRunnerOutput
        # and the previous step's sampled ids gathered into input_ids on the GPU).
        self.defer_outputs = False
        self._in_flight: list[PendingOutput] = []  # oldest first
        self.fed_steps = 0  # steps launched with ids fed from the step before (for tests and stats)
        self._failed: dict[str, str] = {}  # this step's new requests whose state could not be built
        # ... and those of earlier steps the scheduler has not yet said are finished: with async
        # scheduling the step after theirs was scheduled before they failed, and names them too
        self._failed_ids: set[str] = set()

    @property
    def launches_ahead(self) -> bool:
        """execute_model returns once its step is queued on the device, without waiting for it
        (deferred outputs, a sampler that feeds ids): a caller can run it on its own thread."""
        return self.defer_outputs and self.gpu_sampler is not None and self.gpu_sampler.can_feed

    # -- state from the scheduler's diff (see sched_output.py) --------------------------
    def _drop(self, rid: str) -> None:
        st = self.requests.pop(rid, None)
        if st is not None:
            self.batch.remove(st.row)
            self.structured.drop(st.grammar)
            if st.params.prompt_logprobs is not None:
                self._num_prompt_logprobs -= 1

    def _apply(self, so: SchedulerOutput) -> None:
        # Preempted requests keep their state: they come back as resumed cached requests.
        for rid in so.finished_req_ids:
            self._drop(rid)
        self._failed = {}
        if self._failed_ids and so.finished_req_ids:
            self._failed_ids -= so.finished_req_ids
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            self._drop(new.req_id)
            try:  # what the request's own parameters build: a failure there is this request's only
                bad = None
                if params.bad_words:
                    if self.encode is None:
                        raise ValueError("bad_words needs a tokenizer")
                    bad = params.tokenize_bad_words(self.encode, self.vocab_size)
                generator = params.new_generator()
                if params.structured_outputs is not None and self.gpu_sampler is not None \
                        and not self.gpu_sampler.can_mask:
                    raise ValueError("structured output needs the grammar-mask kernel, which this bundle "
                                     "was compiled without: recompile it")
                grammar = self.structured.new_request(params)
            except Exception as e:  # (issue 42 #8: seed=-5 once raised here and killed the engine)
                logger.warning("request %s failed to start", new.req_id, exc_info=True)
                self._failed[new.req_id] = f"{type(e).__name__}: {e}"
                self._failed_ids.add(new.req_id)
                continue
            # a hybrid model's second group is its state: one block, the request's state slot
            row = self.batch.add(new.prompt_token_ids, new.block_ids[0],
                                 new.block_ids[1][0] if len(new.block_ids) > 1 and new.block_ids[1] else -1)
            self.requests[new.req_id] = RunnerRequestState(
                new.req_id, list(new.prompt_token_ids), params, row,
                generator=generator, bad_words_token_ids=bad)
            self.requests[new.req_id].grammar = grammar
            if params.prompt_logprobs is not None:
                self._num_prompt_logprobs += 1
        c = so.scheduled_cached_reqs
        reqs, batch = self.requests, self.batch
        if c.resumed_req_ids or c.all_token_ids:
            for rid, blocks in zip(c.req_ids, c.new_block_ids):
                st = reqs[rid]
                if rid in c.resumed_req_ids:  # a resumed request's table is new, whatever its length
                    batch.set_blocks(st.row, blocks[0] if blocks else [])
                    if blocks and len(blocks) > 1 and blocks[1]:  # and so is its state slot (it recomputes)
                        batch.state_slot[st.row] = blocks[1][0]
                elif blocks:
                    batch.append_blocks(st.row, blocks[0])
                toks = c.all_token_ids.get(rid)
                if toks is not None:
                    st.output_token_ids = toks[len(st.prompt_token_ids):]
                    batch.set_tokens(st.row, toks)
        else:  # the usual step: only some block tables grow
            for rid, blocks in zip(c.req_ids, c.new_block_ids):
                if blocks:
                    batch.append_blocks(reqs[rid].row, blocks[0])

    def block_ids(self, req_id: str) -> list[int]:
        """The request's block table as the runner holds it."""
        return self.batch.block_ids(self.requests[req_id].row)

    def _chunks(self, so: SchedulerOutput) -> StepPlan:
        new, c = so.scheduled_new_reqs, so.scheduled_cached_reqs
        if new:
            ids = [n.req_id for n in new] + c.req_ids
            starts = [n.num_computed_tokens for n in new] + c.num_computed_tokens
        else:
            ids, starts = list(c.req_ids), c.num_computed_tokens
        n = len(ids)
        reqs = self.requests
        states = [reqs[rid] for rid in ids]
        rows = np.fromiter([st.row for st in states], np.intp, n)
        starts = np.array(starts, np.int64)
        lens = np.fromiter(map(so.num_scheduled_tokens.__getitem__, ids), np.int64, n)
        ends = starts + lens
        if n > 1 and (ends[1:] > ends[:-1]).any():
            # Longest context first. A decode step's attention is a program per (sequence, KV
            # head), launched sequence fastest, each as long as its sequence's keys; the GPU
            # starts programs in launch order, so the longest going first leaves the short ones
            # to fill the tail (longest-processing-time-first). A list-scheduling model of 512
            # sequences of 1,000-2,000 keys on 528 slots: 1.10x the ideal in a random order,
            # 1.01x longest first. Rows never mix (batch invariance), so the order changes no
            # token; the scheduler matches outputs by request id. Ties keep the scheduler's
            # order, so a steady batch keeps one order (and its cached SamplingMetadata).
            order = np.argsort(-ends, kind="stable")
            pick = operator.itemgetter(*order.tolist())  # (n > 1: a tuple)
            ids, states = list(pick(ids)), list(pick(states))
            rows, starts, lens, ends = rows[order], starts[order], lens[order], ends[order]
        sample = ends >= self.batch.num_tokens[rows]
        all_logits = None
        if self._num_prompt_logprobs:
            # prompt logprobs: logits of every prompt position this chunk computes
            all_logits = np.array([st.params.prompt_logprobs is not None and s < len(st.prompt_token_ids) - 1
                                   and e > st.prompt_logprobs_done
                                   for st, s, e in zip(states, starts.tolist(), ends.tolist())], dtype=bool)
        return StepPlan(ids, states, rows, starts, lens, sample, all_logits)

    def _step_inputs(self, plan: StepPlan) -> dict[str, np.ndarray]:
        return self.batch.gather(plan.rows, plan.starts, plan.lens, plan.sample, plan.all_logits)

    @staticmethod
    def _logits_layout(plan: StepPlan) -> tuple[list[int], list[tuple[int, int]]]:
        """-> (the logits row of each sampling request, in order; (chunk index, first row) of
        each prompt-logprob chunk). Rows follow prepare_step's logits_indices."""
        if plan.all_logits is None or not plan.all_logits.any():
            return list(range(int(np.count_nonzero(plan.sample)))), []
        rows, prompt_chunks, row = [], [], 0
        for i, (full, sample, n) in enumerate(zip(plan.all_logits.tolist(), plan.sample.tolist(),
                                                  plan.lens.tolist())):
            if full:
                prompt_chunks.append((i, row))
                row += n
                if sample:
                    rows.append(row - 1)
            elif sample:
                rows.append(row)
                row += 1
        return rows, prompt_chunks

    # -- one step -----------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | PendingOutput:
        c = so.scheduled_cached_reqs
        if self._in_flight and (so.finished_req_ids or c.resumed_req_ids or c.all_token_ids):
            self.flush()  # rows are dropped or rewritten below: their placeholders settle first
        self._apply(so)
        if self._failed_ids:  # run the step without them; the scheduler finishes them (ModelRunnerOutput.failed)
            so = _without(so, self._failed_ids)
        if so.state_restores:  # prefix-cache hits: snapshots into the slots this step reads
            self.executor.copy_state_slots(so.state_restores)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [], failed=self._failed)
        plan = self._chunks(so)
        if self.gpu_sampler is not None:
            pending = self._execute_sampling_on_device(plan, so.state_saves)
            pending.failed = self._failed
            return pending
        logits = next(iter(self.executor.execute(self._step_inputs(plan)).values()))
        if so.state_saves:  # the slots as this step left them, kept as snapshots
            self.executor.copy_state_slots(so.state_saves)
        rows, prompt_chunks = self._logits_layout(plan)
        prompt_lps = {}
        for i, r0 in prompt_chunks:
            start, n = int(plan.starts[i]), int(plan.lens[i])
            prompt_lps[plan.ids[i]] = self._prompt_logprobs(plan.states[i], start, n, logits[r0:r0 + n])
        sample_idx = plan.sample_idx
        states = plan.states if len(sample_idx) == len(plan.ids) else [plan.states[i] for i in sample_idx]
        grammars = [st.grammar for st in states] if self.structured.num_requests else None
        mask = self.structured.bitmask(grammars) if grammars else None
        out = self.sampler.sample(logits[rows], self._metadata(states), mask) if states else None
        result = self._output(plan, sample_idx, states, out, prompt_lps)
        result.failed = self._failed
        self._accept(result, plan, sample_idx, grammars)
        return result

    def _accept(self, result: ModelRunnerOutput, plan: StepPlan, sample_idx: list[int], grammars) -> None:
        """The step's grammars take their sampled tokens; a grammar at a dead end names its request's
        stop reason."""
        if grammars:
            self.structured.accept(grammars, result_tokens(result, sample_idx))
            result.stop_reasons = self.structured.stop_reasons([plan.ids[i] for i in sample_idx], grammars)

    def _output(self, plan: StepPlan, sample_idx: list[int], states: list[RunnerRequestState], out,
                prompt_lps: dict, record: bool = True) -> ModelRunnerOutput:
        """Record each sampled token with its request (record: False when placeholders hold
        their places already) and hand the step's results back."""
        ids = plan.ids
        if not states:
            return ModelRunnerOutput(ids, [[] for _ in ids], [None] * len(ids), prompt_logprobs=prompt_lps)
        toks_arr = np.asarray(out.sampled_token_ids)
        toks = toks_arr.tolist()
        if record:
            for st, tok in zip(states, toks):
                st.output_token_ids.append(tok)
        if len(sample_idx) == len(ids):
            if record:
                self.batch.append_tokens(plan.rows, toks_arr)
            sampled = [[tok] for tok in toks]
        else:
            if record:
                self.batch.append_tokens(plan.rows[sample_idx], toks_arr)
            sampled = [[] for _ in ids]
            for i, tok in zip(sample_idx, toks):
                sampled[i] = [tok]
        logprobs: list = [None] * len(ids)
        if out.logprobs is not None:
            for j, i in enumerate(sample_idx):
                if states[j].params.logprobs is not None:
                    logprobs[i] = out.logprobs.slice(j, j + 1)
        return ModelRunnerOutput(ids, sampled, logprobs, prompt_logprobs=prompt_lps)

    def _metadata(self, states: list[RunnerRequestState]) -> SamplingMetadata:
        """The batch's SamplingMetadata. Everything in it but the tokens generated so far is
        fixed per request, so while the sampled requests are the same ones in the same order
        (every decode step of a steady batch) the previous step's arrays are reused."""
        key = tuple(states)  # RunnerRequestState compares by identity
        outputs = [s.output_token_ids for s in states]
        if key == self._md_key:
            return self._md.next_step(outputs, [s.params for s in states] if self._md_min_tokens else None,
                                      self.eos_token_ids)
        self._md = SamplingMetadata.from_requests(
            [s.params for s in states], [s.prompt_token_ids for s in states], outputs, self.vocab_size,
            generators=[s.generator for s in states],
            bad_words_token_ids=[s.bad_words_token_ids for s in states], eos_token_ids=self.eos_token_ids)
        self._md_key = key
        self._md_min_tokens = any(s.params.min_tokens for s in states)
        return self._md

    def _prompt_logprobs(self, st: RunnerRequestState, start: int, n: int,
                         logits: np.ndarray) -> LogprobsTensors | None:
        """Row p of the chunk predicts prompt token start + p + 1 (vLLM: _get_prompt_logprobs_dict)."""
        job = self._prompt_job(st, start, n)
        if job is None:
            return None
        skip, n, targets, k = job
        return gather_logprobs(compute_logprobs(logits[skip:n]), k, targets)

    def _prompt_job(self, st: RunnerRequestState, start: int, num_tokens: int):
        """-> (first row, end row, target tokens, top k) of the chunk's rows still to score, or None."""
        prompt = st.prompt_token_ids
        skip = max(0, st.prompt_logprobs_done - start)
        n = min(num_tokens, len(prompt) - 1 - start)
        if n <= skip:
            return None
        st.prompt_logprobs_done = start + n
        k = st.params.prompt_logprobs
        k = self.vocab_size if k == -1 else k
        targets = np.asarray(prompt[start + 1 + skip: start + 1 + n], dtype=np.int64)
        return skip, n, targets, k

    def _execute_sampling_on_device(self, plan: StepPlan, state_saves=()) -> ModelRunnerOutput | PendingOutput:
        """execute_model with the logits left on the device: the executor runs the step and
        the GpuSampler in one call, on the same rows, metadata and prompt-logprob targets.
        With defer_outputs, returns before the step has run (see PendingOutput, collect).
        state_saves: slot copies queued on the device after the step (before any later one)."""
        rows, prompt_chunks = self._logits_layout(plan)
        jobs, prompt_lps = {}, {}
        for i, r0 in prompt_chunks:
            rid = plan.ids[i]
            job = self._prompt_job(plan.states[i], int(plan.starts[i]), int(plan.lens[i]))
            prompt_lps[rid] = None
            if job is not None:
                skip, _, targets, k = job
                jobs[rid] = PromptJob(r0 + skip, targets.astype(np.int32), k)
        sample_idx = plan.sample_idx
        states = plan.states if len(sample_idx) == len(plan.ids) else [plan.states[i] for i in sample_idx]
        grammars = [st.grammar for st in states] if self.structured.num_requests else None
        if grammars is not None and all(g is None for g in grammars):
            grammars = None
        feed = None
        if self._in_flight:
            if grammars is not None or any(_reads_tokens(st.params) for st in states):
                # penalties and bad words read the tokens themselves, on the host; a grammar must
                # have taken its request's last token before it can say what may come next
                self.flush()
            else:
                feed = self._feed(plan, self._in_flight[-1])
        inputs, seeds = self._step_inputs(plan), [s.params.seed for s in states]
        # The sampling metadata and the grammar masks are made once the model's launches are
        # queued (the executor calls these): the GPU runs the step meanwhile, so neither a
        # prompt's first token nor a constrained row waits on the host's part.
        md = (lambda: self._metadata(states)) if states else None
        extra = {"bitmask": lambda: self.structured.bitmask(grammars)} if grammars is not None else {}
        if not self.launches_ahead:
            out, prompt = self.executor.execute_and_sample(inputs, self.gpu_sampler, rows, md, seeds=seeds,
                                                           prompt=list(jobs.values()), **extra)
            if state_saves:
                self.executor.copy_state_slots(state_saves)
            prompt_lps.update(zip(jobs, prompt))
            result = self._output(plan, sample_idx, states, out, prompt_lps)
            self._accept(result, plan, sample_idx, grammars)
            return result
        # (at most one step is in flight here: each deferred launch below reads its predecessor back)
        handle = self.executor.launch_and_sample(inputs, self.gpu_sampler, rows, md, seeds=seeds,
                                                 prompt=list(jobs.values()), feed=feed, **extra)
        if state_saves:
            self.executor.copy_state_slots(state_saves)
        self.fed_steps += feed is not None
        # placeholders where the sampled tokens go: the next step's lengths count them, and
        # its input ids at those places are fed on the device (_feed)
        spots = [(len(st.output_token_ids), int(n)) for st, n in zip(states, self.batch.num_tokens[plan.rows[sample_idx]])]
        for st in states:
            st.output_token_ids.append(-1)
        self.batch.append_tokens(plan.rows[sample_idx], np.full(len(states), -1, np.int32))
        pending = PendingOutput(plan, sample_idx, states, handle, list(jobs), prompt_lps, spots, grammars=grammars)
        self._in_flight.append(pending)
        if handle.host_gather:  # logprobs from raw rows a later step would overwrite: read them now
            self.collect(pending)
        # the step before this one is read back now that this one is queued behind it
        while len(self._in_flight) > 1:
            self.collect(self._in_flight[0])
        return pending

    def _feed(self, plan: StepPlan, prev: PendingOutput):
        """-> (prev's handle, rows of prev's sampled ids, positions in this step's input ids) for
        the tokens of this step still in flight in prev, or None when it has none."""
        where = {id(st): (j, spot[1]) for j, (st, spot) in enumerate(zip(prev.states, prev.spots))}
        src, dst = [], []
        flat = 0
        for st, start, n in zip(plan.states, plan.starts.tolist(), plan.lens.tolist()):
            hit = where.get(id(st))
            if hit is not None and start <= hit[1] < start + n:
                src.append(hit[0])
                dst.append(flat + hit[1] - start)
            flat += n
        if not src:
            return None
        return prev.handle, np.array(src, np.int32), np.array(dst, np.int32)

    def collect(self, pending: PendingOutput | ModelRunnerOutput) -> ModelRunnerOutput:
        """The results of a step execute_model returned before it ran: wait for its ids (and
        those of any step launched before it), put them in place of its placeholders."""
        if isinstance(pending, ModelRunnerOutput):
            return pending
        while pending.output is None:
            p = self._in_flight.pop(0)
            out, prompt = self.gpu_sampler.collect(p.handle)
            p.prompt_lps.update(zip(p.jobs, prompt))
            if out is not None:
                toks = np.asarray(out.sampled_token_ids).tolist()
                for st, (oi, bi), tok in zip(p.states, p.spots, toks):
                    if self.requests.get(st.req_id) is st:  # (a dropped request's row may be reused)
                        st.output_token_ids[oi] = tok
                        self.batch.token_ids[st.row, bi] = tok
            p.output = self._output(p.plan, p.sample_idx, p.states, out, p.prompt_lps, record=False)
            p.output.failed = p.failed
            self._accept(p.output, p.plan, p.sample_idx, p.grammars)
            p.future.set_result(p.output)
        return pending.output

    def flush(self) -> None:
        """Collect every step in flight."""
        if self._in_flight:
            self.collect(self._in_flight[-1])


def result_tokens(out: ModelRunnerOutput, sample_idx: list[int]) -> list[int]:
    """The token sampled for each sampling request of the step, in sample_idx order."""
    return [out.sampled_token_ids[i][0] for i in sample_idx]
