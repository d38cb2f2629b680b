"""Learning-rate schedules at their boundaries."""

from __future__ import annotations

import itertools
import math

import pytest

from lmforge.train import constant_schedule, cosine_schedule, lr_at, wsd_schedule


def test_cosine_boundaries() -> None:
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_iters=10, cosine_cycle_iters=110)
    assert cosine_schedule(0, **kw) == 0.0
    assert cosine_schedule(5, **kw) == pytest.approx(0.5)
    assert cosine_schedule(10, **kw) == pytest.approx(1.0)
    assert cosine_schedule(60, **kw) == pytest.approx(0.55)  # halfway down the cosine
    assert cosine_schedule(35, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert cosine_schedule(110, **kw) == pytest.approx(0.1)
    assert cosine_schedule(1000, **kw) == 0.1
    values = [cosine_schedule(i, **kw) for i in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_wsd_boundaries() -> None:
    kw = dict(max_lr=1.0, min_lr=0.0, warmup_iters=10, total_iters=100, decay_iters=20)
    assert wsd_schedule(0, **kw) == 0.0
    assert wsd_schedule(5, **kw) == pytest.approx(0.5)
    assert wsd_schedule(10, **kw) == 1.0
    assert wsd_schedule(79, **kw) == 1.0
    assert wsd_schedule(80, **kw) == 1.0
    assert wsd_schedule(90, **kw) == pytest.approx(0.5)
    assert wsd_schedule(100, **kw) == 0.0
    assert wsd_schedule(500, **kw) == 0.0


def test_constant_and_dispatch() -> None:
    assert constant_schedule(2, 1.0, 4) == 0.5
    assert constant_schedule(40, 1.0, 4) == 1.0
    assert lr_at(60, "cosine", 1.0, 0.1, 10, 110) == pytest.approx(0.55)
    assert lr_at(90, "wsd", 1.0, 0.0, 10, 100, decay_fraction=0.2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        lr_at(0, "linear", 1.0, 0.0, 0, 10)
