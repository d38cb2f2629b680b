"""Scaling-law fits: recovery of known laws from noisy synthetic sweeps, and stability on the
shared IsoFLOP curves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lmforge.scaling.fit import (
    ParametricLaw,
    fit_isoflop,
    fit_parametric,
    group_budgets,
    huber,
    parametric_objective,
    predict_isoflop,
    predict_parametric,
)

CURVES = Path("/work/shared/data/scaling/isoflops_curves.json")
TRUE = ParametricLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Chinchilla's fit


def _sweep(law: ParametricLaw, noise: float, seed: int = 0) -> tuple[list, list, list, list]:
    # An IsoFLOP sweep: 5 budgets × 9 sizes spread 1/8..8× around the true optimum.
    rng = np.random.default_rng(seed)
    n, d, loss, c = [], [], [], []
    for budget in (1e17, 3e17, 1e18, 3e18, 1e19):
        n_opt, _ = law.optimal(budget)
        for f in np.geomspace(1 / 8, 8, 9):
            ni = n_opt * f
            di = budget / (6 * ni)
            n.append(ni)
            d.append(di)
            loss.append(float(law.loss(ni, di)) * math.exp(rng.normal(0, noise)))
            c.append(budget)
    return n, d, loss, c


def test_objective_gradient_matches_finite_differences() -> None:
    n, d, loss, _ = _sweep(TRUE, 0.01)
    args = (np.log(n), np.log(d), np.log(loss), 1e-3)
    theta = np.array([5.0, 6.0, 0.4, 0.3, 0.3])
    _, grad = parametric_objective(theta, *args)
    num = np.empty(5)
    for i in range(5):
        h = np.zeros(5)
        h[i] = 1e-6
        num[i] = (
            parametric_objective(theta + h, *args)[0] - parametric_objective(theta - h, *args)[0]
        ) / 2e-6
    np.testing.assert_allclose(grad, num, rtol=1e-5, atol=1e-9)


def test_huber_matches_definition() -> None:
    r = np.array([-2.0, -1e-4, 0.0, 5e-4, 3.0])
    expect = [1e-3 * (2 - 5e-4), 0.5e-8, 0.0, 0.5 * 25e-8, 1e-3 * (3 - 5e-4)]
    np.testing.assert_allclose(huber(r, 1e-3), expect, rtol=1e-12)


def test_noise_free_parametric_fit_recovers_the_coefficients() -> None:
    n, d, loss, _ = _sweep(TRUE, 0.0)
    fit = fit_parametric(n, d, loss)
    law = fit.law
    for key in ("E", "A", "B", "alpha", "beta"):
        assert getattr(law, key) == pytest.approx(getattr(TRUE, key), rel=1e-4), key
    assert fit.objective < 1e-12
    assert not fit.starts_disagree


def test_parametric_intervals_cover_the_true_predictions() -> None:
    n, d, loss, _ = _sweep(TRUE, 0.005)
    fit = fit_parametric(n, d, loss, n_boot=30, seed=1)
    pred = predict_parametric(fit, [1e21])["1e+21"]
    n_true, d_true = TRUE.optimal(1e21)
    iv = pred["intervals"]
    assert iv["N"][0] <= n_true <= iv["N"][1]
    assert iv["D"][0] <= d_true <= iv["D"][1]
    assert iv["loss"][0] <= float(TRUE.loss(n_true, d_true)) <= iv["loss"][1]
    assert iv["tokens_per_param"][0] <= d_true / n_true <= iv["tokens_per_param"][1]


@pytest.mark.parametrize("method", ["parabola", "argmin"])
def test_isoflop_exponents_cover_the_truth(method: str) -> None:
    n, d, loss, c = _sweep(TRUE, 0.005)
    fit = fit_isoflop(n, d, loss, c, method=method, n_boot=200, seed=2)
    a_true = TRUE.beta / (TRUE.alpha + TRUE.beta)  # N_opt ∝ C^(β/(α+β))
    a_boot = np.asarray(fit.boot)[:, 1]
    lo, hi = np.quantile(a_boot, [0.025, 0.975])
    assert lo <= a_true <= hi
    assert fit.a + fit.b == pytest.approx(1.0, abs=1e-9)  # C = 6ND exactly: D_opt = C/(6 N_opt)
    pred = predict_isoflop(fit, [1e21])["1e+21"]
    n_true, _ = TRUE.optimal(1e21)
    assert pred["intervals"]["N"][0] <= n_true <= pred["intervals"]["N"][1]


def test_group_budgets_joins_near_equal_flops() -> None:
    labels = group_budgets([1e18, 1.01e18, 3e18, 2.98e18, 1e19])
    assert labels[0] == labels[1] != labels[2] == labels[3] != labels[4]
    assert labels[4] == pytest.approx(1e19)


def test_non_convex_profile_is_named() -> None:
    n = [1e6, 2e6, 4e6, 1e6, 2e6, 4e6]
    loss = [3.0, 3.5, 3.0, 3.0, 2.0, 3.0]  # the first budget's profile is concave
    c = [1e15] * 3 + [1e16] * 3
    d = [cc / (6 * nn) for nn, cc in zip(n, c)]
    with pytest.raises(ValueError, match=r"budget 1e\+15.*not convex"):
        fit_isoflop(n, d, loss, c)


@pytest.mark.skipif(not CURVES.is_file(), reason="shared IsoFLOP curves absent")
def test_isoflop_predictions_on_shared_curves_are_stable_across_choices() -> None:
    runs = json.loads(CURVES.read_text())
    n = np.array([r["parameters"] for r in runs], dtype=float)
    c = np.array([r["compute_budget"] for r in runs], dtype=float)
    loss = np.array([r["final_loss"] for r in runs], dtype=float)
    d = c / (6 * n)
    budgets = np.unique(c)
    preds: dict[str, list[float]] = {"1e+23": [], "1e+24": []}
    # Fitting choices: all budgets, dropping the smallest or the largest budget, dropping the
    # highest-loss run of every budget (the profile's far tails).
    choices = {
        "all": np.ones(n.size, bool),
        "no_smallest": c != budgets[0],
        "no_largest": c != budgets[-1],
    }
    tails = np.ones(n.size, bool)
    for b in budgets:
        idx = np.flatnonzero(c == b)
        tails[idx[np.argmax(loss[idx])]] = False
    choices["no_tails"] = tails
    for sel in choices.values():
        fit = fit_isoflop(n[sel], d[sel], loss[sel], c[sel], method="parabola")
        for key, rec in predict_isoflop(fit, [1e23, 1e24]).items():
            preds[key].append(rec["N"])
    for key, values in preds.items():
        spread = max(values) / min(values)
        # Measured: 1.009× at 1e23 and 1.011× at 1e24 (benchmarks/RESULTS.md; the argmin variant
        # spreads 1.14× and 1.18× over the same choices, its minima being grid points).
        assert spread < 1.03, (key, values)


def test_minimum_outside_the_sizes_is_flagged() -> None:
    law = TRUE
    n, d, loss, c = [], [], [], []
    for budget in (1e17, 1e18):
        n_opt, _ = law.optimal(budget)
        # sizes bracket the optimum at 1e18 but lie all above it at 1e17
        for f in (2, 4, 8, 16) if budget == 1e17 else (0.25, 0.5, 1, 2, 4):
            n.append(n_opt * f)
            d.append(budget / (6 * n_opt * f))
            loss.append(float(law.loss(n[-1], d[-1])))
            c.append(budget)
    for method in ("parabola", "argmin"):
        fit = fit_isoflop(n, d, loss, c, method=method)
        assert [m.inside for m in fit.minima] == [False, True], method
