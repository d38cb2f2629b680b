"""``lmforge bench kernels``: each Triton kernel checked, then timed next to its peers (one GPU).

Order of work: correctness first (max errors against float64 references, with the peer's own
error as the yardstick), then timing (warmup, CUDA events, medians), then markdown tables.

* FlashAttention-2 vs torch SDPA (flash and cuDNN backends): causal, bf16, E ∈ {64, 128},
  S ∈ {1k … 16k}; B = 32768 / S sequences and H = 2048 / E heads (≈32k tokens, d_model 2048).
  FLOPs: causal forward = 4·B·H·S²·E / 2; forward + backward = 3.5 × forward (the backward does
  five T×T matmuls to the forward's two). TFLOP/s = FLOPs / median time.
* RMSNorm vs ``F.rms_norm`` (and Liger-Kernel when installed): GB/s with bytes = read x + write y
  + weight (forward); forward + backward adds read x, dy and write dx. Reported against the
  device copy bandwidth measured in the same run.
* Fused linear + cross-entropy vs unfused torch (bf16 matmul, float32 cross-entropy) and Liger:
  forward + backward time and the extra peak memory over the inputs.
* SwiGLU gate (a and b separate, and packed as one [a | b] buffer) and RoPE vs ``F.silu(a)·b``
  and ``lmforge.model.RotaryEmbedding``: GB/s of activation reads + writes.

Run: ``lmforge bench kernels`` or ``PYTHONPATH=src python benchmarks/kernels.py``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from lmforge.bench.timing import (
    copy_bandwidth_gbs,
    environment_line,
    markdown_table,
    peak_extra_bytes,
    time_ms,
)
from lmforge.kernels import (
    attention_reference,
    flash_attention,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
    rms_norm,
    rms_norm_reference,
    rope,
    rope_reference,
    swiglu,
    swiglu_packed,
    swiglu_packed_reference,
    swiglu_reference,
)

ATTN_SEQS = (1024, 2048, 4096, 8192, 16384)
ATTN_DIMS = (64, 128)
ATTN_TOKENS = 32768
ATTN_WIDTH = 2048  # heads = width / head dim
BWD_FACTOR = 3.5  # forward + backward FLOPs = 3.5 × forward FLOPs (stated convention)
RMS_SHAPES = ((32768, 2048), (32768, 4096), (16384, 8192))
CE_SHAPES = ((16384, 768, 50304), (16384, 2048, 128256))
SUITES = ("attention", "rmsnorm", "ce", "elementwise")
SWIGLU_SHAPE = (16384, 8192)  # tokens × F
ROPE_SHAPE = (8, 32, 4096, 128)  # B, H, T, E
MIB = 1 << 20


def attention_flops(b: int, h: int, s: int, e: int, causal: bool = True) -> float:
    """Forward FLOPs of attention: two (S × S × E) matmuls per head, halved when causal."""
    fwd = 4.0 * b * h * s * s * e
    return fwd / 2 if causal else fwd


# ----------------------------------------------------------------------------------- peers


def _sdpa(backend: str) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    return flash_attention(q, k, v, causal, backend="triton")


def _liger_rms_norm(
    d: int, weight: torch.Tensor, eps: float
) -> tuple[Callable, torch.Tensor] | None:
    # (forward, its weight parameter): the f+b timing differentiates w.r.t. the weight too.
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError:
        return None
    module = LigerRMSNorm(d, eps=eps).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return (lambda x: module(x)), module.weight


def _liger_ce() -> Callable | None:
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )
    except ImportError:
        return None
    loss_fn = LigerFusedLinearCrossEntropyLoss()

    def run(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = loss_fn(w, h, t)
        return out[0] if isinstance(out, tuple) else out

    return run


def _unfused_ce(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h @ w.T).float(), t)  # (N, V) logits materialised


# ------------------------------------------------------------------------------ correctness


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _judge(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor],
           peer: Sequence[torch.Tensor], floor: float,
           min_scale: float = 1.0) -> tuple[list[str], bool]:  # fmt: skip
    """Each output's max error against the float64 reference next to the peer's (one cell
    each), and whether every one is within 2× the peer's or ``floor`` × the reference's
    magnitude (at least ``min_scale``)."""
    errs = [_max_err(a, w) for a, w in zip(got, want)]
    peer_errs = [_max_err(a, w) for a, w in zip(peer, want)]
    scale = [max(min_scale, w.abs().max().item()) for w in want]
    ok = all(a <= max(2 * p, floor * s) for a, p, s in zip(errs, peer_errs, scale))
    return [f"{a:.2e} ({p:.1e})" for a, p in zip(errs, peer_errs)], ok


# (dtype, E, causal, (B, H, K, T)): GQA, ragged lengths, every dtype, head dims 64/128/256.
ATTN_CHECKS = (
    (torch.bfloat16, 64, True, (2, 8, 2, 1000)),
    (torch.bfloat16, 128, True, (1, 4, 4, 2065)),
    (torch.bfloat16, 128, False, (2, 4, 1, 777)),
    (torch.float16, 64, True, (1, 4, 2, 515)),
    (torch.float32, 128, True, (1, 2, 2, 300)),
    (torch.bfloat16, 256, True, (1, 2, 1, 333)),
)
RMS_CHECKS = (
    (torch.bfloat16, (4099, 1000)),
    (torch.bfloat16, (8192, 4096)),
    (torch.float32, (1000, 2048)),
    (torch.float16, (777, 8192)),
)
CE_CHECKS = ((3000, 512, 32003, 0.0), (2049, 768, 50304, 1e-4))


def _triton_attention_with_grads(ins, do, causal: bool, tune: bool) -> list[torch.Tensor]:
    # Shapes the timing run also uses go through the autotuner; the other dtypes and head dims
    # run each kernel's default config, so the check does not add tuning sweeps.
    try:
        from lmforge.kernels import _flash_triton
    except ImportError:
        _flash_triton = None
    saved = _flash_triton.AUTOTUNE if _flash_triton else True
    if _flash_triton:
        _flash_triton.AUTOTUNE = tune and saved
    try:
        out = flash_attention(*ins, causal)
        return [out, *torch.autograd.grad(out, ins, do)]
    finally:
        if _flash_triton:
            _flash_triton.AUTOTUNE = saved


def _timed(dtype: torch.dtype, e: int, causal: bool) -> bool:
    """Whether the timing tables use this (dtype, head dim, causal) combination."""
    return dtype == torch.bfloat16 and causal and e in ATTN_DIMS


def check_attention(cases=ATTN_CHECKS, device: str = "cuda") -> tuple[list[list[object]], bool]:
    """Triton attention vs float64 reference next to SDPA's own error, forward and gradients."""
    rows: list[list[object]] = []
    ok_all = True
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype, e, causal, (b, h, kv, t) in cases:
        q = torch.randn(b, h, t, e, device=device, generator=gen, dtype=dtype)
        k = torch.randn(b, kv, t, e, device=device, generator=gen, dtype=dtype)
        v = torch.randn(b, kv, t, e, device=device, generator=gen, dtype=dtype)
        do = torch.randn(b, h, t, e, device=device, generator=gen, dtype=dtype)
        ref_in = [x.double().requires_grad_() for x in (q, k, v)]
        ref = attention_reference(*ref_in, is_causal=causal)
        ref_g = torch.autograd.grad(ref, ref_in, do.double())
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        got = _triton_attention_with_grads(ins, do, causal, tune=_timed(dtype, e, causal))
        peer_in = [x.clone().requires_grad_() for x in (q, k, v)]
        group = h // kv
        kr = peer_in[1].repeat_interleave(group, 1)
        vr = peer_in[2].repeat_interleave(group, 1)
        peer = F.scaled_dot_product_attention(peer_in[0], kr, vr, is_causal=causal)
        peer_all = [peer, *torch.autograd.grad(peer, peer_in, do)]
        floor = {torch.float32: 5e-3, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}[dtype]
        cells, ok = _judge(got, [ref, *ref_g], peer_all, floor)
        ok_all &= ok
        rows.append([str(dtype).split(".")[1], e, causal, f"{b}×{h}/{kv}×{t}", *cells,
                     "ok" if ok else "FAIL"])  # fmt: skip
    return rows, ok_all


