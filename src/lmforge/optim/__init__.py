"""Optimizer helpers shared by ``lmforge.parallel`` and ``lmforge.train``.

This is the public API: :func:`clip_grad_norm` (clip in place, return the norm before) and
:func:`grad_norm_and_clip_coef` (the norm and the clip factor, gradients untouched).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.optim.clip import clip_grad_norm, grad_norm_and_clip_coef

__all__ = ["clip_grad_norm", "grad_norm_and_clip_coef"]

_EXPORTS = {"clip_grad_norm": "clip", "grad_norm_and_clip_coef": "clip"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
