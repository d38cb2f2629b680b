"""Scaling-law fits as pure float64 functions: Chinchilla's Approaches 2 and 3, with bootstraps.

Approach 2 (IsoFLOP profiles): per compute budget C, fit the loss as a parabola in log N and take
its minimum (or, the ``argmin`` variant, the best run of the budget); then fit the power laws
N_opt = k_N·C^a and D_opt = k_D·C^b in log-log space. Approach 3 (parametric): fit
L(N, D) = E + A/N^α + B/D^β by minimising the Huber loss of the log-loss residuals written in
log-sum-exp form, ``LSE(a − α·log N, b − β·log D, e) − log L`` with A = e^a, B = e^b, E = e^e,
from a grid of initialisations, each refined by L-BFGS at tight tolerances (Hoffmann et al. 2022,
appendix D.2). Both report bootstrap percentile intervals. The parametric coefficients are poorly
identified (B and β trade off), so what is reported and compared are predictions at a budget —
loss, N_opt, D_opt, tokens per parameter — not the raw coefficients alone.

Compute-optimal allocation uses C = k·N·D with k = 6 unless told otherwise. Exercised by
``pytest tests/test_scaling_fit.py``; ``lmforge scaling fit --help`` is the command.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

IsoflopMethod = Literal["parabola", "argmin"]

_CHINCHILLA_GRID = {
    # Hoffmann et al.'s initialisation grid (appendix D.2): e, a, b are log E, log A, log B.
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5),
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
}


# ---------------------------------------------------------------------------------------------
# Approach 3: the parametric loss L(N, D) = E + A/N^α + B/D^β


@dataclasses.dataclass(frozen=True)
class ParametricLaw:
    """Coefficients of L(N, D) = E + A/N^α + B/D^β."""

    E: float
    "irreducible loss"
    A: float
    "parameter-term coefficient"
    B: float
    "data-term coefficient"
    alpha: float
    "parameter exponent α"
    beta: float
    "data exponent β"

    @classmethod
    def from_theta(cls, theta: Sequence[float]) -> ParametricLaw:
        """From the optimiser's vector (a, b, e, α, β) = (log A, log B, log E, α, β)."""
        a, b, e, alpha, beta = (float(x) for x in theta)
        return cls(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta)

    def loss(self, n: Any, d: Any) -> Any:
        """L(N, D) (scalars or arrays)."""
        n, d = np.asarray(n, dtype=np.float64), np.asarray(d, dtype=np.float64)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def optimal(self, c: float, k: float = 6.0) -> tuple[float, float]:
        """(N_opt, D_opt) minimising L under C = k·N·D (closed form, Hoffmann eq. 4).

        NaN when a term vanishes (α or β at 0, or A or B underflowed): then no finite optimum.
        """
        if min(self.alpha, self.beta) <= 0 or min(self.A, self.B) <= 0:
            return math.nan, math.nan
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        s = c / k
        n = g * s ** (self.beta / (self.alpha + self.beta))
        return n, s / n


def huber(r: np.ndarray, delta: float) -> np.ndarray:
    """Huber loss per element: r²/2 inside ±δ, δ(|r| − δ/2) outside."""
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def parametric_objective(
    theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float
) -> tuple[float, np.ndarray]:
    """Sum of Huber(LSE(a − α·log N, b − β·log D, e) − log L) and its gradient in θ.

    θ = (a, b, e, α, β). The log-sum-exp form keeps the residuals in log space without ever
    forming E + A/N^α + B/D^β from exponentials that over- or underflow at odd starts.
    """
    a, b, e, alpha, beta = theta
    t = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])  # (3, R)
    m = t.max(axis=0)
    w = np.exp(t - m)
    s = w.sum(axis=0)
    lse = m + np.log(s)
    w /= s  # softmax weights: ∂LSE/∂t
    r = lse - log_l
    g_r = np.clip(r, -delta, delta)  # Huber'(r)
    grad = np.array(
        [
            np.sum(g_r * w[0]),
            np.sum(g_r * w[1]),
            np.sum(g_r * w[2]),
            -np.sum(g_r * w[0] * log_n),
            -np.sum(g_r * w[1] * log_d),
        ]
    )
    return float(np.sum(huber(r, delta))), grad


