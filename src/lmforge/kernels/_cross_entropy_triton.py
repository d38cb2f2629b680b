"""Triton kernel for one chunk of the fused linear + cross-entropy (see ``cross_entropy.py``).

One program per logit row (or a persistent grid walking the rows, a sweep option). Pass 1 streams the row in BLOCK_V slices keeping a per-lane running
max and rescaled sum (no cross-lane reduction inside the loop), then reduces once to the
logsumexp. Pass 2 re-reads the row and overwrites it in place with the scaled gradient
``(softmax·(1 + 2ζ·lse) − onehot) · scale``, so the chunk's logits buffer becomes its gradient
without a second allocation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting

_LOG2E = tl.constexpr(1.4426950408889634)  # log2 e


@triton.jit
def _grad_slices(z_row, cols, V, bias, mul, BLOCK_V: tl.constexpr, MUL: tl.constexpr):
    # Pass 2 of _ce_row: logits z → 2^(z·log2 e − bias) (· mul when MUL), in place.
    for v0 in range(0, V, BLOCK_V):
        in_row = v0 + cols < V
        z = tl.load(z_row + v0 + cols, mask=in_row, other=0.0).to(tl.float32)
        g = tl.exp2(z * _LOG2E - bias)
        if MUL:
            g = g * mul
        tl.store(z_row + v0 + cols, g.to(z_row.dtype.element_ty), mask=in_row)


# V stays specialised (Triton's divisible-by-16 hint, true for padded vocabularies): the mask
# `v0 + cols < V` is then constant over 16-column groups and row loads/stores vectorise to
# 16-byte accesses instead of predicated 2-byte ones.
@triton.jit(do_not_specialize=["ignore_index"])
def _ce_row(
    Z, stride_z, T, SCALE, stride_s, LOSS, V, ignore_index, z_loss, n_rows,
    COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # A few hundred rows per chunk give one or two programs per SM, and at that occupancy the
    # kernel is bound by instruction issue as much as by memory, so the work per logit is kept
    # small (each measured on an H200, RESULTS.md fifth session; 512×128256 inside the op):
    # base-2 exponentials with log2 e folded into one multiply-add (124 → 114 µs); the target
    # column's −1 applied after pass 2 by one scalar store instead of a compare and select per
    # logit (→ 108 µs); the row's scale folded into the exponent, 2^(x − b + log2 c), instead of
    # a multiply per logit (256×50304: 19.3 → 17.6 µs). Liger's kernel: 110–112 and 25 µs.
    # One row per program, or (persistent launch) rows pid, pid + programs, … in turn.
    for r in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        z_row = Z + row * stride_z
        target = tl.load(T + row).to(tl.int64)
        valid = target != ignore_index
        cols = tl.arange(0, BLOCK_V)
        # Pass 1: one running max per row (a block max per slice, so one exp per logit, not two)
        # and per-lane rescaled sums reduced once at the end. The finite floor keeps m − m_new
        # defined; every slice holds at least one real logit, so m_new is finite after slice 0.
        m = tl.full([], -1e30, dtype=tl.float32)
        s = tl.zeros([BLOCK_V], dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            z = tl.load(z_row + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, 0))
            m2 = m_new * _LOG2E
            s = s * tl.exp2(m * _LOG2E - m2) + tl.exp2(z * _LOG2E - m2)
            m = m_new
        lse = m + tl.log(tl.sum(s, 0))
        safe_t = tl.where(valid, target, 0)
        z_t = tl.load(z_row + safe_t).to(tl.float32)  # the target's logit, before pass 2 writes
        loss = tl.where(valid, lse - z_t + z_loss * lse * lse, 0.0)
        tl.store(LOSS + row, loss)
        if COMPUTE_GRAD:
            scale = tl.where(valid, tl.load(SCALE + row * stride_s).to(tl.float32), 0.0)
            coef = 1.0 + 2.0 * z_loss * lse
            # Every warp has read z_t before any warp's pass-2 store can overwrite it. (Reading it
            # before pass 1 instead measured slower: the load's address waits on the target's.)
            tl.debug_barrier()
            c = coef * scale  # softmax·c everywhere but the target column
            if c >= 0:  # c = 0 (ignored row): log c = −inf, the exponent −inf, g = 0
                _grad_slices(z_row, cols, V, (lse - tl.log(c)) * _LOG2E, 1.0, BLOCK_V, False)
            else:  # a negative upstream gradient: no logarithm, one multiply per logit
                _grad_slices(z_row, cols, V, lse * _LOG2E, c, BLOCK_V, True)
            # Every thread's pass-2 stores land before this one overwrites the target column;
            # (p_t·coef − 1)·scale is formed in fp32 from the saved logit, then rounded once.
            tl.debug_barrier()
            g_t = (tl.exp(z_t - lse) * coef - 1.0) * scale
            tl.store(z_row + safe_t, g_t.to(Z.dtype.element_ty))


# Launch choice on CUDA, from benchmarks/ce_sweep.py's chunk-kernel sweeps on an H200 (RESULTS.md,
# fourth and fifth sessions): a chunk has only a few hundred rows (one program each, 1-4 per SM),
# so each program keeps many loads in flight — wide slices, many warps, and wider still for long
# rows. In the op (fifth session): 512×128256 16384 columns × 32 warps 107.8 µs (× 16 warps
# 109.7, 32768 × 32 113.9, 8192 × 16 119.5); 256×50304 8192 × 16 17.6 µs (× 32 warps 18.8,
# 4096 × 16 20.9, 16384 × 32 23.1).
BLOCK_V = 8192
LONG_ROW = 65536  # rows longer than this use the LONG_* launch
LONG_BLOCK_V = 16384
LONG_WARPS = 32


def launch_config(v: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the chunk kernel for rows of ``v`` logits on CUDA."""
    if v > LONG_ROW:
        return LONG_BLOCK_V, LONG_WARPS
    block_v = min(BLOCK_V, triton.next_power_of_2(v))
    return block_v, 16 if block_v >= 8192 else (8 if block_v >= 2048 else 4)


def loss_and_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    z_loss: float,
    compute_grad: bool,
    loss: torch.Tensor,
    *,
    block: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
) -> None:
    """Writes the loss per row into ``loss`` (n,) (contiguous; float32, or float64); logits (n, V)
    become the gradient. ``scale`` (n,) may be an expanded scalar (stride 0). ``block`` and
    ``num_warps`` override :func:`launch_config` on CUDA (for sweeps); ``programs`` caps the
    grid (a persistent launch: each program walks rows with that stride; default one program
    a row)."""
    if interpreting():
        ensure_interpreter_compat()
    if logits.stride(-1) != 1:
        raise ValueError("cross-entropy chunk: logits need a unit column stride")
    n, v = logits.shape
    if interpreting():
        block_v, warps = 1024, 4
    else:
        block_v, warps = launch_config(v)
        block_v, warps = block or block_v, num_warps or warps
    grid = (max(1, min(n, programs or n)),)
    _ce_row[grid](
        logits, logits.stride(0), targets, scale, scale.stride(0), loss, v, ignore_index, z_loss,
        n, COMPUTE_GRAD=compute_grad, BLOCK_V=block_v, num_warps=warps,
    )  # fmt: skip
