"""Fused linear + cross-entropy: the LM-head loss without ever materialising (N, V) logits.

Math, per row n with hidden h_n, logits z_n = W h_n, target t_n (rows with t_n = ignore_index
contribute nothing), z-loss weight ζ:
    lse_n = log Σ_v exp(z_nv)          loss_n = lse_n − z_{n,t_n} + ζ·lse_n²
    ∂loss_n/∂z_nv = softmax(z_n)_v · (1 + 2ζ·lse_n) − [v = t_n]
    dh_n = Σ_v ∂z_nv · W_v             dW_v = Σ_n ∂z_nv · h_n
Rows are processed chunk by chunk: one chunk of logits (rows × V) exists at a time; for "mean"
and "sum" the gradients are computed during the forward (the loss is a scalar, so backward only
rescales them by the incoming gradient) — three matmuls in all, like Liger-Kernel. For
reduction="none" backward recomputes each chunk's logits, since it needs the per-row gradient.

The per-chunk softmax/loss/gradient step has two implementations: plain torch (any device, used
on CPU) and a Triton kernel that reads each logit row twice and overwrites it with its gradient in
place. :func:`linear_cross_entropy_reference` is the unchunked definition the tests compare with.

Exercise: ``pytest tests/test_kernels.py -k cross_entropy``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from lmforge.kernels._common import (
    KernelUnsupportedError,
    autocast_dtype,
    check_triton_tensors,
    interpreting,
    triton_available,
)
from lmforge.kernels._ops import _define

# -- the custom ops (torch.ops.lmforge.*) --------------------------------------------------
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
    return _fused_forward(
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
    return _fused_backward_rows(
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
    # AOTAutograd traces backward on fake/functional tensor subclasses; torch < 2.13 does not
    # report is_compiling() there, so the type is checked too.
    return torch.compiler.is_compiling() or type(t) is not torch.Tensor


def linear_ce_grads(
    reduction: str,
    saved: tuple[Tensor, ...],
    meta: tuple[int, float, int, bool],
    want: tuple[bool, bool],
    grad_out: Tensor,
) -> tuple[Tensor | None, Tensor | None]:
    """(dh, dW) of the fused loss given the incoming gradient (the op's autograd). ``saved``:
    (dh, dW) from the forward for mean/sum, (hidden, weight, targets) for "none"; ``want``:
    which gradients are needed."""
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
        # Always rescale: reading grad_out back to skip the multiply when it is 1 was a host
        # sync in every eager training step (the trainer's launch-ahead stalled there), for two
        # passes over dh and dW worth ~0.2% of a GPT-2-small step. Multiplying by 1 is exact.
        # In place: the saved dh and dW are this graph's own (the op's caller never sees them),
        # and a scaled copy would hold both twice at the backward's peak, 2·(N·D + V·D) values
        # instead of N·D + V·D (at 8192×1024→128256 bf16: 533 MiB instead of 267). A second
        # backward through a retained graph then fails in autograd's saved-tensor version check
        # rather than scaling twice. With create_graph the graph's tensors stay intact, and
        # traced (AOTAutograd cannot mutate the forward's outputs in backward) the multiply is
        # out of place, for the compiler to plan.
        eager = not (torch.is_grad_enabled() or _traced(grad_out))
        scale = torch.Tensor.mul_ if eager else torch.Tensor.mul
        dh = scale(dh, grad_out.to(dh.dtype)) if want_dh else dh
        dw = scale(dw, grad_out.to(dw.dtype)) if want_dw else dw
    return (dh if want_dh else None), (dw if want_dw else None)


def _linear_ce_backward(ctx, grad_out, _ddh, _ddw):
    if grad_out is None:
        return (None,) * 11
    need_h, need_w = ctx.needs_input_grad[:2]
    if ctx.reduction != "none":  # only what the forward computed can be scaled
        need_h, need_w = need_h and ctx.want[0], need_w and ctx.want[1]
    dh, dw = linear_ce_grads(ctx.reduction, ctx.saved_tensors, ctx.meta, (need_h, need_w), grad_out)
    return (dh, dw) + (None,) * 9


linear_ce_fwd = _define(
    "linear_ce_fwd", _linear_ce_fwd, _linear_ce_fwd_fake, _linear_ce_backward, _linear_ce_setup
)
linear_ce_bwd = _define("linear_ce_bwd", _linear_ce_bwd, _linear_ce_bwd_fake)


Reduction = Literal["mean", "sum", "none"]

MatmulInto = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None]
"""``mm(a, b, out, accumulate)``: ``out = a @ b`` (or ``out += a @ b``), no autograd."""


def torch_matmul_into(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool
) -> None:
    """The chunk loop's default GEMM: torch's (cuBLAS on CUDA), written into ``out``."""
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Unfused definition: full logits, logsumexp, NLL + z-loss; float32 math (float64 kept).

    "mean" divides by the number of non-ignored rows (0 when every row is ignored).
    """
    acc_t = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = (hidden @ weight.T).to(acc_t)  # (N, V)
    lse = torch.logsumexp(logits, -1)  # (N,)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    loss = lse - logits.gather(1, safe[:, None])[:, 0] + z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return _reduce(loss, valid, reduction)


def _reduce(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)


def default_chunk_rows(n: int, d: int, v: int) -> int:
    """Rows per chunk: the power of two that makes a chunk of logits about as large as the hidden
    states (N·D values), at least 16 rows.

    Fewer, larger chunks keep the LM-head matmuls efficient and cut the read-modify-write passes
    over dW (one per chunk); smaller ones save memory. This is Liger-Kernel's choice too, so the
    two are compared at equal chunk memory.
    """
    rows = math.ceil(n / max(1, math.ceil(v / d)))
    return max(16, 1 << max(0, (rows - 1).bit_length()))


def _torch_chunk_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # logits (n, V); returns loss rows (n,) float32 and the gradient (scaled by `scale` (n,)).
    acc_t = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(acc_t)
    lse = torch.logsumexp(z, -1)  # (n,)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    loss = lse - z.gather(1, safe[:, None])[:, 0] + z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if not compute_grad:
        return loss, logits
    grad = torch.exp(z - lse[:, None]) * (1.0 + 2.0 * z_loss * lse)[:, None]  # (n, V)
    grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    grad *= (scale.to(acc_t) * valid)[:, None]
    return loss, grad.to(logits.dtype)


def _chunk_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    compute_grad: bool,
    use_triton: bool,
    loss_out: torch.Tensor,
) -> torch.Tensor:
    # Writes the chunk's loss rows into loss_out (n,); returns the (scaled) logit gradient.
    if use_triton:
        from lmforge.kernels import _cross_entropy_triton

        _cross_entropy_triton.loss_and_grad_(
            logits, targets, scale, ignore_index, z_loss, compute_grad, loss_out
        )
        return logits  # the gradient overwrote the logits
    loss, grad = _torch_chunk_(logits, targets, scale, ignore_index, z_loss, compute_grad)
    loss_out.copy_(loss)
    return grad


