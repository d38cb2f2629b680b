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

Part ``gemv`` (CUDA): the int4 (g128) and int8 (per channel) decode GEMVs alone on TinyLlama's
four layer shapes at batch 1, inside a CUDA graph, against the bf16 GEMV on the same shape: the
shipped launch (TABLE's, else the default) and a sweep (the tensor-core dot kernel, and for
int4 the CUDA-core row kernel; groups or K chunks a loop iteration, rows a program, split-K,
warps), each launch checked against float64 first, timed on weight copies larger than L2; a
launch more than 2% faster than the shipped one goes
into ``lmforge.quant._gemv_triton.TABLE`` (``--part speed --tune`` builds the engines with them
in the same run). fp8 (W8A8, per channel): the row kernel's launches against the module's own
batch-1 path (the row rounded to e4m3, ``torch._scaled_mm``), which stays unless beaten by 2%.

Part ``speed`` (CUDA): TinyLlama-1.1B-shaped random weights (bf16) for bf16 / int4 (g128) / int8 /
fp8 W8A8 linears, each served by ``Engine(model)`` with its defaults (compiled decode step, CUDA
graphs: the path ``lmforge serve --checkpoint Q`` runs): the median decode step at batch 1
(ms/token) and at batch 64 (tokens/s), 128-token prompts; the floor is the linear weights' bytes
(codes and scales) / the card's copy bandwidth, measured first. Each format's engine builds in a
process of its own, side by side (a 22-layer engine compiles for 2-3 minutes); the engines are
then timed one at a time with nothing else running (``--profile``: the kernels of 20 batch-1
steps per format, with the GPU's busy time and the gaps between kernels). Peers in the same run: torchao's int4 weight-only
(``Int4WeightOnlyConfig``, group 128) when torchao imports; always its kernel, torch's own
tinygemm (``aten._weight_int4pack_mm``) on the same codes in the same engine (int4-tinygemm; also
a column of the GEMV sweep), and Int4Linear's dequantize-then-matmul torch reference compiled in
the same engine step (int4-torch-ref); the independent bf16
static-cache Llama under ``torch.compile(mode="reduce-overhead")`` (gpt-fast style, from
``benchmarks/serve.py``). Correctness first: each format's kernel path against a float64
product with its dequantized weights, and each model's logits against bf16's.

    python benchmarks/quant.py --part quality --device cpu --out runs/quant  # 1-8 min a row (1 core)
    python benchmarks/quant.py --part quality --only "fp8 weight-only" --eval-tokens 16384
    python benchmarks/quant.py --part speed --out bench_out/quant    # CUDA: one engine warm-up a row
    python benchmarks/quant.py --part speed --formats bf16,int4      # the target row alone
    python benchmarks/quant.py --part speed --device cpu --layers 1 --batch-large 4 --new 8  # smoke
    python benchmarks/quant.py --part gemv     # CUDA: the int4/int8/fp8 GEMV launches swept
    python benchmarks/quant.py --part speed --tune --profile   # the sweep, then engines built with it
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import queue
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


def _model(kind: str, dev: str, layers: int = 22):
    from lmforge.model import TransformerLM
    from lmforge.quant import quantize_model

    torch.manual_seed(0)
    cfg = dataclasses.replace(tinyllama_config(), n_layers=layers)
    model = TransformerLM(cfg, device=dev)
    spec = {
        "int8": QuantSpec("int8", None),
        "int4": QuantSpec("int4", 128),
        "fp8": QuantSpec("fp8"),
        "int4-torch-ref": QuantSpec("int4", 128),
        "int4-tinygemm": QuantSpec("int4", 128),
    }.get(kind)
    if spec is not None:
        quantize_model(model, spec)
    model = model.to(torch.bfloat16).eval()
    if kind == "int4-torch-ref":
        for mod in model.modules():
            if isinstance(mod, Int4Linear):
                mod.forward = mod.reference  # the dequantize-then-matmul torch path
    if kind == "int4-tinygemm":
        for mod in model.modules():
            if isinstance(mod, Int4Linear):
                tinygemm_forward(mod)
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


def tinygemm_pack(mod: Int4Linear, inner_k_tiles: int = 8):
    """``mod``'s codes and parameters in the layout of torch's own int4 weight-only kernel:
    ``(op, packed, scales_and_zeros)``, ``op(x_bf16 (M, K), packed, group, scales_and_zeros)``
    -> (M, N). The kernel is tinygemm, ``aten._weight_int4pack_mm``, the one behind torchao's
    ``Int4WeightOnlyConfig`` (its tensor-core tiled layout): the int4 peer here, where torchao
    itself does not import. tinygemm dequantizes (q − 8)·s + z with bf16 s and z, so
    z = m + 8·s (asymmetric; 0 symmetric), our fp16 parameters rounded to bf16. CUDA packs two
    codes a byte (even column in the high nibble) before its tiling; the CPU op (smoke runs)
    takes the codes unpacked."""
    q = mod.codes().to(torch.int32)  # (N, K) 0..15
    s = mod.scales.float()
    z = torch.zeros_like(s) if mod.offsets is None else mod.offsets.float() + 8.0 * s
    sz = torch.stack([s, z], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # (K/G, N, 2)
    if q.is_cuda:
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # (N, K/2)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)
        return torch.ops.aten._weight_int4pack_mm, packed, sz
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)
    return torch.ops.aten._weight_int4pack_mm_for_cpu, packed, sz


def tinygemm_forward(mod: Int4Linear) -> None:
    """Give ``mod`` tinygemm (:func:`tinygemm_pack`) as its forward: an instance attribute, so
    the engine runs the module as itself, off lmforge's GEMV (the int4-tinygemm peer row)."""
    op, packed, sz = tinygemm_pack(mod)
    mod.register_buffer("tinygemm_w", packed)
    mod.register_buffer("tinygemm_sz", sz)
    g, n = mod.group_size, mod.d_out

    def forward(x: torch.Tensor) -> torch.Tensor:
        x2 = mod._scaled_input(x).reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = op(x2, mod.tinygemm_w, g, mod.tinygemm_sz)  # (rows, N) bf16
        return y.reshape(*x.shape[:-1], n).to(x.dtype)

    mod.forward = forward


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


def _bandwidth(dev: str) -> float:
    """The floor's denominator, bytes/s: the card's copy bandwidth measured now
    (:func:`lmforge.bench.timing.copy_bandwidth_gbs`), the H200's on the CPU (smoke runs)."""
    from lmforge.bench.timing import copy_bandwidth_gbs

    return copy_bandwidth_gbs() * 1e9 if dev == "cuda" else HBM_BYTES_PER_S


def _speed_worker(kind: str, cfg: dict, ready, go, results) -> None:
    """One format in its own process: build the model and ``Engine(model)`` (compile and
    CUDA-graph warm-ups, side by side with the other formats' builds), say ready, wait for
    ``go`` (the parent times one engine at a time, nothing else running), then time batch 1
    and batch ``cfg['batch']``, and profile batch-1 steps with ``cfg['profile']``."""
    try:
        torch.set_grad_enabled(False)
        from lmforge.quant import _gemv_triton

        for key, c in cfg["gemv_table"]:  # --tune: the sweep's launches, before any compile
            _gemv_triton.TABLE[tuple(key)] = _gemv_triton.QuantGemvConfig(**c)
        bench = _serve_bench()
        dev = cfg["device"]
        bench.DEVICE = dev
        model = _model(kind, dev, cfg["layers"])
        wbytes = _bytes_read(model)
        probe = torch.tensor([cfg["prompts"][0][:16]], device=dev)
        # the quantized model's own forward, as a list (a tensor would travel as shared
        # memory that dies with this process)
        logits = model(probe)[0, -1].float().cpu().tolist()
        t0 = time.perf_counter()
        eng, summary = bench._engine_build(model, cfg["prompts"][0], **cfg["engine_kw"])
        ready.put((kind, time.perf_counter() - t0, None))
    except Exception as e:  # reported by the parent as the row's failure
        ready.put((kind, 0.0, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        return
    go.wait()
    try:
        prompts = cfg["prompts"]
        b1, bn = bench._engine_time(eng, [prompts[:1], prompts[: cfg["batch"]]], cfg["new"])
        if cfg["profile"] and dev == "cuda":  # (the profiler pass reads CUDA kernels)
            from lmforge.serve import SamplingParams

            eng.add_request(
                prompts[0], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
            )
            while eng.has_unfinished() and not eng.step():  # through the prefill
                pass
            bench.profile_steps(eng, f"{kind}, batch 1 decode steps", n_steps=20, top=12)
            while eng.has_unfinished():
                eng.step()
        results.put((kind, {"b1": b1, "bn": bn, "summary": summary, "wbytes": wbytes,
                            "logits": logits}, None))  # fmt: skip
    except Exception as e:
        results.put((kind, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


def speed(args: argparse.Namespace) -> list[dict]:
    """Each format through ``Engine(model)`` (compiled decode step, CUDA graphs: what ``lmforge
    serve --checkpoint Q`` runs): ms per decode step at batch 1 and tokens/s at batch 64; peers
    in the same run. Each format builds in its own process, side by side (one engine's compile
    takes 2-3 minutes on the GPU host; one after another they outlast a device call); then
    the engines are timed one at a time with nothing else running."""
    import multiprocessing as mp

    dev = args.device
    assert dev == "cuda" or args.layers < 22, "the speed part needs CUDA (or --layers < 22)"
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
    table: list = []
    if args.tune:  # the GEMV launches swept first; the engines below are built with them
        args.gemv_rows = gemv_sweep(args)
        table = [(r["key"], r["config"]) for r in args.gemv_rows if r["tuned"]]
    bw = args.bandwidth if args.tune else _bandwidth(dev)  # (--tune: the sweep measured it)
    args.bandwidth = bw
    print(f"copy bandwidth (1 GiB, read + write): {bw / 1e12:.2f} TB/s" if dev == "cuda" else
          f"CPU smoke run: floors at the H200's {bw / 1e12} TB/s")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 32000, (args.batch_large, args.prompt), generator=gen).tolist()
    kinds = [k for k in ("bf16", "int4") if k in args.formats]
    if "peers" in args.formats:
        try:
            import torchao  # noqa: F401

            kinds.append("torchao-int4")
        except Exception as e:
            print(f"torchao not usable ({type(e).__name__}: {e}); int4 peers = its kernel, torch's"
                  " tinygemm, on our codes, and Int4Linear's torch dequantize-then-matmul"
                  " reference, each compiled in the same engine step")  # fmt: skip
        kinds += ["int4-torch-ref", "int4-tinygemm"]
    kinds += [k for k in ("int8", "fp8") if k in args.formats]
    # the KV cache sized for the runs (every engine holds its cache at once): 64 sequences of
    # prompt + new tokens, twice over; decode speed does not depend on the cache's size
    per_seq = -(-(args.prompt + args.new + 16) // 16)
    cfg = {"device": dev, "layers": args.layers, "prompts": prompts, "new": args.new,
           "batch": args.batch_large, "profile": args.profile, "gemv_table": table,
           "engine_kw": {"num_blocks": 2 * args.batch_large * per_seq + 64}}  # fmt: skip
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    gos = {k: ctx.Event() for k in kinds}
    procs = {k: ctx.Process(target=_speed_worker, args=(k, cfg, ready, gos[k], results))
             for k in kinds}  # fmt: skip
    t0 = time.perf_counter()
    for pr in procs.values():
        pr.start()
    built: dict[str, str | None] = {}
    while len(built) < len(kinds):
        try:
            kind, secs, err = ready.get(timeout=10)
        except queue.Empty:
            dead = [k for k, pr in procs.items() if k not in built and not pr.is_alive()]
            for k in dead:
                built[k] = f"the build process exited ({procs[k].exitcode})"
                print(f"{k}: {built[k]}", flush=True)
            continue
        built[kind] = err
        print(f"{kind}: " + (f"built in {secs:.0f} s" if err is None else f"could not build ({err})"),
              flush=True)  # fmt: skip
    print(f"every engine built after {time.perf_counter() - t0:.0f} s (side by side)", flush=True)
    rows: list[dict] = []
    ref_logits = None
    for kind in kinds:
        if built[kind] is not None:
            continue
        gos[kind].set()
        while True:
            try:
                got, res, err = results.get(timeout=10)
                assert got == kind, (got, kind)
                break
            except queue.Empty:
                if not procs[kind].is_alive():
                    res, err = None, f"the process exited ({procs[kind].exitcode})"
                    break
        procs[kind].join(timeout=60)
        if err is not None:
            print(f"{kind}: the engine failed ({err})")
            continue
        wbytes = res["wbytes"]
        if kind in ("torchao-int4", "int4-tinygemm"):  # torchao's tensor subclass reports
            # bf16 sizes; tinygemm's buffers sit beside the codes it was converted from
            wbytes = next((r["weight_MB"] for r in rows if r["format"] == "int4"), 0) * 1e6
        row = {"format": kind, "weight_MB": wbytes / 1e6, "floor_ms": wbytes / bw * 1e3,
               "b1_ms_per_token": res["b1"], "b64_tokens_per_s": args.batch_large / res["bn"] * 1e3}  # fmt: skip
        row["b1_vs_floor"] = row["b1_ms_per_token"] / row["floor_ms"]
        if kind == "bf16":
            ref_logits = torch.tensor(res["logits"])
        elif ref_logits is not None:
            row["logits_vs_bf16_rel"] = (
                (torch.tensor(res["logits"]) - ref_logits).norm() / ref_logits.norm()
            ).item()
        bf = next((r for r in rows if r["format"] == "bf16"), None)
        if bf is not None:
            row["b1_vs_bf16"] = res["b1"] / bf["b1_ms_per_token"]
            row["b64_vs_bf16"] = row["b64_tokens_per_s"] / bf["b64_tokens_per_s"]
        row["engine"] = res["summary"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    for pr in procs.values():
        pr.join(timeout=30)
    if "peers" in args.formats:  # last, alone: its own compile and timing
        bench = _serve_bench()
        bench.DEVICE = dev
        shape = {**bench.TINYLLAMA, "n_layers": args.layers}
        ms, how = bench._peer_decode(shape, prompts[0], args.new, compile=dev == "cuda")
        row = {"format": "bf16 peer: " + how, "b1_ms_per_token": ms}
        bf = next((r for r in rows if r["format"] == "bf16"), None)
        if bf is not None:
            row["b1_vs_bf16"] = ms / bf["b1_ms_per_token"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# TinyLlama-1.1B's layer weights (N, K): packed q/k/v, o, packed w1/w3, w2
GEMV_SHAPES = {"q|k|v": (2560, 2048), "o": (2048, 2048), "w1|w3": (11264, 2048), "w2": (2048, 5632)}


def _row_launches(chunks: int, splits: tuple) -> list:
    """The row (CUDA-core) kernel's batch-1 launches the sweep tries: tiles of at most 64
    registers a thread in their sm_90 PTX, 1-4 groups or chunks an iteration, the shape's
    splits."""
    from lmforge.quant._gemv_triton import QuantGemvConfig

    return [
        QuantGemvConfig(split, sub, bn, warps, rows_kernel=True)
        for bn, warps in ((32, 4), (64, 8), (16, 2))
        for sub in (1, 2, 4) if chunks % sub == 0
        for split in splits if split <= chunks // sub
    ]  # fmt: skip


def _correct(label: str, cands: list, run, want: torch.Tensor) -> list:
    """The launches of ``cands`` whose ``run(cfg)`` partials add up to ``want`` (float64) within
    1e-2 relative; the others (or one the card cannot run) are printed and dropped."""
    ok = []
    for cfg in cands:
        try:
            got = run(cfg).sum(0).double()
        except Exception as e:  # a launch the card cannot run (shared memory)
            print(f"  {label} {cfg}: {type(e).__name__}", flush=True)
            continue
        err = ((got - want).abs().max() / want.abs().max()).item()
        if err < 1e-2:
            ok.append(cfg)
        else:
            print(f"  {label} {cfg}: error {err:.2e}, dropped", flush=True)
    return ok


def _fp8_sweep(bench, name: str, n: int, k: int, x: torch.Tensor, wbs: list, splits: tuple,
               bw: float, bf16_us: float) -> dict:  # fmt: skip
    """fp8 (W8A8, per channel) at batch 1: the engine's path without a TABLE entry (the
    module's own forward: the row rounded to e4m3, ``torch._scaled_mm``) against the row
    kernel's launches (the row's rounding included), each checked against float64 first."""
    import math

    from lmforge.quant import Fp8Linear
    from lmforge.quant._gemv_triton import fp8_block_k, fp8_gemv_partials
    from lmforge.quant.formats import fp8_quantize_rows

    mod = Fp8Linear.from_float(wbs[0].float())
    nbytes = mod.weight_bytes()
    copies = []  # consecutive calls stream from HBM, not L2
    for _ in range(max(1, math.ceil(256e6 / nbytes))):
        m = Fp8Linear(k, n)
        m.qweight, m.scales = mod.qweight.clone(), mod.scales.clone()
        copies.append(m)

    def gemv(cfg, i=0):
        m = copies[i % len(copies)]
        xq, sx = fp8_quantize_rows(x)  # (1, K), (1, 1)
        return fp8_gemv_partials(xq, m.qweight, m.scales, sx.reshape(1), cfg)

    ok = _correct(f"{name} fp8", _row_launches(k // fp8_block_k(k), splits), gemv,
                  mod.reference(x).double())  # fmt: skip
    times = bench._graph_us([lambda i: copies[i % len(copies)](x)]
                            + [lambda i, cfg=cfg: gemv(cfg, i) for cfg in ok])  # fmt: skip
    scaled_us = times[0]
    best_us, best = min(zip(times[1:], ok, strict=True), key=lambda t: t[0])
    tuned = best_us < 0.98 * scaled_us  # the GEMV replaces _scaled_mm only where faster
    return {"shape": f"{name} {n}x{k}", "format": "fp8", "MB": nbytes / 1e6,
            "floor_us": nbytes / bw * 1e6, "default_us": scaled_us,
            "best_us": min(best_us, scaled_us), "best_TBps": nbytes / min(best_us, scaled_us) / 1e6,
            "bf16_us": bf16_us, "bf16_TBps": n * k * 2 / bf16_us / 1e6,
            "best": (f"rows kernel, block_n {best.block_n}, split {best.split} sub {best.sub} "
                     f"warps {best.warps} ({best_us:.2f} us)" if tuned else
                     f"torch._scaled_mm (rows kernel's best {best_us:.2f} us)"),
            "tuned": tuned, "key": ["fp8", n, k, k],
            "config": dataclasses.asdict(best)}  # fmt: skip


def _tinygemm_us(bench, mod: Int4Linear, x: torch.Tensor, want: torch.Tensor, copies: int,
                 nbytes: int) -> dict:  # fmt: skip
    """The peer's columns of an int4 sweep row: tinygemm (:func:`tinygemm_pack`) on ``mod``'s
    codes at batch 1, checked against float64 (1e-2 relative, as every launch), timed like the
    launches on ``copies`` copies of its buffers."""
    try:
        op, packed, sz = tinygemm_pack(mod)
        xb = x.to(torch.bfloat16)
        got = op(xb, packed, mod.group_size, sz).double()
        err = ((got - want).abs().max() / want.abs().max()).item()
        if not err < 1e-2:
            print(f"  tinygemm: error {err:.2e}, not timed", flush=True)
            return {"tinygemm_us": float("nan")}
        bufs = [(packed.clone(), sz.clone()) for _ in range(copies)]
        g = mod.group_size
        us = bench._graph_us([lambda i: op(xb, bufs[i % copies][0], g, bufs[i % copies][1])])[0]
    except Exception as e:  # not on this card or torch build: the row says so
        print(f"  tinygemm: {type(e).__name__}: {e}", flush=True)
        return {"tinygemm_us": float("nan")}
    return {"tinygemm_us": us, "tinygemm_TBps": nbytes / us / 1e6}


def gemv_sweep(args: argparse.Namespace) -> list[dict]:
    """The int4 (g128) and int8 (per channel) decode GEMVs on TinyLlama's four layer shapes at
    batch 1: the default launch and a sweep (groups or K chunks an iteration, split, warps),
    each checked against float64 first, against the bf16 GEMV the engine runs on the same
    shape. Timed as ``benchmarks/serve.py``'s GEMV sweep is: 20 calls in one CUDA graph (the
    engine's setting), on enough weight copies that no call finds its weight in L2, replays
    of all launches interleaved."""
    import math

    from lmforge.quant import Int8Linear
    from lmforge.quant._gemv_triton import (
        QuantGemvConfig,
        int4_gemv_partials,
        int8_block_k,
        int8_gemv_partials,
        quant_gemv_config,
    )
    from lmforge.serve._gemv_triton import gemv_partials

    dev = args.device
    bench = _serve_bench()
    bench.DEVICE = dev
    args.bandwidth = bw = _bandwidth(dev)
    print(f"copy bandwidth (1 GiB, read + write): {bw / 1e12:.2f} TB/s", flush=True)
    rows: list[dict] = []
    for name, (n, k) in GEMV_SHAPES.items():
        # bf16 as the engine runs it; fp32 in a CPU smoke run (Triton's interpreter multiplies
        # bf16 bit patterns in tl.dot)
        dtype = torch.bfloat16 if dev == "cuda" else torch.float32
        x = torch.randn(1, k, device=dev, generator=torch.Generator(device=dev).manual_seed(k))
        x = x.to(dtype)
        wbs = bench._weight_copies(n, k, dtype)
        bf16_us = bench._graph_us([lambda i, x=x, w=wbs: gemv_partials(x, w[i % len(w)])])[0]
        # w1|w3's partials are summed inside the SiLU-mul kernel, which reads them twice
        # (gate and up halves): at split 8 inductor makes that sum a kernel of its own
        # (the 2026-12-05 H100 profile: 22 more kernels, 26 us a step). Timed alone, the
        # GEMV cannot show that cost, so the sweep keeps this shape to splits <= 4
        splits = (1, 2, 4) if name == "w1|w3" else (1, 2, 4, 8)
        for fmt in ("int4", "int8"):
            if fmt == "int4":
                g, chunks = 128, k // 128
                mods = [Int4Linear.from_float(w.float(), g) for w in wbs[:1]]
            else:
                g, chunks = k, k // int8_block_k(k)
                mods = [Int8Linear.from_float(w.float(), None) for w in wbs[:1]]
            nbytes = mods[0].weight_bytes()
            # copies of the quantized buffers: consecutive calls stream from HBM, not L2
            bufs = [[b.clone() for b in mods[0].buffers() if b is not None]
                    for _ in range(max(1, math.ceil(256e6 / nbytes)))]  # fmt: skip

            def run(cfg, i=0, fmt=fmt, g=g, bufs=bufs, x=x):
                b = bufs[i % len(bufs)]
                if fmt == "int4":  # qweight, scales, offsets
                    return int4_gemv_partials(x, b[0], b[1], b[2], g, cfg)
                return int8_gemv_partials(x, b[0], b[1], g, cfg)

            want = x.double() @ mods[0].dequantize().double().t()
            default = quant_gemv_config(fmt, n, k, g, torch.device(dev))
            cands = [default] + [
                QuantGemvConfig(split, sub, 64, warps)
                for sub in (1, 2, 4, 8) if chunks % sub == 0
                for split in splits if split <= chunks // sub
                for warps in (4, 8)
            ] + (_row_launches(chunks, splits) if fmt == "int4" else [])  # fmt: skip
            ok = _correct(f"{name} {fmt}", cands, run, want)
            times = bench._graph_us([lambda i, cfg=cfg: run(cfg, i) for cfg in ok])
            timed = list(zip(times, ok, strict=True))
            default_us = timed[0][0] if timed and timed[0][1] == default else float("nan")
            best_us, best = min(timed, key=lambda t: t[0])
            # a launch goes into the table only where it beats the default by more than 2%
            tuned = best != default and best_us < 0.98 * default_us
            best = best if tuned else default
            row = {"shape": f"{name} {n}x{k}", "format": fmt, "MB": nbytes / 1e6,
                   "floor_us": nbytes / bw * 1e6, "default_us": default_us,
                   "best_us": best_us, "best_TBps": nbytes / best_us / 1e6,
                   "bf16_us": bf16_us, "bf16_TBps": n * k * 2 / bf16_us / 1e6,
                   "best": f"{'rows' if best.rows_kernel else 'dot'} kernel, block_n "
                           f"{best.block_n}, split {best.split} sub {best.sub} warps {best.warps}",
                   "tuned": tuned, "key": [fmt, n, k, g],
                   "config": dataclasses.asdict(best)}  # fmt: skip
            if fmt == "int4":  # the peer: torch's tinygemm on the same codes
                row.update(_tinygemm_us(bench, mods[0], x, want, len(bufs), nbytes))
            rows.append(row)
            print(json.dumps(row), flush=True)
        row = _fp8_sweep(bench, name, n, k, x, wbs, splits, bw, bf16_us)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("TABLE entries (lmforge/quant/_gemv_triton.py):")
    for r in (r for r in rows if r["tuned"]):
        fmt, n, k, g = r["key"]
        c = r["config"]
        kernel = ", rows_kernel=True" if c["rows_kernel"] else ""
        print(f'    ("{fmt}", {n}, {k}, {g}): QuantGemvConfig({c["split"]}, sub={c["sub"]}, '
              f'block_n={c["block_n"]}, warps={c["warps"]}{kernel}),')  # fmt: skip
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
    p.add_argument("--part", choices=["quality", "speed", "gemv", "all"], default="all")
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
    p.add_argument(
        "--layers",
        type=int,
        default=22,
        help="speed: layers of the TinyLlama shape (fewer: a quick CPU smoke run)",
    )
    p.add_argument("--batch-large", type=int, default=64, help="speed: the large batch")
    p.add_argument(
        "--profile",
        action="store_true",
        help="speed: torch.profiler over 20 batch-1 decode steps per format",
    )
    p.add_argument("--tune", action="store_true",
                   help="speed: run the GEMV sweep (--part gemv) first and build the int4/int8 "
                        "engines with its winning launches")  # fmt: skip
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
        if getattr(args, "gemv_rows", None):
            out["gemv"] = args.gemv_rows
    if args.part == "gemv":
        out["gemv"] = gemv_sweep(args)
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
    if "gemv" in out:
        print(f"\nDecode GEMV at batch 1, TinyLlama shapes, in a CUDA graph; floor = bytes / "
              f"{args.bandwidth / 1e12:.2f} TB/s (copy bandwidth measured)")  # fmt: skip
        cols = ["shape", "format", "MB", "floor_us", "default_us", "best_us", "best_TBps"]
        cols += ["tinygemm_us", "tinygemm_TBps", "bf16_us", "bf16_TBps", "best"]
        print(_table(out["gemv"], cols))
    if "speed" in out:
        print(
            f"\nTinyLlama-1.1B shape ({args.layers} layers), random weights, Engine(model) "
            f"(median decode step at full batch; KV cache sized for the runs); floor = "
            f"linear-weight bytes / {args.bandwidth / 1e12:.2f} TB/s (copy bandwidth measured)"
        )
        print(
            _table(
                out["speed"],
                [
                    "format",
                    "weight_MB",
                    "floor_ms",
                    "b1_ms_per_token",
                    "b1_vs_floor",
                    "b1_vs_bf16",
                    "b64_tokens_per_s",
                    "b64_vs_bf16",
                    "logits_vs_bf16_rel",
                ],
            )
        )


if __name__ == "__main__":
    main()
