"""Flash-decoding's split: partition a sequence's context, then merge the partitions' partial
softmax results. Shared by the paged decode kernels (``lmforge.serve._attention_triton``: K/V
pages; ``lmforge.kernels._mla_decode_triton``: MLA latent pages), which write per partition the
running max ``m``, the sum ``l`` and the unnormalised output ``acc`` to a workspace.

Shape legend: S sequences, H heads, P partitions, E output width (EP: padded to a power of 2).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["TARGET_PROGRAMS", "combine_kernel", "num_partitions"]

TARGET_PROGRAMS = 512  # enough (sequence, head group, partition) programs to fill an H200's SMs


def num_partitions(s: int, groups: int, width: int, nt: int) -> tuple[int, int]:
    """(partitions, blocks per partition) for S sequences, ``groups`` programs per sequence
    (kv-heads or head blocks) and block tables ``width`` blocks wide read ``nt`` blocks per
    tile: split until about TARGET_PROGRAMS programs run, never below one tile each."""
    tiles = triton.cdiv(max(width, 1), nt)
    parts = max(1, min(tiles, triton.cdiv(TARGET_PROGRAMS, s * groups)))
    part_blocks = triton.cdiv(tiles, parts) * nt
    return triton.cdiv(max(width, 1), part_blocks), part_blocks


@triton.jit
def combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    n_parts,
    stride_os,
    stride_oh,
    H: tl.constexpr,
    E: tl.constexpr,
    EP: tl.constexpr,
    PP: tl.constexpr,
):
    """One (sequence, head): out = Σ_p e^(m_p − m) acc_p / Σ_p e^(m_p − m) l_p over the
    partitions; workspaces (S, H, P) for m and l, (S, H, P, EP) for acc."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.arange(0, PP)
    e = tl.arange(0, EP)
    p_ok = p < n_parts
    base = (s * H + h) * n_parts
    m = tl.load(m_ptr + base + p, mask=p_ok, other=float("-inf"))  # (PP,)
    l_p = tl.load(l_ptr + base + p, mask=p_ok, other=0.0)
    acc = tl.load(
        acc_ptr + (base + p)[:, None] * EP + e[None, :],
        mask=p_ok[:, None] & (e < E)[None, :],  # the workspace's padding columns are unwritten
        other=0.0,
    )  # (PP, EP)
    m_max = tl.max(m, axis=0)  # finite: partition 0 always holds slot 0
    w = tl.where(p_ok, tl.exp(m - m_max), 0.0)  # (PP,) empty partitions: e^-inf = 0
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_p * w, axis=0)  # (EP,)
    tl.store(
        out_ptr + s * stride_os + h * stride_oh + e, out.to(out_ptr.dtype.element_ty), mask=e < E
    )
