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

from lmforge.kernels import _ops
from lmforge.kernels._common import KernelUnsupportedError, check_triton_tensors


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


class RoPETriton(torch.autograd.Function):
    """``RoPETriton.apply(x, cos, sin)`` → rotated x; no gradient for the tables. Runs the custom
    op ``torch.ops.lmforge.rope`` that :func:`rope` uses with its own autograd."""

    @staticmethod
    def forward(ctx, x, cos, sin):  # type: ignore[override]
        _check(x, cos, sin)
        c, s = cos.float(), sin.float()
        ctx.save_for_backward(c, s)
        return _ops.rope(x, c, s, False, 1)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        c, s = ctx.saved_tensors
        return _ops.rope(dy, c, s, True, 1), None, None


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
    return _ops.rope(x, cos.float(), sin.float(), False, heads)


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
    return _ops.rope_packed_split(qk, cos.float(), sin.float(), n_q, n_k, False)
