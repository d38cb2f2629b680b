"""Multi-head latent attention on one GPU: KV bytes per token, and the paged MLA decode kernel
against GQA paged decode at long context.

Correctness first, on the device (a failed check exits 1; the tables still print):
  * the MLA module's explicit form (training) against its absorbed form, and its paged decode
    through the Triton kernel against the explicit form over the whole sequence (fp32, ragged
    lengths, shuffled block tables);
  * ``lmforge.kernels.mla_decode`` (Triton) on the timing shapes' head/latent widths, fp32 and
    bf16, against the float64 reference;
  * on the timing inputs: the kernel against the torch reference, and the two GQA peers
    against each other.
Then the KV-cache bytes per token (``lmforge.model.cla.kv_bytes_per_token``) for MHA, GQA-4,
MLA, MLA+CLA-2 at the timing width, and decode attention at batch S and context T (default
64 × 16,384; d_model 2048, 16 heads; MLA C = 512, R = 64; GQA-4 = 4 kv-heads of 128; block
size 16; bf16 caches; blocks shuffled):
  * MLA Triton — ``mla_decode`` (the engine's path: every head reads each latent block once);
    extra rows sweep the kernel's tile (slots per iteration);
  * MLA SDPA — the same absorbed attention through ``F.scaled_dot_product_attention`` on the
    gathered latents (one kv-head of width C + R, values its first C; the H heads as H queries);
  * GQA Triton — lmforge's paged GQA decode kernel (``lmforge.serve.attention``);
  * GQA SDPA — gather the paged K/V, then ``F.scaled_dot_product_attention(enable_gqa=True)``
    (``paged_decode_reference``), the peer the issue names.
Each row: median ms (warmup, CUDA events; ``lmforge.bench.timing.time_ms``), the bytes the
attention must read (each sequence's cache rows + q + out), the bandwidth that implies, and the
floor ``bytes / --peak-tbs`` (4.3 TB/s, an H200's measured copy bandwidth) as % achieved.

    PYTHONPATH=src python benchmarks/mla.py
    PYTHONPATH=src python benchmarks/mla.py --batch 64 --ctx 16384 --out runs/mla
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/mla.py --device cpu
"""

from __future__ import annotations

import argparse
import json
import math
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
    p.add_argument("--batch", type=int, default=64, help="sequences S")
    p.add_argument("--ctx", type=int, default=16384, help="context length T of every sequence")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128, help="GQA/MHA head dim E")
    p.add_argument("--kv-heads", type=int, default=4, help="GQA kv-heads K")
    p.add_argument("--kv-lora-rank", type=int, default=512, help="MLA latent C")
    p.add_argument("--rope-dim", type=int, default=64, help="MLA decoupled RoPE dims R")
    p.add_argument("--layers", type=int, default=24, help="for the bytes-per-token table")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tiles", default="16,32,64", help="kernel tile sweep (slots/iteration)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peak-tbs", type=float, default=4.3, help="HBM bandwidth floor, TB/s")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: tiny smoke run through TRITON_INTERPRET=1 (numbers mean nothing)")  # fmt: skip
    p.add_argument("--out", type=Path, help="directory for results.json and table.md")
    return p


