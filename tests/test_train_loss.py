"""cross_entropy against F.cross_entropy, with huge logits, ignore_index and z-loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmforge.train import cross_entropy


def _data(scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = scale * torch.randn(2, 5, 11, generator=g)  # (B, T, V)
    targets = torch.randint(0, 11, (2, 5), generator=g)  # (B, T)
    return logits, targets


def test_matches_torch() -> None:
    logits, targets = _data()
    torch.testing.assert_close(
        cross_entropy(logits, targets), F.cross_entropy(logits.view(-1, 11), targets.view(-1))
    )


def test_stable_for_logits_times_1000() -> None:
    logits, targets = _data(1000.0)
    ours = cross_entropy(logits, targets)
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours, F.cross_entropy(logits.view(-1, 11), targets.view(-1)))


def test_ignore_index_and_gradient() -> None:
    logits, targets = _data()
    targets[0, :3] = -100
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    la = cross_entropy(a, targets)
    lb = F.cross_entropy(b.view(-1, 11), targets.view(-1), ignore_index=-100)
    torch.testing.assert_close(la, lb)
    la.backward()
    lb.backward()
    torch.testing.assert_close(a.grad, b.grad)
    all_ignored = torch.full_like(targets, -100)
    assert float(cross_entropy(logits, all_ignored)) == 0.0


def test_z_loss_value() -> None:
    logits, targets = _data()
    targets[1, 0] = -100
    z = 1e-2
    valid = targets.view(-1) != -100
    lse = torch.logsumexp(logits.view(-1, 11), dim=-1)[valid]
    expected = F.cross_entropy(logits.view(-1, 11), targets.view(-1)) + z * lse.square().mean()
    torch.testing.assert_close(cross_entropy(logits, targets, z_loss=z), expected)


def test_bf16_logits_computed_in_fp32() -> None:
    logits, targets = _data(10.0)
    ours = cross_entropy(logits.bfloat16(), targets)
    ref = F.cross_entropy(logits.bfloat16().float().view(-1, 11), targets.view(-1))
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref)


def _reference_f64(
    logits: torch.Tensor, targets: torch.Tensor, z_loss: float, ignore_index: int = -100
) -> torch.Tensor:
    """The loss by autograd in float64 (plain formula, no custom backward)."""
    z = logits.double().reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    valid = t != ignore_index
    lse = torch.logsumexp(z, -1)
    picked = z.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
    per = (lse - picked + z_loss * lse.square()) * valid
    return per.sum() / valid.sum()


def test_gradient_with_z_loss_and_ignore_matches_float64_autograd() -> None:
    logits, targets = _data(3.0)
    targets[1, 2] = -100
    a = logits.clone().requires_grad_()
    b = logits.double().requires_grad_()
    cross_entropy(a, targets, z_loss=1e-2).backward()
    _reference_f64(b, targets, 1e-2).backward()
    torch.testing.assert_close(a.grad, b.grad.float(), atol=1e-6, rtol=1e-5)
    assert float(a.grad[1, 2].abs().max()) == 0.0  # ignored position: no gradient


def test_gradient_of_huge_bf16_logits_is_finite_and_in_bf16() -> None:
    logits, targets = _data(1000.0)
    a = logits.bfloat16().requires_grad_()
    b = logits.bfloat16().float().requires_grad_()
    cross_entropy(a, targets).backward()
    F.cross_entropy(b.view(-1, 11), targets.view(-1)).backward()
    assert a.grad.dtype == torch.bfloat16 and torch.isfinite(a.grad.float()).all()
    torch.testing.assert_close(a.grad.float(), b.grad, atol=1e-2, rtol=1e-2)


def test_compiled_gradient_equals_eager_without_float32_logit_buffers() -> None:
    # The compiled backward must be one fused pass: no float32 (N, V) buffer (autograd's gather
    # gradient would allocate one — 6 GiB at GPT-2-small batch 32 × 1024).
    import re

    from torch._inductor.utils import run_and_get_code

    n, v = 64, 1000
    g = torch.Generator().manual_seed(1)
    logits = (5 * torch.randn(n, v, generator=g)).bfloat16()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[3] = -100
    eager = logits.clone().requires_grad_()
    cross_entropy(eager, targets, z_loss=1e-3).backward()
    comp = logits.clone().requires_grad_()
    fn = torch.compile(lambda z, t: cross_entropy(z, t, z_loss=1e-3))

    def run() -> None:
        fn(comp, targets).backward()

    torch._dynamo.reset()
    _, codes = run_and_get_code(run)
    torch.testing.assert_close(comp.grad.float(), eager.grad.float(), atol=2e-3, rtol=1e-2)
    shapes = [
        (m.group(1), m.group(2))
        for code in codes
        for m in re.finditer(r"empty_strided\w*\(\(([^)]*)\), \([^)]*\), (torch\.\w+)", code)
    ]
    assert shapes, "no buffers found in the generated code"
    assert (f"{n}, {v}", "torch.float32") not in shapes, shapes
