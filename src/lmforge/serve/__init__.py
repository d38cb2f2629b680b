"""Inference engine and OpenAI-compatible server: paged KV cache, continuous batching, prefix
caching, speculative decoding, CUDA-graph decode.

This is the public API of ``lmforge.serve``. The engine works on token ids only; the server
(``lmforge serve``) and the terminal chat (``lmforge chat``) hold the tokenizer. ``lmforge.generate``
stays the readable reference the engine is tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.serve.blocks import BlockAllocator
    from lmforge.serve.engine import CompletionOutput, Engine, RequestOutput
    from lmforge.serve.sampling import SamplingParams
    from lmforge.serve.speculative import (
        DraftModel,
        NgramDraft,
        Speculative,
        truncated_draft,
    )

__all__ = [
    "BlockAllocator",
    "CompletionOutput",
    "DraftModel",
    "Engine",
    "NgramDraft",
    "RequestOutput",
    "SamplingParams",
    "Speculative",
    "truncated_draft",
]

_EXPORTS = {
    "BlockAllocator": "blocks",
    "CompletionOutput": "engine",
    "Engine": "engine",
    "RequestOutput": "engine",
    "SamplingParams": "sampling",
    "DraftModel": "speculative",
    "NgramDraft": "speculative",
    "Speculative": "speculative",
    "truncated_draft": "speculative",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
