"""Every post-training loss on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.posttrain.losses import (
    aggregate,
    bradley_terry_loss,
    distill_token_loss,
    dpo_loss,
    dynamic_sampling_keep,
    gae,
    group_advantages,
    k3_kl,
    kl_penalized_rewards,
    overlong_penalty,
    policy_token_loss,
    simpo_loss,
    value_loss,
)


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_dpo_ipo_cdpo_simpo_by_hand() -> None:
    pc, pr = torch.tensor([-1.0]), torch.tensor([-3.0])
    rc, rr = torch.tensor([-2.0]), torch.tensor([-2.5])
    h = (-1 + 2) - (-3 + 2.5)  # 1.5
    loss, r_c, r_r = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert float(loss) == pytest.approx(-math.log(sig(0.15)))
    assert float(r_c) == pytest.approx(0.1) and float(r_r) == pytest.approx(-0.05)
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, kind="cdpo", label_smoothing=0.2)
    assert float(loss) == pytest.approx(-0.8 * math.log(sig(0.15)) - 0.2 * math.log(sig(-0.15)))
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, kind="ipo")
    assert float(loss) == pytest.approx((h - 5.0) ** 2)
    loss, a, b = simpo_loss(torch.tensor([-0.5]), torch.tensor([-1.0]), beta=2.0, gamma=0.5)
    assert float(loss) == pytest.approx(-math.log(sig(2 * 0.5 - 0.5)))
    assert float(a) == pytest.approx(-1.0) and float(b) == pytest.approx(-2.0)
    assert float(bradley_terry_loss(torch.tensor(2.0), torch.tensor(1.0))) == pytest.approx(
        -math.log(sig(1.0))
    )


def test_group_advantages_by_hand() -> None:
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # the sample std by default (TRL, verl, CS336): sqrt(1/3) over [1, 0, 0, 1]
    a = group_advantages(r, "mean", "std", eps=0.0 + 1e-12)
    torch.testing.assert_close(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * (3 / 4) ** 0.5)
    a = group_advantages(r, "mean", "std", eps=0.0 + 1e-12, std="population")
    torch.testing.assert_close(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    # group size 2: the two differ by sqrt(2), the gap the issue measured
    two = torch.tensor([[1.0, 0.0]])
    ratio = group_advantages(two, "mean", "std", eps=0.0, std="population") / group_advantages(
        two, "mean", "std", eps=0.0
    )
    torch.testing.assert_close(ratio, torch.full((1, 2), 2**0.5))
    a = group_advantages(r, "mean", "std")
    assert float(a[1].abs().max()) == 0.0  # identical rewards: no signal, no NaN
    torch.testing.assert_close(
        group_advantages(r, "mean", "none")[0], torch.tensor([0.5, -0.5, -0.5, 0.5])
    )
    loo = group_advantages(r, "loo", "none")[0]  # r_i - mean of the other three
    torch.testing.assert_close(loo, torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))
    maxrl = group_advantages(r, "mean", "mean", eps=0.0)[0]  # (r - 0.5) / 0.5
    torch.testing.assert_close(maxrl, torch.tensor([1.0, -1.0, -1.0, 1.0]))
    torch.testing.assert_close(group_advantages(r, "none", "none"), r)
    assert dynamic_sampling_keep(r).tolist() == [True, False]


def test_overlong_penalty_by_hand() -> None:
    pen = overlong_penalty(torch.tensor([5, 8, 9, 10, 12]), max_len=10, cache=4)
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.5, -0.75, -1.0, -1.0]))


def test_policy_token_losses_by_hand() -> None:
    logp = torch.tensor([[math.log(0.5), math.log(0.9)]])
    old = torch.tensor([[math.log(0.25), math.log(0.9)]])  # ratios 2.0 and 1.0
    mask = torch.tensor([[True, True]])
    adv = torch.tensor([1.0])
    loss, _ = policy_token_loss(logp, old, adv, mask, "none")
    torch.testing.assert_close(loss, -logp)
    loss, _ = policy_token_loss(logp, old, adv, mask, "ratio")
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -1.0]]))
    loss, clipped = policy_token_loss(logp, old, adv, mask, "clip", 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.0]]))
    assert clipped.tolist() == [[True, False]]
    loss, _ = policy_token_loss(logp, old, adv, mask, "clip", 0.2, 0.28)  # clip-higher
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -1.0]]))
    loss, _ = policy_token_loss(logp, old, -adv, mask, "clip", 0.2, 0.2)  # A<0: min keeps 2·A
    torch.testing.assert_close(loss, torch.tensor([[2.0, 1.0]]))
    # GSPO: sequence ratio exp(mean log r) = sqrt(2) ≈ 1.414 for both tokens, clipped to 1.2.
    loss, _ = policy_token_loss(logp, old, adv, mask, "seq_clip", 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.2]]))
    loss, _ = policy_token_loss(logp, old, adv, mask, "seq_clip", 0.5, 0.5)
    torch.testing.assert_close(loss, torch.full((1, 2), -math.sqrt(2.0)))


def test_gspo_gradient_is_the_sequence_ratio_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.9, -0.7]])
    mask = torch.tensor([[True, True, True]])
    loss, _ = policy_token_loss(logp, old, torch.tensor([1.0]), mask, "seq_clip", 10.0, 10.0)
    loss.sum().backward()
    s = math.exp(float((logp - old).mean()))
    # ∂/∂logp_t of −3·s (3 tokens each valued s) = −3·s/3 = −s per token.
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -s))


def test_aggregations_by_hand() -> None:
    tl = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    s, w = aggregate(tl, mask, "seq_mean")
    assert float(s) / w == pytest.approx((2.0 + 4.0) / 2)
    s, w = aggregate(tl, mask, "token_mean")
    assert float(s) / w == pytest.approx(10.0 / 4)
    s, w = aggregate(tl, mask, "constant", constant=5.0)
    assert float(s) / w == pytest.approx((6.0 / 5 + 4.0 / 5) / 2)


def test_k3_kl() -> None:
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert float(k3_kl(logp, ref)) == pytest.approx(0.5 - math.log(0.5) - 1)
    assert float(k3_kl(ref, ref)) == 0.0


def test_gae_by_hand() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    v = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    m = torch.tensor([[True, True, True, False]])
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.6, a2 + 0.7, 0.0]]))


def test_value_loss_clipping_by_hand() -> None:
    v = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.0]])
    ret = torch.tensor([[0.0, 1.0]])
    m = torch.tensor([[True, True]])
    # token 0: unclipped (1-0)²=1, clipped V=0.7 → 0.49, max 1; token 1: 1 and 1.
    assert float(value_loss(v, old, ret, m, clip=0.2)) == pytest.approx(0.5 * (1 + 1) / 2)
    v = torch.tensor([[0.0, 0.0]])
    # token 0: unclipped 0; clipped V=0.3 → 0.09: max picks the clipped (pessimistic) 0.09.
    assert float(value_loss(v, old, ret, m, clip=0.2)) == pytest.approx(0.5 * (0.09 + 1) / 2)


def test_kl_penalized_rewards_by_hand() -> None:
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    m = torch.tensor([[True, True, False]])
    r = kl_penalized_rewards(torch.tensor([2.0]), logp, ref, m, kl_coef=0.1)
    torch.testing.assert_close(r, torch.tensor([[-0.05, 2.0, 0.0]]))


def test_distillation_divergences_against_float64() -> None:
    torch.manual_seed(0)
    s, t = torch.randn(3, 6), torch.randn(3, 6)
    for temp in (1.0, 2.0):
        q = torch.softmax(s.double() / temp, -1)
        p = torch.softmax(t.double() / temp, -1)
        fwd = (p * (p.log() - q.log())).sum(-1) * temp**2
        rev = (q * (q.log() - p.log())).sum(-1) * temp**2
        mix = 0.3 * p + 0.7 * q
        jsd = (
            0.3 * (p * (p.log() - mix.log())).sum(-1) + 0.7 * (q * (q.log() - mix.log())).sum(-1)
        ) * temp**2
        got = distill_token_loss(s, t, "forward", temp).double()
        torch.testing.assert_close(got, fwd, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            distill_token_loss(s, t, "reverse", temp).double(), rev, atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            distill_token_loss(s, t, "jsd", temp, beta=0.3).double(), jsd, atol=1e-5, rtol=1e-5
        )
    with pytest.raises(ValueError, match="vocabulary"):
        distill_token_loss(torch.randn(2, 5), torch.randn(2, 6))


def test_overlong_budget_never_penalises_a_full_length_good_answer() -> None:
    from lmforge.posttrain.losses import ALGORITHMS
    from lmforge.posttrain.rl import overlong_budget

    max_tokens, cache = overlong_budget(5, ALGORITHMS["dapo"])
    assert (max_tokens, cache) == (7, 2)
    assert float(overlong_penalty(torch.tensor([5]), max_tokens, cache)) == 0.0
    assert overlong_budget(5, ALGORITHMS["grpo"]) == (5, 0)
