"""Scaling-law evidence in one GPU call: an IsoFLOP sweep on Gutenberg, a held-out run predicted
by the fit, WSD cooldown branches vs separate cosine runs, muP LR transfer and the coord check.

Parts, in order (each writes its files under --out as soon as it ends; a part that would overrun
--time-limit is skipped and says so):

0. checks: the parametric fit recovers a known law; muP at its base width equals the standard
   model on this device.
1. sweep: 4 budgets (3.75e12–3e13) × 5–6 depths of the depth family (d_model = 32·L, E = 32),
   centred on the first attempt's optima, through ``lmforge.scaling.run_sweep`` (the trainer,
   bf16, CUDA graphs); a power-of-two batch per point so every run has ≥ ~300 steps (warm-up a
   fixed 30), depths whose D exceeds 1.6 epochs dropped → sweep/results.jsonl (second attempt,
   benchmarks/archive/session-2026-12-01/scaling2.md; the first used one batch, 3 budgets × 5 depths, warm-up steps/10).
2. fits: Approach 3 (parametric, bootstrap) and Approach 2 (IsoFLOP parabola) on those runs →
   fit_*.json / fit_*.png.
3. held-out: the family member nearest the parametric fit's N_opt at 4× the largest budget among
   those ≤ 1.5 epochs, its loss predicted (printed) before it trains; error and epochs reported.
4. wsd: one stable run with 3 cooldown branches vs 3 separate cosine runs (same model, data,
   peak LR, warm-up and final LR), once with min_lr = lr/10 and once with min_lr = 0.
5. mup (only when --parts names it): loss vs LR for 4 widths under standard and muP (Gutenberg tokens), coord check PNGs.

Files in --out (6, within what a device call returns): summary.json (every part's records: sweep
results, fit reports, held-out, WSD, muP tables), fit_parametric.png, fit_isoflop-parabola.png,
coord_check.png, mup_lr_transfer.png, plus the caller's log; plans and the runs' folders go to
--work. Run (GPU, from the repo root with the data folder holding train.bin/val.bin from
``lmforge tokenizer encode``)::

    PYTHONPATH=src python benchmarks/scaling_sweep.py --data DATA --out OUT --time-limit 255

``--quick`` shrinks everything to a CPU smoke test of the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
import time
import traceback
from pathlib import Path

T0 = time.monotonic()


def _elapsed() -> float:
    return time.monotonic() - T0


def _log(msg: str) -> None:
    print(f"[{_elapsed():6.1f}s] {msg}", flush=True)


def _base(args: argparse.Namespace):
    from lmforge.config import RunConfig
    from lmforge.model.config import ModelConfig
    from lmforge.train.config import DataConfig, TrainConfig

    gpu = args.device.startswith("cuda")
    return RunConfig(
        model=ModelConfig(
            vocab_size=args.vocab,
            context_length=args.context,
            attention="sdpa" if gpu else "reference",
        ),
        train=TrainConfig(
            device=args.device,
            precision="bf16" if gpu else "fp32",
            batch_size=args.batch,
            lr=2e-3,
            min_lr=2e-4,
            warmup_steps=args.warmup,
            schedule="cosine",
            weight_decay=0.1,
            eval_every=0,
            eval_batches=args.eval_batches,
            save_every=0,
            keep_last=1,
            log_every=50,
            cuda_graph=gpu,
            progress=False,
            plot=False,
        ),
        data=DataConfig(
            train=(str(Path(args.data) / "train.bin"),), val=(str(Path(args.data) / "val.bin"),)
        ),
    )


def check_fits_and_mup(device: str) -> dict:
    """Part 0: the fit recovers a known law (float64); muP at base width == standard here."""
    import numpy as np
    import torch

    from lmforge.model import TransformerLM
    from lmforge.scaling.fit import ParametricLaw, fit_parametric
    from lmforge.scaling.mup import family_config

    law = ParametricLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
    n, d, loss = [], [], []
    for c in (1e17, 1e18, 1e19):
        n_opt, _ = law.optimal(c)
        for f in np.geomspace(0.2, 5, 5):
            n.append(n_opt * f)
            d.append(c / (6 * n_opt * f))
            loss.append(float(law.loss(n[-1], d[-1])))
    fit = fit_parametric(n, d, loss)
    rel = max(
        abs(getattr(fit.law, k) / getattr(law, k) - 1) for k in ("E", "A", "B", "alpha", "beta")
    )
    assert rel < 1e-3, f"parametric fit off by {rel}"
    cfg = family_config(128, True, 128)
    torch.manual_seed(0)
    a = TransformerLM(cfg, device=device)
    torch.manual_seed(0)
    b = TransformerLM(dataclasses.replace(cfg, mup=False), device=device)
    x = torch.randint(0, cfg.vocab_size, (2, 32), device=device)
    with torch.no_grad():
        diff = float((a(x) - b(x)).abs().max())
    assert diff == 0.0, f"muP at base width differs from standard by {diff}"
    _log(
        f"checks: parametric fit recovers a known law (max rel err {rel:.1e}); muP at base width == standard"
    )
    return {"fit_max_rel_err": rel, "mup_base_diff": diff}


def _n_of(base, depth: int) -> int:
    from lmforge.model import accounting
    from lmforge.scaling.plan import family_shape

    d, h = family_shape(depth, 32, 32)
    return accounting.matmul_parameters(
        dataclasses.replace(base.model, n_layers=depth, d_model=d, n_heads=h)
    )


def pick_batch(tokens: float, context: int, target_steps: int, batches: list[int]) -> int:
    """The largest batch (sequences) that still gives ``target_steps`` steps, else the smallest.

    Why per point: a batch fixed per budget gives the largest model ≥ 300 steps only by giving
    the smallest thousands (the first attempt's 58–2,365 steps); a power-of-two batch per point
    keeps every run within ~[target, 2·target] steps (the cap aside) at a bounded cost.
    """
    fits = [b for b in sorted(batches) if tokens / (b * context) >= target_steps]
    return fits[-1] if fits else min(batches)


def _with_batch(base, b: int, eval_windows: int):
    # Validation reads fixed sequential windows from the start of val.bin, so eval_windows / b
    # batches make every point, whatever its batch, score the very same eval_windows sequences.
    t = dataclasses.replace(base.train, batch_size=b, eval_batches=max(1, eval_windows // b))
    return dataclasses.replace(base, train=t)


def _grouped_points(args, base, budget: float, depths: list[int], max_epochs: float, train_tokens):
    """Plan (batch, point) pairs for ``budget``: per-point batch, repetition ≤ ``max_epochs``."""
    from lmforge.scaling.plan import plan_grid
    from lmforge.utils.errors import LmforgeError

    out = []
    for depth in depths:
        d = budget / (6 * _n_of(base, depth))
        if d > max_epochs * train_tokens:
            _log(f"  skip C{budget:.3g}_L{depth}: D={d:.3g} is over {max_epochs} epochs")
            continue
        b = pick_batch(d, args.context, args.target_steps, args.batches)
        bb = _with_batch(base, b, args.eval_windows)
        try:
            pts = plan_grid(
                bb, [budget], [depth], 32, 32, flops_rule="6nd", min_steps=args.min_steps
            )
        except LmforgeError:  # under min_steps even at the smallest batch
            _log(f"  skip C{budget:.3g}_L{depth}: under {args.min_steps} steps at batch {b}")
            continue
        out += [(b, p) for p in pts]
    return out


def _run_grouped(args, base, pairs, name: str) -> list[dict]:
    """One sweep folder per batch size (a plan has one base config); results in plan order."""
    from lmforge.scaling.sweep import plan_to_json, run_sweep

    by_id = {}
    for b in sorted({b for b, _ in pairs}):
        pts = [p for bb, p in pairs if bb == b]
        bb = _with_batch(base, b, args.eval_windows)
        plan = args.work / f"{name}_plan_b{b}.json"
        plan.write_text(plan_to_json(bb, pts, {"batch": b}))
        for r in run_sweep(plan, args.work / f"{name}_b{b}", progress=False):
            r["batch_size"] = b
            by_id[r["id"]] = r
    return [by_id[p.id] for _, p in pairs if p.id in by_id]


def _est_s(depth: int, steps: int) -> float:
    # Seconds per run from the first H200 attempt's log (benchmarks/archive/session-2026-12-01/scaling/log.txt): ~3 ms a step up
    # to L3, ~1.4 ms a layer beyond, plus ~0.7 s of graph capture and evaluation per run.
    return 0.7 + steps * max(3.0, 1.4 * depth) / 1000


def run_sweep_part(args, base, out: Path, train_tokens: int) -> list[dict]:
    pairs = []
    for budget, depths in zip(args.budgets, args.windows, strict=True):
        pairs += _grouped_points(args, base, budget, depths, args.sweep_epochs, train_tokens)
    est = sum(_est_s(p.n_layers, p.steps) for _, p in pairs)
    for b, p in pairs:
        _log(
            f"  plan {p.id}: N={p.parameters:,} D={p.tokens:,} D/N={p.tokens / p.parameters:.1f} "
            f"batch={b} steps={p.steps} epochs={p.tokens / train_tokens:.2f}"
        )
    _log(f"  {len(pairs)} runs, estimated {est:.0f}s on an H200")
    results = _run_grouped(args, base, pairs, "sweep")
    (args.work / "sweep").mkdir(parents=True, exist_ok=True)
    with open(args.work / "sweep" / "results.jsonl", "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    for r in results:
        _log(
            f"  {r['id']}: loss {r['loss']:.4f} in {r['elapsed_s']:.1f}s (batch {r['batch_size']})"
        )
    return results


def fit_part(out: Path, work: Path, budgets: list[float]) -> tuple:
    from lmforge.scaling.fit import fit_and_report
    from lmforge.scaling.plot import plot_fit
    from lmforge.scaling.runs import load_runs

    table = load_runs(work / "sweep" / "results.jsonl")
    reps = {}
    fits = {}
    for method, boot in (("parametric", 30), ("isoflop-parabola", 200)):
        try:
            fit, rep = fit_and_report(
                table.parameters,
                table.tokens,
                table.loss,
                table.budget,
                method,
                budgets,
                n_boot=boot,
            )
        except ValueError as e:  # e.g. a non-convex profile: say so, keep the other fit
            _log(f"  {method}: {e}")
            continue
        plot_fit(table, fit, out / f"fit_{method}.png", budgets)
        reps[method], fits[method] = rep, fit
        _log(f"  {method}: params {json.dumps(rep['params'])} objective {rep['objective']:.4g}")
    return table, fits, reps


def heldout_part(args, base, out: Path, fits: dict, train_tokens: int) -> dict:
    import numpy as np

    from lmforge.scaling.fit import ParametricLaw

    fit = fits["parametric"]
    c_h = args.heldout_factor * max(args.budgets)
    n_opt, _ = fit.law.optimal(c_h)
    # The family member nearest N_opt among those whose D keeps repetition ≤ --heldout-epochs
    # (the first attempt allowed 4 and its held-out run saw 2.5 epochs, the sweep ≤ 2.07).
    allowed = [
        L for L in range(1, 13) if c_h / (6 * _n_of(base, L)) <= args.heldout_epochs * train_tokens
    ]
    depth = min(allowed, key=lambda L: abs(math.log(_n_of(base, L) / n_opt)))
    ((bsz, point),) = _grouped_points(args, base, c_h, [depth], args.heldout_epochs, train_tokens)
    pred = float(fit.law.loss(point.parameters, point.tokens))
    boots = [
        float(ParametricLaw.from_theta(th).loss(point.parameters, point.tokens)) for th in fit.boot
    ]
    lo, hi = np.quantile(boots, [0.025, 0.975]).tolist() if boots else [math.nan, math.nan]
    _log(
        f"  held-out: C={c_h:.3g} ({args.heldout_factor}× the largest budget), fit N_opt={n_opt:.3g} → "
        f"depth {depth} N={point.parameters:,} D={point.tokens:,} batch {bsz} steps {point.steps}; "
        f"PREDICTED loss {pred:.4f} [{lo:.4f}, {hi:.4f}] (before training)"
    )
    (res,) = _run_grouped(args, base, [(bsz, point)], "heldout")
    rec = {
        "fit_n_opt": n_opt,
        "budget": c_h,
        "depth": depth,
        "parameters": point.parameters,
        "tokens": point.tokens,
        "epochs": point.tokens / train_tokens,
        "batch_size": bsz,
        "steps": point.steps,
        "predicted_loss": pred,
        "predicted_interval": [lo, hi],
        "actual_loss": res["loss"],
        "rel_error": res["loss"] / pred - 1.0,
        "elapsed_s": res["elapsed_s"],
    }
    if "isoflop-parabola" in fits:
        n2, d2, l2 = fits["isoflop-parabola"].predict(c_h)
        rec["isoflop_prediction"] = {"N_opt": n2, "D_opt": d2, "L_opt_powerlaw": l2}
    _log(
        f"  held-out: actual {res['loss']:.4f} vs predicted {pred:.4f} ({100 * rec['rel_error']:+.2f}%), "
        f"{rec['epochs']:.2f} epochs of the training tokens"
    )
    return rec


def wsd_part(args, base, out: Path) -> list[dict]:
    """Branches vs cosine with the same peak LR, warm-up and final LR, at two final LRs.

    Both schedules share lr, warmup_steps and min_lr; WSD decays linearly to min_lr over the last
    20% of each length (the trainer's WSD is linear; 1−sqrt is not implemented). Run once with
    min_lr = lr/10 (the sweep's cosine) and once with min_lr = 0 (Hägele et al.'s cooldown to 0).
    """
    from lmforge.scaling.branches import run_branches

    m = dataclasses.replace(base.model, n_layers=3, d_model=96, n_heads=3)
    recs = []
    for i, min_lr in enumerate(args.wsd_min_lrs):
        left = args.time_limit - _elapsed()
        if i and left < 0.18 * args.time_limit:  # a half-finished pair would be lost to the kill
            _log(f"  wsd min_lr {min_lr:g}: skipped ({left:.0f}s left)")
            continue
        t = dataclasses.replace(
            _with_batch(base, args.wsd_batch, args.eval_windows).train,
            warmup_steps=args.wsd_warmup,
            min_lr=min_lr,
        )
        cfg = dataclasses.replace(base, model=m, train=t)
        for r in run_branches(
            cfg,
            args.wsd_at,
            args.work / f"wsd_min{min_lr:g}",
            decay_fraction=0.2,
            compare_cosine=True,
        ):
            r["min_lr"], r["peak_lr"], r["warmup"] = min_lr, t.lr, t.warmup_steps
            _log(
                f"  wsd min_lr {min_lr:g}, {r['steps']} steps: branch {r['wsd_loss']:.4f} vs cosine "
                f"{r['cosine_loss']:.4f} ({100 * r['rel_diff']:+.2f}%)"
            )
            recs.append(r)
    return recs


def mup_part(args, out: Path) -> dict:
    import numpy as np
    import torch

    from lmforge.scaling.mup import best_lrs, coord_check, lr_sweep, plot_coord_check, plot_lr_sweep
    from lmforge.train.data import open_shard

    shard = open_shard(Path(args.data) / "train.bin")
    stream = torch.from_numpy(np.asarray(shard.tokens[:4_000_000]).astype(np.int64))
    cc = coord_check(args.mup_widths, steps=6, lr=1e-2, device=args.device)
    plot_coord_check(cc, out / "coord_check.png", 1e-2)
    torch.backends.cuda.matmul.allow_tf32 = True
    kw = dict(
        steps=args.mup_steps, device=args.device, stream=stream, batch=args.mup_batch, context=128
    )
    sp = lr_sweep(args.mup_widths, args.mup_lrs, False, **kw)
    _log(f"  standard best LRs {best_lrs(sp)}")
    mu = lr_sweep(args.mup_widths, args.mup_lrs, True, **kw)
    _log(f"  muP best LRs {best_lrs(mu)}")
    plot_lr_sweep(sp, mu, out / "mup_lr_transfer.png")
    rec = {
        "standard": sp,
        "mup": mu,
        "best_standard": best_lrs(sp),
        "best_mup": best_lrs(mu),
        "coord_check": cc,
    }
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", required=True, help="folder with train.bin and val.bin")
    ap.add_argument("--out", required=True)
    ap.add_argument("--time-limit", type=float, default=200.0, help="seconds for the whole script")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke test of the script")
    ap.add_argument(
        "--parts", default="checks,sweep,fit,heldout,wsd", help="parts to run (mup also exists)"
    )
    ap.add_argument(
        "--work",
        type=Path,
        help="folder for plans and the runs' checkpoints and metrics (default: a temporary folder)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.work is None:
        args.work = Path(tempfile.mkdtemp(prefix="scaling_sweep_"))
    args.work.mkdir(parents=True, exist_ok=True)
    import torch

    from lmforge.train.data import open_shard

    # Common to both: per-point batch (sequences) from these, each run ≥ target steps where the
    # smallest batch allows; a fixed warm-up; sweep points ≤ 1.6 epochs, the held-out run ≤ 1.5.
    args.batches, args.target_steps, args.sweep_epochs, args.heldout_epochs = (
        [4, 8, 16, 32, 64, 128],
        300,
        1.6,
        1.5,
    )
    if args.quick:
        args.device = "cpu"
        args.vocab, args.context, args.eval_batches, args.warmup = 1024, 32, 2, 3
        args.batch, args.batches, args.target_steps, args.eval_windows = 4, [2, 4, 8], 10, 8
        args.budgets, args.windows = [1e9, 2e9, 4e9, 8e9], [[1, 2, 3]] * 4
        args.heldout_factor, args.min_steps = 4, 5
        args.wsd_at, args.wsd_batch, args.wsd_warmup, args.wsd_min_lrs = [30, 60], 4, 5, [2e-4, 0.0]
        args.mup_widths, args.mup_lrs, args.mup_steps, args.mup_batch = (
            [32, 64],
            [3e-3, 1e-2],
            10,
            4,
        )
    else:
        # Budgets centred on the first attempt's optima (1e13 → L2, 3e13 → L2–L3, 1e14 → L4) and
        # low enough that the held-out run at 4× the largest (1.2e14, L4: D ≈ 20M) stays ≤ 1.5
        # epochs of the 18.7M training tokens; depths whose D exceeds 1.6 epochs are dropped.
        args.vocab, args.context, args.eval_batches, args.warmup = 1024, 256, 16, 30
        args.batch, args.eval_windows = 64, 1024  # 1024 × 256 val tokens, as the first attempt
        args.budgets = [3.75e12, 7.5e12, 1.5e13, 3e13]
        args.windows = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 7]]
        args.heldout_factor, args.min_steps = 4, 200
        args.wsd_at, args.wsd_batch, args.wsd_warmup = [1000, 2000, 4000], 16, 50
        args.wsd_min_lrs = [2e-4, 0.0]
        args.mup_widths = [64, 128, 256, 512]
        args.mup_lrs = [1e-3, 2.5e-3, 6e-3, 1.5e-2, 3.5e-2]
        args.mup_steps, args.mup_batch = 100, 16
    base = _base(args)
    train_tokens = len(open_shard(Path(args.data) / "train.bin").tokens)
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "train_tokens": train_tokens,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    _log(f"env {env}")
    summary: dict = {"env": env}
    # Rough share of the time limit each part needs before it is worth starting.
    needs = {"sweep": 0.0, "heldout": 0.08, "wsd": 0.2, "mup": 0.15}
    fits: dict = {}
    for part in args.parts.split(","):
        left = args.time_limit - _elapsed()
        if part in needs and left < needs[part] * args.time_limit:
            _log(f"{part}: skipped ({left:.0f}s left of {args.time_limit:.0f}s)")
            summary[part] = "skipped: time limit"
            continue
        _log(f"{part}: start")
        t = time.monotonic()
        try:
            if part == "checks":
                summary["checks"] = check_fits_and_mup(args.device)
            elif part == "sweep":
                summary["sweep"] = run_sweep_part(args, base, out, train_tokens)
            elif part == "fit":
                _, fits, reps = fit_part(out, args.work, [args.heldout_factor * max(args.budgets)])
                summary["fit"] = reps
            elif part == "heldout":
                summary["heldout"] = heldout_part(args, base, out, fits, train_tokens)
            elif part == "wsd":
                summary["wsd"] = wsd_part(args, base, out)
            elif part == "mup":
                summary["mup"] = mup_part(args, out)
        except Exception as e:  # one part failing must not lose the others' results
            traceback.print_exc()
            summary[part] = f"failed: {type(e).__name__}: {e}"
        _log(f"{part}: done in {time.monotonic() - t:.1f}s")
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))

    # The tables, last.
    print("\n== IsoFLOP sweep (final val loss) ==")
    if isinstance(summary.get("sweep"), list):
        print(f"{'id':>12} {'N':>10} {'D':>11} {'D/N':>7} {'batch':>5} {'loss':>7} {'s':>6}")
        for r in summary["sweep"]:
            print(
                f"{r['id']:>12} {r['parameters']:>10,} {r['tokens']:>11,} {r['tokens'] / r['parameters']:>7.1f} "
                f"{r['batch_size']:>5} {r['loss']:>7.4f} {r['elapsed_s']:>6.1f}"
            )
    h = summary.get("heldout")
    if isinstance(h, dict):
        print("\n== held-out run (predicted before training) ==")
        print(
            f"C={h['budget']:.3g} N={h['parameters']:,} D={h['tokens']:,} ({h['epochs']:.2f} epochs): predicted "
            f"{h['predicted_loss']:.4f} [{h['predicted_interval'][0]:.4f}, {h['predicted_interval'][1]:.4f}], "
            f"actual {h['actual_loss']:.4f}, error {100 * h['rel_error']:+.2f}%"
        )
    w = summary.get("wsd")
    if isinstance(w, list):
        print("\n== WSD cooldown branches vs separate cosine runs ==")
        print(
            f"{'min_lr':>7} {'steps':>6} {'tokens':>10} {'branch':>8} {'cosine':>8} {'branch/cos-1':>12}"
        )
        for r in w:
            print(
                f"{r['min_lr']:>7g} {r['steps']:>6} {r['tokens']:>10,} {r['wsd_loss']:>8.4f} {r['cosine_loss']:>8.4f} "
                f"{100 * r['rel_diff']:>11.2f}%"
            )
    m = summary.get("mup")
    if isinstance(m, dict):
        print("\n== muP LR transfer (train loss, last 10% of steps) ==")
        for name in ("standard", "mup"):
            print(f"{name}: best LR per width {m['best_' + name]}")
            for wdt, row in m[name].items():
                print(f"  d={wdt}: " + "  ".join(f"{lr:g}:{v:.3f}" for lr, v in row.items()))
    for part in args.parts.split(","):
        if isinstance(summary.get(part), str):
            print(f"{part}: {summary[part]}")
    _log("end")


if __name__ == "__main__":
    main()
