"""What the trainer applies to the single-device model from outside, before compiling it:
activation checkpointing and master weights (``FastPath.master_weights``), names unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from lmforge.model.layers import Linear
from lmforge.model.moe import moe_layers


@functools.cache
def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(cls):  # type: ignore[misc, valid-type]
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return super().forward(*args, **kwargs)
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)

    Checkpointed.__name__ = Checkpointed.__qualname__ = f"Checkpointed{cls.__name__}"
    return Checkpointed


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each block of ``model.layers`` in backward instead of storing its activations:
    each block's class becomes a subclass whose ``forward`` runs under non-reentrant
    ``torch.utils.checkpoint``, so names and checkpoints do not change. Returns ``model``."""
    for block in model.layers:
        block.__class__ = _checkpointed_class(type(block))
    return model


def bf16_weight_copies(model: nn.Module) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
    """Turn the matmul weights of ``model`` into bf16 copies of fp32 master weights, in place.

    Every :class:`~lmforge.model.layers.Linear` weight (not one tied to the token embedding, not
    an MoE router) and every MoE layer's stacked expert weights become a bf16 Parameter (same
    object, same name); its fp32 values move to a master tensor AdamW updates (``copies=…``),
    rewriting the copy each step. Under bf16 autocast this computes exactly what fp32 weights
    would (autocast rounds each weight to bf16 for its matmul, whose weight gradient comes out
    in bf16) without the per-step cast kernels: ~170 fewer a GPT-2-small step. Embeddings and
    norm gains stay fp32. Returns ``{name: (copy parameter, fp32 master)}``.
    """
    linear = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
    embeddings = getattr(model, "token_embeddings", None)
    if embeddings is not None:
        linear.discard(id(embeddings.weight))  # tied LM head: the embedding stays fp32
    for layer in moe_layers(model):
        # Expert weights are matmul weights too (casting them costs ~450 MB of traffic and 6
        # kernels per GPT-2-small MoE layer and step). The router stays fp32: router_logits
        # rounds it itself and its fp32 weight gradient would be rounded by a bf16 copy.
        linear.update(id(w) for w in (layer.w1, layer.w2, layer.w3))
        linear.discard(id(layer.router.weight))
    out: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if id(p) in linear and p.dtype == torch.float32:
            master = p.detach().clone()
            p.data = p.data.to(torch.bfloat16)
            out[name] = (p, master)
    return out
