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
are no longer contiguous in processing order. Without act order a group's parameters are
chosen when its first column is reached, from the already-updated weights.

Exercised by ``pytest tests/test_quant_calib.py``.
"""

from __future__ import annotations

import torch

from lmforge.quant.formats import (
    Int4Linear,
    Int8Linear,
    QuantLinear,
    int4_params,
)

__all__ = ["GroupQuantizer", "gptq_quantize", "gptq_reference"]


class GroupQuantizer:
    """Round-to-nearest of one column under the current group's parameters (int4 or int8).

    ``params(w_group)`` computes fp16 parameters for the (N, G) columns of a group;
    ``quantize(w_col, g)`` returns the codes and the dequantized column under group g's params.
    """

    def __init__(self, bits: int, group_size: int, n_groups: int, symmetric: bool) -> None:
        self.bits = bits
        self.group_size = group_size
        self.symmetric = symmetric or bits == 8
        self.scales: list[torch.Tensor | None] = [None] * n_groups
        self.offsets: list[torch.Tensor | None] = [None] * n_groups

    def params(self, g: int, w: torch.Tensor) -> None:
        """Set group g's parameters from its weights w (N, G)."""
        if self.bits == 8:
            self.scales[g] = (w.float().abs().amax(-1) / 127.0).clamp_min(1e-8).half()  # (N,)
            return
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
    w: torch.Tensor, bits: int, group_size: int, symmetric: bool, static: bool
) -> GroupQuantizer:
    k = w.shape[1]
    quant = GroupQuantizer(bits, group_size, k // group_size, symmetric)
    if static:
        for g in range(k // group_size):
            quant.params(g, w[:, g * group_size : (g + 1) * group_size])
    return quant


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
) -> QuantLinear:
    """The GPTQ-quantized module for ``weight`` (N, K) given ``hessian`` (K, K) = 2 X Xᵀ / n."""
    k = weight.shape[1]
    w, h = _prepare(weight, hessian, damp, dtype)
    perm = _order(h, act_order)
    static = act_order or group_size == k  # a per-channel "group" is known from the start
    quant = _quantizer(w, bits, group_size, symmetric, static)
    if not static:  # each group inside one block, so its parameters see every update
        block_size = group_size * -(-block_size // group_size)
    w, h = w[:, perm], h[perm][:, perm]
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
                quant.params(g, w1[:, j : j + group_size])
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
) -> QuantLinear:
    """The slow, literal algorithm in float64: quantize column by column, update every remaining
    column with the full OBS rule, eliminate the column from the explicit inverse Hessian."""
    k = weight.shape[1]
    w, h = _prepare(weight, hessian, damp, torch.float64)
    perm = _order(h, act_order)
    static = act_order or group_size == k
    quant = _quantizer(w, bits, group_size, symmetric, static)
    hinv = torch.linalg.inv(h)  # (K, K), original column order
    codes = torch.zeros_like(w)
    remaining = torch.ones(k, dtype=torch.bool)
    for idx in perm.tolist():
        g = idx // group_size
        if not static and idx % group_size == 0:
            quant.params(g, w[:, idx : idx + group_size])
        q, dq = quant.quantize(w[:, idx], g)
        codes[:, idx] = q
        remaining[idx] = False
        e = (w[:, idx] - dq) / hinv[idx, idx]  # (N,)
        w[:, remaining] -= e[:, None] * hinv[idx, remaining][None, :]
        w[:, idx] = dq
        # remove idx from the problem: H⁻¹ of the remaining columns
        hinv = hinv - torch.outer(hinv[:, idx], hinv[idx, :]) / hinv[idx, idx]
    return quant.module(codes.to(weight.device))
