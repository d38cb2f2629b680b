"""Quantization benchmark: quality on SmolLM2-135M-Instruct and decode speed at TinyLlama-1.1B shape.

Part ``quality`` (CPU or GPU): the shipped SmolLM2-135M-Instruct GGUF (dequantized import: the
float baseline, itself carrying the file's Q4_1 rounding) is quantized by the library's own
``quantize_calibrated`` — the function ``lmforge quantize`` calls — with each method, and scored
in bits per byte on WikiText-2 test (calibration on a Gutenberg book, so the two texts differ).
Rows (``--list`` prints them, ``--only`` picks some: bf16 always runs, as every row's paired
reference — each row prints its bits-per-byte difference and twice its standard error, windows as
the paired units — and int4 RTN whenever an int4 row runs, AWQ's and GPTQ's own baseline): bf16;
int4 RTN / AWQ / GPTQ (group 64: SmolLM2's width 576 is not a multiple of 128; GPTQ with the
library's defaults — act order with static groups, diag(H)-weighted clip search of the group
ranges — later the same in input order and with min/max ranges); int8 (per channel); fp8
weight-only by RTN with absmax/448 scales, RTN with MSE-searched scales, GPTQ; fp8 W8A8 (dynamic
per-token activation scales; ``torch._scaled_mm`` on Hopper, emulated with the same rounding
elsewhere) by RTN, SmoothQuant at α = 0.5 and with α searched per group (MSE-searched scales),
GPTQ; fp32.

Part ``speed`` (CUDA): TinyLlama-1.1B-shaped random weights (bf16) for bf16 / int4 (g128) / int8 /
fp8 W8A8 linears, each served by ``Engine(model)`` with its defaults (compiled decode step, CUDA
graphs: the path ``lmforge serve --checkpoint Q`` runs): the median decode step at batch 1
(ms/token) and at batch 64 (tokens/s), 128-token prompts; the floor is the linear weights' bytes
(codes and scales) / 4.27 TB/s. Peers in the same run: torchao's int4 weight-only
(``Int4WeightOnlyConfig``, group 128) when torchao imports, and always Int4Linear's
dequantize-then-matmul torch reference compiled in the same engine step; the independent bf16
static-cache Llama under ``torch.compile(mode="reduce-overhead")`` (gpt-fast style, from
``benchmarks/serve.py``). Correctness first: each format's kernel path against a float64
product with its dequantized weights, and each model's logits against bf16's.

    python benchmarks/quant.py --part quality --device cpu --out runs/quant  # 1-8 min a row (1 core)
    python benchmarks/quant.py --part quality --only "fp8 weight-only" --eval-tokens 16384
    python benchmarks/quant.py --part speed --out bench_out/quant    # CUDA: one engine warm-up a row
    python benchmarks/quant.py --part speed --formats bf16,int4      # the target row alone
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmforge.quant import CalibOptions, QuantSpec, quantize_calibrated  # noqa: E402
from lmforge.quant.calib import calibration_tokens  # noqa: E402
from lmforge.quant.formats import Int4Linear, QuantLinear  # noqa: E402

SHARED = ROOT.parent / "shared"
HBM_BYTES_PER_S = 4.27e12
QUALITY_COLUMNS = ("config", "bpb", "vs_bf16_%", "±2se_%", "vs_rtn_%", "rtn±2se_%", "linear_MB")
QUALITY_COLUMNS += ("quantize_s", "eval_s")


# ------------------------------------------------------------------------------ part (a): quality


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, seq_len: int, batch: int) -> torch.Tensor:
    """(n,) float64 Σ NLL (nats) per window: windows of seq_len+1 tokens overlapping by one, so
    every token after the first is predicted exactly once. bits/byte = sum / ln 2 / bytes."""
    dev = next(model.buffers()).device
    n = (ids.numel() - 1) // seq_len
    windows = torch.stack([ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    out = []
    for chunk in windows.split(batch):
        chunk = chunk.to(dev)
        logits = model(chunk[:, :-1]).float()  # (B, T, V)
        nll = F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")  # (B, T)
        out.append(nll.double().sum(1).cpu())
    return torch.cat(out)


def paired_diff(nll: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Relative bits-per-byte difference of ``nll`` against ``ref`` (per-window nats, same
    windows) in %, and its standard error: windows are the units (the byte count cancels)."""
    d = nll - ref  # (n,)
    total = ref.sum().item()
    se = math.sqrt(d.numel()) * d.std().item() / total if d.numel() > 1 else float("nan")
    return 100 * d.sum().item() / total, 100 * se


