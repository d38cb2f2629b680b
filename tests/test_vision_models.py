"""ViT, text encoder and dual encoder (lmforge.vision.encoders)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmforge.vision.encoders import DualEncoder, TextConfig, TextEncoder, ViT, ViTConfig, patchify

VIT = ViTConfig(image_size=16, patch_size=4, d_model=32, n_layers=2, n_heads=4)
TEXT = TextConfig(context_length=10, d_model=32, n_layers=2, n_heads=4)


def test_patchify_matches_strided_conv() -> None:
    torch.manual_seed(0)
    images = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    weight = torch.randn(8, 3, 4, 4, dtype=torch.float64)
    conv = torch.nn.functional.conv2d(images, weight, stride=4)  # (2, 8, 4, 4)
    ours = patchify(images, 4) @ weight.reshape(8, -1).t()  # (2, 16, 8)
    torch.testing.assert_close(ours, conv.flatten(2).transpose(1, 2))


@pytest.mark.parametrize("pool", ["cls", "attn"])
def test_vit_sdpa_matches_reference_attention(pool: str) -> None:
    torch.manual_seed(0)
    fast = ViT(dataclasses.replace(VIT, pool=pool)).double()
    slow = ViT(dataclasses.replace(VIT, pool=pool, attention="reference")).double()
    slow.load_state_dict(fast.state_dict())
    images = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    (p1, t1), (p2, t2) = fast(images), slow(images)
    assert p1.shape == (3, 32) and t1.shape == (3, 16, 32)
    # lmforge's reference attention takes its softmax in fp32: fp32 tolerances
    torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(t1, t2, rtol=1e-5, atol=1e-6)


def test_text_encoder_pools_at_eos_and_ignores_padding() -> None:
    torch.manual_seed(0)
    enc = TextEncoder(TEXT, vocab_size=20, eos_id=3).double()
    ref = TextEncoder(dataclasses.replace(TEXT, attention="reference"), 20, 3).double()
    ref.load_state_dict(enc.state_dict())
    a = torch.tensor([[2, 7, 8, 3, 0, 0, 0, 0, 0, 0]])
    b = torch.tensor([[2, 7, 8, 3, 9, 9, 11, 5, 0, 1]])  # same up to the EOS, junk after
    torch.testing.assert_close(enc(a), enc(b))
    torch.testing.assert_close(enc(a), ref(a), rtol=1e-5, atol=1e-6)
    c = torch.tensor([[2, 7, 9, 3, 0, 0, 0, 0, 0, 0]])
    assert not torch.allclose(enc(a), enc(c))


def test_dual_encoder_features_are_unit_norm_and_learn() -> None:
    torch.manual_seed(0)
    from lmforge.vision.losses import clip_loss

    model = DualEncoder(VIT, TEXT, vocab_size=20, eos_id=3, embed_dim=16)
    images = torch.randn(4, 3, 16, 16)
    tokens = torch.tensor([[2, 5 + i, 3] + [0] * 7 for i in range(4)])
    img, txt = model(images, tokens)
    assert img.shape == txt.shape == (4, 16)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = clip_loss(*model(images, tokens), model.logit_scale)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first
