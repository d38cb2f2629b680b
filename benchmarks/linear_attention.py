"""Chunked linear-attention kernels on one GPU: Gated DeltaNet and Mamba-2 SSD against FLA and SDPA.

Correctness first, on the device: lmforge's Triton gated delta rule and decayed linear attention
(the SSD core), forward and backward, float32 inputs against the float64 token recurrence
(packed ragged sequences, initial state in, final state out, every input's gradient), and bf16
against the same reference; then lmforge's GDN output against flash-linear-attention's
``chunk_gated_delta_rule`` on the timing inputs. A failed check exits 1 (tables still print).

Then timings at a fixed token budget B·T (default 32k), 16 heads, head dim 128, bf16, for each T:
  * ours GDN — ``lmforge.kernels.gated_delta_rule`` (Triton), forward and forward + backward;
  * FLA GDN — ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` where the ``fla-core`` wheel
    is installed; where its backward refuses (FLA issue #640: triton < 3.7.1 on Hopper) the row
    says so, keeps its forward time and adds its recurrent reference's forward
    (``fused_recurrent_gated_delta_rule``);
  * ours SSD — ``lmforge.kernels.linear_attention`` with a per-token decay (Mamba-2's core);
  * SDPA — ``F.scaled_dot_product_attention(is_causal=True)`` on the flash backend.
Last, one decoding token (the fused Triton step vs torch) at batch 1 and 32.
FLOP conventions (matmul FLOPs of the algorithm, per token and head, chunk C, head dim d):
GDN forward 10·C·d + 6·d², forward + backward 4 × that; SSD forward 4·C·d + 4·d², forward +
backward 3 ×; causal attention forward 4·T·d/2, forward + backward 3.5 ×. Times: warmup, CUDA
events, medians (``lmforge.bench.timing.time_ms``). The ``ms/token`` column shows linearity in T.

    PYTHONPATH=src python benchmarks/linear_attention.py
    PYTHONPATH=src python benchmarks/linear_attention.py --seqs 4096,16384 --out runs/linattn
    PYTHONPATH=src python benchmarks/linear_attention.py --seqs 8192 --profile 8192   # + kernel tables
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/linear_attention.py --device cpu
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
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
    p.add_argument("--seqs", default="4096,8192,16384,32768,65536", help="sequence lengths T")
    p.add_argument("--tokens", type=int, default=32768, help="B·T (B = max(1, tokens // T))")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="head dim (K = V)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--budget", type=float, default=300.0,
                   help="seconds: lengths not started by then are skipped (the table still prints)")  # fmt: skip
    p.add_argument("--profile", type=int, default=0, metavar="T",
                   help="after the timings, torch.profiler over 5 forwards of ours and of FLA's "
                        "GDN at this T: each kernel's share, to compare the two")  # fmt: skip
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: tiny smoke run through TRITON_INTERPRET=1 (numbers mean nothing)")  # fmt: skip
    p.add_argument("--out", type=Path, help="directory for results.json and table.md")
    return p


# --------------------------------------------------------------------------------- correctness
def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want).abs().max().item() / max(1.0, want.abs().max().item())


def _check_op(name, op, ref, T, H, K, V, cu, device, dtype, delta: bool) -> dict[str, float]:
    """Largest relative error of o, the final state and every gradient against float64."""
    gen = torch.Generator().manual_seed(0)
    n = len(cu) - 1

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q, k, v = r(1, T, H, K), F.normalize(r(1, T, H, K), dim=-1), r(1, T, H, V)
    g = -torch.rand(1, T, H, generator=gen, dtype=torch.float64) * 0.3 - 0.01
    beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    h0 = r(n, H, K, V) * 0.5
    inputs = [q, k, v, g, beta, h0] if delta else [q, k, v, g, h0]
    xs = [x.to(device, dtype).requires_grad_() for x in inputs]
    xr = [x.to(device).requires_grad_() for x in inputs]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    w_o, w_h = r(1, T, H, V).to(device), r(n, H, K, V).to(device)
    kw = dict(output_final_state=True, cu_seqlens=cu_t)
    o_r, h_r = ref(*xr[:-1], initial_state=xr[-1], **kw)
    ((o_r * w_o).sum() + (h_r * w_h).sum()).backward()
    o, h = op(*xs[:-1], initial_state=xs[-1], **kw)
    grads = torch.autograd.grad((o.double() * w_o).sum() + (h.double() * w_h).sum(), xs)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"] if delta else ["dq", "dk", "dv", "dg", "dh0"]
    errs = {"o": _rel_err(o, o_r), "state": _rel_err(h, h_r)}
    errs |= {nm: _rel_err(gr, x.grad) for nm, gr, x in zip(names, grads, xr)}
    print(f"  {name} {str(dtype).removeprefix('torch.')}: "
          + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))  # fmt: skip
    return errs


def check(device: str, chunk: int, big: bool) -> tuple[bool, dict]:
    from lmforge.kernels import (
        gated_delta_reference,
        gated_delta_rule,
        linear_attention,
        linear_attention_reference,
    )

    T, H, K, V = (1000, 4, 128, 128) if big else (40, 2, 16, 16)
    cu = [0, 1, 77, 640, 1000] if big else [0, 5, 23, 40]
    gdn = lambda *a, **kw: gated_delta_rule(*a, chunk_size=chunk, backend="triton", **kw)
    la = lambda *a, **kw: linear_attention(*a, chunk_size=chunk, backend="triton", **kw)
    dtypes = [(torch.float32, 2e-4), (torch.bfloat16, 5e-2)] if device == "cuda" else [
        (torch.float32, 1e-4)
    ]  # fmt: skip
    print("correctness (max |error| / max(1, max |reference|), vs float64 recurrences):")
    ok, report = True, {}
    for dtype, tol in dtypes:
        for name, op, ref, delta in (
            ("gated delta", gdn, gated_delta_reference, True),
            ("ssd/linear", la, linear_attention_reference, False),
        ):
            errs = _check_op(name, op, ref, T, H, K, V, cu, device, dtype, delta)
            report[f"{name} {dtype}"] = errs
            bad = [k for k, e in errs.items() if not e <= tol]
            if bad:
                ok = False
                print(f"  FAIL {name} {dtype}: {bad} above {tol}")
    return ok, report


# ------------------------------------------------------------------------------------ timings
def _fla():
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"
    return (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule), None


def _fwd_bwd(fn, inputs, do):
    def run():
        for x in inputs:
            x.grad = None
        o = fn()
        o.backward(do)

    return run


def bench(args, device: str, start: float) -> tuple[list[dict], bool]:
    fla, fla_err = _fla()
    if fla_err:
        print(f"FLA not available: {fla_err}")
    rows, ok = [], True
    for T in [int(s) for s in args.seqs.split(",")]:
        if time.perf_counter() - start > args.budget:
            print(f"  T={T}: skipped (past the --budget of {args.budget:.0f} s)")
            continue
        row, row_ok = _bench_one(T, args, device, fla)
        rows.append(row)
        ok = ok and row_ok
        print(f"  T={T} ({time.perf_counter() - start:.0f} s): "
              + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in row.items()))  # fmt: skip
        if args.out:  # each length's row kept as it finishes: a call cut short still has them
            from lmforge.utils.io import atomic_write_text

            args.out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(
                args.out / "rows.partial.json", json.dumps(rows, indent=1, default=str)
            )
    return rows, ok


def _timing_inputs(T: int, args, device: str) -> list[torch.Tensor]:
    """The timed GDN inputs at length T (B = tokens // T), seeded by T, each requiring grad:
    q, k L2-normalised and v (B, T, H, d) bf16, g = logsigmoid / 16 (B, T, H) float32, β in
    (0, 1) bf16; then dO (B, T, H, d) bf16."""
    B, H, d = max(1, args.tokens // T), args.heads, args.dim
    gen = torch.Generator(device=device).manual_seed(T)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device, dtype=torch.bfloat16)

    q = F.normalize(r(B, T, H, d).float(), dim=-1).bfloat16()
    k = F.normalize(r(B, T, H, d).float(), dim=-1).bfloat16()
    v = r(B, T, H, d)
    g = F.logsigmoid(r(B, T, H).float()) / 16
    beta = torch.sigmoid(r(B, T, H).float()).bfloat16()
    return [x.requires_grad_() for x in (q, k, v, g, beta)] + [r(B, T, H, d)]


def _bench_one(T: int, args, device: str, fla) -> tuple[dict, bool]:
    from lmforge.bench.timing import time_ms
    from lmforge.kernels import gated_delta_rule, linear_attention

    H, d, C = args.heads, args.dim, args.chunk
    ok = True
    B = max(1, args.tokens // T)
    q, k, v, g, beta, do = _timing_inputs(T, args, device)
    ins = [q, k, v, g, beta]
    row = {"T": T, "B": B}

    def ours():
        return gated_delta_rule(q, k, v, g, beta, chunk_size=C, backend="triton")[0]

    row["gdn_fwd"] = time_ms(ours, iters=args.iters, device=device)
    row["gdn_fb"] = time_ms(_fwd_bwd(ours, ins, do), iters=args.iters, device=device)
    if fla is not None:
        fla_chunk, fla_recurrent = fla

        def theirs():
            return fla_chunk(q, k, v, g, beta.to(q.dtype))[0]

        try:
            with torch.no_grad():
                err = _rel_err(ours().float(), theirs().double())
            row["fla_vs_ours_max_rel_diff"] = err
            if err > 5e-2:
                ok = False
                print(f"  FAIL T={T}: ours and FLA forward differ by {err:.3g}")
            row["fla_fwd"] = time_ms(theirs, iters=args.iters, device=device)
        except Exception as e:
            row["fla_fwd_error"] = f"{type(e).__name__}: {str(e)[:120]}"
        try:
            row["fla_fb"] = time_ms(_fwd_bwd(theirs, ins, do), iters=args.iters, device=device)
            # Where FLA's backward runs, its gradients next to ours (same inputs, bf16).
            theirs().backward(do)
            fla_grads = [x.grad.double() for x in ins]
            for x in ins:
                x.grad = None
            ours().backward(do)
            row["fla_vs_ours_grad_max_rel_diff"] = max(
                _rel_err(x.grad, gr) for x, gr in zip(ins, fla_grads)
            )
        except Exception as e:
            row["fla_fb_error"] = f"{type(e).__name__}: {str(e)[:120]}"
            for x in ins:
                x.grad = None
            try:  # its token-recurrent kernel, forward only, in the refused backward's place
                with torch.no_grad():
                    rec = functools.partial(fla_recurrent, q, k, v, g, beta=beta.to(q.dtype))
                    row["fla_recurrent_fwd"] = time_ms(rec, iters=args.iters, device=device)
            except Exception as e2:
                row["fla_recurrent_error"] = f"{type(e2).__name__}: {str(e2)[:120]}"

    def ssd():
        return linear_attention(q, k, v, g, scale=d**-0.5, chunk_size=C, backend="triton")[0]

    row["ssd_fb"] = time_ms(_fwd_bwd(ssd, [q, k, v, g], do), iters=args.iters, device=device)
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qs, ks, vs = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        dos = do.transpose(1, 2).contiguous()

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

        row["sdpa_fb"] = time_ms(_fwd_bwd(sdpa, [qs, ks, vs], dos), iters=args.iters)
    tok = B * T * H
    row["gdn_tflops"] = 4 * tok * (10 * C * d + 6 * d * d) / row["gdn_fb"] / 1e9
    row["ssd_tflops"] = 3 * tok * (4 * C * d + 4 * d * d) / row["ssd_fb"] / 1e9
    if "sdpa_fb" in row:
        row["sdpa_tflops"] = 3.5 * tok * 2 * T * d / row["sdpa_fb"] / 1e9
    return row, ok


def profile_forwards(args, T: int) -> str:
    """torch.profiler over 5 GDN forwards at length T (B·T = ``args.tokens``), ours and FLA's
    (where installed): each kernel's GPU time, so the two implementations' stages line up."""
    from torch.profiler import ProfilerActivity, profile

    from lmforge.bench.timing import cuda_kernel_totals
    from lmforge.kernels import gated_delta_rule

    B = max(1, args.tokens // T)
    q, k, v, g, beta, _ = (x.detach() for x in _timing_inputs(T, args, "cuda"))
    runs = {"ours": lambda: gated_delta_rule(q, k, v, g, beta, chunk_size=args.chunk,
                                             backend="triton")}  # fmt: skip
    fla, _ = _fla()
    if fla is not None:
        runs["FLA"] = lambda: fla[0](q, k, v, g, beta)
    lines = [f"profile: GDN forward, T = {T}, B = {B}, 5 calls each (us per call)"]
    with torch.no_grad():
        for name, fn in runs.items():
            fn()  # compiled and tuned before the profile
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            agg = cuda_kernel_totals(prof)
            total = sum(us for _, us in agg.values())
            lines += [f"\n{name}: GPU busy {total / 5:.1f} us per call", "",
                      "| kernel | launches per call | us per call | share |", "|---|---:|---:|---:|"]  # fmt: skip
            for kname, (cnt, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:12]:
                short = (kname if len(kname) <= 80 else kname[:77] + "...").replace("|", "/")
                lines.append(f"| {short} | {cnt / 5:g} | {us / 5:.1f} | {us / max(total, 1e-9):.1%} |")  # fmt: skip
    return "\n".join(lines)


def bench_decode(args, device: str) -> list[dict]:
    """One decoding token of a GDN head group: the fused Triton step vs the same math in torch,
    batch 1 and 32; GB/s counts one read and one write of the float32 state."""
    from lmforge.bench.timing import time_ms
    from lmforge.kernels import gated_delta_step

    H, d = args.heads, args.dim
    rows = []
    for n in (1, 32):
        gen = torch.Generator(device=device).manual_seed(n)
        q, k, v = (torch.randn(n, H, d, generator=gen, device=device) for _ in range(3))
        k = F.normalize(k, dim=-1)
        g = -torch.rand(n, H, generator=gen, device=device)
        beta = torch.rand(n, H, generator=gen, device=device)
        state = torch.randn(n, H, d, d, generator=gen, device=device)
        row = {"batch": n, "state_bytes_per_seq": H * d * d * 4}
        for backend in ("triton", "torch"):
            row[backend] = time_ms(
                functools.partial(gated_delta_step, q, k, v, g, beta, state, backend=backend),
                iters=args.iters,
                device=device,
            )
        row["triton_GBps"] = 2 * n * row["state_bytes_per_seq"] / row["triton"] / 1e6
        rows.append(row)
    return rows


def decode_table(rows: list[dict]) -> str:
    lines = [
        "decode step (one token, GDN, float32 state; GB/s: state read + write)\n",
        "| batch | state KiB/seq | Triton step ms | torch step ms | torch/Triton | Triton GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['state_bytes_per_seq'] / 1024:.0f} | {r['triton']:.4f} | "
            f"{r['torch']:.4f} | {r['torch'] / r['triton']:.2f} | {r['triton_GBps']:.0f} |"
        )
    return "\n".join(lines)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def table(rows: list[dict], args) -> str:
    head = (
        f"B·T = {args.tokens}, H = {args.heads}, d = {args.dim}, chunk {args.chunk}, bf16; "
        "fwd+bwd ms (TFLOP/s); ratio > 1: ours faster\n\n"
        "| T | B | GDN fwd | GDN fwd+bwd | µs per 1k tok | FLA fwd | FLA fwd+bwd | FLA/ours | "
        "FLA recurrent fwd | SSD fwd+bwd | SDPA fwd+bwd | SDPA/ours GDN |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        fla_fb = r.get("fla_fb")
        fla_col = _fmt(fla_fb) if fla_fb else "refused" if "fla_fb_error" in r else "—"
        ratio = fla_fb / r["gdn_fb"] if fla_fb else None
        fla_fwd = r.get("fla_fwd")
        ratio_fwd = f" (fwd {fla_fwd / r['gdn_fwd']:.2f})" if fla_fwd else ""
        sdpa = r.get("sdpa_fb")
        lines.append(
            f"| {r['T']} | {r['B']} | {_fmt(r['gdn_fwd'])} | {_fmt(r['gdn_fb'])} "
            f"({_fmt(r['gdn_tflops'], '.0f')}) | {1e3 * r['gdn_fb'] / (r['B'] * r['T'] / 1e3):.1f} | "
            f"{_fmt(fla_fwd)} | {fla_col} | {_fmt(ratio)}{ratio_fwd} | "
            f"{_fmt(r.get('fla_recurrent_fwd'))} | {_fmt(r['ssd_fb'])} "
            f"({_fmt(r['ssd_tflops'], '.0f')}) | {_fmt(sdpa)} "
            f"({_fmt(r.get('sdpa_tflops'), '.0f')}) | {_fmt(sdpa / r['gdn_fb'] if sdpa else None)} |"
        )
    keys = ("fla_fb_error", "fla_fwd_error", "fla_recurrent_error")
    errors = {r["T"]: r[k] for r in rows for k in keys if k in r}
    if errors:
        lines.append("\nFLA errors: " + "; ".join(f"T={t}: {e}" for t, e in errors.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    sys.stdout.reconfigure(line_buffering=True)  # progress lines arrive as they happen
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; run with --device cpu under TRITON_INTERPRET=1 for a smoke run")
        return 2
    if device == "cpu":  # tiny shapes the interpreter can run
        args.seqs, args.tokens, args.heads, args.dim, args.chunk, args.iters = (
            "32,64",
            64,
            2,
            16,
            16,
            1,
        )
    ok, report = check(device, args.chunk, big=device == "cuda")
    print(f"correctness done at {time.perf_counter() - start:.0f} s")
    rows, ok_bench = bench(args, device, start)
    ok = ok and ok_bench
    decode = bench_decode(args, device)
    versions = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        versions["gpu"] = torch.cuda.get_device_name()
    try:
        import fla

        versions["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        pass
    text = table(rows, args) + "\n\n" + decode_table(decode)
    if args.profile and device == "cuda":
        text += "\n\n" + profile_forwards(args, args.profile)
    if args.out:
        from lmforge.utils.io import atomic_write_text

        args.out.mkdir(parents=True, exist_ok=True)
        payload = {
            "versions": versions,
            "correctness": report,
            "rows": rows,
            "decode": decode,
            "ok": ok,
        }
        atomic_write_text(args.out / "results.json", json.dumps(payload, indent=1, default=str))
        atomic_write_text(args.out / "table.md", text + "\n")
    print("\nversions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print("correctness: " + ("ok" if ok else "FAILED"))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
