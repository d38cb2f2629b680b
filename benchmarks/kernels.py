"""lmforge's kernels against their peers on one GPU: correctness first, then tables.

Suites (``--only``, comma-separated; all by default):

* ``attention``, ``rmsnorm``, ``ce``, ``elementwise`` — ``lmforge.bench.kernels`` (also
  ``lmforge bench kernels``): FlashAttention-2 vs torch SDPA (flash and cuDNN), RMSNorm vs
  ``F.rms_norm``, fused linear + cross-entropy vs unfused torch, SwiGLU gates and RoPE vs torch,
  each next to Liger-Kernel where it is installed. Conventions: causal attention forward FLOPs =
  4·B·H·S²·E / 2, forward + backward = 3.5 × forward; RMSNorm bytes = read x + write y (+ weight).
* ``rope-packed`` — ``lmforge.kernels.rope_packed``, the model's q‖k rotation (forward: split
  the q‖k GEMM's output into rotated q and k; backward: join their gradients), at GPT-2-small's
  training shape, vs the torch reference rotation under ``torch.compile`` (what
  ``model.rope = "reference"`` runs) and the device copy bandwidth: GB/s of reads + writes.
* ``adamw`` — ``lmforge.train.AdamW(fused=True)``, the one-launch Triton multi-tensor update
  (``train.adamw = "auto"`` on CUDA), with global-norm clipping folded in as the trainer calls
  it, vs ``torch.optim.AdamW`` fused and foreach after ``clip_grad_norm_`` (the nanoGPT-style
  peer's update), over GPT-2-small's parameters: GPU ms, host ms per call, × the 28 B/param floor.

Every suite checks first (float64 references, the peer's own error as the yardstick; AdamW: 5
steps against ``torch.optim.AdamW(foreach=False)``), then times (warmup, CUDA events, medians;
``lmforge.bench.timing.time_ms`` queues the calls behind a GPU sleep so GPU work is timed, not
the host's launches), then prints markdown tables. A failed check exits 1 (tables still print).
``--device cpu`` runs ``rope-packed`` and ``adamw`` at tiny sizes through Triton's interpreter
(set ``TRITON_INTERPRET=1``): a smoke run of this script, its numbers mean nothing.

    PYTHONPATH=src python benchmarks/kernels.py
    PYTHONPATH=src python benchmarks/kernels.py --only attention --seqs 4096,16384 --dims 128
    PYTHONPATH=src python benchmarks/kernels.py --only ce,rope-packed,adamw --results runs/k.md
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/kernels.py --device cpu
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

LOCAL_SUITES = ("rope-packed", "adamw")
ADAMW_HP = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 1.0  # the presets' grad_clip


def _parser() -> argparse.ArgumentParser:
    from lmforge.bench import kernels

    p = argparse.ArgumentParser(
        description=__doc__[: __doc__.index("    PYTHONPATH")].rstrip(),
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kernels.build_parser(p)
    suites = (*kernels.SUITES, *LOCAL_SUITES)
    p.set_defaults(only=",".join(suites))
    for action in p._actions:  # the library's --only lists its own suites; name ours too
        if action.dest == "only":
            action.help = "comma list of " + ",".join(suites)
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: smoke run of rope-packed and adamw at tiny sizes (needs TRITON_INTERPRET=1)",
    )
    p.add_argument("--preset", default="gpt2-small", help="model whose parameters adamw updates")
    return p


# ---------------------------------------------------------------------------------- rope-packed


def _rope_tables(t: int, e: int, device: str):
    import torch

    pos = torch.arange(t, device=device, dtype=torch.float32)
    inv = 1.0 / 10000 ** (torch.arange(0, e, 2, device=device, dtype=torch.float32) / e)
    ang = pos[:, None] * inv[None, :]  # (T, E/2)
    return ang.cos().contiguous(), ang.sin().contiguous()


def check_rope_packed(device: str, small: bool) -> tuple[list[list[object]], bool]:
    """Max errors of q, k and the packed gradient against float64, next to the torch reference's
    own (bf16 in and out, fp32 math), for a grouped-query shape (Hk < Hq) and a ragged T."""
    import torch

    from lmforge.kernels import rope_packed, rope_packed_reference

    b, t, hq, hk, e = (1, 9, 2, 1, 16) if small else (2, 1000, 12, 4, 64)
    gen = torch.Generator(device=device).manual_seed(5)
    qk = (torch.randn(b, t, (hq + hk) * e, device=device, generator=gen) * 2).bfloat16()
    dq = torch.randn(b, t, hq, e, device=device, generator=gen).bfloat16()
    dk = torch.randn(b, t, hk, e, device=device, generator=gen).bfloat16()
    cos, sin = _rope_tables(t, e, device)
    results = []
    for fn, dtype in ((rope_packed_reference, torch.float64), (rope_packed, None),
                      (rope_packed_reference, None)):  # fmt: skip
        x = qk.to(dtype or qk.dtype).requires_grad_()
        c, s = (cos.double(), sin.double()) if dtype else (cos, sin)
        q, k = fn(x, c, s, hq, hk)
        (dx,) = torch.autograd.grad((q, k), (x,), (dq.to(q.dtype), dk.to(k.dtype)))
        results.append((q, k, dx))
    want, got, peer = results
    errs = [(a.double() - w).abs().max().item() for a, w in zip(got, want)]
    peer_errs = [(a.double() - w).abs().max().item() for a, w in zip(peer, want)]
    scale = [max(1.0, w.abs().max().item()) for w in want]
    ok = all(x <= max(2 * p, 1.6e-2 * sc) for x, p, sc in zip(errs, peer_errs, scale))
    cells = [f"{x:.2e} ({p:.1e})" for x, p in zip(errs, peer_errs)]
    shape = f"{b}×{t}×({hq}+{hk})·{e}"
    return [[shape, *cells, "ok" if ok else "FAIL"]], ok


def bench_rope_packed(iters: int, device: str, small: bool) -> tuple[list[list[object]], str]:
    """GB/s forward and forward + backward of the packed kernel and the compiled reference at
    GPT-2-small's q‖k (B, T, (Hq + Hk)·E) = (32, 1024, 24·64), bf16."""
    import torch

    from lmforge.bench.timing import copy_bandwidth_gbs, time_ms
    from lmforge.kernels import rope_packed, rope_packed_reference

    b, t, hq, hk, e = (1, 16, 2, 2, 16) if small else (32, 1024, 12, 12, 64)
    qk = torch.randn(b, t, (hq + hk) * e, device=device, dtype=torch.bfloat16)
    dq = torch.randn(b, t, hq, e, device=device, dtype=torch.bfloat16)
    dk = torch.randn(b, t, hk, e, device=device, dtype=torch.bfloat16)
    cos, sin = _rope_tables(t, e, device)
    n_bytes = qk.numel() * qk.element_size()
    fwd_bytes, fb_bytes = 2 * n_bytes, 4 * n_bytes  # read qk, write q and k; backward the same

    def reference(x: torch.Tensor):
        return rope_packed_reference(x, cos, sin, hq, hk)

    peer_name = "torch reference, compiled" if device == "cuda" else "torch reference, eager"
    peer = torch.compile(reference) if device == "cuda" else reference
    rows: list[list[object]] = []
    for name, fn in (("lmforge rope_packed", lambda x: rope_packed(x, cos, sin, hq, hk)),
                     (peer_name, peer)):  # fmt: skip
        x = qk.detach().requires_grad_()

        def fwd(fn=fn) -> object:
            with torch.no_grad():
                return fn(qk)

        def fwd_bwd(fn=fn, x=x) -> object:
            return torch.autograd.grad(fn(x), (x,), (dq, dk))

        t_f = time_ms(fwd, warmup=5, iters=iters, device=device)
        t_fb = time_ms(fwd_bwd, warmup=5, iters=iters, device=device)
        rows.append([name, t_f * 1e3, fwd_bytes / t_f / 1e6, t_fb * 1e3, fb_bytes / t_fb / 1e6])
    copy = f"{copy_bandwidth_gbs():,.0f} GB/s" if device == "cuda" else "n/a (cpu)"
    note = (f"q‖k {b}×{t}×({hq}+{hk})·{e} bf16, {n_bytes / 1e6:.0f} MB each way; device copy "
            f"bandwidth in this run: {copy}")  # fmt: skip
    return rows, note