# --------------------------------------------------------------------------------- correctness
def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _paged_inputs(s, lens, bs, width_fn, gen, device, dtype, extra_blocks=3):
    """A shuffled block pool for sequences of ``lens`` tokens: (cache tensors, tables (S, M))."""
    nb = sum(-(-n // bs) for n in lens) + extra_blocks
    perm = torch.randperm(nb, generator=gen)
    tables, used = [], 0
    for n in lens:
        m = -(-n // bs)
        tables.append(perm[used : used + m].tolist())
        used += m
    width = max(map(len, tables))
    bt = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.int32)
    # drawn on the device: the timing caches hold ~10^9 values, slow to draw on the host
    dev_gen = torch.Generator(device=device).manual_seed(int(perm[0]))
    caches = [
        torch.randn(nb, bs, *w, generator=dev_gen, device=device).to(dtype) for w in width_fn()
    ]
    return caches, bt.to(device), tables


def check(device: str, heads: int, c: int, r: int) -> tuple[bool, dict]:
    """The module's two forms and its Triton paged decode; the kernel vs float64."""
    from lmforge.kernels.mla_decode import mla_decode, mla_decode_reference
    from lmforge.model.mla import MLAConfig, MultiHeadLatentAttention, PagedLatentCache

    report: dict[str, float] = {}
    torch.manual_seed(0)
    cfg = MLAConfig(d_model=64, n_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                    qk_rope_head_dim=16, v_head_dim=16, max_seq_len=256)  # fmt: skip
    m = MultiHeadLatentAttention(cfg).to(device)
    x = torch.randn(2, 40, 64, device=device)
    with torch.no_grad():
        want = m(x)
        report["module absorbed vs explicit"] = _rel(m.decode_absorbed(x)[0], want)
        lens, bs = [37, 1, 70], 16
        gen = torch.Generator().manual_seed(1)
        cache = PagedLatentCache(1, 20, bs, cfg.latent_dim, device, torch.float32)
        perm = torch.randperm(20, generator=gen).tolist()
        tables = [perm[0:3], perm[3:4], perm[4:9]]
        xs = [torch.randn(n + 1, 64, generator=gen).to(device) for n in lens]
        for i, n in enumerate(lens):
            slots = torch.tensor([tables[i][p // bs] * bs + p % bs for p in range(n)])
            cache.write(0, slots.to(device), m.compress_kv(xs[i][None, :n])[0])
        width = max(map(len, tables))
        bt = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.int32)
        slots = torch.tensor([tables[i][n // bs] * bs + n % bs for i, n in enumerate(lens)])
        got = m.decode_paged(
            torch.stack([x_[-1] for x_ in xs]), torch.tensor(lens, device=device),
            cache.latent[0], slots.to(device), bt.to(device),
            torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=device),
            use_triton=True,
        )  # fmt: skip
        want_rows = torch.stack([m(x_[None])[0, -1] for x_ in xs])
        report["module paged decode (Triton) vs explicit"] = _rel(got, want_rows)
    # the kernel at the timing widths, ragged lengths, float64 reference
    gen = torch.Generator().manual_seed(2)
    lens = [300, 1, 129, 1000] if device == "cuda" else [20, 1, 33]
    for dtype in (torch.float32, torch.bfloat16):
        (cache,), bt, _ = _paged_inputs(len(lens), lens, 16, lambda: [(c + r,)], gen, device, dtype)
        q = torch.randn(len(lens), heads, c + r, generator=gen).to(device, dtype)
        ctx = torch.tensor(lens, dtype=torch.int32, device=device)
        scale = 1 / math.sqrt(192)
        want = mla_decode_reference(q.double(), cache.double(), bt, ctx, c, scale)
        for parts in (None, 3):
            got = mla_decode(q, cache, bt, ctx, kv_lora_rank=c, scale=scale, use_triton=True,
                             n_parts=parts)  # fmt: skip
            report[f"kernel {str(dtype)[6:]} parts={parts} vs float64"] = _rel(got, want)
    tol = {"float32": 1e-5, "bfloat16": 1e-2}
    ok = all(
        v < (tol["bfloat16"] if "bfloat16" in k else tol["float32"]) for k, v in report.items()
    )
    return ok, report


# ------------------------------------------------------------------------------------- timing
def bytes_table(args) -> list[dict]:
    from lmforge.model.cla import kv_bytes_per_token

    e, h, L = args.head_dim, args.heads, args.layers
    mla = {"kv_lora_rank": args.kv_lora_rank, "qk_rope_head_dim": args.rope_dim, "n_layers": L}
    rows = [
        ("MHA", kv_bytes_per_token("mha", n_layers=L, n_heads=h, head_dim=e)),
        (f"GQA-{h // args.kv_heads} (K={args.kv_heads})",
         kv_bytes_per_token("gqa", n_layers=L, n_heads=h, head_dim=e, n_kv_heads=args.kv_heads)),
        ("MLA", kv_bytes_per_token("mla", **mla)),
        ("MLA + CLA-2", kv_bytes_per_token("mla", kv_share_every=2, **mla)),
    ]  # fmt: skip
    gqa = rows[1][1]
    return [
        {"kind": k, "bytes_per_token": b, "per_layer": b / L, "vs_gqa": b / gqa} for k, b in rows
    ]


def bench(args, device: str) -> tuple[list[dict], bool, dict]:
    from lmforge.bench.timing import time_ms
    from lmforge.kernels._mla_decode_triton import mla_decode_triton
    from lmforge.kernels.mla_decode import mla_decode, mla_decode_reference
    from lmforge.serve.attention import paged_decode, paged_decode_reference

    s, t, bs = args.batch, args.ctx, args.block_size
    h, c, r, e, kh = args.heads, args.kv_lora_rank, args.rope_dim, args.head_dim, args.kv_heads
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    lens = [t] * s
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    elem = 2
    rows: list[dict] = []
    checks: dict[str, float] = {}

    def row(name, fn, nbytes, note=""):
        ms = time_ms(fn, warmup=3, iters=args.iters, device=device)
        floor_ms = nbytes / (args.peak_tbs * 1e12) * 1e3
        rows.append({"impl": name, "ms": ms, "GB": nbytes / 1e9, "GBps": nbytes / ms / 1e6,
                     "floor_pct": 100 * floor_ms / ms, "note": note})  # fmt: skip

    def mla_part() -> None:  # its tensors are freed on return, before the GQA caches
        # ---- MLA: latent pages (NB, BS, C+R) ----
        (lat,), bt, _ = _paged_inputs(s, lens, bs, lambda: [(c + r,)], gen, device, dtype)
        q = torch.randn(s, h, c + r, generator=gen).to(device, dtype)
        scale = 1 / math.sqrt(128 + r)
        mla_bytes = s * t * (c + r) * elem + q.numel() * elem + s * h * c * elem
        use = True if device == "cpu" else None  # None: the dispatcher's choice (Triton on CUDA)
        out = mla_decode(q, lat, bt, ctx, kv_lora_rank=c, scale=scale, use_triton=use)
        ref = mla_decode_reference(q, lat, bt, ctx, c, scale)
        checks["timing inputs: MLA Triton vs torch reference (bf16)"] = _rel(out, ref)
        row("MLA Triton (mla_decode)",
            lambda: mla_decode(q, lat, bt, ctx, kv_lora_rank=c, scale=scale, use_triton=use),
            mla_bytes)  # fmt: skip
        for tile in [int(x) for x in args.tiles.split(",") if x]:
            row(f"MLA Triton tile={tile}",
                lambda tile=tile: mla_decode_triton(q, lat, bt, ctx, c, scale, tile=tile),
                mla_bytes, "sweep")  # fmt: skip

        def mla_sdpa():
            rows_ = lat[bt.long()].reshape(s, 1, -1, c + r)  # (S, 1, M·BS, C+R) gathered latents
            # one kv-head: the H heads are H queries of it (no GQA repeat of the latents)
            out = F.scaled_dot_product_attention(
                q[:, None], rows_, rows_[..., :c], scale=scale
            )  # (S, 1, H, C); contexts are full blocks here, so no mask
            return out[:, 0]  # (S, H, C)

        if t % bs == 0:
            checks["timing inputs: MLA SDPA vs torch reference (bf16)"] = _rel(mla_sdpa(), ref)
            row("MLA SDPA (gather, heads as queries)", mla_sdpa, mla_bytes)

    mla_part()

    # ---- GQA-4 peer: K/V pages (NB, BS, K, E) ----
    (kc, vc), bt_g, _ = _paged_inputs(s, lens, bs, lambda: [(kh, e), (kh, e)], gen, device, dtype)
    qg = torch.randn(s, h, e, generator=gen).to(device, dtype)
    gqa_bytes = 2 * s * t * kh * e * elem + 2 * qg.numel() * elem
    if device == "cuda" or _interpreting():
        got = paged_decode(qg, kc, vc, bt_g, ctx, use_triton=True)
        want = paged_decode_reference(qg, kc, vc, bt_g, ctx)
        checks["timing inputs: GQA Triton vs GQA SDPA (bf16)"] = _rel(got, want)
        row(f"GQA-{h // kh} Triton (lmforge paged_decode)",
            lambda: paged_decode(qg, kc, vc, bt_g, ctx, use_triton=True), gqa_bytes)  # fmt: skip
    row(f"GQA-{h // kh} SDPA (gather + enable_gqa)",
        lambda: paged_decode_reference(qg, kc, vc, bt_g, ctx), gqa_bytes)  # fmt: skip
    ok = all(v < 2e-2 for v in checks.values())
    return rows, ok, checks


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def table(bytes_rows: list[dict], rows: list[dict], args) -> str:
    lines = [
        f"KV cache per token, d_model {args.d_model}, {args.heads} heads of {args.head_dim},"
        f" MLA C={args.kv_lora_rank} R={args.rope_dim}, {args.layers} layers, bf16",
        "",
        "| cache | bytes/token (model) | bytes/token/layer | vs GQA |",
        "|---|---:|---:|---:|",
    ]
    for b in bytes_rows:
        lines.append(
            f"| {b['kind']} | {b['bytes_per_token']:,} | {b['per_layer']:,.0f} |"
            f" {b['vs_gqa']:.3f} |"
        )
    lines += [
        "",
        f"Decode attention, one layer: batch {args.batch} × context {args.ctx}, block size"
        f" {args.block_size}, bf16; floor = bytes / {args.peak_tbs} TB/s",
        "",
        "| impl | ms | GB read | GB/s | % of floor |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = r["impl"] + (" (sweep)" if r["note"] else "")
        lines.append(
            f"| {name} | {r['ms']:.3f} | {r['GB']:.2f} | {r['GBps']:,.0f} | {r['floor_pct']:.0f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; run with --device cpu under TRITON_INTERPRET=1 for a smoke run")
        return 2
    if device == "cpu":  # tiny shapes the interpreter can run
        if not _interpreting():
            print("--device cpu needs TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
            return 2
        args.batch, args.ctx, args.heads, args.kv_heads, args.head_dim = 2, 64, 4, 2, 16
        args.kv_lora_rank, args.rope_dim, args.iters, args.tiles = 32, 16, 1, "16"
    ok, report = check(device, args.heads, args.kv_lora_rank, args.rope_dim)
    for k, v in report.items():
        print(f"  {k}: rel err {v:.2e}")
    bytes_rows = bytes_table(args)
    rows, ok_bench, checks = bench(args, device)
    for k, v in checks.items():
        print(f"  {k}: rel err {v:.2e}")
    ok = ok and ok_bench
    versions = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        versions["gpu"] = torch.cuda.get_device_name()
    text = table(bytes_rows, rows, args)
    if args.out:
        from lmforge.utils.io import atomic_write_text

        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"versions": versions, "args": vars(args), "correctness": report,
                   "checks": checks, "bytes": bytes_rows, "rows": rows, "ok": ok}  # fmt: skip
        atomic_write_text(args.out / "results.json", json.dumps(payload, indent=1, default=str))
        atomic_write_text(args.out / "table.md", text + "\n")
    print("\nversions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print("correctness: " + ("ok" if ok else "FAILED"))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