def _accumulate(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_scale: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    chunk: int,
    use_triton: bool,
    want_dh: bool,
    want_dw: bool,
    mm: MatmulInto = torch_matmul_into,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One pass over the chunks: loss rows (N,) float32 and, if asked, dh (N, D) and dW (V, D).

    ``mm`` runs the chunk's three GEMMs (an argument, not a process global, so an experiment
    with another GEMM passes its own without touching the library)."""
    n = hidden.shape[0]
    w = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
    acc_t = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    loss = torch.empty(n, dtype=acc_t, device=hidden.device)  # (N,)
    dh = torch.empty_like(hidden) if want_dh else None  # (N, D)
    # (V, D), accumulated in weight.dtype; the first chunk writes it (no zero fill, no read).
    dw = torch.empty_like(weight) if want_dw else None
    grad = want_dh or want_dw
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        h = hidden[r0:r1]  # (n, D)
        logits = h.new_empty((r1 - r0, w.shape[0]))  # (n, V): the only logits alive at any time
        mm(h, w.T, logits, False)
        g = _chunk_(
            logits, targets[r0:r1], row_scale[r0:r1], ignore_index, z_loss, grad, use_triton,
            loss[r0:r1],
        )  # fmt: skip
        if dh is not None:
            mm(g, w, dh[r0:r1], False)  # (n, D)
        if dw is not None:
            if r0 == 0:
                if dw.dtype == g.dtype:
                    mm(g.T, h, dw, False)  # (V, D)
                else:
                    dw.copy_(g.T @ h)
            elif dw.dtype == g.dtype:
                mm(g.T, h, dw, True)  # (V, D)
            else:
                dw += (g.T @ h).to(dw.dtype)
        del logits, g
    if dw is not None and n == 0:
        dw.zero_()
    return loss, dh, dw


def _fused_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    reduction: str,
    chunk: int,
    use_triton: bool,
    want_dh: bool,
    want_dw: bool,
    check_targets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Body of the custom op ``lmforge::linear_ce_fwd``: (loss, dh, dW), dh/dW empty (0,) when
    not wanted; "none" returns per-row losses and never computes gradients here.

    ``check_targets`` validates the targets (one host sync, which also gives the mean's
    divisor); without it the divisor stays on the device and nothing waits for the GPU.
    chunk = 0 picks :func:`default_chunk_rows`. Autocast is off inside: the caller already cast,
    and the chunk matmuls must run in exactly these dtypes.
    """
    with torch.autocast(hidden.device.type, enabled=False):
        hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
        n, v = hidden.shape[0], weight.shape[0]
        acc_t = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        valid = targets != ignore_index
        divisor: float | torch.Tensor
        if check_targets:
            bad = ((targets < 0) | (targets >= v)) & valid
            # One host sync for both: the mean's divisor and the range check.
            n_valid, n_bad = (int(c) for c in torch.stack((valid.sum(), bad.sum())).tolist())
            del bad
            if n_bad:
                raise KernelUnsupportedError(
                    f"fused_linear_cross_entropy: targets must lie in [0, {v}) or equal "
                    f"ignore_index={ignore_index}"
                )
            divisor = max(n_valid, 1) if reduction == "mean" else 1
            scale = torch.full((1,), 1.0 / divisor, dtype=acc_t, device=hidden.device)
        elif reduction == "mean":
            divisor = valid.sum().clamp(min=1).to(acc_t).reshape(1)  # stays on the device
            scale = 1.0 / divisor
        else:
            divisor = 1
            scale = torch.ones(1, dtype=acc_t, device=hidden.device)
        del valid  # (N,) temporary: not alive during the chunk loop
        eager = reduction != "none"
        # One scale for every row, expanded (stride 0) rather than an (N,) buffer.
        row_scale = scale.expand(n)
        chunk = chunk or default_chunk_rows(n, hidden.shape[1], v)
        loss, dh, dw = _accumulate(
            hidden, weight, targets, row_scale, ignore_index, z_loss, chunk, use_triton,
            eager and want_dh, eager and want_dw,
        )  # fmt: skip
        if eager:
            loss = (loss.sum() / divisor).reshape(())
        dh = hidden.new_empty(0) if dh is None else dh
        dw = weight.new_empty(0) if dw is None else dw
        return loss, dh, dw


