"""The causality probe: dense and dropless token-choice pass; expert choice and capacity
dropping are flagged; the aux-free bias passes; CLI exit codes 0 / 1 / 2."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.model import ModelConfig, TransformerLM, load_preset
from lmforge.model import moe as M
from lmforge.model.moe_config import MoEConfig
from lmforge.probe import probe_causality

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


def _model(**moe) -> TransformerLM:
    cfg = dataclasses.replace(load_preset("tiny"), moe=MoEConfig(**moe))
    torch.manual_seed(0)
    return TransformerLM(cfg)


def test_dense_model_is_causal() -> None:
    report = probe_causality(_model(), batch=3, seq_len=16)
    assert report.causal and report.routing == "dense"
    assert all(not c.positions for c in report.changes)
    assert {c.check for c in report.changes} == {"future", "other_rows", "incremental"}
    assert all(c.assignments_changed is None for c in report.changes)


@pytest.mark.parametrize(
    "moe",
    [
        dict(n_experts=8, top_k=2),
        dict(n_experts=6, top_k=3, score="sigmoid", n_shared_experts=1, expert_d_ff=32),
        dict(n_experts=4, top_k=1, every=2),
    ],
)
def test_dropless_token_choice_is_causal(moe) -> None:
    report = probe_causality(_model(**moe), batch=3, seq_len=16)
    assert report.causal, report.table()
    assert any(c.assignments_changed == 0 for c in report.changes)  # MoE layers were compared


@pytest.mark.parametrize(
    "moe",
    [
        dict(n_experts=8, top_k=2, routing="expert_choice"),
        dict(n_experts=8, top_k=2, routing="token_choice_capacity", capacity_factor=1.0),
    ],
)
def test_noncausal_routing_is_flagged_in_every_check(moe) -> None:
    report = probe_causality(_model(**moe), batch=4, seq_len=32)
    assert not report.causal
    leaks = report.first_leaks()
    assert set(leaks) == {"future", "other_rows", "incremental"}
    for c in leaks.values():
        assert c.assignments_changed and c.layer == "L0" and c.where is not None
    future = leaks["future"]
    assert future.where[1] <= report.position  # the change is at a position <= t
    assert future.positions and all(t <= report.position for _, t in future.positions)
    assert all(r == 0 for r, _ in leaks["other_rows"].positions)  # only row 0 is compared
    assert len(future.positions) >= max(future.changed, future.assignments_changed)


def test_aux_free_bias_is_causal_after_bias_updates() -> None:
    model = _model(n_experts=8, top_k=2, bias_update_rate=0.05, aux_loss_coef=0.0)
    model.train()
    for _ in range(5):  # real load-driven updates between "steps"
        model(torch.randint(0, 512, (4, 32)))
        M.update_expert_bias(model)
    assert any(layer.expert_bias.abs().sum() > 0 for layer in M.moe_layers(model))
    report = probe_causality(model, batch=3, seq_len=16)
    assert report.causal, report.table()


def test_probe_restores_training_mode_and_routing_hooks() -> None:
    model = _model(n_experts=4, top_k=2).train()
    probe_causality(model, batch=2, seq_len=8, checks=("future",))
    assert model.training
    assert all(
        not layer.record_routing and layer.last_routing is None for layer in M.moe_layers(model)
    )
    assert not any(block._forward_hooks for block in model.layers)


def test_bad_probe_arguments_raise_one_line() -> None:
    from lmforge.utils.errors import LmforgeError

    model = _model()
    with pytest.raises(LmforgeError, match="seq-len"):
        probe_causality(model, seq_len=10_000)
    with pytest.raises(LmforgeError, match="batch"):
        probe_causality(model, batch=1)


def test_cli_exit_codes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    base = ["probe", "causality", "--config", str(TINY), "--batch", "2", "--seq-len", "12"]
    assert main(base) == 0
    assert "causal" in capsys.readouterr().out
    moe = ["--model.moe.n_experts=4", "--model.moe.top_k=2"]
    assert main(base + moe) == 0
    assert main(base + moe + ["--model.moe.routing=expert_choice"]) == 1
    out = capsys.readouterr().out
    assert "BROKEN (future)" in out and "| future | L0 |" in out
    assert main([*base, "--model.moe.nexperts=4"]) == 2
    assert "nexperts" in capsys.readouterr().err
    assert main([*base, "--checkpoint", str(tmp_path)]) == 2


def test_cli_checkpoint_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from lmforge.config import RunConfig
    from lmforge.train import save_checkpoint

    cfg: ModelConfig = dataclasses.replace(
        load_preset("tiny"), moe=MoEConfig(n_experts=4, top_k=2, routing="expert_choice")
    )
    torch.manual_seed(0)
    path = save_checkpoint(
        tmp_path / "ck", TransformerLM(cfg), None, 1, config=RunConfig(model=cfg)
    )
    assert main(["probe", "causality", "--checkpoint", str(path), "--seq-len", "12", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["causal"] is False and report["routing"] == "expert_choice"
