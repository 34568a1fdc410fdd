"""Compile a KernelSpec to a cubin for sm_90 or sm_121(a) on a machine with no GPU.

    compiled = compile_spec(spec, "sm_90")   # -> Compiled(cubin, name, shared, num_warps, n_hidden, ...)
    compiled = compile_specs([(spec_a, "sm_90"), (spec_b, "sm_121")])  # misses compiled together

Results are cached on disk under a key that hashes the kernel's source file, the
kernel name, signature, constexprs, divisibility hints, warps/stages, target arch and
the Triton version, so an unchanged kernel comes back in milliseconds. (Hashing
the whole file is conservative: any edit recompiles every kernel of that file; the
@triton.jit helpers a kernel calls live in its file, so nothing outside it matters
but Triton itself.)

Triton decides interpret-or-compile when it is imported. In a process that imported
it with TRITON_INTERPRET=1 (the interpreter tests), a cache miss compiles in a
child process: `python -m kiln.codegen.triton.aot` reads the spec as JSON on stdin.

Launching a cubin: cuModuleLoadData(cubin), cuModuleGetFunction(name), set
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES when shared > 48 KiB, then
cuLaunchKernel(grid, block=(32 * num_warps, 1, 1), sharedMemBytes=shared) with the
spec's non-constexpr args in order followed by `n_hidden` pointers (Triton 3.6: global
and profile scratch). The global scratch is null unless global_scratch_size > 0 (the
GEMM that builds its TMA descriptors on the device: 128 bytes per descriptor); then it
is a buffer of global_scratch_size bytes per program of the grid (runtime/worker/cuda_driver.py
Kernel.hidden_args). The profile scratch is always null.
"""
from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, NamedTuple

from kiln.codegen.triton.launch import KernelSpec, interpreting, kernel_fn

ARCHS = {"sm_90": 90, "sm_90a": 90, "sm_121": 121, "sm_121a": 121}


class Compiled(NamedTuple):
    cubin: bytes
    name: str
    shared: int
    num_warps: int
    n_hidden: int  # hidden scratch pointer args after the kernel's own
    global_scratch_size: int
    target: str  # the PTX .target: "sm_90a", "sm_121a"


def default_cache_dir() -> Path:
    root = os.environ.get("KILN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kiln")
    return Path(root) / "cubins"


def cache_key(spec: KernelSpec, arch: str) -> str:
    # A bundle asks for the key of every launch of every bucket (tens of thousands for an 8B
    # model), so the key is memoised on the spec's fields (the grid is not part of it).
    return _cache_key(spec.module, spec.kernel, tuple(spec.signature.items()),
                      tuple((k, repr(v)) for k, v in spec.constexprs.items()), tuple(sorted(spec.divisible)),
                      spec.num_warps, spec.num_stages, ARCHS[arch], spec.maxnreg)


_KILN_IMPORT = re.compile(r"^from (kiln\.codegen\.triton\.\w+) import", re.MULTILINE)


