"""Quantized KV cache on one GPU: paged decode attention over bf16 vs fp8 (e4m3) vs int8 pages.

Correctness first, on the device (a failed check exits 1; the table still prints):
  * on the timing inputs (its first sequences, float64 math): the Triton decode kernel and the
    Triton prefill kernel on each quantized cache against the float64 reference on the same
    dequantized cache (equal up to summation order);
  * the cost of quantizing: decode attention over the quantized cache vs over the bf16 cache it
    was written from (max abs error, float64 reference);
  * the engine: greedy decoding of a small random bf16 model with an fp8 / int8 cache vs the
    bf16 cache, max |log-prob| error of the generated tokens while the tokens agree.
Then decode attention (one layer, ``paged_decode``: the engine's kernel) at batch S and context
T (default 64 × 4096; 32 heads, 8 kv-heads of 128; block size 16; blocks shuffled), and the
quantizing KV write of one decode step (``write_kv``). Each row: median ms (warmup, CUDA
events; ``lmforge.bench.timing.time_ms``), the bytes the attention must read (every sequence's
K/V rows, scales included, + q + out), the bandwidth that implies, and the floor
``bytes / --peak-tbs`` (4.3 TB/s, an H200's measured copy bandwidth) as % achieved.

    PYTHONPATH=src python benchmarks/kv_quant.py
    PYTHONPATH=src python benchmarks/kv_quant.py --batch 64 --ctx 4096 --out runs/kv_quant
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/kv_quant.py --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without install

import torch

FORMATS = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__[: __doc__.index("    PYTHONPATH")].rstrip(),
        epilog="examples:\n" + __doc__[__doc__.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batch", type=int, default=64, help="sequences S")
    p.add_argument("--ctx", type=int, default=4096, help="context length T of every sequence")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peak-tbs", type=float, default=4.3, help="bandwidth floor in TB/s")
    p.add_argument("--check-seqs", type=int, default=3, help="sequences checked in float64")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, help="directory for results.json and table.md")
    return p


def _inputs(args: argparse.Namespace, device: str) -> dict:
    """bf16 K/V for every slot (randn, keys ×2), written into a bf16, an fp8 and an int8 cache
    through ``write_kv``; shuffled block tables; a bf16 query per sequence."""
    from lmforge.serve.attention import write_kv

    s, t, k, e, bs = args.batch, args.ctx, args.kv_heads, args.head_dim, args.block_size
    per_seq = -(-t // bs)
    nb = s * per_seq
    g = torch.Generator(device=device).manual_seed(0)
    caches = {}
    kf = torch.randn(nb * bs, k, e, generator=g, device=device, dtype=torch.bfloat16) * 2
    vf = torch.randn(nb * bs, k, e, generator=g, device=device, dtype=torch.bfloat16)
    slots = torch.arange(nb * bs, device=device)
    for name, dt in FORMATS.items():
        row = e + (4 if name != "bf16" else 0)
        kc = torch.zeros(nb, bs, k, row, device=device, dtype=dt)
        vc = torch.zeros_like(kc)
        write_kv(kc, vc, slots, kf, vf)
        caches[name] = (kc, vc)
    del kf, vf
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1))
    bt = perm.view(s, per_seq).to(device=device, dtype=torch.int32)
    lens = torch.full((s,), t, device=device, dtype=torch.int32)
    q = torch.randn(s, args.heads, e, generator=g, device=device, dtype=torch.bfloat16)
    return {"caches": caches, "bt": bt, "lens": lens, "q": q}


def _float64(q, kc, vc, bt, lens, n):
    from lmforge.serve.attention import paged_attention_float64

    return torch.stack(
        [
            paged_attention_float64(q[i : i + 1].cpu(), kc, vc, bt[i].tolist(), int(lens[i]))[0]
            for i in range(n)
        ]
    )


def check(args: argparse.Namespace, inp: dict, device: str) -> tuple[bool, dict]:
    """Kernels vs float64 on the same quantized cache; quantized vs bf16 attention."""
    from lmforge.serve.attention import paged_decode, paged_prefill

    n = min(args.check_seqs, args.batch)
    bt, lens, q = inp["bt"][:n], inp["lens"][:n], inp["q"][:n]
    used = bt.flatten().long()  # only the checked sequences' blocks go to the host
    remap = torch.empty(int(used.max()) + 1, dtype=torch.long, device=bt.device)
    remap[used] = torch.arange(used.numel(), device=bt.device)
    bt_small = remap[bt.long()].to(torch.int32)
    report, ok, want = {}, True, {}
    for name, (kc, vc) in inp["caches"].items():
        kc_s, vc_s = (c.view(torch.uint8)[used].view(c.dtype).cpu() for c in (kc, vc))
        want[name] = _float64(q, kc_s, vc_s, bt_small, lens, n)
        if name == "bf16":
            continue
        got = paged_decode(q, kc, vc, bt, lens, use_triton=True)
        err = float((got.double().cpu() - want[name]).abs().max())
        report[f"decode kernel vs float64, {name} cache"] = err
        ok &= err < 2e-2  # bf16 q and P for the tensor-core products
        q_lens = [1, 7, 33][:n]
        qp = torch.randn(sum(q_lens), args.heads, args.head_dim, device=device).bfloat16()
        tables = bt.tolist()
        got = paged_prefill(qp, kc, vc, tables, q_lens, lens.tolist(), use_triton=True)
        start, errs = 0, []
        for i, t in enumerate(q_lens):
            from lmforge.serve.attention import paged_attention_float64

            w = paged_attention_float64(qp[start : start + t].cpu(), kc_s, vc_s,
                                        bt_small[i].tolist(), int(lens[i]))  # fmt: skip
            errs.append(float((got[start : start + t].double().cpu() - w).abs().max()))
            start += t
        report[f"prefill kernel vs float64, {name} cache"] = max(errs)
        ok &= max(errs) < 2e-2
    for name in ("fp8", "int8"):
        err = float((want[name] - want["bf16"]).abs().max())
        report[f"attention error vs bf16 cache, {name}"] = err
        ok &= err < {"fp8": 0.25, "int8": 0.05}[name]  # measured at E 16: 0.064, 0.020
    return ok, report


def engine_logprob_error(device: str) -> dict:
    """Greedy decoding with fp8 / int8 pages vs bf16 pages on a small random bf16 model: the
    max |log-prob| difference of the generated tokens while the tokens agree, and how many of
    the samples agree on every token."""
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.serve import Engine, SamplingParams

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, context_length=512, d_model=256, n_layers=4, n_heads=8,
                      n_kv_heads=2)  # fmt: skip
    model = TransformerLM(cfg).eval().to(device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 60, 200, 17)]
    params = SamplingParams(temperature=0, max_tokens=32)
    outs = {}
    for name in ("auto", "fp8", "int8"):
        engine = Engine(model, num_blocks=256, kv_cache_dtype=name, cuda_graphs=False,
                        compile=False)  # fmt: skip
        outs[name] = [o.outputs[0] for o in engine.generate(prompts, params)]
    report = {}
    for name in ("fp8", "int8"):
        errs, same = [0.0], 0
        for a, b in zip(outs["auto"], outs[name], strict=True):
            same += a.token_ids == b.token_ids
            for x, y, ta, tb in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids, strict=True):
                errs.append(abs(x - y))
                if ta != tb:
                    break
        report[f"engine log-prob error vs bf16, {name}"] = max(errs)
        report[f"engine samples identical to bf16, {name}"] = f"{same}/{len(prompts)}"
    return report


def bench(args: argparse.Namespace, inp: dict, device: str) -> list[dict]:
    from lmforge.bench.timing import time_ms
    from lmforge.serve.attention import paged_decode, write_kv

    s, h, k, e = args.batch, args.heads, args.kv_heads, args.head_dim
    rows = []
    new_k = torch.randn(s, k, e, device=device, dtype=torch.bfloat16)
    new_slots = torch.arange(s, device=device) * args.block_size  # one per sequence
    for name, (kc, vc) in inp["caches"].items():
        row_bytes = kc.shape[-1] * kc.element_size()
        nbytes = 2 * s * args.ctx * k * row_bytes + 2 * s * h * e * 2  # K, V rows + q, out
        ms = time_ms(
            lambda kc=kc, vc=vc: paged_decode(inp["q"], kc, vc, inp["bt"], inp["lens"],
                                              use_triton=True),
            warmup=5, iters=args.iters, device=device,
        )  # fmt: skip
        write_ms = time_ms(
            lambda kc=kc, vc=vc: write_kv(kc, vc, new_slots, new_k, new_k),
            warmup=5, iters=args.iters, device=device,
        )  # fmt: skip
        floor_ms = nbytes / (args.peak_tbs * 1e12) * 1e3
        rows.append({"kv": name, "bytes_per_row": row_bytes, "attn_ms": ms,
                     "gb": nbytes / 1e9, "tbs": nbytes / (ms * 1e-3) / 1e12,
                     "pct_floor": 100 * floor_ms / ms, "write_ms": write_ms})  # fmt: skip
    base = rows[0]["attn_ms"]
    for r in rows:
        r["speedup"] = base / r["attn_ms"]
    return rows


def table(rows: list[dict], args: argparse.Namespace) -> str:
    head = (f"decode attention, one layer, S={args.batch} × T={args.ctx}, H={args.heads}, "
            f"K={args.kv_heads}, E={args.head_dim}, BS={args.block_size}")  # fmt: skip
    lines = [
        head,
        "",
        "| KV | bytes/row | attention ms | vs bf16 | GB read | TB/s | % of floor | write ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kv']} | {r['bytes_per_row']} | {r['attn_ms']:.3f} | {r['speedup']:.2f}x | "
            f"{r['gb']:.2f} | {r['tbs']:.2f} | {r['pct_floor']:.0f}% | {r['write_ms']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; run with --device cpu under TRITON_INTERPRET=1 for a smoke run")
        return 2
    if device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--device cpu needs TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
            return 2
        args.batch, args.ctx, args.heads, args.kv_heads, args.head_dim = 2, 64, 4, 2, 16
        args.iters, args.check_seqs = 1, 2
    inp = _inputs(args, device)
    ok, report = check(args, inp, device)
    if device == "cuda":
        report.update(engine_logprob_error(device))
    for key, v in report.items():
        print(f"  {key}: {v if isinstance(v, str) else f'{v:.2e}'}")
    rows = bench(args, inp, device)
    versions = {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        versions["gpu"] = torch.cuda.get_device_name()
    text = table(rows, args)
    if args.out:
        from lmforge.utils.io import atomic_write_text

        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"versions": versions, "args": vars(args), "correctness": report,
                   "rows": rows, "ok": ok}  # fmt: skip
        atomic_write_text(args.out / "results.json", json.dumps(payload, indent=1, default=str))
        atomic_write_text(args.out / "table.md", text + "\n")
    print("\nversions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print("correctness: " + ("ok" if ok else "FAILED"))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
