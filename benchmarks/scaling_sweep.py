"""Scaling-law evidence in one GPU call: an IsoFLOP sweep on Gutenberg, a held-out run predicted
by the fit, WSD cooldown branches vs separate cosine runs, muP LR transfer and the coord check.

Parts, in order (each writes its files under --out as soon as it ends; a part that would overrun
--time-limit is skipped and says so):

0. checks: the parametric fit recovers a known law; muP at its base width equals the standard
   model on this device.
1. sweep: 3 budgets × 5 depths of the depth family (d_model = 32·L, E = 32) through
   ``lmforge.scaling.run_sweep`` (the trainer, bf16, CUDA graphs) → sweep/results.jsonl.
2. fits: Approach 3 (parametric, bootstrap) and Approach 2 (IsoFLOP parabola) on the 15 runs →
   fit_*.json / fit_*.png.
3. held-out: the family member nearest the parametric fit's N_opt at 5× the largest budget, its
   loss predicted before it trains; prediction error and data epochs reported.
4. wsd: one stable run with 3 cooldown branches vs 3 separate cosine runs (same model, data).
5. mup: loss vs LR for 4 widths under standard and muP (Gutenberg tokens), coord check PNGs.

Files in --out (6, within what a device call returns): summary.json (every part's records: sweep
results, fit reports, held-out, WSD, muP tables), fit_parametric.png, fit_isoflop-parabola.png,
coord_check.png, mup_lr_transfer.png, plus the caller's log; plans and the runs' folders go to
--work. Run (GPU, from the repo root with the data folder holding train.bin/val.bin from
``lmforge tokenizer encode``)::

    PYTHONPATH=src python benchmarks/scaling_sweep.py --data DATA --out OUT --time-limit 200

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
            warmup_steps=100,
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


def run_sweep_part(args, base, out: Path) -> list[dict]:
    from lmforge.scaling.plan import plan_grid
    from lmforge.scaling.sweep import plan_to_json, run_sweep

    points = []
    for budget, depths in zip(args.budgets, args.windows, strict=True):
        points += plan_grid(
            base,
            [budget],
            depths,
            aspect=32,
            head_dim=32,
            flops_rule="6nd",
            min_steps=args.min_steps,
        )
    plan = args.work / "sweep_plan.json"
    plan.write_text(plan_to_json(base, points, {"budgets": args.budgets}))
    for p in points:
        _log(
            f"  plan {p.id}: N={p.parameters:,} D={p.tokens:,} D/N={p.tokens / p.parameters:.1f} steps={p.steps}"
        )
    results = run_sweep(plan, args.work / "sweep", progress=False)
    for r in results:
        _log(f"  {r['id']}: loss {r['loss']:.4f} in {r['elapsed_s']:.1f}s")
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

    from lmforge.model import accounting
    from lmforge.scaling.fit import ParametricLaw
    from lmforge.scaling.plan import family_shape, plan_grid
    from lmforge.scaling.sweep import plan_to_json, run_sweep

    fit = fits["parametric"]
    c_h = args.heldout_factor * max(args.budgets)
    n_opt, _ = fit.law.optimal(c_h)

    def n_of(depth: int) -> int:
        d, h = family_shape(depth, 32, 32)
        m = dataclasses.replace(base.model, n_layers=depth, d_model=d, n_heads=h)
        return accounting.matmul_parameters(m)

    # The family member nearest N_opt among those whose D keeps data repetition ≤ 4 epochs
    # (beyond that repeated tokens are worth less, Muennighoff et al. 2023).
    allowed = [L for L in range(1, 13) if c_h / (6 * n_of(L)) <= 4 * train_tokens]
    depth = min(allowed, key=lambda L: abs(math.log(n_of(L) / n_opt)))
    (point,) = plan_grid(base, [c_h], [depth], aspect=32, head_dim=32, flops_rule="6nd")
    pred = float(fit.law.loss(point.parameters, point.tokens))
    boots = [
        float(ParametricLaw.from_theta(th).loss(point.parameters, point.tokens)) for th in fit.boot
    ]
    lo, hi = np.quantile(boots, [0.025, 0.975]).tolist() if boots else [math.nan, math.nan]
    _log(
        f"  held-out: C={c_h:.3g} ({args.heldout_factor}× the largest budget), fit N_opt={n_opt:.3g} → "
        f"depth {depth} N={point.parameters:,} D={point.tokens:,}; predicted loss {pred:.4f} [{lo:.4f}, {hi:.4f}]"
    )
    plan = args.work / "heldout_plan.json"
    plan.write_text(plan_to_json(base, [point], {"heldout_of": args.budgets}))
    (res,) = run_sweep(plan, args.work / "heldout", progress=False)
    rec = {
        "fit_n_opt": n_opt,
        "budget": c_h,
        "depth": depth,
        "parameters": point.parameters,
        "tokens": point.tokens,
        "epochs": point.tokens / train_tokens,
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
    from lmforge.scaling.branches import run_branches

    m = dataclasses.replace(base.model, n_layers=3, d_model=96, n_heads=3)
    t = dataclasses.replace(base.train, batch_size=args.wsd_batch, warmup_steps=args.wsd_warmup)
    cfg = dataclasses.replace(base, model=m, train=t)
    recs = run_branches(
        cfg, args.wsd_at, args.work / "wsd", decay_fraction=0.2, compare_cosine=True
    )
    for r in recs:
        _log(
            f"  wsd {r['steps']} steps: branch {r['wsd_loss']:.4f} vs cosine {r['cosine_loss']:.4f} "
            f"({100 * r['rel_diff']:+.2f}%)"
        )
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
    ap.add_argument("--parts", default="checks,sweep,fit,heldout,wsd,mup", help="parts to run")
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

    if args.quick:
        args.device = "cpu"
        args.vocab, args.context, args.batch, args.eval_batches = 1024, 32, 4, 2
        args.budgets, args.windows = [1e9, 2e9, 4e9], [[1, 2, 3], [1, 2, 3], [1, 2, 3]]
        args.heldout_factor, args.min_steps = 3, 5
        args.wsd_at, args.wsd_batch, args.wsd_warmup = [30, 60], 4, 5
        args.mup_widths, args.mup_lrs, args.mup_steps, args.mup_batch = (
            [32, 64],
            [3e-3, 1e-2],
            10,
            4,
        )
    else:
        args.vocab, args.context, args.batch, args.eval_batches = 1024, 256, 64, 16
        args.budgets = [1e13, 3e13, 1e14]
        args.windows = [[1, 2, 3, 4, 5], [2, 3, 4, 5, 6], [3, 4, 5, 6, 7]]
        args.heldout_factor, args.min_steps = 5, 20
        args.wsd_at, args.wsd_batch, args.wsd_warmup = [600, 1200, 1800], 32, 50
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
    needs = {"sweep": 0.0, "heldout": 0.15, "wsd": 0.12, "mup": 0.15}
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
                summary["sweep"] = run_sweep_part(args, base, out)
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
        print(f"{'id':>12} {'N':>10} {'D':>11} {'D/N':>7} {'loss':>7} {'s':>6}")
        for r in summary["sweep"]:
            print(
                f"{r['id']:>12} {r['parameters']:>10,} {r['tokens']:>11,} {r['tokens'] / r['parameters']:>7.1f} "
                f"{r['loss']:>7.4f} {r['elapsed_s']:>6.1f}"
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
        print(f"{'steps':>6} {'tokens':>10} {'branch':>8} {'cosine':>8} {'branch/cos-1':>12}")
        for r in w:
            print(
                f"{r['steps']:>6} {r['tokens']:>10,} {r['wsd_loss']:>8.4f} {r['cosine_loss']:>8.4f} "
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