def check_rms_norm(cases=RMS_CHECKS, device: str = "cuda") -> tuple[list[list[object]], bool]:
    """Triton RMSNorm vs float64 reference next to ``F.rms_norm``'s error in the same dtype."""
    rows: list[list[object]] = []
    ok_all = True
    gen = torch.Generator(device=device).manual_seed(1)
    for dtype, (n, d) in cases:
        x = torch.randn(n, d, device=device, generator=gen, dtype=dtype) * 2
        w = (torch.rand(d, device=device, generator=gen) + 0.5).to(dtype)
        dy = torch.randn(n, d, device=device, generator=gen, dtype=dtype)
        ref_in = [x.double().requires_grad_(), w.double().requires_grad_()]
        ref = rms_norm_reference(*ref_in, 1e-5)
        want = [ref, *torch.autograd.grad(ref, ref_in, dy.double())]
        ins = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        y = rms_norm(*ins, 1e-5)
        got = [y, *torch.autograd.grad(y, ins, dy)]
        p_in = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        py = F.rms_norm(p_in[0], (d,), p_in[1], 1e-5)
        peer = [py, *torch.autograd.grad(py, p_in, dy)]
        floor = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        cells, ok = _judge(got, want, peer, floor)
        ok_all &= ok
        rows.append([str(dtype).split(".")[1], f"{n}×{d}", *cells, "ok" if ok else "FAIL"])
    return rows, ok_all


