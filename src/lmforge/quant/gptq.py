"""GPTQ (Frantar et al. 2022): quantize a linear's columns one at a time, each time spreading the
rounding error over the columns not yet quantized, weighted by the inverse Hessian of the layer's
squared output error.

For a linear with inputs X (K, n) the layer-wise loss ``‖W X − Q X‖²`` has Hessian
``H = 2 X Xᵀ`` (K, K). Quantizing column i to q_i with error e_i = (w_i − q_i) / [H⁻¹]_ii and
updating the remaining columns by ``W[:, j] −= e_i · [H⁻¹]_ij`` (optimal brain surgeon), then
dropping column i from H⁻¹ (one step of Gaussian elimination), is the exact algorithm:
:func:`gptq_reference` does precisely that. The fast :func:`gptq_quantize` uses the paper's
three tricks, with identical results up to float rounding: the rows of the upper Cholesky factor
of H⁻¹ are those eliminated inverses (no per-column downdate), updates inside a block of
``block_size`` (128) columns are applied eagerly while the rest of W receives one matrix
product per block (lazy batch updates), and H gets ``damp · mean(diag H)`` added to its
diagonal. ``act_order`` processes columns by decreasing ``diag H`` (the most active inputs
first, while many columns remain to absorb their error); with groups it uses static groups
(each group's scale and offset from the weights before any update), since a group's columns
are no longer contiguous in processing order. Without act order a group's parameters are chosen
when its first column is reached, from the already-updated weights.

The group parameters are min/max by default in the paper; ``clip_grid`` > 0 searches shrunken
ranges instead (GPTQ's ``mse`` option, :func:`~lmforge.quant.formats.int4_params_search`), and
``clip_weighted`` weights that search's error by ``diag H`` — the layer-output error each
column's rounding causes before GPTQ's compensation. On SmolLM2-135M int4 g64 the weighted
search took GPTQ from +6.3% to about +3% bits/byte over bf16 (``benchmarks/RESULTS.md``).
``fp8`` quantizes onto the e4m3 grid with per-channel (or per-tensor) fp32 scales instead
(:class:`Fp8Quantizer`; the same error feedback, the scale from :func:`~lmforge.quant.formats.
fp8_scales`, searched the same way).

Exercised by ``pytest tests/test_quant_calib.py``.
"""

from __future__ import annotations

import torch

from lmforge.quant.formats import (
    FP8_MAX,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    QuantLinear,
    fp8_scales,
    int4_params,
    int4_params_search,
)

__all__ = ["Fp8Quantizer", "GroupQuantizer", "gptq_quantize", "gptq_reference"]