def _grid_starts(
    log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float, top: int
) -> np.ndarray:
    # Evaluate the objective on the whole grid at once, keep the best ``top`` as L-BFGS starts
    # (Hoffmann refine every grid point; the best few reach the same optima far faster).
    g = _CHINCHILLA_GRID
    grid = np.array(
        list(itertools.product(g["a"], g["b"], g["e"], g["alpha"], g["beta"]))
    )  # (S, 5)
    t1 = grid[:, 0:1] - grid[:, 3:4] * log_n[None, :]  # (S, R)
    t2 = grid[:, 1:2] - grid[:, 4:5] * log_d[None, :]
    t3 = np.broadcast_to(grid[:, 2:3], t1.shape)
    lse = np.logaddexp(np.logaddexp(t1, t2), t3)
    obj = huber(lse - log_l[None, :], delta).sum(axis=1)
    order = np.argsort(obj, kind="stable")
    return grid[order[:top]]


def _lbfgs(
    theta0: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float
) -> tuple[np.ndarray, float]:
    from scipy.optimize import minimize

    res = minimize(
        parametric_objective,
        theta0,
        args=(log_n, log_d, log_l, delta),
        jac=True,
        method="L-BFGS-B",
        # α, β kept non-negative (a negative exponent is no scaling law); tight tolerances so
        # the optimum of the stated objective is reached, not the optimiser's default stop.
        bounds=[(None, None), (None, None), (None, None), (0.0, 10.0), (0.0, 10.0)],
        options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 5000, "maxcor": 30},
    )
    return np.asarray(res.x, dtype=np.float64), float(res.fun)


@dataclasses.dataclass(frozen=True)
class ParametricFit:
    """Result of :func:`fit_parametric`."""

    law: ParametricLaw
    "the best fit"
    objective: float
    "sum of Huber losses at the optimum"
    theta: tuple[float, ...]
    "(log A, log B, log E, α, β) at the optimum"
    starts: int
    "L-BFGS starts run"
    starts_disagree: bool
    "starts within 0.1% of the best objective predict differently (> 5% in N_opt or > 0.5% in loss)"
    start_spread: dict[str, float]
    "among near-best starts: max relative spread of N_opt and of the loss at the reference budget"
    boot: tuple[tuple[float, ...], ...] = ()
    "bootstrap θ samples"
    k: float = 6.0
    "C = k·N·D for compute-optimal allocation"
    min_loss: float = 1.0
    "the smallest loss fitted (the scale a vanished E is judged against)"


def fit_parametric(
    n: Sequence[float],
    d: Sequence[float],
    loss: Sequence[float],
    delta: float = 1e-3,
    top_starts: int = 24,
    n_boot: int = 0,
    seed: int = 0,
    k: float = 6.0,
    reference_budget: float | None = None,
) -> ParametricFit:
    """Fit L = E + A/N^α + B/D^β (Approach 3) to runs; optionally bootstrap it.

    ``delta`` is the Huber δ (Hoffmann: 1e-3). The grid's best ``top_starts`` points start
    L-BFGS; the starts that end within 0.1% of the best objective are compared at
    ``reference_budget`` (default: 100× the largest run's 6ND) and ``starts_disagree`` is set
    when they predict different N_opt or loss. ``n_boot`` resamples the runs with replacement and
    refits from the full fit's optimum and the resample's best 2 grid points.
    """
    log_n, log_d, log_l = _logs(n, d, loss)
    if log_n.size < 5:
        raise ValueError(f"a parametric fit needs at least 5 runs, got {log_n.size}")
    results = [
        _lbfgs(s, log_n, log_d, log_l, delta)
        for s in _grid_starts(log_n, log_d, log_l, delta, top_starts)
    ]
    best_theta, best_obj = min(results, key=lambda r: r[1])
    ref = reference_budget or 100.0 * k * float(np.max(np.exp(log_n + log_d)))
    near = [th for th, f in results if f <= best_obj * (1 + 1e-3) + 1e-15]
    n_opts, losses = [], []
    for th in near:
        law = ParametricLaw.from_theta(th)
        no, do = law.optimal(ref, k)
        n_opts.append(no)
        losses.append(float(law.loss(no, do)) if math.isfinite(no) else math.nan)
    spread = {
        "n_opt": float(np.max(n_opts) / np.min(n_opts) - 1.0),
        "loss": float(np.max(losses) / np.min(losses) - 1.0),
        "reference_budget": ref,
        "near_best_starts": float(len(near)),
    }
    # NaN spreads (a near-best start without a finite optimum) count as disagreement.
    disagree = not (spread["n_opt"] <= 0.05 and spread["loss"] <= 0.005)
    boot: list[tuple[float, ...]] = []
    if n_boot:
        rng = np.random.default_rng(seed)
        size = log_n.size
        for _ in range(n_boot):
            idx = rng.integers(0, size, size)
            bn, bd, bl = log_n[idx], log_d[idx], log_l[idx]
            starts = [best_theta, *_grid_starts(bn, bd, bl, delta, 2)]
            th, _ = min((_lbfgs(s, bn, bd, bl, delta) for s in starts), key=lambda r: r[1])
            boot.append(tuple(float(x) for x in th))
    return ParametricFit(
        law=ParametricLaw.from_theta(best_theta),
        objective=best_obj,
        theta=tuple(float(x) for x in best_theta),
        starts=len(results),
        starts_disagree=disagree,
        start_spread=spread,
        boot=tuple(boot),
        k=k,
        min_loss=float(np.exp(np.min(log_l))),
    )


