"""Kernel references and pure-torch paths on CPU (no Triton needed); Triton kernels run in
``test_kernels_interp.py`` (CPU interpreter, subprocess) and ``test_kernels_gpu.py`` (``-m gpu``).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge import kernels
from lmforge.kernels import (
    FlashAttentionTorch,
    KernelUnsupportedError,
    attention_reference,
    flash_attention,
    flash_supported,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
    rms_norm,
    rms_norm_reference,
)


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int = 1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad(out, inputs, g.to(out.dtype))


def _leaf(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.detach().to(dtype).requires_grad_()


# (B, H, K, T, S, E): GQA, T ≠ S, sizes not multiples of the 64-row tiles.
ATTN_SHAPES = [
    (1, 2, 2, 64, 64, 16),
    (2, 4, 2, 70, 70, 16),
    (1, 3, 1, 130, 130, 8),
    (2, 2, 1, 33, 97, 16),
    (1, 2, 2, 97, 33, 32),
]


@pytest.mark.parametrize("shape", ATTN_SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_torch_matches_float64_reference(shape, causal) -> None:
    b, h, kv, t, s, e = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, t, e, generator=gen, dtype=torch.float64)
    k = torch.randn(b, kv, s, e, generator=gen, dtype=torch.float64)
    v = torch.randn(b, kv, s, e, generator=gen, dtype=torch.float64)
    ref_in = tuple(_leaf(x, torch.float64) for x in (q, k, v))
    ref = attention_reference(*ref_in, is_causal=causal)
    ref_g = _grads(ref, ref_in)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        ins = tuple(_leaf(x, dtype) for x in (q, k, v))
        out = FlashAttentionTorch.apply(*ins, causal)
        assert out.dtype == dtype and out.shape == ref.shape
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        for got, want in zip(_grads(out, ins), ref_g):
            torch.testing.assert_close(got.double(), want, atol=tol * 10, rtol=tol * 10)


@settings(max_examples=12, deadline=None)
@given(
    b=st.integers(1, 2),
    kv=st.integers(1, 2),
    group=st.integers(1, 3),
    t=st.integers(1, 80),
    s=st.integers(1, 80),
    e=st.sampled_from([4, 8, 16]),
    causal=st.booleans(),
    block=st.sampled_from([8, 16, 64]),
)
def test_flash_attention_torch_property(b, kv, group, t, s, e, causal, block) -> None:
    # Any lengths (T ≠ S, not multiples of the tile), group sizes and tile sizes: the tiled
    # online-softmax forward and the recomputing backward equal the naive definition.
    gen = torch.Generator().manual_seed(b * 1000 + t * 10 + s)
    q = torch.randn(b, kv * group, t, e, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv, s, e, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv, s, e, generator=gen, dtype=torch.float64, requires_grad=True)
    old = FlashAttentionTorch.BLOCK
    FlashAttentionTorch.BLOCK = block
    try:
        out = FlashAttentionTorch.apply(q, k, v, causal)
        got = _grads(out, (q, k, v))
    finally:
        FlashAttentionTorch.BLOCK = old
    ref = attention_reference(q, k, v, causal)
    torch.testing.assert_close(out, ref)
    for a, w in zip(got, _grads(ref, (q, k, v))):
        torch.testing.assert_close(a, w)


def test_flash_attention_torch_bf16_and_leading_dims() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 40, 16, generator=gen)  # (H, T, E): 3-D form, heads as leading dim
    k = torch.randn(5, 40, 16, generator=gen)
    v = torch.randn(5, 40, 16, generator=gen)
    ref = attention_reference(q.double(), k.double(), v.double(), True)
    out = flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), True, backend="torch")
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 3e-2
    # 5-D leading dims and 2-D single-head inputs agree with the reference too.
    q5 = torch.randn(2, 3, 2, 20, 16, generator=gen, dtype=torch.float64)
    k5 = torch.randn(2, 3, 1, 20, 16, generator=gen, dtype=torch.float64)
    out5 = flash_attention(q5, k5, k5, False, backend="torch")
    torch.testing.assert_close(out5, attention_reference(q5, k5, k5, False))
    out2 = flash_attention(q5[0, 0, 0], k5[0, 0, 0], k5[0, 0, 0], True, backend="torch")
    torch.testing.assert_close(out2, attention_reference(q5[0, 0, 0], k5[0, 0, 0], k5[0, 0, 0]))


def test_attention_reference_matches_sdpa() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 50, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    for causal in (True, False):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(attention_reference(q, k, v, causal), want)


def test_flash_attention_errors_are_value_errors_naming_the_constraint() -> None:
    q = torch.randn(1, 3, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(KernelUnsupportedError, match="multiple of key/value heads"):
        flash_attention(q, k, k, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        flash_attention(q, q, q, backend="cuda")
    assert not flash_supported(q, q, q)  # CPU tensors outside the interpreter


def test_triton_paths_refuse_cpu_tensors_with_one_clear_error(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(4, 8)
    with pytest.raises(KernelUnsupportedError, match=r"CUDA tensors|'triton' package"):
        rms_norm(x, torch.ones(8))
    with pytest.raises(KernelUnsupportedError, match=r"CUDA tensors|'triton' package"):
        flash_attention(
            torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
        )
    with pytest.raises(KernelUnsupportedError, match=r"CUDA tensors|'triton' package"):
        fused_linear_cross_entropy(x, torch.randn(5, 8), torch.zeros(4, dtype=torch.long),
                                   backend="triton")  # fmt: skip


def test_rms_norm_reference_matches_torch() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 48, generator=gen)
    w = torch.randn(48, generator=gen)
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6), F.rms_norm(x, (48,), w, 1e-6))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_fused_linear_cross_entropy_torch_matches_reference(reduction, z_loss) -> None:
    gen = torch.Generator().manual_seed(6)
    n, d, v = 45, 24, 103
    h = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.5
    t = torch.randint(0, v, (n,), generator=gen)
    t[::4] = -100
    ref_in = (_leaf(h, torch.float64), _leaf(w, torch.float64))
    ref = linear_cross_entropy_reference(*ref_in, t, z_loss=z_loss, reduction=reduction)
    ref_g = _grads(ref, ref_in)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        ins = (_leaf(h, dtype), _leaf(w, dtype))
        loss = fused_linear_cross_entropy(
            *ins, t, z_loss=z_loss, reduction=reduction, backend="torch", chunk_rows=16
        )
        torch.testing.assert_close(loss.double(), ref, atol=tol, rtol=tol)
        for got, want in zip(_grads(loss, ins), ref_g):
            torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_cross_entropy_matches_torch_and_never_builds_full_logits(monkeypatch) -> None:
    from lmforge.kernels import cross_entropy

    seen: list[tuple[int, ...]] = []
    real = cross_entropy._chunk_

    def spy(logits, *args):
        seen.append(tuple(logits.shape))
        return real(logits, *args)

    monkeypatch.setattr(cross_entropy, "_chunk_", spy)
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(2, 50, 32, generator=gen, requires_grad=True)  # (B, T, D) form
    w = torch.randn(300, 32, generator=gen, requires_grad=True)
    t = torch.randint(0, 300, (2, 50), generator=gen)
    loss = fused_linear_cross_entropy(h, w, t, backend="torch", chunk_rows=32)
    loss.backward()
    want = F.cross_entropy((h @ w.T).reshape(-1, 300), t.reshape(-1))
    torch.testing.assert_close(loss, want)
    assert seen and max(s[0] for s in seen) <= 32 and all(s[1] == 300 for s in seen)
    # All targets ignored: "mean" is 0 with zero gradients, not NaN.
    h.grad = None
    t_none = torch.full((2, 50), -100)
    loss0 = fused_linear_cross_entropy(h, w, t_none, backend="torch")
    loss0.backward()
    assert loss0.item() == 0.0 and h.grad.abs().max() == 0
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 300\)"):
        fused_linear_cross_entropy(h, w, torch.full((2, 50), 300), backend="torch")


def test_cross_entropy_scales_by_incoming_gradient_and_skips_frozen_weight() -> None:
    gen = torch.Generator().manual_seed(8)
    h = torch.randn(20, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, generator=gen, dtype=torch.float64)  # frozen
    t = torch.randint(0, 40, (20,), generator=gen)
    (3.0 * fused_linear_cross_entropy(h, w, t, backend="torch")).backward()
    got = h.grad.clone()
    h.grad = None
    (3.0 * linear_cross_entropy_reference(h, w, t)).backward()
    torch.testing.assert_close(got, h.grad)
    with torch.no_grad():
        assert fused_linear_cross_entropy(h, w, t, backend="torch").grad_fn is None


_NO_TRITON = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, Block())
import torch
import lmforge.kernels as K
assert not K.triton_available()
x = torch.randn(1, 2, 8, 16)
assert not K.flash_supported(x, x, x)
out = K.flash_attention(x, x, x, backend="torch")
loss = K.fused_linear_cross_entropy(torch.randn(4, 16), torch.randn(9, 16), torch.arange(4))
try:
    K.rms_norm(x, torch.ones(16))
except K.KernelUnsupportedError as e:
    assert "'triton' package" in str(e)
else:
    raise AssertionError("rms_norm ran without triton")
print("ok")
"""


