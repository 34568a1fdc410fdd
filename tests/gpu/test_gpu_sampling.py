"""On the GPU: the sampler runs where the logits are (runtime/sample/gpu_sampler.py), and agrees
with the numpy sampler (runtime/sample/sampler.py) on the same device logits: greedy tokens,
processed logits, logprobs and ranks, the kept sets of top-k / top-p / min-p, and the
draw's distribution; seeded requests draw the same alone and batched. Last, the kernels
at a 152k vocabulary, timed."""
from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.sample import ops
from kiln.runtime.sample.gpu_sampler import GpuSampler, PromptJob
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from kiln.runtime.sample.sampler import Sampler, compute_logprobs, gather_logprobs
from kiln.runtime.sample.metadata import SamplingMetadata
from tests.tiny_models import make_tiny_model

torch = pytest.importorskip("torch")
V = 256  # the tiny models' vocabulary


@pytest.fixture(scope="module")
def llm(tmp_path_factory, gpu_target):
    d = tmp_path_factory.mktemp("gpu_sampling")
    make_tiny_model(d, "qwen3_qknorm", dtype=torch.bfloat16)
    llm = LLM(d, target=gpu_target, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=128, kv_cache_tokens=16 * 512, bundle_dir=str(d / "bundle"),
              async_scheduling=False)  # spy() wraps GpuSampler.sample, the synchronous engine's call
    assert llm.engine.core.runner.gpu_sampler is not None, "the CUDA model runner should sample on the device"
    return llm


def _prompts(n, seed, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=int(k)).tolist() for k in rng.integers(lo, hi, size=n)]


@contextlib.contextmanager
def spy(llm):
    """Every engine step's raw logits rows (downloaded before the sampler runs), metadata and output."""
    sampler = llm.engine.core.runner.gpu_sampler
    inner, seen = sampler.sample, []

    def sample(rows, md, seeds=(), prompt=(), bitmask=None):
        raw = None
        if len(rows):
            raw = np.empty((max(rows) + 1, V), np.float32)
            sampler.ctx.download(sampler.logits_ptr, raw)
            raw = raw[rows]
        out, lps = inner(rows, md, seeds, prompt, bitmask)
        seen.append((raw, md, out))
        return out, lps

    sampler.sample = sample
    try:
        yield seen
    finally:
        del sampler.sample


def _reference_mask(row, temperature, k, p, min_p):
    sub = row[None] / np.float32(temperature)
    ops.apply_min_p(sub, np.array([min_p], np.float32))
    ops.apply_top_k_top_p(sub, None if k >= V else np.array([k]), None if p >= 1 else np.array([p], np.float32))
    return sub[0]


def test_greedy_tokens_are_the_argmax_of_the_device_logits(llm):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with spy(llm) as seen:
        outs = llm.generate(_prompts(12, 1), sp)
    steps = [(raw, out) for raw, _, out in seen if raw is not None]
    for raw, out in steps:
        assert out.sampled_token_ids.tolist() == raw.argmax(axis=1).tolist()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == 12 * 16 and sum(len(r) for r, _ in steps) == n
    print(f"\n[gpu sampling] greedy: {n} tokens over {len(steps)} steps equal the argmax of the device logits")


