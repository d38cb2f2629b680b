"""The packed RoPE kernel's launches, side by side: GB/s of split (forward) and join (backward).

``lmforge.kernels.rope_packed`` rotates the q‖k GEMM's (B, T, (Hq+Hk)·E) output into q and k
(split) and, in backward, rotates dq and dk back into one packed gradient (join). Its launch is
chosen by module constants of ``lmforge.kernels._elementwise_triton``: ``ROPE_PACKED_TOKENS = 0``
is the per-row launch (each program a run of (token, head) rows), otherwise each program takes
ROPE_PACKED_TOKENS tokens × ROPE_PACKED_HEADS heads of one side with ROPE_PACKED_WARPS warps.
Correctness first: every launch's outputs equal the per-row launch's bit for bit, and the
per-row launch is within bf16 rounding of the float64 reference. Then CUDA-event medians and
GB/s (calls replayed from a CUDA graph) of the bytes each direction must move (read the packed buffer, write q and k, or the
reverse) against the device copy bandwidth measured in the same run.

    PYTHONPATH=src python benchmarks/rope_packed_bench.py
    PYTHONPATH=src python benchmarks/rope_packed_bench.py --launches 0,4x4x1,16x4x4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

import torch


def _median_ms(fn, iters: int, calls: int = 10) -> float:
    """Median GPU time of one call: ``calls`` calls captured in a CUDA graph, the graph's replays
    timed with CUDA events (the host's launch cost, ~60 µs a call here, would otherwise exceed
    the kernel's own ~50 µs and the events would time the host)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    pairs = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) / calls


def _copy_ms(like: torch.Tensor, iters: int) -> float:
    """GPU time of a device copy of a tensor like ``like`` (the same bytes read and written as
    one direction of the kernel), timed as the kernels are."""
    src, dst = torch.empty_like(like), torch.empty_like(like)
    return _median_ms(lambda: dst.copy_(src), iters)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])  # fmt: skip
    p.add_argument("--tokens", type=int, default=32768, help="B·T (default 32768)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", default="12,12", help="Hq,Hk (default 12,12)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--launches", default="0,4x4x1,8x2x1,8x4x2,16x4x4",
                   help="TOKENSxHEADSxWARPS launches to measure (0 = per-row)")  # fmt: skip
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--results", type=Path, help="append the table to this markdown file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("rope_packed_bench.py: needs a CUDA device", file=sys.stderr)
        return 2
    from lmforge.kernels import _elementwise_triton as ew
    from lmforge.kernels import rope_packed_reference

    hq, hk = (int(x) for x in args.heads.split(","))
    e, t = args.head_dim, args.seq
    b = args.tokens // t
    torch.manual_seed(0)
    packed = torch.randn(b, t, (hq + hk) * e, device="cuda").to(torch.bfloat16)
    pos = torch.arange(t, device="cuda", dtype=torch.float32)
    inv = 1.0 / 10000 ** (torch.arange(0, e, 2, device="cuda", dtype=torch.float32) / e)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    nbytes = 2 * packed.numel() * packed.element_size()  # read once, write once
    copy_us = 1e3 * _copy_ms(packed, args.iters)
    copy_gbs = nbytes / copy_us / 1e3
    saved = (ew.ROPE_PACKED_TOKENS, ew.ROPE_PACKED_HEADS, ew.ROPE_PACKED_WARPS)

    def set_launch(spec: str) -> None:
        if spec == "0":
            ew.ROPE_PACKED_TOKENS = 0
            return
        tok, heads, warps = (int(x) for x in spec.split("x"))
        ew.ROPE_PACKED_TOKENS, ew.ROPE_PACKED_HEADS, ew.ROPE_PACKED_WARPS = tok, heads, warps

    rows, ref = [], None
    try:
        for spec in args.launches.split(","):
            set_launch(spec)
            q, k = ew.rope_packed(packed, None, None, cos, sin, hq, hk, False)
            back = ew.rope_packed(None, q, k, cos, sin, hq, hk, True)
            torch.cuda.synchronize()
            if ref is None:
                rq, rk = rope_packed_reference(packed.double(), cos.double(), sin.double(), hq, hk)
                err = max(
                    (q.double() - rq).abs().max().item(), (k.double() - rk).abs().max().item()
                )
                ok = err <= 2.0**-7 * max(rq.abs().max().item(), rk.abs().max().item())
                ref = (q, k, back)
                check = f"max |error| vs float64 {err:.2e}" + ("" if ok else " FAILED")
            else:
                same = all(torch.equal(x, y) for x, y in zip((q, k, back), ref, strict=True))
                check = "bit-identical to per-row" if same else "DIFFERS from per-row"
            split = _median_ms(lambda: ew.rope_packed(packed, None, None, cos, sin, hq, hk,
                                                      False), args.iters)  # fmt: skip
            join = _median_ms(lambda q=q, k=k: ew.rope_packed(None, q, k, cos, sin, hq, hk,
                                                              True), args.iters)  # fmt: skip
            rows.append(
                f"| {'per-row' if spec == '0' else spec} | {1e3 * split:.1f} | "
                f"{nbytes / split / 1e6:,.0f} ({nbytes / split / 1e6 / copy_gbs:.0%}) | "
                f"{1e3 * join:.1f} | {nbytes / join / 1e6:,.0f} ({nbytes / join / 1e6 / copy_gbs:.0%})"
                f" | {check} |"
            )
            print(rows[-1], file=sys.stderr)
    finally:
        ew.ROPE_PACKED_TOKENS, ew.ROPE_PACKED_HEADS, ew.ROPE_PACKED_WARPS = saved
    text = "\n".join([
        f"## benchmarks/rope_packed_bench.py — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {b}×{t} tokens, "
        f"Hq={hq}, Hk={hk}, E={e}, bf16; {nbytes / 1e6:.0f} MB moved each way; device copy "
        f"{copy_us:.1f} µs ({copy_gbs:,.0f} GB/s) for a copy of the same bytes in this run",
        "",
        "| launch (tokens×heads×warps) | split µs | split GB/s (× copy) | join µs "
        "| join GB/s (× copy) | check |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ])  # fmt: skip
    print(text)
    if args.results:
        with args.results.open("a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
