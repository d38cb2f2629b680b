"""MoE in the trainer: refusal of non-causal routing, aux loss in the training loss, per-layer
routing metrics logged, aux-free bias updated between steps and checkpointed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config import RunConfig
from lmforge.model import load_preset
from lmforge.model import moe as M
from lmforge.model.moe_config import MoEConfig
from lmforge.train import DataConfig, TrainConfig, Trainer, load_for_inference
from lmforge.train.data import write_shard
from lmforge.train.trainer import read_metrics
from lmforge.utils.errors import LmforgeError


def _cfg(tmp: Path, moe: MoEConfig, **train: object) -> RunConfig:
    rng = np.random.default_rng(0)
    shard = write_shard(tmp / "t.bin", rng.integers(0, 97, 6000), 512)
    base = dict(
        out_dir=str(tmp / "run"),
        device="cpu",
        precision="fp32",
        batch_size=4,
        context_length=16,
        max_steps=6,
        log_every=2,
        eval_every=0,
        save_every=0,
        progress=False,
        plot=False,
    )
    base.update(train)
    model = dataclasses.replace(load_preset("tiny"), moe=moe)
    return RunConfig(
        model=model,
        train=TrainConfig(**base),
        data=DataConfig(train=(str(shard),), val=(str(shard),)),
    )


@pytest.mark.parametrize("routing", ["expert_choice", "token_choice_capacity"])
def test_trainer_refuses_noncausal_routing_naming_the_probe(tmp_path: Path, routing: str) -> None:
    moe = MoEConfig(n_experts=4, top_k=2, routing=routing)
    with pytest.raises(LmforgeError, match="lmforge probe causality") as e:
        Trainer(_cfg(tmp_path, moe))
    assert "allow_noncausal" in str(e.value)
    ok = dataclasses.replace(moe, allow_noncausal=True)
    Trainer(_cfg(tmp_path, ok, out_dir=str(tmp_path / "ok")))  # builds with the override


def test_training_loss_includes_aux_only_in_training(tmp_path: Path) -> None:
    moe = MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.5, z_loss_coef=0.01)
    tr = Trainer(_cfg(tmp_path, moe))
    x, y = tr.sampler.next_batch(4, "cpu")
    tr.model.train()
    with_aux = tr.loss_fn(tr.model, x, y)
    aux = M.aux_loss(tr.model)
    assert aux is not None and aux.item() > 0.5  # Switch term ≥ 1 · 0.5 per layer
    tr.model.eval()
    plain = tr.loss_fn(tr.model, x, y)
    torch.testing.assert_close(with_aux, plain + aux, rtol=1e-6, atol=1e-6)


def test_train_logs_moe_metrics_and_updates_bias(tmp_path: Path) -> None:
    moe = MoEConfig(n_experts=4, top_k=2, bias_update_rate=0.01, aux_loss_coef=0.0)
    cfg = _cfg(tmp_path, moe)
    result = Trainer(cfg).run()
    recs = [r for r in read_metrics(Path(cfg.train.out_dir) / "metrics.jsonl")]
    train = [r for r in recs if r.get("event") == "train"]
    assert train and all("moe/L1/load_max_mean" in r for r in train)
    assert all(0.0 <= r["moe/L0/dropped"] <= 1.0 for r in train)
    model, _ = load_for_inference(result["checkpoint"])
    bias = [layer.expert_bias for layer in M.moe_layers(model)]
    # 6 steps of ±0.01: every entry a multiple of 0.01 within ±0.06, and not all zero.
    assert all(b.abs().max() <= 0.06 + 1e-6 for b in bias)
    assert any(b.abs().sum() > 0 for b in bias)


@pytest.mark.parametrize("name", ["moe-tiny", "moe-gpt2-small"])
def test_moe_configs_load_and_build(name: str) -> None:
    from lmforge.config import load_run_config
    from lmforge.model import TransformerLM, accounting

    root = Path(__file__).resolve().parents[1]
    cfg = load_run_config(root / "configs" / f"{name}.toml").model
    assert cfg.moe.enabled and cfg.moe.causal
    model = TransformerLM(cfg, device="meta")
    assert model.num_parameters() == accounting.parameter_count(cfg)
    assert accounting.active_parameter_count(cfg) < accounting.parameter_count(cfg)


def _run_recording(cfg: RunConfig, late: bool) -> tuple[list[str], list[dict], dict]:
    tr = Trainer(cfg)
    tr.deferred = True  # the sync-free step (the default on CUDA), forced on the CPU
    if not late:  # the old contract: a callback makes the loop wait for every step
        for cb in tr.callbacks:
            cb.deferrable = False
    order: list[str] = []
    launch, finish = tr.stepper.launch, tr.stepper.finish

    def logged_launch(*a: object, **k: object) -> object:
        order.append("launch")
        return launch(*a, **k)

    def logged_finish(p: object) -> object:
        order.append("finish")
        return finish(p)

    tr.stepper.launch = logged_launch
    tr.stepper.finish = logged_finish
    tr.run()
    recs = [
        {k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "elapsed_s")}
        for r in read_metrics(Path(cfg.train.out_dir) / "metrics.jsonl")
        if r.get("event") == "train"
    ]
    return order, recs, {k: v.clone() for k, v in tr.model.state_dict().items()}


def test_moe_callbacks_let_the_sync_free_loop_run_a_step_ahead(tmp_path: Path) -> None:
    # The MoE callbacks (bias update, routing statistics) used to force the loop to wait for
    # every step (a host sync per step on a GPU). Now their device work runs at launch and the
    # loop reports each step one step late, with the same weights, bias and logged statistics.
    moe = MoEConfig(n_experts=4, top_k=2, bias_update_rate=0.01, z_loss_coef=1e-3)
    runs = {}
    for late in (False, True):
        cfg = _cfg(tmp_path / str(late), moe, max_steps=6, log_every=2)
        runs[late] = _run_recording(cfg, late)
    sync_order, sync_recs, sync_state = runs[False]
    late_order, late_recs, late_state = runs[True]
    assert sync_order[:4] == ["launch", "finish", "launch", "finish"]
    assert late_order[:3] == ["launch", "launch", "finish"], late_order  # a step ahead
    assert late_recs == sync_recs and "moe/L0/entropy" in late_recs[0]
    for k, v in sync_state.items():
        assert torch.equal(late_state[k], v), k
    assert any(late_state[k].abs().sum() > 0 for k in late_state if k.endswith("expert_bias"))


def test_moe_master_weights_train_exactly_like_autocast_over_fp32(tmp_path: Path) -> None:
    # train.master_weights=on makes the stacked expert weights bf16 copies too (no per-step
    # casts of them), and keeps the router fp32: losses, norms, weights and the bias equal the
    # autocast-over-fp32 run bit for bit (with the router copied to bf16 they did not).
    moe = MoEConfig(n_experts=4, top_k=2, bias_update_rate=0.01, z_loss_coef=1e-3)
    kw = dict(precision="bf16", grad_clip=0.5, lr=3e-3, warmup_steps=2, max_steps=4)
    runs = {}
    for mw in ("off", "on"):
        tr = Trainer(_cfg(tmp_path / mw, moe, master_weights=mw, **kw))
        tr.deferred = True  # the same (sync-free) step on both
        runs[mw] = (tr, [tr.train_step() for _ in range(4)])
    on = runs["on"][0]
    assert "layers.0.ffn.w1" in on.masters and "layers.1.ffn.w2" in on.masters
    assert not any(name.endswith("router.weight") for name in on.masters)
    assert on.model.layers[0].ffn.w3.dtype == torch.bfloat16
    assert runs["on"][1] == runs["off"][1]
    off_state = runs["off"][0].model.state_dict()
    state = {**on.model.state_dict(), **{n: m for n, (_, m) in on.masters.items()}}
    for k, v in off_state.items():
        assert torch.equal(state[k], v), k
