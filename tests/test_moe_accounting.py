"""MoE accounting: total vs active parameters against the model, active FLOPs against
FlopCounterMode (reference expert loop), MFU on active FLOPs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lmforge.model import ModelConfig, TransformerLM, accounting
from lmforge.model.moe_config import MoEConfig

BASE = ModelConfig(
    vocab_size=131, context_length=64, d_model=64, n_layers=4, n_heads=4, attention="reference"
)
VARIANTS = [
    dict(n_experts=4, top_k=2),
    dict(n_experts=8, top_k=3, expert_d_ff=32, n_shared_experts=2),
    dict(n_experts=6, top_k=1, every=2, expert_d_ff=48),
    dict(n_experts=4, top_k=2, routing="token_choice_capacity", capacity_factor=0.5),
    # Qwen3-Next's gated shared expert: the gate is one D → 1 projection per MoE layer
    dict(n_experts=8, top_k=3, expert_d_ff=16, n_shared_experts=2, shared_gate=True),
]


def _cfg(**moe) -> ModelConfig:
    return dataclasses.replace(BASE, moe=MoEConfig(backend="reference", **moe))


@pytest.mark.parametrize("moe", VARIANTS)
def test_total_and_active_parameters(moe) -> None:
    cfg = _cfg(**moe)
    model = TransformerLM(cfg, device="meta")
    assert accounting.parameter_count(cfg) == model.num_parameters()
    mc, d, f = cfg.moe, cfg.d_model, cfg.expert_dim
    n_moe = sum(mc.is_moe_layer(i) for i in range(cfg.n_layers))
    skipped = n_moe * (mc.n_experts - mc.top_k) * 3 * d * f
    assert accounting.active_parameter_count(cfg) == model.num_parameters() - skipped
    dense = dataclasses.replace(BASE)
    assert accounting.active_parameter_count(dense) == accounting.parameter_count(dense)


@pytest.mark.parametrize("moe", VARIANTS)
@pytest.mark.parametrize("backward", [False, True])
def test_active_flops_match_flop_counter(moe, backward) -> None:
    cfg = _cfg(**moe)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    b, t = 2, 24
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    with FlopCounterMode(display=False) as counter:
        out = model(ids)
        if backward:
            out.sum().backward()
    expected = accounting.flops_per_token(cfg, t, backward=backward) * b * t
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-9)


def test_mfu_uses_active_flops() -> None:
    cfg = _cfg(n_experts=8, top_k=2)
    dense_same_active = dataclasses.replace(BASE, d_ff=2 * cfg.ffn_dim)
    # 2 of 8 full-width experts per token plus the router: the FLOPs of a 2×-wide dense FFN
    # plus 2·D·N per layer.
    router = 2 * 3 * cfg.n_layers * cfg.d_model * 8
    a = accounting.flops_per_token(cfg, 32)
    b = accounting.flops_per_token(dense_same_active, 32)
    assert a - b == pytest.approx(router)
    assert accounting.model_flops_utilization(1e6, cfg, 32, 1e15) == pytest.approx(a * 1e6 / 1e15)
