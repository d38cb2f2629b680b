"""Triton kernels on a CUDA GPU (``pytest -m gpu tests/test_kernels_gpu.py``).

Each kernel is compared with a float64 reference; the yardstick for low-precision dtypes is the
error of the torch peer (SDPA, ``F.rms_norm``, unfused matmul + cross-entropy) in the same dtype:
ours must be within 2× of it (or under a small absolute floor relative to the values' scale).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fixed_attention_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    # One compile per specialisation instead of an autotuning sweep per shape; the autotuned
    # path has its own test below and is what benchmarks/kernels.py checks and times.
    from lmforge.kernels import _flash_triton

    monkeypatch.setattr(_flash_triton, "AUTOTUNE", False)


FLOOR = {torch.float32: 5e-3, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _assert_like_peer(got, peer, want, dtype, what, grad_scale: float = 1.0) -> None:
    for i, (a, p, w) in enumerate(zip(got, peer, want)):
        scale = max(1.0, w.abs().max().item(), grad_scale if i else 1.0)
        e, pe = _err(a, w), _err(p, w)
        assert e <= max(2 * pe, FLOOR[dtype] * scale), f"{what}[{i}]: {e:.3g} vs peer {pe:.3g}"


def _attention_case(b, h, kv, t, s, e, causal, dtype, layout="bhte", window=None):
    from lmforge.kernels import attention_reference, flash_attention

    gen = torch.Generator(device="cuda").manual_seed(t * 7 + e)
    if layout == "bthe":  # the model's layout: (B, T, H, E) transposed, head dim contiguous
        q = torch.randn(b, t, h, e, device="cuda", generator=gen, dtype=dtype).transpose(1, 2)
        k = torch.randn(b, s, kv, e, device="cuda", generator=gen, dtype=dtype).transpose(1, 2)
        v = torch.randn(b, s, kv, e, device="cuda", generator=gen, dtype=dtype).transpose(1, 2)
    else:
        q = torch.randn(b, h, t, e, device="cuda", generator=gen, dtype=dtype)
        k = torch.randn(b, kv, s, e, device="cuda", generator=gen, dtype=dtype)
        v = torch.randn(b, kv, s, e, device="cuda", generator=gen, dtype=dtype)
    do = torch.randn(b, h, t, e, device="cuda", generator=gen, dtype=dtype)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = attention_reference(*ref_in, is_causal=causal, window=window)
    want = [ref, *torch.autograd.grad(ref, ref_in, do.double())]
    ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if layout == "bthe":
        ins = [x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k, v)]  # fmt: skip
        assert ins[0].stride(-1) == 1 and not ins[0].is_contiguous()
    out = flash_attention(*ins, is_causal=causal, window=window)
    assert out.shape == q.shape and out.dtype == dtype
    got = [out, *torch.autograd.grad(out, ins, do)]
    p_in = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    group = h // kv
    mask = None  # the peer: SDPA with the window as an explicit mask
    if window is not None:
        d = torch.arange(t, device="cuda")[:, None] - torch.arange(s, device="cuda")[None, :]
        mask = (d >= 0) & (d < window)
    po = F.scaled_dot_product_attention(
        p_in[0], p_in[1].repeat_interleave(group, 1), p_in[2].repeat_interleave(group, 1),
        attn_mask=mask, is_causal=causal and mask is None,
    )  # fmt: skip
    peer = [po, *torch.autograd.grad(po, p_in, do)]
    for a, p in zip(got[1:], ins):
        assert a.shape == p.shape and a.dtype == dtype
    grad_scale = 1.0
    if dtype == torch.float32 and window == 1:
        # fp32 runs TF32 dots (documented in flash_attention.py). With a window of 1 every row's
        # softmax has one entry, so dS = P (dP - D) cancels to exactly 0 and dq, dk are 0: their
        # error is TF32's on the terms that cancel, scale · |dO·V| · |K| (or |Q|), not on 0.
        dp = (do.double() * v.double().repeat_interleave(group, 1)).sum(-1).abs().max().item()
        grad_scale = e**-0.5 * dp * max(q.abs().max().item(), k.abs().max().item())
    what = f"attention {dtype} {(b, h, kv, t, s, e, causal)}"
    _assert_like_peer(got, peer, want, dtype, what, grad_scale)


@pytest.mark.parametrize("e", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 4, 4, 256), (1, 8, 2, 1000), (3, 2, 1, 129), (1, 2, 2, 1)])
def test_flash_attention_gpu_bf16(e, causal, shape) -> None:
    b, h, kv, t = shape
    _attention_case(b, h, kv, t, t, e, causal, torch.bfloat16)


@pytest.mark.parametrize("e, window", [(64, 1), (128, 100), (128, 256), (64, 700)])
def test_flash_attention_gpu_sliding_window(e, window) -> None:
    """The W layers' kernel: the window inside a tile, across tiles, a tile multiple, wide."""
    _attention_case(2, 8, 2, 1000, 1000, e, True, torch.bfloat16, window=window)
    _attention_case(1, 4, 4, 777, 777, e, True, torch.float32, window=window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_gpu_fp16_fp32(dtype, causal) -> None:
    _attention_case(1, 8, 2, 1000, 1000, 64, causal, dtype)


def test_flash_attention_gpu_autotuned(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmforge.kernels import _flash_triton

    monkeypatch.setattr(_flash_triton, "AUTOTUNE", True)
    _attention_case(2, 8, 2, 1000, 1000, 128, True, torch.bfloat16)
    assert _flash_triton.tuned_kernels()


@pytest.mark.parametrize("e", [16, 32, 256])
def test_flash_attention_gpu_other_head_dims(e) -> None:
    _attention_case(1, 4, 2, 333, 333, e, True, torch.bfloat16)


def test_flash_attention_gpu_strided_layout_and_unequal_lengths() -> None:
    _attention_case(2, 4, 2, 300, 300, 64, True, torch.bfloat16, layout="bthe")
    _attention_case(1, 2, 1, 100, 517, 64, False, torch.bfloat16)
    _attention_case(1, 2, 1, 517, 100, 128, True, torch.bfloat16)


def test_flash_attention_gpu_never_materialises_scores() -> None:
    from lmforge.kernels import flash_attention

    b, h, t, e = 1, 8, 8192, 64
    q, k, v = (torch.randn(b, h, t, e, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    do = torch.randn_like(q)
    flash_attention(q, k, v)  # compile / autotune outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = flash_attention(q, k, v)
    torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    one = q.numel() * q.element_size()  # 8 MiB; one fp32 T×T score matrix per head is 256 MiB
    assert extra < 8 * one, f"extra peak {extra / 2**20:.1f} MiB"


def test_flash_supported_and_autocast_on_gpu() -> None:
    from lmforge.kernels import KernelUnsupportedError, flash_attention, flash_supported

    x = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    assert flash_supported(x, x, x)
    odd = torch.randn(1, 2, 64, 96, device="cuda", dtype=torch.bfloat16)
    assert not flash_supported(odd, odd, odd)
    with pytest.raises(KernelUnsupportedError, match="head dim 96"):
        flash_attention(odd, odd, odd)
    f64 = x.double()
    assert not flash_supported(f64, f64, f64)
    q32 = torch.randn(1, 2, 64, 64, device="cuda")  # fp32 q/k (after RoPE) with bf16 v
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert flash_supported(q32, q32, q32.bfloat16())
        out = flash_attention(q32, q32, q32.bfloat16())
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(4099, 1000), (3, 7, 4096), (16, 8192), (5, 64)])
def test_rms_norm_gpu(dtype, shape) -> None:
    from lmforge.kernels import rms_norm, rms_norm_reference

    gen = torch.Generator(device="cuda").manual_seed(1)
    d = shape[-1]
    x = torch.randn(*shape, device="cuda", generator=gen, dtype=dtype) * 2
    w = (torch.rand(d, device="cuda", generator=gen) + 0.5).to(dtype)
    dy = torch.randn(*shape, device="cuda", generator=gen, dtype=dtype)
    ref_in = [x.double().requires_grad_(), w.double().requires_grad_()]
    ref = rms_norm_reference(*ref_in, 1e-5)
    want = [ref, *torch.autograd.grad(ref, ref_in, dy.double())]
    ins = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    y = rms_norm(*ins, 1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    got = [y, *torch.autograd.grad(y, ins, dy)]
    p_in = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    py = F.rms_norm(p_in[0], (d,), p_in[1], 1e-5)
    peer = [py, *torch.autograd.grad(py, p_in, dy)]
    _assert_like_peer(got, peer, want, dtype, f"rms_norm {dtype} {shape}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_fused_linear_cross_entropy_gpu(reduction, z_loss) -> None:
    from lmforge.kernels import fused_linear_cross_entropy, linear_cross_entropy_reference

    gen = torch.Generator(device="cuda").manual_seed(2)
    n, d, v = 1000, 256, 32003
    h = torch.randn(n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(v, d, device="cuda", generator=gen) / math.sqrt(d)).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    t[::9] = -100
    g = torch.rand(n if reduction == "none" else (), device="cuda", generator=gen) + 0.5
    ref_in = [h.double().requires_grad_(), w.double().requires_grad_()]
    ref = linear_cross_entropy_reference(*ref_in, t, z_loss=z_loss, reduction=reduction)
    want = [ref, *torch.autograd.grad(ref, ref_in, g.double())]
    ins = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    loss = fused_linear_cross_entropy(*ins, t, z_loss=z_loss, reduction=reduction)
    got = [loss, *torch.autograd.grad(loss, ins, g)]
    p_in = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    p_loss = linear_cross_entropy_reference(*p_in, t, z_loss=z_loss, reduction=reduction)
    peer = [p_loss, *torch.autograd.grad(p_loss, p_in, g)]
    for a, p, wv in zip(got, peer, want):
        scale = max(1e-3, wv.abs().max().item())
        assert _err(a, wv) <= max(2 * _err(p, wv), 2e-2 * scale)


@pytest.mark.parametrize("v", [1000, 32003, 128256])
def test_cross_entropy_chunk_launches_agree(v) -> None:
    """Every launch config of the chunk kernel (the default for this row length, and the others
    the sweep times) matches float64: loss rows and in-place gradients, ignored rows."""
    from lmforge.kernels import _cross_entropy_triton as k

    gen = torch.Generator(device="cuda").manual_seed(5)
    n = 300
    z = (torch.randn(n, v, device="cuda", generator=gen) * 3).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    t[::7] = -100
    t[1] = v - 1  # the target in the last (ragged) column
    scale = torch.rand(n, device="cuda", generator=gen) + 0.5
    scale[3] = -0.7  # a negative scale: multiplied, not folded into the exponent
    z64 = z.double()
    lse = torch.logsumexp(z64, -1)
    valid = t != -100
    safe = torch.where(valid, t, 0)
    want_loss = torch.where(valid, lse - z64.gather(1, safe[:, None])[:, 0], 0)
    want_g = torch.softmax(z64, -1)
    want_g[torch.arange(n), safe] -= 1
    want_g *= (scale.double() * valid)[:, None]
    for block, warps, programs in [
        (None, None, None), (8192, 16, None), (16384, 32, None), (32768, 32, None),
        (4096, 8, None), (8192, 16, 64), (None, None, 7),
    ]:  # fmt: skip
        a, la = z.clone(), torch.empty(n, device="cuda")
        k.loss_and_grad_(
            a, t, scale, -100, 0.0, True, la, block=block, num_warps=warps, programs=programs
        )
        torch.testing.assert_close(la.double(), want_loss, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(a.double(), want_g, rtol=0.02, atol=2e-3)


def test_fused_linear_cross_entropy_gpu_memory_and_autocast() -> None:
    from lmforge.kernels import fused_linear_cross_entropy
    from lmforge.kernels.cross_entropy import default_chunk_rows

    n, d, v = 8192, 1024, 128256
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, d, device="cuda") / 32).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    fused_linear_cross_entropy(h, w, t)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fused_linear_cross_entropy(h, w, t)
    dh, dw = torch.autograd.grad(loss, (h, w))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # What the algorithm holds beyond its inputs: dh and dW (computed in the forward, scaled in
    # place by the backward) and one chunk of logits, all bf16: 16 + 250.5 + 31.3 = 297.8 MiB.
    # Scaling copies of dh and dW in backward (commit de3fe48) measured 533 MiB here.
    parts = {"dh": dh.numel() * 2, "dW": dw.numel() * 2,
             "chunk": default_chunk_rows(n, d, v) * v * 2}  # fmt: skip
    figure = sum(parts.values())
    budget = figure + (16 << 20)  # + small temporaries (the (N,) loss rows, target checks)
    print(
        f"\nfused linear+CE {n}x{d}->{v} bf16: extra {extra / 2**20:.1f} MiB measured, "
        f"{figure / 2**20:.1f} MiB computed ("
        + " + ".join(f"{k} {x / 2**20:.1f}" for k, x in parts.items())
        + f"), budget {budget / 2**20:.1f} MiB"
    )
    assert extra <= budget, f"extra {extra / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"
    assert extra < n * v * 2 / 4  # far below one bf16 copy of the full logits
    # Under autocast, fp32 master weights and fp32 hidden states run the bf16 path.
    h32 = torch.randn(64, 128, device="cuda", requires_grad=True)
    w32 = torch.randn(1000, 128, device="cuda", requires_grad=True)
    t32 = torch.randint(0, 1000, (64,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss32 = fused_linear_cross_entropy(h32, w32, t32)
    loss32.backward()
    assert h32.grad.dtype == torch.float32 and w32.grad.dtype == torch.float32
    want = F.cross_entropy(h32.detach() @ w32.detach().T, t32)
    assert abs(loss32.item() - want.item()) < 5e-2 * max(1.0, want.item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_and_rope_gpu(dtype) -> None:
    from lmforge.kernels import rope, rope_reference, swiglu, swiglu_reference
    from lmforge.model import RotaryEmbedding

    gen = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(4, 1000, 2731, device="cuda", generator=gen, dtype=dtype) * 3
    b = torch.randn(4, 1000, 2731, device="cuda", generator=gen, dtype=dtype)
    ins = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    ref_in = [a.double().requires_grad_(), b.double().requires_grad_()]
    y, ref = swiglu(*ins), swiglu_reference(*ref_in)
    g = torch.randn_like(y)
    got = [y, *torch.autograd.grad(y, ins, g)]
    want = [ref, *torch.autograd.grad(ref, ref_in, g.double())]
    p_in = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    py = F.silu(p_in[0]) * p_in[1]
    peer = [py, *torch.autograd.grad(py, p_in, g)]
    _assert_like_peer(got, peer, want, dtype, "swiglu")
    # The packed gate on [a | b] (F = 2731: ragged against its 2048-column block).
    from lmforge.kernels import swiglu_packed, swiglu_packed_reference

    ab = torch.cat([a, b], -1)
    abt, abr, abp = (ab.clone().requires_grad_(), ab.double().requires_grad_(),
                     ab.clone().requires_grad_())  # fmt: skip
    y, ref = swiglu_packed(abt), swiglu_packed_reference(abr)
    got = [y, *torch.autograd.grad(y, (abt,), g)]
    want = [ref, *torch.autograd.grad(ref, (abr,), g.double())]
    pa, pb = abp.chunk(2, -1)
    py = F.silu(pa) * pb
    peer = [py, *torch.autograd.grad(py, (abp,), g)]
    _assert_like_peer(got, peer, want, dtype, "swiglu_packed")
    layer = RotaryEmbedding(10000.0, 128, 4096, device="cuda")
    x = torch.randn(2, 8, 1000, 128, device="cuda", generator=gen, dtype=dtype)
    cos, sin = layer.cos[:1000], layer.sin[:1000]
    xt, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    y, ref = rope(xt, cos, sin), rope_reference(xr, cos, sin)
    g = torch.randn_like(y)
    got = [y, *torch.autograd.grad(y, (xt,), g)]
    want = [ref, *torch.autograd.grad(ref, (xr,), g.double())]
    xp = x.clone().requires_grad_()
    py = layer(xp, torch.arange(1000, device="cuda"))
    peer = [py, *torch.autograd.grad(py, (xp,), g)]
    _assert_like_peer(got, peer, want, dtype, "rope")
    # (B, T, H, E), positions on the third-last axis: the head-transposed rotation's values.
    xh = x.transpose(1, 2).contiguous().requires_grad_()  # (2, 1000, 8, 128)
    yh = rope(xh, cos, sin, seq_dim=-3)
    torch.testing.assert_close(yh.transpose(1, 2), y.detach(), rtol=0, atol=0)
    (gh,) = torch.autograd.grad(yh, (xh,), g.transpose(1, 2))
    torch.testing.assert_close(gh.transpose(1, 2), got[1], rtol=0, atol=0)
    from lmforge.kernels import _elementwise_triton as ew

    for cfg in [(8192, 8), (4096, 4), (1024, 2)]:  # rope_bench.py's sweep
        yc = ew.rope(xh.detach(), cos.float(), sin.float(), False, 8, config=cfg)
        torch.testing.assert_close(yc, yh.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_packed_gpu(dtype, monkeypatch) -> None:
    # q and k of one (B, T, (Hq + Hk)·E) GEMM output: bit-identical to the one-tensor kernel on
    # each half (the same rotation), gradient included; and against float64. Then the launches
    # (per-row, token-block default, other token blocks / head groups / warps: other layouts,
    # where the compiler once fused other products) against each other, bit for bit, split and
    # join, both signs, on full and ragged shapes (E = 128; E = 48 with 3 + 1 heads; (T,) alone).
    from lmforge.kernels import rope, rope_packed, rope_packed_reference
    from lmforge.model import RotaryEmbedding

    gen = torch.Generator(device="cuda").manual_seed(6)
    hq, hk, e, t = 12, 4, 64, 1000
    layer = RotaryEmbedding(10000.0, e, 4096, device="cuda")
    cos, sin = layer.cos[:t], layer.sin[:t]
    qk = torch.randn(3, t, (hq + hk) * e, device="cuda", generator=gen, dtype=dtype)
    qkt, qkr = qk.clone().requires_grad_(), qk.double().requires_grad_()
    q, k = rope_packed(qkt, cos, sin, hq, hk)
    qr, kr = rope_packed_reference(qkr, cos, sin, hq, hk)
    split = qk.unflatten(-1, (hq + hk, e))
    q1 = split[:, :, :hq].contiguous().requires_grad_()
    k1 = split[:, :, hq:].contiguous().requires_grad_()
    yq, yk = rope(q1, cos, sin, seq_dim=-3), rope(k1, cos, sin, seq_dim=-3)
    torch.testing.assert_close(q, yq, rtol=0, atol=0)
    torch.testing.assert_close(k, yk, rtol=0, atol=0)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    (dqk,) = torch.autograd.grad((q * gq).sum() + (k * gk).sum(), (qkt,))
    dq1, dk1 = torch.autograd.grad((yq * gq).sum() + (yk * gk).sum(), (q1, k1))
    torch.testing.assert_close(dqk, torch.cat([dq1.flatten(2), dk1.flatten(2)], -1), rtol=0, atol=0)
    (dref,) = torch.autograd.grad((qr * gq.double()).sum() + (kr * gk.double()).sum(), (qkr,))
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(q.double(), qr, rtol=tol, atol=tol)
    torch.testing.assert_close(dqk.double(), dref, rtol=tol, atol=tol)
    from lmforge.kernels import _elementwise_triton as ew

    launches = [(0, 4, 4), (ew.ROPE_PACKED_TOKENS, ew.ROPE_PACKED_HEADS, ew.ROPE_PACKED_WARPS),
                (16, 4, 4), (32, 4, 8), (8, 2, 2), (4, 1, 1)]  # fmt: skip
    shapes = [((3, t), hq, hk, e), ((2, 333), 12, 12, 128), ((77,), 3, 1, 48)]
    for lead, nq, nk, width in shapes:
        tab = RotaryEmbedding(10000.0, width, 4096, device="cuda")
        c, s = tab.cos[: lead[-1]].float(), tab.sin[: lead[-1]].float()
        x = torch.randn(*lead, (nq + nk) * width, device="cuda", generator=gen, dtype=dtype)
        dq = torch.randn(*lead, nq, width, device="cuda", generator=gen, dtype=dtype)
        dk = torch.randn(*lead, nk, width, device="cuda", generator=gen, dtype=dtype)
        outs = []
        for tokens, heads, warps in launches:
            monkeypatch.setattr(ew, "ROPE_PACKED_TOKENS", tokens)
            monkeypatch.setattr(ew, "ROPE_PACKED_HEADS", heads)
            monkeypatch.setattr(ew, "ROPE_PACKED_WARPS", warps)
            got = []
            for inverse in (False, True):  # both signs of the rotation, in both directions
                got += ew.rope_packed(x, None, None, c, s, nq, nk, inverse)
                got.append(ew.rope_packed(None, dq, dk, c, s, nq, nk, not inverse))
            outs.append(got)
        for launch, got in zip(launches[1:], outs[1:]):
            for a, b in zip(got, outs[0]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{launch} {lead} {width}")


def test_flash_attention_triton_saves_the_logsumexp_with_q_leading_dims() -> None:
    # Issue 20 item 7 for the Triton class: L saved as q.shape[:-1], float32.
    import math

    from lmforge.kernels import FlashAttentionTriton

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(3, 64, 32, generator=g, device="cuda", requires_grad=True)
               for _ in range(3))  # fmt: skip
    out = FlashAttentionTriton.apply(q, k, v, True)
    saved = [t for t in out.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(saved) == 1 and saved[0].dtype == torch.float32
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(32)
    keep = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    want = scores.masked_fill(~keep, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(saved[0].double(), want.detach(), rtol=1e-3, atol=1e-3)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
