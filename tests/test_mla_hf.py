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
