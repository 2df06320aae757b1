"""Dependencies point one way: the framework core knows neither rules nor kernels, the kernels
reach only the framework's leaves, the rules reach the kernels only through an op's Spec, the
kernel library (kernels/lib) registers nothing and never imports across toolchains, a kernel's
limits exist only as its predicate (`Impl.accepts`), and no two modules import each other,
directly or around a loop.

The package-dir remap (patterns/ -> k3fuse.patterns, kernels/ -> k3fuse.kernels) hides these edges
from import tools, so this test builds the import graph itself from the source: every `import`
and `from ... import` (function-level ones included: a lazy import is still a dependency), except
those under `if TYPE_CHECKING:`. An edge goes to the module named (as import-linter counts it), or
to the package when the imported name is not a submodule.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source directory -> the package it installs as (pyproject's package-dir)
PACKAGES = {"k3fuse": "k3fuse", "patterns": "k3fuse.patterns", "kernels": "k3fuse.kernels"}

#: imports nothing from k3fuse but these
LEAVES = {"k3fuse.settings": set(), "k3fuse.graph_facts": set(), "k3fuse.usage_error": set(),
          "k3fuse.compat": {"k3fuse.graph_facts"}, "k3fuse.runtime": {"k3fuse.settings"}, "k3fuse.spelling": {"k3fuse.quant"}, "k3fuse.quant": set(),
          "k3fuse.tools.console": set(), "k3fuse.token_range": set(),
          "k3fuse.fileio": {"k3fuse.usage_error"}}
#: the framework core: it must not import the rules, the kernels or the doors
CORE = {"k3fuse.settings", "k3fuse.token_range", "k3fuse.graph_facts", "k3fuse.usage_error", "k3fuse.compat",
        "k3fuse.runtime", "k3fuse.context", "k3fuse.guards", "k3fuse.rewrite_site", "k3fuse.matcher", "k3fuse.rule",
        "k3fuse.rule_api", "k3fuse.vocabulary", "k3fuse.engine_ops", "k3fuse.fp32_residual", "k3fuse.pipeline",
        "k3fuse.verify", "k3fuse.log", "k3fuse.fileio"}
#: what a kernel module may import from k3fuse outside k3fuse.kernels
KERNEL_REACH = {"k3fuse.runtime", "k3fuse.settings", "k3fuse.compat", "k3fuse.dist", "k3fuse.graph_facts",
                "k3fuse.spelling", "k3fuse.quant", "k3fuse.usage_error"}


def _module_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for src, pkg in PACKAGES.items():
        base = ROOT / src
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if src == "k3fuse" and parts and parts[0] in ("patterns", "kernels"):
                continue
            out[name] = path
    return out


MODULES = _module_files()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(importer: str, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not _is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for sub in ast.walk(child):
                    if hasattr(sub, "lineno"):
                        lines.add(sub.lineno)
    return lines


def _edges(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in MODULES else target)
    return {e for e in out if e in MODULES and e != name}


GRAPH = {name: _edges(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_real():
    assert len(MODULES) > 60
    assert "k3fuse.kernels.dispatch" in GRAPH["k3fuse.kernels.ops.decode_gemm"]
    assert "k3fuse.kernels.lib.triton.splitk_gemm" in GRAPH["k3fuse.kernels.lib.triton.moe_gather"]
    assert "k3fuse.rule_api" in GRAPH["k3fuse.patterns.decode_gemm"]


def test_no_import_cycles():
    assert _cycles() == []


@pytest.mark.parametrize("module", sorted(CORE))
def test_core_knows_no_rules_kernels_or_doors(module):
    bad = sorted(e for e in GRAPH[module] if e not in CORE)
    assert bad == [], f"{module} imports {bad}"


@pytest.mark.parametrize("module", sorted(LEAVES))
def test_leaves(module):
    assert GRAPH[module] <= LEAVES[module], f"{module} imports {sorted(GRAPH[module] - LEAVES[module])}"


def test_kernels_reach_only_the_leaves():
    bad = {m: sorted(e for e in deps if not e.startswith("k3fuse.kernels") and e not in KERNEL_REACH)
           for m, deps in GRAPH.items() if m.startswith("k3fuse.kernels")}
    assert {m: e for m, e in bad.items() if e} == {}


def test_the_compiler_never_imports_the_tools():
    """k3fuse.tools (CLI, demo, bench, validate, console tables) sits on top: nothing below reaches up."""
    bad = {m: sorted(e for e in deps if e == "k3fuse.tools" or e.startswith("k3fuse.tools."))
           for m, deps in GRAPH.items() if not m.startswith("k3fuse.tools")}
    assert {m: e for m, e in bad.items() if e} == {}
    assert "k3fuse.tools.cli" in MODULES and "k3fuse.tools.bench.runner" in MODULES


#: what a rule may import from the kernels: an op module, for its Spec (the typed contract)
RULE_REACH_PREFIX = "k3fuse.kernels.ops."
LIBRARY = "k3fuse.kernels.lib"
TOOLCHAINS = ("cute", "triton", "reference")
#: library packages of launch sequences across toolchains (a CuTe kernel between Triton ones), never a kernel
#: body: the toolchains each may import
COMPOSITES = {"composite": ("cute", "triton")}


def test_rules_reach_kernels_only_through_an_ops_spec():
    doors = {"k3fuse.backend", "k3fuse.inductor", "k3fuse.offline", "k3fuse.tools.cli", "k3fuse.plugins", "k3fuse"}
    bad = {m: sorted(e for e in deps if (e.startswith("k3fuse.kernels") and not e.startswith(RULE_REACH_PREFIX))
                     or e in doors)
           for m, deps in GRAPH.items() if m.startswith("k3fuse.patterns")}
    assert {m: e for m, e in bad.items() if e} == {}


def _toolchain(module: str) -> str | None:
    parts = module.split(".")
    return parts[3] if module.startswith(LIBRARY + ".") and len(parts) > 3 else None


def test_the_library_never_imports_across_toolchains():
    """A module under kernels/lib/<toolchain> imports no other toolchain's modules (cute never triton, and
    the other way round; the plain-torch references neither; none a composite): a launch sequence mixing
    both lives under kernels/lib/composite, which may import exactly those two."""
    bad = {m: sorted(e for e in deps if _toolchain(e) not in (None, _toolchain(m), *COMPOSITES.get(_toolchain(m), ())))
           for m, deps in GRAPH.items() if _toolchain(m)}
    assert {m: e for m, e in bad.items() if e} == {}
    assert all(_toolchain(m) in TOOLCHAINS + tuple(COMPOSITES) for m in GRAPH if _toolchain(m))


def test_the_w4a16_launch_sequence_lives_in_the_composite_package():
    """The routed experts' W4A16 launches (Triton grouping and SiTU-GLU around the CuTe GEMMs) and their
    configuration are lib/composite's; the op module holds its Spec, predicates and registration, and reaches
    the sequence only through it."""
    composite = "k3fuse.kernels.lib.composite.routed_experts_w4a16"
    assert {f"{LIBRARY}.cute.routed_experts_w4a16", f"{LIBRARY}.triton.routed_experts_w4a16"} <= GRAPH[composite]
    assert composite in GRAPH["k3fuse.kernels.ops.routed_experts_w4a16"]
    defs = {n.name for n in ast.walk(ast.parse(MODULES["k3fuse.kernels.ops.routed_experts_w4a16"].read_text()))
            if isinstance(n, ast.FunctionDef)}
    assert not defs & {"cute_config", "pick_config", "tuned_choices"}, defs


#: the kernel library modules that read a setting: compat's K3FUSE_DISABLE_CUTE check (the DSL's availability)
READS_SETTINGS = {f"{LIBRARY}.cute.compat"}


def test_the_library_reads_no_settings():
    """Settings are read outside kernels/lib (k3fuse/settings.py parses them; an op module or its caller
    passes what a kernel needs as arguments)."""
    readers = {m for m, deps in GRAPH.items() if m.startswith(LIBRARY) and "k3fuse.settings" in deps}
    assert readers <= READS_SETTINGS, sorted(readers - READS_SETTINGS)


def test_the_library_registers_nothing():
    """kernels/lib holds kernel bodies: it imports neither the dispatcher's registry, the op
    declarations nor the op modules, and never calls register_impl / register_stock / declare."""
    registry = {"k3fuse.kernels.declare", "k3fuse.kernels.ops", "k3fuse.kernels.dispatch"}
    for name, path in MODULES.items():
        if not name.startswith(LIBRARY):
            continue
        assert not {e for e in GRAPH[name] if e in registry or e.startswith("k3fuse.kernels.ops.")}, name
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
                 for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)}
        assert not calls & {"register_impl", "register_stock", "declare"}, (name, calls)


#: function names that would state a kernel's limits a second time, beside its predicate
LIMIT_NAMES = {"supports", "covers", "_supports", "_covers", "decide", "_shape_limit", "_reason"}


def test_a_kernels_limits_exist_only_as_its_predicate():
    """Every implementation states its limits once, as `Impl.accepts` over its op's Spec, which serves
    the compile-time coverage guard and the call-time dispatch alike: no kernel module defines a
    separate supports/covers/decide, and Impl has no second predicate to fill in."""
    from dataclasses import fields

    from k3fuse.kernels import dispatch

    for name, path in MODULES.items():
        if name.startswith("k3fuse.kernels"):
            defs = {n.name for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            assert not defs & LIMIT_NAMES, (name, sorted(defs & LIMIT_NAMES))
    assert [f.name for f in fields(dispatch.Impl) if f.name in ("supports", "covers")] == []
    import k3fuse.kernels.ops as ops

    for decl in ops.DECLARATIONS:
        for impl in dispatch.implementations(decl.name):
            assert impl.name == dispatch.REFERENCE or callable(impl.accepts), (decl.name, impl.name)
        if any(i.name != dispatch.REFERENCE and "cuda" in i.device_types and i.needs
               for i in dispatch.implementations(decl.name)):
            assert decl.spec is not None, f"{decl.name}: kernels need the op's Spec"
