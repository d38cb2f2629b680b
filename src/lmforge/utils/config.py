"""One configuration tree of frozen dataclasses, loaded from TOML and dotted command-line overrides.

A run's configuration is a tree of frozen dataclasses (``RunConfig`` in :mod:`lmforge.config`);
each stage receives only its own branch. This module is generic: it builds any such tree from a
mapping, checks every key and type, applies ``--a.b=value`` overrides and writes the resolved tree
back to TOML. Unknown keys and wrong types raise :class:`ConfigError` naming the dotted key and the
expected type.

Fields document themselves with a string literal on the line after the field (read by
:func:`field_docs` for ``--help`` listings), as in::

    @dataclass(frozen=True)
    class TrainConfig:
        lr: float = 3e-4
        "peak learning rate"
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import os
import textwrap
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

T = TypeVar("T")


class ConfigError(LmforgeError):
    """A configuration file or override names an unknown key or holds a value of the wrong type."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else _type_name(a) for a in get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert where lossless (int → float, list → tuple)."""

    def fail() -> typing.NoReturn:
        raise ConfigError(
            f"config key '{key}': expected {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )

    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            fail()
        return from_dict(tp, value, prefix=key)
    origin = get_origin(tp)
    if origin is Literal:
        if value in get_args(tp) and type(value) in {type(a) for a in get_args(tp)}:
            return value
        fail()
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            fail()
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        fail()
    if origin in (tuple, list):
        if isinstance(value, str) and get_args(tp)[-1:] == (Ellipsis,) and get_args(tp)[0] is str:
            value = [value]  # "--data.train=a.bin" means a one-element list
        if not isinstance(value, list | tuple):
            fail()
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                fail()
            items = [_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            inner = args[0] if args else Any
            items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            fail()
        ktp, vtp = get_args(tp) or (Any, Any)
        return {_coerce(k, ktp, key): _coerce(v, vtp, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        fail()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        fail()
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        fail()
    if tp is str:
        if isinstance(value, str):
            return value
        fail()
    if tp is Path:
        if isinstance(value, str | Path):
            return Path(value)
        fail()
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    fail()


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, checking every key and type (recursively).

    Missing keys take the field's default; a field without a default must be present.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"config section '{prefix or '<root>'}' must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key '{key}' (known keys here: {known})")
        kwargs[name] = _coerce(value, hints[name], key)
    for name, f in fields.items():
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            key = f"{prefix}.{name}" if prefix else name
            raise ConfigError(f"config key '{key}' is required ({_type_name(hints[name])})")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        # __post_init__ validation speaks in the dataclass's own terms; keep its message.
        where = f" in '{prefix}'" if prefix else ""
        raise ConfigError(f"invalid config{where}: {e}") from None


def _parse_value(text: str) -> Any:
    """Parse an override's right-hand side with TOML rules; bare words stay strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Turn ``["train.lr=3e-4", "model.n_layers=2"]`` into a nested dict.

    A leading ``--`` is allowed. Values use TOML syntax (``true``, ``3e-4``, ``[1, 2]``, ``"s"``);
    anything that is not valid TOML is taken as a plain string.
    """
    tree: dict[str, Any] = {}
    for item in overrides:
        raw = item[2:] if item.startswith("--") else item
        if "=" not in raw:
            raise ConfigError(f"override '{item}' must look like --section.key=value")
        key, text = raw.split("=", 1)
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"override '{item}' has an empty key part")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with another override of '{part}'")
        node[parts[-1]] = _parse_value(text)
    return tree


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def _stringify_for_str_fields(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    # "--data.name=123" parses as an int; a str field wants the text back.
    out = dict(data)
    hints = _hints(cls)
    for name, value in data.items():
        tp = hints.get(name)
        if tp is None:
            continue
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            out[name] = _stringify_for_str_fields(tp, value)
        elif tp is str and isinstance(value, int | float | bool):
            out[name] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def load_config(
    cls: type[T],
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    base: Mapping[str, Any] | None = None,
    top: Mapping[str, Any] | None = None,
) -> T:
    """Load ``cls`` from optional ``base`` values, then a TOML file, then dotted overrides, then
    ``top`` (nested values that win over all: a command's own flags)."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = _merge(data, read_toml(path))
    data = _merge(data, _stringify_for_str_fields(cls, parse_overrides(overrides)))
    if top:
        data = _merge(data, top)
    return from_dict(cls, data)


def read_toml(path: str | os.PathLike, what: str = "config file") -> dict[str, Any]:
    """The parsed TOML file at ``path``; a missing, non-UTF-8, invalid or empty file (or a
    folder) is one :class:`ConfigError` line naming ``what`` and the path."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} {p} is a directory, expected a file")
    if not p.is_file():
        raise ConfigError(f"{what} not found: {p}")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} {p} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {p} is not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} {p}: {e.strerror or e}") from None
    if not data:
        # an empty file would silently give every default (e.g. a 162M model on the CPU)
        raise ConfigError(f"{what} {p} is empty: it sets no keys")
    return data


def config_to_dict(obj: Any) -> Any:
    """Plain nested dict/list/scalar form of a config tree (Paths become strings)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: config_to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [config_to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): config_to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_scalar(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _toml_scalar(k)


def config_to_toml(obj: Any) -> str:
    """Write a config tree as TOML (``None`` fields are omitted: TOML has no null)."""

    def emit(d: dict[str, Any], section: str, out: list[str]) -> None:
        scalars = {
            k: v
            for k, v in d.items()
            if v is not None and not (isinstance(v, dict) and _is_table(obj, section, k))
        }
        tables = {k: v for k, v in d.items() if k not in scalars and v is not None}
        if section and (scalars or not tables):
            out.append(f"[{section}]")
        for k, v in scalars.items():
            out.append(f"{_toml_key(k)} = {_toml_scalar(v)}")
        if scalars or section:
            out.append("")
        for k, v in tables.items():
            emit(v, f"{section}.{k}" if section else k, out)

    out: list[str] = []
    emit(config_to_dict(obj), "", out)
    return "\n".join(out).rstrip() + "\n"


def _is_table(root: Any, section: str, key: str) -> bool:
    # A nested dataclass becomes a [table]; a dict-valued field stays an inline table.
    node = root
    for part in [p for p in section.split(".") if p]:
        node = getattr(node, part, None)
    return dataclasses.is_dataclass(getattr(node, key, None))


def save_config(obj: Any, path: str | os.PathLike) -> None:
    """Write the resolved config tree to ``path`` as TOML, atomically."""
    atomic_write_text(path, config_to_toml(obj))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring written after each field of dataclass ``cls`` (empty if none)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(source)
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe_config(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, doc) for every leaf field of a config tree, for ``--help`` listings."""
    rows: list[tuple[str, str, str]] = []
    docs = field_docs(cls)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe_config(tp, key))
        else:
            rows.append((key, _type_name(tp), docs.get(f.name, "")))
    return rows
