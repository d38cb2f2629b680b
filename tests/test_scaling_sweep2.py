"""The second scaling attempt's planning helpers (benchmarks/scaling_sweep.py, scaling_prep2.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from lmforge.utils.errors import LmforgeError

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _shard(path: Path, n: int) -> None:
    from lmforge.train.data import SHARD_FORMAT

    (np.arange(n) % 1024).astype(np.uint16).tofile(path)
    side = {"format": SHARD_FORMAT, "dtype": "uint16", "count": n, "vocab_size": 1024}
    path.with_name(path.name + ".json").write_text(json.dumps(side))


def test_pick_batch_largest_that_keeps_target_steps() -> None:
    sw = _load("scaling_sweep")
    b = [8, 16, 32, 64, 128]
    assert sw.pick_batch(400 * 64 * 256, 256, 400, b) == 64  # exactly 400 steps at 64
    assert sw.pick_batch(400 * 64 * 256 - 1, 256, 400, b) == 32
    assert sw.pick_batch(1e12, 256, 400, b) == 128  # the cap
    assert sw.pick_batch(1000, 256, 400, b) == 8  # too few tokens: the smallest batch


def test_grouped_points_steps_and_epoch_cap(tmp_path: Path) -> None:
    sw = _load("scaling_sweep")
    _shard(tmp_path / "train.bin", 1000)
    _shard(tmp_path / "val.bin", 1000)
    a = argparse.Namespace(
        data=str(tmp_path),
        device="cpu",
        vocab=1024,
        context=256,
        eval_batches=2,
        warmup=30,
        batch=64,
        batches=[8, 16, 32, 64, 128],
        target_steps=400,
        min_steps=250,
        eval_windows=1024,
    )
    base = sw._base(a)
    train_tokens = 18_744_374
    pairs = sw._grouped_points(a, base, 1.5e13, [1, 2, 3, 4, 5, 6], 1.6, train_tokens)
    ids = [p.id for _, p in pairs]
    assert "C1.5e+13_L1" not in ids  # D = 5.1e7 > 1.6 epochs
    assert len(ids) == 5
    for b, p in pairs:
        assert p.steps >= 300
        assert p.tokens == p.steps * b * 256
        assert p.tokens <= 1.6 * train_tokens
        assert p.parameters > 0
        assert abs(6 * p.parameters * p.tokens / 1.5e13 - 1) < 0.01
    a.min_steps = 10**6  # no depth reaches it: each is skipped with a line, no error
    assert sw._grouped_points(a, base, 1.5e13, [2, 3], 1.6, train_tokens) == []


def test_every_batch_scores_the_same_val_windows(tmp_path: Path) -> None:
    sw = _load("scaling_sweep")
    from lmforge.config import RunConfig

    base = RunConfig()
    for b in (8, 16, 32, 64, 128):
        t = sw._with_batch(base, b, 1024).train
        assert t.batch_size == b and t.batch_size * t.eval_batches == 1024


def test_prep2_assembles_and_refuses(tmp_path: Path) -> None:
    prep = _load("scaling_prep2")
    data = tmp_path / "data"
    data.mkdir()
    _shard(data / "train.bin", 5000)
    _shard(data / "val.bin", 500)
    repo = tmp_path / "repo"
    (repo / "src" / "pkg").mkdir(parents=True)
    (repo / "src" / "pkg" / "a.py").write_text("x = 1\n")
    (repo / "benchmarks").mkdir()
    (repo / "benchmarks" / "scaling_sweep.py").write_text("# sweep\n")
    out = tmp_path / "carry"
    size = prep.assemble(data, repo, out, val_tokens=300)
    assert (out / "data" / "train.bin").stat().st_size == 10_000
    from lmforge.train.data import open_shard

    val = open_shard(out / "data" / "val.bin")
    assert len(val.tokens) == 300 and list(val.tokens[:3]) == [0, 1, 2]
    assert (out / "src" / "pkg" / "a.py").is_file() and size > 10_000
    with pytest.raises(LmforgeError, match="over"):
        prep.assemble(data, repo, tmp_path / "small", max_mb=0.001)
    assert not (tmp_path / "small").exists()
    (data / "val.bin.json").unlink()
    with pytest.raises(LmforgeError, match="missing"):
        prep.assemble(data, repo, tmp_path / "x")