def quality(args: argparse.Namespace) -> list[dict]:
    from lmforge.hf.gguf import import_gguf
    from lmforge.model import TransformerLM

    dev = args.device
    text = Path(args.eval_text).read_text(encoding="utf-8")
    base, tok, _ = import_gguf(args.gguf, context_length=max(args.seq_len, args.calib_seq_len) + 1)
    ids = torch.tensor(tok.encode(text[: args.eval_tokens * 8]), dtype=torch.long)
    n = (min(ids.numel() - 1, args.eval_tokens) // args.seq_len) * args.seq_len
    ids = ids[: n + 1]
    n_bytes = len(tok.decode(ids[1:].tolist()).encode("utf-8"))
    calib = calibration_tokens(args.calib, tok, args.calib_samples, args.calib_seq_len)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    rows = []
    g = args.group
    # most wanted first, so a run stopped early still answers the main questions
    mse = args.fp8_scale_grid
    gptq = CalibOptions(gptq_damp=args.gptq_damp)  # the library's defaults (act order, clip)
    configs = [  # most wanted first, so a run stopped early still answers the main questions
        ("bf16", None, None, None),
        (f"int4 rtn g{g}", "rtn", QuantSpec("int4", g), None),
        (f"int4 awq g{g}", "awq", QuantSpec("int4", g), None),
        (f"int4 gptq g{g} act-order", "gptq", QuantSpec("int4", g), gptq),
        ("fp8 weight-only rtn absmax", "rtn", QuantSpec("fp8", fp8_activations="none"), None),
        ("fp8 weight-only rtn mse", "rtn",
         QuantSpec("fp8", fp8_activations="none", fp8_scale_search=mse), None),
        ("fp8 weight-only gptq", "gptq", QuantSpec("fp8", fp8_activations="none"), gptq),
        ("fp8 W8A8 rtn absmax", "rtn", QuantSpec("fp8"), None),
        ("fp8 W8A8 smoothquant", "smoothquant", QuantSpec("fp8", fp8_scale_search=mse),
         CalibOptions(smooth_alpha_grid=0)),
        ("fp8 W8A8 smoothquant alpha-search", "smoothquant",
         QuantSpec("fp8", fp8_scale_search=mse), CalibOptions(smooth_alpha_grid=10)),
        ("fp8 W8A8 gptq", "gptq", QuantSpec("fp8"), gptq),
        (f"int4 gptq g{g} input-order", "gptq", QuantSpec("int4", g),
         dataclasses.replace(gptq, gptq_act_order=False)),
        (f"int4 gptq g{g} min/max act-order", "gptq", QuantSpec("int4", g),
         dataclasses.replace(gptq, gptq_clip_grid=0)),
        ("int8 rtn (per channel)", "rtn", QuantSpec("int8", None), None),
        ("fp32", None, None, None),
    ]  # fmt: skip
    if args.list:
        print("\n".join(c[0] for c in configs))
        return []
    wanted = {c[0] for c in configs if not args.only or any(o in c[0] for o in args.only)}
    if args.only:  # the references of the paired differences always run
        wanted.add("bf16")
        if any(w.startswith("int4 ") for w in wanted):
            wanted.add(f"int4 rtn g{g}")
    ref_nll = rtn_nll = None
    for name, method, spec, options in configs:
        if name not in wanted:
            continue
        model = TransformerLM(base.config)  # a fresh float model for every row
        model.load_state_dict(state)
        model = model.to(dev).eval()
        t0 = time.time()
        if method is not None:
            model = quantize_calibrated(
                model, spec, method, calib if method != "rtn" else None, options or CalibOptions()
            )
        qtime = time.time() - t0
        if name == "bf16":
            model = model.to(torch.bfloat16)
        t0 = time.time()
        nll = window_nll(model, ids, args.seq_len, args.batch)
        bpb = nll.sum().item() / math.log(2) / n_bytes
        if name == "bf16":
            ref_nll = nll  # the reference of every other row
        if name == f"int4 rtn g{g}":
            rtn_nll = nll  # AWQ's and GPTQ's own baseline
        wbytes = sum(
            sum(b.numel() * b.element_size() for b in m.buffers())
            if isinstance(m, QuantLinear)
            else m.weight.numel() * m.weight.element_size()
            for m in model.modules()
            if isinstance(m, QuantLinear) or type(m).__name__ == "Linear"
        )
        row = {
            "config": name,
            "bpb": bpb,
            "linear_MB": wbytes / 1e6,
            "quantize_s": qtime,
            "eval_s": time.time() - t0,
            "windows": nll.numel(),
        }
        if ref_nll is not None:
            pct, se = paired_diff(nll, ref_nll)
            row["vs_bf16_%"] = pct
            row["±2se_%"] = 2 * se
        if rtn_nll is not None and name.startswith("int4 ") and nll is not rtn_nll:
            pct, se = paired_diff(nll, rtn_nll)
            row["vs_rtn_%"] = pct
            row["rtn±2se_%"] = 2 * se
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # per-window NLLs, so other differences can be formed afterwards
            d = Path(args.out) / "nll"
            d.mkdir(parents=True, exist_ok=True)
            torch.save(nll, d / (name.replace(" ", "_").replace("/", "-") + ".pt"))
    return rows


# -------------------------------------------------------------------------------- part (b): speed


def tinyllama_config():
    from lmforge.model import ModelConfig

    return ModelConfig(
        vocab_size=32000, context_length=2048, d_model=2048, n_layers=22, n_heads=32,
        n_kv_heads=4, d_ff=5632, rope_theta=10000.0, norm_eps=1e-5, attention="sdpa",
    )  # fmt: skip


def _bytes_read(model) -> int:
    """Bytes a decode step reads from the linears (codes, scales, offsets; bf16 weights)."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.weight_bytes()
        elif type(m).__name__ in ("Linear",) and hasattr(m, "weight"):
            total += m.weight.numel() * m.weight.element_size()
    return total


def _check_format(spec: QuantSpec, dev: str) -> float:
    """Max relative error of the module's fast path vs float64 with its dequantized weights."""
    from lmforge.quant.apply import quantize_linear

    w = torch.randn(2048, 5632, device=dev) * 0.02
    m = quantize_linear(w, spec)
    worst = 0.0
    for rows in (1, 8, 64):
        x = torch.randn(rows, 5632, device=dev, dtype=torch.bfloat16)
        got = m(x).double()
        xin = x.double()
        if spec.format == "fp8" and spec.fp8_activations == "dynamic":
            from lmforge.quant.formats import fp8_quantize_rows

            xq, sx = fp8_quantize_rows(x)
            xin = xq.double() * sx.double()
        want = xin @ m.dequantize().double().t()
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


def _model(kind: str, dev: str):
    from lmforge.model import TransformerLM
    from lmforge.quant import quantize_model

    torch.manual_seed(0)
    model = TransformerLM(tinyllama_config(), device=dev)
    spec = {
        "int8": QuantSpec("int8", None),
        "int4": QuantSpec("int4", 128),
        "fp8": QuantSpec("fp8"),
        "int4-torch-ref": QuantSpec("int4", 128),
    }.get(kind)
    if spec is not None:
        quantize_model(model, spec)
    model = model.to(torch.bfloat16).eval()
    if kind == "int4-torch-ref":
        for mod in model.modules():
            if isinstance(mod, Int4Linear):
                mod.forward = mod.reference  # the dequantize-then-matmul torch path
    if kind == "torchao-int4":
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        _to_nn_linear(model)
        quantize_(model, Int4WeightOnlyConfig(group_size=128))
    return model


def _to_nn_linear(model) -> None:
    from torch import nn

    from lmforge.model.layers import Linear

    for name, m in list(model.named_modules()):
        if type(m) is Linear and name != "lm_head":
            lin = nn.Linear(
                m.d_in, m.d_out, bias=False, device=m.weight.device, dtype=m.weight.dtype
            )
            lin.weight = m.weight
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, lin)


