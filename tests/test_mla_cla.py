"""Cross-layer KV sharing plans and KV-cache bytes per token for MHA / GQA / MLA / MLA+CLA."""

from __future__ import annotations

import pytest

from lmforge.model.cla import (
    kv_bytes_per_token,
    kv_cache_index,
    kv_cache_layers,
    kv_producer_layers,
    kv_source_layer,
)
from lmforge.utils.errors import LmforgeError


def test_sharing_plan() -> None:
    assert kv_producer_layers(7, 1) == list(range(7))
    assert kv_producer_layers(7, 3) == [0, 3, 6]
    assert [kv_source_layer(i, 3) for i in range(7)] == [0, 0, 0, 3, 3, 3, 6]
    assert [kv_cache_index(i, 2) for i in range(5)] == [0, 0, 1, 1, 2]
    assert kv_cache_layers(7, 3) == 3 == len(kv_producer_layers(7, 3))
    # every layer's cache index is its source's, and sources are producers
    for k in (1, 2, 3, 4):
        for i in range(9):
            src = kv_source_layer(i, k)
            assert src in kv_producer_layers(9, k)
            assert kv_cache_index(i, k) == kv_producer_layers(9, k).index(src)


def test_bytes_per_token_deepseek_like() -> None:
    """DeepSeek-V2-Lite's attention widths (d 2048, 16 heads of 128, C 512, R 64), 24 layers,
    bf16: MLA caches 576 values per layer, 1/7 of MHA; against GQA with 4 kv-heads (groups of 4)
    it is 9/16, and MLA + CLA-2 / CLA-3 brings it to 9/32 / 3/16."""
    base = {"n_layers": 24, "n_heads": 16, "head_dim": 128}
    mha = kv_bytes_per_token("mha", **base)
    gqa4 = kv_bytes_per_token("gqa", n_kv_heads=4, **base)
    mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, n_layers=24)
    m = kv_bytes_per_token("mla", **mla)
    assert mha == 24 * 2 * 16 * 128 * 2 and gqa4 == mha // 4
    assert m == 24 * 576 * 2
    assert m / mha == pytest.approx(576 / 4096)
    assert m / gqa4 == pytest.approx(9 / 16)
    assert kv_bytes_per_token("mla", kv_share_every=2, **mla) / gqa4 == pytest.approx(9 / 32)
    assert kv_bytes_per_token("mla", kv_share_every=3, **mla) <= gqa4 / 4


def test_mla_at_most_a_quarter_of_gqa4_at_equal_width() -> None:
    """The 9/H rule: with DeepSeek's C = 4E, R = E/2, MLA is (4.5E) / (2·(H/4)·E) of the GQA cache
    with groups of 4 at the same width (H heads of E): at most 1/4 from 36 heads on (DeepSeek-V2:
    128 heads -> 9/128); MLA + CLA-2 from 18 heads on."""
    for h in (16, 32, 36, 64, 128):
        e = 128
        gqa4 = kv_bytes_per_token("gqa", n_layers=4, n_heads=h, head_dim=e, n_kv_heads=h // 4)
        mla = kv_bytes_per_token("mla", n_layers=4, kv_lora_rank=4 * e, qk_rope_head_dim=e // 2)
        cla2 = kv_bytes_per_token(
            "mla", n_layers=4, kv_lora_rank=4 * e, qk_rope_head_dim=e // 2, kv_share_every=2
        )
        assert mla / gqa4 == pytest.approx(9 / h)
        assert (mla <= gqa4 / 4) == (h >= 36)
        assert (cla2 <= gqa4 / 4) == (h >= 18)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"attention": "mqa", "n_layers": 2}, "mha, gqa or mla"),
        ({"attention": "mla", "n_layers": 2}, "kv_lora_rank"),
        ({"attention": "gqa", "n_layers": 2, "n_heads": 4, "head_dim": 0}, "head_dim"),
        ({"attention": "mha", "n_layers": 2, "n_heads": 4, "head_dim": 8, "kv_share_every": 0},
         "kv_share_every"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(kwargs: dict, needle: str) -> None:
    attention = kwargs.pop("attention")
    with pytest.raises(LmforgeError, match=needle):
        kv_bytes_per_token(attention, **kwargs)


def test_packed_sft_rows_equal_one_by_one() -> None:
    """MLA + CLA under packed SFT's block-diagonal stand-in cache: consumers read the producer's
    latents of the same forward; per-token log-probs and gradients equal the examples' one by
    one."""
    import torch

    from lmforge.model import ModelConfig, TransformerLM
    from test_posttrain_sft import _check_packing, _examples

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, context_length=32, d_model=32, n_layers=3, n_heads=4,
                      attention_type="mla", kv_lora_rank=16, q_lora_rank=0, qk_rope_head_dim=4,
                      qk_nope_head_dim=8, v_head_dim=8, kv_share_every=2)  # fmt: skip
    _check_packing(TransformerLM(cfg), _examples(40, (5, 9, 4, 7, 3)))
