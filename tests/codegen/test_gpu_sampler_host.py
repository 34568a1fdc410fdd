"""runtime/sample/gpu_sampler.py on this CPU machine: its staging, launches and downloads run
against a stand-in CUDA context whose "device" memory is host memory and whose
cuLaunchKernel runs the sampling kernels in the Triton interpreter. What the real
device adds (streams, cubins) the GPU tests cover (tests/gpu/test_gpu_sampling.py)."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from kiln.codegen.triton import sampling as K
from kiln.codegen.triton.configs import ElementwiseConfig
from kiln.codegen.triton.launch import Buf, _interpreter_compat, kernel_fn
from kiln.runtime.worker.cuda_driver import Kernel
from kiln.runtime.worker.cuda_executor import _resolved
from kiln.runtime.sample.gpu_sampler import GpuSampler, PromptJob
from kiln.runtime.worker.input_stager import InputStager
from kiln.runtime.sample.sampler import Sampler, compute_logprobs, gather_logprobs
from kiln.runtime.sample.metadata import SamplingMetadata
from kiln.runtime.sample.sampling_params import SamplingParams
from tests.codegen.helpers import require_interpreter

pytestmark = pytest.mark.usefixtures("interpreter")
_NP = {"*fp32": np.float32, "*i32": np.int32, "*i64": np.int64}


@pytest.fixture
def interpreter():
    require_interpreter()


class HostDevice:
    """The few CudaContext calls GpuSampler makes, on host memory."""

    def __init__(self) -> None:
        self.blocks: dict[int, np.ndarray] = {}
        self.stream = None
        self.drv = SimpleNamespace(cuLaunchKernel=self._launch, CUresult=SimpleNamespace(CUDA_SUCCESS=0))
        self.launched: list[str] = []

    def host_alloc(self, nbytes):
        return np.zeros(max(int(nbytes), 1), np.uint8)

    def malloc(self, nbytes):
        a = np.zeros(max(int(nbytes), 1), np.uint8)
        self.blocks[a.ctypes.data] = a
        return a.ctypes.data

    def free(self, ptr):
        del self.blocks[ptr]

    def side_stream(self, name):
        return name

    def upload(self, ptr, host, sync=True, stream=None):
        host = np.ascontiguousarray(host)
        ctypes.memmove(ptr, host.ctypes.data, host.nbytes)

    def download(self, ptr, out):
        ctypes.memmove(out.ctypes.data, ptr, out.nbytes)
        return out

    def synchronize(self):
        pass

    def memset(self, ptr, nbytes):
        ctypes.memset(ptr, 0, nbytes)

    def download_async(self, ptr, out, stream=None):  # the stand-in runs everything at once
        return self.download(ptr, out)

    def marker(self):
        return object()

    def record(self, event, stream=None):
        pass

    def wait(self, event, stream=None):
        pass

    def event_sync(self, event):
        pass

    def _launch(self, spec, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        vals, _ = params
        args = [Buf(ptr=v, shape=(1,), dtype=_NP[t]) if t.startswith("*") else v
                for t, v in zip(spec.signature.values(), vals)]
        _interpreter_compat()
        fn = kernel_fn(spec)
        kw = dict(spec.constexprs, **({"INTERPRET": True} if "INTERPRET" in fn.arg_names else {}))
        fn[(gx, gy)](*args, **kw)
        self.launched.append(spec.kernel)
        return (0,)


def host_sampler(dev: HostDevice, vocab: int, logits_ptr: int, seed=0, block=32) -> GpuSampler:
    """A GpuSampler as CudaExecutor.make_sampler builds it, its kernels from the specs a bundle records."""
    specs = K.sampler_specs(vocab, ElementwiseConfig(block=block, num_warps=4))
    manifest = {"logits": {"vocab": vocab},
                "sampler": K.sampler_manifest(specs, lambda role, spec: role),
                "kernels": {r: {"signature": list(s.signature.values())} for r, s in specs.items()}}
    kernels = {r: Kernel(s.kernel, s, s.num_warps, 0, 0) for r, s in specs.items()}
    return GpuSampler(dev, manifest, kernels, logits_ptr, seed=seed)


def host_stager(dev: HostDevice, dst_ptr: int, nbytes: int, max_tokens: int) -> InputStager:
    """An InputStager as CudaExecutor builds it, over `nbytes` of inputs at dst_ptr."""
    spec = K.sampler_specs(256)["stage"]
    role = K.sampler_manifest({"stage": spec}, lambda role, spec: role)["stage"]
    return InputStager(dev, Kernel(spec.kernel, spec, spec.num_warps, 0, 0), role, list(spec.signature.values()),
                       dst_ptr, nbytes, max_tokens)


def test_one_step_equals_the_numpy_sampler():
    V, rng = 61, np.random.default_rng(4)
    dev = HostDevice()
    logits = (rng.standard_normal((7, V)) * 3).astype(np.float32)
    ptr = dev.malloc(logits.nbytes)
    dev.upload(ptr, logits)
    params = [SamplingParams(temperature=0, logprobs=3, logit_bias={4: 5.0}, repetition_penalty=1.3),
              SamplingParams(temperature=0.9, top_k=6, seed=5, logprobs=0),
              SamplingParams(temperature=0, allowed_token_ids=[1, 2, 30], presence_penalty=0.5),
              SamplingParams(temperature=1.1, top_p=0.7, min_p=0.02)]
    prompts = [rng.integers(0, V, 9).tolist() for _ in params]
    outputs = [rng.integers(0, V, 4).tolist() for _ in params]
    md = SamplingMetadata.from_requests(params, prompts, outputs, V, generators=[p.new_generator() for p in params])
    rows = [1, 3, 4, 6]
    jobs = [PromptJob(0, np.array([3, 9], np.int32), 2), PromptJob(5, np.array([7], np.int32), V)]  # V: on the host
    sampler = host_sampler(dev, V, ptr)
    out, prompt = sampler.sample(rows, md, [p.seed for p in params], jobs)

    processed = dev.blocks[ptr].view(np.float32).reshape(7, V)
    assert np.array_equal(processed[rows], Sampler.apply_logits_processors(logits[rows], md))
    ids = out.sampled_token_ids
    assert ids[0] == processed[1].argmax() and ids[2] == processed[4].argmax()
    assert ids[2] in (1, 2, 30)
    want = gather_logprobs(compute_logprobs(logits[rows]), 3, ids)  # raw logprobs, as vLLM's default
    assert out.logprobs.token_ids.tolist() == want.token_ids.tolist()
    assert out.logprobs.ranks.tolist() == want.ranks.tolist()
    np.testing.assert_allclose(out.logprobs.logprobs, want.logprobs, atol=2e-6, rtol=0)
    for job, got in zip(jobs, prompt):
        n = len(job.targets)
        ref = gather_logprobs(compute_logprobs(logits[job.first_row:job.first_row + n]), job.k, job.targets)
        assert got.token_ids.tolist() == ref.token_ids.tolist() and got.ranks.tolist() == ref.ranks.tolist()
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=2e-6, rtol=0)
    assert dev.launched.count("logprobs_kernel") == 2  # sampled rows and the first job; the second on the host
    # the seeded row draws the same alone, in another position, with other neighbours
    dev.upload(ptr, logits)
    md1 = SamplingMetadata.from_requests(params[1:2], prompts[1:2], outputs[1:2], V,
                                         generators=[params[1].new_generator()])
    alone, _ = host_sampler(dev, V, ptr, seed=99).sample([3], md1, [5])
    assert alone.sampled_token_ids[0] == ids[1]


def test_a_steady_batch_uploads_its_sampling_inputs_once_per_slot():
    """A decode batch that stages the same rows and knobs step after step (greedy: its rows' keys
    are staged as 0) copies them to each in-flight slot's device buffer once; a step that stages
    other bytes copies again, and every step samples what the numpy Sampler does."""
    V, rng = 61, np.random.default_rng(7)
    dev = HostDevice()
    uploads = []
    real_upload = dev.upload
    dev.upload = lambda ptr, host, sync=True, stream=None: (uploads.append((ptr, stream)), real_upload(ptr, host, sync))
    ptr = dev.malloc(4 * 4 * V)
    sampler = host_sampler(dev, V, ptr)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]

    def step(rows, params):
        logits = (rng.standard_normal((4, V)) * 3).astype(np.float32)
        real_upload(ptr, logits)
        md = SamplingMetadata.from_requests(params, [[1, 2]] * len(params), [[3]] * len(params), V,
                                            generators=[None] * len(params))
        before = len(uploads)
        out, _ = sampler.sample(rows, md, [None] * len(params))
        want = Sampler.apply_logits_processors(logits[rows], md).argmax(axis=1)
        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        assert [out.sampled_token_ids[i] for i in greedy] == [want[i] for i in greedy]
        return len(uploads) - before

    assert [step([0, 2], params) for _ in range(5)] == [1, 1, 0, 0, 0]  # one per slot, then none
    assert {stream for _, stream in uploads} == {"in"}  # on the side stream, never in the main one's queue
    assert step([1, 3], params) == 1  # other rows: staged again
    hot = [SamplingParams(temperature=0), SamplingParams(temperature=0.8)]
    assert [step([1, 3], hot) for _ in range(3)] == [1, 1, 1]  # an unseeded row's key is drawn per step


def test_llm_tokens_and_logprobs_equal_the_cpu_path(tmp_path):
    """The model runner's device path (execute_and_sample) on a tiny CPU model: the same
    greedy tokens, logprobs and prompt logprobs as its numpy path."""
    pytest.importorskip("torch")
    from kiln import LLM
    from tests.tiny_models import make_tiny_model

    make_tiny_model(tmp_path, "llama_gqa_untied")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (3, 9, 14)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                        repetition_penalty=1.2)
    cpu = LLM(tmp_path, skip_tokenizer_init=True, max_num_batched_tokens=16, kv_cache_tokens=1024)
    want = cpu.generate(prompts, sp)

    llm = LLM(tmp_path, skip_tokenizer_init=True, max_num_batched_tokens=16, kv_cache_tokens=1024)
    runner = llm.engine.core.runner
    dev, cpu_executor = HostDevice(), runner.executor
    logits_ptr = dev.malloc(4 * 256 * 64)

    class DeviceLogits:  # the CPU executor's logits written to "device" memory, then the GpuSampler
        num_blocks = cpu_executor.num_blocks

        def execute_and_sample(self, inputs, sampler, rows, md, seeds=(), prompt=()):
            logits = next(iter(cpu_executor.execute(inputs).values()))
            dev.upload(logits_ptr, np.ascontiguousarray(logits, np.float32))
            return sampler.sample(rows, _resolved(md), seeds, prompt)

    runner.executor, runner.gpu_sampler = DeviceLogits(), host_sampler(dev, 256, logits_ptr, block=128)
    got = llm.generate(prompts, sp)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(g.prompt_token_ids)
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert a.keys() == b.keys() and all(a[t].rank == b[t].rank for t in a)
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def _on_host_device(llm, vocab: int = 256) -> None:
    """Give llm's runner the device path over the stand-in: its CPU executor's logits written to
    "device" memory, then a GpuSampler; input ids staged into "device" memory by the executor's
    InputStager, the ids still in flight fed in by its stage kernel; grammar masks, made when
    the executor asks for them (after the step's launches), applied by the mask kernel."""
    runner = llm.engine.core.runner
    dev, cpu_executor = HostDevice(), runner.executor
    logits_ptr = dev.malloc(4 * vocab * 64)
    ids_ptr = dev.malloc(4 * 64)
    stager = host_stager(dev, ids_ptr, 4 * 64, 64)

    class DeviceLogits:
        num_blocks = cpu_executor.num_blocks

        def execute_and_sample(self, inputs, sampler, rows, md, seeds=(), prompt=(), bitmask=None):
            return sampler.collect(self.launch_and_sample(inputs, sampler, rows, md, seeds, prompt, bitmask=bitmask))

        def launch_and_sample(self, inputs, sampler, rows, md, seeds=(), prompt=(), feed=None, bitmask=None):
            ids = np.ascontiguousarray(inputs["input_ids"], np.int32)
            if feed is not None:
                prev, src_idx, dst_idx = feed
                assert (ids[dst_idx] == -1).all()  # placeholders, nothing else
                feed = (prev.ids_dev, src_idx, dst_idx)
            stager.buffer()[:ids.nbytes] = ids.view(np.uint8)
            stager.put(ids.nbytes, 0, len(ids), feed)
            inputs = dict(inputs, input_ids=dev.download(ids_ptr, np.empty_like(ids)))
            assert (inputs["input_ids"] >= 0).all()
            logits = next(iter(cpu_executor.execute(inputs).values()))
            dev.upload(logits_ptr, np.ascontiguousarray(logits, np.float32))
            return sampler.launch(rows, _resolved(md), seeds, prompt, _resolved(bitmask))

    runner.executor, runner.gpu_sampler = DeviceLogits(), host_sampler(dev, vocab, logits_ptr, block=128)


def test_async_scheduling_feeds_sampled_ids_on_the_device(tmp_path):
    """Async scheduling through the device path: each step is launched before the one ahead of
    it is read back, its input ids fed from that step's sampled ids by the stage kernel
    (runtime/worker/input_stager.py); penalised rows (which read their tokens on the host) wait for them.
    Tokens and logprobs equal the synchronous engine's on the same device path."""
    pytest.importorskip("torch")
    from kiln import LLM
    from tests.tiny_models import make_tiny_model

    make_tiny_model(tmp_path, "llama_gqa_untied")
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(2, 20, size=6)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=7, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, repetition_penalty=1.5)]
    common = dict(skip_tokenizer_init=True, max_num_batched_tokens=16, kv_cache_tokens=1024, max_num_seqs=4)
    sync = LLM(tmp_path, **common)
    _on_host_device(sync)
    want = [sync.generate(prompts, sp) for sp in params]
    assert sync.engine.core.runner.fed_steps == 0

    llm = LLM(tmp_path, async_scheduling=True, **common)
    runner = llm.engine.core.runner
    assert runner.defer_outputs
    _on_host_device(llm)
    for sp, w in zip(params, want):
        fed = runner.fed_steps
        got = llm.generate(prompts, sp)
        assert [g.outputs[0].token_ids for g in got] == [x.outputs[0].token_ids for x in w]
        for g, x in zip(got, w):  # (the numpy executor's sums depend a little on the batch)
            for a, b in zip(g.outputs[0].logprobs or [], x.outputs[0].logprobs or []):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
        if sp.repetition_penalty == 1:
            assert runner.fed_steps > fed  # decode steps took their ids from the step before
    assert not runner._in_flight
    # a runner that only queues its steps runs on the engine's thread: no worker thread started
    assert runner.launches_ahead and llm.engine.core._worker is None
    stats = llm.stats()
    assert stats["num_running_reqs"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"] - 1


def test_abort_while_steps_are_in_flight_on_the_device_path(tmp_path):
    """Aborting requests while a step that samples for them is queued (its ids still on the
    device): their tokens are never reported, the placeholders settle before their rows are
    reused, every KV block returns, and the other requests get the synchronous engine's tokens."""
    pytest.importorskip("torch")
    from kiln import LLM
    from tests.tiny_models import make_tiny_model

    make_tiny_model(tmp_path, "llama_gqa_untied")
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(2, 20, size=6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    common = dict(skip_tokenizer_init=True, max_num_batched_tokens=64, kv_cache_tokens=1024, max_num_seqs=8)
    sync = LLM(tmp_path, **common)
    _on_host_device(sync)
    want = {f"r{i}": o.outputs[0].token_ids for i, o in enumerate(sync.generate(prompts, params))}

    llm = LLM(tmp_path, async_scheduling=True, **common)
    _on_host_device(llm)
    eng, runner = llm.engine, llm.engine.core.runner
    free0 = eng.core.snapshot()["num_free_blocks"]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {}

    def step():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.outputs[0].token_ids[len(got.get(o.request_id, [])):])
    for _ in range(4):
        step()
    assert runner._in_flight, "the abort was meant to land while a step's ids were on the device"
    eng.abort_request(["r1", "r4"])
    seen_after = {rid: len(t) for rid, t in got.items()}
    while eng.has_unfinished_requests():
        step()
    assert {rid: len(t) for rid, t in got.items() if rid in ("r1", "r4")} == \
        {rid: n for rid, n in seen_after.items() if rid in ("r1", "r4")}, "tokens of aborted requests were reported"
    for rid in ("r0", "r2", "r3", "r5"):
        assert got[rid] == want[rid], rid
    assert runner.fed_steps > 0 and not runner._in_flight and eng.core._worker is None
    assert eng.core.snapshot()["num_free_blocks"] == free0


def test_a_step_failing_on_the_engine_thread_reaches_the_caller(tmp_path):
    """Async scheduling with a runner that launches ahead runs its steps on the engine's own
    thread: a launch error (the fourth step's) is raised by LLM.generate with its message, no
    step runs after it, and no worker thread was started. Prompts from seed 4 launch the failing
    step into an empty queue (the engine then once went on to launch a fifth); one more set is
    fresh."""
    pytest.importorskip("torch")
    from kiln import LLM
    from tests.tiny_models import make_tiny_model

    make_tiny_model(tmp_path, "llama_gqa_untied")
    for rng in (np.random.default_rng(4), np.random.default_rng()):
        prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(2, 20, size=6)]
        llm = LLM(tmp_path, async_scheduling=True, skip_tokenizer_init=True, max_num_batched_tokens=16,
                  kv_cache_tokens=1024, max_num_seqs=4)
        _on_host_device(llm)
        ex, calls = llm.engine.core.runner.executor, []
        launch = ex.launch_and_sample

        def failing(*args, **kw):
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("device lost")
            return launch(*args, **kw)

        ex.launch_and_sample = failing
        with pytest.raises(RuntimeError, match="device lost"):
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert len(calls) == 4, "steps ran on after the failure"
        assert llm.engine.core._worker is None