def _step_logits(llm, prompts, all_logits=False):
    """One prefill step through the executor: logits rows stay in device memory; -> host copy."""
    ex = llm.model.executor
    free = iter(range(ex.num_blocks - 1, 0, -1))  # the far end of the pool: the engine's cached blocks are safe
    chunks = [SeqChunk(p, 0, [next(free) for _ in range(-(-len(p) // 16))], all_logits=all_logits)
              for p in prompts]
    return ex.execute(prepare_step(chunks, 16))["logits"]


def test_processors_and_logprobs_equal_the_numpy_sampler(llm):
    sampler = llm.engine.core.runner.gpu_sampler
    rng = np.random.default_rng(3)
    prompts = _prompts(6, 3, hi=20)
    logits = _step_logits(llm, prompts)
    params = [SamplingParams(temperature=0, logprobs=5, logit_bias={4: 3.0, 9: -50.0}, repetition_penalty=1.4),
              SamplingParams(temperature=0, logprobs=5, frequency_penalty=0.7, presence_penalty=0.3,
                             min_tokens=3, stop_token_ids=[2, 200]),
              SamplingParams(temperature=0, allowed_token_ids=[5, 50, 150, 250], repetition_penalty=0.8),
              SamplingParams(temperature=0.8, top_k=12, logprobs=2, seed=7, logit_bias={17: 8.0}),
              SamplingParams(temperature=1.0, top_p=0.7, min_p=0.03, frequency_penalty=-0.4),
              SamplingParams(temperature=0, bad_words=["x"], logprobs=1)]
    outputs = [rng.integers(0, V, int(n)).tolist() for n in (0, 2, 9, 30, 5, 4)]
    outputs[5][-1] = 33
    bad = [None] * 5 + [[[33, 34], [90]]]
    md = SamplingMetadata.from_requests(params, prompts, outputs, V, generators=[p.new_generator() for p in params],
                                        bad_words_token_ids=bad, eos_token_ids=(1,))
    out, _ = sampler.sample(list(range(6)), md, [p.seed for p in params])
    processed = np.empty_like(logits)
    sampler.ctx.download(sampler.logits_ptr, processed)
    want = Sampler.apply_logits_processors(logits, md)
    bad_rows = {j: int((processed[j] != want[j]).sum()) for j in range(6) if not np.array_equal(processed[j], want[j])}
    assert not bad_rows, f"processed logits differ from the numpy sampler's (row: entries) {bad_rows}"
    ids = out.sampled_token_ids
    greedy = [0, 1, 2, 5]
    assert ids[greedy].tolist() == want[greedy].argmax(axis=1).tolist()
    assert ids[2] in (5, 50, 150, 250) and ids[5] not in (34, 90)
    for j in (3, 4):
        t, k = md.temperature[j], md.top_k[j] if md.top_k is not None else V
        p, mp = md.top_p[j] if md.top_p is not None else 1.0, md.min_p[j] if md.min_p is not None else 0.0
        assert np.isfinite(_reference_mask(want[j], t, k, p, mp)[ids[j]])
    ref = gather_logprobs(compute_logprobs(logits), 5, ids)
    assert out.logprobs.token_ids.tolist() == ref.token_ids.tolist()
    assert out.logprobs.ranks.tolist() == ref.ranks.tolist()
    err = float(np.abs(out.logprobs.logprobs - ref.logprobs).max())
    assert err < 1e-5
    print(f"\n[gpu sampling] processed logits bit-equal to numpy; logprobs, ranks and top-5 equal "
          f"(max logprob error {err:.1e})")


def test_prompt_logprobs_equal_the_numpy_sampler(llm):
    """Every position of a prefill through the logprob kernel (a bucket holds at most
    max_num_seqs = 16 logits rows, so 15 positions here)."""
    sampler = llm.engine.core.runner.gpu_sampler
    prompts = [p[:n] for p, n in zip(_prompts(3, 4, lo=10, hi=30), (4, 5, 6))]
    logits = _step_logits(llm, prompts, all_logits=True)
    jobs, row = [], 0
    for p in prompts:
        jobs.append(PromptJob(row, np.array(p[1:], np.int32), 3))
        row += len(p)
    _, got = sampler.sample([], None, prompt=jobs)
    err = 0.0
    for job, g in zip(jobs, got):
        n = len(job.targets)
        r = gather_logprobs(compute_logprobs(logits[job.first_row:job.first_row + n]), 3, job.targets)
        assert g.token_ids.tolist() == r.token_ids.tolist() and g.ranks.tolist() == r.ranks.tolist()
        err = max(err, float(np.abs(g.logprobs - r.logprobs).max()))
    assert err < 1e-5
    print(f"\n[gpu sampling] prompt logprobs of 12 positions equal (max error {err:.1e})")


def test_seeded_requests_draw_the_same_alone_and_batched(llm):
    prompts = _prompts(6, 5)
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    free = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompts[2], seeded)[0].outputs[0].token_ids
    params = [free, seeded, free, SamplingParams(temperature=0.5, seed=99, max_tokens=9), free, seeded]
    batched = [o.outputs[0].token_ids for o in llm.generate([prompts[i] for i in (0, 2, 1, 3, 4, 2)], params)]
    print(f"\n[gpu sampling] seeded alone {alone}\n  batched[1] {batched[1]}\n  batched[5] {batched[5]}")
    assert batched[1] == alone and batched[5] == alone
    others = [llm.generate(prompts[2], SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=s, max_tokens=16,
                                                      ignore_eos=True))[0].outputs[0].token_ids for s in (1, 2, 3)]
    assert any(o != alone for o in others), "three other seeds drew the same tokens"
    print(f"\n[gpu sampling] seeded: {len(alone)} tokens identical alone and at two places in a batch of 6")


def test_top_k_top_p_min_p_tokens_stay_in_the_kept_set(llm):
    kinds = [SamplingParams(temperature=0.8, top_k=5, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.2, top_p=0.6, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.0, min_p=0.2, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, max_tokens=12, ignore_eos=True)]
    with spy(llm) as seen:
        llm.generate(_prompts(8, 6), kinds * 2)
    checked, kept = 0, []
    for raw, md, out in seen:
        if raw is None:
            continue
        for j, tok in enumerate(out.sampled_token_ids):
            k = md.top_k[j] if md.top_k is not None else V
            p = md.top_p[j] if md.top_p is not None else 1.0
            mp = md.min_p[j] if md.min_p is not None else 0.0
            mask = _reference_mask(raw[j], md.temperature[j], k, p, mp)
            assert np.isfinite(mask[tok]), f"token {tok} outside the kept set (k={k}, p={p}, min_p={mp})"
            checked += 1
            kept.append(int(np.isfinite(mask).sum()))
    assert checked == 8 * 12
    print(f"\n[gpu sampling] top-k/top-p/min-p: {checked} draws inside the reference's kept sets "
          f"(kept {min(kept)}..{max(kept)} of {V})")


def _chi2_critical(df: int, z: float = 3.719) -> float:  # upper 1e-4 quantile (Wilson-Hilferty)
    a = 2.0 / (9 * df)
    return df * (1 - a + z * np.sqrt(a)) ** 3


def test_draws_follow_the_distribution(llm):
    sampler = llm.engine.core.runner.gpu_sampler
    row = _step_logits(llm, _prompts(1, 7))[0]
    n = 20000
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=10)):
        md = SamplingMetadata.from_requests([params] * n, [[0]] * n, [[]] * n, V)
        tok = sampler.sample([0] * n, md, [None] * n)[0].sampled_token_ids
        z = row.astype(np.float64) / params.temperature
        p = np.exp(z - z.max())
        if params.top_k:
            p[z < np.sort(z)[-params.top_k]] = 0
        p /= p.sum()
        assert set(np.unique(tok)) <= set(np.flatnonzero(p).tolist())
        big = n * p >= 5
        counts = np.bincount(tok, minlength=V)
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(n * p[big], n * p[~big].sum())
        obs, exp = obs[exp > 0], exp[exp > 0]
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        assert chi2 < _chi2_critical(len(obs) - 1), f"chi-square {chi2:.1f} over {len(obs)} bins"
        print(f"\n[gpu sampling] {n} draws, T={params.temperature} top_k={params.top_k}: "
              f"chi-square {chi2:.1f} over {len(obs)} bins (1e-4 critical {_chi2_critical(len(obs) - 1):.1f})")


