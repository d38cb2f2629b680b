"""RoPE row orders shared by the Llama/Qwen3, DeepSeek-V3, Bamba and Qwen3-Next mappings
(:mod:`lmforge.hf.convert`, :mod:`lmforge.hf.deepseek`, :mod:`lmforge.hf.bamba`,
:mod:`lmforge.hf.qwen3_next`)."""

from __future__ import annotations

import torch


def rope_permutation(head_dim: int) -> torch.Tensor:
    """Row order that maps lmforge's interleaved RoPE layout to HF's half-split one.

    ``hf_rows = lmforge_rows[perm]`` within each head: ``perm = [0, 2, …, E-2, 1, 3, …, E-1]``.
    """
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def partial_rope_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Row order, within a head, from lmforge's layout to HF's under partial rotary
    (``ModelConfig.rotary_dim`` R ≤ E): the R rotated rows half-split as
    :func:`rope_permutation`, then the E − R pass-through rows in place."""
    return torch.cat([rope_permutation(rotary_dim), torch.arange(rotary_dim, head_dim)])