def test_a_thread_that_steps_the_engine_binds_the_device_context_first(tmp_path):
    """A driver context is current per thread. AsyncLLM loads the model on one thread and steps on
    its engine thread; with async scheduling's steps on that thread (no worker) or synchronous
    ones, the engine core makes the executor's context current there before the runner's first
    launch (CudaExecutor.bind_thread), and again when another thread takes over."""
    import threading

    pytest.importorskip("torch")
    from kiln import LLM
    from tests.tiny_models import make_tiny_model

    make_tiny_model(tmp_path, "llama_gqa_untied")
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for flag in (True, False):
        llm = LLM(tmp_path, async_scheduling=flag, skip_tokenizer_init=True, max_num_batched_tokens=16,
                  kv_cache_tokens=1024, max_num_seqs=4)
        _on_host_device(llm)
        ex, bound = llm.engine.core.runner.executor, []
        launch = ex.launch_and_sample

        def checked(*args, **kw):  # every launch from a thread that bound the context
            assert bound and bound[-1] == threading.get_ident(), "launched before binding this thread"
            return launch(*args, **kw)

        ex.bind_thread = lambda: bound.append(threading.get_ident())
        ex.launch_and_sample = checked
        ex.execute_and_sample = lambda inputs, sampler, rows, md, seeds=(), prompt=(): sampler.collect(
            checked(inputs, sampler, rows, md, seeds, prompt))
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("out", llm.generate(prompts, sp)))
        t.start()
        t.join()
        assert len(got["out"]) == 2 and bound == [t.ident]
        llm.generate(prompts, sp)  # back on the loading thread: bound again there
        assert bound == [t.ident, threading.get_ident()]
        assert llm.engine.core._worker is None


