"""The model runner's cached state against from-scratch computation.

PersistentBatch.gather must give exactly prepare_step's arrays for the same chunks, and
SamplingMetadata.next_step exactly from_requests; checked on random edits, and inside a
real engine over many steps with chunked prefill, preemption, aborts and mixed params.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from kiln.runtime.worker.persistent_batch import PersistentBatch
from kiln.runtime.sample.metadata import SamplingMetadata
from tests.tiny_models import make_tiny_model

BS = 16


def assert_same_inputs(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype == np.int32, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def assert_same_metadata(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for f in dataclasses.fields(SamplingMetadata):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray) or isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        elif f.name == "output_token_ids":
            assert [list(x) for x in a] == [list(x) for x in b]
        else:
            assert a == b, f.name


@pytest.mark.parametrize("seed", range(20))
def test_gather_equals_prepare_step_over_random_edits(seed):
    rng = np.random.default_rng(seed)
    batch = PersistentBatch(BS, rows=2, max_tokens=8, max_blocks=1)  # small: growth is exercised
    ref: dict[int, tuple[list[int], list[int]]] = {}  # row -> (tokens, blocks)
    for _ in range(60):
        op = rng.random()
        if op < 0.3 or not ref:
            toks = rng.integers(0, 300, int(rng.integers(1, 80))).tolist()
            blocks = rng.permutation(500)[:-(-len(toks) // BS) + int(rng.integers(0, 3))].tolist()
            ref[batch.add(toks, blocks)] = (toks, blocks)
        elif op < 0.4:
            row = int(rng.choice(list(ref)))
            batch.remove(row)
            del ref[row]
        elif op < 0.5:
            row = int(rng.choice(list(ref)))
            toks = rng.integers(0, 300, int(rng.integers(1, 120))).tolist()
            batch.set_tokens(row, toks)
            ref[row] = (toks, ref[row][1])
        elif op < 0.6:
            row = int(rng.choice(list(ref)))
            blocks = rng.permutation(500)[:int(rng.integers(0, 12))].tolist()
            batch.set_blocks(row, blocks)
            ref[row] = (ref[row][0], blocks)
        elif op < 0.7:
            row = int(rng.choice(list(ref)))
            more = rng.permutation(500)[:int(rng.integers(0, 4))].tolist()
            batch.append_blocks(row, more)
            ref[row][1].extend(more)
        else:
            rows = rng.permutation(list(ref))[:int(rng.integers(1, len(ref) + 1))]
            new = rng.integers(0, 300, len(rows))
            batch.append_tokens(rows, new)
            for r, t in zip(rows.tolist(), new.tolist()):
                ref[r][0].append(t)
        for row, (toks, blocks) in ref.items():
            assert batch.num_tokens[row] == len(toks)
            assert batch.block_ids(row) == blocks
        # a step over some rows: chunks that fit each row's tokens and blocks
        rows, starts, lens, sample, full, chunks = [], [], [], [], [], []
        for row in rng.permutation(list(ref)).tolist():
            toks, blocks = ref[row]
            cap = min(len(toks), len(blocks) * BS)
            if cap == 0:
                continue
            start = int(rng.integers(0, cap))
            r = rng.random()
            n = int(rng.integers(1, cap - start + 1)) if r < 0.45 else 1 if r < 0.9 else 0  # 0: an empty chunk
            rows.append(row)
            starts.append(start)
            lens.append(n)
            sample.append(start + n >= len(toks))
            full.append(bool(rng.random() < 0.15))
            chunks.append(SeqChunk(toks[start:start + n], start, blocks, sample=sample[-1], all_logits=full[-1]))
        want = prepare_step(chunks, BS)
        got = batch.gather(np.array(rows, np.intp), np.array(starts, np.int64), np.array(lens, np.int64),
                           np.array(sample, bool), np.array(full, bool))
        assert_same_inputs(got, want)


@pytest.mark.parametrize("lens", [[1, 1, 1], [0, 2, 1], [2, 0, 1], [0, 0, 0], [3, 0, 0]])
def test_gather_equals_prepare_step_when_every_chunk_samples(lens):
    """As many tokens as chunks is not a decode step unless every chunk has one token."""
    batch = PersistentBatch(BS)
    toks = [[10 + 7 * r + i for i in range(5)] for r in range(3)]
    rows = [batch.add(t, [r + 1]) for r, t in enumerate(toks)]
    starts = [5 - n for n in lens]
    chunks = [SeqChunk(t[s:s + n], s, [r + 1]) for r, (t, s, n) in enumerate(zip(toks, starts, lens))]
    got = batch.gather(np.array(rows, np.intp), np.array(starts), np.array(lens), np.ones(3, bool))
    assert_same_inputs(got, prepare_step(chunks, BS))


def test_gather_names_a_short_block_table():
    batch = PersistentBatch(BS)
    batch.add([1] * 20, [3])
    with pytest.raises(ValueError, match="sequence 0: 1 blocks cannot hold 20 tokens"):
        batch.gather(np.array([0], np.intp), np.array([0]), np.array([20]), np.array([True]))


def _random_params(rng, i):
    kinds = [
        lambda: SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 30))),
        lambda: SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i, max_tokens=int(rng.integers(1, 30))),
        lambda: SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5,
                               max_tokens=int(rng.integers(1, 30))),
        lambda: SamplingParams(temperature=0, min_tokens=5, max_tokens=int(rng.integers(6, 30)),
                               stop_token_ids=[7, 9]),
        lambda: SamplingParams(temperature=0, logprobs=2, prompt_logprobs=1, max_tokens=int(rng.integers(1, 20))),
        lambda: SamplingParams(temperature=0.5, logit_bias={3: 2.0, 5: -1.0}, allowed_token_ids=list(range(40)),
                               max_tokens=int(rng.integers(1, 20))),
    ]
    return kinds[int(rng.integers(0, len(kinds)))]()


@pytest.mark.parametrize("seed", range(3))
def test_runner_cached_state_equals_from_scratch_in_a_real_engine(tmp_path, seed):
    """Every step's inputs and sampling metadata, from the runner's cached state, equal those
    built from scratch from the requests' token lists and the scheduler's block tables."""
    make_tiny_model(tmp_path, "llama_gqa_untied")
    llm = LLM(tmp_path, skip_tokenizer_init=True, kv_cache_tokens=16 * 16, max_num_batched_tokens=48,
              max_num_seqs=12)  # few blocks: preemptions; small budget: chunked prefills
    eng, core = llm.engine, llm.engine.core
    runner, kv = core.runner, core.scheduler.kv_cache_manager
    checked = {"steps": 0, "metadata_reused": 0}
    step_inputs, metadata = runner._step_inputs, runner._metadata

    def checked_inputs(plan):
        got = step_inputs(plan)
        chunks = []
        for st, start, n, sample, full in zip(plan.states, plan.starts.tolist(), plan.lens.tolist(),
                                              plan.sample.tolist(), [False] * len(plan.ids)
                                              if plan.all_logits is None else plan.all_logits.tolist()):
            blocks = kv.get_block_ids(st.req_id)[0]
            assert runner.block_ids(st.req_id) == blocks
            assert runner.batch.num_tokens[st.row] == st.num_tokens
            assert sample == (start + n >= st.num_tokens)
            chunks.append(SeqChunk(st.tokens(start, start + n), start, blocks, sample=sample, all_logits=full))
        assert_same_inputs(got, prepare_step(chunks, runner.block_size))
        checked["steps"] += 1
        return got

    def checked_metadata(states):
        reused = tuple(states) == runner._md_key
        got = metadata(states)
        want = SamplingMetadata.from_requests(
            [s.params for s in states], [s.prompt_token_ids for s in states], [s.output_token_ids for s in states],
            runner.vocab_size, generators=[s.generator for s in states],
            bad_words_token_ids=[s.bad_words_token_ids for s in states], eos_token_ids=runner.eos_token_ids)
        assert_same_metadata(got, want)
        checked["metadata_reused"] += reused
        return got

    runner._step_inputs, runner._metadata = checked_inputs, checked_metadata
    rng = np.random.default_rng(seed)
    n_added = 0
    for it in range(300):
        if n_added < 40 and rng.random() < 0.3:
            prompt = rng.integers(0, 256, int(rng.integers(1, 70))).tolist()
            if rng.random() < 0.3 and n_added:  # a shared prefix: prefix-cache hits
                prompt = [1, 2, 3] * 12 + prompt[:10]
            eng.add_request(f"r{n_added}", prompt, _random_params(rng, n_added))
            n_added += 1
        if rng.random() < 0.05 and core.scheduler.requests:
            eng.abort_request([str(rng.choice(sorted(core.scheduler.requests)))])
        if eng.has_unfinished_requests():
            eng.step()
        elif n_added >= 40:
            break
    assert checked["steps"] > 50 and checked["metadata_reused"] > 5
    assert eng.totals.num_preemptions > 0
