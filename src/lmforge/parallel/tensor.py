"""Megatron-style tensor parallelism for lmforge's Transformer blocks.

Inside each block the two matrix multiplies of a pair are split so that only one all-reduce of
activations is needed per pair, forward and backward:

* column-parallel (``q_proj``, ``k_proj``, ``v_proj``, ``ffn.w1``, ``ffn.w3``): each rank holds
  ``d_out / n`` output rows of the weight; its input goes through ``_CopyToTP`` (identity forward,
  all-reduce of the gradient backward, because every rank's partial input gradient is needed);
* row-parallel (``output_proj``, ``ffn.w2``): each rank holds ``d_in / n`` input columns and
  produces a partial sum; ``_ReduceFromTP`` all-reduces it forward (identity backward).

Attention heads split with the q/k/v rows (H/n query heads and K/n kv-heads per rank, so each
rank runs ordinary attention on its heads). Norms, embeddings and the LM head are replicated;
their gradients come out identical on every tensor-parallel rank, so they need no reduction.
Per layer and direction the traffic is two all-reduces of a (B, T, D) activation: with a ring,
about 8·b·s·h·(n−1)/n bytes per layer forward+backward in bf16.

Simplifications: no sequence parallelism, no vocabulary-parallel embedding/LM head.

Exercise: ``pytest tests/test_parallel_tp_pp.py -k tp``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.utils.errors import LmforgeError


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce (sum, fp32) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce_sum_fp32(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum, fp32) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return _all_reduce_sum_fp32(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _all_reduce_sum_fp32(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    buf = x.float().contiguous() if x.dtype != torch.float32 else x.contiguous().clone()
    dist.all_reduce(buf, group=group)
    return buf.to(x.dtype)


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Enter a column-parallel region (identity forward, all-reduce backward)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Leave a row-parallel region (all-reduce forward, identity backward)."""
    return _ReduceFromTP.apply(x, group)


_COLUMN = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "ffn.w1", "ffn.w3")
_ROW = ("attn.output_proj", "ffn.w2")


def _shard_weight(linear: nn.Module, dim: int, rank: int, n: int) -> None:
    w = linear.weight
    if w.shape[dim] % n:
        raise LmforgeError(f"tensor parallel: weight {tuple(w.shape)} not divisible by tp={n}")
    piece = w.detach().chunk(n, dim=dim)[rank].clone()
    linear.weight = nn.Parameter(piece, requires_grad=w.requires_grad)
    linear.tp_dim = dim  # used when gathering full weights


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """Shard every block of ``model.layers`` over ``group`` in place; return ``model``.

    The model must hold the same weights on every rank of the group (seed before building it,
    or broadcast). Attention modules get their ``n_heads``/``n_kv_heads`` divided by the degree.
    """
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if n == 1:
        return model
    for block in model.layers:
        attn = block.attn
        if attn.n_heads % n or attn.n_kv_heads % n:
            raise LmforgeError(
                f"tensor parallel: tp={n} must divide n_heads={attn.n_heads} and "
                f"n_kv_heads={attn.n_kv_heads}"
            )
        # the output gate's W_gate (Qwen3-Next) is split by query heads, as q_proj
        gate = ("attn.gate_proj",) if getattr(attn, "gate_proj", None) is not None else ()
        for name in _COLUMN + gate:
            lin = block.get_submodule(name)
            _shard_weight(lin, 0, rank, n)
            lin.register_forward_pre_hook(lambda m, args, g=group: (copy_to_tp(args[0], g),))
        for name in _ROW:
            lin = block.get_submodule(name)
            _shard_weight(lin, 1, rank, n)
            lin.register_forward_hook(lambda m, args, out, g=group: reduce_from_tp(out, g))
        attn.n_heads //= n
        attn.n_kv_heads //= n
    model.tp_group = group
    return model


def _shard_dims(model: nn.Module) -> dict[str, int]:
    return {
        f"{name}.weight": mod.tp_dim
        for name, mod in model.named_modules()
        if hasattr(mod, "tp_dim")
    }


@torch.no_grad()
def gather_tp_tensors(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate the tensor-parallel slices in ``state`` into full tensors (collective)."""
    group = getattr(model, "tp_group", None)
    if group is None:
        return state
    n = dist.get_world_size(group)
    dims = _shard_dims(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in dims:
            parts = [torch.empty_like(value) for _ in range(n)]
            dist.all_gather(parts, value.contiguous(), group=group)
            out[key] = torch.cat(parts, dim=dims[key])
        else:
            out[key] = value
    return out


def slice_tp_tensors(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's tensor-parallel slice of every sharded tensor in a full ``state``."""
    group = getattr(model, "tp_group", None)
    if group is None:
        return state
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    dims = _shard_dims(model)
    return {k: (v.chunk(n, dim=dims[k])[rank] if k in dims else v) for k, v in state.items()}


def gather_tensor_parallel_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full single-device state dict of a tensor-parallel model (collective over tp)."""
    return gather_tp_tensors(model, model.state_dict())


def load_tensor_parallel_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full single-device state into a tensor-parallel model (each rank slices)."""
    model.load_state_dict(slice_tp_tensors(model, state))