def test_kernels_work_without_triton_installed() -> None:
    # A subprocess in which `import triton` fails, as on a machine without it.
    done = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_public_api() -> None:
    assert set(kernels.__all__) >= {
        "FlashAttentionTriton",
        "FlashAttentionTorch",
        "flash_attention",
        "flash_supported",
        "rms_norm",
        "rms_norm_reference",
        "fused_linear_cross_entropy",
        "KernelUnsupportedError",
    }
    assert issubclass(KernelUnsupportedError, ValueError)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_without_target_check_matches(reduction) -> None:
    # check_targets=False keeps the mean's divisor on the device (no host sync): same values.
    gen = torch.Generator().manual_seed(8)
    h = torch.randn(37, 16, generator=gen, requires_grad=True)
    w = torch.randn(300, 16, generator=gen, requires_grad=True)
    t = torch.randint(0, 300, (37,), generator=gen)
    t[::5] = -100
    out = []
    for check in (True, False):
        loss = fused_linear_cross_entropy(
            h, w, t, reduction=reduction, backend="torch", chunk_rows=16, check_targets=check
        )
        out.append((loss.detach(), *torch.autograd.grad(loss, (h, w))))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(3, 20, 16), (2, 4, 20, 16), (20, 16)])
def test_flash_attention_torch_saves_the_logsumexp_with_q_leading_dims(shape) -> None:
    # Issue 20 item 7: L comes back shaped like q without its last dim ((batch, queries) for
    # q (batch, queries, d)), and it is the row logsumexp of the scaled scores.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))  # fmt: skip
    out = FlashAttentionTorch.apply(q, k, v, True)
    saved = [t for t in out.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(saved) == 1, [tuple(t.shape) for t in out.grad_fn.saved_tensors]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(shape[-1])
    keep = torch.ones(shape[-2], shape[-2], dtype=torch.bool).tril()
    want = scores.masked_fill(~keep, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(saved[0], want.detach(), rtol=1e-10, atol=1e-10)
    out.sum().backward()  # the backward reads it back in its own layout
    assert q.grad is not None and q.grad.shape == q.shape
