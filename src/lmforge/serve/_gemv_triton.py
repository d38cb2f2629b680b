"""The decode GEMV: y (M, N) = x (M, K) @ W (N, K)ᵀ for the few rows of a decode step (M ≤ 8).

At batch 1-8 a projection reads every weight once and does almost no arithmetic, so its floor
is the weight read: N·K·2 bytes at the HBM bandwidth (4.8 TB/s on an H200). cuBLAS picks tiles
for this case (``nvjet`` 64×8 / 128×8, split-K plus a reduce kernel) that reach ~59% of it on
TinyLlama's shapes; this kernel is tuned for them instead.

Math: program (n, s) owns rows ``n·BLOCK_N …`` of W and the K chunks ``s, s + SPLIT, …`` (each
BLOCK_K wide; interleaved so every split gets the same number of chunks ±1), and computes

    P[s, m, j] = Σ_{k in its chunks} x[m, k] · W[j, k]      (fp32)

as tensor-core dots with the operands swapped — ``W_tile (BLOCK_N, BLOCK_K) @ x_tileᵀ (BLOCK_K,
16)`` — so W's rows fill the MMA's M side (64 rows: a Hopper wgmma) and the decode rows, padded
to 16 with masked (never fetched) loads, its N side; W streams through shared memory in
``stages`` pipelined 16-byte-per-thread copies. No atomics and no second kernel: the op returns
the (SPLIT, M, N) fp32 partial sums and the caller adds them (``P.sum(0)``). Under
``torch.compile`` (the decode step compiled with ``unroll_reductions_threshold`` above MAX_SPLIT:
inductor's default unrolls fewer than 8 terms) that sum is unrolled into pointwise loads and fused
into the kernel that consumes y (the RoPE, the SwiGLU, the residual add + RMSNorm), so split-K
costs neither a launch nor a pass over y. Rows past N re-read row N−1 (clamped index, so W's
loads need no mask) and are not stored; K not a multiple of BLOCK_K masks the last chunk.

Launch configs: :data:`TABLE` per (N, K) for the shapes of TinyLlama-1.1B, Qwen3-0.6B and
SmolLM2-135M (packed q/k/v, o, packed w1/w3, w2, LM head), :func:`default_config` for any other
(enough programs for about two waves of the SMs). A table entry of None routes that shape to
cuBLAS (where the H200 measured it faster). The reference is :func:`gemv_reference` (float64).

Shape legend: M decode rows (sequences), N output features, K input features.
Exercised by ``pytest tests/test_serve_gemv.py`` (TRITON_INTERPRET=1 on CPU; ``-m gpu``) and
``python benchmarks/serve.py --only gemv``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from lmforge.kernels._common import ensure_interpreter_compat, interpreting

MAX_ROWS = 8  # decode buckets 1, 2, 4, 8; larger batches are GEMMs: cuBLAS
_ROWS_PAD = 16  # tl.dot's smallest tile side
# the compiled decode step has inductor unroll a sum of <= MAX_SPLIT terms into its consumer
MAX_SPLIT = 8


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MP: tl.constexpr,
    EVEN_K: tl.constexpr,
    MMA: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output features
    rn_ld = tl.minimum(rn, N - 1)  # rows past N re-read the last row: W loads stay unmasked
    rm = tl.arange(0, MP)  # (MP,) decode rows, >= M are padding
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    w_ptrs = w_ptr + rn_ld.to(tl.int64)[:, None] * stride_wn + rk[None, :]  # (BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]  # (BLOCK_K, MP): xᵀ
    acc = tl.zeros((BLOCK_N, MP), dtype=tl.float32)
    step = tl.num_programs(1) * BLOCK_K  # the split is the grid's second dim (one compile for all)
    for k0 in range(pid_s * BLOCK_K, K, step):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            xt = tl.load(x_ptrs + k0, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k0 + rk < K
            w = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs + k0, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(w.to(MMA), xt.to(MMA), acc, input_precision=PREC)  # (BLOCK_N, MP) fp32
    # partials (SPLIT, M, N): row m of split s at (s·M + m)·N
    out = out_ptr + (pid_s * M + rm[None, :]) * N + rn[:, None]
    tl.store(out, acc, mask=(rn < N)[:, None] & m_ok[None, :])


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One launch: tiles, the K split and the Triton compile options."""

    block_n: int
    "rows of W per program (64: one wgmma M tile per 4 warps)"
    block_k: int
    "K elements per pipelined chunk"
    split: int
    "programs along K (partial sums the caller adds), 1..MAX_SPLIT"
    warps: int = 4
    "num_warps"
    stages: int = 3
    "num_stages: chunks of W in flight per program"


