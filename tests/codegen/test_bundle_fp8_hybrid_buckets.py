"""The block-wise FP8 Qwen3.5 hybrid of tests/gpu/test_gpu_fp8.py (the tiny qwen3_5_causal, 16x16
blocks, one GDN out_proj left bf16), lowered for sm_90 with the GPU test's limits (max_model_len
512, 32 sequences, budgets 256 and 32): every FP8 GEMM takes one reduction form in every bucket
of both bundles. Per node, the K order's constexprs (fp8_gemm.fp8_reduction: N, K, groups, GK,
BLOCK_K, the weight's scale blocks) are the same in every bucket; only the tile (BLOCK_M,
BLOCK_N, warps, stages) may move. And the cubin of every bucket's tile runs the one e4m3 wgmma
(SASS QGMMA.64xNx32.F32.E4M3.E4M3) and nothing else, where a 16-row tile would be an f16
mma.sync (HMMA) with other bits (fp8_gemm.py's docstring). A tile default or config that gives
a decode bucket another instruction or K blocking than a prefill bucket fails here, on the CPU,
before a GPU sees greedy tokens drift between alone, batched and chunked."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter

import pytest

from kiln.codegen.buckets import make_buckets
from kiln.codegen.compile import plan_dims
from kiln.codegen.lower import Regions, lower_bucket
from kiln.codegen.triton.aot import compile_specs
from kiln.codegen.triton.configs import Configs
from kiln.loader import build_graph, open_source
from kiln.passes.plan_memory import plan_memory
from kiln.schedules import Schedules
from tests.fp8_checkpoints import make_fp8_checkpoint

pytestmark = pytest.mark.slow

# the K order of every output element (fp8_gemm.fp8_gemm_spec); the rest is the tile's
REDUCTION = ("N", "K", "GROUPS", "GK", "BLOCK_K", "BN_W", "BK_W", "KB_W", "HAS_BIAS")
MMA = re.compile(r"\b((?:[HIQO]GMMA|HMMA|IMMA|QMMA|OMMA)\.[\w.]+)")


def _fp8_launches(graph, budget: int):
    """{bucket name: [the fp8_gemm_kernel specs of its plan, in launch order]} as compile_bundle
    lowers them for the GPU test's limits, with the schedules loader.compile_model reads."""
    configs = Configs(lookup=Schedules.read("sm_90").lookup)
    buckets = make_buckets(32, budget)
    mb = -(-512 // 16)
    plan = plan_memory(graph, plan_dims(buckets, mb))
    regions = Regions()
    regions.need("arena", plan.arena_bytes)
    return {f"{budget}/{b.name}": [s for s, _ in lower_bucket(graph, plan, b, max_blocks_per_seq=mb, regions=regions,
                                                               max_model_len=512, configs=configs, arch="sm_90")
                                   if getattr(s, "kernel", None) == "fp8_gemm_kernel"] for b in buckets}


def _mma_class(cubin: bytes) -> tuple[str, ...]:
    """The cubin's tensor-core instructions with the wgmma's N (the tile's width) written as N:
    the instruction class and K step, which decide each output element's bits."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return tuple(sorted({re.sub(r"^(\w+\.\d+)x\d+x", r"\1xNx", op) for op in MMA.findall(sass)}))


def test_every_fp8_gemm_of_the_fp8_hybrid_has_one_reduction_form_in_every_bucket(tmp_path):
    pytest.importorskip("triton")
    make_fp8_checkpoint(tmp_path, "qwen3_5_causal", "block", not_converted=("model.layers.0.linear_attn.out_proj",))
    graph = build_graph(open_source(tmp_path).config, target="sm_90")
    n_fp8 = [n.op for n in graph.nodes.values()].count("linear_fp8")
    assert n_fp8 == 6 * 3 - 1 + 2 * 4 + 8 * 3  # GDN in_proj_qkv, in_proj_z, out_proj (one bf16); q/k/v/o; MLPs
    plans = {**_fp8_launches(graph, 256), **_fp8_launches(graph, 32)}
    assert {len(v) for v in plans.values()} == {n_fp8}, {k: len(v) for k, v in plans.items()}
    specs = {}
    for launches in plans.values():
        for s in launches:
            specs.setdefault(repr((sorted(s.constexprs.items()), s.num_warps, s.num_stages, s.divisible)), s)
    compiled = dict(zip(specs, compile_specs([(s, "sm_90") for s in specs.values()], cache_dir=tmp_path / "cache")))
    classes = {key: _mma_class(c.cubin) for key, c in compiled.items()}
    tiles = set()
    for i in range(n_fp8):  # the i-th FP8 linear of the graph in every bucket
        forms = Counter()
        for bucket, launches in plans.items():
            s = launches[i]
            key = repr((sorted(s.constexprs.items()), s.num_warps, s.num_stages, s.divisible))
            forms[(tuple(s.constexprs[c] for c in REDUCTION), classes[key])] += 1
            tiles.add((s.constexprs["BLOCK_M"], s.constexprs["BLOCK_N"], s.num_warps))
        assert len(forms) == 1, f"FP8 linear {i}: {len(forms)} reduction forms over the buckets: {dict(forms)}"
        (red, mma), = forms
        assert mma == ("QGMMA.64xNx32.F32.E4M3.E4M3",), f"FP8 linear {i} ({dict(zip(REDUCTION, red))}): {mma}"
    assert len(tiles) > 1  # the buckets do cut other tiles: the check above compared something
