"""transformers' DeepseekV3Attention on a random tiny config vs lmforge's MLA with the mapped
weights: outputs equal (fp32, 1e-5), for interleaved and rotate-half RoPE, low-rank and
full-rank queries; export inverts import; unsupported options are one line."""

from __future__ import annotations

import pytest
import torch

from conftest import optional_import
from lmforge.hf.deepseek import mla_config_from_hf, mla_state_from_hf, mla_state_to_hf
from lmforge.model.mla import MultiHeadLatentAttention
from lmforge.utils.errors import LmforgeError

optional_import("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds  # noqa: E402


def _hf_config(q_lora_rank, interleave):
    cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=24, q_lora_rank=q_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, max_position_embeddings=64, rope_interleave=interleave,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [None, 40])
def test_outputs_equal_transformers(q_lora_rank, interleave) -> None:
    hf_cfg = _hf_config(q_lora_rank, interleave)
    torch.manual_seed(0)
    attn = ds.DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    rope = ds.DeepseekV3RotaryEmbedding(hf_cfg)
    b, t = 2, 9
    x = torch.randn(b, t, hf_cfg.hidden_size)
    pos = torch.arange(t)[None].expand(b, t)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]  # (1, 1, T, T) additive causal
    with torch.no_grad():
        want, _ = attn(x, rope(x, pos), mask)
    cfg = mla_config_from_hf(hf_cfg)
    ours = MultiHeadLatentAttention(cfg).eval()
    hf_state = {"self_attn." + k: v for k, v in attn.state_dict().items()}
    ours.load_state_dict(
        mla_state_from_hf(hf_state, cfg, rope_interleave=interleave, prefix="self_attn.")
    )
    with torch.no_grad():
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)
        got, _ = ours.decode_absorbed(x)  # the absorbed form too
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    back = mla_state_to_hf(ours.state_dict(), cfg, rope_interleave=interleave)
    for k, v in attn.state_dict().items():
        torch.testing.assert_close(back[k], v, atol=0, rtol=0)


def test_unsupported_options_are_one_line() -> None:
    hf = _hf_config(None, True).to_dict()
    with pytest.raises(LmforgeError, match="attention_bias"):
        mla_config_from_hf({**hf, "attention_bias": True})
    yarn = {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0}
    with pytest.raises(LmforgeError, match="yarn"):
        mla_config_from_hf({**hf, "rope_parameters": yarn})
    with pytest.raises(LmforgeError, match="qk_rope_head_dim must be even"):
        mla_config_from_hf({**hf, "qk_rope_head_dim": 7})
    with pytest.raises(LmforgeError, match=r"missing tensor 'q_proj\.weight'"):
        mla_state_from_hf({}, mla_config_from_hf(hf))


# ---- whole models: lmforge hf export / import as DeepseekV3ForCausalLM ----------------------


def _mla_model(**kw):
    from lmforge.model import ModelConfig, TransformerLM

    base = dict(
        vocab_size=101, context_length=64, d_model=64, n_layers=2, n_heads=4, d_ff=96,
        attention_type="mla", kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**{**base, **kw})).eval()
    with torch.no_grad():  # non-trivial norm gains, so a mis-mapped gain would show
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize(
    "kw", [{}, {"q_lora_rank": 40, "tie_embeddings": True}, {"mtp_depth": 2, "rope_theta": 500.0}]
)
def test_whole_model_export_import_logits_equal_transformers(tmp_path, kw) -> None:
    """export -> DeepseekV3ForCausalLM: logits equal (fp32, 1e-5); import back: the same
    model (every tensor, the MTP modules' included, bit-equal); the MTP weights are under
    DeepSeek-V3's names."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lmforge.hf import export_model, import_model

    ours = _mla_model(**kw)
    out = export_model(ours, tmp_path / "hf")
    theirs = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    idx = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx).logits, atol=1e-5, rtol=1e-5)
    back, _ = import_model(out)
    assert back.config == ours.config
    mine = ours.state_dict()
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, mine[k], atol=0, rtol=0)
    names = load_file(str(out / "model.safetensors"))
    for k in range(kw.get("mtp_depth", 0)):
        for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.kv_b_proj"):
            assert f"model.layers.{2 + k}.{part}.weight" in names


def test_import_rotate_half_deepseek(tmp_path) -> None:
    """A DeepseekV3ForCausalLM saved by transformers with rope_interleave=False imports to the
    same logits."""
    from transformers import DeepseekV3ForCausalLM

    from lmforge.hf import import_model

    cfg = _hf_config(40, False)
    cfg.first_k_dense_replace = cfg.num_hidden_layers = 2
    cfg.vocab_size = 64
    torch.manual_seed(0)
    theirs = DeepseekV3ForCausalLM(cfg).eval()
    theirs.save_pretrained(tmp_path)
    ours, _ = import_model(tmp_path)
    idx = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx).logits, atol=1e-5, rtol=1e-5)


def test_whole_model_refusals_are_one_line() -> None:
    from lmforge.hf import hf_config_to_model_config, model_config_to_hf_config
    from lmforge.model import ModelConfig
    from lmforge.model.moe_config import MoEConfig

    hf = _hf_config(None, True).to_dict()
    with pytest.raises(LmforgeError, match="n_groups"):  # MoE maps; 4 experts in 3 groups do not
        hf_config_to_model_config({**hf, "first_k_dense_replace": 0, "n_group": 3})
    mla = dict(d_model=64, n_heads=4, attention_type="mla", kv_lora_rank=24,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)  # fmt: skip
    with pytest.raises(LmforgeError, match="kv_share_every"):
        model_config_to_hf_config(ModelConfig(**mla, kv_share_every=2))
    with pytest.raises(LmforgeError, match=r"moe\.score = 'softmax'"):
        model_config_to_hf_config(ModelConfig(**mla, moe=MoEConfig(n_experts=4, top_k=2)))
