"""muP multipliers (Yang et al. 2022, Tensor Programs V, Table 3 for Adam) as pure functions.

With width multiplier m = d_model / mup_base_width: hidden matrices (every Linear inside the
blocks) keep their 1/fan_in-variance init and get Adam LR × 1/m; the embedding, the norm gains
and the LM head keep the base LR; logits are multiplied by 1/m (applied to the final hidden state,
so the fused loss sees it too); attention scores use sqrt(E_base)/E instead of 1/sqrt(E), i.e. the
1/E scaling, equal to the standard scale at E = mup_base_head_dim. At m = 1 and E = E_base every
multiplier is 1 and the model is the standard one. ``model.mup`` switches it on; the trainer reads
:func:`lr_multipliers` when it builds the optimizer's parameter groups. Exercised by
``pytest tests/test_scaling_mup.py`` and ``lmforge scaling coord-check``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from lmforge.model.config import ModelConfig

# Parameters that keep the base LR under muP besides vectors: the input and output layers.
_BASE_LR = ("token_embeddings.weight", "lm_head.weight")


def output_multiplier(cfg: ModelConfig) -> float:
    """The logits' factor 1/m = mup_base_width / d_model (also the hidden matrices' LR factor)."""
    return cfg.mup_base_width / cfg.d_model


def q_scale(cfg: ModelConfig) -> float:
    """Factor on q turning the kernels' 1/sqrt(E) into sqrt(E_base)/E."""
    return math.sqrt(cfg.mup_base_head_dim / cfg.head_dim)


def lr_multipliers(model: nn.Module) -> dict[int, float]:
    """id(parameter) → LR multiplier under muP (empty when ``model.config.mup`` is off)."""
    cfg = model.config
    if not getattr(cfg, "mup", False):
        return {}
    hidden = output_multiplier(cfg)
    return {
        id(p): (hidden if p.ndim >= 2 and name not in _BASE_LR else 1.0)
        for name, p in model.named_parameters()
    }
