"""lmforge.model.accounting against independent counts: numel, FlopCounterMode, saved tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from lmforge.model import ModelConfig, TransformerLM, accounting, load_preset

BASE = ModelConfig(
    vocab_size=131, context_length=64, d_model=64, n_layers=2, n_heads=4, attention="reference"
)
VARIANTS = [
    {},
    {"tie_embeddings": True},
    {"n_kv_heads": 2},
    {"n_kv_heads": 1, "qk_norm": True},
    {"qk_norm": True, "tie_embeddings": True, "d_ff": 100},
    {"n_layers": 3, "d_model": 96, "n_heads": 6, "n_kv_heads": 3},
    {"attn_output_gate": True, "qk_norm": True, "n_kv_heads": 2, "rotary_dim": 8},  # Qwen3-Next
]


def _cfg(**kw) -> ModelConfig:
    return dataclasses.replace(BASE, **kw)


@pytest.mark.parametrize("kw", VARIANTS)
def test_parameter_count_is_exact(kw):
    cfg = _cfg(**kw)
    model = TransformerLM(cfg)
    distinct = {id(p): p for p in model.parameters()}
    assert accounting.parameter_count(cfg) == sum(p.numel() for p in distinct.values())
    assert accounting.parameter_count(cfg) == model.num_parameters()
    assert accounting.parameter_count(cfg, exclude_embeddings=True) == model.num_parameters(
        exclude_embeddings=True
    )
    matmul = sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "Linear")
    assert accounting.matmul_parameters(cfg) == matmul


@pytest.mark.parametrize("name", ["gpt2-small", "350m", "1b"])
def test_parameter_count_of_large_presets(name):
    cfg = load_preset(name)
    assert accounting.parameter_count(cfg) == TransformerLM(cfg, device="meta").num_parameters()


def _counted_flops(model: nn.Module, ids: torch.Tensor, backward: bool) -> int:
    with FlopCounterMode(display=False) as counter:
        out = model(ids)
        if backward:
            out.float().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("kw", VARIANTS)
@pytest.mark.parametrize("backward", [False, True])
def test_matmul_flops_match_flop_counter(kw, backward):
    cfg = _cfg(**kw)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    b, t = 2, 24
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    expected = accounting.flops_per_token(cfg, t, backward=backward) * b * t
    assert _counted_flops(model, ids, backward) == pytest.approx(expected, rel=1e-9)


def test_flops_breakdown_components_and_6n_rule():
    cfg = load_preset("gpt2-small")
    t = 1024
    parts = accounting.flops_breakdown(cfg, t)
    assert tuple(parts) == accounting.FLOP_COMPONENTS
    assert parts["embedding"] == 0
    assert parts["lm_head"] == 2 * cfg.d_model * cfg.vocab_size
    assert parts["attn_scores"] == parts["attn_values"] == 2 * 12 * 768 * t
    n = accounting.matmul_parameters(cfg)
    layers, h, e = cfg.n_layers, cfg.n_heads, cfg.head_dim
    total = accounting.flops_per_token(cfg, t)
    assert total == pytest.approx(6 * n + 12 * layers * h * e * t, rel=1e-12)
    assert accounting.flops_per_token(cfg, t, backward=False) == pytest.approx(total / 3)
    causal = accounting.flops_per_token(cfg, t, causal=True)
    assert total - causal == pytest.approx(6 * layers * h * e * t)
    # Tying does not change the arithmetic: the LM head still multiplies.
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    assert accounting.flops_per_token(tied, t) == total


def test_model_flops_utilization():
    cfg = load_preset("gpt2-small")
    fpt = accounting.flops_per_token(cfg, 1024)
    assert accounting.model_flops_utilization(1e5, cfg, 1024, 1e5 * fpt * 2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        accounting.model_flops_utilization(1.0, cfg, 1024, 0.0)


def _saved_activation_bytes(model: nn.Module, ids: torch.Tensor, dtype=None) -> int:
    """Bytes of distinct non-parameter storages autograd saves during one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if dtype is None:
            model(ids)
        else:
            with torch.autocast("cpu", dtype=dtype):
                model(ids)
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "kw",
    [
        {"attention": "reference"},
        {"attention": "sdpa", "n_kv_heads": 2},
        {"attention": "reference", "n_kv_heads": 2, "qk_norm": True},
        {"attention": "reference", "tie_embeddings": True},
    ],
)
def test_activation_memory_matches_saved_tensors(precision, kw):
    cfg = _cfg(**kw)
    model = TransformerLM(cfg)
    b, t = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    measured = _saved_activation_bytes(model, ids, None if precision == "fp32" else torch.bfloat16)
    estimate = accounting.activation_bytes(cfg, b, t, precision, include_loss=False)
    # Masks and position ids are left out of the model: within 1%.
    assert estimate == pytest.approx(measured, rel=0.01)


