"""Gradient noise scale: the estimator on Gaussian gradients of known covariance, and the trainer
callback (logged, and without any effect on training)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from lmforge.config import RunConfig
from lmforge.model.config import ModelConfig
from lmforge.scaling.noise import NoiseScaleCallback, b_simple, noise_scale_terms
from lmforge.train.config import DataConfig, TrainConfig
from lmforge.train.data import write_shard
from lmforge.train.trainer import read_metrics, train


def test_estimator_recovers_trace_over_squared_mean() -> None:
    rng = np.random.default_rng(0)
    dim, b_small, b_big, trials = 400, 4, 32, 2000
    g = rng.normal(0, 1, dim) * 0.05
    sigma = rng.uniform(0.5, 1.5, dim)  # per-example std per coordinate
    true = float(np.sum(sigma**2) / np.sum(g**2))
    # Batch means of per-example gradients N(G, diag σ²): N(G, σ²/B).
    small = g + rng.normal(0, 1, (trials, dim)) * sigma / math.sqrt(b_small)
    big = g + rng.normal(0, 1, (trials, dim)) * sigma / math.sqrt(b_big)
    s2 = float(np.mean(np.sum(small**2, 1)))
    b2 = float(np.mean(np.sum(big**2, 1)))
    g2, trace = noise_scale_terms(s2, b2, b_small, b_big)
    assert g2 == pytest.approx(float(np.sum(g**2)), rel=0.1)
    assert trace == pytest.approx(float(np.sum(sigma**2)), rel=0.02)
    assert b_simple(s2, b2, b_small, b_big) == pytest.approx(true, rel=0.1)
    with pytest.raises(ValueError):
        noise_scale_terms(1.0, 1.0, 8, 8)


def _cfg(folder: Path, out: str) -> RunConfig:
    rng = np.random.default_rng(0)
    toks = np.where(
        rng.random(20000) < 0.2, rng.integers(0, 64, 20000), np.tile(np.arange(20), 1000)
    )
    train_p = write_shard(folder / "train.bin", toks, 64)
    return RunConfig(
        model=ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=1, n_heads=2),
        train=TrainConfig(
            out_dir=str(folder / out),
            device="cpu",
            precision="fp32",
            batch_size=4,
            max_steps=20,
            warmup_steps=2,
            eval_every=0,
            save_every=0,
            log_every=5,
            progress=False,
            plot=False,
        ),
        data=DataConfig(train=(str(train_p),)),
    )


def test_callback_logs_noise_scale_and_leaves_training_unchanged(tmp_path: Path) -> None:
    plain = train(_cfg(tmp_path, "plain"))
    cb = NoiseScaleCallback(every=5, micro=4)
    with_cb = train(_cfg(tmp_path, "cb"), callbacks=[cb])
    assert with_cb["train_loss"] == plain["train_loss"]  # bit-identical: own sampler, no .grad
    a = [
        r["loss"]
        for r in read_metrics(tmp_path / "plain" / "metrics.jsonl")
        if r["event"] == "train"
    ]
    recs = [r for r in read_metrics(tmp_path / "cb" / "metrics.jsonl") if r["event"] == "train"]
    assert [r["loss"] for r in recs] == a
    assert [r["step"] for r in recs if "noise_scale" in r] == [5, 10, 15, 20]
    for r in recs:
        assert math.isfinite(r["noise_scale"]) and r["noise_trace"] > 0
