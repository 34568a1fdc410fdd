"""FP8 W8A8 checkpoints on the GPU (codegen/triton/fp8_gemm.py, fp8_quant.py): the tiny FP8
checkpoints of tests/fp8_checkpoints.py (block-wise with weight_scale_inv and some linears left
bf16, compressed-tensors per channel, ModelOpt per tensor with static input scales) through the
GPU engine, against the cpu target's executor, and the engine's invariance; and a block-wise FP8
Qwen3.5 hybrid (Gated DeltaNet and gated attention, tests/test_fp8_hybrid.py) the same way.

Logits oracle. The cpu target runs the FP8 graph with f32 activations, a GPU target with bf16 ones
(loader.build_graph), so the two differ by more than the FP8 kernels' own error (those are
checked against numpy under the interpreter, tests/codegen/test_fp8_kernels.py and
test_lowering_fp8.py): every bf16 rounding of an activation that lands on the other side of an
e4m3 rounding boundary moves that activation by a whole e4m3 step, and on these tiny random
models (weights spread wide on purpose) a few such steps move the logits by percent. The
yardstick is what the storage dtype alone does: the same FP8 graph in bf16, run by the numpy
executor (the GPU's arithmetic, written independently), against the f32 one. The GPU must be as
close to the f32 executor as that bf16 reference is, within a factor of 2 plus 1e-2 of the largest
logit (the GPU's own f32 sums and bf16 attention round otherwise than numpy's, which flips a few
more e4m3 values: ~2e-3 of the largest logit each, tests/test_fp8_models.py). A wrong scale, a
missing group or a bf16 GEMM on e4m3 bytes moves the logits by the size of the logits themselves.

Invariance (DESIGN): greedy tokens alone = batched = chunked under a small token budget: on sm_90
every bucket's FP8 GEMM runs e4m3 wgmma with the weight's K order (fp8_gemm.py; checked per node
and bucket on this test's hybrid by tests/codegen/test_bundle_fp8_hybrid_buckets.py), so a token's
row must be the same bits in every bucket. The hybrid's small budget is the Gated DeltaNet window
(GDN_CHUNK_ALIGN, 64), not 32: the scheduler ends a hybrid's prefill chunks on multiples of it
only where the budget holds a whole window, and a chunk cut inside one runs the chunked form from a
mid-window state, which is the one-step prefill's arithmetic in another order, a documented
rounding difference (runtime/core/scheduler.py _gdn_aligned_chunk; tests/gpu/test_gpu_hybrid.py
chunks its bf16 hybrid at 64 for the same reason). FP8 amplifies such a difference: a last-bit
change that moves an activation across an e4m3 rounding boundary moves it a whole e4m3 step.
"""
from __future__ import annotations

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.loader import build_graph, load
from kiln.runtime.core.kv_cache_spec import GDN_CHUNK_ALIGN
from kiln.runtime.worker.cpu_executor import CpuExecutor
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.fp8_checkpoints import make_fp8_checkpoint

torch = pytest.importorskip("torch")

SKIP = ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj")
CASES = [("llama_gqa_untied", "block", SKIP), ("qwen3_qknorm", "block", ()), ("llama_gqa_untied", "channel", ()),
         ("qwen3_qknorm", "modelopt", ()),
         # a Qwen3.5 hybrid as Qwen's FP8 checkpoints quantise it (in_proj_a/b, conv1d bf16) and one
         # GDN out_proj left bf16 too (tests/test_fp8_hybrid.py)
         ("qwen3_5_causal", "block", ("model.layers.0.linear_attn.out_proj",))]


def _prompts(n: int, seed: int, vocab: int = 256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(k)).tolist() for k in rng.integers(3, 90, size=n)]


