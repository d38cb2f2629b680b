"""The Triton varlen paged prefill kernel (see :mod:`lmforge.serve.attention` for the math).

One launch covers a whole step: the packed queries q (N, H, E) of S sequences, sequence i owning
rows ``cu_q[i] .. cu_q[i+1]`` (its chunk of T_i = q_lens[i] queries) and ``ctx_lens[i]`` cached
tokens (this chunk's included, already written to the pages). Keys and values are read straight
from the paged caches (NB, BS, K, E) through the block tables (S, M): no gather, no per-sequence
launch.

Grid: (head, query tile), heads fastest, so the H programs of a tile start together: the G heads
of a kv-head read its pages while they are in L2, and the K kv-heads' slices of a page (adjacent
in memory) are read at the same time. The host lists the step's tiles once
(:func:`prefill_plan`): tile t is rows ``tile_m[t] .. tile_m[t] + BLOCK_M`` of sequence
``tile_seq[t]``. Query row r of a chunk sits at position ``p_r = ctx − T + r`` and sees keys
``0 .. p_r`` (causal aligned bottom-right, so a chunk after a cached prefix and a decode row,
T = 1, are the same case). Per program, FlashAttention in base 2 with fp32 running max ``m``,
normaliser ``l`` and output ``acc``:

    m' = max(m, max_j s_j);  acc = acc·2^(m−m') + Σ_j 2^(s_j−m') v_j;  l = l·2^(m−m') + Σ_j 2^(s_j−m')

over the key tiles of BLOCK_N slots (a tile spans BLOCK_N / BS table entries). Key tiles left of
the tile's first row position need no causal mask (an unmasked loop); the rest (up to the last
row's position) a masked one; tiles past it are never read. Key 0 is in the first tile every row
visits, so ``m`` is finite after it and no row ever computes −inf − −inf.

Short chunks (decode rows mixed into a prefill step, speculative verification) would waste a
128-row tile, so the plan puts sequences with T ≤ 16 in a second launch with 16-row tiles: two
launches per layer, disjoint output rows. GQA: head h reads kv-head ``h // (H/K)``.

Quantized caches (QUANT 1 fp8 e4m3, 2 int8): as in the decode kernel, values convert exactly to
the MMA dtype, K's per-token scales multiply the scores and V's the weights ``p`` before P·V.

Shape legend: N tokens in the step, S sequences, H heads, K kv-heads, E head dim, NB blocks,
BS block size, M table width.
Exercised by ``pytest tests/test_serve_prefill.py`` (under TRITON_INTERPRET=1 on the CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from lmforge.kernels._common import ensure_interpreter_compat, interpreting, staged
from lmforge.serve._attention_triton import _load_values, kernel_view, quant_code

LOG2E = 1.4426950408889634
SHORT_ROWS = 16  # chunks this short (decode rows) get 16-row tiles, in their own launch


@triton.jit
def _kv_tile(
    k_ptr, v_ptr, bt_row, kh_off, start_n, ctx, stride_kb, stride_kt, e, e_ok,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MMA: tl.constexpr,
    QUANT: tl.constexpr, E: tl.constexpr,
):  # fmt: skip
    """K and V of slots ``start_n .. start_n + BLOCK_N`` of one sequence: (BLOCK_N, EP) each,
    and their (BLOCK_N,) scales (ones for a plain cache)."""
    n = start_n + tl.arange(0, BLOCK_N)  # (BN,) token index in the sequence
    if MASKED:
        n_ok = n < ctx
        block = tl.load(bt_row + n // BS, mask=n_ok, other=0).to(tl.int64)
    else:
        n_ok = n >= 0
        block = tl.load(bt_row + n // BS).to(tl.int64)
    base = block * stride_kb + (n % BS) * stride_kt + kh_off  # (BN,) row starts
    if QUANT:  # rows of E + 4 bytes: 4-byte aligned (E % 4 == 0), which Triton cannot see
        base = tl.multiple_of(base, 4)
    offs = base[:, None] + e[None, :]
    mask = n_ok[:, None] & e_ok[None, :]
    k = _load_values(k_ptr + offs, mask, QUANT, MMA)
    v = _load_values(v_ptr + offs, mask, QUANT, MMA)
    if QUANT:
        sk = tl.load((k_ptr + base + E).to(tl.pointer_type(tl.float32)), mask=n_ok, other=0.0)
        sv = tl.load((v_ptr + base + E).to(tl.pointer_type(tl.float32)), mask=n_ok, other=0.0)
    else:
        sk = tl.full([BLOCK_N], 1.0, tl.float32)
        sv = sk
    return k, v, n, sk, sv


@triton.jit
def _prefill_inner(
    acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kh_off, lo, hi, ctx, pos, stride_kb, stride_kt, e,
    e_ok, qk_scale, window,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MMA: tl.constexpr,
    PREC: tl.constexpr, QUANT: tl.constexpr, E: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    for start_n in range(lo, hi, BLOCK_N):
        k, v, n, sk, sv = _kv_tile(
            k_ptr, v_ptr, bt_row, kh_off, start_n, ctx, stride_kb, stride_kt, e, e_ok,
            BS, BLOCK_N, MASKED, MMA, QUANT, E,
        )  # fmt: skip
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # (BM, BN) fp32, unscaled
        if QUANT:
            qk = qk * sk[None, :]
        if MASKED:  # causal (bottom-right) and the end of the context
            keep = (n[None, :] <= pos[:, None]) & (n[None, :] < ctx)
            if WINDOWED:  # and the sliding window: keys pos − window < n only
                keep = keep & (n[None, :] > pos[:, None] - window)
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # (BM,)
        if WINDOWED:  # a row whose window starts past this tile has no key yet: a finite max
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # (exp2(−inf − 0) = 0 then)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # (BM, BN)
        alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            pv = tl.dot((p * sv[None, :]).to(MMA), v, input_precision=PREC)
        else:
            pv = tl.dot(p.to(MMA), v, input_precision=PREC)
        acc = acc * alpha[:, None] + pv  # (BM, EP)
        m_i = m_new
    return acc, m_i, l_i


# Not specialised on what changes from step to step, so no variant compiles mid-run: the table
# width (its divisibility by 16), and the 16-byte alignment of the int32 inputs, which are views
# at step-dependent offsets (the engine's block tables follow the S context lengths in one
# buffer; the plan's tile lists follow cu_q). They are read as scalars or small gathers.
_INT_INPUTS = ["bt_ptr", "ctx_ptr", "cu_ptr", "tile_seq_ptr", "tile_m_ptr"]


@triton.jit(do_not_specialize=["stride_bts"], do_not_specialize_on_alignment=_INT_INPUTS)
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, cu_ptr, tile_seq_ptr, tile_m_ptr, out_ptr, qk_scale,
    window,
    stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_bts, stride_on, stride_oh,
    G: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MMA: tl.constexpr, PREC: tl.constexpr,
    QUANT: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_m_ptr + tile)  # first row of the tile inside its chunk
    q0 = tl.load(cu_ptr + seq)
    t_len = tl.load(cu_ptr + seq + 1) - q0  # T: queries of this sequence in the step
    ctx = tl.load(ctx_ptr + seq)
    r = m0 + tl.arange(0, BLOCK_M)  # (BM,) rows of the chunk
    r_ok = r < t_len
    pos = ctx - t_len + r  # (BM,) each row's position: it sees keys 0 .. pos
    e = tl.arange(0, EP)
    e_ok = e < E
    rows = (q0 + r).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qn + h * stride_qh + e[None, :],
        mask=r_ok[:, None] & e_ok[None, :],
        other=0.0,
    ).to(MMA)  # (BM, EP)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    kh_off = (h // G) * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, EP], tl.float32)
    first = ctx - t_len + m0  # the tile's first row sees keys 0 .. first: no mask left of it
    last = tl.minimum(ctx, first + BLOCK_M)  # keys past the last row's position are never read
    if WINDOWED:  # keys before the first row's window are never read; every tile masked
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _prefill_inner(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kh_off, lo, last, ctx, pos, stride_kb,
            stride_kt, e, e_ok, qk_scale, window, BS, BLOCK_N, True, MMA, PREC, QUANT, E, True,
        )  # fmt: skip
    else:
        lo = (first + 1) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _prefill_inner(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kh_off, 0, lo, ctx, pos, stride_kb,
            stride_kt, e, e_ok, qk_scale, window, BS, BLOCK_N, False, MMA, PREC, QUANT, E, False,
        )  # fmt: skip
        acc, m_i, l_i = _prefill_inner(
            acc, m_i, l_i, q, k_ptr, v_ptr, bt_row, kh_off, lo, last, ctx, pos, stride_kb,
            stride_kt, e, e_ok, qk_scale, window, BS, BLOCK_N, True, MMA, PREC, QUANT, E, False,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (a padding row past a window: no key)
    tl.store(
        out_ptr + rows[:, None] * stride_on + h * stride_oh + e[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & e_ok[None, :],
    )


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """One step's tiles, built on the host from ``q_lens`` once per step (every layer reuses it).

    ``ints`` is one int32 device tensor: cu_q (S+1) | long tiles' seq, row | short tiles' seq, row.
    """

    ints: torch.Tensor
    "(S + 1 + 2·n_long + 2·n_short,) int32 on the device"
    n_seqs: int
    n_long: int
    "tiles of BLOCK_M rows (chunks longer than SHORT_ROWS)"
    n_short: int
    "tiles of SHORT_ROWS rows"
    block_m: int

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """cu_q, long tile seqs, long tile rows, short tile seqs, short tile rows (views)."""
        s, a, b = self.n_seqs, self.n_long, self.n_short
        x = self.ints
        c = s + 1
        return (
            x[:c],
            x[c : c + a],
            x[c + a : c + 2 * a],
            x[c + 2 * a : c + 2 * a + b],
            x[c + 2 * a + b :],
        )


def default_block_m(head_dim: int) -> int:
    """Query rows per long tile: 128 up to E 128 (the project's FlashAttention forward default
    on Hopper), 64 above; 32 in the interpreter (tiny test shapes)."""
    if interpreting():
        return 32
    return 128 if head_dim <= 128 else 64


def launch_config(block_m: int, head_dim: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for tiles of ``block_m`` rows: 64-key tiles, 3 stages;
    fp32 caches and E > 128 take 32-key tiles and 2 stages (shared memory), short tiles 2."""
    wide = elem_bytes > 2 or head_dim > 128
    block_n = 32 if wide else 64
    stages = 2 if wide or block_m <= SHORT_ROWS else 3
    return block_n, 8 if block_m >= 128 else 4, stages