class GroupQuantizer:
    """Round-to-nearest of one column under the current group's parameters (int4 or int8).

    ``params(w_group)`` computes fp16 parameters for the (N, G) columns of a group;
    ``quantize(w_col, g)`` returns the codes and the dequantized column under group g's params.
    """

    def __init__(
        self,
        bits: int,
        group_size: int,
        n_groups: int,
        symmetric: bool,
        clip_grid: int = 0,
    ) -> None:
        self.bits = bits
        self.group_size = group_size
        self.symmetric = symmetric or bits == 8
        self.clip_grid = clip_grid
        self.scales: list[torch.Tensor | None] = [None] * n_groups
        self.offsets: list[torch.Tensor | None] = [None] * n_groups

    def params(self, g: int, w: torch.Tensor, c: torch.Tensor | None = None) -> None:
        """Set group g's parameters from its weights w (N, G) (c (G,): the clip search's
        column weights, in w's column order)."""
        if self.bits == 8:
            self.scales[g] = (w.float().abs().amax(-1) / 127.0).clamp_min(1e-8).half()  # (N,)
            return
        if self.clip_grid:
            s, m = int4_params_search(
                w.float(), w.shape[1], self.symmetric, self.clip_grid, col_weight=c
            )
        else:
            s, m = int4_params(w.float(), w.shape[1], self.symmetric)  # (N, 1)
        self.scales[g] = s[:, 0]
        self.offsets[g] = None if m is None else m[:, 0]

    def quantize(self, w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (N,) and the dequantized column (N,) in w's dtype."""
        s = self.scales[g].to(w.dtype)  # type: ignore[union-attr]
        if self.bits == 8:
            q = torch.round(w / s).clamp(-127, 127)
            return q, q * s
        if self.symmetric:
            q = (torch.round(w / s) + 8).clamp(0, 15)
            return q, (q - 8) * s
        m = self.offsets[g].to(w.dtype)  # type: ignore[union-attr]
        q = torch.round((w - m) / s).clamp(0, 15)
        return q, q * s + m

    def module(self, codes: torch.Tensor) -> QuantLinear:
        """The quantized module for codes (N, K) in original column order."""
        scales = torch.stack(self.scales, 1)  # type: ignore[arg-type]  # (N, K/G)
        if self.bits == 8:
            m = Int8Linear(codes.shape[1], codes.shape[0], self.group_size)
            m.qweight = codes.to(torch.int8)
            m.scales = scales
            return m
        offsets = None if self.symmetric else torch.stack(self.offsets, 1)  # type: ignore[arg-type]
        return Int4Linear.from_codes(codes.to(torch.uint8), scales, offsets, self.group_size)


class Fp8Quantizer:
    """Round-to-nearest e4m3 of one column under per-channel (or per-tensor) fp32 scales fixed
    from the weights before any update (:func:`~lmforge.quant.formats.fp8_scales`)."""

    def __init__(
        self,
        w: torch.Tensor,
        per_channel: bool,
        activations: str,
        scale_grid: int = 0,
        col_weight: torch.Tensor | None = None,
    ) -> None:
        self.per_channel = per_channel
        self.activations = activations
        self.scales = fp8_scales(w, per_channel, scale_grid, col_weight)  # (N,) | (1,)

    def params(self, g: int, w: torch.Tensor, c: torch.Tensor | None = None) -> None:
        """Nothing to do: the scales are set at construction."""

    def quantize(self, w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """e4m3 codes (N,) held in w's dtype and the dequantized column (N,)."""
        s = self.scales.to(w.dtype)
        q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(w.dtype)
        return q, q * s

    def module(self, codes: torch.Tensor) -> QuantLinear:
        """The :class:`Fp8Linear` for codes (N, K) in original column order."""
        m = Fp8Linear(codes.shape[1], codes.shape[0], self.per_channel, self.activations)
        m.qweight = codes.float().to(torch.float8_e4m3fn)
        m.scales = self.scales.float().to(codes.device)
        return m


def _prepare(
    weight: torch.Tensor, hessian: torch.Tensor, damp: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.detach().to(dtype).clone()
    h = hessian.detach().to(dtype).clone()
    dead = torch.diag(h) == 0  # inputs never active: weight irrelevant, keep H invertible
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=dtype, device=h.device)
    return w, h


def _order(hessian: torch.Tensor, act_order: bool) -> torch.Tensor:
    k = hessian.shape[0]
    if not act_order:
        return torch.arange(k, device=hessian.device)
    return torch.argsort(torch.diag(hessian), descending=True, stable=True)


def _quantizer(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    static: bool,
    clip_grid: int = 0,
    col_weight: torch.Tensor | None = None,
    fp8: str | None = None,
    fp8_per_channel: bool = True,
) -> GroupQuantizer | Fp8Quantizer:
    if fp8 is not None:
        return Fp8Quantizer(w, fp8_per_channel, fp8, clip_grid, col_weight)
    k = w.shape[1]
    quant = GroupQuantizer(bits, group_size, k // group_size, symmetric, clip_grid)
    if static:
        for g in range(k // group_size):
            cols = slice(g * group_size, (g + 1) * group_size)
            quant.params(g, w[:, cols], None if col_weight is None else col_weight[cols])
    return quant


def _setup(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    damp: float,
    act_order: bool,
    clip_grid: int,
    clip_weighted: bool,
    fp8: str | None,
    fp8_per_channel: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, GroupQuantizer | Fp8Quantizer, int, bool]:
    """Damped (w, h), processing order, quantizer, effective group size, static flag."""
    k = weight.shape[1]
    w, h = _prepare(weight, hessian, damp, dtype)
    if fp8 is not None:
        group_size = k  # one scale per channel (or tensor), known from the start
    static = group_size == k or act_order  # act order: static groups, known from the start
    perm = _order(h, act_order)
    cw = torch.diag(h) if clip_weighted else None
    quant = _quantizer(w, bits, group_size, symmetric, static, clip_grid, cw, fp8, fp8_per_channel)
    return w, h, perm, quant, group_size, static


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = False,
    damp: float = 0.01,
    act_order: bool = True,
    block_size: int = 128,
    dtype: torch.dtype = torch.float32,
    clip_grid: int = 0,
    clip_weighted: bool = False,
    fp8: str | None = None,
    fp8_per_channel: bool = True,
) -> QuantLinear:
    """The GPTQ-quantized module for ``weight`` (N, K) given ``hessian`` (K, K) = 2 X Xᵀ / n.

    ``act_order``: columns by decreasing diag H, every group's parameters from the weights before
    any update (static groups). ``clip_grid`` > 0: the group parameters (fp8: the scales) come
    from a range search (:func:`~lmforge.quant.formats.int4_params_search`,
    :func:`~lmforge.quant.formats.fp8_scales`), its error weighted by diag H if ``clip_weighted``. ``fp8`` = "none" or
    "dynamic": e4m3 codes (:class:`Fp8Linear` with those activations) instead of an int grid.
    """
    k = weight.shape[1]
    w, h, perm, quant, group_size, static = _setup(
        weight, hessian, bits, group_size, symmetric, damp, act_order,
        clip_grid, clip_weighted, fp8, fp8_per_channel, dtype,
    )  # fmt: skip
    if not static:  # each group inside one block, so its parameters see every update
        block_size = group_size * -(-block_size // group_size)
    w, h = w[:, perm], h[perm][:, perm]
    cw = torch.diag(h) if clip_weighted else None  # processing order
    # upper Cholesky factor of H⁻¹: row i holds the inverse Hessian with columns < i eliminated
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros_like(w)
    group_of = perm // group_size  # (K,): group of each processed column (original index)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()  # (N, B)
        err1 = torch.zeros_like(w1)
        h1 = hinv[i1:i2, i1:i2]  # (B, B)
        for j in range(i2 - i1):
            col = i1 + j
            g = int(group_of[col])
            if not static and col % group_size == 0:
                # the group's columns, already updated by everything before them
                c = None if cw is None else cw[col : col + group_size]
                quant.params(g, w1[:, j : j + group_size], c)
            q, dq = quant.quantize(w1[:, j], g)
            codes[:, col] = q
            e = (w1[:, j] - dq) / h1[j, j]  # (N,)
            w1[:, j:] -= e[:, None] * h1[j, j:][None, :]
            err1[:, j] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]  # lazy update of the columns after the block
    inv = torch.argsort(perm)
    return quant.module(codes[:, inv].to(weight.device))


@torch.no_grad()
def gptq_reference(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = False,
    damp: float = 0.01,
    act_order: bool = True,
    clip_grid: int = 0,
    clip_weighted: bool = False,
    fp8: str | None = None,
    fp8_per_channel: bool = True,
) -> QuantLinear:
    """The slow, literal algorithm in float64: quantize column by column, update every remaining
    column with the full OBS rule, eliminate the column from the explicit inverse Hessian."""
    k = weight.shape[1]
    w, h, perm, quant, group_size, static = _setup(
        weight, hessian, bits, group_size, symmetric, damp, act_order,
        clip_grid, clip_weighted, fp8, fp8_per_channel, torch.float64,
    )  # fmt: skip
    cw = torch.diag(h) if clip_weighted else None
    hinv = torch.linalg.inv(h)  # (K, K), original column order
    codes = torch.zeros_like(w)
    remaining = torch.ones(k, dtype=torch.bool)
    for idx in perm.tolist():
        g = idx // group_size
        if not static and idx % group_size == 0:  # input order: the group's first column
            cols = slice(g * group_size, (g + 1) * group_size)
            quant.params(g, w[:, cols], None if cw is None else cw[cols])
        q, dq = quant.quantize(w[:, idx], g)
        codes[:, idx] = q
        remaining[idx] = False
        e = (w[:, idx] - dq) / hinv[idx, idx]  # (N,)
        w[:, remaining] -= e[:, None] * hinv[idx, remaining][None, :]
        w[:, idx] = dq
        # remove idx from the problem: H⁻¹ of the remaining columns
        hinv = hinv - torch.outer(hinv[:, idx], hinv[idx, :]) / hinv[idx, idx]
    return quant.module(codes.to(weight.device))
