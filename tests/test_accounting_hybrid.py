"""Accounting of hybrid layer patterns (``model.layers``): parameter counts against the built
models, FLOPs per layer type against a hand count of one tiny config."""

from __future__ import annotations

import dataclasses

import pytest

from lmforge.model import ModelConfig, TransformerLM, accounting
from lmforge.train.plan import training_plan

TINY = ModelConfig(
    vocab_size=61, context_length=64, d_model=32, n_layers=6, n_heads=4, n_kv_heads=2,
    layers="AWSGML", window=5, dsa_topk=6, dsa_index_heads=2, dsa_index_dim=8, linear_heads=2,
    linear_head_dim=16, ssm_state=16, ssm_head_dim=16, conv_size=4, attention="reference",
)  # fmt: skip

VARIANTS = [
    {},
    {"qk_norm": True, "tie_embeddings": True},
    {"layers": "GGGA", "n_layers": 8, "linear_heads": None, "linear_head_dim": None},
    {"layers": "MMMA", "ssm_expand": 1, "ssm_state": 8, "conv_size": 3},
    {"layers": "LW", "linear_decay": False, "n_kv_heads": 1},
    {"layers": "SAAS", "qk_norm": True, "dsa_index_heads": 3, "dsa_index_dim": 12},
    # grouped value heads (Qwen3-Next): 2 q/k heads of 16, 4 value heads of 8
    {"layers": "GGA", "n_layers": 3, "linear_v_heads": 4, "linear_v_head_dim": 8},
]


@pytest.mark.parametrize("kw", VARIANTS)
def test_hybrid_parameter_counts_equal_the_built_models(kw: dict) -> None:
    cfg = dataclasses.replace(TINY, **kw)
    model = TransformerLM(cfg, device="meta")
    distinct = {id(p): p for p in model.parameters()}
    assert accounting.parameter_count(cfg) == sum(p.numel() for p in distinct.values())
    assert accounting.parameter_count(cfg, exclude_embeddings=True) == model.num_parameters(
        exclude_embeddings=True
    )
    matmul = sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "Linear")
    assert accounting.matmul_parameters(cfg) == matmul
    for block, kind in zip(model.layers, cfg.layer_types):
        qk_norm = 2 * cfg.head_dim if cfg.qk_norm and kind in "AWS" else 0  # counted apart
        mixer = sum(p.numel() for p in block.attn.parameters())
        assert accounting.mixer_parameters(cfg, kind) + qk_norm == mixer, kind


def test_hybrid_flops_equal_a_hand_count() -> None:
    """TINY at T = 24: D 32, H 4 / K 2 × E 8; W window 5; S top-6 with J 2 × E_I 8;
    G and L 2 heads × 16; M inner 64 = 4 heads × 16, state 16; conv width 4; F 128; V 61."""
    t = 24
    got = accounting.flops_breakdown(TINY, t)
    # A, W, S share the projections: q 32→32, k and v 32→16; out 32→32.
    attn_qkv, attn_out = 2 * 32 * (32 + 16 + 16), 2 * 32 * 32
    # G: q k v z 32→32, β and a 32→2, conv over 96 channels × 4; L: q k v 32→32;
    # M: in-proj 32→(64 + 96 + 4), conv over 96 channels × 4.
    g_qkv = 2 * 32 * (4 * 32 + 2 * 2) + 2 * 96 * 4
    l_qkv = 2 * 32 * 96
    m_qkv = 2 * 32 * (64 + 96 + 4) + 2 * 96 * 4
    assert got["qkv"] == 3 * attn_qkv + g_qkv + m_qkv + l_qkv == 38912
    # scores and values: H·E = 32 wide, against 24 (A), 5 (W) and 6 (S) keys.
    assert got["attn_scores"] == got["attn_values"] == 2 * 32 * (24 + 5 + 6) == 2240
    # state: G 6·K·V, M and L 4·K·V per head.
    assert got["state"] == 2 * 6 * 16 * 16 + 4 * 4 * 16 * 16 + 2 * 4 * 16 * 16 == 9216
    # indexer: projections 32→(2·8 + 8 + 2), 16-wide scores and 2 weights against 24 keys.
    assert got["indexer"] == 2 * 32 * 26 + 2 * 2 * 8 * 24 + 2 * 2 * 24 == 2528
    assert got["output_proj"] == 3 * attn_out + 2 * 32 * 32 + 2 * 64 * 32 + 2 * 32 * 32 == 14336
    assert got["ffn"] == 6 * 2 * 3 * 32 * 128 and got["lm_head"] == 2 * 32 * 61
    assert accounting.flops_per_token(TINY, t) == pytest.approx(3 * sum(got.values()))
    causal = accounting.flops_breakdown(TINY, t, causal=True)
    # A halves; a band (W) or a top-k (S) of k keys keeps k − k²/2T per query.
    keys = 12 + (5 - 25 / 48) + (6 - 36 / 48)
    assert causal["attn_scores"] == pytest.approx(2 * 32 * keys)
    assert causal["indexer"] == pytest.approx(2 * 32 * 26 + (2 * 2 * 8 + 2 * 2) * 12)
    assert causal["state"] == got["state"] and causal["qkv"] == got["qkv"]


def test_grouped_value_head_flops_equal_a_hand_count() -> None:
    """G with 2 q/k heads × K 16 and 4 value heads × V 8 (D 32, conv width 4): q, k 32→32,
    v, z 32→32, β and a 32→4, conv over 2·32 + 32 channels; one 16×8 state per value head."""
    cfg = dataclasses.replace(TINY, layers="G", n_layers=1, linear_v_heads=4, linear_v_head_dim=8)
    got = accounting.mixer_flops(cfg, "G", 24)
    assert got["qkv"] == 2 * 32 * (2 * 32 + 2 * 32 + 2 * 4) + 2 * 96 * 4
    assert got["state"] == 6 * 4 * 16 * 8
    assert got["output_proj"] == 2 * 32 * 32


def test_linear_layers_cost_the_same_at_any_length_and_attention_grows() -> None:
    f = {
        kind: [sum(accounting.mixer_flops(TINY, kind, t).values()) for t in (64, 4096)]
        for kind in "AWSGML"
    }
    for kind in "GML":
        assert f[kind][0] == f[kind][1]
    assert f["W"][0] == f["W"][1]  # past the window, a window's cost is constant
    assert f["A"][1] > 50 * f["A"][0] / 2
    assert f["A"][1] > f["S"][1] > f["W"][1]
    with pytest.raises(ValueError, match="unknown layer type"):
        accounting.mixer_flops(TINY, "X", 8)


def test_the_training_plan_reads_the_hybrid_flops() -> None:
    from lmforge.train import TrainConfig

    tc = TrainConfig(batch_size=2, context_length=32, max_steps=1, device="cpu")
    dense = dataclasses.replace(TINY, layers="A")
    hybrid = dataclasses.replace(TINY, layers="GGGA")
    for cfg in (dense, hybrid):
        plan = training_plan(cfg, tc, 1)
        assert plan.flops_per_token == accounting.flops_per_token(cfg, 32)
        assert plan.n_params == accounting.parameter_count(cfg)
    assert training_plan(hybrid, tc, 1).n_params != training_plan(dense, tc, 1).n_params