def check_cross_entropy(cases=CE_CHECKS, device: str = "cuda") -> tuple[list[list[object]], bool]:
    """Fused linear + CE (Triton chunks) vs float64 reference next to unfused bf16 torch."""
    rows: list[list[object]] = []
    ok_all = True
    gen = torch.Generator(device=device).manual_seed(2)
    for n, d, v, z in cases:
        h = torch.randn(n, d, device=device, generator=gen, dtype=torch.bfloat16)
        w = (torch.randn(v, d, device=device, generator=gen) / math.sqrt(d)).bfloat16()
        t = torch.randint(0, v, (n,), device=device, generator=gen)
        t[::7] = -100
        ref_in = [h.double().requires_grad_(), w.double().requires_grad_()]
        ref = linear_cross_entropy_reference(*ref_in, t, z_loss=z)
        want = [ref, *torch.autograd.grad(ref, ref_in)]
        ins = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        loss = fused_linear_cross_entropy(*ins, t, z_loss=z, backend="triton")
        got = [loss, *torch.autograd.grad(loss, ins)]
        p_in = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        p_loss = linear_cross_entropy_reference(*p_in, t, z_loss=z)  # bf16 matmul, fp32 CE
        peer = [p_loss, *torch.autograd.grad(p_loss, p_in)]
        cells, ok = _judge(got, want, peer, 2e-2, min_scale=1e-3)
        ok_all &= ok
        rows.append([f"{n}×{d}→{v}", z, *cells, "ok" if ok else "FAIL"])
    return rows, ok_all


# ----------------------------------------------------------------------------------- timing


def _safe(fn: Callable[[], float]) -> float | str:
    try:
        return fn()
    except Exception as e:  # a peer backend missing on this build must not stop the run
        return f"n/a ({type(e).__name__})"


def _fwd_and_fwd_bwd(
    fn: Callable[..., torch.Tensor],
    args: tuple,
    wrt: tuple[torch.Tensor, ...],
    grad_out: torch.Tensor | None,
    iters: int,
    warmup: int,
    device: str,
) -> tuple[float | str, float | str]:
    """Median ms of ``fn(*args)`` without grad, and of forward + ``autograd.grad`` over ``wrt``."""

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return fn(*args)

    def fwd_bwd() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(fn(*args), wrt, grad_out)

    t_f = _safe(lambda: time_ms(fwd, warmup=warmup, iters=iters, device=device))
    t_fb = _safe(lambda: time_ms(fwd_bwd, warmup=warmup, iters=iters, device=device))
    return t_f, t_fb


