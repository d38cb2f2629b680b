"""Triton kernels of the MoE layer's data movement (imported lazily by :mod:`lmforge.model.moe`).

The grouped GEMMs read and write rows sorted by expert; tokens live in token order. Two kernels
move between the two without a materialised permuted copy:

- :func:`gather_sum`: ``out[t] = Σ_j w[t, j] · src[idx[t·k + j]]`` (w optional = 1), one
  program per (token, column block), fp32 accumulation. It is the combine's forward (src = the
  sorted expert outputs, idx = inv, w = gate weights) and the token gather's backward (src = the
  sorted gradient rows, no weights).
- :func:`combine_backward`: for sorted row s of assignment a = order[s] and token t = a // k,
  ``dys[s] = w[a] · g[t]`` and ``dw[a] = <g[t], ys[s]>``: one read of g's row and ys's row,
  one write of dys's row, no scatter conflicts (order is a permutation).

Shape legend: M tokens, k top-k, A = M·k assignments, D model dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting


def _block_d(d: int) -> int:
    return min(triton.next_power_of_2(d), 1024)


@triton.jit
def _gather_sum_kernel(
    SRC, IDX, W, OUT, D, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(IDX + t * K + j).to(tl.int64)
        v = tl.load(SRC + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(W + t * K + j).to(tl.float32)
        acc += v
    tl.store(OUT + t * D + cols, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _combine_bwd_kernel(G, YS, ORDER, W, DYS, DW, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    a = tl.load(ORDER + s).to(tl.int64)
    t = a // K
    w = tl.load(W + a).to(tl.float32)
    dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for c in range(0, D, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        mask = cols < D
        g = tl.load(G + t * D + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(YS + s * D + cols, mask=mask, other=0.0).to(tl.float32)
        dot += g * y
        tl.store(DYS + s * D + cols, (w * g).to(DYS.dtype.element_ty), mask=mask)
    tl.store(DW + a, tl.sum(dot, axis=0))


def gather_sum(
    src: torch.Tensor, idx: torch.Tensor, k: int, w: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """src (A, D) contiguous, idx (M·k,) rows of src, w (M·k,) or None -> (M, D) ``out_dtype``."""
    if interpreting():
        ensure_interpreter_compat()
    d = src.shape[1]
    m = idx.numel() // k
    out = torch.empty((m, d), dtype=out_dtype, device=src.device)
    if m == 0:
        return out
    bd = _block_d(d)
    grid = (m, triton.cdiv(d, bd))
    _gather_sum_kernel[grid](
        src, idx, src if w is None else w, out, d, K=k, HAS_W=w is not None, BLOCK_D=bd
    )
    return out


def combine_backward(
    g: torch.Tensor, ys: torch.Tensor, order: torch.Tensor, w: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """g (M, D), ys (A, D) sorted rows, order (A,), w (A,) token-major -> (dys (A, D) in ys's
    dtype, dw (A,) fp32 token-major)."""
    if interpreting():
        ensure_interpreter_compat()
    a, d = ys.shape
    dys = torch.empty_like(ys)
    dw = torch.empty(a, dtype=torch.float32, device=ys.device)
    if a == 0:
        return dys, dw
    _combine_bwd_kernel[(a,)](g, ys, order, w, dys, dw, d, K=k, BLOCK_D=_block_d(d))
    return dys, dw