def _serve_bench():
    """benchmarks/serve.py as a module: its engine-decode timer and its independent compiled
    static-cache Llama (the gpt-fast-style peer)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_lmforge_serve_bench", Path(__file__).with_name("serve.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def speed(args: argparse.Namespace) -> list[dict]:
    """Each format through ``Engine(model)`` with its defaults (compiled decode step, CUDA
    graphs: what ``lmforge serve --checkpoint Q`` runs): ms per decode step at batch 1 and
    tokens/s at batch 64; peers in the same run."""
    assert torch.cuda.is_available(), "the speed part needs CUDA"
    dev = "cuda"
    print("correctness (kernel path vs float64, rel. max error):")
    for spec in (
        QuantSpec("int8", None),
        QuantSpec("int4", 128),
        QuantSpec("int4", 128, symmetric=True),
        QuantSpec("fp8"),
    ):
        err = _check_format(spec, dev)
        ok = err < (0.03 if spec.format == "fp8" else 0.01)
        print(
            f"  {spec.format} g{spec.group_size} sym={spec.symmetric}: {err:.2e} {'ok' if ok else 'FAIL'}"
        )
        assert ok
    bench = _serve_bench()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 32000, (64, args.prompt), generator=gen).tolist()
    # the target's rows first (bf16, int4 and their peers), then int8 and fp8
    kinds = [k for k in ("bf16", "int4") if k in args.formats]
    if "peers" in args.formats:
        try:
            import torchao  # noqa: F401

            kinds.append("torchao-int4")
        except Exception as e:
            print(f"torchao not usable ({type(e).__name__}: {e}); int4 peer = Int4Linear's torch "
                  "dequantize-then-matmul reference, compiled in the same engine step")  # fmt: skip
        kinds += ["int4-torch-ref", "bf16-peer"]
    kinds += [k for k in ("int8", "fp8") if k in args.formats]
    rows: list[dict] = []
    ref_logits = None
    probe = torch.tensor([prompts[0][:16]], device=dev)
    for kind in kinds:
        if kind == "bf16-peer":
            ms, how = bench._peer_decode(bench.TINYLLAMA, prompts[0], args.new, compile=True)
            row = {"format": "bf16 peer: " + how, "b1_ms_per_token": ms}
            bf = next((r for r in rows if r["format"] == "bf16"), None)
            if bf is not None:
                row["b1_vs_bf16"] = ms / bf["b1_ms_per_token"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        print(f"{kind}: building the model and its engine", flush=True)
        try:
            model = _model(kind, dev)
        except Exception as e:
            print(f"{kind}: could not build ({type(e).__name__}: {e})")
            continue
        wbytes = _bytes_read(model)
        if kind == "torchao-int4":  # its tensor subclass reports logical bf16 sizes
            wbytes = next((r["weight_MB"] for r in rows if r["format"] == "int4"), 0) * 1e6
        row = {
            "format": kind,
            "weight_MB": wbytes / 1e6,
            "floor_ms": wbytes / HBM_BYTES_PER_S * 1e3,
        }
        eager = model(probe)[0, -1].float()  # the quantized model's own forward vs bf16's
        if kind == "bf16":
            ref_logits = eager
        elif ref_logits is not None:
            row["logits_vs_bf16_rel"] = ((eager - ref_logits).norm() / ref_logits.norm()).item()
        try:
            (b1, b64), summary = bench._engine_decode(model, [prompts[:1], prompts], args.new)
        except Exception as e:
            print(f"{kind}: the engine failed ({type(e).__name__}: {str(e).splitlines()[0]})")
            continue
        row["b1_ms_per_token"] = b1
        row["b64_tokens_per_s"] = 64 / b64 * 1e3
        bf = next((r for r in rows if r["format"] == "bf16"), None)
        if bf is not None:
            row["b1_vs_bf16"] = b1 / bf["b1_ms_per_token"]
        row["engine"] = summary
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def _table(rows: list[dict], cols: Sequence[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=["quality", "speed", "all"], default="all")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gguf", default=str(SHARED / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--eval-text", default=str(SHARED / "data/text/wikitext2/test.txt"))
    p.add_argument("--calib", default=str(SHARED / "data/text/gutenberg/Austen_Emma.txt"))
    p.add_argument(
        "--eval-tokens",
        type=int,
        default=32768,
        help="WikiText-2 tokens scored (windows of --seq-len)",
    )
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--gptq-damp", type=float, default=0.01)
    p.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="quality rows whose name contains one of these (bf16, the reference, always runs; "
        "int4 rtn too when an int4 row does); --list prints the names",
    )
    p.add_argument("--list", action="store_true", help="print the quality rows' names and exit")
    p.add_argument(
        "--fp8-scale-grid", type=int, default=50, help="steps of the fp8 rows' mse scale search"
    )
    p.add_argument("--prompt", type=int, default=128, help="speed: prompt tokens per request")
    p.add_argument("--new", type=int, default=64, help="speed: tokens decoded per request")
    p.add_argument(
        "--formats",
        type=lambda v: v.split(","),
        default=["bf16", "int4", "int8", "fp8", "peers"],
        help="speed: comma-separated rows to run (default bf16,int4,int8,fp8,peers)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    out = {}
    if args.part == "quality" or (args.part == "all" and Path(args.gguf).is_file()):
        out["quality"] = quality(args)
    elif args.part == "all":
        print(f"quality part skipped: {args.gguf} not found (--gguf FILE)")
    if args.part in ("speed", "all"):
        out["speed"] = speed(args)
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "quant.json").write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"\ntorch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "")
    )
    if "quality" in out:
        print("\nSmolLM2-135M-Instruct, WikiText-2 test bits per byte (calibration: Gutenberg)")
        print(_table(out["quality"], QUALITY_COLUMNS))
    if "speed" in out:
        print(
            f"\nTinyLlama-1.1B shape, random weights, Engine(model) defaults (median decode step at "
            f"full batch); floor = linear-weight bytes / {HBM_BYTES_PER_S / 1e12} TB/s"
        )
        print(
            _table(
                out["speed"],
                [
                    "format",
                    "weight_MB",
                    "floor_ms",
                    "b1_ms_per_token",
                    "b64_tokens_per_s",
                    "b1_vs_bf16",
                    "logits_vs_bf16_rel",
                ],
            )
        )


if __name__ == "__main__":
    main()