def load_cpu_gpu_bf16(path, gpu_target, bundle_dir, num_state_slots: int = 64, **cpu_kwargs):
    """The checkpoint at `path` three ways, as the GPU logits tests compare them: on the cpu target (f32),
    on the GPU (its bundle in bundle_dir), and the GPU's graph with bf16 activations run by the numpy
    executor, what the storage dtype alone does (num_state_slots: a hybrid's GDN state, one slot a
    prompt, _last_logits)."""
    cpu = load(path, kv_cache_tokens=16 * 512, tokenizer=False, **cpu_kwargs)
    gpu = load(path, target=gpu_target, kv_cache_tokens=16 * 512, tokenizer=False, max_model_len=512,
               max_num_seqs=32, max_num_batched_tokens=256, bundle_dir=str(bundle_dir))
    bf16 = CpuExecutor(build_graph(cpu.source.config, target=gpu_target), cpu.source.weights.get, num_blocks=512,
                       num_state_slots=num_state_slots)
    return cpu, gpu, bf16


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}{'-skip' if c[2] else ''}")
def fp8(request, tmp_path_factory, gpu_target):
    variant, layout, skip = request.param
    d = tmp_path_factory.mktemp(f"{variant}_{layout}")
    make_fp8_checkpoint(d, variant, layout, not_converted=skip, calib_prompts=_prompts(8, seed=99))
    cpu, gpu, bf16 = load_cpu_gpu_bf16(d, gpu_target, d / "bundle", num_state_slots=64)
    return f"{variant}-{layout}", d, cpu, gpu, bf16


def _last_logits(executor, prompts):
    """Each prompt's last-position logits, all prompts in one step: [len(prompts), V] f32. The step's one
    output read as the model runner reads it (the cpu executor names it after the graph's output, the
    CUDA executor "logits")."""
    free = iter(range(executor.num_blocks))
    chunks = [SeqChunk(p, 0, [next(free) for _ in range(-(-len(p) // 16))], state_slot=i + 1)
              for i, p in enumerate(prompts)]
    return np.asarray(next(iter(executor.execute(prepare_step(chunks, 16)).values())), np.float32)


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_fp8_logits_match_the_cpu_executor(fp8):
    name, _, cpu, gpu, bf16 = fp8
    prompts = [p[:30] for p in _prompts(8, seed=1)]  # one step: at most 240 of the 256-token bucket
    want = _last_logits(cpu.executor, prompts)
    got = _last_logits(gpu.executor, prompts)
    ref16 = _last_logits(bf16, prompts)
    assert np.isfinite(got).all(), name
    errs = [(_rel(g, w), _rel(r, w)) for g, w, r in zip(got, want, ref16)]
    print(f"\n[{name}] per prompt (GPU vs cpu f32, numpy bf16 vs cpu f32): "
          + ", ".join(f"{e:.2e}/{r:.2e}" for e, r in errs))
    for i, (err, storage) in enumerate(errs):
        assert err <= 2 * storage + 1e-2, f"{name} prompt {i}: {err:.2e} from the cpu target, bf16 storage alone {storage:.2e}"


def test_fp8_greedy_alone_batched_chunked(fp8, gpu_target):
    name, d, _, _, _ = fp8
    # a hybrid's chunks must end on whole GDN windows to keep the one-step bits (module docstring)
    budget = GDN_CHUNK_ALIGN if name.startswith("qwen3_5") else 32
    check_greedy_alone_batched_chunked(name, d, gpu_target, budget=budget)


def check_greedy_alone_batched_chunked(name, d, gpu_target, budget: int = 32, small_bundle: str = "bundle_llm",
                                       **small) -> None:
    """The engine's invariance on the checkpoint at d (the FP8 / NVFP4 GPU tests share it): 16 prompts'
    24 greedy tokens each alone equal them batched (a 256-token budget) and chunked (a second engine
    of `budget` tokens, its bundle in d / small_bundle, `small` its other engine arguments)."""
    prompts = _prompts(16, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(target=gpu_target, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=32)
    big = LLM(d, max_num_batched_tokens=256, kv_cache_tokens=16 * 1024, bundle_dir=str(d / "bundle_llm"), **common)
    alone = [big.generate(p, sp)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in big.generate(prompts, sp)]
    assert batched == alone, f"{name}: batched differs from alone"
    chunker = LLM(d, max_num_batched_tokens=budget, kv_cache_tokens=16 * 1024, bundle_dir=str(d / small_bundle),
                  **small, **common)
    chunked = [o.outputs[0].token_ids for o in chunker.generate(prompts, sp)]
    assert chunked == alone, f"{name}: chunked (budget {budget}) differs from alone"
