"""The Triton kernels as torch custom ops (``torch.ops.lmforge.*``), so torch.compile traces them.

An ``autograd.Function`` whose forward launches Triton kernels is opaque to Dynamo only if it is
wrapped in ``torch.compiler.disable``, and every such call splits the compiled model into two
graphs (a graph break per attention/norm layer). A custom op is one node in the graph instead:
Dynamo and AOTAutograd see its output shapes through a fake (meta) implementation and its
gradient through a registered backward, while the real implementation — the same Triton launches
— runs unchanged at run time. So ``torch.compile(model, fullgraph=True)`` covers the whole model.

Each forward op has a backward op; the autograd registration of the forward saves what the
Triton backward needs and calls the backward op, which AOTAutograd records in the backward graph.

    op                          inputs → outputs (non-differentiable extras marked ·)
    flash_attn_fwd              q (B,H,T,E), k, v (B,K,S,E), causal → O (B,H,T,E), ·L (B,H,T) f32
    flash_attn_bwd              q, k, v, O, L, dO, causal → dq, dk, dv
    rms_norm_fwd                x (N,D), w (D,), eps → y (N,D), ·r (N,) f32
    rms_norm_bwd                x, w, r, dy → dx, dw
    swiglu_fwd / swiglu_bwd     a, b → y;  a, b, dy → da, db
    swiglu_packed_fwd / _bwd    ab (…,2F) = [a | b] → y (…,F);  ab, dy → dab (…,2F)
    rope                        x (…,T,E) or (…,T,H,E), cos, sin (T,E/2) f32, inverse, heads
                                → y  (backward: rope⁻¹)
    rope_packed_split / _join   qk (…,T,(Hq+Hk)·E), cos, sin, Hq, Hk, inverse → q (…,T,Hq,E),
                                k (…,T,Hk,E);  q, k, … → qk  (each the other's backward)
    linear_ce_fwd               h (N,D), W (V,D), t (N,), … → loss, ·dh, ·dW (see below)
    linear_ce_bwd               h, W, t, dloss (N,), … → dh, dW

Rules these follow (custom-op contracts): no output aliases an input (every output is a fresh
buffer; reshapes to the caller's shape happen outside, in the public functions); every output
layout is contiguous and the fake implementations return exactly those layouts; an
implementation makes its inputs contiguous where a kernel needs it, since the compiler may hand
it a strided or padded buffer; non-tensor arguments are plain bool/int/float/str. Autocast casts
stay in the public functions: a custom op is not autocast-aware, so it runs in the dtypes it is
given (the cross-entropy implementation turns autocast off for its matmuls).

Registration happens once per process at import of this module and imports no Triton: the
implementations import the ``_*_triton`` modules on first call. Exercise:
``pytest tests/test_kernels_compile.py``.
"""

from collections.abc import Callable

import torch
from torch import Tensor

_NS = "lmforge"


def _define(
    name: str,
    impl: Callable[..., object],
    fake: Callable[..., object],
    backward: Callable[..., object] | None = None,
    setup_context: Callable[..., None] | None = None,
) -> torch._ops.OpOverload:
    """Register ``lmforge::name`` (implementation, fake, optional autograd) and return it.

    An op already defined (``importlib.reload`` of this module, as in tests) is reused as it is
    rather than defined again, which would swap the op out under compiled graphs and handles
    that already refer to it.
    """
    if not hasattr(getattr(torch.ops, _NS), name):
        op = torch.library.custom_op(f"{_NS}::{name}", impl, mutates_args=())
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
    return getattr(getattr(torch.ops, _NS), name).default


def _unit_stride(x: Tensor) -> Tensor:
    # Kernels that take row strides still need a unit stride along the last dim.
    return x if x.stride(-1) == 1 else x.contiguous()


# -- FlashAttention-2 -------------------------------------------------------------------------


def _flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _flash_triton

    return _flash_triton.forward(_unit_stride(q), _unit_stride(k), _unit_stride(v), causal)


