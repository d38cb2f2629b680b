"""The package's import graph (read with ast, nothing imported): no cycles, and the core stack's
layer order ``utils ← kernels ← model ← optim ← parallel ← train`` never reversed.

Every ``import``/``from … import`` counts, at module level or inside a function (a lazy import
is still a dependency); only ``if TYPE_CHECKING:`` blocks are ignored. The stages above the core
(data, tokenizer, eval, generate, serve, hf, posttrain, scaling, probe, bench, cli) may import the
core; the core imports none of them except the pairs in ``ALLOWED``, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "lmforge"

LAYERS = {
    "utils": 0,
    "kernels": 1,
    "model": 2,
    "optim": 3,
    "parallel": 4,
    "checkpoint": 4,  # lmforge.checkpoint: checkpoint I/O below the trainer
    "train": 5,
    "config": 5,  # lmforge.config: the RunConfig composed of the branches below it
}
ALLOWED = {
    # A checkpoint carries its tokenizer folder; load_for_inference hands it back loaded.
    ("lmforge.checkpoint.io", "lmforge.tokenizer"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = list(f.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in modules else mod)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    # Tarjan's strongly connected components; a component of two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_core_layers_import_only_downward() -> None:
    bad = []
    for a, targets in sorted(_graph().items()):
        la = _layer(a)
        if la is None:
            continue
        for b in sorted(targets):
            lb = _layer(b)
            if b == "lmforge" or (a, ".".join(b.split(".")[:2])) in ALLOWED:
                continue
            if lb is None or lb > la:
                bad.append(f"{a} -> {b}")
    assert bad == []


def test_the_walker_sees_cycles_and_upward_imports() -> None:
    # The checks above would pass on an empty graph: show they catch what they claim to.
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    graph = _graph()
    assert "lmforge.model.layers" in graph["lmforge.model.transformer"]
    assert (
        _layer("lmforge.train.trainer") > _layer("lmforge.parallel.ddp") > _layer("lmforge.model")
    )