def _rate(amount: float, ms: float | str) -> float | str:
    # amount per millisecond → per second, in units of 1e9 (GFLOP/s→TFLOP/s needs /1e3 more)
    return ms if isinstance(ms, str) else amount / ms / 1e6


def bench_attention(
    seqs: Sequence[int],
    dims: Sequence[int],
    iters: int,
    tokens: int = ATTN_TOKENS,
    width: int = ATTN_WIDTH,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
) -> list[list[object]]:
    """TFLOP/s forward and forward + backward per (E, S) for Triton, SDPA-flash, SDPA-cuDNN."""
    impls = [_triton_attention, _sdpa("flash"), _sdpa("cudnn")]
    rows: list[list[object]] = []
    for e in dims:
        for s in seqs:
            b, h = max(1, tokens // s), max(1, width // e)
            qkv = tuple(
                torch.randn(b, h, s, e, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            do = torch.randn(b, h, s, e, device=device, dtype=dtype)
            flops = attention_flops(b, h, s, e, causal=True)
            row: list[object] = [e, s, f"{b}×{h}"]
            for fn in impls:
                t_f, t_fb = _fwd_and_fwd_bwd(fn, (*qkv, True), qkv, do, iters, 3, device)
                row += [_rate(flops / 1e3, t_f), _rate(BWD_FACTOR * flops / 1e3, t_fb)]
            rows.append(row)
    return rows


def bench_rms_norm(
    shapes: Sequence[tuple[int, int]], iters: int, copy_gbs: float, device: str = "cuda"
):
    """GB/s forward and forward + backward for Triton, ``F.rms_norm`` and Liger (if installed)."""
    rows: list[list[object]] = []
    eps = 1e-5
    for n, d in shapes:
        x = torch.randn(n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(d, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(n, d, device=device, dtype=torch.bfloat16)
        fwd_bytes = 2 * (2 * n * d + d)
        fb_bytes = fwd_bytes + 2 * (3 * n * d + 2 * d)
        liger = _liger_rms_norm(d, w.detach(), eps)
        # f+b differentiates w.r.t. x AND the weight for every implementation (the byte count
        # includes dw; a peer asked only for dx could skip its weight-gradient reduction).
        impls: list[tuple[Callable | None, tuple, tuple]] = [
            (rms_norm, (x, w, eps), (x, w)),
            (F.rms_norm, (x, (d,), w, eps), (x, w)),
            (None, (), ()) if liger is None else (liger[0], (x,), (x, liger[1])),
        ]
        row: list[object] = [f"{n}×{d}"]
        for fn, args, wrt in impls:
            if fn is None:
                row += ["-", "-"]
                continue
            t_f, t_fb = _fwd_and_fwd_bwd(fn, args, wrt, dy, iters, 5, device)
            row += [_rate(fwd_bytes, t_f), _rate(fb_bytes, t_fb)]
        row.append(copy_gbs)
        rows.append(row)
    return rows


def _ce_fwd_bwd(fn: Callable, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
    return torch.autograd.grad(fn(h, w, t), (h, w))


def _lmforge_ce(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # As the trainer calls it: no host-side target range check (a sync); Liger has none either.
    return fused_linear_cross_entropy(h, w, t, backend="triton", check_targets=False)


def bench_cross_entropy(shapes: Sequence[tuple[int, int, int]], iters: int, device: str = "cuda"):
    """Forward + backward ms and extra peak MiB for fused (Triton), unfused torch and Liger."""
    rows: list[list[object]] = []
    impls = [_lmforge_ce, _unfused_ce, _liger_ce()]
    for n, d, v in shapes:
        gen = torch.Generator(device=device).manual_seed(3)
        h = torch.randn(n, d, device=device, generator=gen, dtype=torch.bfloat16)
        w = (torch.randn(v, d, device=device, generator=gen) / math.sqrt(d)).bfloat16()
        h.requires_grad_()
        w.requires_grad_()
        t = torch.randint(0, v, (n,), device=device, generator=gen)
        row: list[object] = [f"{n}×{d}→{v}"]
        for fn in impls:
            if fn is None:
                row += ["-", "-"]
                continue
            call = functools.partial(_ce_fwd_bwd, fn, h, w, t)
            ms = _safe(lambda call=call: time_ms(call, warmup=2, iters=iters, device=device))
            mem = _safe(lambda call=call: peak_extra_bytes(call) / MIB)  # n/a off CUDA
            row += [ms, mem]
        rows.append(row)
    return rows


def _rope_peer(device: str, t: int, e: int):
    from lmforge.model import RotaryEmbedding

    layer = RotaryEmbedding(10000.0, e, t, device=device)
    positions = torch.arange(t, device=device)
    return layer, (lambda x: layer(x, positions))


def check_elementwise(device: str = "cuda", small: bool = False) -> tuple[list[list[object]], bool]:
    """SwiGLU gate (separate and packed halves) and RoPE vs float64 references next to the torch
    peers' errors (bf16)."""
    gen = torch.Generator(device=device).manual_seed(4)
    n, f = (8, 100) if small else (4099, 2731)
    b, h, t, e = (1, 2, 9, 16) if small else (2, 8, 1000, 128)
    a = torch.randn(n, f, device=device, generator=gen).bfloat16() * 3
    g = torch.randn(n, f, device=device, generator=gen).bfloat16()
    dy = torch.randn(n, f, device=device, generator=gen).bfloat16()
    x = torch.randn(b, h, t, e, device=device, generator=gen).bfloat16()
    dx = torch.randn(b, h, t, e, device=device, generator=gen).bfloat16()
    layer, rope_peer = _rope_peer(device, t, e)
    cos, sin = layer.cos[:t], layer.sin[:t]
    ag = torch.cat([a, g], -1)  # the packed [a | b] layout of one w1/w3 GEMM
    cases = [
        ("swiglu", (a, g), swiglu, swiglu_reference, lambda a, g: F.silu(a) * g, dy),
        ("swiglu packed", (ag,), swiglu_packed, swiglu_packed_reference, _packed_peer, dy),
        ("rope", (x,), lambda x: rope(x, cos, sin), lambda x: rope_reference(x, cos, sin),
         rope_peer, dx),
    ]  # fmt: skip
    rows: list[list[object]] = []
    ok_all = True
    for name, inputs, fast, ref_fn, peer_fn, grad in cases:
        results = []
        for fn, dtype in ((ref_fn, torch.float64), (fast, None), (peer_fn, None)):
            ins = [t.to(dtype or t.dtype).requires_grad_() for t in inputs]
            out = fn(*ins)
            results.append([out, *torch.autograd.grad(out, ins, grad.to(out.dtype))])
        want, got, peer = results
        cells, ok = _judge(got, want, peer, 1.6e-2)
        ok_all &= ok
        rows.append([name, *cells, *(["-"] * (3 - len(cells))), "ok" if ok else "FAIL"])
    return rows, ok_all


def _packed_peer(ab: torch.Tensor) -> torch.Tensor:
    # torch on the packed [a | b] layout: silu of the first half times the second.
    a, b = ab.chunk(2, dim=-1)
    return F.silu(a) * b


def bench_elementwise(iters: int, device: str = "cuda", small: bool = False):
    """GB/s forward and forward + backward of the SwiGLU gate (separate halves and packed) and
    RoPE vs their torch peers."""
    n, f = (64, 256) if small else SWIGLU_SHAPE
    b, h, t, e = (1, 2, 16, 16) if small else ROPE_SHAPE
    a, g = (torch.randn(n, f, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip
    dy = torch.randn(n, f, device=device, dtype=torch.bfloat16)
    x = torch.randn(b, h, t, e, device=device, dtype=torch.bfloat16, requires_grad=True)
    dx = torch.randn_like(x)
    layer, rope_peer = _rope_peer(device, t, e)
    cos, sin = layer.cos[:t], layer.sin[:t]
    el = 2  # bytes per bf16 element
    ag = torch.randn(n, 2 * f, device=device, dtype=torch.bfloat16, requires_grad=True)
    cases = [
        ("swiglu", (a, g), (a, g), dy, swiglu, lambda a, g: F.silu(a) * g,
         3 * n * f * el, 8 * n * f * el),
        ("swiglu packed", (ag,), (ag,), dy, swiglu_packed, _packed_peer,
         3 * n * f * el, 8 * n * f * el),
        ("rope", (x,), (x,), dx, lambda x: rope(x, cos, sin), rope_peer,
         2 * x.numel() * el, 4 * x.numel() * el),
    ]  # fmt: skip
    rows: list[list[object]] = []
    for name, args, wrt, grad, fast, peer, fwd_bytes, fb_bytes in cases:
        row: list[object] = [name, "×".join(map(str, args[0].shape))]
        for fn in (fast, peer):
            t_f, t_fb = _fwd_and_fwd_bwd(fn, args, wrt, grad, iters, 5, device)
            row += [_rate(fwd_bytes, t_f), _rate(fb_bytes, t_fb)]
        rows.append(row)
    return rows


def _tuned_configs() -> list[str]:
    # Which autotuned attention configs won, per kernel and key (for tuning notes).
    try:
        from lmforge.kernels import _flash_triton
    except ImportError:
        return []
    lines = []
    for (kind, dim_class), tuner in _flash_triton.tuned_kernels().items():
        for key, cfg in getattr(tuner, "cache", {}).items():
            lines.append(f"{kind}/{dim_class} key={key}: {cfg}")
    return lines


# ------------------------------------------------------------------------------------- main


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of the kernel benchmark (shared by the CLI and ``benchmarks/kernels.py``)."""
    p = parser or argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SUITES), help="comma list of " + ",".join(SUITES))
    p.add_argument("--seqs", default=",".join(map(str, ATTN_SEQS)), help="attention lengths")
    p.add_argument("--dims", default=",".join(map(str, ATTN_DIMS)), help="attention head dims")
    p.add_argument("--iters", type=int, default=10, help="timed calls per measurement")
    p.add_argument("--quick", action="store_true", help="one length and dim per suite")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--results", metavar="FILE", help="append the tables to this markdown file")
    return p


def run(args: argparse.Namespace, command: str) -> int:
    """Run the selected suites; print tables; append to ``args.results``. Returns 0, or 1 when a
    correctness check failed (timings are still printed)."""
    from lmforge.utils.errors import LmforgeError

    if not torch.cuda.is_available():
        raise LmforgeError("bench kernels needs a CUDA GPU (none visible to torch)")
    suites = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        raise LmforgeError(f"--only: unknown suite(s) {unknown}; choose from {list(SUITES)}")
    seqs = [int(s) for s in args.seqs.split(",")]
    dims = [int(s) for s in args.dims.split(",")]
    rms_shapes, ce_shapes = RMS_SHAPES, CE_SHAPES
    if args.quick:
        seqs, dims, rms_shapes, ce_shapes = seqs[:1], dims[-1:], RMS_SHAPES[1:2], CE_SHAPES[:1]
    out: list[str] = [f"`{command}` — {environment_line()}"]

    def emit(text: str) -> None:
        print(text, flush=True)
        out.append(text)

    all_ok = True
    if not args.no_check:
        emit("\n### Correctness (max abs error vs float64; peer's own error in parentheses)\n")
        if "attention" in suites:
            rows, ok = check_attention()
            all_ok &= ok
            header = ["dtype", "E", "causal", "B×H/K×T", "O", "dq", "dk", "dv", "ok"]
            emit("Attention (peer: torch SDPA, same dtype)\n\n" + markdown_table(header, rows))
        if "rmsnorm" in suites:
            rows, ok = check_rms_norm()
            all_ok &= ok
            header = ["dtype", "N×D", "y", "dx", "dw", "ok"]
            emit("\nRMSNorm (peer: F.rms_norm)\n\n" + markdown_table(header, rows))
        if "ce" in suites:
            rows, ok = check_cross_entropy()
            all_ok &= ok
            header = ["N×D→V", "z-loss", "loss", "dh", "dW", "ok"]
            emit("\nLinear + CE, bf16 (peer: unfused bf16 matmul + fp32 CE)\n\n" + markdown_table(header, rows))  # fmt: skip
        if "elementwise" in suites:
            rows, ok = check_elementwise()
            all_ok &= ok
            header = ["op", "y", "d(first input)", "d(second input)", "ok"]
            emit("\nSwiGLU gate and RoPE, bf16 (peers: F.silu·b, lmforge.model.RotaryEmbedding)\n\n"
                 + markdown_table(header, rows))  # fmt: skip
    if "attention" in suites:
        rows = bench_attention(seqs, dims, args.iters)
        header = ["E", "S", "B×H", "triton fwd", "triton f+b", "sdpa-flash fwd", "sdpa-flash f+b",
                  "cudnn fwd", "cudnn f+b"]  # fmt: skip
        emit(
            "\n### Attention, causal bf16, TFLOP/s (fwd = 4·B·H·S²·E/2 FLOPs; f+b = 3.5 × fwd)\n\n"
            + markdown_table(header, rows)
        )
        tuned = _tuned_configs()
        if tuned:
            emit("\nAutotuned configs:\n" + "\n".join(f"- {line}" for line in tuned))
    if "rmsnorm" in suites:
        copy = copy_bandwidth_gbs()
        rows = bench_rms_norm(rms_shapes, max(args.iters, 20), copy)
        header = ["N×D", "triton fwd", "triton f+b", "torch fwd", "torch f+b", "liger fwd",
                  "liger f+b", "copy"]  # fmt: skip
        emit("\n### RMSNorm, bf16, GB/s (device copy bandwidth in the last column)\n\n"
             + markdown_table(header, rows))  # fmt: skip
    if "ce" in suites:
        rows = bench_cross_entropy(ce_shapes, args.iters)
        header = ["N×D→V", "lmforge ms", "lmforge MiB", "torch ms", "torch MiB", "liger ms",
                  "liger MiB"]  # fmt: skip
        emit("\n### Linear + cross-entropy, bf16, forward + backward: ms and extra peak MiB\n\n"
             + markdown_table(header, rows))  # fmt: skip
    if "elementwise" in suites:
        rows = bench_elementwise(max(args.iters, 20))
        header = ["op", "shape", "triton fwd", "triton f+b", "torch fwd", "torch f+b"]
        emit("\n### SwiGLU gate and RoPE, bf16, GB/s (reads + writes of the activations)\n\n"
             + markdown_table(header, rows))  # fmt: skip
    if not all_ok:
        emit("\nA correctness check FAILED (see the tables above).")
    if args.results:
        _append_results(args.results, out)
    return 0 if all_ok else 1


def _append_results(path: str, lines: list[str]) -> None:
    from pathlib import Path

    from lmforge.utils.io import atomic_write_text

    target = Path(path)
    old = target.read_text(encoding="utf-8") if target.exists() else "# Benchmark results\n"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    entry = f"\n## Kernels — {stamp}\n\n" + "\n".join(lines) + "\n"
    atomic_write_text(target, old.rstrip("\n") + "\n" + entry)
    print(f"appended to {target}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lmforge.bench.kernels`` entry (same flags as ``lmforge bench kernels``)."""
    args = build_parser().parse_args(argv)
    return run(args, "python -m lmforge.bench.kernels " + " ".join(argv or sys.argv[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
