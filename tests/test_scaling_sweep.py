"""Sweep planning and the resumable sweep runner, end to end on tiny CPU models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmforge.config import RunConfig
from lmforge.model import accounting
from lmforge.model.config import ModelConfig
from lmforge.scaling.plan import family_shape, plan_grid
from lmforge.scaling.runs import load_runs
from lmforge.scaling.sweep import plan_to_json, read_results, run_sweep
from lmforge.train.config import DataConfig, TrainConfig
from lmforge.train.data import write_shard
from lmforge.utils.errors import LmforgeError


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    folder = tmp_path_factory.mktemp("sweep_data")
    rng = np.random.default_rng(0)
    toks = np.where(
        rng.random(40000) < 0.2, rng.integers(0, 128, 40000), np.tile(np.arange(40), 1000)
    )
    train = write_shard(folder / "train.bin", toks[:36000], 128)
    val = write_shard(folder / "val.bin", toks[36000:], 128)
    return RunConfig(
        model=ModelConfig(vocab_size=128, context_length=32, d_model=32, n_layers=1, n_heads=2),
        train=TrainConfig(
            device="cpu",
            precision="fp32",
            batch_size=4,
            lr=3e-3,
            min_lr=3e-4,
            warmup_steps=5,
            eval_every=0,
            eval_batches=4,
            save_every=0,
            log_every=5,
            progress=False,
            plot=False,
        ),
        data=DataConfig(train=(str(train),), val=(str(val),)),
    )


def test_family_shape_rounds_width_to_heads() -> None:
    assert family_shape(3, 20, 16) == (64, 4)
    with pytest.raises(LmforgeError, match="even head_dim"):
        family_shape(2, 32, 15)


def test_plan_tokens_follow_the_flop_rule(base: RunConfig) -> None:
    six = plan_grid(base, [1e10], [1, 2], aspect=32, head_dim=16, flops_rule="6nd")
    exact = plan_grid(base, [1e10], [1, 2], aspect=32, head_dim=16, flops_rule="exact")
    for p6, pe in zip(six, exact, strict=True):
        assert p6.parameters == pe.parameters
        tps = base.train.batch_size * base.model.context_length
        assert p6.tokens == p6.steps * tps
        assert p6.steps == round(1e10 / (6 * p6.parameters) / tps)
        assert pe.tokens < p6.tokens  # exact counts attention too: fewer tokens per budget
        mcfg = ModelConfig(
            vocab_size=128,
            context_length=32,
            d_model=pe.d_model,
            n_layers=pe.n_layers,
            n_heads=pe.n_heads,
        )
        assert pe.flops == pytest.approx(accounting.flops_per_token(mcfg, 32) * pe.tokens)
        assert p6.parameters == accounting.matmul_parameters(mcfg)


def test_plan_drops_points_below_min_steps(base: RunConfig) -> None:
    pts = plan_grid(base, [3e9], [1, 2, 3, 4], aspect=32, head_dim=16, min_steps=30)
    assert pts and all(p.steps >= 30 for p in pts)
    with pytest.raises(LmforgeError, match="no point"):
        plan_grid(base, [1e6], [1], aspect=32, head_dim=16)


def test_sweep_resumes_without_rerunning_finished_points(
    base: RunConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmforge.train.trainer as trainer_mod

    pts = plan_grid(base, [2e9, 4e9], [1, 2], aspect=32, head_dim=16)
    plan = tmp_path / "plan.json"
    plan.write_text(plan_to_json(base, pts, {}))
    out = tmp_path / "sweep"
    real = trainer_mod.train
    calls: list[str] = []

    def killed_on_third(cfg, runtime=None, callbacks=()):
        calls.append(Path(cfg.train.out_dir).name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the sweep is killed while its third point trains
        return real(cfg, runtime, callbacks)

    monkeypatch.setattr(trainer_mod, "train", killed_on_third)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(plan, out, progress=False)
    assert [r["id"] for r in read_results(out / "results.jsonl")] == calls[:2]
    # A torn last line (killed mid-append) is dropped, not fatal.
    with open(out / "results.jsonl", "a") as f:
        f.write('{"id": "C4e+09_L')
    calls.clear()
    monkeypatch.setattr(trainer_mod, "train", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    results = run_sweep(plan, out, progress=False)
    assert len(calls) == len(pts) - 2  # only the unfinished points ran
    assert sorted(r["id"] for r in results) == sorted(p.id for p in pts)
    for r in results:
        assert r["loss_kind"] == "val_loss" and np.isfinite(r["loss"])
        assert r["curve"] and r["curve"][-1][0] == r["tokens"]
    # A third run has nothing to do.
    calls.clear()
    run_sweep(plan, out, progress=False)
    assert calls == []
    table = load_runs(out / "results.jsonl")
    assert len(table) == len(pts)
    assert sorted(set(table.budget)) == [2e9, 4e9]


def test_sweep_refuses_a_different_plan_in_the_same_folder(base: RunConfig, tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(plan_to_json(base, plan_grid(base, [2e9], [1], aspect=32, head_dim=16), {}))
    b.write_text(plan_to_json(base, plan_grid(base, [4e9], [1], aspect=32, head_dim=16), {}))
    run_sweep(a, tmp_path / "s", progress=False)
    with pytest.raises(LmforgeError, match="different sweep plan"):
        run_sweep(b, tmp_path / "s", progress=False)


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        (
            "r.jsonl",
            '{"parameters": 1e6, "tokens": 1e7, "loss": 3.0}\n{bad\n{"parameters": 1}\n',
            "r.jsonl:2: not valid JSON",
        ),
        ("r.csv", "parameters,tokens\n1,2\n", "needs the columns parameters,tokens,loss"),
        ("r.csv", "parameters,tokens,loss\n1e6,1e7,-3\n", "r.csv:2: loss must be a positive"),
        ("r.json", '{"a": 1}', "expected a JSON list"),
        ("r.txt", "", "unknown runs format"),
    ],
)
def test_bad_runs_files_name_the_problem(tmp_path: Path, name: str, text: str, match: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(LmforgeError, match=match):
        load_runs(tmp_path / name)


def test_csv_and_fit_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lmforge.cli import main
    from lmforge.scaling.fit import ParametricLaw

    law = ParametricLaw(E=1.8, A=300.0, B=500.0, alpha=0.35, beta=0.3)
    lines = ["parameters,tokens,loss"]
    for c in (1e16, 1e17, 1e18):
        n_opt, _ = law.optimal(c)
        for f in (0.25, 0.5, 1, 2, 4):
            n = n_opt * f
            lines.append(f"{n},{c / (6 * n)},{float(law.loss(n, c / (6 * n)))}")
    (tmp_path / "runs.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "fit.json"
    rc = main(
        [
            "scaling",
            "fit",
            "--runs",
            str(tmp_path / "runs.csv"),
            "--method",
            "isoflop-parabola",
            "--predict",
            "1e20",
            "--json",
            str(out),
            "--bootstrap",
            "20",
            "--plot",
            str(tmp_path / "fit.png"),
        ]
    )
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["method"] == "isoflop-parabola" and set(rep["params"]) >= {"a", "b"}
    assert rep["optimal"]["1e+20"]["N"] == pytest.approx(law.optimal(1e20)[0], rel=0.1)
    assert (tmp_path / "fit.png").stat().st_size > 1000
    assert main(["scaling", "predict", "--fit", str(out), "--budgets", "1e20"]) == 0
    assert "C=1e+20" in capsys.readouterr().out