def test_activation_checkpointing_keeps_only_block_inputs():
    cfg = _cfg(n_layers=4)
    model = TransformerLM(cfg)

    class Checkpointed(nn.Module):
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, x, token_positions=None):
            return checkpoint(self.block, x, token_positions, use_reentrant=False)

    for i, block in enumerate(model.layers):
        model.layers[i] = Checkpointed(block)
    b, t = 2, 32
    measured = _saved_activation_bytes(model, torch.randint(0, cfg.vocab_size, (b, t)))
    with_ckpt = accounting.activation_bytes(cfg, b, t, "fp32", True, include_loss=False)
    without = accounting.activation_bytes(cfg, b, t, "fp32", False, include_loss=False)
    # The estimate adds one block's activations, alive while that block is recomputed.
    fewer = dataclasses.replace(cfg, n_layers=cfg.n_layers - 1)
    one_block = without - accounting.activation_bytes(fewer, b, t, "fp32", include_loss=False)
    assert with_ckpt - one_block == pytest.approx(measured, rel=0.01)
    assert with_ckpt < without


def test_memory_estimate_parts():
    cfg = load_preset("gpt2-small")
    n = accounting.parameter_count(cfg)
    est = accounting.memory_estimate(cfg, batch_size=8, seq_len=1024, precision="bf16")
    assert est.parameters == est.gradients == 4 * n
    assert est.optimizer == 8 * n
    assert est.total == est.parameters + est.gradients + est.optimizer + est.activations
    ckpt = accounting.memory_estimate(cfg, 8, 1024, "bf16", activation_checkpointing=True)
    assert ckpt.activations < est.activations / 2
    no_loss = accounting.activation_bytes(cfg, 8, 1024, "bf16", include_loss=False)
    no_loss_ckpt = accounting.activation_bytes(cfg, 8, 1024, "bf16", True, include_loss=False)
    assert no_loss_ckpt < no_loss / 4
    # The full-logit loss keeps V fp32 log-probabilities per token.
    assert est.activations - no_loss == 4 * cfg.vocab_size * 8 * 1024
    ref = accounting.memory_estimate(cfg, 8, 1024, "bf16", fused_attention=False)
    assert ref.activations > est.activations  # the T×T scores are stored
    # Activations scale linearly in the batch.
    half = accounting.activation_bytes(cfg, 4, 1024, "bf16", include_loss=True)
    full = accounting.activation_bytes(cfg, 8, 1024, "bf16", include_loss=True)
    weights = full - 2 * (full - half)
    assert full - weights == pytest.approx(2 * (half - weights), rel=1e-6)


def test_activation_memory_with_full_logit_loss():
    cfg = _cfg(attention="sdpa")
    model = TransformerLM(cfg)
    b, t = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (b, t))

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x):
            logits = self.model(x)
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())

    measured = _saved_activation_bytes(WithLoss(), ids)
    estimate = accounting.activation_bytes(cfg, b, t, "fp32", include_loss=True)
    assert estimate == pytest.approx(measured, rel=0.01)


