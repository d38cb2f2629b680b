"""PNG figures of a fit: IsoFLOP curves with their minima, the frontier with intervals, a loss contour.

matplotlib is imported inside the function (Agg backend), so importing this module costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.scaling.fit import IsoflopFit, ParametricFit, ParametricLaw
from lmforge.scaling.runs import RunTable


def _pyplot() -> Any:
    # matplotlib's pyplot on the Agg backend, imported on first use
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_png(fig: Any, path: str | Path, dpi: int = 110) -> None:
    # tight layout, the PNG written atomically, the figure closed
    from lmforge.utils.io import atomic_write

    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    _pyplot().close(fig)


def plot_fit(
    table: RunTable,
    fit: IsoflopFit | ParametricFit,
    path: str | Path,
    budgets: Sequence[float] = (),
) -> None:
    """Three panels: loss vs N per budget (fitted curves and minima), N_opt vs C (the runs'
    optima, the fitted law, its 95% bootstrap band, the predicted budgets), L(N, D) contours
    with the runs and the compute-optimal frontier (contours only for a parametric fit)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ax1, ax2, ax3 = axes
    ubud = np.unique(table.budget)
    colors = plt.cm.viridis(np.linspace(0, 0.9, ubud.size))
    is_param = isinstance(fit, ParametricFit)
    for c, col in zip(ubud, colors, strict=True):
        sel = table.budget == c
        n = table.parameters[sel]
        ax1.scatter(n, table.loss[sel], color=col, s=14, label=f"C={c:.2g}")
        xs = np.geomspace(n.min(), n.max(), 100)
        if is_param:
            ys = fit.law.loss(xs, c / (fit.k * xs))
            no, do = fit.law.optimal(c, fit.k)
            ax1.plot(xs, ys, color=col, lw=1)
            ax1.scatter([no], [fit.law.loss(no, do)], color=col, marker="*", s=90, edgecolor="k")
    if not is_param:
        for m, col in zip(fit.minima, colors, strict=True):
            if m.coef is not None:
                sel = table.budget == m.budget
                n = table.parameters[sel]
                xs = np.geomspace(n.min(), n.max(), 100)
                c0, c1, c2 = m.coef
                lx = np.log(xs)
                ax1.plot(xs, c0 + c1 * lx + c2 * lx * lx, color=col, lw=1)
            ax1.scatter([m.n_opt], [m.loss], color=col, marker="*", s=90, edgecolor="k")
    ax1.set_xscale("log")
    ax1.set_xlabel("parameters N")
    ax1.set_ylabel("loss")
    ax1.set_title("IsoFLOP profiles (★ = fitted minimum)")
    ax1.legend(fontsize=7)

    # The frontier: N_opt against C, from the smallest budget to the largest prediction.
    lo_c = float(ubud.min())
    hi_c = max([float(ubud.max()), *budgets])
    cs = np.geomspace(lo_c, hi_c, 60)
    if is_param:
        n_fit = np.array([fit.law.optimal(c, fit.k)[0] for c in cs])
        boot = [ParametricLaw.from_theta(th) for th in fit.boot]
        band = np.array([[law.optimal(c, fit.k)[0] for c in cs] for law in boot]) if boot else None
        pts = [(c, fit.law.optimal(c, fit.k)[0]) for c in ubud]
    else:
        n_fit = fit.k_n * cs**fit.a
        bs = np.asarray(fit.boot)
        band = bs[:, :1] * cs[None, :] ** bs[:, 1:2] if bs.size else None
        pts = [(m.budget, m.n_opt) for m in fit.minima]
    ax2.plot(cs, n_fit, "k-", lw=1.2, label="fit")
    if band is not None and len(band):
        ax2.fill_between(
            cs,
            *np.quantile(band, [0.025, 0.975], axis=0),
            color="C0",
            alpha=0.25,
            label="95% bootstrap",
        )
    ax2.scatter(*zip(*pts, strict=True), color="C3", zorder=3, label="per-budget optimum")
    for c in budgets:
        ax2.axvline(c, color="gray", ls=":", lw=0.8)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("compute C (FLOPs)")
    ax2.set_ylabel("N_opt")
    ax2.set_title("compute-optimal frontier")
    ax2.legend(fontsize=7)

    ln = np.log(table.parameters)
    ld = np.log(table.tokens)
    if is_param:
        gn = np.geomspace(math.exp(ln.min() - 0.5), math.exp(ln.max() + 0.5), 80)
        gd = np.geomspace(math.exp(ld.min() - 0.5), math.exp(ld.max() + 0.5), 80)
        nn, dd = np.meshgrid(gn, gd)
        cont = ax3.contourf(nn, dd, fit.law.loss(nn, dd), levels=20, cmap="magma")
        fig.colorbar(cont, ax=ax3, label="L(N, D)")
        fr = np.array(
            [fit.law.optimal(c, fit.k) for c in np.geomspace(lo_c, float(ubud.max()), 30)]
        )
        ax3.plot(fr[:, 0], fr[:, 1], "c-", lw=1.5, label="compute-optimal")
        ax3.set_title("loss contour of the fitted L(N, D)")
    else:
        ax3.set_title("runs (loss as colour)")
    sc = ax3.scatter(
        table.parameters, table.tokens, c=table.loss, cmap="magma", edgecolor="w", s=22
    )
    if not is_param:
        fig.colorbar(sc, ax=ax3, label="loss")
    ax3.set_xscale("log")
    ax3.set_yscale("log")
    ax3.set_xlabel("parameters N")
    ax3.set_ylabel("tokens D")
    _save_png(fig, path)
