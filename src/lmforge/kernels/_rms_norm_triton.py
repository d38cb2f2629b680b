"""Triton kernels of the fused RMSNorm (math and public op in ``rms_norm.py``).

RMSNorm is memory-bound (one read of x and one write of y forward; reads of x, dy and a write
of dx backward), so every variant below exists to keep more bytes in flight per SM; which one
wins depends on D and the GPU, hence launch configs chosen per row width from one table.

Forward, two kernels:
  * ``_rms_fwd`` ("tile"): one program normalises one (ROWS, BLOCK_D) register tile and stores
    r = 1/rms per row. Latency is hidden only by other resident programs.
  * ``_rms_fwd_loop`` ("loop"): persistent — a fixed number of programs (k per SM) stride over
    the row tiles, loading w once. With PREFETCH the next tile's loads are issued into registers
    before the current tile is reduced and stored (manual double buffering); with STAGES > 1
    Triton's software pipeliner (``tl.range(num_stages=...)``) stages the next tiles through
    shared memory with cp.async instead.
Backward, two kernels writing dx and one float32 partial dw per program:
  * ``_rms_bwd`` ("slab"): each program walks a contiguous slab of rows, ROWS at a time.
  * ``_rms_bwd_loop`` ("loop"): persistent grid-stride over row tiles with the same PREFETCH /
    STAGES options as the forward, and dw accumulated as a (ROWS, BLOCK_D) tile reduced once at
    the end (no cross-warp reduction inside the loop).
The (programs, D) partials are summed in a fixed order — by torch (``partial.sum(0)``) or by the
column-parallel ``_dw_sum`` kernel, which also casts to the weight dtype in the same launch — so
dw is deterministic; there are no atomics.

Launch configs: :class:`FwdConfig` / :class:`BwdConfig`; the defaults per BLOCK_D live in
``FWD_CONFIGS`` / ``BWD_CONFIGS`` below (the one place to paste what
``benchmarks/rmsnorm_sweep.py`` prints); widths not listed fall back to :func:`_tile`.
Exercise: ``pytest tests/test_kernels_rmsnorm_variants.py`` (CPU interpreter).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting

_STREAM = "evict_first"  # L2 policy for x, dy, y, dx when a config sets evict=True


# ------------------------------------------------------------------------------- jit helpers


@triton.jit
def _load_rows(P, stride, rows, cols, mask, POLICY: tl.constexpr):
    # (ROWS, BLOCK_D) tile of a row-major matrix; int64 row offsets (N·D may exceed 2³¹).
    offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    return tl.load(P + offs, mask=mask, other=0.0, eviction_policy=POLICY)


@triton.jit
def _fwd_rows(x, w, Y, RSTD, stride_y, rows, cols, mask, row_ok, D, eps, POLICY: tl.constexpr):
    x = x.to(tl.float32)  # (ROWS, BLOCK_D)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)  # (ROWS,)
    y = x * rstd[:, None] * w[None, :]
    offs = rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask, eviction_policy=POLICY)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _bwd_rows(x, dy, rstd, w, DX, stride_dx, rows, cols, mask, D, POLICY: tl.constexpr):
    # dx = r·(w∘dy − x̂·mean(w∘dy∘x̂)) with x̂ = x·r; returns dy∘x̂, this tile's share of dw.
    xhat = x.to(tl.float32) * rstd[:, None]  # (ROWS, BLOCK_D)
    dy = dy.to(tl.float32)
    wdy = dy * w[None, :]
    c = tl.sum(wdy * xhat, 1) / D  # (ROWS,)
    dx = (wdy - xhat * c[:, None]) * rstd[:, None]
    offs = rows.to(tl.int64)[:, None] * stride_dx + cols[None, :]
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask, eviction_policy=POLICY)
    return dy * xhat


# ----------------------------------------------------------------------------------- forward


# D stays specialised (Triton's divisible-by-16 hint): with it the column mask `cols < D` is
# constant over 16-column groups and loads/stores vectorise to 16-byte accesses; unspecialised,
# every bf16 element is its own predicated 2-byte access (the ~25% of copy bandwidth measured). The hint is
# part of the cache key (D % 16 == 0 or not), not D itself, so widths do not recompile.
@triton.jit(do_not_specialize=["N"])
def _rms_fwd(
    X, W, Y, RSTD, stride_x, stride_y, N, D, eps,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    # w first: its (L2) load overlaps x's instead of waiting behind the row reduction's barrier.
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    mask = row_ok[:, None] & col_ok[None, :]
    x = _load_rows(X, stride_x, rows, cols, mask, "")
    _fwd_rows(x, w, Y, RSTD, stride_y, rows, cols, mask, row_ok, D, eps, "")


@triton.jit(do_not_specialize=["N"])
def _rms_fwd_loop(
    X, W, Y, RSTD, stride_x, stride_y, N, D, eps,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
    POLICY: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    base = tl.arange(0, ROWS)
    tiles = tl.cdiv(N, ROWS)
    if PREFETCH:
        rows = pid * ROWS + base
        x_next = _load_rows(X, stride_x, rows, cols, (rows < N)[:, None] & col_ok[None, :], POLICY)
        for t in range(pid, tiles, step):
            rows = t * ROWS + base
            row_ok = rows < N
            mask = row_ok[:, None] & col_ok[None, :]
            x = x_next
            # Issued before this tile's reduction: in flight while it is reduced and stored.
            # Past the last tile every row is masked off, so no memory is touched.
            nxt = rows + step * ROWS
            nmask = (nxt < N)[:, None] & col_ok[None, :]
            x_next = _load_rows(X, stride_x, nxt, cols, nmask, POLICY)
            _fwd_rows(x, w, Y, RSTD, stride_y, rows, cols, mask, row_ok, D, eps, POLICY)
    else:
        for t in tl.range(pid, tiles, step, num_stages=STAGES):
            rows = t * ROWS + base
            row_ok = rows < N
            mask = row_ok[:, None] & col_ok[None, :]
            x = _load_rows(X, stride_x, rows, cols, mask, POLICY)
            _fwd_rows(x, w, Y, RSTD, stride_y, rows, cols, mask, row_ok, D, eps, POLICY)


# ---------------------------------------------------------------------------------- backward


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
        x = _load_rows(X, stride_x, rows, cols, mask, "")
        dy = _load_rows(DY, stride_dy, rows, cols, mask, "")
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)  # (ROWS,)
        dw += tl.sum(_bwd_rows(x, dy, rstd, w, DX, stride_dx, rows, cols, mask, D, ""), 0)
    tl.store(DWP + pid.to(tl.int64) * D + cols, dw, mask=col_ok)


@triton.jit(do_not_specialize=["N"])
def _rms_bwd_loop(
    X, W, DY, RSTD, DX, DWP, stride_x, stride_dy, stride_dx, N, D,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
    POLICY: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
    base = tl.arange(0, ROWS)
    tiles = tl.cdiv(N, ROWS)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)  # dw partial, reduced over rows at the end
    if PREFETCH:
        rows = pid * ROWS + base
        row_ok = rows < N
        mask = row_ok[:, None] & col_ok[None, :]
        x_next = _load_rows(X, stride_x, rows, cols, mask, POLICY)
        dy_next = _load_rows(DY, stride_dy, rows, cols, mask, POLICY)
        r_next = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        for t in range(pid, tiles, step):
            rows = t * ROWS + base
            mask = (rows < N)[:, None] & col_ok[None, :]
            x = x_next
            dy = dy_next
            rstd = r_next
            nxt = rows + step * ROWS  # masked off entirely past the last tile
            nxt_ok = nxt < N
            nmask = nxt_ok[:, None] & col_ok[None, :]
            x_next = _load_rows(X, stride_x, nxt, cols, nmask, POLICY)
            dy_next = _load_rows(DY, stride_dy, nxt, cols, nmask, POLICY)
            r_next = tl.load(RSTD + nxt, mask=nxt_ok, other=0.0)
            acc += _bwd_rows(x, dy, rstd, w, DX, stride_dx, rows, cols, mask, D, POLICY)
    else:
        for t in tl.range(pid, tiles, step, num_stages=STAGES):
            rows = t * ROWS + base
            row_ok = rows < N
            mask = row_ok[:, None] & col_ok[None, :]
            x = _load_rows(X, stride_x, rows, cols, mask, POLICY)
            dy = _load_rows(DY, stride_dy, rows, cols, mask, POLICY)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            acc += _bwd_rows(x, dy, rstd, w, DX, stride_dx, rows, cols, mask, D, POLICY)
    tl.store(DWP + pid.to(tl.int64) * D + cols, tl.sum(acc, 0), mask=col_ok)


@triton.jit
def _dw_sum(DWP, DW, P, D, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # dw[c] = Σ_p partial[p, c] for one block of columns, always in the same order
    # (deterministic), cast to the weight dtype in the same pass.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < D
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & col_ok[None, :]
        acc += tl.load(DWP + p.to(tl.int64)[:, None] * D + cols[None, :], mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(acc, 0).to(DW.dtype.element_ty), mask=col_ok)


# ------------------------------------------------------------------------------ launch configs


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """How the forward is launched (a value object; see :meth:`validate`).

    ``programs_per_sm == 0`` runs the tile kernel (one program per ROWS rows); ``k > 0`` runs
    the persistent loop kernel with k programs per SM, which alone takes ``prefetch``,
    ``stages`` and ``evict``.
    """

    rows: int  # ROWS: rows per tile (power of two)
    warps: int  # num_warps
    programs_per_sm: int = 0  # 0: tile kernel; k > 0: persistent, k·SMs programs
    prefetch: bool = False  # loop: load the next tile into registers before reducing this one
    stages: int = 1  # loop without prefetch: tl.range software-pipelining depth (1 = off)
    evict: bool = False  # loop: stream x and y with evict_first (L2 keeps w)

    def validate(self) -> FwdConfig:
        """Raise ValueError on a combination the kernels do not implement; return self."""
        _check_common(self.rows, self.warps, self.programs_per_sm, self.stages)
        if self.programs_per_sm == 0 and (self.prefetch or self.stages != 1 or self.evict):
            raise ValueError(f"{self}: prefetch/stages/evict need programs_per_sm > 0")
        if self.prefetch and self.stages != 1:
            raise ValueError(f"{self}: prefetch and stages > 1 are alternatives")
        return self


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """How the backward is launched (a value object; see :meth:`validate`).

    ``loop=False`` runs the slab kernel (programs own contiguous row slabs); ``loop=True`` the
    grid-stride loop kernel, which alone takes ``prefetch``, ``stages`` and ``evict``. Either
    way there are ``programs_per_sm``·SMs programs (fewer when N is small) and as many float32
    dw partials, summed by ``dw_reduce``: "torch" (sum then cast) or "triton" (``_dw_sum``).
    """

    rows: int  # ROWS: rows per iteration (power of two)
    warps: int  # num_warps
    programs_per_sm: int = 4
    loop: bool = False  # False: _rms_bwd (slabs); True: _rms_bwd_loop (grid-stride)
    prefetch: bool = False  # loop: load the next x, dy, r before this tile's math
    stages: int = 1  # loop without prefetch: tl.range software-pipelining depth (1 = off)
    evict: bool = False  # loop: stream x, dy, dx with evict_first
    dw_reduce: str = "torch"  # "torch" | "triton"

    def validate(self) -> BwdConfig:
        """Raise ValueError on a combination the kernels do not implement; return self."""
        _check_common(self.rows, self.warps, self.programs_per_sm, self.stages)
        if self.programs_per_sm < 1:
            raise ValueError(f"{self}: the backward needs programs_per_sm >= 1")
        if not self.loop and (self.prefetch or self.stages != 1 or self.evict):
            raise ValueError(f"{self}: prefetch/stages/evict need loop=True")
        if self.prefetch and self.stages != 1:
            raise ValueError(f"{self}: prefetch and stages > 1 are alternatives")
        if self.dw_reduce not in ("torch", "triton"):
            raise ValueError(f"{self}: dw_reduce must be 'torch' or 'triton'")
        return self


def _check_common(rows: int, warps: int, programs_per_sm: int, stages: int) -> None:
    for name, v in (("rows", rows), ("warps", warps)):
        if v < 1 or v & (v - 1) or v > (16 if name == "warps" else 1024):
            raise ValueError(f"{name}={v}: expected a power of two (warps ≤ 16, rows ≤ 1024)")
    if programs_per_sm < 0 or stages < 1:
        raise ValueError(f"programs_per_sm={programs_per_sm}, stages={stages}: out of range")


def config_repr(cfg: FwdConfig | BwdConfig) -> str:
    """``FwdConfig(rows=2, warps=8)``: the constructor call with non-default fields only (what
    the sweep prints for pasting into the tables below)."""
    parts = [
        f"{f.name}={getattr(cfg, f.name)!r}"
        for f in dataclasses.fields(cfg)
        if f.default is dataclasses.MISSING or getattr(cfg, f.name) != f.default
    ]
    return f"{type(cfg).__name__}({', '.join(parts)})"


def _tile(d: int, backward: bool = False) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps) for widths without a table entry: ~4096 values per tile.

    More warps for wide rows; the backward holds four row-sized float32 arrays (x, dy, w, dw)
    per thread, so it goes to 16 warps from 8192 values on to keep them in registers.
    """
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(16, 4096 // block_d))
    size = block_d * rows
    if backward:
        warps = 4 if size <= 2048 else (8 if size < 8192 else 16)
    else:
        warps = 4 if size <= 2048 else (8 if size <= 8192 else 16)
    return block_d, rows, warps


# Default launch per BLOCK_D (= next power of two ≥ D; D=768 → 1024). THE place to apply the
# winners of ``benchmarks/rmsnorm_sweep.py``: it prints both dicts ready to paste over these.
# Widths missing here use _tile's heuristic (tile forward, slab backward, 4 programs per SM).
FWD_CONFIGS: dict[int, FwdConfig] = {
    # Winners of benchmarks/rmsnorm_sweep.py on an H200 (2026-11-29, bf16; GB/s of GPU time).
    1024: FwdConfig(rows=8, warps=4),  # 32768×768: 3610 GB/s
    2048: FwdConfig(rows=2, warps=8),  # 32768×2048: 3917 GB/s
    4096: FwdConfig(rows=4, warps=8),  # 32768×4096: 4047 GB/s
    8192: FwdConfig(rows=2, warps=8),  # 16384×8192: 4061 GB/s
}
BWD_CONFIGS: dict[int, BwdConfig] = {
    # 32768×768: f+b 3179 GB/s (bwd 2922); 32768×2048: 3867 (3774); 32768×4096: 4012 (3973);
    # 16384×8192: 4014 (3973).
    1024: BwdConfig(
        rows=4, warps=8, programs_per_sm=2, loop=True, prefetch=True, dw_reduce="triton"
    ),
    2048: BwdConfig(
        rows=2, warps=8, programs_per_sm=2, loop=True, prefetch=True, dw_reduce="triton"
    ),
    4096: BwdConfig(
        rows=1, warps=8, programs_per_sm=2, loop=True, prefetch=True, dw_reduce="triton"
    ),
    8192: BwdConfig(rows=1, warps=8, programs_per_sm=1, loop=True, stages=3),
}


def default_config(d: int, backward: bool = False) -> FwdConfig | BwdConfig:
    """The launch config used for rows of width ``d`` when the caller passes none."""
    block_d, rows, warps = _tile(d, backward)
    if backward:
        return BWD_CONFIGS.get(block_d) or BwdConfig(rows=rows, warps=warps)
    return FWD_CONFIGS.get(block_d) or FwdConfig(rows=rows, warps=warps)


@functools.cache
def _sm_count(device: torch.device) -> int:
    # Under the interpreter (CPU tensors) one "SM": programs_per_sm programs, so tests still
    # exercise several programs striding over the rows.
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


# ------------------------------------------------------------------------------------- entry


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    config: FwdConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y (N, D) in ``out_dtype`` (default x.dtype) and r (N,) float32 for x (N, D) with unit
    column stride.

    ``config`` overrides the default launch for this width (benchmarks and tests only).
    """
    if interpreting():
        ensure_interpreter_compat()
    n, d = x.shape
    y = torch.empty((n, d), dtype=out_dtype or x.dtype, device=x.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return y, rstd
    cfg = default_config(d) if config is None else config.validate()
    block_d = triton.next_power_of_2(d)
    args = (x, weight, y, rstd, x.stride(0), y.stride(0), n, d, eps)
    tiles = triton.cdiv(n, cfg.rows)
    if cfg.programs_per_sm == 0:
        _rms_fwd[(tiles,)](*args, BLOCK_D=block_d, ROWS=cfg.rows, num_warps=cfg.warps)
        return y, rstd
    programs = min(tiles, cfg.programs_per_sm * _sm_count(x.device))
    _rms_fwd_loop[(programs,)](
        *args, BLOCK_D=block_d, ROWS=cfg.rows, PREFETCH=cfg.prefetch, STAGES=cfg.stages,
        POLICY=_STREAM if cfg.evict else "", num_warps=cfg.warps,
    )  # fmt: skip
    return y, rstd


def backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dy: torch.Tensor,
    *,
    config: BwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (N, D) in x.dtype and dw (D,) in weight.dtype; dw is deterministic (no atomics).

    ``config`` overrides the default launch for this width (benchmarks and tests only).
    """
    if interpreting():
        ensure_interpreter_compat()
    n, d = x.shape
    dx = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n == 0:
        return dx, torch.zeros_like(weight)
    cfg = default_config(d, backward=True) if config is None else config.validate()
    block_d = triton.next_power_of_2(d)
    programs = max(1, min(triton.cdiv(n, cfg.rows), cfg.programs_per_sm * _sm_count(x.device)))
    args = (x, weight, dy, rstd, dx)
    strides = (x.stride(0), dy.stride(0), dx.stride(0), n, d)
    if cfg.loop:
        partial = torch.empty((programs, d), dtype=torch.float32, device=x.device)
        _rms_bwd_loop[(programs,)](
            *args, partial, *strides, BLOCK_D=block_d, ROWS=cfg.rows, PREFETCH=cfg.prefetch,
            STAGES=cfg.stages, POLICY=_STREAM if cfg.evict else "", num_warps=cfg.warps,
        )  # fmt: skip
    else:
        # Whole tiles per slab, then only as many programs as slabs (the last may be short).
        rows_per_prog = triton.cdiv(triton.cdiv(n, programs), cfg.rows) * cfg.rows
        programs = triton.cdiv(n, rows_per_prog)
        partial = torch.empty((programs, d), dtype=torch.float32, device=x.device)
        _rms_bwd[(programs,)](
            *args, partial, *strides, rows_per_prog, BLOCK_D=block_d, ROWS=cfg.rows,
            num_warps=cfg.warps,
        )  # fmt: skip
    if cfg.dw_reduce == "torch":
        return dx, partial.sum(0).to(weight.dtype)
    return dx, _reduce_partials(partial, weight.dtype, _sm_count(x.device))


def _reduce_partials(partial: torch.Tensor, dtype: torch.dtype, sms: int) -> torch.Tensor:
    # Column blocks narrow enough for about one program per SM (16–128 columns), each summing
    # all P partial rows in BLOCK_P-row steps.
    p, d = partial.shape
    block_c = max(16, min(128, triton.next_power_of_2(triton.cdiv(d, sms))))
    block_p = max(16, min(128, 4096 // block_c))
    dw = torch.empty(d, dtype=dtype, device=partial.device)
    _dw_sum[(triton.cdiv(d, block_c),)](partial, dw, p, d, BLOCK_P=block_p, BLOCK_C=block_c,
                                        num_warps=4)  # fmt: skip
    return dw