def test_constrained_requests_run_on_the_device_path(tmp_path):
    """Structured output through the device path: llguidance's masks, made when the executor asks
    for them (after the step's model launches), applied by the mask kernel to the rows in
    "device" memory. Greedy constrained tokens equal the numpy sampler's; seeded temperature-1
    ones hold their grammars; async scheduling (which reads a constrained step back before the
    next is launched, as the grammar needs its token) gives the synchronous tokens; an
    unconstrained request in the same batch is untouched."""
    pytest.importorskip("torch")
    import json
    import re

    import jsonschema

    from kiln import LLM
    from kiln.runtime.sample.structured_outputs import StructuredOutputsParams
    from tests.server.tiny_chat_model import VOCAB_SIZE, make_tiny_chat_model

    make_tiny_chat_model(tmp_path)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "c": {"enum": ["red", "blue"]}},
              "required": ["n", "c"], "additionalProperties": False}
    regex = "[0-9]{3}-[a-z]{2,4}"
    grammars = [StructuredOutputsParams(regex=regex), StructuredOutputsParams(json=schema),
                StructuredOutputsParams(choice=["yes", "no", "maybe"]), None]
    prompts = ["hello", "a b c", "xyz", "free"]

    def params(temperature, seed=None):
        return [SamplingParams(temperature=temperature, seed=None if seed is None else seed + i,
                               max_tokens=30 if g else 6, structured_outputs=g, ignore_eos=g is None)
                for i, g in enumerate(grammars)]

    def check(outs):
        texts = [o.outputs[0].text for o in outs]
        assert re.fullmatch(regex, texts[0]), texts[0]
        jsonschema.validate(json.loads(texts[1]), schema)
        assert texts[2] in ("yes", "no", "maybe") and len(outs[3].outputs[0].token_ids) == 6
        return [o.outputs[0].token_ids for o in outs]

    common = dict(max_num_batched_tokens=16, kv_cache_tokens=2048, max_num_seqs=4)
    want_greedy = check(LLM(tmp_path, **common).generate(prompts, params(0.0)))
    sync = LLM(tmp_path, **common)
    _on_host_device(sync, VOCAB_SIZE)
    assert sync.engine.core.runner.gpu_sampler.can_mask
    assert check(sync.generate(prompts, params(0.0))) == want_greedy
    want_random = check(sync.generate(prompts, params(1.0, seed=11)))

    llm = LLM(tmp_path, async_scheduling=True, **common)
    _on_host_device(llm, VOCAB_SIZE)
    assert check(llm.generate(prompts, params(1.0, seed=11))) == want_random
    assert not llm.engine.core.runner._in_flight
