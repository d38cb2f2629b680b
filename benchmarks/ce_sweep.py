"""Fused linear + cross-entropy on one GPU: where the time goes, and which launch choices win.

Correctness first (every variant against a float64 reference, then loss and gradients within
bf16 tolerance), then forward + backward time (warmup, CUDA events, median; see
``lmforge.bench.timing.time_ms``) and extra peak memory for each variant of lmforge's fused op
next to unfused torch (bf16 matmul + fp32 cross-entropy) and Liger-Kernel (when installed),
then a torch-profiler table of the default variant's CUDA kernels. Variants: rows per chunk
(memory against fewer, larger GEMMs and fewer read-modify-write passes over dW) and the chunk
kernel's launch for long rows. First, the chunk kernel alone at the chunk shapes over its launch
configs. (Split-row schedules — two kernels, or one with row slices held in registers and a
per-row wait — persistent programs, and a hand split-K of dh were measured slower:
benchmarks/RESULTS.md.)
Shapes are the kernels issue's: N=16384 rows, (D, V) = (768, 50304) and (2048, 128256).

    PYTHONPATH=src python benchmarks/ce_sweep.py
    PYTHONPATH=src python benchmarks/ce_sweep.py --shapes 16384x768x50304 --iters 20
    PYTHONPATH=src python benchmarks/ce_sweep.py --launches
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

MIB = 2**20


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shapes", default="16384x768x50304,16384x2048x128256", help="NxDxV,...")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--kernel-shapes",
        default="256x50304,512x50304,512x128256",
        help="ROWSxV chunk shapes for the chunk-kernel sweep ('' skips it)",
    )
    p.add_argument(
        "--launches",
        action="store_true",
        help="only the chunk kernel's launch sweep, alone and inside the op, next to Liger",
    )
    p.add_argument("--results", help="append the tables to this markdown file")
    return p.parse_args()


def _variants() -> list[dict]:
    return [
        {"chunk": 0, "long": None},
        {"chunk": 0, "long": (32768, 32)},
        {"chunk": 1024, "long": None},
    ]


def _name(variant: dict) -> str:
    chunk = variant["chunk"] or "default"
    long = variant["long"]
    launch = f"rows > 65536: BLOCK_V {long[0]}, {long[1]} warps" if long else "default launch"
    return f"chunk {chunk}, {launch}"


def _call(variant: dict):
    from lmforge.kernels import _cross_entropy_triton as k
    from lmforge.kernels import fused_linear_cross_entropy

    def ours(h, w, t, **kw):
        before = (k.LONG_BLOCK_V, k.LONG_WARPS)
        k.LONG_BLOCK_V, k.LONG_WARPS = variant["long"] or before
        try:  # as the trainer calls it: no target check, no host sync
            return fused_linear_cross_entropy(
                h, w, t, backend="triton", chunk_rows=variant["chunk"] or None,
                check_targets=False, **kw,
            )  # fmt: skip
        finally:
            k.LONG_BLOCK_V, k.LONG_WARPS = before

    return ours


def _kernel_sweep(shapes: list[tuple[int, int]], iters: int) -> list[str]:
    """The chunk step alone on (rows, V) bf16 logits over launch configs (slice width, warps),
    each checked against the default launch first."""
    import functools

    import torch

    from lmforge.bench.timing import copy_bandwidth_gbs, markdown_table, time_ms
    from lmforge.kernels import _cross_entropy_triton as k

    bw = copy_bandwidth_gbs()
    out = []
    for rows_n, v in shapes:
        gen = torch.Generator(device="cuda").manual_seed(1)
        z0 = (torch.randn(rows_n, v, device="cuda", generator=gen) * 3).bfloat16()
        t = torch.randint(0, v, (rows_n,), device="cuda", generator=gen)
        scale = torch.full((1,), 1.0 / rows_n, device="cuda").expand(rows_n)
        loss = torch.empty(rows_n, device="cuda")
        ref, ref_loss = z0.clone(), torch.empty(rows_n, device="cuda")
        k.loss_and_grad_(ref, t, scale, -100, 0.0, True, ref_loss)
        z = z0.clone()
        floor = 3 * z.numel() * 2 / (bw * 1e9) * 1e3  # read, read again, write
        table = []
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        launches = [(8192, 16, 0), (16384, 16, 0), (16384, 32, 0), (32768, 16, 0), (32768, 32, 0)]
        # Persistent: fewer rows in flight, so each row's second read may come from L2.
        launches += [(8192, 16, per_sm) for per_sm in (1, 2, 3)]
        for block, warps, per_sm in launches:
            cfg = [block, warps, per_sm or "one a row"]
            kw = {"block": block, "num_warps": warps, "programs": per_sm * sms or None}
            try:
                z.copy_(z0)
                k.loss_and_grad_(z, t, scale, -100, 0.0, True, loss, **kw)
                # Other slice widths sum in another order: equal within rounding.
                same = (z.float() - ref.float()).abs().max().item() <= 1e-3 and (
                    torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
                )
                if not same:
                    table.append([*cfg, "MISMATCH", "-"])
                    continue
                step = functools.partial(k.loss_and_grad_, z, t, scale, -100, 0.0, True, loss, **kw)
                ms = time_ms(step, 3, iters)
                table.append([*cfg, round(ms * 1e3, 1), round(ms / floor, 2)])
            except Exception as e:  # a config that does not compile is reported
                table.append([*cfg, f"failed: {type(e).__name__}"[:60], "-"])
            print(f"kernel {rows_n}x{v} {table[-1]}", file=sys.stderr)
        out += [
            f"### Chunk step alone, {rows_n}×{v} bf16 logits (µs; three-pass floor "
            f"{floor * 1e3:.1f} µs, two-pass {floor * 2e3 / 3:.1f} µs, at the copy bandwidth "
            f"{bw:,.0f} GB/s)",
            "",
            markdown_table(["BLOCK_V", "warps", "programs per SM", "µs", "× 3-pass floor"], table),
            "",
        ]
    return out


# Chunk-kernel launches (BLOCK_V, warps) timed alone and inside the op by --launches.
LAUNCHES_LONG = [(16384, 32), (16384, 16), (32768, 32), (8192, 16), (8192, 32), (4096, 16)]
LAUNCHES_SHORT = [(8192, 16), (8192, 32), (4096, 8), (4096, 16), (16384, 32)]


def _kernel_us_in_op(fn, name: str) -> float:
    """Mean GPU µs per launch of the kernels whose name contains ``name`` during ``fn()``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    total, count = 0.0, 0
    for ev in prof.key_averages():
        if name in ev.key:
            total += getattr(ev, "device_time_total", 0.0) or ev.cuda_time_total
            count += ev.count
    return total / max(count, 1)


