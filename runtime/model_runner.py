"""The model runner: applies a SchedulerOutput to its per-request state, runs
one step on an executor, samples, and hands back ModelRunnerOutput.

vLLM's GPUModelRunner keeps a persistent InputBatch updated by diffs; this one
keeps, per request, the prompt, the tokens sampled so far, the block table and
the sampling state (seeded generator, tokenised bad words), and rebuilds the
flat step arrays each step (runtime/input_batch.py). The executor is anything
with `execute(inputs) -> {name: logits}` and `num_blocks`: numpy now, CUDA later.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kiln.runtime.gpu_sampler import PromptJob
from kiln.runtime.input_batch import SeqChunk, prepare_step
from kiln.runtime.sampler import LogprobsTensors, Sampler, compute_logprobs, gather_logprobs
from kiln.runtime.sampling_metadata import SamplingMetadata
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sched_output import ModelRunnerOutput, SchedulerOutput


@dataclass
class RunnerRequestState:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: np.random.Generator | None = None
    bad_words_token_ids: list | None = None
    prompt_logprobs_done: int = 0  # prompt positions already scored (a resumed request skips them)
    _block_arr: np.ndarray | None = None  # block_ids as i32, rebuilt only when blocks were added

    def block_array(self) -> np.ndarray:
        """The block table row as a numpy array, cached: a decode step adds a block only every
        block_size tokens, and prepare_step concatenates these arrays in C."""
        if self._block_arr is None or len(self._block_arr) != len(self.block_ids):
            self._block_arr = np.array(self.block_ids, dtype=np.int32)
        return self._block_arr

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


class ModelRunner:
    def __init__(self, executor, block_size: int, vocab_size: int, *, eos_token_ids: Sequence[int] = (),
                 encode: Callable[[str], list[int]] | None = None, seed: int | None = None,
                 gpu_sampling: bool = True) -> None:
        self.executor = executor
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.encode = encode  # for bad_words; None when running on token ids only
        self.sampler = Sampler(seed)
        # An executor that can sample where its logits are (CudaExecutor) does: only token
        # ids and asked-for logprobs come back. The numpy Sampler stays the reference.
        make = getattr(executor, "make_sampler", None) if gpu_sampling else None
        self.gpu_sampler = make(seed) if make is not None else None
        self.requests: dict[str, RunnerRequestState] = {}

    # -- state from the scheduler's diff (see sched_output.py) --------------------------
    def _apply(self, so: SchedulerOutput) -> None:
        # Preempted requests keep their state: they come back as resumed cached requests.
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            bad = None
            if params.bad_words:
                if self.encode is None:
                    raise ValueError("bad_words needs a tokenizer")
                bad = params.tokenize_bad_words(self.encode, self.vocab_size)
            self.requests[new.req_id] = RunnerRequestState(
                new.req_id, list(new.prompt_token_ids), params, list(new.block_ids[0]),
                generator=params.new_generator(), bad_words_token_ids=bad)
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            st = self.requests[rid]
            blocks = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                st.block_ids = list(blocks[0]) if blocks else []
                st._block_arr = None  # a resumed request's table is new, whatever its length
            elif blocks:
                st.block_ids.extend(blocks[0])
            if rid in c.all_token_ids:
                st.output_token_ids = c.all_token_ids[rid][len(st.prompt_token_ids):]

    def _chunks(self, so: SchedulerOutput) -> tuple[list[str], list[SeqChunk], list[bool]]:
        ids, chunks, samples = [], [], []
        starts = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        c = so.scheduled_cached_reqs
        starts.update(zip(c.req_ids, c.num_computed_tokens))
        for rid, start in starts.items():
            n = so.num_scheduled_tokens[rid]
            st = self.requests[rid]
            tokens = st.tokens(start, start + n)
            sample = start + n >= st.num_tokens
            # prompt logprobs: logits of every prompt position this chunk computes
            want_prompt = (st.params.prompt_logprobs is not None and start < len(st.prompt_token_ids) - 1
                           and start + n > st.prompt_logprobs_done)
            ids.append(rid)
            samples.append(sample)
            chunks.append(SeqChunk(tokens, start, st.block_array(), sample=sample, all_logits=want_prompt))
        return ids, chunks, samples

    # -- one step -----------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        ids, chunks, samples = self._chunks(so)
        if self.gpu_sampler is not None:
            return self._execute_sampling_on_device(ids, chunks, samples)
        logits = next(iter(self.executor.execute(prepare_step(chunks, self.block_size)).values()))
        rows, prompt_lps, row = [], {}, 0
        for rid, ch, sample in zip(ids, chunks, samples):
            if ch.all_logits:
                n = len(ch.token_ids)
                prompt_lps[rid] = self._prompt_logprobs(self.requests[rid], ch, logits[row:row + n])
                row += n
                if sample:
                    rows.append(row - 1)
            elif sample:
                rows.append(row)
                row += 1
        sample_idx = [i for i, s in enumerate(samples) if s]
        states = [self.requests[ids[i]] for i in sample_idx]
        out = self.sampler.sample(logits[rows], self._metadata(states)) if states else None
        return self._output(ids, sample_idx, states, out, prompt_lps)

    @staticmethod
    def _output(ids: list[str], sample_idx: list[int], states: list[RunnerRequestState], out,
                prompt_lps: dict) -> ModelRunnerOutput:
        """Record each sampled token with its request and hand the step's results back."""
        sampled: list[list[int]] = [[] for _ in ids]
        logprobs: list = [None] * len(ids)
        for j, i in enumerate(sample_idx):
            tok = int(out.sampled_token_ids[j])
            sampled[i] = [tok]
            states[j].output_token_ids.append(tok)
            if out.logprobs is not None and states[j].params.logprobs is not None:
                logprobs[i] = out.logprobs.slice(j, j + 1)
        return ModelRunnerOutput(ids, sampled, logprobs, prompt_logprobs=prompt_lps)

    def _metadata(self, states: list[RunnerRequestState]) -> SamplingMetadata:
        return SamplingMetadata.from_requests(
            [s.params for s in states], [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states], self.vocab_size,
            generators=[s.generator for s in states],
            bad_words_token_ids=[s.bad_words_token_ids for s in states], eos_token_ids=self.eos_token_ids)

    def _prompt_logprobs(self, st: RunnerRequestState, ch: SeqChunk, logits: np.ndarray) -> LogprobsTensors | None:
        """Row p of the chunk predicts prompt token start + p + 1 (vLLM: _get_prompt_logprobs_dict)."""
        job = self._prompt_job(st, ch)
        if job is None:
            return None
        skip, n, targets, k = job
        return gather_logprobs(compute_logprobs(logits[skip:n]), k, targets)

    def _prompt_job(self, st: RunnerRequestState, ch: SeqChunk):
        """-> (first row, end row, target tokens, top k) of the chunk's rows still to score, or None."""
        prompt = st.prompt_token_ids
        skip = max(0, st.prompt_logprobs_done - ch.start_pos)
        n = min(len(ch.token_ids), len(prompt) - 1 - ch.start_pos)
        if n <= skip:
            return None
        st.prompt_logprobs_done = ch.start_pos + n
        k = st.params.prompt_logprobs
        k = self.vocab_size if k == -1 else k
        targets = np.asarray(prompt[ch.start_pos + 1 + skip: ch.start_pos + 1 + n], dtype=np.int64)
        return skip, n, targets, k

    def _execute_sampling_on_device(self, ids: list[str], chunks: list[SeqChunk],
                                    samples: list[bool]) -> ModelRunnerOutput:
        """execute_model with the logits left on the device: the executor runs the step and
        the GpuSampler in one call, on the same rows, metadata and prompt-logprob targets."""
        rows, jobs, prompt_lps, row = [], {}, {}, 0
        for rid, ch, sample in zip(ids, chunks, samples):
            if ch.all_logits:
                job = self._prompt_job(self.requests[rid], ch)
                prompt_lps[rid] = None
                if job is not None:
                    skip, _, targets, k = job
                    jobs[rid] = PromptJob(row + skip, targets.astype(np.int32), k)
                row += len(ch.token_ids)
                if sample:
                    rows.append(row - 1)
            elif sample:
                rows.append(row)
                row += 1
        sample_idx = [i for i, s in enumerate(samples) if s]
        states = [self.requests[ids[i]] for i in sample_idx]
        out, prompt = self.executor.execute_and_sample(
            prepare_step(chunks, self.block_size), self.gpu_sampler, rows, self._metadata(states) if states else None,
            seeds=[s.params.seed for s in states], prompt=list(jobs.values()))
        prompt_lps.update(zip(jobs, prompt))
        return self._output(ids, sample_idx, states, out, prompt_lps)