# ---------------------------------------------------------------------------------------------
# Approach 2: IsoFLOP profiles


@dataclasses.dataclass(frozen=True)
class IsoflopMinimum:
    """The compute-optimal point of one budget's IsoFLOP profile."""

    budget: float
    "compute budget C (FLOPs)"
    n_opt: float
    "parameters at the profile's minimum"
    d_opt: float
    "tokens at the profile's minimum"
    loss: float
    "loss at the minimum (the parabola's value, or the best run's loss)"
    coef: tuple[float, float, float] | None
    "parabola L = c0 + c1·x + c2·x² in x = ln N (None for argmin)"
    inside: bool = True
    "the minimum lies within the budget's sizes (False: an extrapolated vertex, or an edge run)"


def group_budgets(flops: Sequence[float], tol: float = 0.05) -> np.ndarray:
    """Budget label per run: runs whose C lie within ``tol`` (relative) of a group's first share it.

    Returns each run's budget as the geometric mean of its group's C values.
    """
    c = np.asarray(flops, dtype=np.float64)
    order = np.argsort(c, kind="stable")
    labels = np.empty(c.size, dtype=np.int64)
    group, start = -1, -math.inf
    for i in order:
        if c[i] > start * (1 + tol):
            group, start = group + 1, c[i]
        labels[i] = group
    out = np.empty(c.size)
    for gidx in range(group + 1):
        sel = labels == gidx
        out[sel] = math.exp(float(np.mean(np.log(c[sel]))))
    return out


def isoflop_minimum(
    budget: float, n: np.ndarray, d: np.ndarray, loss: np.ndarray, method: IsoflopMethod
) -> IsoflopMinimum:
    """One budget's optimum: the parabola-in-ln N vertex, or the best run (``argmin``).

    D at the optimum comes from a least-squares line of ln D against ln N within the budget (with
    C = 6ND exactly this is C/(6·N_opt); with exact FLOP counts it follows the runs' own D).
    """
    x, y = np.log(n), np.log(d)
    if method == "argmin":
        i = int(np.argmin(loss))
        edge = x[i] in (x.min(), x.max())
        return IsoflopMinimum(budget, float(n[i]), float(d[i]), float(loss[i]), None, not edge)
    if np.unique(x).size < 3:
        raise ValueError(f"budget {budget:.3g}: a parabola needs runs of at least 3 sizes")
    c2, c1, c0 = np.polyfit(x, loss, 2)
    if c2 <= 0:
        raise ValueError(
            f"budget {budget:.3g}: the IsoFLOP profile is not convex (no minimum); add sizes "
            "on both sides of the optimum or use --method isoflop-argmin"
        )
    x_opt = -c1 / (2 * c2)
    slope, icpt = np.polyfit(x, y, 1)
    return IsoflopMinimum(
        budget=budget,
        n_opt=math.exp(x_opt),
        d_opt=math.exp(icpt + slope * x_opt),
        loss=float(c0 + c1 * x_opt + c2 * x_opt**2),
        coef=(float(c0), float(c1), float(c2)),
        inside=bool(x.min() <= x_opt <= x.max()),
    )


