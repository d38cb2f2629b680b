"""Evaluation statistics: accuracy with standard error, pass@k, Bradley–Terry/Elo ratings.

Pure functions on plain numbers (NumPy only), testable without a model. Exercised by
``pytest tests/test_eval_metrics.py`` and by every task of ``lmforge eval``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np


def mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std with ddof=1 over sqrt(n)); stderr 0 for n < 2.

    For 0/1 correctness this is accuracy ± sqrt(p(1-p)/(n-1)), as lm-evaluation-harness reports.
    """
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    arr = np.asarray(values, dtype=np.float64)
    mean = float(arr.mean())
    if n < 2:
        return mean, 0.0
    return mean, float(arr.std(ddof=1) / math.sqrt(n))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021).

    pass@k = 1 - C(n-c, k) / C(n, k), computed as a running product so large n does not overflow.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    # C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
    ratio = float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))
    return 1.0 - ratio


@dataclasses.dataclass(frozen=True)
class PairwiseRatings:
    """Bradley–Terry strengths on the Elo scale, with bootstrap confidence intervals."""

    ratings: dict[str, float]
    "model → Elo-scale rating (mean over models = base)"
    ci: dict[str, tuple[float, float]]
    "model → (low, high) percentile bootstrap interval"
    n_games: int
    "number of comparisons fitted"

    def win_probability(self, a: str, b: str, scale: float = 400.0) -> float:
        """P(a beats b) implied by the fitted ratings."""
        return 1.0 / (1.0 + 10.0 ** ((self.ratings[b] - self.ratings[a]) / scale))

    def table(self) -> str:
        """Markdown table of models sorted by rating."""
        rows = ["| model | rating | 95% CI |", "|---|---:|---:|"]
        for name, r in sorted(self.ratings.items(), key=lambda kv: -kv[1]):
            lo, hi = self.ci[name]
            rows.append(f"| {name} | {r:.1f} | {lo:.1f} – {hi:.1f} |")
        return "\n".join(rows)


def _outcomes(
    records: Iterable[tuple[str, str, str | None]],
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Index models; per game (i, j, score of i in {0, 0.5, 1})."""
    names: dict[str, int] = {}
    ii, jj, ss = [], [], []
    for rec in records:
        a, b, winner = rec
        if a == b:
            raise ValueError(f"a model cannot play itself: {rec!r}")
        if winner in (a, "a", "model_a"):
            s = 1.0
        elif winner in (b, "b", "model_b"):
            s = 0.0
        elif winner in (None, "tie", "draw", "tie (bothbad)"):
            s = 0.5
        else:
            raise ValueError(f"winner must be model_a, model_b or 'tie', got {rec!r}")
        ii.append(names.setdefault(a, len(names)))
        jj.append(names.setdefault(b, len(names)))
        ss.append(s)
    return list(names), np.array(ii, np.int64), np.array(jj, np.int64), np.array(ss, np.float64)


def _fit_strengths(
    m: int, i: np.ndarray, j: np.ndarray, s: np.ndarray, l2: float, iters: int = 100
) -> np.ndarray:
    """Maximise sum s·log σ(θi-θj) + (1-s)·log σ(θj-θi) - l2/2·|θ|² by Newton's method.

    The small L2 term keeps an undefeated model's strength finite; the sum of θ is fixed at 0.
    """
    theta = np.zeros(m)
    for _ in range(iters):
        d = theta[i] - theta[j]
        p = 1.0 / (1.0 + np.exp(-d))
        r = s - p  # d loglik / d d
        grad = np.bincount(i, r, m) - np.bincount(j, r, m) - l2 * theta
        w = p * (1.0 - p)
        hess = np.zeros((m, m))
        np.add.at(hess, (i, i), -w)
        np.add.at(hess, (j, j), -w)
        np.add.at(hess, (i, j), w)
        np.add.at(hess, (j, i), w)
        hess -= l2 * np.eye(m)
        step = np.linalg.solve(hess, grad)
        theta = theta - step
        theta -= theta.mean()
        if np.max(np.abs(step)) < 1e-10:
            break
    return theta


def fit_bradley_terry(
    records: Sequence[tuple[str, str, str | None]],
    *,
    scale: float = 400.0,
    base: float = 1000.0,
    bootstrap: int = 200,
    confidence: float = 0.95,
    l2: float = 1e-3,
    seed: int = 0,
) -> PairwiseRatings:
    """Fit Bradley–Terry strengths from ``(model_a, model_b, winner)`` records, on the Elo scale.

    ``winner`` is ``model_a``'s or ``model_b``'s name (or ``"a"``/``"b"``), or ``"tie"``/``None``
    (half a win each). P(a beats b) = 1 / (1 + 10^((R_b - R_a)/scale)); ratings average ``base``.
    Confidence intervals come from ``bootstrap`` resamples of the records (percentile method).
    Simplification: the order-free maximum-likelihood fit (as in Chatbot Arena), not online Elo.
    """
    if not records:
        raise ValueError("no comparison records")
    names, i, j, s = _outcomes(records)
    m = len(names)
    to_elo = scale / math.log(10.0)
    theta = _fit_strengths(m, i, j, s, l2)
    ratings = {n: base + to_elo * float(t) for n, t in zip(names, theta)}
    rng = np.random.default_rng(seed)
    samples = np.empty((bootstrap, m))
    for b in range(bootstrap):
        idx = rng.integers(0, len(s), len(s))
        samples[b] = base + to_elo * _fit_strengths(m, i[idx], j[idx], s[idx], l2)
    alpha = (1.0 - confidence) / 2.0
    if bootstrap > 0:
        lo = np.quantile(samples, alpha, axis=0)
        hi = np.quantile(samples, 1.0 - alpha, axis=0)
    else:
        lo = hi = np.array([ratings[n] for n in names])
    ci = {n: (float(lo[k]), float(hi[k])) for k, n in enumerate(names)}
    return PairwiseRatings(ratings=ratings, ci=ci, n_games=len(s))