@pytest.mark.gpu
def test_activation_memory_matches_saved_tensors_on_cuda():
    cfg = ModelConfig(
        vocab_size=1000, context_length=256, d_model=256, n_layers=2, n_heads=4, attention="sdpa"
    )
    model = TransformerLM(cfg, device="cuda")
    b, t = 4, 256
    ids = torch.randint(0, cfg.vocab_size, (b, t), device="cuda")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.untyped_storage().data_ptr() not in params:
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(ids)
    estimate = accounting.activation_bytes(cfg, b, t, "bf16", include_loss=False)
    assert estimate == pytest.approx(sum(seen.values()), rel=0.1)


def test_one_device_memory_figures_are_unchanged_and_sharding_divides_them():
    # The one memory model keeps the previous one-device figures (pinned from before the
    # planner moved onto it) and applies the Sharding factors on top.
    cfg = load_preset("gpt2-small")
    est = accounting.memory_estimate(cfg, 8, 1024, "bf16")
    assert est.total == 9_149_165_568
    n = accounting.parameter_count(cfg)
    z3 = accounting.memory_estimate(
        cfg, 8, 1024, "bf16", sharding=accounting.Sharding(dp=4, zero=3)
    )
    assert (z3.parameters, z3.gradients, z3.optimizer) == (n, n, 2 * n)
    assert z3.activations == est.activations  # ZeRO shards state, not activations
    mw = accounting.memory_estimate(cfg, 8, 1024, "bf16", master_weights=True)
    assert (mw.parameters, mw.gradients, mw.optimizer) == (2 * n, 2 * n, 12 * n)
    tp2 = accounting.activation_bytes(cfg, 8, 1024, "bf16", sharding=accounting.Sharding(tp=2))
    assert est.activations / 2 < tp2 < est.activations


@pytest.mark.parametrize("kw", [{"attention": "sdpa"}, {"attention": "reference", "n_kv_heads": 2}])
def test_master_weight_activations_match_saved_tensors(kw):
    # The planner's layout (bf16 matmul weights, fp32 masters in the optimizer): autograd saves
    # no weight copies, the residual stream stays fp32; measured against the saved tensors.
    from lmforge.train.wrap import bf16_weight_copies

    cfg = _cfg(**kw)
    model = TransformerLM(cfg)
    assert bf16_weight_copies(model)
    b, t = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    measured = _saved_activation_bytes(model, ids, torch.bfloat16)
    estimate = accounting.activation_bytes(
        cfg, b, t, "bf16", include_loss=False, master_weights=True
    )
    assert estimate == pytest.approx(measured, rel=0.01)
    with_copies = accounting.activation_bytes(cfg, b, t, "bf16", include_loss=False)
    assert with_copies - estimate == 2 * accounting.matmul_parameters(cfg)


def test_deepseek_shaped_model_counts_exactly() -> None:
    """MLA + DeepSeek MoE (a dense first layer, groups) + an MTP module whose block is MoE:
    parameters exact; the MTP FLOPs count that block's active experts, not a dense FFN."""
    import tomllib
    from pathlib import Path

    from lmforge.model import MoEConfig

    raw = tomllib.loads((Path(__file__).parents[1] / "configs/deepseek-tiny.toml").read_text())
    kw = dict(raw["model"])
    cfg = ModelConfig(**{**kw, "moe": MoEConfig(**kw["moe"])})
    assert accounting.parameter_count(cfg) == TransformerLM(cfg, device="meta").num_parameters()
    dense_mtp = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, first_dense_layers=0))
    # every layer MoE now, the MTP block included: the MTP term must not change
    t = 64
    mtp = accounting.flops_breakdown(cfg, t)["mtp"]
    assert mtp == accounting.flops_breakdown(dense_mtp, t)["mtp"] > 0
