"""Structured pruning (Minitron-style): activation importance, width and depth pruning.

This is the public API of ``lmforge.prune``. :func:`activation_importance` scores heads, FFN
channels, residual channels and blocks on calibration tokens; :func:`prune_width` and
:func:`prune_depth` build a smaller valid model from those scores; :func:`plan_width` /
:func:`plan_depth` pick its shape for a parameter target. Recovery is distillation from the
unpruned model with the post-training ``distill`` objective
(``lmforge distill --teacher ORIGINAL --student PRUNED ...``). CLI: ``lmforge prune``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.prune.importance import Importance, activation_importance
    from lmforge.prune.prune import (
        count_parameters,
        plan_depth,
        plan_width,
        prune_depth,
        prune_width,
    )

__all__ = [
    "Importance",
    "activation_importance",
    "count_parameters",
    "plan_depth",
    "plan_width",
    "prune_depth",
    "prune_width",
]

_EXPORTS = {
    "Importance": "importance",
    "activation_importance": "importance",
    "count_parameters": "prune",
    "plan_depth": "prune",
    "plan_width": "prune",
    "prune_depth": "prune",
    "prune_width": "prune",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