def power_law(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least squares in log-log space: (k, p) of y = k·x^p."""
    lx, ly = np.log(np.asarray(x, np.float64)), np.log(np.asarray(y, np.float64))
    p, lk = np.polyfit(lx, ly, 1)
    return math.exp(lk), float(p)


@dataclasses.dataclass(frozen=True)
class IsoflopFit:
    """Result of :func:`fit_isoflop`: N_opt = k_N·C^a, D_opt = k_D·C^b, L_opt = k_L·C^γ."""

    method: IsoflopMethod
    "parabola or argmin"
    minima: tuple[IsoflopMinimum, ...]
    "per-budget optima, budgets ascending"
    a: float
    "exponent of N_opt ∝ C^a"
    k_n: float
    "prefactor of N_opt"
    b: float
    "exponent of D_opt ∝ C^b"
    k_d: float
    "prefactor of D_opt"
    gamma: float
    "exponent of the optimal loss L_opt ≈ k_L·C^γ (a plain power law: no irreducible term)"
    k_l: float
    "prefactor of L_opt"
    objective: float
    "sum of squared log residuals of the two allocation power laws"
    boot: tuple[tuple[float, ...], ...] = ()
    "bootstrap samples of (k_N, a, k_D, b, k_L, γ)"

    def predict(self, c: float) -> tuple[float, float, float]:
        """(N_opt, D_opt, L_opt) at budget ``c``."""
        return self.k_n * c**self.a, self.k_d * c**self.b, self.k_l * c**self.gamma


def _isoflop_laws(minima: Sequence[IsoflopMinimum]) -> tuple[float, ...]:
    c = [m.budget for m in minima]
    kn, a = power_law(c, [m.n_opt for m in minima])
    kd, b = power_law(c, [m.d_opt for m in minima])
    kl, g = power_law(c, [m.loss for m in minima])
    return kn, a, kd, b, kl, g


def fit_isoflop(
    n: Sequence[float],
    d: Sequence[float],
    loss: Sequence[float],
    budget: Sequence[float],
    method: IsoflopMethod = "parabola",
    n_boot: int = 0,
    seed: int = 0,
) -> IsoflopFit:
    """Approach 2 over runs labelled by budget (see :func:`group_budgets`).

    The bootstrap resamples runs with replacement within each budget (redrawing a budget's
    sample until it has 3 distinct sizes) and refits every minimum and both power laws.
    """
    n_, d_, l_, c_ = (np.asarray(v, dtype=np.float64) for v in (n, d, loss, budget))
    budgets = np.unique(c_)
    if budgets.size < 2:
        raise ValueError(f"an IsoFLOP fit needs at least 2 budgets, got {budgets.size}")
    groups = [np.flatnonzero(c_ == c) for c in budgets]
    minima = tuple(
        isoflop_minimum(float(c), n_[g], d_[g], l_[g], method)
        for c, g in zip(budgets, groups, strict=True)
    )
    kn, a, kd, b, kl, g = _isoflop_laws(minima)
    cs = np.log(budgets)
    res_n = np.log([m.n_opt for m in minima]) - (math.log(kn) + a * cs)
    res_d = np.log([m.d_opt for m in minima]) - (math.log(kd) + b * cs)
    boot: list[tuple[float, ...]] = []
    if n_boot:
        rng = np.random.default_rng(seed)
        for _ in range(n_boot):
            bm = []
            for c, grp in zip(budgets, groups, strict=True):
                for _tries in range(100):
                    idx = rng.choice(grp, grp.size, replace=True)
                    if method == "argmin" or np.unique(n_[idx]).size >= 3:
                        break
                try:
                    bm.append(isoflop_minimum(float(c), n_[idx], d_[idx], l_[idx], method))
                except ValueError:  # a resample without a convex profile: skip the budget
                    continue
            if len(bm) >= 2:
                boot.append(_isoflop_laws(bm))
    return IsoflopFit(
        method=method,
        minima=minima,
        a=a,
        k_n=kn,
        b=b,
        k_d=kd,
        gamma=g,
        k_l=kl,
        objective=float(np.sum(res_n**2) + np.sum(res_d**2)),
        boot=tuple(boot),
    )


# ---------------------------------------------------------------------------------------------
# Predictions


def _interval(samples: Sequence[float], level: float = 0.95) -> list[float]:
    s = np.asarray(samples, dtype=np.float64)
    s = s[np.isfinite(s)]
    if s.size == 0:
        return [math.nan, math.nan]
    q = (1 - level) / 2
    return [float(np.quantile(s, q)), float(np.quantile(s, 1 - q))]


def predict_parametric(fit: ParametricFit, budgets: Sequence[float]) -> dict[str, dict]:
    """Per budget: compute-optimal N, D, tokens per parameter, loss, with bootstrap intervals."""
    out: dict[str, dict] = {}
    boot_laws = [ParametricLaw.from_theta(th) for th in fit.boot]
    for c in budgets:
        n, d = fit.law.optimal(c, fit.k)
        rec: dict[str, Any] = {
            "N": n,
            "D": d,
            "tokens_per_param": d / n,
            "loss": float(fit.law.loss(n, d)),
        }
        if boot_laws:
            ns, ds, ls = [], [], []
            for law in boot_laws:
                bn, bd = law.optimal(c, fit.k)
                ns.append(bn)
                ds.append(bd)
                ls.append(float(law.loss(bn, bd)) if math.isfinite(bn) else math.nan)
            rec["intervals"] = {
                "N": _interval(ns),
                "D": _interval(ds),
                "tokens_per_param": _interval(np.asarray(ds) / np.asarray(ns)),
                "loss": _interval(ls),
            }
        out[f"{c:.3g}"] = rec
    return out


def predict_isoflop(fit: IsoflopFit, budgets: Sequence[float]) -> dict[str, dict]:
    """Per budget: N_opt, D_opt, tokens per parameter and L_opt from the power laws, with intervals."""
    out: dict[str, dict] = {}
    for c in budgets:
        n, d, loss = fit.predict(c)
        rec: dict[str, Any] = {"N": n, "D": d, "tokens_per_param": d / n, "loss": loss}
        if fit.boot:
            bs = np.asarray(fit.boot)  # (S, 6): k_N, a, k_D, b, k_L, γ
            ns, ds, ls = (
                bs[:, 0] * c ** bs[:, 1],
                bs[:, 2] * c ** bs[:, 3],
                bs[:, 4] * c ** bs[:, 5],
            )
            rec["intervals"] = {
                "N": _interval(ns),
                "D": _interval(ds),
                "tokens_per_param": _interval(ds / ns),
                "loss": _interval(ls),
            }
        out[f"{c:.3g}"] = rec
    return out


EXPONENT_BOUNDS = (0.0, 10.0)
"the L-BFGS bounds of α and β (:func:`_lbfgs`)"


def fit_warnings(
    params: dict[str, float],
    intervals: dict[str, list[float]] | None,
    min_loss: float,
    bounds: dict[str, tuple[float, float]] | None = None,
    spread: float = 100.0,
) -> list[str]:
    """Why a fit's coefficients should not be trusted, one sentence each (empty: none seen).

    A parameter on its optimisation bound (``bounds``; default α, β in :data:`EXPONENT_BOUNDS`),
    an irreducible loss E that collapsed to nothing (below 1e-6 of the smallest loss: the data
    cannot tell E from the power-law terms), and a bootstrap interval whose ends differ by more
    than ``spread``× (or straddle zero) each give a warning. Too few runs show up this way.
    """
    bounds = bounds if bounds is not None else {"alpha": EXPONENT_BOUNDS, "beta": EXPONENT_BOUNDS}
    out: list[str] = []
    for key, (lo, hi) in bounds.items():
        v = params.get(key)
        if v is not None and (abs(v - lo) <= 1e-6 * max(1.0, abs(lo)) or abs(v - hi) <= 1e-6 * hi):
            out.append(f"{key} = {v:.4g} sits on its bound [{lo:g}, {hi:g}]: it is not identified")
    e = params.get("E")
    if e is not None and e < 1e-6 * min_loss:
        out.append(
            f"E = {e:.3g} collapsed to zero: the runs cannot separate the irreducible loss "
            "from the power-law terms"
        )
    for key, iv in (intervals or {}).items():
        lo, hi = float(iv[0]), float(iv[1])
        if lo <= 0 < hi and params.get(key, 1.0) > 0:
            out.append(f"the 95% interval of {key} [{lo:.3g}, {hi:.3g}] includes zero")
        elif lo > 0 and hi / lo > spread:
            out.append(
                f"the 95% interval of {key} [{lo:.3g}, {hi:.3g}] spans "
                f"{math.log10(hi / lo):.0f} orders of magnitude"
            )
    return out


def parametric_report(fit: ParametricFit, budgets: Sequence[float]) -> dict[str, Any]:
    """The JSON the CLI writes for Approach 3."""
    law = fit.law
    params = {"A": law.A, "B": law.B, "E": law.E, "alpha": law.alpha, "beta": law.beta}
    rep: dict[str, Any] = {
        "method": "parametric",
        "params": params,
        "objective": fit.objective,
        "starts": fit.starts,
        "starts_disagree": fit.starts_disagree,
        "start_spread": fit.start_spread,
        "flops_per_param_token": fit.k,
        "optimal": predict_parametric(fit, budgets),
    }
    if fit.boot:
        laws = [ParametricLaw.from_theta(th) for th in fit.boot]
        rep["intervals"] = {
            key: _interval([getattr(x, key) for x in laws])
            for key in ("A", "B", "E", "alpha", "beta")
        }
        rep["bootstrap_samples"] = len(laws)
    rep["warnings"] = fit_warnings(params, rep.get("intervals"), fit.min_loss)
    return rep


def isoflop_report(fit: IsoflopFit, budgets: Sequence[float]) -> dict[str, Any]:
    """The JSON the CLI writes for Approach 2."""
    rep: dict[str, Any] = {
        "method": f"isoflop-{fit.method}",
        "params": {
            "a": fit.a,
            "k_N": fit.k_n,
            "b": fit.b,
            "k_D": fit.k_d,
            "gamma": fit.gamma,
            "k_L": fit.k_l,
        },
        "objective": fit.objective,
        "minima": [dataclasses.asdict(m) for m in fit.minima],
        "minima_outside": [m.budget for m in fit.minima if not m.inside],
        "optimal": predict_isoflop(fit, budgets),
    }
    if fit.boot:
        bs = np.asarray(fit.boot)
        rep["intervals"] = {
            "a": _interval(bs[:, 1]),
            "b": _interval(bs[:, 3]),
            "gamma": _interval(bs[:, 5]),
        }
        rep["bootstrap_samples"] = int(bs.shape[0])
    rep["warnings"] = fit_warnings(rep["params"], rep.get("intervals"), math.inf, bounds={})
    return rep


def _logs(*cols: Sequence[float]) -> tuple[np.ndarray, ...]:
    out = []
    for col in cols:
        arr = np.asarray(col, dtype=np.float64)
        if arr.ndim != 1 or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
            raise ValueError("parameters, tokens and losses must be positive finite numbers")
        out.append(np.log(arr))
    if len({a.size for a in out}) != 1:
        raise ValueError("parameters, tokens and losses must have the same length")
    return tuple(out)


def fit_and_report(
    n: Sequence[float],
    d: Sequence[float],
    loss: Sequence[float],
    budget: Sequence[float],
    method: Literal["parametric", "isoflop-parabola", "isoflop-argmin"],
    budgets: Sequence[float],
    delta: float = 1e-3,
    n_boot: int = 200,
    seed: int = 0,
    k: float = 6.0,
) -> tuple[ParametricFit | IsoflopFit, dict[str, Any]]:
    """One fit by name (as ``lmforge scaling fit --method``) and its JSON report."""
    if method == "parametric":
        ref = max(budgets) if budgets else None
        pfit = fit_parametric(
            n, d, loss, delta=delta, n_boot=n_boot, seed=seed, k=k, reference_budget=ref
        )
        rep = parametric_report(pfit, budgets)
        rep["huber_delta"] = delta
        return pfit, rep
    if method in ("isoflop-parabola", "isoflop-argmin"):
        ifit = fit_isoflop(
            n, d, loss, budget, method=method.split("-", 1)[1], n_boot=n_boot, seed=seed
        )
        return ifit, isoflop_report(ifit, budgets)
    raise ValueError(
        f"unknown fit method {method!r} (expected parametric, isoflop-parabola or isoflop-argmin)"
    )