def test_a_152k_vocabulary_against_numpy_and_timed(gpu_target):
    """The bundle's kernels at Qwen's vocabulary on random f32 rows: greedy, top-k/top-p
    kept sets, top-20 logprobs against numpy, and the time of a sample() call."""
    from kiln.codegen.triton.aot import compile_specs
    from kiln.codegen.triton.sampling import sampler_manifest, sampler_specs
    from kiln.runtime.worker.cuda_driver import CudaContext

    vocab, B = 151936, 64
    specs = sampler_specs(vocab)
    ctx = CudaContext()
    compiled = compile_specs([(s, gpu_target) for s in specs.values()])
    kernels = {r: ctx.load_kernel(c.cubin, c.name, c.num_warps, c.shared, c.n_hidden)
               for r, c in zip(specs, compiled)}
    manifest = {"logits": {"vocab": vocab},
                "sampler": sampler_manifest(specs, lambda role, spec: role),
                "kernels": {r: {"signature": list(s.signature.values())} for r, s in specs.items()}}
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((B, vocab)) * 2.5).astype(np.float32)
    ptr = ctx.to_device(logits)
    sampler = GpuSampler(ctx, manifest, kernels, ptr, seed=0)

    def md_of(params, n=B):
        params = params * n if len(params) == 1 else params
        return SamplingMetadata.from_requests(params, [[0]] * n, [[]] * n, vocab,
                                              generators=[p.new_generator() for p in params])

    def timed(rows, md, reps=5):
        ctx.upload(ptr, logits)
        out = sampler.sample(rows, md)[0]
        t0 = time.perf_counter()
        for _ in range(reps):
            sampler.sample(rows, md)
        return out, (time.perf_counter() - t0) / reps * 1e3

    times = {}
    greedy = SamplingParams(temperature=0)
    out, times["greedy x1"] = timed([0], md_of([greedy], 1))
    out, times["greedy x64"] = timed(list(range(B)), md_of([greedy]))
    assert out.sampled_token_ids.tolist() == logits.argmax(axis=1).tolist()
    _, times["temperature x64"] = timed(list(range(B)), md_of([SamplingParams(temperature=0.8)]))
    topkp = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    _, times["top-k+top-p x1"] = timed([0], md_of([topkp], 1))
    out, times["top-k+top-p x64"] = timed(list(range(B)), md_of([topkp]))
    for j, tok in enumerate(out.sampled_token_ids[:8]):
        assert np.isfinite(_reference_mask_v(logits[j], 0.8, 50, 0.9, vocab)[tok])
    lp = SamplingParams(temperature=0, logprobs=20)
    out, times["greedy + top-20 logprobs x64"] = timed(list(range(B)), md_of([lp]))
    print("\n[gpu sampling] V=151936, sample() wall time incl. staging and download (ms): "
          + ", ".join(f"{k} {v:.3f}" for k, v in times.items()))
    ref = gather_logprobs(compute_logprobs(logits), 20, out.sampled_token_ids)
    assert out.logprobs.token_ids.tolist() == ref.token_ids.tolist()
    assert out.logprobs.ranks.tolist() == ref.ranks.tolist()
    assert np.abs(out.logprobs.logprobs - ref.logprobs).max() < 1e-5
    seeded = sampler.sample([3] * 16, md_of([SamplingParams(temperature=1.0, seed=5)], 16), [5] * 16)[0]
    assert len(set(seeded.sampled_token_ids.tolist())) == 1  # one seed, one row: one draw, wherever it sits
    ctx.close()