def prefill_plan(
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    device: torch.device,
    block_m: int | None = None,
    *,
    head_dim: int = 128,
    short_tiles: bool = True,
) -> PrefillPlan:
    """The step's tile lists from the chunk and context lengths (one host-to-device copy);
    ``block_m`` query rows per long tile (None: :func:`default_block_m` of ``head_dim``).

    Tiles are listed by descending key count (the last tiles of the longest contexts first):
    programs start in grid order, so the longest ones do not run alone at the end.
    ``short_tiles=False`` puts short chunks in ``block_m``-row tiles too (the benchmark's peer).
    """
    block_m = block_m or default_block_m(head_dim)
    cu = [0]
    tiles: list[tuple[int, int, int]] = []  # (keys read, seq, first row)
    short: list[tuple[int, int]] = []  # (keys read, seq)
    for i, (t, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        cu.append(cu[-1] + t)
        if short_tiles and t <= SHORT_ROWS < block_m:
            short.append((ctx, i))
        else:
            tiles.extend((min(ctx, ctx - t + m + block_m), i, m) for m in range(0, t, block_m))
    tiles.sort(key=lambda x: -x[0])
    short.sort(key=lambda x: -x[0])
    short_seq = [x[1] for x in short]
    ints = cu + [x[1] for x in tiles] + [x[2] for x in tiles] + short_seq + [0] * len(short_seq)
    dev = staged(ints, torch.int32, device).to(device, non_blocking=True)
    return PrefillPlan(dev, len(q_lens), len(tiles), len(short_seq), block_m)


def paged_prefill_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    plan: PrefillPlan,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """q (N, H, E), caches (NB, BS, K, E), block_tables (S, M) int32, ctx_lens (S,) int32 and the
    step's :class:`PrefillPlan` -> (N, H, E) in q's dtype. ``window`` > 0: sliding-window
    attention (row at position p sees keys p − window < n ≤ p; the key tiles before the tile's
    first window are never read)."""
    if interpreting():
        ensure_interpreter_compat()
    _n, h, e = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    quant = quant_code(k_cache)
    assert quant == quant_code(v_cache) and (not quant or k_cache.shape[-1] == e + 4)
    assert h % kv_heads == 0 and e <= 256, (h, kv_heads, e)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = q.contiguous()
    out = torch.empty_like(q)
    ep = max(16, triton.next_power_of_2(e))
    mma_src = q.dtype if quant else k_cache.dtype  # quantized values convert exactly to q's
    mma = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(mma_src, tl.float32)
    if interpreting() and mma == tl.bfloat16:  # Triton 3.6's interpreter: bf16 tl.dot is wrong
        mma = tl.float32
    prec = "ieee" if mma == tl.float32 else "tf32"
    if interpreting():
        block_n = block_n or 16  # small tiles: tiny test shapes still cross several of them
    cu, l_seq, l_m, s_seq, s_m = plan.parts()
    qk_scale = LOG2E / (e**0.5)
    launches = ((plan.n_long, plan.block_m, l_seq, l_m), (plan.n_short, SHORT_ROWS, s_seq, s_m))
    for n_tiles, block_m, t_seq, t_m in launches:
        if n_tiles == 0:
            continue
        assert n_tiles < 65536, f"{n_tiles} query tiles: more than CUDA's grid y limit"
        args = (
            q, kernel_view(k_cache), kernel_view(v_cache), block_tables, ctx_lens, cu, t_seq,
            t_m, out, qk_scale, window,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
        )  # fmt: skip
        meta = dict(
            G=h // kv_heads, E=e, EP=ep, BS=bs, BLOCK_M=block_m, MMA=mma, PREC=prec, QUANT=quant,
            WINDOWED=window > 0,
        )  # fmt: skip
        if interpreting():
            _paged_prefill_kernel[(h, n_tiles)](*args, **meta, BLOCK_N=block_n)
            continue
        elem = q.element_size() if quant else k_cache.element_size()  # tiles in the MMA dtype
        bn, warps, stages = launch_config(block_m, e, elem)
        bn, warps, stages = block_n or bn, num_warps or warps, num_stages or stages
        # The shared-memory need grows with stages x key tile; step down rather than fail on a
        # dtype/E the defaults were not sized for (fp32 caches in tests, E 256).
        tries = [(bn, stages), (bn, 1), (max(16, bn // 2), 1)]
        for i, (bn_i, st) in enumerate(tries):
            try:
                _paged_prefill_kernel[(h, n_tiles)](
                    *args, **meta, BLOCK_N=bn_i, num_warps=warps, num_stages=st
                )
                break
            except OutOfResources:
                if i == len(tries) - 1:
                    raise
    return out
