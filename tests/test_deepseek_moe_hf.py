"""DeepSeek-V3 MoE interop: a random tiny transformers ``DeepseekV3ForCausalLM`` with MoE layers
(group-limited routing, a non-zero score-correction bias, a routed scale, shared experts, a
dense first layer) imports with equal logits (fp32, 1e-5) under both expert backends; an
lmforge MLA + MoE model (MTP modules included) exports to equal transformers logits and imports
back bit-equal; what DeepSeek-V3 cannot represent is refused in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import optional_import
from lmforge.hf import export_model, import_model
from lmforge.model import moe as M
from lmforge.model.moe_config import MoEConfig
from lmforge.utils.errors import LmforgeError

transformers = optional_import("transformers")
V = 64
IDS = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(1))


def _hf_config(**kw) -> object:
    base = dict(
        vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24,
        q_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        max_position_embeddings=64, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
        routed_scaling_factor=1.7, norm_topk_prob=True,
    )  # fmt: skip
    return transformers.DeepseekV3Config(**{**base, **kw})


def _hf_model(**kw):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(_hf_config(**kw)).eval()
    with torch.no_grad():  # HF starts the router near zero and the bias at zero: spread both
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return hf


def _set_backend(model, backend: str) -> None:  # type: ignore[no-untyped-def]
    for layer in M.moe_layers(model):
        layer.backend = backend


@pytest.mark.parametrize("kw", [{}, {"n_shared_experts": 0, "norm_topk_prob": False}])
def test_random_hf_deepseek_moe_imports_with_equal_logits(tmp_path: Path, kw: dict) -> None:
    hf = _hf_model(**kw)
    hf.save_pretrained(tmp_path / "ds")
    model, _ = import_model(tmp_path / "ds")
    mc = model.config.moe
    assert (mc.n_experts, mc.top_k, mc.n_groups, mc.top_groups) == (8, 2, 4, 2)
    assert (mc.first_dense_layers, mc.routed_scale, mc.score) == (1, 1.7, "sigmoid")
    assert mc.n_shared_experts == kw.get("n_shared_experts", 1)
    bias = hf.model.layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(model.layers[2].ffn.expert_bias, bias)
    with torch.no_grad():
        want = hf(IDS).logits
        for backend in ("reference", "grouped"):
            _set_backend(model, backend)
            torch.testing.assert_close(model(IDS), want, atol=1e-5, rtol=1e-5, msg=backend)
        # the group limit and the bias are not no-ops here: dropping either changes the logits
        for change in ({"n_groups": 1, "top_groups": 1}, None):
            other, _ = import_model(tmp_path / "ds")
            if change is None:
                for layer in M.moe_layers(other):
                    layer.expert_bias.zero_()
            else:
                for layer in M.moe_layers(other):
                    layer.config = dataclasses.replace(
                        other.config, moe=dataclasses.replace(mc, **change)
                    )
            assert (other(IDS) - want).abs().max() > 1e-3


def test_in_memory_fused_experts_import(tmp_path: Path) -> None:
    """transformers ≥ 5 holds the experts fused (gate_up_proj (N, 2F, D), down_proj (N, D, F));
    its in-memory state dict maps too."""
    from lmforge.hf.convert import hf_config_to_model_config, hf_to_lmforge_state
    from lmforge.model import TransformerLM

    hf = _hf_model(num_mtp_layers=0)  # the in-memory model has no MTP modules either
    state = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    cfg = hf_config_to_model_config(hf.config.to_dict())
    model = TransformerLM(cfg).eval()
    model.load_state_dict(hf_to_lmforge_state(state, cfg))
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), hf(IDS).logits, atol=1e-5, rtol=1e-5)


def _lmforge_model(mtp_depth: int = 0, **moe):  # type: ignore[no-untyped-def]
    from lmforge.model import ModelConfig, TransformerLM

    base = dict(n_experts=8, top_k=2, expert_d_ff=32, n_shared_experts=1, score="sigmoid",
                n_groups=4, top_groups=2, routed_scale=2.5, first_dense_layers=1)  # fmt: skip
    cfg = ModelConfig(
        vocab_size=101, context_length=64, d_model=64, n_layers=3, n_heads=4, d_ff=96,
        attention_type="mla", kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, norm_eps=1e-6, mtp_depth=mtp_depth, moe=MoEConfig(**{**base, **moe}),
    )  # fmt: skip
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # non-trivial gains, a router with spread, a trained-looking bias
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            if name.endswith("router.weight"):
                p.normal_(0, 0.5)
        for layer in M.moe_layers(model):
            layer.expert_bias.copy_(torch.randn(layer.n_experts) * 0.1)
    return model


@pytest.mark.parametrize(
    "mtp_depth, moe",
    [(0, {}), (2, {}), (0, {"n_shared_experts": 0, "norm_top_k": False, "aux_loss_coef": 0.0})],
)
def test_export_matches_transformers_and_imports_back(tmp_path: Path, mtp_depth, moe) -> None:
    from safetensors.torch import load_file

    ours = _lmforge_model(mtp_depth, **moe)
    out = export_model(ours, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs.eval()(ids).logits, atol=1e-5, rtol=1e-5)
    back, _ = import_model(out)
    assert back.config == ours.config  # the MoE fields survive config.json
    mine = ours.state_dict()
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, mine[k], atol=0, rtol=0, msg=k)
    names = load_file(str(out / "model.safetensors"))
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense first layer
    for k in range(mtp_depth):  # MTP modules are MoE blocks under DeepSeek-V3's names
        pre = f"model.layers.{3 + k}.mlp."
        for part in ("gate.weight", "gate.e_score_correction_bias", "experts.7.down_proj.weight",
                     "shared_experts.gate_proj.weight"):  # fmt: skip
            assert pre + part in names


def test_hf_config_refusals_are_one_line() -> None:
    from lmforge.hf import hf_config_to_model_config

    hf = _hf_config().to_dict()
    for change, what in (
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"n_group": 3}, "n_groups"),
        ({"topk_group": 5}, "top_groups"),
        ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ):
        with pytest.raises(LmforgeError, match=what) as e:
            hf_config_to_model_config({**hf, **change})
        assert "\n" not in str(e.value)
    dense = hf_config_to_model_config({**hf, "first_k_dense_replace": 3})  # no MoE layer left
    assert not dense.moe.enabled


@pytest.mark.parametrize(
    "moe, what",
    [
        ({"score": "softmax"}, "score"),
        ({"routing": "token_choice_capacity"}, "routing"),
        ({"every": 2, "first_dense_layers": 0}, "every"),
        ({"n_groups": 1, "top_groups": 1, "n_experts": 1, "top_k": 1}, "2 experts per group"),
        ({"first_dense_layers": 3}, "MTP"),
        ({"shared_gate": True}, "shared_gate"),  # Qwen3-Next's gate: DeepSeek-V3 has none
    ],
)
def test_export_refusals_are_one_line(tmp_path: Path, moe: dict, what: str) -> None:
    with pytest.raises(LmforgeError, match=what) as e:
        export_model(_lmforge_model(1, **moe), tmp_path / "hf")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists()