def _reference_mask_v(row, temperature, k, p, vocab):
    sub = row[None] / np.float32(temperature)
    ops.apply_top_k_top_p(sub, np.array([k]) if k < vocab else None, np.array([p], np.float32))
    return sub[0]


def test_grammar_bitmask_at_152k_against_numpy(gpu_target):
    """The grammar-mask kernel in the bundle's sampler at Qwen's vocabulary: the masked rows in
    device memory equal ops.apply_token_bitmask's, greedy tokens are the masked argmax, and
    unconstrained rows are untouched; the time of a masked greedy sample() of 64 rows."""
    from kiln.codegen.triton.aot import compile_specs
    from kiln.codegen.triton.sampling import sampler_manifest, sampler_specs
    from kiln.runtime.sample.structured_output_manager import GrammarBitmask
    from kiln.runtime.worker.cuda_driver import CudaContext

    vocab, B = 151936, 64
    specs = sampler_specs(vocab)
    ctx = CudaContext()
    compiled = compile_specs([(s, gpu_target) for s in specs.values()])
    kernels = {r: ctx.load_kernel(c.cubin, c.name, c.num_warps, c.shared, c.n_hidden)
               for r, c in zip(specs, compiled)}
    manifest = {"logits": {"vocab": vocab},
                "sampler": sampler_manifest(specs, lambda role, spec: role),
                "kernels": {r: {"signature": list(s.signature.values())} for r, s in specs.items()}}
    rng = np.random.default_rng()
    logits = (rng.standard_normal((B, vocab)) * 2.5).astype(np.float32)
    ptr = ctx.to_device(logits)
    sampler = GpuSampler(ctx, manifest, kernels, ptr, seed=0)
    assert sampler.can_mask
    greedy = [SamplingParams(temperature=0)] * B
    md = SamplingMetadata.from_requests(greedy, [[0]] * B, [[]] * B, vocab)
    masked_rows = np.arange(0, B, 2)
    words = (vocab + 31) // 32 + 1  # a grammar vocabulary a little wider than the logits'
    bits = rng.integers(-2**31, 2**31, size=(len(masked_rows), words), dtype=np.int64).astype(np.int32)
    bits[0] = 0
    bits[0, 1000] = 1 << 5  # one token allowed: 32,005
    mask = GrammarBitmask(masked_rows, bits)
    out, _ = sampler.sample(list(range(B)), md, bitmask=mask)
    want = logits.copy()
    ops.apply_token_bitmask(want, masked_rows, bits)
    got = np.empty_like(logits)
    ctx.download(ptr, got)
    assert np.array_equal(got, want)
    assert out.sampled_token_ids.tolist() == want.argmax(axis=1).tolist() and out.sampled_token_ids[0] == 32005
    t0 = time.perf_counter()
    for _ in range(5):
        ctx.upload(ptr, logits)
        sampler.sample(list(range(B)), md, bitmask=mask)
    print(f"\n[gpu sampling] masked greedy x64 at V={vocab}: {(time.perf_counter() - t0) / 5 * 1e3:.2f} ms "
          f"a call (with a 39 MB upload)")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_constrained_requests_run_on_the_gpu(tmp_path_factory, gpu_target, async_scheduling):
    """Structured output on the device path end to end (a tiny random model with a real
    tokenizer): seeded temperature-1 requests under a regex, a JSON schema and a choice all
    hold, beside an unconstrained request, with async scheduling off and on (on, a constrained
    step reads the step before back before it is launched)."""
    import json
    import re

    import jsonschema

    from kiln.runtime.sample.structured_outputs import StructuredOutputsParams
    from tests.server.tiny_chat_model import make_tiny_chat_model

    d = tmp_path_factory.getbasetemp() / "gpu_constrained"
    if not d.exists():
        d.mkdir()
        make_tiny_chat_model(d)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "c": {"enum": ["red", "blue"]}},
              "required": ["n", "c"], "additionalProperties": False}
    grammars = [StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2,4}"), StructuredOutputsParams(json=schema),
                StructuredOutputsParams(choice=["yes", "no", "maybe"]), None]
    llm = LLM(d, target=gpu_target, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
              kv_cache_tokens=16 * 512, bundle_dir=str(d / "bundle"), async_scheduling=async_scheduling)
    assert llm.engine.core.runner.gpu_sampler.can_mask
    for seed in range(3):
        params = [SamplingParams(temperature=1.0, seed=seed * 10 + i, max_tokens=40 if g else 8,
                                 structured_outputs=g, ignore_eos=g is None) for i, g in enumerate(grammars)]
        outs = llm.generate(["hello", "a b c", "xyz", "free"], params)
        texts = [o.outputs[0].text for o in outs]
        assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", texts[0]), texts
        jsonschema.validate(json.loads(texts[1]), schema)
        assert texts[2] in ("yes", "no", "maybe") and len(outs[3].outputs[0].token_ids) == 8
        assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
