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
