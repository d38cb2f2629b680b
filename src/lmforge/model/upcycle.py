"""Sparse upcycling: a mixture-of-experts model built from a trained dense one.

Kept apart from :mod:`lmforge.model.moe` because it builds a whole
:class:`~lmforge.model.TransformerLM`, which itself imports the MoE layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lmforge.model.moe import MoEFFN
from lmforge.model.transformer import TransformerLM
from lmforge.utils.errors import LmforgeError


def upcycle(
    dense: nn.Module, moe: object, *, seed: int = 0, zero_router: bool = False
) -> nn.Module:
    """An MoE :class:`~lmforge.model.TransformerLM` built from a dense one (sparse upcycling,
    Komatsuzaki et al. 2022). ``moe`` is the :class:`~lmforge.model.moe_config.MoEConfig`.

    Every weight outside the MoE layers' FFNs is copied. In an MoE layer, with g = d_ff /
    expert_d_ff (the granularity), expert e gets slice e mod g of the dense SwiGLU (rows
    ``[j·F, (j+1)·F)`` of w1 and w3, those columns of w2, times g / ``routed_scale``, which undoes
    the routed output's scaling); g = 1 makes every expert a
    copy. The router is fresh (σ as any Linear, from ``seed``; or zero with ``zero_router``),
    the selection bias zero, and shared experts get fresh w1/w3 and a zero w2 (they add nothing
    until trained). The output equals the dense model's at initialisation when the weights of
    the chosen experts sum to 1 and cover every slice: copies (g = 1) with ``norm_top_k`` and
    any router, or g slices with n_experts = top_k = g and a zero router (uniform weights 1/g).
    """
    dcfg = dense.config
    if dcfg.moe.enabled:
        raise LmforgeError("upcycle needs a dense model (model.moe.n_experts = 0)")
    cfg = dataclasses.replace(dcfg, moe=moe)
    if not cfg.moe.enabled:
        raise LmforgeError("upcycle needs model.moe.n_experts > 0")
    f, fe = dcfg.ffn_dim, cfg.expert_dim
    if f % fe:
        raise LmforgeError(f"moe.expert_d_ff ({fe}) must divide the dense d_ff ({f}) to upcycle")
    g = f // fe
    torch.manual_seed(seed)
    model = TransformerLM(cfg, device=next(dense.parameters()).device)
    state = dense.state_dict()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name in state and ".ffn." not in name:
                t.copy_(state[name])
        for i, block in enumerate(model.layers):
            pre = f"layers.{i}.ffn."
            w1, w2, w3 = (state[pre + f"{w}.weight"] for w in ("w1", "w2", "w3"))
            ffn = block.ffn
            if not isinstance(ffn, MoEFFN):
                ffn.load_state_dict({"w1.weight": w1, "w2.weight": w2, "w3.weight": w3})
                continue
            for e in range(ffn.n_experts):
                rows = slice((e % g) * fe, (e % g + 1) * fe)
                ffn.w1[e].copy_(w1[rows])
                ffn.w3[e].copy_(w3[rows])
                ffn.w2[e].copy_(w2[:, rows] * (g / cfg.moe.routed_scale))
            if zero_router:
                ffn.router.weight.zero_()
            if ffn.shared is not None:
                ffn.shared.w2.weight.zero_()
    return model
