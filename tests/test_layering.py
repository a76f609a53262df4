"""The package's layers stay true: every import (lazy ones inside functions included) goes to the same layer
own package or to a lower layer, and there is no import cycle.

    runtime (_backend, _cli, _loader, _nvrtc, _public, build, graph, data, tokenizer, prepare, settings)
      <  ops (+ blas, blaslt, distributed)  <  autograd, amp  <  functional  <  nn, optim, io  <  models  <  generation
      <  export, sample (the export and generator command lines)  <  train  <  run (the launcher)
      <  the package root (its __init__ only re-exports)
"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "cukernels"

LAYERS = [
    {"_backend", "_cli", "_loader", "_nvrtc", "_public", "build", "graph", "data", "tokenizer", "prepare", "settings"},
    {"ops", "blas", "blaslt", "distributed"},
    {"autograd", "amp"},
    {"functional"},
    {"nn", "optim", "io"},
    {"models"},
    {"generation"},
    {"export", "sample"},
    {"train"},
    {"run"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules():
    out = {}
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(mod, path, mods):
    """Every cukernels module imported by ``mod`` (absolute or relative, at any depth in the file)."""
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            b = base[: len(base) - (node.level - 1)] if node.level else []
            root = ".".join(b + (node.module.split(".") if node.module else []))
            names = [f"{root}.{a.name}" if f"{root}.{a.name}" in mods else root for a in node.names]
        for t in names:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != mod and t.split(".")[0] == "cukernels":
                found.add(t)
    return found


def _top(mod):
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package root


def test_every_module_has_a_layer():
    tops = {_top(m) for m in _modules()} - {None}
    assert tops <= set(RANK), f"modules without a layer in tests/test_layering.py: {sorted(tops - set(RANK))}"


def test_imports_only_go_down():
    mods = _modules()
    bad = []
    for m, f in mods.items():
        src = _top(m)
        for t in _imports(m, f, mods):
            dst = _top(t)
            if src is None:
                continue  # the root re-exports everything
            if dst is None:
                bad.append(f"{m} imports the package root {t} (import the module itself)")
            elif RANK[dst] > RANK[src]:
                bad.append(f"{m} (layer {RANK[src]}: {src}) imports {t} (layer {RANK[dst]}: {dst})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    mods = _modules()
    edges = {m: _imports(m, f, mods) for m, f in mods.items()}
    # a package's __init__ and its own direct module (a registry, re-exports) may import each other
    def tolerated(a, b):
        return a.rpartition(".")[0] == b or b.rpartition(".")[0] == a

    index, low, stack, on, cycles = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
            if len(comp) > 2 or (len(comp) == 2 and not tolerated(*comp)):
                cycles.append(sorted(comp))

    for v in mods:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("bad", ["from ..models import Llama", "import cukernels"])
def test_the_checker_catches_an_upward_import(tmp_path, bad):
    """The test above can fail: an nn module importing models (or the root) is reported."""
    mods = _modules()
    f = tmp_path / "x.py"
    f.write_text(bad + "\n")
    got = _imports("cukernels.nn.x", f, mods)
    assert got and all(RANK.get(_top(t), 99) > RANK["nn"] or _top(t) is None for t in got)
