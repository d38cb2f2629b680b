"""Lazy public APIs: a package lists its exports without importing them (or torch) at import.

``lmforge --help`` and config loading must stay fast, so package ``__init__`` files map each
public name to the submodule defining it and import that submodule on first attribute access
(PEP 562 module ``__getattr__``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for ``package`` given ``{name: submodule}``.

    Submodules are named relative to ``package`` (``"layers"``) or in full
    (``"lmforge.model.layers"``).
    A submodule value equal to the name itself (``{"accounting": "accounting"}``) exports the
    submodule.
    """

    def __getattr__(name: str) -> Any:
        try:
            sub = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        full = sub if sub.startswith("lmforge.") else f"{package}.{sub}"  # full or relative
        module = importlib.import_module(full)
        value = module if sub == name else getattr(module, name)
        globals_ = importlib.import_module(package).__dict__
        globals_[name] = value  # cache: later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