def kernel_sources(module: str) -> list[str]:
    """The kernel's module and the codegen/triton modules it imports from, transitively (the
    helpers its jit functions call: pdl.py's pdl_enter, say), sorted."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += _KILN_IMPORT.findall(Path(importlib.util.find_spec(m).origin).read_text())
    return sorted(seen)


@functools.lru_cache(maxsize=None)
def _source_sha256(module: str) -> str:
    """The hash of the kernel's sources (kernel_sources): an edit to a helper it calls makes
    new keys too. Read once per process (an edited file means a new process)."""
    h = hashlib.sha256()
    for m in kernel_sources(module):
        h.update(m.encode() + b"\0" + Path(importlib.util.find_spec(m).origin).read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=4096)
def _cache_key(module, kernel, sig, constexprs, div, warps, stages, arch, maxnreg=None) -> str:
    import triton

    key = {
        "src": _source_sha256(module), "kernel": kernel, "sig": dict(sig), "constexprs": dict(constexprs),
        "div": list(div), "warps": warps, "stages": stages, "arch": arch, "triton": triton.__version__,
    }
    if maxnreg is not None:  # (absent otherwise: uncapped kernels keep their keys)
        key["maxnreg"] = maxnreg
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def compile_spec(spec: KernelSpec, arch: str = "sm_90", cache_dir: str | Path | None = None) -> Compiled:
    return compile_specs([(spec, arch)], cache_dir)[0]


def compile_specs(jobs: list[tuple[KernelSpec, str]], cache_dir: str | Path | None = None,
                  workers: int | None = None, on_done: Callable[[int], Any] | None = None) -> list[Compiled]:
    """Compile (spec, arch) pairs; cache hits are read back, misses compiled in this
    process or, under the interpreter or with workers > 1, in child processes (as many
    as `workers`; default: one per CPU when there are many misses). on_done(n): n more
    jobs are ready (the cache hits at once, then each kernel as it compiles)."""
    done_n = on_done if on_done is not None else (lambda n: None)
    for _, arch in jobs:
        if arch not in ARCHS:
            raise ValueError(f"unknown arch {arch!r} (known: {', '.join(ARCHS)})")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    keys = [cache_key(spec, arch) for spec, arch in jobs]
    out = [_read_cache(cache, k) for k in keys]
    miss = [i for i, c in enumerate(out) if c is None]
    if len(jobs) > len(miss):
        done_n(len(jobs) - len(miss))
    if miss:
        todo = [jobs[i] for i in miss]
        if workers is None:
            workers = min(os.cpu_count() or 1, len(todo) // 4) or 1
        if workers > 1:
            done = _compile_in_children(todo, workers, done_n)
        elif interpreting():
            done = _compile_in_child(todo, done_n)
        else:
            done = []
            for s, a in todo:
                done.append(_compile_here(s, a))
                done_n(1)
        for i, c in zip(miss, done, strict=True):
            _write_cache(cache, keys[i], c)
            out[i] = c
    return out


def _compile_here(spec: KernelSpec, arch: str) -> Compiled:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_fn(spec)
    names = list(fn.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec.divisible}
    src = ASTSource(fn, spec.full_signature(), spec.all_constexprs(), attrs)
    k = triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32),
                       options={"num_warps": spec.num_warps, "num_stages": spec.num_stages,
                                **({"maxnreg": spec.maxnreg} if spec.maxnreg else {})})
    md = k.metadata
    n_params = _count_ptx_params(k.asm["ptx"], md.name)
    n_hidden = n_params - len(spec.signature)
    n_scratch_fields = sum(1 for f in md._fields if f.endswith("_scratch_size"))
    if n_hidden != n_scratch_fields:
        raise RuntimeError(f"{spec.kernel}: PTX has {n_params} params for {len(spec.signature)} args; "
                           f"expected {n_scratch_fields} hidden scratch pointers")
    if spec.constexprs.get("PDL"):
        check_pdl_order(k.asm["ptx"], md.name, spec.kernel)
    target = re.search(r"^\.target\s+(\S+)", k.asm["ptx"], re.MULTILINE).group(1).rstrip(",")
    return Compiled(bytes(k.asm["cubin"]), md.name, int(md.shared), int(md.num_warps), n_hidden,
                    int(md.global_scratch_size or 0), target)


# PTX instructions that may touch memory another kernel writes: global (and generic) loads and
# stores, atomics, async and bulk (TMA) copies, tensor-map writes; not the kernel's parameters,
# shared memory or locals, nor prefetches, which only warm L2 (the GPU's point of coherence).
_MEM_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st|atom|red|cp|tensormap|multimem)\.[\w.:]*)",
                     re.MULTILINE)
_SAFE_BEFORE_WAIT = ("ld.param", "ld.shared", "st.shared", "ld.local", "st.local", "cp.async.commit_group",
                     "cp.async.wait_group", "cp.async.bulk.commit_group", "cp.async.bulk.wait_group",
                     "cp.async.bulk.prefetch")


@functools.lru_cache(maxsize=None)
def _step_input_load() -> re.Pattern:
    """pdl.pdl_step_input's PTX: a scalar load of the step inputs (uploaded before the step,
    written by no kernel), marked so that it alone may stand before the wait. (pdl.py imports
    Triton, which this module leaves to compile time.)"""
    from kiln.codegen.triton.pdl import STEP_INPUT_MARK

    return re.compile(r"//\s*" + re.escape(STEP_INPUT_MARK) + r"[ \t]*\n\s*ld\.global\.b32\s+%r\d+,\s*\[%rd\d+\];")


def check_pdl_order(ptx: str, name: str, kernel: str) -> None:
    """A kernel compiled for programmatic dependent launch must wait for the kernel before it
    (griddepcontrol.wait) before it touches memory that kernel may still be writing or
    reading (codegen/triton/pdl.py): checked on the PTX, where the compiler could have
    hoisted a load above the wait."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(.*?\)\s*(?:\.\w+[^{]*)?\{(.*)", ptx, re.DOTALL)
    body = m.group(1) if m else ""
    cut = body.find("griddepcontrol.wait")
    if cut < 0:
        raise RuntimeError(f"{kernel}: compiled with PDL=True but its PTX has no griddepcontrol.wait")
    head = _step_input_load().sub("", body[:cut])  # pdl_step_input's marked loads of the step inputs
    early = [op.group(1) for op in _MEM_OP.finditer(head) if not op.group(1).startswith(_SAFE_BEFORE_WAIT)]
    if early:
        raise RuntimeError(f"{kernel}: compiled with PDL=True but accesses memory before griddepcontrol.wait "
                           f"({', '.join(sorted(set(early)))}); call pdl_enter first (codegen/triton/pdl.py)")


