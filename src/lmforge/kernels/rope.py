"""Fused rotary position embedding (interleaved pairs, Meta's Llama layout), forward and backward.

Math: each consecutive pair (x[2i], x[2i+1]) of a head vector at position t is rotated by the
angle θ_ti whose cosine and sine are the tables cos[t, i], sin[t, i]:
    y[2i]   = x[2i]·cos − x[2i+1]·sin        y[2i+1] = x[2i]·sin + x[2i+1]·cos
The backward is the inverse rotation (sin → −sin) applied to dy, so nothing but the tables is
saved. The fused op reads and writes each element once instead of the several gathers,
multiplies and stacks of the torch version. Same layout as ``lmforge.model.RotaryEmbedding``.
Exercise: ``pytest tests/test_kernels_interp.py`` (interpreter) and ``-m gpu``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmforge.kernels._common import KernelUnsupportedError, check_triton_tensors
from lmforge.kernels._ops import _define


# -- the custom ops (torch.ops.lmforge.*) --------------------------------------------------
def _rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool, heads: int) -> Tensor:
    # heads = 1: x (…, T, E); heads = H: x (…, T, H, E) (positions on the third-last axis).
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.rope(
        x.contiguous(), cos.contiguous(), sin.contiguous(), inverse, heads
    )


def _rope_fake(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool, heads: int) -> Tensor:
    return x.new_empty(x.shape)


def _rope_setup(ctx, inputs, output) -> None:
    _x, cos, sin, inverse, heads = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse, ctx.heads = inverse, heads


def _rope_backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    # The rotation's adjoint is the inverse rotation; the tables get no gradient.
    return rope_op(dy, cos, sin, not ctx.inverse, ctx.heads), None, None, None, None


def _rope_packed_split(
    qk: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_k: int, inverse: bool
) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.rope_packed(
        qk.contiguous(), None, None, cos.contiguous(), sin.contiguous(), n_q, n_k, inverse
    )


def _rope_packed_split_fake(
    qk: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_k: int, inverse: bool
) -> tuple[Tensor, Tensor]:
    e = qk.shape[-1] // (n_q + n_k)
    lead = qk.shape[:-1]
    return qk.new_empty((*lead, n_q, e)), qk.new_empty((*lead, n_k, e))


def _rope_packed_join(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_k: int, inverse: bool
) -> Tensor:
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.rope_packed(
        None, q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous(), n_q, n_k,
        inverse,
    )  # fmt: skip


def _rope_packed_join_fake(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, n_q: int, n_k: int, inverse: bool
) -> Tensor:
    return q.new_empty((*q.shape[:-2], (n_q + n_k) * q.shape[-1]))


def _rope_packed_setup(ctx, inputs, output) -> None:
    cos, sin, n_q, n_k, inverse = inputs[-5:]
    ctx.save_for_backward(cos, sin)
    ctx.meta = (n_q, n_k, not inverse)


def _rope_packed_split_backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    if dq is None:
        dq = torch.zeros_like(dk[..., :1, :]).expand(*dk.shape[:-2], ctx.meta[0], dk.shape[-1])
    if dk is None:
        dk = torch.zeros_like(dq[..., :1, :]).expand(*dq.shape[:-2], ctx.meta[1], dq.shape[-1])
    return rope_packed_join(dq, dk, cos, sin, *ctx.meta), None, None, None, None, None


def _rope_packed_join_backward(ctx, dqk):
    cos, sin = ctx.saved_tensors
    dq, dk = rope_packed_split(dqk, cos, sin, *ctx.meta)
    return dq, dk, None, None, None, None, None


rope_op = _define("rope", _rope, _rope_fake, _rope_backward, _rope_setup)
rope_packed_split = _define(
    "rope_packed_split",
    _rope_packed_split,
    _rope_packed_split_fake,
    _rope_packed_split_backward,
    _rope_packed_setup,
)
rope_packed_join = _define(
    "rope_packed_join",
    _rope_packed_join,
    _rope_packed_join_fake,
    _rope_packed_join_backward,
    _rope_packed_setup,
)


def rope_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, seq_dim: int = -2
) -> torch.Tensor:
    """Rotate pairs of x (…, T, E) — or (…, T, H, E) with ``seq_dim=-3`` — by cos/sin (T, E/2);
    math in float32 (float64 kept)."""
    acc_t = torch.float64 if x.dtype == torch.float64 else torch.float32
    pairs = x.to(acc_t).unflatten(-1, (-1, 2))  # (…, T, E/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos.to(acc_t), sin.to(acc_t)
    if seq_dim == -3:
        c, s = c[:, None], s[:, None]  # (T, 1, E/2): the same angle for every head
    y = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)  # (…, T, E/2, 2)
    return y.flatten(-2).to(x.dtype)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_dim: int = -2) -> None:
    check_triton_tensors("rope", x)
    if seq_dim not in (-2, -3):
        raise KernelUnsupportedError(f"rope: seq_dim must be -2 or -3, got {seq_dim}")
    if x.dim() < -seq_dim or x.shape[-1] % 2:
        layout = "(…, T, E)" if seq_dim == -2 else "(…, T, H, E)"
        raise KernelUnsupportedError(f"rope: x must be {layout} with even E, got {tuple(x.shape)}")
    want = (x.shape[seq_dim], x.shape[-1] // 2)
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise KernelUnsupportedError(
            f"rope: cos/sin must be {want} (T, E/2), got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, seq_dim: int = -2
) -> torch.Tensor:
    """Fused RoPE: rotate consecutive pairs of x (…, T, E) by cos/sin tables (T, E/2) for the
    positions of x's T axis; differentiable in x. ``seq_dim=-3`` takes x as (…, T, H, E), the
    layout the q/k projections write, so the model rotates before its head transpose without a
    copy. Raises KernelUnsupportedError for inputs the kernel cannot handle (use
    :func:`rope_reference` there). A custom op (``torch.ops.lmforge.rope``, its backward the
    inverse rotation), so torch.compile traces through it."""
    _check(x, cos, sin, seq_dim)
    heads = 1 if seq_dim == -2 else x.shape[-2]
    return rope_op(x, cos.float(), sin.float(), False, heads)


def rope_packed_reference(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k from one packed buffer qk (…, T, (n_q + n_k)·E) — q's heads first — each
    rotated as :func:`rope_reference` with ``seq_dim=-3``: (…, T, n_q, E), (…, T, n_k, E)."""
    e = qk.shape[-1] // (n_q + n_k)
    q, k = qk.unflatten(-1, (n_q + n_k, e)).split([n_q, n_k], dim=-2)
    return rope_reference(q, cos, sin, seq_dim=-3), rope_reference(k, cos, sin, seq_dim=-3)


