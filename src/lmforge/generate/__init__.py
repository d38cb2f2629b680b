"""Inference on token ids: KV-cache sampling (the tokenizer stays outside, in the CLI).

This is the public API of ``lmforge.generate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.generate.engine import generate, greedy_generate_reference
    from lmforge.generate.sampling import sample_next_token

__all__ = ["generate", "greedy_generate_reference", "sample_next_token"]

_EXPORTS = {
    "generate": "engine",
    "greedy_generate_reference": "engine",
    "sample_next_token": "sampling",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
