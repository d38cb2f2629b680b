"""Triton kernels of the fused RMSNorm (math and public op in ``rms_norm.py``).

Forward: each program normalises ROWS rows held in one (ROWS, BLOCK_D) register tile (ROWS grows
as D shrinks so every program moves a few thousand values) and stores r = 1/rms per row.
Backward: a fixed number of programs (a few per SM) each own a contiguous slab of rows, write dx
for them and one float32 partial dw; the host sums the (programs, D) partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting


# D stays specialised (Triton's divisible-by-16 hint): with it the column mask `cols < D` is
# constant over 16-column groups and loads/stores vectorise to 16-byte accesses; unspecialised,
# every bf16 element is its own predicated 2-byte access (the ~25% of copy bandwidth measured). The hint is
# part of the cache key (D % 16 == 0 or not), not D itself, so widths do not recompile.
@triton.jit(do_not_specialize=["N"])
def _rms_fwd(
    X, W, Y, RSTD, stride_x, stride_y, N, D, eps,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < N
    mask = row_ok[:, None] & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # (ROWS, BLOCK_D)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)  # (ROWS,)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit(do_not_specialize=["N", "rows_per_prog"])
def _rms_bwd(
    X, W, DY, RSTD, DX, DWP, stride_x, stride_dy, stride_dx, N, D, rows_per_prog,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, N)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for r0 in range(row_start, row_end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)  # (ROWS, BLOCK_D)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (ROWS,)
        wdy = dy * w[None, :]
        c = tl.sum(wdy * x, 1) / D  # mean(w∘dy∘x) per row
        dx = rstd[:, None] * wdy - x * (rstd * rstd * rstd * c)[:, None]
        tl.store(
            DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask
        )
        dw += tl.sum(dy * x * rstd[:, None], 0)
    tl.store(DWP + pid.to(tl.int64) * D + cols, dw, mask=col_ok)


def _tile(d: int, backward: bool = False) -> tuple[int, int, int]:
    # (BLOCK_D, ROWS, num_warps): about 4096 values per tile, more warps for wide rows. The
    # backward holds four row-sized float32 arrays (x, dy, w, dw) per thread, so it goes to 16
    # warps from 8192 values on to keep them in registers with room for loads in flight.
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(16, 4096 // block_d))
    size = block_d * rows
    if backward:
        warps = 4 if size <= 2048 else (8 if size < 8192 else 16)
    else:
        warps = 4 if size <= 2048 else (8 if size <= 8192 else 16)
    return block_d, rows, warps


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y (N, D) in x.dtype and r (N,) float32 for x (N, D) with unit column stride."""
    if interpreting():
        ensure_interpreter_compat()
    n, d = x.shape
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    block_d, rows, warps = _tile(d)
    _rms_fwd[(triton.cdiv(n, rows),)](
        x, weight, y, rstd, x.stride(0), y.stride(0), n, d, eps,
        BLOCK_D=block_d, ROWS=rows, num_warps=warps,
    )  # fmt: skip
    return y, rstd


def backward(
    x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (N, D) in x.dtype and dw (D,) in weight.dtype."""
    if interpreting():
        ensure_interpreter_compat()
    n, d = x.shape
    block_d, rows, warps = _tile(d, backward=True)
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        programs = max(1, min(triton.cdiv(n, rows), 4 * sms))
    else:
        programs = max(1, min(triton.cdiv(n, rows), 4))
    rows_per_prog = triton.cdiv(triton.cdiv(n, programs), rows) * rows
    programs = triton.cdiv(n, rows_per_prog)
    dx = torch.empty((n, d), dtype=x.dtype, device=x.device)
    partial = torch.empty((programs, d), dtype=torch.float32, device=x.device)
    _rms_bwd[(programs,)](
        x, weight, dy, rstd, dx, partial, x.stride(0), dy.stride(0), dx.stride(0), n, d,
        rows_per_prog, BLOCK_D=block_d, ROWS=rows, num_warps=warps,
    )  # fmt: skip
    return dx, partial.sum(0).to(weight.dtype)
