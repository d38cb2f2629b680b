"""The readable reference decoder: a KV-cache loop on token ids, the oracle the serving engine
(:class:`lmforge.serve.Engine`) is tested against. Every command decodes on the engine;
``lmforge generate`` (``_cli.py``) is one of them.

This is the public API of ``lmforge.generate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.generate.engine import generate, greedy_generate_reference

__all__ = ["generate", "greedy_generate_reference"]

_EXPORTS = {
    "generate": "engine",
    "greedy_generate_reference": "engine",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
