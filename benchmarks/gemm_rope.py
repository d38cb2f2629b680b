"""Probe: the q‖k projection GEMM with RoPE applied in its epilogue, in Triton, against cuBLAS.

The model's q and k come from one GEMM (x @ cat([Wq, Wk])ᵀ, cuBLAS) whose output lmforge's packed
RoPE kernel reads back and rotates (``model.rope = "packed"``). Rotating inside the GEMM's
epilogue would save that kernel's read and write of q and k (~62 µs a layer on an H200 at
GPT-2-small's 32768 tokens) if a Triton GEMM came close enough to cuBLAS: the fused kernel breaks
even at cuBLAS-GEMM + RoPE time. This script measures exactly that, at the model's shapes, before
anything goes into the library: correctness first (fp32 reference of GEMM + rotation; the bf16
outputs within bf16 rounding of it), then CUDA-event medians of

* cuBLAS GEMM alone, and cuBLAS GEMM + ``lmforge.kernels.rope_packed`` (the model's path),
* the Triton GEMM alone and with the RoPE epilogue, for a few tile configurations,

and a table with TFLOP/s and the ratio to the model's path.

    PYTHONPATH=src python benchmarks/gemm_rope.py
    PYTHONPATH=src python benchmarks/gemm_rope.py --tokens 16384 --results runs/RESULTS-gemm.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

import torch
import triton
import triton.language as tl


@triton.jit
def _mm_rope(
    A, W, Y, Q, KO, COS, SIN, M, N, K, T, NQ, HALF,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ROPE: tl.constexpr,
):  # fmt: skip
    # Y (M, N) = A (M, K) @ W (N, K)ᵀ, all row-major; with ROPE the tile is rotated pairwise by
    # the (T, HALF) tables at position row % T and written to Q (M, NQ) or KO (M, N − NQ) — the
    # packed RoPE's outputs. M, N, K multiples of the blocks, NQ of BLOCK_N (checked on the host).
    pid = tl.program_id(0)
    num_m = M // BLOCK_M
    num_n = N // BLOCK_N
    per_group = GROUP_M * num_n  # tiles of GROUP_M row blocks, column-major inside: L2 reuse
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None].to(tl.int64) * K + ks[None, :]
    w_ptrs = W + cols[None, :].to(tl.int64) * K + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(a_ptrs), tl.load(w_ptrs), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if ROPE:
        t = rows % T
        i = (pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)) % HALF
        c = tl.load(COS + t[:, None] * HALF + i[None, :])
        s = tl.load(SIN + t[:, None] * HALF + i[None, :])
        x0, x1 = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        out = tl.reshape(tl.join(x0 * c - x1 * s, x0 * s + x1 * c), (BLOCK_M, BLOCK_N))
        if pid_n * BLOCK_N < NQ:
            ptrs = Q + rows[:, None].to(tl.int64) * NQ + cols[None, :]
        else:
            ptrs = KO + rows[:, None].to(tl.int64) * (N - NQ) + (cols[None, :] - NQ)
        tl.store(ptrs, out.to(Q.dtype.element_ty))
    else:
        tl.store(Y + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(Y.dtype.element_ty))


@triton.jit
def _mm_tma(
    a_desc, w_desc, y_desc, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):  # fmt: skip
    # Y = A @ Wᵀ with tensor-memory-accelerator (TMA) loads and stores through host-built
    # descriptors; NUM_PROGRAMS = 0: one program a tile, else a persistent grid of that many
    # programs walking the tiles in the same grouped order.
    num_m = M // BLOCK_M
    num_n = N // BLOCK_N
    per_group = GROUP_M * num_n
    tiles = num_m * num_n
    step = NUM_PROGRAMS if NUM_PROGRAMS > 0 else tiles
    for tile in range(tl.program_id(0), tiles, step):
        group = tile // per_group
        first_m = group * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % size_m
        pid_n = (tile % per_group) // size_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k])
            w = w_desc.load([pid_n * BLOCK_N, k])
            acc = tl.dot(a, w.T, acc)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))


def mm_tma(x, w, config, programs=0):
    """x (M, K) @ w (N, K)ᵀ through TMA descriptors (``programs`` > 0: a persistent grid)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, warps, stages, group = config
    m, kdim = x.shape
    n = w.shape[0]
    assert m % bm == 0 and n % bn == 0 and kdim % bk == 0, (m, n, kdim, config)
    y = x.new_empty((m, n))
    a_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    y_desc = TensorDescriptor.from_tensor(y, [bm, bn])
    tiles = (m // bm) * (n // bn)
    grid = (min(programs, tiles) if programs else tiles,)
    _mm_tma[grid](
        a_desc, w_desc, y_desc, m, n, kdim, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        NUM_PROGRAMS=grid[0] if programs else 0, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def mm_rope(x, w, cos, sin, n_q, n_k, config, rope=True):
    """x (M, K) @ w (N, K)ᵀ; with ``rope``: (q (M, n_q·E), k (M, n_k·E)) rotated, else y (M, N)."""
    bm, bn, bk, warps, stages, group = config
    m, kdim = x.shape
    n = w.shape[0]
    e = n // (n_q + n_k)
    nq = n_q * e
    assert m % bm == 0 and n % bn == 0 and kdim % bk == 0 and nq % bn == 0, (m, n, kdim, config)
    t, half = cos.shape
    y = q = ko = None
    if rope:
        q = x.new_empty((m, nq))
        ko = x.new_empty((m, n - nq))
    else:
        y = x.new_empty((m, n))
    dummy = q if rope else y
    grid = ((m // bm) * (n // bn),)
    _mm_rope[grid](
        x, w, y if y is not None else dummy, q if q is not None else dummy,
        ko if ko is not None else dummy, cos, sin, m, n, kdim, t, nq, half,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, ROPE=rope,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return (q, ko) if rope else y


CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M)
    # The epilogue holds the tile plus its fp32 cos/sin (2 × BM × BN/2 values): 128 × 128 tiles
    # need 8 warps to stay clear of spills (ptxas, sm_90a: 182 registers, 128 × 256 spill).
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 8, 3, 8),
    (128, 128, 64, 8, 5, 8),
    (64, 128, 64, 4, 4, 8),
    (128, 64, 64, 4, 4, 8),
    (128, 256, 64, 8, 3, 8),
]


TMA_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M)
    (128, 128, 64, 4, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 256, 64, 8, 3, 8),
    (256, 128, 64, 8, 3, 8),
]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, default=32768, help="rows (batch × sequence)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12, help="query heads (and key heads)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--results", help="append the table to this markdown file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gemm_rope.py: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from lmforge.bench.timing import environment_line, markdown_table, time_ms
    from lmforge.kernels import rope_packed
    from lmforge.model import RotaryEmbedding

    m, d, h = args.tokens, args.d_model, args.heads
    e = d // h
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, d, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(2 * d, d, device="cuda", generator=gen) / d**0.5).bfloat16()
    table = RotaryEmbedding(10000.0, e, args.seq, device="cuda")
    cos, sin = table.cos.float().contiguous(), table.sin.float().contiguous()

    def model_path():
        qk = (x @ w.t()).view(m // args.seq, args.seq, 2 * d)
        return rope_packed(qk, cos, sin, h, h)

    # Correctness first: fp32 GEMM + rotation as the reference.
    ref_q, ref_k = rope_packed(
        (x.float() @ w.float().t()).view(m // args.seq, args.seq, 2 * d), cos, sin, h, h
    )
    ref = torch.cat([ref_q.reshape(m, d), ref_k.reshape(m, d)], 1)
    mq, mk = model_path()
    model_err = (torch.cat([mq.reshape(m, d), mk.reshape(m, d)], 1).float() - ref).abs().max()
    flops = 2 * m * d * 2 * d
    rows = []
    base_mm = time_ms(lambda: x @ w.t(), 5, args.iters)
    base = time_ms(model_path, 5, args.iters)
    rows.append(["cuBLAS GEMM", "-", round(base_mm * 1e3, 1), round(flops / base_mm / 1e9), "-"])
    rows.append(["cuBLAS GEMM + packed RoPE (the model)", f"{model_err:.1e}",
                 round(base * 1e3, 1), round(flops / base / 1e9), 1.0])  # fmt: skip
    ok = True
    for cfg in CONFIGS:
        name = "×".join(map(str, cfg))
        try:
            q, k = mm_rope(x, w, cos, sin, h, h, cfg)
            err = (torch.cat([q, k], 1).float() - ref).abs().max().item()
            good = err <= 2 * float(model_err) + 1e-2
            ok &= good
            t_mm = time_ms(lambda cfg=cfg: mm_rope(x, w, cos, sin, h, h, cfg, rope=False), 5,
                           args.iters)  # fmt: skip
            t_fused = time_ms(lambda cfg=cfg: mm_rope(x, w, cos, sin, h, h, cfg), 5, args.iters)
            rows.append([f"Triton GEMM {name}", "-", round(t_mm * 1e3, 1),
                         round(flops / t_mm / 1e9), round(t_mm / base, 3)])  # fmt: skip
            rows.append([f"Triton GEMM + RoPE epilogue {name}",
                         f"{err:.1e}{'' if good else ' FAIL'}", round(t_fused * 1e3, 1),
                         round(flops / t_fused / 1e9), round(t_fused / base, 3)])  # fmt: skip
        except Exception as exc:  # a config that does not compile or fit is reported
            rows.append([f"Triton {name}", f"failed: {type(exc).__name__}"[:50], "-", "-", "-"])
        print(rows[-1], file=sys.stderr)
    head = ["kernel (BM×BN×BK×warps×stages×group)", "max error", "µs", "TFLOP/s",
            "× the model's time"]  # fmt: skip
    # The same GEMM through TMA descriptors (one program a tile, or persistent).
    want = x.float() @ w.float().t()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in TMA_CONFIGS:
        for programs in (0, sms):
            name = "×".join(map(str, cfg)) + (f", {programs} persistent" if programs else "")
            try:
                y = mm_tma(x, w, cfg, programs)
                err = (y.float() - want).abs().max().item()
                good = err <= 2e-2 * want.abs().max().item()
                ok &= good
                t_mm = time_ms(lambda cfg=cfg, programs=programs: mm_tma(x, w, cfg, programs), 5,
                               args.iters)  # fmt: skip
                rows.append([f"Triton TMA GEMM {name}", f"{err:.1e}{'' if good else ' FAIL'}",
                             round(t_mm * 1e3, 1), round(flops / t_mm / 1e9),
                             round(t_mm / base, 3)])  # fmt: skip
            except Exception as exc:
                rows.append([f"Triton TMA {name}", f"failed: {type(exc).__name__}"[:50], "-", "-",
                             "-"])  # fmt: skip
            print(rows[-1], file=sys.stderr)
    text = "\n".join(
        [
            f"## gemm_rope.py — {environment_line()}",
            "",
            f"q‖k projection {m}×{d} @ {d}×{2 * d} bf16 ({h} + {h} heads of {e}), positions "
            f"mod {args.seq}; max |error| against an fp32 GEMM + rotation",
            "",
            markdown_table(head, rows),
            "",
        ]
    )
    print(text)
    if args.results:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write("\n" + text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