# ---------------------------------------------------------------------------------------- adamw


def _clip_coef(grads: list, max_norm: float):
    # min(1, max_norm / (‖g‖ + 1e-6)) on the device, one read of the gradients (the trainer's
    # factor, folded into the update instead of rescaling the gradients in place).
    import torch

    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _adamw_setup(preset: str, device: str, small: bool):
    import torch

    torch.manual_seed(0)
    if small:
        shapes = [(7, 33), (129,), (64, 16), (3, 5, 11)]
        base = [torch.randn(s, device=device) for s in shapes]
    else:
        from lmforge.model import TransformerLM, load_preset

        model = TransformerLM(load_preset(preset)).to(device)
        base = [p.detach().clone() for p in model.parameters()]
        del model
    gen = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen, device=device) * 1e-2 for p in base]
    return base, grads


def _adamw_step(kind: str, base: list, grads: list, clip: bool) -> tuple[list, Callable[[], None]]:
    """Fresh parameters with the gradients attached, and one update as each side runs it."""
    import torch

    from lmforge.train import AdamW

    ps = [torch.nn.Parameter(b.clone()) for b in base]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    if kind.startswith("torch"):  # the peer: clip in place, then the update
        opt = torch.optim.AdamW(
            ps, fused=kind == "torch fused", foreach=kind == "torch foreach", **ADAMW_HP
        )

        def torch_step() -> None:
            if clip:
                torch.nn.utils.clip_grad_norm_(ps, MAX_NORM)
            opt.step()

        return ps, torch_step
    ours = AdamW(ps, fused=True, **ADAMW_HP)
    ok = torch.ones((), dtype=torch.bool, device=ps[0].device)
    gs = [p.grad for p in ps]

    def step() -> None:  # as the trainer calls it: the clip factor folded into the update
        ours.step_if(ok, grad_scale=_clip_coef(gs, MAX_NORM) if clip else None)

    return ps, step


