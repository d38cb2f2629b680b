"""Scaling laws: plan and run IsoFLOP sweeps, fit Chinchilla's Approaches 2 and 3, predict.

This is the public API; everything else in ``lmforge.scaling`` is internal. The command is
``lmforge scaling plan|run|fit|predict|branch|coord-check``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.scaling.fit import (
        IsoflopFit,
        ParametricFit,
        ParametricLaw,
        fit_and_report,
        fit_isoflop,
        fit_parametric,
        predict_isoflop,
        predict_parametric,
    )
    from lmforge.scaling.runs import RunTable, load_runs

__all__ = [
    "IsoflopFit",
    "ParametricFit",
    "ParametricLaw",
    "RunTable",
    "fit_and_report",
    "fit_isoflop",
    "fit_parametric",
    "load_runs",
    "predict_isoflop",
    "predict_parametric",
]

_EXPORTS = {
    "IsoflopFit": "fit",
    "ParametricFit": "fit",
    "ParametricLaw": "fit",
    "RunTable": "runs",
    "fit_and_report": "fit",
    "fit_isoflop": "fit",
    "fit_parametric": "fit",
    "load_runs": "runs",
    "predict_isoflop": "fit",
    "predict_parametric": "fit",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
