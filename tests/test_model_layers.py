"""Each building block of lmforge.model against an independent torch computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.model import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    default_d_ff,
    scaled_dot_product_attention,
    silu,
    softmax,
)


def test_linear_matches_functional_and_shape():
    torch.manual_seed(0)
    lin = Linear(16, 24)
    assert lin.weight.shape == (24, 16)
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-6, atol=1e-6)


def test_linear_init_statistics():
    torch.manual_seed(0)
    lin = Linear(256, 512)
    sigma = math.sqrt(2 / (256 + 512))
    w = lin.weight.detach()
    assert abs(w.mean().item()) < 0.02 * sigma * 10
    # A normal truncated at ±3σ has std 0.9866σ.
    assert w.std().item() == pytest.approx(0.9866 * sigma, rel=0.02)
    assert w.abs().max().item() <= 3 * sigma + 1e-7
    assert w.abs().max().item() > 2.5 * sigma  # the tails are really there


def test_embedding_matches_functional_and_init():
    torch.manual_seed(0)
    emb = Embedding(1000, 32)
    ids = torch.randint(0, 1000, (4, 7))
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))
    w = emb.weight.detach()
    assert w.std().item() == pytest.approx(0.9866, rel=0.03)
    assert w.abs().max().item() <= 3.0


def test_rmsnorm_matches_reference_and_keeps_dtype():
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x = torch.randn(4, 9, 32) * 5
    expected = F.rms_norm(x, (32,), norm.weight, eps=1e-6)
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    out = norm(xb)
    assert out.dtype == torch.bfloat16
    # Computed in fp32 from the bf16 input, then rounded once.
    ref = F.rms_norm(xb.float(), (32,), norm.weight, eps=1e-6).bfloat16()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_silu_and_softmax_match_torch():
    x = torch.randn(5, 11)
    torch.testing.assert_close(silu(x), F.silu(x))
    for dim in (0, 1, -1):
        torch.testing.assert_close(softmax(x, dim), torch.softmax(x, dim))


def test_softmax_stable_for_large_inputs():
    x = torch.randn(6, 50) * 1000
    out = softmax(x, dim=-1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.softmax(x, dim=-1))
    torch.testing.assert_close(out.sum(-1), torch.ones(6))


def test_swiglu_matches_formula_and_default_width():
    assert default_d_ff(768) == 2048
    assert default_d_ff(64) == 192
    assert default_d_ff(100) % 64 == 0 and default_d_ff(100) >= 800 / 3
    torch.manual_seed(0)
    ffn = SwiGLU(48)
    assert ffn.d_ff == default_d_ff(48)
    x = torch.randn(2, 3, 48)
    w1, w2, w3 = ffn.w1.weight, ffn.w2.weight, ffn.w3.weight
    expected = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
    torch.testing.assert_close(ffn(x), expected, rtol=1e-5, atol=1e-6)


def _rope_complex(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta-Llama-style RoPE: consecutive pairs as complex numbers times e^{i·pos·θ^(-2i/d)}."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = pos.double()[..., None] * freqs  # (..., T, E/2)
    rot = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)


def test_rope_pair_layout_matches_complex_rotation():
    torch.manual_seed(0)
    rope = RotaryEmbedding(10000.0, 16, 128)
    x = torch.randn(2, 3, 10, 16)
    pos = torch.arange(5, 15)
    torch.testing.assert_close(rope(x, pos), _rope_complex(x, pos, 10000.0), rtol=1e-5, atol=1e-5)
    # Batched positions (B, 1, T) broadcast over heads.
    pos_b = torch.stack([torch.arange(10), torch.arange(20, 30)])[:, None, :]
    torch.testing.assert_close(
        rope(x, pos_b), _rope_complex(x, pos_b.expand(2, 3, 10), 10000.0), rtol=1e-5, atol=1e-5
    )
    # The first pair rotates by exactly `position` radians (θ^0 = 1).
    e0 = torch.zeros(16)
    e0[0] = 1.0
    out = rope(e0.expand(1, 16), torch.tensor([3]))
    torch.testing.assert_close(out[0, :2], torch.tensor([math.cos(3), math.sin(3)]))


def test_rope_relative_position_property():
    torch.manual_seed(1)
    rope = RotaryEmbedding(10000.0, 32, 256)
    q, k = torch.randn(32), torch.randn(32)

    def score(m: int, n: int) -> float:
        qm = rope(q[None], torch.tensor([m]))[0]
        kn = rope(k[None], torch.tensor([n]))[0]
        return float(qm @ kn)

    for m, n, shift in [(5, 2, 40), (0, 9, 100), (17, 17, 3)]:
        assert score(m, n) == pytest.approx(score(m + shift, n + shift), rel=1e-4, abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


def test_rope_tables_are_fp32_non_persistent_buffers():
    rope = RotaryEmbedding(10000.0, 8, 32)
    assert dict(rope.state_dict()) == {}
    rope = rope.to(torch.bfloat16)
    assert rope.cos.dtype == torch.float32
    x = torch.randn(4, 8).bfloat16()
    assert rope(x, torch.arange(4)).dtype == torch.bfloat16


@pytest.mark.parametrize("leading", [(), (3,), (2, 4)])
def test_sdpa_reference_matches_torch(leading):
    torch.manual_seed(0)
    q = torch.randn(*leading, 7, 16)
    k = torch.randn(*leading, 9, 16)
    v = torch.randn(*leading, 9, 8)
    mask = torch.rand(7, 9) > 0.3
    mask[:, 0] = True  # every query keeps a key
    out = scaled_dot_product_attention(q, k, v, mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v),
        F.scaled_dot_product_attention(q, k, v),
        rtol=1e-5,
        atol=1e-5,
    )