def rope_packed(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q: int, n_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused RoPE on q and k in one launch, from one packed buffer qk (…, T, (n_q + n_k)·E) —
    the output of a single matmul against ``cat([Wq, Wk])``, q's n_q heads first — into
    separate contiguous q (…, T, n_q, E) and k (…, T, n_k, E); cos/sin (T, E/2). Differentiable:
    the backward rotates dq and dk back into one (…, T, (n_q + n_k)·E) buffer, the gradient of
    that matmul's output, with no concatenation. fp16/bf16/fp32 on CUDA (or CPU under
    ``TRITON_INTERPRET=1``); raises KernelUnsupportedError for inputs it cannot handle. Custom
    ops ``torch.ops.lmforge.rope_packed_split`` / ``rope_packed_join``."""
    check_triton_tensors("rope_packed", qk)
    heads = n_q + n_k
    if n_q < 1 or n_k < 1 or qk.dim() < 2 or qk.shape[-1] % heads or (qk.shape[-1] // heads) % 2:
        raise KernelUnsupportedError(
            f"rope_packed: qk must be (…, T, ({n_q} + {n_k})·E) with even E, got {tuple(qk.shape)}"
        )
    want = (qk.shape[-2], qk.shape[-1] // heads // 2)
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise KernelUnsupportedError(
            f"rope_packed: cos/sin must be {want} (T, E/2), got {tuple(cos.shape)}, "
            f"{tuple(sin.shape)}"
        )
    return rope_packed_split(qk, cos.float(), sin.float(), n_q, n_k, False)
