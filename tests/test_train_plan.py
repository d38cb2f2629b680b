"""The derived quantities of a run come from one pure function."""

from __future__ import annotations

from lmforge.model import ModelConfig, TransformerLM
from lmforge.train import TrainConfig, training_plan


def test_plan_counts() -> None:
    mc = ModelConfig(
        vocab_size=512, context_length=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2
    )
    tc = TrainConfig(batch_size=4, grad_accum=3, context_length=32, max_steps=10)
    plan = training_plan(mc, tc, world_size=2)
    assert plan.context_length == 32
    assert plan.tokens_per_step == 4 * 3 * 2 * 32
    assert plan.total_tokens == plan.tokens_per_step * 10
    n = sum(p.numel() for p in TransformerLM(mc).parameters())
    assert plan.n_params == n
    # 6·N_matmul (the embedding lookup is no matmul) plus the attention term 12·L·D·T
    n_matmul = n - 512 * 64 - 64 * (2 * 2 + 1)
    assert plan.flops_per_token == 6 * n_matmul + 12 * 2 * 64 * 32
    assert plan.flops_per_step == plan.flops_per_token * plan.tokens_per_step
    assert plan.total_flops == plan.flops_per_step * 10
    assert training_plan(mc, TrainConfig(context_length=0)).context_length == 64