def _fused_backward_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    grad_rows: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    chunk: int,
    use_triton: bool,
    want_dh: bool,
    want_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Body of ``lmforge::linear_ce_bwd`` (reduction "none"): recompute each chunk's logits and
    scale row n's gradient by ``grad_rows[n]``; (dh, dW), empty (0,) when not wanted."""
    with torch.autocast(hidden.device.type, enabled=False):
        hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
        chunk = chunk or default_chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0])
        _, dh, dw = _accumulate(
            hidden, weight, targets, grad_rows.contiguous(), ignore_index, z_loss, chunk,
            use_triton, want_dh, want_dw,
        )  # fmt: skip
        dh = hidden.new_empty(0) if dh is None else dh
        dw = weight.new_empty(0) if dw is None else dw
        return dh, dw


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: Reduction = "mean",
    *,
    backend: Literal["auto", "triton", "torch"] = "auto",
    chunk_rows: int | None = None,
    check_targets: bool = True,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``targets`` without full (N, V) logits.

    hidden (N, D) (or (…, D) with targets (…)), weight (V, D), targets int (N,). ``z_loss`` adds
    ζ·lse² per row. "mean" averages over non-ignored rows. ``backend="auto"`` uses the Triton
    chunk kernel on CUDA (or under ``TRITON_INTERPRET=1``) and the chunked torch path elsewhere;
    both never hold more than one chunk of logits. Differentiable in hidden and weight.
    ``check_targets=False`` skips the range check of the targets and with it the op's one host
    sync (for callers that validated them already, like the trainer's sampler): the host then
    runs ahead of the GPU; an out-of-range target gives a wrong loss instead of an error.

    Both chunk paths run inside the custom op ``torch.ops.lmforge.linear_ce_fwd``, so
    torch.compile traces through this function without a graph break (the targets check's host
    sync happens inside the op, at run time). For "mean"/"sum" the op returns dh and dW with the
    loss and backward rescales them; for "none" backward recomputes the logits chunk by chunk
    (``linear_ce_bwd``), also traceable.
    """
    if reduction not in ("mean", "sum", "none"):
        raise KernelUnsupportedError(
            f"fused_linear_cross_entropy: reduction must be mean, sum or none, got {reduction!r}"
        )
    if backend not in ("auto", "triton", "torch"):
        raise KernelUnsupportedError(
            f"fused_linear_cross_entropy: backend must be auto, triton or torch, got {backend!r}"
        )
    dtype = autocast_dtype(hidden.device.type)
    if dtype is not None:  # the LM-head matmul runs in autocast's dtype, as nn.Linear would
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    lead = hidden.shape[:-1]
    hidden2 = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
    targets1 = targets.reshape(-1)  # (N,)
    if weight.dim() != 2 or weight.shape[1] != hidden2.shape[1]:
        raise KernelUnsupportedError(
            f"fused_linear_cross_entropy: weight must be (V, {hidden2.shape[1]}), got "
            f"{tuple(weight.shape)}"
        )
    if targets1.shape[0] != hidden2.shape[0]:
        raise KernelUnsupportedError(
            f"fused_linear_cross_entropy: {targets1.shape[0]} targets for {hidden2.shape[0]} rows"
        )
    use_triton = backend == "triton"
    if backend == "triton":
        check_triton_tensors("fused_linear_cross_entropy", hidden2, weight)
    elif backend == "auto":
        use_triton = (
            triton_available()
            and (hidden2.is_cuda or interpreting())
            and hidden2.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
        )
    needs_grad = torch.is_grad_enabled() and (hidden2.requires_grad or weight.requires_grad)
    want = reduction != "none" and needs_grad  # mean/sum: gradients computed in the forward
    loss, _, _ = linear_ce_fwd(
        hidden2, weight, targets1, ignore_index, float(z_loss), reduction, chunk_rows or 0,
        use_triton, want and hidden2.requires_grad, want and weight.requires_grad, check_targets,
    )  # fmt: skip
    return loss.reshape(lead) if reduction == "none" else loss
