"""Qwen3-MoE interop: an exported lmforge MoE gives transformers' logits; a random HF Qwen3-MoE
imports with equal logits; options Qwen3-MoE lacks are refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import optional_import
from lmforge.hf import export_model, import_model
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.moe_config import MoEConfig
from lmforge.utils.errors import LmforgeError

transformers = optional_import("transformers")
TOL = 1e-4


def _model(**moe) -> TransformerLM:
    base = dict(n_experts=4, top_k=2, expert_d_ff=32)
    cfg = ModelConfig(
        vocab_size=101,
        context_length=64,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=96,
        qk_norm=True,
        moe=MoEConfig(**{**base, **moe}),
    )
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # non-trivial gains and a router with spread (no near-ties)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            if name.endswith("router.weight"):
                p.normal_(0, 0.5)
    return model


IDS = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "moe", [{}, {"every": 2}, {"norm_top_k": False, "top_k": 1}, {"first_dense_layers": 1}]
)
def test_export_matches_transformers_and_imports_back(tmp_path: Path, moe: dict) -> None:
    model = _model(**moe)
    out = export_model(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        want = model(IDS)
        got = hf(IDS).logits
        assert (got - want).abs().max() < TOL
        back, _ = import_model(out)
        assert back.config.moe == model.config.moe
        assert (back(IDS) - want).abs().max() < TOL


def test_random_hf_qwen3_moe_imports_with_equal_logits(tmp_path: Path) -> None:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        moe_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "mlp.gate" in name:
                p.normal_(0, 0.5)  # HF initialises the router at zero: give it spread
    hf.save_pretrained(tmp_path / "q3m")
    model, _ = import_model(tmp_path / "q3m")
    assert model.config.moe.n_experts == 6 and model.config.expert_dim == 24
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < TOL


@pytest.mark.parametrize(
    "moe, what",
    [
        ({"n_shared_experts": 1}, "n_shared_experts"),
        ({"score": "sigmoid"}, "score"),
        ({"routing": "expert_choice"}, "routing"),
        ({"n_groups": 2}, "n_groups"),
        ({"routed_scale": 2.0}, "routed_scale"),
    ],
)
def test_export_refuses_what_qwen3_moe_lacks(tmp_path: Path, moe: dict, what: str) -> None:
    with pytest.raises(LmforgeError, match=what):
        export_model(_model(**moe), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_mlp_only_layers_other_than_a_prefix_are_refused() -> None:
    from lmforge.hf._moe import moe_from_hf

    hf = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 8}  # fmt: skip
    assert moe_from_hf({**hf, "mlp_only_layers": [0, 1]}, "c").first_dense_layers == 2
    with pytest.raises(LmforgeError, match="mlp_only_layers"):
        moe_from_hf({**hf, "mlp_only_layers": [1]}, "c")


def test_export_refuses_a_nonzero_selection_bias(tmp_path: Path) -> None:
    model = _model()
    model.layers[0].ffn.expert_bias.fill_(0.1)
    with pytest.raises(LmforgeError, match="selection bias"):
        export_model(model, tmp_path / "hf")