def _count_ptx_params(ptx: str, name: str) -> int:
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.DOTALL)
    if m is None:
        raise RuntimeError(f"no .entry {name} in the PTX")
    return len(re.findall(r"\.param\s", m.group(1)))


def _compile_in_child(jobs: list[tuple[KernelSpec, str]], on_done: Callable[[int], Any]) -> list[Compiled]:
    return _compile_in_children(jobs, 1, on_done)


def _compile_in_children(jobs: list[tuple[KernelSpec, str]], workers: int,
                         on_done: Callable[[int], Any]) -> list[Compiled]:
    """Round-robin the jobs over `workers` child compilers running at once; each child
    writes one JSON line per kernel as it finishes it, and on_done(1) is called for each."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    shares = [jobs[i::workers] for i in range(workers)]
    procs = []
    for share in shares:
        if not share:
            continue
        p = subprocess.Popen([sys.executable, "-m", "kiln.codegen.triton.aot"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        procs.append((share, p, json.dumps([{"spec": _spec_to_json(s), "arch": a} for s, a in share])))
    lock = threading.Lock()

    def talk(p: subprocess.Popen, payload: str) -> tuple[list[str], str]:
        err: list[str] = []
        drain = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
        drain.start()
        try:  # the child reads all of stdin before it writes a line
            p.stdin.write(payload)
            p.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: its stderr says why
        lines = []
        for line in p.stdout:
            lines.append(line)
            with lock:
                on_done(1)
        p.wait()
        drain.join()
        return lines, err[0] if err else ""

    with ThreadPoolExecutor(len(procs)) as pool:  # feed and drain every child at once
        talks = list(pool.map(lambda t: talk(t[1], t[2]), procs))
    results = {}
    for i, ((share, p, _), (out, err)) in enumerate(zip(procs, talks)):
        if p.returncode != 0:
            names = ", ".join(f"{s.kernel}@{a}" for s, a in share)
            raise RuntimeError(f"compiling {names} failed:\n{err[-4000:]}")
        for j, d in enumerate(map(json.loads, out)):
            results[i + j * workers] = _from_json(d)
    return [results[i] for i in range(len(jobs))]


def _spec_to_json(spec: KernelSpec) -> dict:
    d = dataclasses.asdict(spec)
    d["signature"], d["constexprs"] = dict(spec.signature), dict(spec.constexprs)
    return d


def _to_json(c: Compiled) -> dict:
    d = c._asdict()
    d["cubin"] = base64.b64encode(c.cubin).decode()
    return d


def _from_json(d: dict) -> Compiled:
    return Compiled(**dict(d, cubin=base64.b64decode(d["cubin"])))


def _read_cache(cache: Path, key: str) -> Compiled | None:
    meta, cubin = cache / f"{key}.json", cache / f"{key}.cubin"
    if not (meta.exists() and cubin.exists()):
        return None
    d = json.loads(meta.read_text())
    return Compiled(**dict(d, cubin=cubin.read_bytes()))


def _write_cache(cache: Path, key: str, c: Compiled) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    for suffix, data in ((".cubin", c.cubin), (".json", json.dumps(_to_json(c) | {"cubin": None}).encode())):
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=key, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, cache / f"{key}{suffix}")  # atomic: readers see all or nothing


def _main() -> None:
    """A child compiler: a JSON list of jobs on stdin, one JSON line per compiled kernel on stdout."""
    for req in json.loads(sys.stdin.read()):
        s = req["spec"]
        spec = KernelSpec(**dict(s, grid=tuple(s["grid"]), divisible=tuple(s["divisible"])))
        sys.stdout.write(json.dumps(_to_json(_compile_here(spec, req["arch"]))) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _main()