def _launch_sweep(n: int, d: int, v: int, iters: int) -> list[str]:
    """The chunk kernel's launches, each timed three ways: alone on one chunk's logits, inside
    the whole fused op (profiler, per launch) and the whole op; Liger's kernel and op in the
    same run."""
    import functools

    import torch

    from lmforge.bench.kernels import _liger_ce
    from lmforge.bench.timing import markdown_table, time_ms
    from lmforge.kernels import _cross_entropy_triton as k
    from lmforge.kernels import fused_linear_cross_entropy
    from lmforge.kernels.cross_entropy import default_chunk_rows

    gen = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(n, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=gen) / math.sqrt(d)).bfloat16()
    w.requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    rows_n = default_chunk_rows(n, d, v)
    z0 = (torch.randn(rows_n, v, device="cuda", generator=gen) * 3).bfloat16()
    tc = t[:rows_n].contiguous()
    scale = torch.full((1,), 1.0 / rows_n, device="cuda").expand(rows_n)
    loss = torch.empty(rows_n, device="cuda")
    z = z0.clone()

    def op():
        out = fused_linear_cross_entropy(h, w, t, backend="triton", check_targets=False)
        return torch.autograd.grad(out, (h, w))

    liger = _liger_ce()

    def lig():
        return torch.autograd.grad(liger(h, w, t), (h, w))

    saved = k.launch_config

    def use(block: int, warps: int) -> None:
        k.launch_config = lambda _v: (block, warps)  # the op's launch, too

    def restore() -> None:
        k.launch_config = saved

    # Wall times first: after a torch.profiler session the host launches more slowly, and a
    # chunked op of hundreds of launches would be timed host-bound.
    launches = LAUNCHES_LONG if v > k.LONG_ROW else LAUNCHES_SHORT
    table = [["Liger", "-", "-", "-", "-", round(time_ms(lig, 2, iters), 2)]] if liger else []
    for block, warps in launches:
        name = "lmforge" + (" (default)" if (block, warps) == saved(v) else "")
        try:
            use(block, warps)
            step = functools.partial(k.loss_and_grad_, z, tc, scale, -100, 0.0, True, loss)
            alone = time_ms(step, 3, iters) * 1e3
            table.append(
                [name, block, warps, round(alone, 1), "-", round(time_ms(op, 2, iters), 2)]
            )
        except Exception as e:  # a launch that fails to compile is reported
            table.append([name, block, warps, f"failed: {type(e).__name__}"[:60], "-", "-"])
        finally:
            restore()
        print(f"launch {n}x{d}x{v} {table[-1]}", file=sys.stderr)
    # Then each kernel's GPU time per launch inside the op, from the profiler.
    if liger:
        table[0][4] = round(_kernel_us_in_op(lig, "liger_cross_entropy"), 1)
    for row, (block, warps) in zip(table[1 if liger else 0 :], launches):
        if row[4] == "-" and not str(row[3]).startswith("failed"):
            try:
                use(block, warps)
                row[4] = round(_kernel_us_in_op(op, "_ce_row"), 1)
            finally:
                restore()
    return [
        f"### Chunk-kernel launches, N×D→V = {n}×{d}→{v} ({rows_n}-row chunks)",
        "",
        markdown_table(
            ["kernel", "BLOCK_V", "warps", "alone µs", "in the op µs/launch", "op fwd+bwd ms"],
            table,
        ),
        "",
    ]


