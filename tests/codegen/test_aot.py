"""Every kernel compiles to sm_90 and sm_121a cubins on this CPU-only machine, and the
disk cache makes a second compile take milliseconds.

Under the interpreter (this folder's conftest) cache misses compile in one child
process without TRITON_INTERPRET; the whole set takes tens of seconds on 2 cores,
hence the slow marker.
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kiln.codegen.triton.aot import check_pdl_order, compile_spec, compile_specs, kernel_sources
from kiln.codegen.triton.argmax import argmax_spec
from kiln.codegen.triton.attention_preamble import attention_preamble_spec
from kiln.codegen.triton.configs import DEFAULT, AttentionConfig, GemmReduction
from kiln.codegen.triton.gather import gather_rows_spec
from kiln.codegen.triton.gemm import gemm_rope_specs, gemm_specs
from kiln.codegen.triton.launch import KernelSpec
from kiln.codegen.triton.paged_attention_launch import paged_attention_specs
from kiln.codegen.triton.rms_norm import rms_norm_spec
from kiln.codegen.triton.silu_mul import silu_mul_spec

# Llama-3-8B-like shapes; one bucket of 64 tokens, 8 sequences.
H, HKV, D, HID, I, V, BS, T, S = 32, 8, 128, 4096, 14336, 128256, 16, 64, 8
ARCHS = ("sm_90", "sm_121")


def all_specs():
    c = DEFAULT
    specs = []
    for m in (1, 64, 512):  # decode tile (mma.sync), 64-row and 128x128 (wgmma on sm_90) tiles
        specs += gemm_specs(m, 6144, HID, has_bias=m == 64, tile=c.gemm_tile(m, 6144, HID),
                            red=c.gemm_reduction(6144, HID))
    specs += gemm_specs(T, HID, I, tile=c.gemm_tile(T, HID, I), red=GemmReduction(64, 4))  # + ordered reduce
    # the SwiGLU epilogue on the interleaved gate/up stack: decode tile, 128x128 TMA, 128x256,
    # folded split-K, and split-K with the epilogue in the reduce kernel
    for m, red, fold in ((1, GemmReduction(64, 1), None), (512, GemmReduction(64, 1), None),
                         (2048, GemmReduction(64, 1), None), (2048, GemmReduction(64, 2), True),
                         (T, GemmReduction(64, 2), False)):
        tile = replace(c.gemm_tile(m, 2 * I, HID), fold=fold)
        specs += gemm_specs(m, 2 * I, HID, tile=tile, red=red, silu_group=16)
    specs += gemm_specs(S, V, HID, out_dtype="float32", tile=c.gemm_tile(S, V, HID), red=c.gemm_reduction(V, HID))
    # the q/k/v GEMM with the attention preamble in its epilogue: decode (half-head pairs, an e4m3
    # cache), 128x256 TMA (two heads a tile)
    n_qkv = (H + 2 * HKV) * D
    specs += gemm_rope_specs(1, n_qkv, HID, h=H, hkv=HKV, d=D, bs=BS, cache_dtype="float8_e4m3fn",
                             tile=c.gemm_tile(1, n_qkv, HID), red=c.gemm_reduction(n_qkv, HID))
    specs += gemm_rope_specs(2048, n_qkv, HID, h=H, hkv=HKV, d=D, bs=BS, has_bias=True,
                             tile=c.gemm_tile(2048, n_qkv, HID), red=c.gemm_reduction(n_qkv, HID))
    specs.append(rms_norm_spec(T, 1, HID, has_residual=False, config=c.row("rms_norm", HID)))
    specs.append(rms_norm_spec(T, 1, HID, has_residual=True, config=c.row("rms_norm", HID)))
    specs.append(silu_mul_spec(T, I, config=c.elementwise("silu_mul", I)))
    for neox, rot, norm in ((True, D, False), (False, D // 2, True)):
        specs.append(attention_preamble_spec(T, H, HKV, D, rot, BS, is_neox=neox, qk_norm=norm,
                                             config=c.row("attention_preamble", H * D)))
    for split in (False, True):  # split adds the merge kernel
        specs += paged_attention_specs(T, H, HKV, D, BS, S, split=split, max_model_len=8192,
                                       config=AttentionConfig())
    # a mixed bucket's decode rows in a launch of the decode variant (the rest return before the
    # PDL wait), the others in the prefill variant
    specs += paged_attention_specs(T, H, HKV, D, BS, S, split=False, max_model_len=8192,
                                   config=AttentionConfig(route_mixed=True))
    # a decode batch read whole, its tiles in key halves under a register cap
    specs += paged_attention_specs(S, H, HKV, D, BS, S, split=False, max_model_len=8192,
                                   config=AttentionConfig(key_halves=2, maxnreg=168), decode=True)
    # a split decode merges in the attention kernel (atomic counter, L1-bypassing loads)
    specs += paged_attention_specs(S, H, HKV, D, BS, S, split=True, max_model_len=8192, config=AttentionConfig(),
                                   decode=True)
    # one sequence at heads of 256 (Qwen3.6-27B's 24 / 4): V columns in parts (configs.wide_head)
    specs += paged_attention_specs(1, 24, 4, 256, BS, 1, split=True, max_model_len=8192, decode=True,
                                   config=c.attention(24, 4, 256, 8192))
    specs.append(gather_rows_spec(T, HID, config=c.elementwise("embedding", HID)))
    specs.append(argmax_spec(S, V, config=c.elementwise("argmax", V)))
    return specs


def test_every_kernel_is_covered():
    kernels = {s.kernel for s in all_specs()}
    assert kernels == {"gemm_kernel", "gemm_reduce_kernel", "gemm_rope_kernel", "rms_norm_kernel", "silu_mul_kernel",
                       "attention_preamble_kernel", "paged_attention_kernel", "attention_merge_kernel",
                       "gather_rows_kernel", "argmax_kernel"}


@pytest.mark.slow
def test_every_kernel_compiles_for_both_archs(tmp_path):
    jobs = [(spec, arch) for spec in all_specs() for arch in ARCHS]
    t0 = time.perf_counter()
    out = compile_specs(jobs, cache_dir=tmp_path)
    cold = time.perf_counter() - t0
    for (spec, arch), c in zip(jobs, out, strict=True):
        where = f"{spec.kernel} {spec.constexprs} @ {arch}"
        assert c.cubin[:4] == b"\x7fELF", where
        assert c.name == spec.kernel, where
        assert c.target == {"sm_90": "sm_90a", "sm_121": "sm_121a"}[arch], where
        assert c.num_warps == spec.num_warps, where
        assert c.n_hidden == 2, where  # Triton 3.6: global + profile scratch pointers
        # null global scratch pointers are fine, but for the GEMM building 2 TMA descriptors
        tma = spec.kernel in ("gemm_kernel", "gemm_rope_kernel") and spec.constexprs["TMA"]
        assert c.global_scratch_size == (256 if tma else 0), where
        assert c.shared <= (227 if arch == "sm_90" else 99) * 1024, where
    t0 = time.perf_counter()
    again = compile_specs(jobs, cache_dir=tmp_path)
    warm = time.perf_counter() - t0
    assert again == out
    assert warm < 0.05 * cold and warm < 2.0, f"cache hit took {warm:.3f}s for {len(jobs)} kernels"


@pytest.mark.slow
def test_pdl_kernels_wait_before_they_touch_memory(tmp_path):
    """Every plan kernel compiled for programmatic dependent launch passes the compiler's
    check (aot.check_pdl_order: no global load, store, TMA copy or descriptor write before
    griddepcontrol.wait in the PTX), and a kernel that loads first is refused."""
    jobs = [(spec.with_pdl(), "sm_90") for spec in all_specs()]
    assert all(spec.constexprs["PDL"] for spec, _ in jobs)
    out = compile_specs(jobs, cache_dir=tmp_path)  # raises on a kernel that breaks the rule
    plain = compile_specs([(spec, "sm_90") for spec in all_specs()], cache_dir=tmp_path)
    assert all(a.cubin != b.cubin for a, b in zip(out, plain, strict=True))
    bad = KernelSpec(module="tests.codegen.pdl_bad_kernel", kernel="loads_before_wait_kernel",
                     signature={"x_ptr": "*i32", "y_ptr": "*i32"}, constexprs={}, grid=(1,))
    compile_spec(bad, "sm_90", cache_dir=tmp_path)  # without PDL nothing is checked
    with pytest.raises(RuntimeError, match=r"loads_before_wait_kernel: compiled with PDL=True but accesses "
                                           r"memory before griddepcontrol.wait \(ld\.global"):
        compile_spec(bad.with_pdl(), "sm_90", cache_dir=tmp_path)


def test_pdl_order_check_reads_the_entry_body():
    head = ".visible .entry k(\n\t.param .u64 k_param_0\n)\n.reqntid 128\n{\n\tld.param.u64 %rd1, [k_param_0];\n"
    check_pdl_order(head + "\tgriddepcontrol.wait;\n\tld.global.b32 %r1, [%rd1];\n}", "k", "k")
    for early in ("\t@%p1 ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\n", "\tst.global.b32 [%rd1], %r1;\n",
                  "\tcp.async.bulk.tensor.2d.shared::cluster.global [%r1], [%rd1, {%r2, %r3}], [%r4];\n",
                  "\ttensormap.replace.tile.global_address.global.b1024.b64 [%rd1], %rd2;\n"):
        with pytest.raises(RuntimeError, match="before griddepcontrol.wait"):
            check_pdl_order(head + early + "\tgriddepcontrol.wait;\n}", "k", "k")
    with pytest.raises(RuntimeError, match="no griddepcontrol.wait"):
        check_pdl_order(head + "}", "k", "k")


def test_pdl_order_check_lets_only_marked_step_input_loads_before_the_wait():
    """pdl.pdl_step_input's load (a scalar of the uploaded step inputs, which no kernel writes)
    may stand before the wait, marked as it is; the same load unmarked, a marked store or wider
    load, or any other access there is still refused."""
    head = ".visible .entry k(\n\t.param .u64 k_param_0\n)\n.reqntid 128\n{\n\tld.param.u64 %rd1, [k_param_0];\n"
    marked = "\t// begin inline asm\n\t// kiln:step-input\n\tld.global.b32 %r7, [%rd1];\n\t// end inline asm\n"
    wait = "\tgriddepcontrol.wait;\n}"
    check_pdl_order(head + marked + marked.replace("%r7", "%r8") + wait, "k", "k")
    for early in (marked.replace("\t// kiln:step-input\n", ""),  # unmarked
                  marked.replace("ld.global.b32 %r7, [%rd1]", "st.global.b32 [%rd1], %r7"),
                  marked.replace("ld.global.b32 %r7, [%rd1]", "ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1]"),
                  marked + "\tld.global.b32 %r9, [%rd1];\n"):  # a load after a marked one
        with pytest.raises(RuntimeError, match="before griddepcontrol.wait"):
            check_pdl_order(head + early + wait, "k", "k")


def test_cache_hit_is_fast_and_keyed_by_the_spec(tmp_path):
    spec = silu_mul_spec(T, 512, config=DEFAULT.elementwise("silu_mul", 512))
    first = compile_spec(spec, "sm_90", cache_dir=tmp_path)
    t0 = time.perf_counter()
    second = compile_spec(spec, "sm_90", cache_dir=tmp_path)
    assert time.perf_counter() - t0 < 0.05
    assert second == first
    other = silu_mul_spec(T, 1024, config=DEFAULT.elementwise("silu_mul", 1024))  # another constexpr
    assert compile_spec(other, "sm_90", cache_dir=tmp_path).cubin != first.cubin
    assert len(list(tmp_path.glob("*.cubin"))) == 2


def test_cache_key_covers_the_helpers_a_kernel_calls():
    assert kernel_sources("kiln.codegen.triton.paged_attention") == [
        "kiln.codegen.triton.paged_attention", "kiln.codegen.triton.pdl"]
    assert "kiln.codegen.triton.pdl" in kernel_sources("kiln.codegen.triton.gemm")


def test_specs_setting_different_constexprs_get_their_own_kernels(tmp_path, monkeypatch):
    """{A: 1} and {B: 1} of a kernel whose constexprs both default to 0: Triton's own cache
    (fresh here, shared by both compiles) keys constexprs by value and place, not name, so
    each spec must pass every constexpr (KernelSpec.all_constexprs) to get its own kernel."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    spec = lambda **c: KernelSpec(module="tests.codegen.constexpr_kernel", kernel="two_switches_kernel",  # noqa: E731
                                  signature={"y_ptr": "*i32"}, constexprs=c, grid=(1,))
    a = compile_spec(spec(A=1), "sm_90", cache_dir=tmp_path / "a")
    b = compile_spec(spec(B=1), "sm_90", cache_dir=tmp_path / "b")
    assert a.cubin != b.cubin, "the spec setting B was given the kernel compiled for A"


def test_unknown_arch_is_one_clear_error(tmp_path):
    spec = silu_mul_spec(T, 512, config=DEFAULT.elementwise("silu_mul", 512))
    with pytest.raises(ValueError, match="unknown arch 'sm_80'"):
        compile_spec(spec, "sm_80", cache_dir=tmp_path)
