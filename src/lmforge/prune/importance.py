"""Importance scores for structured pruning, from activations on calibration text (Minitron).

One pass over the calibration tokens with forward hooks gathers, per
:class:`~lmforge.model.TransformerLM`:

- ``heads`` (L, H): mean L2 norm, over tokens, of each query head's attention output (the
  slice of ``output_proj``'s input that head writes) — Minitron's head importance;
- ``ffn`` (L, F): mean |a_j| of the SwiGLU activation ``a = silu(w1 x) ⊙ w3 x`` (``w2``'s input)
  per hidden channel;
- ``hidden`` (D,): mean |y_d| of every RMSNorm output in the model (ln1, ln2 of each block and
  ln_final), summed: how much each residual channel feeds the computation;
- ``layers`` (L,): Block Influence (ShortGPT) ``1 − E[cos(x_in, x_out)]`` of each block — a
  block that barely turns its input is the one to remove.

Scores are means over all N·T calibration tokens. Exercised by ``pytest tests/test_prune.py``.
Shape legend: L layers, H query heads, E head dim, F ffn dim, D model dim, N samples, T tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = ["Importance", "activation_importance"]


@dataclasses.dataclass
class Importance:
    """Per-structure importance (larger = keep)."""

    heads: torch.Tensor
    "(L, H) mean L2 norm of each query head's attention output"
    ffn: torch.Tensor
    "(L, F) mean |SwiGLU activation| per hidden channel"
    hidden: torch.Tensor
    "(D,) summed mean |RMSNorm output| per residual channel"
    layers: torch.Tensor
    "(L,) Block Influence 1 − mean cos(block input, block output)"
    tokens: int
    "calibration tokens the scores average over"


@torch.no_grad()
def activation_importance(
    model: nn.Module, tokens: torch.Tensor, batch_size: int = 8, progress: bool = False
) -> Importance:
    """Scores of ``model`` (a TransformerLM with dense SwiGLU blocks) on ``tokens`` (N, T)."""
    cfg = model.config
    n_layers, h, e = cfg.n_layers, cfg.n_heads, int(cfg.head_dim)
    dev = next(model.parameters()).device
    heads = torch.zeros(n_layers, h, dtype=torch.float64)
    ffn = torch.zeros(n_layers, cfg.ffn_dim, dtype=torch.float64)
    hidden = torch.zeros(cfg.d_model, dtype=torch.float64)
    cos = torch.zeros(n_layers, dtype=torch.float64)
    handles = []

    def on_heads(i: int):
        def hook(_m: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
            o = args[0].float().reshape(-1, h, e)  # (B·T, H, E)
            heads[i] += o.norm(dim=-1).sum(0).double().cpu()

        return hook

    def on_ffn(i: int):
        def hook(_m: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
            a = args[0].float().reshape(-1, args[0].shape[-1])  # (B·T, F)
            ffn[i] += a.abs().sum(0).double().cpu()

        return hook

    def on_norm(_m: nn.Module, _args: tuple[Any, ...], out: torch.Tensor) -> None:
        hidden.add_(out.float().reshape(-1, out.shape[-1]).abs().sum(0).double().cpu())

    def on_block(i: int):
        def hook(_m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            x_in = args[0].float().reshape(-1, args[0].shape[-1])  # (B·T, D)
            x_out = out.float().reshape(-1, out.shape[-1])
            cos[i] += (
                torch.nn.functional.cosine_similarity(x_in, x_out, dim=-1).sum().double().cpu()
            )

        return hook

    for i, layer in enumerate(model.layers):
        handles.append(layer.attn.output_proj.register_forward_hook(on_heads(i)))
        handles.append(layer.ffn.w2.register_forward_hook(on_ffn(i)))
        handles.append(layer.ln1.register_forward_hook(on_norm))
        handles.append(layer.ln2.register_forward_hook(on_norm))
        handles.append(layer.register_forward_hook(on_block(i)))
    handles.append(model.ln_final.register_forward_hook(on_norm))
    batches = tokens.split(batch_size)
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="importance", unit="batch")
    try:
        for batch in batches:
            model(batch.to(dev))
    finally:
        for hd in handles:
            hd.remove()
    n = tokens.numel()
    return Importance(
        heads=(heads / n).float(),
        ffn=(ffn / n).float(),
        hidden=(hidden / n).float(),
        layers=(1.0 - cos / n).float(),
        tokens=n,
    )