def _flash_attn_fwd_fake(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    b, h, t, e = q.shape
    out = q.new_empty((b, h, t, e))  # (B, H, T, E)
    lse = q.new_empty((b, h, t), dtype=torch.float32)  # (B, H, T)
    return out, lse


def _flash_attn_bwd(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    from lmforge.kernels import _flash_triton

    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    return _flash_triton.backward(q, k, v, out.contiguous(), lse.contiguous(), dout, causal)


def _flash_attn_bwd_fake(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_setup(ctx, inputs, output) -> None:
    q, k, v, causal = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero-filled dL for the logsumexp output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal = causal


def _flash_backward(ctx, dout, _dlse):
    if dout is None:
        return None, None, None, None
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attn_bwd(q, k, v, out, lse, dout, ctx.causal)
    return dq, dk, dv, None


# -- RMSNorm ----------------------------------------------------------------------------------


def _rms_norm_fwd(
    x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _rms_norm_triton

    return _rms_norm_triton.forward(_unit_stride(x), weight.contiguous(), eps, out_dtype=out_dtype)


def _rms_norm_fwd_fake(
    x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor]:
    y = x.new_empty(x.shape, dtype=out_dtype or x.dtype)  # (N, D)
    return y, x.new_empty(x.shape[:1], dtype=torch.float32)  # (N,)


def _rms_norm_bwd(x: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _rms_norm_triton

    x, weight, rstd = _unit_stride(x), weight.contiguous(), rstd.contiguous()
    return _rms_norm_triton.backward(x, weight, rstd, _unit_stride(dy))


def _rms_norm_bwd_fake(
    x: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor
) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_setup(ctx, inputs, output) -> None:
    x, weight, _eps, _out_dtype = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, rstd)


def _rms_backward(ctx, dy, _drstd):
    if dy is None:
        return None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(x, weight, rstd, dy)
    return dx, dw if ctx.needs_input_grad[1] else None, None, None


# -- SwiGLU gate ------------------------------------------------------------------------------


def _swiglu_fwd(a: Tensor, b: Tensor) -> Tensor:
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.swiglu_forward(a.contiguous(), b.contiguous())


def _swiglu_fwd_fake(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty(a.shape)


def _swiglu_bwd(a: Tensor, b: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.swiglu_backward(a.contiguous(), b.contiguous(), dy.contiguous())


def _swiglu_bwd_fake(a: Tensor, b: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    a, b = ctx.saved_tensors
    return swiglu_bwd(a, b, dy)


def _swiglu_packed_fwd(ab: Tensor) -> Tensor:
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.swiglu_packed_forward(ab.contiguous())


def _swiglu_packed_fwd_fake(ab: Tensor) -> Tensor:
    return ab.new_empty((*ab.shape[:-1], ab.shape[-1] // 2))


def _swiglu_packed_bwd(ab: Tensor, dy: Tensor) -> Tensor:
    from lmforge.kernels import _elementwise_triton

    return _elementwise_triton.swiglu_packed_backward(ab.contiguous(), dy.contiguous())


def _swiglu_packed_bwd_fake(ab: Tensor, dy: Tensor) -> Tensor:
    return ab.new_empty(ab.shape)


def _swiglu_packed_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_packed_backward(ctx, dy):
    (ab,) = ctx.saved_tensors
    return swiglu_packed_bwd(ab, dy)


# -- RoPE -------------------------------------------------------------------------------------


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
    return rope(dy, cos, sin, not ctx.inverse, ctx.heads), None, None, None, None


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


# -- fused linear + cross-entropy -------------------------------------------------------------
#
# For "mean" and "sum" the forward already computes dh and dW (scaled by the reduction), so they
# are outputs of the forward op, saved for backward, which only multiplies them by the incoming
# gradient. want_dh / want_dw (known when the caller traces: requires_grad and grad mode) say
# which to compute; one not wanted comes back as an empty (0,) tensor. For "none" the forward
# returns per-row losses and empty gradients; backward recomputes the chunks' logits with the
# per-row incoming gradient as row scale (linear_ce_bwd). chunk = 0 picks the default chunk size
# at run time from the concrete shapes (so a traced caller never computes it from symbolic ones).


def _linear_ce_fwd(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    z_loss: float,
    reduction: str,
    chunk: int,
    use_triton: bool,
    want_dh: bool,
    want_dw: bool,
    check_targets: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    from lmforge.kernels import cross_entropy

    return cross_entropy._fused_forward(
        hidden, weight, targets, ignore_index, z_loss, reduction, chunk, use_triton, want_dh,
        want_dw, check_targets,
    )  # fmt: skip


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _linear_ce_fwd_fake(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    z_loss: float,
    reduction: str,
    chunk: int,
    use_triton: bool,
    want_dh: bool,
    want_dw: bool,
    check_targets: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    rows = hidden.shape[:1] if reduction == "none" else ()
    loss = hidden.new_empty(rows, dtype=_acc_dtype(hidden))  # (N,) or ()
    dh = hidden.new_empty(hidden.shape if want_dh else (0,))  # (N, D)
    dw = weight.new_empty(weight.shape if want_dw else (0,))  # (V, D)
    return loss, dh, dw


def _linear_ce_bwd(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    grad_rows: Tensor,
    ignore_index: int,
    z_loss: float,
    chunk: int,
    use_triton: bool,
    want_dh: bool,
    want_dw: bool,
) -> tuple[Tensor, Tensor]:
    from lmforge.kernels import cross_entropy

    return cross_entropy._fused_backward_rows(
        hidden, weight, targets, grad_rows, ignore_index, z_loss, chunk, use_triton, want_dh,
        want_dw,
    )  # fmt: skip


def _linear_ce_bwd_fake(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    grad_rows: Tensor,
    ignore_index: int,
    z_loss: float,
    chunk: int,
    use_triton: bool,
    want_dh: bool,
    want_dw: bool,
) -> tuple[Tensor, Tensor]:
    dh = hidden.new_empty(hidden.shape if want_dh else (0,))
    dw = weight.new_empty(weight.shape if want_dw else (0,))
    return dh, dw


def _linear_ce_setup(ctx, inputs, output) -> None:
    hidden, weight, targets, ignore_index, z_loss, reduction, chunk, use_triton, dh_on, dw_on = (
        inputs[:10]
    )
    _loss, dh, dw = output
    ctx.mark_non_differentiable(dh, dw)
    ctx.set_materialize_grads(False)  # no zero-filled (N, D) and (V, D) grads for dh, dW
    ctx.reduction = reduction
    ctx.meta = (ignore_index, z_loss, chunk, use_triton)
    ctx.want = (dh_on, dw_on)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, targets)
    else:
        ctx.save_for_backward(dh, dw)


def _traced(t: Tensor) -> bool:
    # AOTAutograd traces backward on fake/functional tensor subclasses, where a value cannot be
    # read; torch < 2.13 does not report is_compiling() there, so the type is checked too.
    return torch.compiler.is_compiling() or type(t) is not torch.Tensor


def linear_ce_grads(
    reduction: str,
    saved: tuple[Tensor, ...],
    meta: tuple[int, float, int, bool],
    want: tuple[bool, bool],
    grad_out: Tensor,
) -> tuple[Tensor | None, Tensor | None]:
    """(dh, dW) of the fused loss given the incoming gradient; shared by the op's autograd and
    :class:`~lmforge.kernels.FusedLinearCrossEntropy`. ``saved``: (dh, dW) from the forward for
    mean/sum, (hidden, weight, targets) for "none"; ``want``: which gradients are needed."""
    want_dh, want_dw = want
    if reduction == "none":
        hidden, weight, targets = saved
        ignore_index, z_loss, chunk, use_triton = meta
        dh, dw = linear_ce_bwd(
            hidden, weight, targets, grad_out, ignore_index, z_loss, chunk, use_triton, want_dh,
            want_dw,
        )  # fmt: skip
    else:
        dh, dw = saved
        # Eager: the loss is usually the root (grad 1), so skip two full-size rescales (one
        # host sync). Traced, the value is unknown and the multiply is one fused pass.
        if _traced(grad_out) or not bool(grad_out == 1):
            dh = dh * grad_out.to(dh.dtype) if want_dh else dh
            dw = dw * grad_out.to(dw.dtype) if want_dw else dw
    return (dh if want_dh else None), (dw if want_dw else None)


def _linear_ce_backward(ctx, grad_out, _ddh, _ddw):
    if grad_out is None:
        return (None,) * 11
    need_h, need_w = ctx.needs_input_grad[:2]
    if ctx.reduction != "none":  # only what the forward computed can be scaled
        need_h, need_w = need_h and ctx.want[0], need_w and ctx.want[1]
    dh, dw = linear_ce_grads(ctx.reduction, ctx.saved_tensors, ctx.meta, (need_h, need_w), grad_out)
    return (dh, dw) + (None,) * 9


flash_attn_fwd = _define(
    "flash_attn_fwd", _flash_attn_fwd, _flash_attn_fwd_fake, _flash_backward, _flash_setup
)
flash_attn_bwd = _define("flash_attn_bwd", _flash_attn_bwd, _flash_attn_bwd_fake)
rms_norm_fwd = _define("rms_norm_fwd", _rms_norm_fwd, _rms_norm_fwd_fake, _rms_backward, _rms_setup)
rms_norm_bwd = _define("rms_norm_bwd", _rms_norm_bwd, _rms_norm_bwd_fake)
swiglu_fwd = _define("swiglu_fwd", _swiglu_fwd, _swiglu_fwd_fake, _swiglu_backward, _swiglu_setup)
swiglu_bwd = _define("swiglu_bwd", _swiglu_bwd, _swiglu_bwd_fake)
swiglu_packed_fwd = _define(
    "swiglu_packed_fwd",
    _swiglu_packed_fwd,
    _swiglu_packed_fwd_fake,
    _swiglu_packed_backward,
    _swiglu_packed_setup,
)
swiglu_packed_bwd = _define("swiglu_packed_bwd", _swiglu_packed_bwd, _swiglu_packed_bwd_fake)
rope = _define("rope", _rope, _rope_fake, _rope_backward, _rope_setup)
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
linear_ce_fwd = _define(
    "linear_ce_fwd", _linear_ce_fwd, _linear_ce_fwd_fake, _linear_ce_backward, _linear_ce_setup
)
linear_ce_bwd = _define("linear_ce_bwd", _linear_ce_bwd, _linear_ce_bwd_fake)
