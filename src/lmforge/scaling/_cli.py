"""``lmforge scaling plan|run|fit|predict|branch|coord-check``: registered here; numpy, scipy and
torch are imported only when a command runs."""

from __future__ import annotations

import argparse

PLAN_EXAMPLES = """examples:
  lmforge scaling plan --config configs/scaling/cpu-tiny.toml --budgets 3e11,1e12,3e12 \\
      --depths 1,2,3,4,6 --out runs/sweep/plan.json
  lmforge scaling plan --config configs/scaling/cpu-tiny.toml --budgets 1e12 --depths 2,4 \\
      --flops exact --train.batch_size=16          # exact per-layer FLOPs instead of 6ND

The plan's runs read the token shards the config names (configs/scaling/cpu-tiny.toml:
runs/scaling/data/{train,val}.bin, a 512-token BPE). Make them once:
  lmforge tokenizer train --input examples/text/tinyshakespeare/input.txt --vocab-size 512 --out runs/scaling/tok
  lmforge tokenizer encode --tokenizer runs/scaling/tok --input examples/text/tinyshakespeare/input.txt --out runs/scaling/data/train.bin
  lmforge tokenizer encode --tokenizer runs/scaling/tok --input examples/text/wikitext2/test.txt --out runs/scaling/data/val.bin
"""

RUN_EXAMPLES = """examples:
  lmforge scaling run --plan runs/sweep/plan.json --out runs/sweep
  lmforge scaling run --plan runs/sweep/plan.json --out runs/sweep   # after a kill: continues
  lmforge scaling run --plan plan.json --out runs/sweep --device cuda --noise-scale-every 50
"""

FIT_EXAMPLES = """examples:
  lmforge scaling fit --runs runs/sweep/results.jsonl --method parametric --predict 1e13,1e14
  lmforge scaling fit --runs runs/sweep/results.jsonl --method isoflop-parabola \\
      --predict 1e13,1e14 --json runs/sweep/fit.json --plot runs/sweep/fit.png
  lmforge scaling fit --runs runs.csv --method isoflop-argmin --predict 1e23 --drop-worst 2
"""

PREDICT_EXAMPLES = """examples:
  lmforge scaling predict --fit fit.json --budgets 1e23,1e24
  lmforge scaling predict --fit fit.json --parameters 4e8 --tokens 8e9   # parametric fits only
"""

BRANCH_EXAMPLES = """examples:
  lmforge scaling branch --config configs/scaling/cpu-tiny.toml --at 200,400,800 --out runs/wsd
  lmforge scaling branch --config configs/scaling/cpu-tiny.toml --at 200,400 --decay-fraction 0.2 \\
      --compare-cosine --out runs/wsd          # also separate cosine runs of each length
"""

