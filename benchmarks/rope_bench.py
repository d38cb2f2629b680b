"""RoPE as the model runs it, under torch.compile: forward + backward of q and k of one layer.

Shape: GPT-2-small training (batch 32, 12 heads, 1024 positions, head dim 64), bf16 q and k as
the projections write them, (B, T, H, E), rotated through the (B, H, T, E) transposed view the
attention takes. Rows: the model's current formulation (one element-wise expression over the
(x[2i], x[2i+1]) pairs and their swap), the previous one (rotate the even and odd halves, then
re-interleave with stack), and lmforge's Triton RoPE op (on a contiguous copy of the transposed
view, and on the (B, T, H, E) layout before the transpose, as ``model.rope='triton'`` runs it).
Correctness first (outputs and gradients of the two formulations must be equal, and every row
within bf16 tolerance of a float64 reference), then GPU time (``lmforge.bench.timing.time_ms``) and the floor: bytes moved (read
q, k; write both; the same in backward) over the measured device copy bandwidth.

    PYTHONPATH=src python benchmarks/rope_bench.py
    PYTHONPATH=src python benchmarks/rope_bench.py --batch 8 --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--results", help="append the table to this markdown file")
    p.add_argument("--best-out", help="write the fastest Triton launch as ELEMS,WARPS to this file")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the code paths only")
    return p.parse_args()


# (elements per program, warps) launches of the Triton kernel timed alone
ROPE_CONFIGS = [(2048, 4), (4096, 4), (8192, 8), (1024, 2), (2048, 2), (4096, 8)]


def _previous(rope, x, positions):  # the formulation the model used before (for the A/B)
    import torch

    cos = rope.cos[positions].float()
    sin = rope.sin[positions].float()
    x32 = x.float()
    x_even, x_odd = x32[..., 0::2], x32[..., 1::2]
    out = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def main() -> int:
    import torch

    from lmforge.bench.timing import time_ms
    from lmforge.model.layers import RotaryEmbedding

    args = _parse()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("benchmarks/rope_bench.py needs a CUDA GPU", file=sys.stderr)
        return 1
    b, h, t, e = args.batch, args.heads, args.seq, args.head_dim
    rope = RotaryEmbedding(10000.0, e, t, device=dev)
    positions = torch.arange(t, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)

    def inputs():
        q = torch.randn(b, t, h, e, device=dev, generator=gen, dtype=torch.bfloat16)
        k = torch.randn(b, t, h, e, device=dev, generator=gen, dtype=torch.bfloat16)
        return q.requires_grad_(), k.requires_grad_()

    def current(q, k):
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, E) views
        return rope(qt, positions), rope(kt, positions)

    def previous(q, k):
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        return _previous(rope, qt, positions), _previous(rope, kt, positions)

    impls = {"current (pairs and swap)": current, "previous (halves + stack)": previous}
    try:
        from lmforge.kernels.rope import rope as rope_triton

        def triton_op(q, k):
            cos, sin = rope.cos[:t], rope.sin[:t]
            qt = q.transpose(1, 2).contiguous()
            kt = k.transpose(1, 2).contiguous()
            return rope_triton(qt, cos, sin), rope_triton(kt, cos, sin)

        def triton_heads(q, k):  # as model.rope='triton' runs it: before the transpose
            cos, sin = rope.cos[:t], rope.sin[:t]
            qo = rope_triton(q, cos, sin, seq_dim=-3)
            ko = rope_triton(k, cos, sin, seq_dim=-3)
            return qo.transpose(1, 2), ko.transpose(1, 2)

        if dev == "cuda":
            impls["lmforge Triton op (after .contiguous())"] = triton_op
            impls["lmforge Triton op on (B, T, H, E), model.rope='triton'"] = triton_heads
    except ImportError:
        pass

    # Correctness: the formulations agree exactly (eager), and with a float64 reference.
    q, k = inputs()
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    outs = {}
    for name, fn in impls.items():
        qo, ko = fn(q, k)
        grads = torch.autograd.grad((qo, ko), (q, k), (dq.transpose(1, 2), dk.transpose(1, 2)))
        outs[name] = (qo, ko, *grads)
    q64 = q.detach().double().requires_grad_()
    ref = _previous(rope, q64.transpose(1, 2), positions)
    (ref_g,) = torch.autograd.grad(ref, q64, dq.double().transpose(1, 2))
    a, p_ = outs["current (pairs and swap)"], outs["previous (halves + stack)"]
    assert all(torch.equal(x, y) for x, y in zip(a, p_)), "formulations differ"
    err = (a[0].double() - ref).abs().max().item()
    gerr = (a[2].double() - ref_g).abs().max().item()
    assert err < 2e-2 and gerr < 2e-2, (err, gerr)
    print(f"correctness: formulations equal; vs float64 |Δ| out {err:.1e}, grad {gerr:.1e}")
    for name, got in outs.items():  # every implementation within bf16 rounding of float64
        e_out = (got[0].double() - ref).abs().max().item()
        e_grad = (got[2].double() - ref_g).abs().max().item()
        assert e_out < 2e-2 and e_grad < 2e-2, (name, e_out, e_grad)

    # GPU time of compiled fwd+bwd.
    nbytes = 2 * 2 * q.numel() * q.element_size() * 2  # q and k; read + write; fwd + bwd
    src = torch.empty(2**28, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), iters=args.iters, device=dev)
    copy_gbs = 2 * src.numel() / copy_ms / 1e6
    rows = []
    for name, fn in impls.items():
        compiled = torch.compile(fn)

        def step(compiled=compiled):
            qo, ko = compiled(q, k)
            torch.autograd.grad((qo, ko), (q, k), (dq.transpose(1, 2), dk.transpose(1, 2)))

        ms = time_ms(step, iters=args.iters, device=dev)
        rows.append((name, ms, nbytes / ms / 1e6))
    floor_ms = nbytes / copy_gbs / 1e6
    if dev == "cuda":  # the Triton kernel's launch configs alone, as model.rope='triton' runs it
        from lmforge.kernels import _elementwise_triton as ew

        cos32, sin32 = rope.cos[:t].float(), rope.sin[:t].float()
        qd, kd = q.detach(), k.detach()
        want = ew.rope(qd, cos32, sin32, False, h)
        best = None
        for cfg in ROPE_CONFIGS:

            def fwd_bwd(cfg=cfg):  # forward of q and k, then the inverse rotation of each
                for x in (qd, kd):
                    ew.rope(x, cos32, sin32, False, h, config=cfg)
                    ew.rope(x, cos32, sin32, True, h, config=cfg)

            torch.testing.assert_close(ew.rope(qd, cos32, sin32, False, h, config=cfg), want)
            ms = time_ms(fwd_bwd, iters=args.iters, device=dev)
            default = cfg == (ew.ROPE_ELEMS, ew.ROPE_WARPS)
            name = (
                f"Triton kernel alone, {cfg[0]} elements/program, {cfg[1]} warps"
                f"{' (default)' if default else ''}"
            )
            rows.append((name, ms, nbytes / ms / 1e6))
            best = min(best, (ms, cfg)) if best else (ms, cfg)
        if args.best_out and best:
            Path(args.best_out).write_text(",".join(str(int(v)) for v in best[1]) + "\n")
    table = (
        f"RoPE fwd+bwd of q and k, (B, H, T, E) = ({b}, {h}, {t}, {e}) bf16, compiled; "
        f"floor {floor_ms:.3f} ms at the copy bandwidth {copy_gbs:,.0f} GB/s\n\n"
        "| implementation | ms | GB/s | × floor |\n|---|---|---|---|\n"
        + "".join(f"| {n} | {ms:.3f} | {gbs:,.0f} | {ms / floor_ms:.2f} |\n" for n, ms, gbs in rows)
    )
    print(table)
    if args.results:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(
                f"\n## benchmarks/rope_bench.py — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
                f"UTC\n\nDevice: {torch.cuda.get_device_name() if dev == 'cuda' else dev}; torch {torch.__version__}\n\n"
                f"Command: `PYTHONPATH=src python {' '.join(sys.argv)}`\n\n{table}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