def check_adamw(preset: str, device: str, small: bool) -> tuple[list[list[object]], bool]:
    """5 unclipped steps of the Triton update against torch.optim.AdamW(foreach=False) from the
    same state (clipping differs by design: torch rescales the stored gradients every step), and
    on CUDA one update under ``set_sync_debug_mode("error")`` (no host sync)."""
    import torch

    base, grads = _adamw_setup(preset, device, small)
    ref, ref_step = _adamw_step("torch single-tensor", base, grads, clip=False)
    ps, step = _adamw_step("lmforge triton", base, grads, clip=False)
    for _ in range(5):
        ref_step()
        step()
    err = max((p - q).abs().max().item() for p, q in zip(ps, ref))
    ok = err <= 2e-6  # a few float32 ulps of O(1) weights (fused multiply-adds)
    sync = "n/a (cpu)"
    if device == "cuda":
        ps, step = _adamw_step("lmforge triton", base, grads, clip=True)
        step()  # tables and state allocated before the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            sync = "none"
        except RuntimeError as e:
            sync, ok = f"FAIL: {str(e).splitlines()[0]}", False
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n = sum(b.numel() for b in base)
    return [[f"{n / 1e6:.1f}M", f"{err:.2e}", sync, "ok" if ok else "FAIL"]], ok


def bench_adamw(
    preset: str, iters: int, device: str, small: bool, bandwidth_gbs: float | None
) -> tuple[list[list[object]], str]:
    """GPU ms per update with clipping and without, host ms per call, GB/s and × the floor (the
    update reads θ, g, m, v and writes θ, m, v: 28 B/param at the copy bandwidth)."""
    import torch

    from lmforge.bench.timing import time_ms

    base, grads = _adamw_setup(preset, device, small)
    n = sum(b.numel() for b in base)
    rows: list[list[object]] = []
    for kind in ("lmforge triton", "torch fused", "torch foreach"):
        ps, step = _adamw_step(kind, base, grads, clip=True)
        clipped = time_ms(step, warmup=3, iters=iters, device=device)
        host = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)
            if device == "cuda":
                torch.cuda.synchronize()
        del ps, step
        ps, step = _adamw_step(kind, base, grads, clip=False)
        alone = time_ms(step, warmup=3, iters=iters, device=device)
        del ps, step
        floor = 28 * n / (bandwidth_gbs * 1e6) if bandwidth_gbs else None
        rows.append([kind, clipped, alone, statistics.median(host), 28 * n / alone / 1e6,
                     f"{alone / floor:.2f}" if floor else "n/a"])  # fmt: skip
    for row in rows:
        row.append(f"{row[1] / rows[1][1]:.2f}")  # time against torch fused, clipped
    floor_text = (f"floor 28 B/param at the copy bandwidth measured in this run, "
             f"{bandwidth_gbs:,.0f} GB/s" if bandwidth_gbs else "no floor on cpu")  # fmt: skip
    note = (f"{'tiny' if small else preset} ({n:,} fp32 parameters), max-norm {MAX_NORM} "
            f"clipping; {floor_text}")  # fmt: skip
    return rows, note