COORD_EXAMPLES = """examples:
  lmforge scaling coord-check --out coord.png                       # standard vs muP, CPU
  lmforge scaling coord-check --widths 64,128,256,512 --steps 8 --lr 1e-2 --out coord.png
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``scaling`` with its subcommands."""
    from lmforge.cli import add_config_arguments

    p = sub.add_parser(
        "scaling",
        help="scaling laws: plan and run sweeps, fit and predict, muP coord check",
        description=(
            "Scaling laws on lmforge's trainer: plan an IsoFLOP grid, run it resumably, fit "
            "Chinchilla's Approach 2 (IsoFLOP parabolas) and 3 (parametric L(N, D)) with bootstrap "
            "intervals, predict compute-optimal N, D and loss; WSD cooldown branches; muP coord "
            "check."
        ),
        epilog="examples:\n  lmforge scaling plan --help\n  lmforge scaling fit --help\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s = p.add_subparsers(dest="scaling_command", metavar="WHAT")
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])

    def add(name: str, help_: str, desc: str, epilog: str) -> argparse.ArgumentParser:
        return s.add_parser(
            name,
            help=help_,
            description=desc,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    pl = add(
        "plan",
        "list an IsoFLOP grid: budgets × a depth-derived model family → (N, D, steps)",
        "Budgets × depths (d_model = aspect · depth, heads = d_model / head-dim) on a base run "
        "config → one (N, D, steps, FLOPs) point each; N = N_matmul. --flops 6nd: D = C/(6N); "
        "exact: D = C / the per-layer FLOPs per token of lmforge.model.accounting.",
        PLAN_EXAMPLES,
    )
    add_config_arguments(pl, "base run TOML (model/train/data); the family sets depth and width")
    pl.add_argument("--budgets", required=True, help="comma-separated FLOP budgets, e.g. 1e12,3e12")
    pl.add_argument(
        "--depths", default="1,2,3,4,6", help="comma-separated depths (default %(default)s)"
    )
    pl.add_argument(
        "--aspect", type=int, default=32, help="d_model per layer (default %(default)s)"
    )
    pl.add_argument("--head-dim", type=int, default=16, help="head width E (default %(default)s)")
    pl.add_argument(
        "--flops", choices=("6nd", "exact"), default="6nd", help="FLOP rule (default %(default)s)"
    )
    pl.add_argument("--min-steps", type=int, default=10, help="drop points shorter than this")
    pl.add_argument("--out", help="write the plan (JSON) here for `lmforge scaling run`")
    pl.set_defaults(func=_plan)

    r = add(
        "run",
        "train every point of a plan (resumable), appending results to one JSONL",
        "Runs each point with lmforge's trainer into OUT/points/<id>/ and appends one line per "
        "finished point to OUT/results.jsonl (config, N, D, FLOPs, final and curve losses). Run it "
        "again after a kill: finished points are skipped, the interrupted one resumes from its "
        "checkpoint.",
        RUN_EXAMPLES,
    )
    r.add_argument("--plan", required=True, help="plan JSON from `lmforge scaling plan`")
    r.add_argument("--out", required=True, help="sweep folder")
    r.add_argument("--device", help="override train.device (cpu, cuda, auto)")
    r.add_argument("--only", default="", help="comma-separated point ids to run")
    r.add_argument(
        "--noise-scale-every",
        type=int,
        default=0,
        help="estimate and log the gradient noise scale B_simple every N steps",
    )
    r.add_argument("--no-progress", action="store_true", help="no sweep progress bar")
    r.set_defaults(func=_run)

    f = add(
        "fit",
        "fit Approach 2 or 3 to finished runs and predict compute-optimal N, D and loss",
        "parametric: L = E + A/N^α + B/D^β by Huber on log-loss residuals (log-sum-exp form), "
        "grid of starts + L-BFGS; isoflop-parabola / isoflop-argmin: per-budget minima, then "
        "N_opt ∝ C^a and D_opt ∝ C^b. Bootstrap 95% intervals; C = 6ND for the allocation unless "
        "--flops-per-param-token says otherwise.",
        FIT_EXAMPLES,
    )
    f.add_argument(
        "--runs",
        required=True,
        help="sweep JSONL, CSV (parameters,tokens,loss[,flops]) or IsoFLOP JSON",
    )
    f.add_argument(
        "--method",
        choices=("parametric", "isoflop-parabola", "isoflop-argmin"),
        default="parametric",
    )
    f.add_argument("--predict", default="", help="comma-separated budgets to predict at")
    f.add_argument("--json", help="write the fit and predictions here")
    f.add_argument("--plot", help="write a PNG: IsoFLOP curves, frontier, loss contour")
    f.add_argument("--drop-worst", type=int, default=0, help="drop the K highest-loss runs")
    f.add_argument("--huber-delta", type=float, default=1e-3, help="Huber δ (default %(default)s)")
    f.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples (0 = none)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--flops-per-param-token", type=float, default=6.0, help="k of C = k·N·D")
    f.set_defaults(func=_fit)

    pr = add(
        "predict",
        "predictions from a saved fit JSON",
        "Compute-optimal N, D, tokens per parameter and loss at budgets; for a parametric fit "
        "also the loss of a given (N, D).",
        PREDICT_EXAMPLES,
    )
    pr.add_argument("--fit", required=True, help="JSON from `lmforge scaling fit --json`")
    pr.add_argument("--budgets", default="", help="comma-separated budgets")
    pr.add_argument("--parameters", type=float, help="N for a loss prediction")
    pr.add_argument("--tokens", type=float, help="D for a loss prediction")
    pr.set_defaults(func=_predict)

    b = add(
        "branch",
        "WSD cooldown branches from one stable run (optionally vs separate cosine runs)",
        "One constant-LR run checkpoints at each branch point T − round(f·T); each branch resumes "
        "from it with WSD's linear decay to T steps: the loss at several token counts for "
        "max(s) + Σ d steps instead of Σ T. --compare-cosine adds separate cosine runs of each "
        "length. Results in OUT/branches.json.",
        BRANCH_EXAMPLES,
    )
    add_config_arguments(b, "run TOML (model/train/data); schedule and max_steps are set per run")
    b.add_argument("--at", required=True, help="comma-separated total steps of the branches")
    b.add_argument("--decay-fraction", type=float, default=0.2, help="decay share of each branch")
    b.add_argument("--compare-cosine", action="store_true", help="also train separate cosine runs")
    b.add_argument("--out", required=True, help="folder for the stable run, branches and results")
    b.set_defaults(func=_branch)

    cc = add(
        "coord-check",
        "muP coordinate check: activation scales across widths, standard vs muP (PNG)",
        "Trains each width of a fixed-depth, fixed-heads family for a few AdamW steps on a "
        "synthetic stream and plots the mean |x| of the embedding, each block and the logits "
        "against width per step. Flat in width = muP working; standard grows.",
        COORD_EXAMPLES,
    )
    cc.add_argument("--widths", default="32,64,128,256", help="comma-separated d_model values")
    cc.add_argument("--steps", type=int, default=5)
    cc.add_argument("--lr", type=float, default=1e-2)
    cc.add_argument("--device", default="cpu")
    cc.add_argument("--out", default="coord_check.png", help="PNG path")
    cc.set_defaults(func=_coord)

    lt = add(
        "lr-transfer",
        "muP learning-rate transfer: loss vs LR per width, standard vs muP (PNG + JSON)",
        "For each width and LR, trains the coord-check family (muP base = the smallest width) "
        "and reports the loss of the last 10% of steps; the best LR per width should stay put "
        "under muP and drift under standard. GPU-sized (use --device cuda).",
        "examples:\n  lmforge scaling lr-transfer --widths 64,128,256,512 --lrs 1e-3,3e-3,1e-2,3e-2 "
        "--steps 200 --device cuda --out lr.png\n",
    )
    lt.add_argument("--widths", default="32,64,128")
    lt.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2")
    lt.add_argument("--steps", type=int, default=100)
    lt.add_argument("--device", default="cpu")
    lt.add_argument("--out", default="lr_transfer.png", help="PNG path")
    lt.add_argument("--json", help="write the loss table here")
    lt.set_defaults(func=_lr_transfer)


def _numbers(text: str, what: str, kind: type = float) -> list:
    from lmforge.utils.errors import LmforgeError

    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise LmforgeError(f"{what} must be comma-separated {noun}, got {text!r}") from None


def _plan(args: argparse.Namespace) -> int:
    from lmforge.config import load_run_config
    from lmforge.scaling.plan import plan_grid
    from lmforge.scaling.sweep import plan_to_json
    from lmforge.utils.io import atomic_write_text

    base = load_run_config(args.config, args.overrides)
    points = plan_grid(
        base,
        _numbers(args.budgets, "--budgets"),
        _numbers(args.depths, "--depths", int),
        aspect=args.aspect,
        head_dim=args.head_dim,
        flops_rule=args.flops,
        min_steps=args.min_steps,
    )
    print(f"{'id':>14} {'L':>3} {'d':>5} {'N':>10} {'D':>11} {'D/N':>7} {'steps':>7} {'FLOPs':>9}")
    for pt in points:
        print(
            f"{pt.id:>14} {pt.n_layers:>3} {pt.d_model:>5} {pt.parameters:>10,} {pt.tokens:>11,} "
            f"{pt.tokens / pt.parameters:>7.1f} {pt.steps:>7} {pt.flops:>9.3g}"
        )
    total = sum(pt.flops for pt in points)
    print(f"{len(points)} points, {total:.3g} FLOPs in all ({args.flops})")
    if args.out:
        meta = {
            "budgets": args.budgets,
            "depths": args.depths,
            "aspect": args.aspect,
            "head_dim": args.head_dim,
            "flops_rule": args.flops,
        }
        atomic_write_text(args.out, plan_to_json(base, points, meta))
        print(f"plan written to {args.out}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from lmforge.scaling.sweep import run_sweep

    callbacks = None
    if args.noise_scale_every:
        from lmforge.scaling.noise import NoiseScaleCallback

        every = args.noise_scale_every

        def callbacks(point: object) -> list:
            return [NoiseScaleCallback(every=every)]

    only = [x for x in args.only.split(",") if x]
    results = run_sweep(
        args.plan,
        args.out,
        device=args.device,
        only=only,
        callbacks=callbacks,
        progress=not args.no_progress,
    )
    print(f"{len(results)} finished points in {args.out}/results.jsonl")
    return 0


def _fit(args: argparse.Namespace) -> int:
    import json

    from lmforge.scaling.fit import fit_and_report
    from lmforge.scaling.runs import load_runs
    from lmforge.utils.errors import LmforgeError
    from lmforge.utils.io import atomic_write_text

    table = load_runs(args.runs).drop_worst(args.drop_worst)
    budgets = _numbers(args.predict, "--predict")
    try:
        fit, rep = fit_and_report(
            table.parameters,
            table.tokens,
            table.loss,
            table.budget,
            args.method,
            budgets,
            delta=args.huber_delta,
            n_boot=args.bootstrap,
            seed=args.seed,
            k=args.flops_per_param_token,
        )
    except ValueError as e:
        raise LmforgeError(f"{args.runs}: {e}") from None
    rep["runs"] = {"file": str(args.runs), "count": len(table), "dropped_worst": args.drop_worst}
    _print_report(rep)
    if args.json:
        atomic_write_text(args.json, json.dumps(rep, indent=1))
    if args.plot:
        from lmforge.scaling.plot import plot_fit

        plot_fit(table, fit, args.plot, budgets)
    return 0


def _print_report(rep: dict) -> None:
    params = ", ".join(f"{k}={v:.4g}" for k, v in rep["params"].items())
    print(f"{rep['method']}: {params}; objective {rep['objective']:.6g}")
    if rep.get("starts_disagree"):
        sp = rep["start_spread"]
        print(
            f"warning: L-BFGS starts near the best objective disagree (N_opt spread "
            f"{100 * sp['n_opt']:.1f}%, loss spread {100 * sp['loss']:.2f}%): the coefficients are "
            "poorly identified; trust the predictions' intervals, not the coefficients"
        )
    for w in rep.get("warnings", []):
        print(f"warning: {w}")

    def ci(iv: dict, key: str) -> str:
        return f" [{iv[key][0]:.3g}, {iv[key][1]:.3g}]" if key in iv else ""

    if rep.get("minima_outside"):
        budgets = ", ".join(f"{c:.3g}" for c in rep["minima_outside"])
        print(
            f"warning: the minimum of budget(s) {budgets} lies outside (or at the edge of) their "
            "sizes: the profile does not bracket its optimum; add sizes on that side"
        )
    for c, rec in rep["optimal"].items():
        iv = rec.get("intervals", {})

        print(
            f"C={c}: N_opt={rec['N']:.4g}{ci(iv, 'N')}  D_opt={rec['D']:.4g}{ci(iv, 'D')}  "
            f"D/N={rec['tokens_per_param']:.3g}{ci(iv, 'tokens_per_param')}  "
            f"loss={rec['loss']:.4f}{ci(iv, 'loss')}"
        )


def _predict(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from lmforge.utils.errors import LmforgeError

    p = Path(args.fit)
    try:
        rep = json.loads(p.read_text(encoding="utf-8"))
        method, params = rep["method"], rep["params"]
    except FileNotFoundError:
        raise LmforgeError(f"fit file not found: {p}") from None
    except (json.JSONDecodeError, KeyError, TypeError):
        raise LmforgeError(f"{p}: not a fit JSON from `lmforge scaling fit --json`") from None
    budgets = _numbers(args.budgets, "--budgets")
    if method == "parametric":
        from lmforge.scaling.fit import ParametricLaw

        law = ParametricLaw(**{k: float(params[k]) for k in ("E", "A", "B", "alpha", "beta")})
        k = float(rep.get("flops_per_param_token", 6.0))
        for c in budgets:
            n, d = law.optimal(c, k)
            print(
                f"C={c:.3g}: N_opt={n:.4g} D_opt={d:.4g} D/N={d / n:.3g} loss={float(law.loss(n, d)):.4f}"
            )
        if args.parameters or args.tokens:
            if not (args.parameters and args.tokens):
                raise LmforgeError("--parameters and --tokens go together")
            print(
                f"L(N={args.parameters:.4g}, D={args.tokens:.4g}) = "
                f"{float(law.loss(args.parameters, args.tokens)):.4f}"
            )
    else:
        if args.parameters or args.tokens:
            raise LmforgeError(
                f"{p}: a loss at (N, D) needs a parametric fit, this one is {method}"
            )
        for c in budgets:
            n, d = params["k_N"] * c ** params["a"], params["k_D"] * c ** params["b"]
            loss = params["k_L"] * c ** params["gamma"]
            print(f"C={c:.3g}: N_opt={n:.4g} D_opt={d:.4g} D/N={d / n:.3g} loss={loss:.4f}")
    return 0


def _branch(args: argparse.Namespace) -> int:
    from lmforge.config import load_run_config
    from lmforge.scaling.branches import run_branches

    base = load_run_config(args.config, args.overrides)
    recs = run_branches(
        base, _numbers(args.at, "--at", int), args.out, args.decay_fraction, args.compare_cosine
    )
    print(f"{'steps':>7} {'tokens':>11} {'from':>6} {'wsd loss':>9} {'cosine':>9} {'wsd/cos-1':>9}")
    for r in recs:
        cos = f"{r['cosine_loss']:>9.4f} {100 * r['rel_diff']:>8.2f}%" if "cosine_loss" in r else ""
        print(
            f"{r['steps']:>7} {r['tokens']:>11,} {r['branch_from']:>6} {r['wsd_loss']:>9.4f} {cos}"
        )
    return 0


def _coord(args: argparse.Namespace) -> int:
    from lmforge.scaling.mup import coord_check, plot_coord_check

    widths = _numbers(args.widths, "--widths", int)
    res = coord_check(widths, steps=args.steps, lr=args.lr, device=args.device)
    for name in res:
        for site, by_w in res[name].items():
            vals = "  ".join(f"d={w}: {v[-1]:.3g}" for w, v in sorted(by_w.items()))
            print(f"{name:>8} {site:>9} (step {args.steps - 1}): {vals}")
    plot_coord_check(res, args.out, args.lr)
    print(f"coord check written to {args.out}")
    return 0


def _lr_transfer(args: argparse.Namespace) -> int:
    import json

    from lmforge.scaling.mup import best_lrs, lr_sweep, plot_lr_sweep
    from lmforge.utils.io import atomic_write_text

    widths, lrs = _numbers(args.widths, "--widths", int), _numbers(args.lrs, "--lrs")
    sp = lr_sweep(widths, lrs, False, steps=args.steps, device=args.device)
    mu = lr_sweep(widths, lrs, True, steps=args.steps, device=args.device)
    print(f"best LR per width  standard: {best_lrs(sp)}  muP: {best_lrs(mu)}")
    plot_lr_sweep(sp, mu, args.out)
    if args.json:
        atomic_write_text(args.json, json.dumps({"standard": sp, "mup": mu}, indent=1))
    return 0
