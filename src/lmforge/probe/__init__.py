"""Probes of a model's behaviour: ``lmforge probe causality`` (MoE routing, KV-cache decoding).

This is the public API of ``lmforge.probe``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from lmforge.probe.causality import CausalityReport, LayerChange, probe_causality

__all__ = ["CausalityReport", "LayerChange", "probe_causality"]

_EXPORTS = {
    "CausalityReport": "causality",
    "LayerChange": "causality",
    "probe_causality": "causality",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