# (N, K) -> config, or None for cuBLAS. TinyLlama-1.1B (d 2048, 32/4 heads of 64, F 5632,
# V 32000), Qwen3-0.6B (d 1024, 16/8 heads of 128, F 3072, V 151936), SmolLM2-135M (d 576, 9/3
# heads of 64, F 1536, V 49152): packed q/k/v, o, packed w1/w3, w2, LM head. Chosen for 132
# SMs: all of a small GEMV's programs resident at once (<= 3 per SM at 3 stages of 20 KB), each
# with its loads issued up front; the big ones in chunks that balance over the SMs, the LM heads
# 3 chunks ahead. The TinyLlama entries were swept on the H200 (2026-12-02, ``benchmarks/serve.py
# --only gemv``, M = 1): each within 2% of the sweep's best, q|k|v its winner (3% faster).
TABLE: dict[tuple[int, int], GemvConfig | None] = {
    # TinyLlama-1.1B
    (2560, 2048): GemvConfig(64, 64, 8),
    (2048, 2048): GemvConfig(64, 128, 8),
    (11264, 2048): GemvConfig(64, 128, 2),
    (2048, 5632): GemvConfig(64, 128, 8),
    (32000, 2048): GemvConfig(64, 128, 1, stages=4),
    # Qwen3-0.6B
    (4096, 1024): GemvConfig(64, 128, 4),
    (1024, 2048): GemvConfig(64, 128, 8),
    (6144, 1024): GemvConfig(64, 128, 2),
    (1024, 3072): GemvConfig(64, 128, 8),
    (151936, 1024): GemvConfig(64, 128, 1, stages=4),
    # SmolLM2-135M
    (960, 576): GemvConfig(64, 64, 4),
    (576, 576): GemvConfig(64, 64, 8),
    (3072, 576): GemvConfig(64, 64, 2),
    (576, 1536): GemvConfig(64, 128, 8),
    (49152, 576): GemvConfig(64, 64, 1),
}


def default_config(n: int, k: int, sms: int = 132) -> GemvConfig:
    """A config for any (N, K): 64-row tiles, 128-wide chunks (64 when K is small or not a
    multiple of 128; K rounded up to a power of two below that), and the smallest split giving
    about two waves of ``sms`` SMs' programs, never more splits than chunks nor MAX_SPLIT."""
    block_k = 128 if k % 128 == 0 and k >= 1024 else min(64, max(16, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, 64)
    chunks = triton.cdiv(k, block_k)
    split = 1
    while split < MAX_SPLIT and tiles * split < 2 * sms and 2 * split <= chunks:
        split *= 2
    return GemvConfig(64, block_k, split)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gemv_config(n: int, k: int, device: torch.device) -> GemvConfig | None:
    """The launch for W (N, K) on ``device``: the table's, else :func:`default_config` for the
    device's SM count (132 where it has none: the CPU interpreter). None: use cuBLAS."""
    if (n, k) in TABLE:
        return TABLE[(n, k)]
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132
    return default_config(n, k, sms)


def gemv_partials(
    x: torch.Tensor,
    w: torch.Tensor,
    config: GemvConfig | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """x (M, K) half/bf16/fp32, W (N, K) row-major, same dtype -> partial sums (SPLIT, M, N)
    fp32; ``P.sum(0)`` is x @ Wᵀ with fp32 accumulation. ``config`` None: :func:`gemv_config`
    (which must not be None for this shape); ``split`` overrides its split."""
    if interpreting():
        ensure_interpreter_compat()
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.dtype == x.dtype, (x.shape, x.dtype, w.shape, w.dtype)
    assert 1 <= m <= MAX_ROWS, m
    cfg = config or gemv_config(n, k, x.device)
    assert cfg is not None, f"no GEMV config for ({n}, {k}): cuBLAS's shape"
    if split is not None and split != cfg.split:
        cfg = dataclasses.replace(cfg, split=split)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    out = torch.empty((cfg.split, m, n), device=x.device, dtype=torch.float32)
    # tensor-core operands in the input dtype; fp32 stays exact (ieee), as does bf16 in Triton
    # 3.6's CPU interpreter, whose tl.dot multiplies bf16 bit patterns (the upcast is exact)
    mma = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype, tl.float32)
    if interpreting():
        mma = tl.float32
    grid = (triton.cdiv(n, cfg.block_n), cfg.split)
    _gemv_kernel[grid](
        x,
        w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        MP=_ROWS_PAD,
        EVEN_K=k % cfg.block_k == 0,
        MMA=mma,
        PREC="ieee" if mma == tl.float32 else "tf32",
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return out


def gemv_triton(x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x (M, K) @ W (N, K)ᵀ -> (M, N) in x's dtype (fp32 accumulation), eagerly (the partial
    sums added by torch)."""
    return gemv_partials(x, w, config).sum(0).to(x.dtype)


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) @ W (N, K)ᵀ in float64 (on the inputs' device, returned on the CPU): the
    reference the kernel is tested against."""
    return (x.detach().double() @ w.detach().double().t()).cpu()
