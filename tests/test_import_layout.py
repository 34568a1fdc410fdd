"""Imports point one way (the layout table in README's tour and DESIGN.md): every module of
the package is read with ast, nothing imported, and each `import` or `from ... import`, at
the top of a file or inside a function (a lazy import does not dodge the rule), must land in
what its layer may import. tests/ is not walked (tests import everything)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package `kiln`

LOW = ("kiln.graph", "kiln.errors")  # what every layer above graph may use
RUNTIME_SHARED = ("kiln.runtime.worker.bundle", "kiln.runtime.sample.phases")  # the bundle's format

# layer (a module or package prefix) -> the prefixes its modules may import. The longest
# matching layer applies; a module no layer matches fails the test (add its row here first).
ALLOWED: dict[str, tuple[str, ...]] = {
    "kiln": ("kiln.errors", "kiln.entrypoints", "kiln.runtime.sample.sampling_params"),  # the lazy front door
    "kiln.errors": (),
    "kiln.graph": ("kiln.graph",),
    "kiln.schedules": ("kiln.schedules",),
    "kiln.models": ("kiln.models",) + LOW,
    "kiln.passes": ("kiln.passes",) + LOW,
    "kiln.codegen": ("kiln.codegen", "kiln.passes", "kiln.schedules") + LOW + RUNTIME_SHARED,
    # the runtime reads bundles: never models, passes, codegen, the loader, entrypoints, server, bench, build.py
    "kiln.runtime": ("kiln.runtime",) + LOW,
    "kiln.runtime.core": ("kiln.runtime.core", "kiln.errors"),  # pure Python over ints
    "kiln.runtime.text": ("kiln.runtime.text", "kiln.runtime.sample.sampling_params") + LOW,  # stop strings
    "kiln.runtime.sample": ("kiln.runtime.sample", "kiln.runtime.text") + LOW,
    "kiln.runtime.worker": ("kiln.runtime.worker", "kiln.runtime.sample", "kiln.runtime.core", "kiln.runtime.cpu") + LOW,
    "kiln.runtime.engine": ("kiln.runtime",) + LOW,
    "kiln.loader": ("kiln.models", "kiln.passes", "kiln.codegen", "kiln.schedules", "kiln.runtime") + LOW,
    "kiln.entrypoints": ("kiln.entrypoints", "kiln.loader", "kiln.runtime") + LOW,
    "kiln.server": ("kiln.server", "kiln.entrypoints", "kiln.loader", "kiln.runtime", "kiln.__version__") + LOW,
    "kiln.bench": ("kiln.bench", "kiln.entrypoints", "kiln.loader", "kiln.runtime", "kiln.server", "kiln.models",
                   "kiln.passes", "kiln.codegen", "kiln.schedules") + LOW,
    "kiln.build": ("kiln",),  # the command line may use everything
}
# third-party modules a layer must not import: the scheduler's side runs without model arrays
FORBIDDEN_THIRD_PARTY = {"kiln.runtime.core": ("numpy", "ml_dtypes", "cuda", "triton")}
SKIP_DIRS = {"tests", "docs", "schedules_cache", "build", "dist"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kiln"] + parts)


def package_modules() -> list[Path]:
    out = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT).parts
        if rel[0] in SKIP_DIRS or rel[0].startswith(".") or any(p.endswith(".egg-info") for p in rel):
            continue
        if len(rel) > 1 and not (ROOT / rel[0] / "__init__.py").is_file():
            continue  # a folder that is not a package (scripts)
        out.append(f)
    return out


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split(".")[1:]) if dotted != "kiln" else Path()
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


ERROR_NAMES = {"KilnError", "ModelNotFoundError", "InvalidModelError", "UnsupportedArchitectureError",
               "ConfigError", "ChatTemplateError"}  # what kiln/__init__.py re-exports from kiln.errors


def imports_of(tree: ast.Module, me: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported kiln module) for every import in module `me`. `from P import N` imports
    P.N when that is a module, else P; `from kiln import X` is the lazy front door
    (kiln.entrypoints) unless X is an error class or __version__."""
    pkg = me if is_package else me.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "kiln"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.split(".")[0] != "kiln":
                continue
            for a in node.names:
                if src == "kiln":
                    target = ("kiln.errors" if a.name in ERROR_NAMES else
                              "kiln.__version__" if a.name == "__version__" else "kiln.entrypoints")
                else:
                    target = f"{src}.{a.name}" if _is_module(f"{src}.{a.name}") else src
                out.append((node.lineno, target))
    return out


def third_party_imports(tree: ast.Module) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def layer_of(module: str) -> str | None:
    best = None
    for layer in ALLOWED:
        if (module == layer or module.startswith(layer + ".")) and (best is None or len(layer) > len(best)):
            best = layer
    return best


def _within(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def violations(where: str, source: str, me: str, is_package: bool = False) -> list[str]:
    """What is wrong with the imports of module `me` (its text `source`, shown as `where`)."""
    tree = ast.parse(source, where)
    layer = layer_of(me)
    if layer is None:
        return [f"{where}: {me} belongs to no layer of the table (add it to ALLOWED)"]
    bad = [f"{where}:{line}: {me} imports {target}, which layer {layer} may not "
           f"(it may import {', '.join(ALLOWED[layer]) or 'nothing of kiln'})"
           for line, target in imports_of(tree, me, is_package)
           if target != me and not _within(target, ALLOWED[layer])]
    for forbidden_layer, names in FORBIDDEN_THIRD_PARTY.items():
        if me == forbidden_layer or me.startswith(forbidden_layer + "."):
            bad += [f"{where}:{line}: {me} imports {name} (layer {forbidden_layer} must not)"
                    for line, name in third_party_imports(tree) if name in names]
    return bad


def test_every_import_points_down_the_table():
    paths = package_modules()
    assert len(paths) > 100  # the walk found the package (not an empty directory)
    assert ROOT / "runtime" / "core" / "scheduler.py" in paths and ROOT / "build.py" in paths
    bad = [b for f in paths for b in violations(str(f.relative_to(ROOT)), f.read_text(), module_name(f),
                                                f.name == "__init__.py")]
    assert not bad, "imports against the layout:\n" + "\n".join(bad)


@pytest.mark.parametrize("where,line", [
    ("runtime/worker/model_runner.py", "from kiln.loader import load"),
    ("runtime/engine/core.py", "    from kiln.build import main  # a lazy import is no way round"),
    ("runtime/engine/async_llm.py", "from kiln.entrypoints.engine import build_engine"),
    ("runtime/core/scheduler.py", "import numpy as np"),
    ("runtime/core/scheduler.py", "from kiln.runtime.worker.input_batch import prepare_step"),
    ("runtime/text/tokenizer.py", "from kiln.models.source import open_model"),
    ("runtime/sample/sampler.py", "from kiln import LLM"),
    ("runtime/worker/cuda_executor.py", "from ...codegen.compile import compile_bundle"),
    ("server/app.py", "from kiln.build import main"),
    ("graph/graph.py", "from kiln.errors import KilnError"),
    ("codegen/compile.py", "from kiln.models.registry import get_graph_builder"),
])
def test_an_upward_import_is_caught(where, line):
    """Each module as it is passes; with one upward import added (at the top, or inside a
    function when indented), the rule names that line."""
    src = ROOT / where
    me, text = module_name(src), src.read_text()
    assert violations(where, text, me) == []
    body = f"\n\ndef _probe():\n{line}\n" if line.startswith(" ") else f"\n{line}\n"
    bad = violations(where, text + body, me)
    n = len((text + body).splitlines())
    assert len(bad) == 1 and f"{where}:{n}:" in bad[0], bad
