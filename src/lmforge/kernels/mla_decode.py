"""Paged decode attention for absorbed multi-head latent attention (MLA, DeepSeek-V2/V3).

Cache layout (one layer): ``cache`` is (NB, BS, C + R): NB blocks of BS token slots, each slot
one token's ``[c (C = kv_lora_rank) ; k^R (R = qk_rope_head_dim)]`` row (the RMS-normalised
latent, then the RoPE'd shared key; :class:`lmforge.model.mla.PagedLatentCache` holds L of
them). Slot ``b·BS + i`` is offset i of block b; a sequence's token j lives in block
``table[j // BS]`` at offset ``j % BS`` (the engine's block tables, unchanged).

Math (per sequence s with n cached tokens and head h; q̃ is the absorbed query
``[W_UKᵀ q^C ; q^R]`` of :meth:`~lmforge.model.mla.MultiHeadLatentAttention.absorbed_query`):

    out_h = Σ_j softmax_j(scale · q̃_h · row_j) c_j      (C,)   — latent space; W_UV comes after

so the latents are the keys (with the rope part) and the values at once, and every head reads
the same rows. The Triton kernel (:mod:`lmforge.kernels._mla_decode_triton`) therefore loads
each block once for all heads of a sequence (up to 32 per program) and keeps an online softmax;
:func:`mla_decode_reference` is the torch path (gather + fp32 math) and the kernel's reference.

Shape legend: S sequences, H heads, C kv_lora_rank, R rope dims, NB blocks, BS block size,
M block-table width. Exercised by ``pytest tests/test_kernels_mla_decode.py`` (the kernel under
TRITON_INTERPRET=1) and ``benchmarks/mla.py`` on a GPU.
"""

from __future__ import annotations

import os

import torch

__all__ = ["mla_decode", "mla_decode_available", "mla_decode_reference"]


def mla_decode_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """q (S, H, C+R), cache (NB, BS, C+R), block_tables (S, M) int, ctx_lens (S,) -> (S, H, C).

    Gathers every sequence's M blocks (padding entries may hold any valid block id; slots at or
    past ``ctx_lens`` are masked) and computes in fp32 (float64 for float64 inputs, which makes
    it the float64 reference the kernel is tested against). Output in q's dtype.
    """
    s = q.shape[0]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = cache[block_tables.long()].reshape(s, -1, cache.shape[-1]).to(work)  # (S, M·BS, C+R)
    valid = torch.arange(rows.shape[1], device=q.device)[None, :] < ctx_lens[:, None].long()
    scores = torch.einsum("shl,sjl->shj", q.to(work), rows) * scale  # (S, H, M·BS)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)  # (S, H, M·BS)
    out = torch.einsum("shj,sjc->shc", probs, rows[..., :kv_lora_rank])  # (S, H, C)
    return out.to(q.dtype)


def mla_decode_available(device: torch.device) -> bool:
    """Whether the Triton kernel can run here (CUDA + triton, or TRITON_INTERPRET=1 + triton)."""
    from lmforge.kernels._common import interpreting, triton_available

    return triton_available() and (device.type == "cuda" or interpreting())


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    scale: float,
    use_triton: bool | None = None,
    n_parts: int | None = None,
) -> torch.Tensor:
    """Absorbed-MLA decode over a paged latent cache (one query per sequence): q (S, H, C+R),
    cache (NB, BS, C+R), block_tables (S, M) int32, ctx_lens (S,) int32 -> (S, H, C).

    ``use_triton`` None: the Triton kernel on CUDA (with triton installed), else torch. Every
    sequence needs ctx_lens >= 1. ``n_parts`` forces the kernel's partition count (tests).
    """
    if use_triton is None:
        use_triton = q.is_cuda and mla_decode_available(q.device)
    if not use_triton:
        return mla_decode_reference(q, cache, block_tables, ctx_lens, kv_lora_rank, scale)
    if q.shape[-1] != cache.shape[-1] or not 0 < kv_lora_rank < cache.shape[-1]:
        raise ValueError(
            f"mla_decode: q width {q.shape[-1]} and cache width {cache.shape[-1]} must be"
            f" C + R with 0 < C = {kv_lora_rank} < C + R"
        )
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not q.is_cuda:
        raise ValueError("mla_decode: the Triton path needs CUDA tensors (or TRITON_INTERPRET=1)")
    from lmforge.kernels._mla_decode_triton import mla_decode_triton

    return mla_decode_triton(
        q,
        cache,
        block_tables.to(torch.int32),
        ctx_lens.to(torch.int32),
        kv_lora_rank,
        scale,
        n_parts=n_parts,
    )