# ----------------------------------------------------------------------------------------- main


def run_local(args: argparse.Namespace, suites: list[str], command: str) -> tuple[list[str], bool]:
    """The rope-packed and adamw suites: checks first, then tables. Returns (lines, all ok)."""
    from lmforge.bench.timing import copy_bandwidth_gbs, environment_line, markdown_table

    small = args.device == "cpu"
    out = [f"`{command}` — {environment_line()}"]

    def emit(text: str) -> None:
        print(text, flush=True)
        out.append(text)

    ok_all = True
    if not args.no_check:
        emit("\n### Correctness (max abs error vs float64; peer's own error in parentheses)\n")
        if "rope-packed" in suites:
            rows, ok = check_rope_packed(args.device, small)
            ok_all &= ok
            emit("Packed RoPE, bf16 (peer: the torch reference rotation)\n\n" + markdown_table(
                ["B×T×(Hq+Hk)·E", "q", "k", "d(q‖k)", "ok"], rows))  # fmt: skip
        if "adamw" in suites:
            rows, ok = check_adamw(args.preset, args.device, small)
            ok_all &= ok
            emit("\nAdamW, 5 steps (peer: torch.optim.AdamW(foreach=False))\n\n" + markdown_table(
                ["params", "max |Δθ|", "host syncs in one update", "ok"], rows))  # fmt: skip
    iters = max(args.iters, 20)
    if "rope-packed" in suites:
        rows, note = bench_rope_packed(iters, args.device, small)
        emit(f"\n### Packed RoPE, split (fwd) and join (bwd): µs and GB/s\n\n{note}\n\n"
             + markdown_table(["implementation", "fwd µs", "fwd GB/s", "f+b µs", "f+b GB/s"],
                              rows))  # fmt: skip
    if "adamw" in suites:
        bandwidth = copy_bandwidth_gbs() if args.device == "cuda" else None
        rows, note = bench_adamw(args.preset, iters, args.device, small, bandwidth)
        emit(f"\n### AdamW update with and without clipping\n\n{note}\n\n" + markdown_table(
            ["update", "GPU ms, clipped", "GPU ms, update alone", "host ms/call", "GB/s",
             "× floor", "vs torch fused (time, clipped)"], rows))  # fmt: skip
    if not ok_all:
        emit("\nA correctness check FAILED (see the tables above).")
    return out, ok_all


def _append(path: str, lines: list[str]) -> None:
    from lmforge.utils.io import atomic_write_text

    target = Path(path)
    old = target.read_text(encoding="utf-8") if target.exists() else "# Benchmark results\n"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    entry = f"\n## Kernels: packed RoPE, AdamW — {stamp}\n\n" + "\n".join(lines) + "\n"
    atomic_write_text(target, old.rstrip("\n") + "\n" + entry)
    print(f"appended to {target}", file=sys.stderr)


def main() -> int:
    args = _parser().parse_args()
    from lmforge.bench import kernels
    from lmforge.utils.errors import LmforgeError

    command = "python benchmarks/kernels.py " + " ".join(sys.argv[1:])
    default = ",".join((*kernels.SUITES, *LOCAL_SUITES))
    if args.device == "cpu" and args.only == default:
        args.only = ",".join(LOCAL_SUITES)
    suites = [s.strip() for s in args.only.split(",") if s.strip()]
    try:
        unknown = sorted(set(suites) - set(kernels.SUITES) - set(LOCAL_SUITES))
        if unknown:
            raise LmforgeError(f"--only: unknown suite(s) {unknown}; choose from {default}")
        library = [s for s in suites if s in kernels.SUITES]
        local = [s for s in suites if s in LOCAL_SUITES]
        if args.device == "cpu" and library:
            raise LmforgeError(f"--device cpu runs only {','.join(LOCAL_SUITES)}, not {library}")
        if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise LmforgeError("--device cpu runs the Triton kernels in Triton's interpreter: "
                               "set TRITON_INTERPRET=1")  # fmt: skip
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise LmforgeError("needs a CUDA GPU (none visible to torch); --device cpu smoke-runs")
        rc = 0
        if library:
            args.only = ",".join(library)
            rc = kernels.run(args, command)
        if local:
            lines, ok = run_local(args, local, command)
            if args.results:
                _append(args.results, lines)
            rc = rc or (0 if ok else 1)
        return rc
    except LmforgeError as e:
        print(f"benchmarks/kernels.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
