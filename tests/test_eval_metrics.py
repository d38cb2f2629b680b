"""Accuracy standard errors, unbiased pass@k, Bradley–Terry/Elo with bootstrap intervals."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmforge.eval import fit_bradley_terry, mean_stderr, pass_at_k


def test_mean_stderr_matches_bernoulli_formula() -> None:
    values = [1.0] * 30 + [0.0] * 70
    mean, se = mean_stderr(values)
    assert mean == pytest.approx(0.3)
    assert se == pytest.approx(math.sqrt(0.3 * 0.7 / 99))
    assert mean_stderr([1.0]) == (1.0, 0.0)
    assert all(math.isnan(x) for x in mean_stderr([]))


def _pass_at_k_brute(n: int, c: int, k: int) -> float:
    # probability that a uniformly random k-subset of n samples contains a correct one
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@given(
    st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n)))
)
def test_pass_at_k_equals_subset_probability(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_brute(n, c, k), abs=1e-12)


def test_pass_at_k_edges() -> None:
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200)
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError):
        pass_at_k(5, 1, 6)


def test_bradley_terry_recovers_known_ratings() -> None:
    true = {"strong": 1200.0, "mid": 1000.0, "weak": 800.0}
    rng = random.Random(0)
    records = []
    for _ in range(3000):
        a, b = rng.sample(sorted(true), 2)
        p_a = 1 / (1 + 10 ** ((true[b] - true[a]) / 400))
        records.append((a, b, a if rng.random() < p_a else b))
    fit = fit_bradley_terry(records, bootstrap=100, seed=1)
    # ratings are identified up to a shift: compare differences
    assert fit.ratings["strong"] - fit.ratings["weak"] == pytest.approx(400, abs=40)
    assert fit.ratings["mid"] - fit.ratings["weak"] == pytest.approx(200, abs=40)
    assert sum(fit.ratings.values()) / 3 == pytest.approx(1000.0)
    for name, (lo, hi) in fit.ci.items():
        assert lo < fit.ratings[name] < hi
        assert hi - lo < 80
    assert fit.win_probability("strong", "weak") == pytest.approx(1 / (1 + 10**-1), abs=0.03)
    assert "| strong |" in fit.table().splitlines()[2]


def test_bradley_terry_ties_and_names() -> None:
    # all ties: equal ratings; "a"/"b" and model names are both accepted as winners
    fit = fit_bradley_terry([("x", "y", "tie")] * 10 + [("x", "y", None)] * 10, bootstrap=0)
    assert fit.ratings["x"] == pytest.approx(fit.ratings["y"])
    fit2 = fit_bradley_terry([("x", "y", "a")] * 3 + [("x", "y", "y")], bootstrap=10)
    assert fit2.ratings["x"] > fit2.ratings["y"]
    # undefeated stays finite thanks to the small L2 term
    fit3 = fit_bradley_terry([("x", "y", "x")] * 20, bootstrap=0)
    assert math.isfinite(fit3.ratings["x"]) and fit3.ratings["x"] > fit3.ratings["y"]
    with pytest.raises(ValueError):
        fit_bradley_terry([("x", "y", "z")])
    with pytest.raises(ValueError):
        fit_bradley_terry([])
