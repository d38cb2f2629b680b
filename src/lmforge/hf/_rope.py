"""RoPE row orders shared by the Llama/Qwen3 and DeepSeek-V3 mappings (:mod:`lmforge.hf.convert`,
:mod:`lmforge.hf.deepseek`)."""

from __future__ import annotations

import torch


def rope_permutation(head_dim: int) -> torch.Tensor:
    """Row order that maps lmforge's interleaved RoPE layout to HF's half-split one.

    ``hf_rows = lmforge_rows[perm]`` within each head: ``perm = [0, 2, …, E-2, 1, 3, …, E-1]``.
    """
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
