"""muP: the multipliers (against an equivalent re-weighted standard model), the trainer's LR
groups, and the coordinate check (flat in width under muP, growing under standard)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config import RunConfig
from lmforge.model import TransformerLM
from lmforge.model.config import ModelConfig
from lmforge.model.mup import lr_multipliers, output_multiplier, q_scale
from lmforge.scaling.mup import coord_check, lr_sweep
from lmforge.train.config import DataConfig, TrainConfig
from lmforge.train.data import write_shard
from lmforge.train.trainer import Trainer


def _cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=64, context_length=16, d_model=64, n_layers=2, n_heads=4, attention="reference"
    )
    base.update(kw)
    return ModelConfig(**base)


def test_mup_equals_a_reweighted_standard_model() -> None:
    # muP at width 64 over base 16 (heads of 16 over a base of 4): q × sqrt(4/16), logits × 1/4.
    mcfg = _cfg(mup=True, mup_base_width=16, mup_base_head_dim=4)
    assert q_scale(mcfg) == 0.5 and output_multiplier(mcfg) == 0.25
    torch.manual_seed(0)
    mup = TransformerLM(mcfg).double()
    torch.manual_seed(0)
    std = TransformerLM(dataclasses.replace(mcfg, mup=False)).double()
    with torch.no_grad():  # the same function by weights: q_proj·c (RoPE is linear), lm_head/m
        for layer in std.layers:
            layer.attn.q_proj.weight.mul_(q_scale(mcfg))
        std.lm_head.weight.mul_(output_multiplier(mcfg))
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(mup(x), std(x), rtol=1e-12, atol=1e-12)
    # SDPA takes q's scale the same way (the reference attention's softmax runs in fp32).
    other = TransformerLM(dataclasses.replace(mcfg, attention="sdpa")).double()
    other.load_state_dict(mup.state_dict())
    torch.testing.assert_close(other(x), mup(x), rtol=1e-5, atol=1e-6)


def test_mup_at_base_width_is_the_standard_model() -> None:
    mcfg = _cfg(mup=True, mup_base_width=64, mup_base_head_dim=16)
    torch.manual_seed(1)
    a = TransformerLM(mcfg)
    torch.manual_seed(1)
    b = TransformerLM(dataclasses.replace(mcfg, mup=False))
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert set(lr_multipliers(a).values()) == {1.0}
    assert lr_multipliers(b) == {}


def test_trainer_applies_the_hidden_lr_multiplier(tmp_path: Path) -> None:
    toks = np.random.default_rng(0).integers(0, 64, 5000)
    shard = write_shard(tmp_path / "t.bin", toks, 64)
    cfg = RunConfig(
        model=_cfg(mup=True, mup_base_width=16, mup_base_head_dim=4),
        train=TrainConfig(
            out_dir=str(tmp_path / "run"),
            device="cpu",
            precision="fp32",
            batch_size=2,
            max_steps=3,
            warmup_steps=0,
            schedule="constant",
            lr=1e-3,
            eval_every=0,
            progress=False,
            plot=False,
        ),
        data=DataConfig(train=(str(shard),)),
    )
    tr = Trainer(cfg)
    tr.train_step()
    names = {id(p): n for n, p in tr.model.named_parameters()}
    seen = {}
    for g in tr.optimizer.param_groups:
        for p in g["params"]:
            seen[names[id(p)]] = g["lr"]
    assert seen["layers.0.attn.q_proj.weight"] == pytest.approx(1e-3 / 4)
    assert seen["layers.1.ffn.w2.weight"] == pytest.approx(1e-3 / 4)
    assert seen["token_embeddings.weight"] == seen["lm_head.weight"] == pytest.approx(1e-3)
    assert seen["ln_final.weight"] == pytest.approx(1e-3)


def test_coord_check_is_flat_under_mup_and_grows_under_standard() -> None:
    res = coord_check([32, 128], steps=4, lr=1e-2)
    last = {name: {w: v[-1] for w, v in res[name]["block_1"].items()} for name in res}
    sp = last["standard"][128] / last["standard"][32]
    mu = last["mup"][128] / last["mup"][32]
    # Measured: standard 1.62×, muP 0.94× over 4× the width (benchmarks/RESULTS.md).
    assert sp > 1.5
    assert abs(math.log(mu)) < math.log(1.2)


def test_lr_sweep_in_the_trainer_matches_a_plain_adamw_loop() -> None:
    # The Trainer's run (its AdamW groups with muP's multipliers, constant LR, no clipping)
    # against torch.optim.AdamW stepped by hand on the same windows: the same losses.
    from lmforge.model.mup import lr_multipliers
    from lmforge.scaling.mup import _batches, _stream, family_config

    steps, lr = 6, 1e-2
    got = lr_sweep([32], [lr], mup=True, steps=steps, base_width=16, batch=2, context=16)[32][lr]
    cfg = dataclasses.replace(family_config(32, True, 16, context=16, vocab=256), attention="sdpa")
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    mults = lr_multipliers(model)
    assert set(mults.values()) != {1.0}
    groups: dict[float, list] = {}
    for p in model.parameters():
        groups.setdefault(mults.get(id(p), 1.0), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "lr": lr * m} for m, ps in groups.items()], lr=lr,
                            betas=(0.9, 0.95), weight_decay=0.0)  # fmt: skip
    losses = []
    for x, y in _batches(_stream(256, 200000, 0), 2, 16, steps, 0):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert got == pytest.approx(losses[-1], rel=1e-5)