def _check(variants: list[dict]) -> bool:
    import torch

    from lmforge.kernels import linear_cross_entropy_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 1000, 256, 20011
    h = torch.randn(n, d, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(v, d, device="cuda", generator=gen) / math.sqrt(d)).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    t[::7] = -100
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    ref = linear_cross_entropy_reference(hr, wr, t, z_loss=1e-4)
    want = torch.autograd.grad(ref, (hr, wr))
    ok = True
    for variant in variants:
        ht, wt = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = _call(variant)(ht, wt, t, z_loss=1e-4)
        got = torch.autograd.grad(loss, (ht, wt))
        errs = [abs(loss.item() - ref.item())] + [
            ((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)
        ]
        good = errs[0] < 2e-3 and max(errs[1:]) < 2e-2
        ok &= good
        print(
            f"check {_name(variant)}: |Δloss| {errs[0]:.1e}, rel dh {errs[1]:.1e}, "
            f"rel dW {errs[2]:.1e} {'ok' if good else 'FAIL'}",
            file=sys.stderr,
        )
    return ok


def _profile_table(fn, top: int = 12) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)


def main() -> int:
    args = _parse()
    import torch

    from lmforge.bench.timing import environment_line

    if not torch.cuda.is_available():
        print("ce_sweep.py: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    variants = _variants()
    if not _check(variants):
        print("ce_sweep.py: correctness check failed", file=sys.stderr)
        return 1
    out = [f"## ce_sweep — {environment_line()}", ""]
    if args.launches:
        for spec in args.shapes.split(","):
            out += _launch_sweep(*(int(x) for x in spec.split("x")), args.iters)
            torch.cuda.empty_cache()
        args.kernel_shapes, args.shapes = "", ""
    if args.kernel_shapes:
        shapes = [tuple(int(x) for x in sp.split("x")) for sp in args.kernel_shapes.split(",")]
        out += _kernel_sweep(shapes, args.iters)
    for spec in filter(None, args.shapes.split(",")):
        n, d, v = (int(x) for x in spec.split("x"))
        out += _shape(n, d, v, variants, args.iters)
        torch.cuda.empty_cache()
    text = "\n".join(out)
    print(text)
    if args.results:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write("\n" + text + "\n")
    return 0


def _shape(n: int, d: int, v: int, variants: list[dict], iters: int) -> list[str]:
    import functools

    import torch

    from lmforge.bench.kernels import _liger_ce, _unfused_ce
    from lmforge.bench.timing import markdown_table, peak_extra_bytes, time_ms

    gen = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(v, d, device="cuda", generator=gen) / math.sqrt(d)).bfloat16()
    h.requires_grad_()
    w.requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)

    def fwd_bwd(fn):
        return torch.autograd.grad(fn(h, w, t), (h, w))

    rows: list[list[object]] = []
    liger = _liger_ce()
    peers = [("torch unfused", _unfused_ce)] + ([("liger", liger)] if liger else [])
    for name, fn in peers:
        call = functools.partial(fwd_bwd, fn)
        rows.append([name, time_ms(call, 2, iters), peak_extra_bytes(call) / MIB])
    for variant in variants:
        call = functools.partial(fwd_bwd, _call(variant))
        try:
            rows.append([_name(variant), time_ms(call, 2, iters), peak_extra_bytes(call) / MIB])
        except Exception as e:  # a variant that fails to launch is reported, not fatal
            rows.append([_name(variant), f"failed: {type(e).__name__}: {e}"[:80], "-"])
        print(f"{n}x{d}x{v} {rows[-1]}", file=sys.stderr)
    floor = 6 * n * d * v / 700e12 * 1e3
    out = [
        f"### N×D→V = {n}×{d}→{v} (GEMM floor at 700 TFLOP/s: {floor:.1f} ms)",
        "",
        markdown_table(["variant", "fwd+bwd ms", "extra MiB"], rows),
        "",
    ]
    out += [
        "CUDA kernels of one fwd+bwd, default variant:",
        "```",
        _profile_table(functools.partial(fwd_bwd, _call(variants[0]))),
        "```",
        "",
    ]
    if liger:
        out += [
            "CUDA kernels of one fwd+bwd, Liger-Kernel:",
            "```",
            _profile_table(functools.partial(fwd_bwd, liger)),
            "```",
            "",
        ]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
