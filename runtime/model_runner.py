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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class ModelRunner:
    def __init__(self, executor, block_size: int, vocab_size: int, *, eos_token_ids: Sequence[int] = (),
                 encode: Callable[[str], list[int]] | None = None, seed: int | None = None) -> None:
        self.executor = executor
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.encode = encode  # for bad_words; None when running on token ids only
        self.sampler = Sampler(seed)
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
            tokens = (st.prompt_token_ids + st.output_token_ids)[start:start + n]
            sample = start + n >= st.num_tokens
            # prompt logprobs: logits of every prompt position this chunk computes
            want_prompt = (st.params.prompt_logprobs is not None and start < len(st.prompt_token_ids) - 1
                           and start + n > st.prompt_logprobs_done)
            ids.append(rid)
            samples.append(sample)
            chunks.append(SeqChunk(tokens, start, st.block_ids, sample=sample, all_logits=want_prompt))
        return ids, chunks, samples

    # -- one step -----------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        ids, chunks, samples = self._chunks(so)
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
        sampled: list[list[int]] = [[] for _ in ids]
        logprobs: list = [None] * len(ids)
        sample_idx = [i for i, s in enumerate(samples) if s]
        if sample_idx:
            states = [self.requests[ids[i]] for i in sample_idx]
            md = SamplingMetadata.from_requests(
                [s.params for s in states], [s.prompt_token_ids for s in states],
                [s.output_token_ids for s in states], self.vocab_size,
                generators=[s.generator for s in states],
                bad_words_token_ids=[s.bad_words_token_ids for s in states], eos_token_ids=self.eos_token_ids)
            out = self.sampler.sample(logits[rows], md)
            for j, i in enumerate(sample_idx):
                tok = int(out.sampled_token_ids[j])
                sampled[i] = [tok]
                states[j].output_token_ids.append(tok)
                if out.logprobs is not None and states[j].params.logprobs is not None:
                    logprobs[i] = out.logprobs.slice(j, j + 1)
        return ModelRunnerOutput(ids, sampled, logprobs, prompt_logprobs=prompt_lps)

    def _prompt_logprobs(self, st: RunnerRequestState, ch: SeqChunk, logits: np.ndarray) -> LogprobsTensors | None:
        """Row p of the chunk predicts prompt token start + p + 1 (vLLM: _get_prompt_logprobs_dict)."""
        prompt = st.prompt_token_ids
        skip = max(0, st.prompt_logprobs_done - ch.start_pos)
        n = min(len(ch.token_ids), len(prompt) - 1 - ch.start_pos)
        if n <= skip:
            return None
        st.prompt_logprobs_done = ch.start_pos + n
        k = st.params.prompt_logprobs
        k = self.vocab_size if k == -1 else k
        targets = np.asarray(prompt[ch.start_pos + 1 + skip: ch.start_pos + 1 + n], dtype=np.int64)
        return gather_logprobs(compute_logprobs(logits[skip:n]), k, targets)
