"""Every field of the run-config tree is read somewhere in ``src/lmforge`` (a setting nothing
reads is a promise the code does not keep: ``parallel.microbatches`` was one).

Read = an attribute access ``.name`` or the string ``"name"`` (``getattr(cfg, key)`` loops)
anywhere in the package outside the config classes' own ``__post_init__`` validation and the
root ``lmforge/config.py``. Coarse by design (a common name read for another object passes too), it catches fields
no code mentions at all.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from lmforge.config import RunConfig

SRC = Path(__file__).resolve().parents[1] / "src" / "lmforge"


def _fields(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    out = []
    for f in dataclasses.fields(cls):
        tp = f.type if isinstance(f.type, type) else None
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default) or (tp is not None and dataclasses.is_dataclass(tp)):
            sub = type(default) if default is not None else tp
            out += _fields(sub, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f.name, cls.__module__))
    return out


def _reads(skip: Path) -> set[str]:
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        if path == skip:
            continue
        stack: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"))]
        while stack:
            node = stack.pop()
            if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
                continue  # a field's own validation is not a use of it
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
            stack.extend(ast.iter_child_nodes(node))
    return names


def test_every_config_field_is_read_somewhere() -> None:
    fields = _fields(RunConfig)
    reads = _reads(SRC / "config.py")
    unread = [key for key, name, _ in fields if name not in reads]
    assert unread == [], f"config fields nothing reads: {unread}"
    assert len(fields) > 100  # the whole tree was walked (model, train, data, parallel, ...)
