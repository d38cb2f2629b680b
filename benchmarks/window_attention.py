"""Sliding-window attention (the W layers' training path): lmforge's windowed FlashAttention-2
kernel against torch SDPA on the same shapes, forward + backward.

Correctness first, on the device (a failed check exits 1; the table still prints): O and dq,
dk, dv of the windowed kernel against the float64 masked reference
(``lmforge.kernels.attention_reference(..., window=W)``), bf16, ragged lengths, GQA.

Then, per (T, W) at B·T = ``--tokens`` tokens, ``--heads`` heads of ``--dim`` (bf16, causal):
the median f+b time (CUDA events, ``--iters`` after warm-up) of
  * ``lmforge window``: ``flash_attention(q, k, v, window=W)`` (tiles outside the window skipped),
  * ``sdpa mask``: ``F.scaled_dot_product_attention`` with the explicit (T, T) window mask (what
    a W layer costs without the kernel: torch's SDPA has no window argument),
  * ``sdpa causal``: SDPA's full causal attention (flash / cuDNN backends as torch picks them:
    the cost a W layer would have as an A layer),
and the windowed kernel's TFLOP/s on the window's FLOPs (f+b = 3.5 × the forward's
4·B·H·E·Σ_i min(i + 1, W)).

    PYTHONPATH=src python benchmarks/window_attention.py
    PYTHONPATH=src python benchmarks/window_attention.py --seqs 8192,16384 --windows 512,4096
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/window_attention.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

import torch
import torch.nn.functional as F


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__[: __doc__.index("    PYTHONPATH")].rstrip(),
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--seqs", default="4096,8192,16384", help="sequence lengths T")
    p.add_argument("--windows", default="512,1024,4096", help="windows W (W < T rows only)")
    p.add_argument("--tokens", type=int, default=32768, help="B·T")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="the correctness check on tiny shapes")
    p.add_argument("--out", type=Path, default=None, help="write results.json here")
    return p


def check(device: str, dtype: torch.dtype) -> bool:
    """The windowed kernel against the float64 masked reference (O and every gradient)."""
    from lmforge.kernels import attention_reference, flash_attention

    ok = True
    gen = torch.Generator(device=device).manual_seed(0)
    for b, h, kv, t, e, w in ((2, 8, 2, 1000, 128, 256), (1, 4, 4, 777, 64, 100),
                              (1, 2, 1, 515, 128, 512), (1, 2, 2, 333, 64, 1)):  # fmt: skip
        if device == "cpu":  # the interpreter: tiny shapes, windows still shorter than T
            t, e, w = min(t, 70), 16, min(w, 20)
        q = torch.randn(b, h, t, e, device=device, generator=gen, dtype=dtype)
        k = torch.randn(b, kv, t, e, device=device, generator=gen, dtype=dtype)
        v = torch.randn(b, kv, t, e, device=device, generator=gen, dtype=dtype)
        do = torch.randn(b, h, t, e, device=device, generator=gen, dtype=dtype)
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_in = [x.double().requires_grad_() for x in (q, k, v)]
        out = flash_attention(*ins, is_causal=True, window=w)
        ref = attention_reference(*ref_in, is_causal=True, window=w)
        got = [out, *torch.autograd.grad(out, ins, do)]
        want = [ref, *torch.autograd.grad(ref, ref_in, do.double())]
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        errs = [(a.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
                for a, r in zip(got, want, strict=True)]  # fmt: skip
        good = all(x <= tol for x in errs)
        ok &= good
        print(f"check B{b} H{h} K{kv} T{t} E{e} W{w}: O/dq/dk/dv rel. error "
              + " ".join(f"{x:.1e}" for x in errs) + (" ok" if good else " FAILED"))  # fmt: skip
    return ok


def _fb_ms(fn, ins, do, iters: int) -> float:
    for _ in range(2):
        torch.autograd.grad(fn(*ins), ins, do)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.autograd.grad(fn(*ins), ins, do)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench(a: argparse.Namespace) -> list[dict]:
    from lmforge.kernels import flash_attention
    from lmforge.model.attention import sliding_window_mask

    rows = []
    h, kv, e = a.heads, a.kv_heads, a.dim
    for t in (int(x) for x in a.seqs.split(",")):
        b = max(1, a.tokens // t)
        gen = torch.Generator(device="cuda").manual_seed(t)
        q, k, v, do = (torch.randn(b, n, t, e, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for n in (h, kv, kv, h))  # fmt: skip
        ins = [x.requires_grad_() for x in (q, k, v)]
        full = _fb_ms(lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=h != kv), ins, do, a.iters)  # fmt: skip
        for w in (int(x) for x in a.windows.split(",")):
            if w >= t:
                continue
            ours = _fb_ms(lambda q, k, v, w=w: flash_attention(q, k, v, window=w), ins, do,
                          a.iters)  # fmt: skip
            mask = sliding_window_mask(t, w, torch.device("cuda"))  # (T, T) the W layer's
            try:
                masked = _fb_ms(lambda q, k, v, m=mask: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=m, enable_gqa=h != kv), ins, do, a.iters)  # fmt: skip
            except torch.OutOfMemoryError:
                masked = float("nan")
            pairs = sum(min(i + 1, w) for i in range(t))  # (query, key) pairs per head
            flops = 3.5 * 4.0 * b * h * e * pairs
            row = {"T": t, "B": b, "W": w, "ours_ms": ours, "sdpa_mask_ms": masked,
                   "sdpa_causal_ms": full, "vs_mask": masked / ours, "vs_causal": full / ours,
                   "ours_TFLOPs": flops / ours / 1e9}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    a = _parser().parse_args()
    ok = check(a.device, torch.float32 if a.device == "cpu" else torch.bfloat16)
    rows = [] if a.quick or a.device != "cuda" else bench(a)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)},
                                                        "rows": rows}, indent=2))  # fmt: skip
    if rows:
        print(
            f"\nf+b, bf16, causal, {a.heads} heads ({a.kv_heads} kv) x {a.dim}, "
            f"B·T = {a.tokens}; {torch.cuda.get_device_name()}, torch {torch.__version__}"
        )
        print(f"{'T':>6} {'W':>6} {'ours ms':>9} {'SDPA mask ms':>13} {'SDPA causal ms':>15} "
              f"{'vs mask':>8} {'vs causal':>10} {'TFLOP/s':>8}")  # fmt: skip
        for r in rows:
            print(f"{r['T']:>6} {r['W']:>6} {r['ours_ms']:>9.3f} {r['sdpa_mask_ms']:>13.3f} "
                  f"{r['sdpa_causal_ms']:>15.3f} {r['vs_mask']:>7.2f}x {r['vs_causal']:>9.2f}x "
                  f"{r['ours_TFLOPs']:>8.1f}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
