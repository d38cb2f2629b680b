"""Loss math for preference optimisation, RL with verifiable rewards, PPO and distillation: pure
functions of tensors, each tested on hand-computed cases.

RL losses are built from three separable choices, so any combination can be made:

1. advantages per group (:func:`group_advantages`): baseline ``mean`` | ``loo`` (leave-one-out)
   | ``none``, normalizer ``std`` | ``mean`` (MaxRL: divide by the group's mean reward) | ``none``;
2. per-token loss with an importance-reweighting choice (:func:`policy_token_loss`): ``none``
   (REINFORCE: −A·log π), ``ratio`` (−A·r, unclipped), ``clip`` (PPO/GRPO token-level clip with
   ε_low/ε_high — DAPO's clip-higher when they differ), ``seq_clip`` (GSPO: the sequence-level
   ratio exp(mean log r), clipped);
3. aggregation over tokens (:func:`aggregate`): ``seq_mean`` (per-sequence mean, then batch
   mean — GRPO), ``token_mean`` (all tokens of the batch weigh the same — DAPO), ``constant``
   (sum over a constant, e.g. the max response length — Dr. GRPO).

:data:`ALGORITHMS` names the published combinations. Shape legend: B batch (sequences), T
response tokens, G groups, N samples per group, V vocab.
Exercised by ``pytest tests/test_posttrain_losses.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F

from lmforge.posttrain.core import masked_mean, masked_sum_normalize

Baseline = Literal["mean", "loo", "none"]
Normalizer = Literal["std", "mean", "none"]
Reweight = Literal["none", "ratio", "clip", "seq_clip"]
Aggregation = Literal["seq_mean", "token_mean", "constant"]

# -- Preference optimisation


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    kind: Literal["dpo", "ipo", "cdpo"] = "dpo",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair loss (B,) and implicit rewards β·(π − ref) (B,), (B,) from summed sequence
    log-probs (B,). h = (π_c − ref_c) − (π_r − ref_r). DPO: −log σ(β h). cDPO (labels flipped
    with probability ε = ``label_smoothing``): −(1−ε) log σ(β h) − ε log σ(−β h). IPO:
    (h − 1/(2β))², h from per-token *average* log-probs as in the IPO paper (the caller passes
    averages)."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)  # (B,)
    if kind == "ipo":
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    elif kind in ("dpo", "cdpo"):
        eps = label_smoothing if kind == "cdpo" else 0.0
        loss = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    else:
        raise ValueError(f"unknown DPO kind {kind!r} (dpo, ipo, cdpo)")
    r_c = beta * (policy_chosen - ref_chosen).detach()
    r_r = beta * (policy_rejected - ref_rejected).detach()
    return loss, r_c, r_r


def simpo_loss(
    avg_chosen: torch.Tensor, avg_rejected: torch.Tensor, beta: float = 2.0, gamma: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (reference-free): −log σ(β·avg_c − β·avg_r − γ) from per-token average log-probs (B,);
    the per-pair loss and the rewards β·avg (chosen, rejected)."""
    loss = -F.logsigmoid(beta * (avg_chosen - avg_rejected) - gamma)
    return loss, beta * avg_chosen.detach(), beta * avg_rejected.detach()


def bradley_terry_loss(score_chosen: torch.Tensor, score_rejected: torch.Tensor) -> torch.Tensor:
    """Reward-model loss per pair (B,): −log σ(s_chosen − s_rejected)."""
    return -F.logsigmoid(score_chosen - score_rejected)


# -- Advantages


def group_advantages(
    rewards: torch.Tensor,
    baseline: Baseline = "mean",
    normalizer: Normalizer = "std",
    eps: float = 1e-6,
    std: Literal["sample", "population"] = "sample",
) -> torch.Tensor:
    """Advantages (G, N) of rewards (G, N), one row per prompt's group of N samples. Baseline
    ``mean``: r − mean(group); ``loo``: r − mean of the *other* N−1 samples (RLOO);
    ``none``: r. Normalizer ``std``: divide by the group's std + eps, by default the *sample*
    (unbiased, N−1) std as TRL, verl and the CS336 reference compute it; ``std="population"``
    (N) gives advantages smaller by √((N−1)/N) (1/√2 at N = 2), lmforge's choice before;
    ``mean``: divide by the group's mean reward + eps (MaxRL); ``none``: no division (Dr. GRPO)."""
    if std not in ("sample", "population"):
        raise ValueError(f"unknown std {std!r} (sample, population)")
    r = rewards.float()
    n = r.shape[-1]
    if baseline == "mean":
        adv = r - r.mean(-1, keepdim=True)
    elif baseline == "loo":
        if n < 2:
            raise ValueError("a leave-one-out baseline needs at least 2 samples per group")
        adv = r - (r.sum(-1, keepdim=True) - r) / (n - 1)
    elif baseline == "none":
        adv = r
    else:
        raise ValueError(f"unknown baseline {baseline!r} (mean, loo, none)")
    if normalizer == "std":
        if std == "sample" and n < 2:
            raise ValueError("the sample std needs at least 2 samples per group")
        adv = adv / (r.std(-1, unbiased=std == "sample", keepdim=True) + eps)
    elif normalizer == "mean":
        adv = adv / (r.mean(-1, keepdim=True) + eps)
    elif normalizer != "none":
        raise ValueError(f"unknown normalizer {normalizer!r} (std, mean, none)")
    return adv


def dynamic_sampling_keep(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic sampling: (G,) bool, False for groups whose rewards are all equal (zero
    advantage everywhere, so they add no gradient but dilute the batch)."""
    return (rewards.max(-1).values - rewards.min(-1).values) > 0


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache: int) -> torch.Tensor:
    """DAPO's soft overlong penalty (B,): 0 up to max_len − cache tokens, then falling linearly
    to −1 at ``max_len``, and −1 beyond."""
    lengths = lengths.float()
    start = max_len - cache
    ramp = (start - lengths) / max(cache, 1)
    out = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    return out.clamp_min(-1.0)


# -- Per-token policy losses and aggregation


def policy_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    reweight: Reweight = "clip",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss (B, T) and the "clipped" indicator (B, T), 0 where masked.
    ``logp``/``old_logp`` (B, T): log-probs of the sampled tokens under the current policy and
    the one that sampled them; ``advantages`` (B,) per sequence or (B, T) per token."""
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # (B, T) or (B, 1)
    adv = adv.expand_as(logp)
    m = mask.to(logp.dtype)
    log_ratio = (logp - old_logp) * m
    if reweight == "none":
        return -adv * logp * m, torch.zeros_like(mask)
    if reweight == "ratio":
        return -adv * log_ratio.exp() * m, torch.zeros_like(mask)
    if reweight == "clip":
        ratio = log_ratio.exp()
    elif reweight == "seq_clip":
        # GSPO-token: s_i = exp(mean_t log r) as the value of each token's ratio, with the
        # gradient of log π at that token (s_i · ∇log π_t / |y_i| summed = ∇s_i).
        seq = log_ratio.sum(-1) / m.sum(-1).clamp_min(1.0)  # (B,)
        ratio = (seq.detach()[:, None] + logp - logp.detach()).exp()
    else:
        raise ValueError(f"unknown reweight {reweight!r} (none, ratio, clip, seq_clip)")
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    unclipped, clipped = ratio * adv, clipped_ratio * adv
    loss = -torch.minimum(unclipped, clipped) * m
    was_clipped = (clipped < unclipped) & mask
    return loss, was_clipped


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation = "seq_mean",
    constant: float | None = None,
) -> tuple[torch.Tensor, float]:
    """``(loss_sum, weight)`` of a per-token loss (B, T), loss = loss_sum / weight (so gradient
    accumulation divides by the whole batch's weight). ``seq_mean``: Σ_i mean_t(loss_i) over
    weight B; ``token_mean``: Σ loss over weight = number of tokens; ``constant``:
    Σ_i Σ_t loss_i,t / constant over weight B (Dr. GRPO, constant = the generation budget)."""
    if mode == "seq_mean":
        return masked_mean(token_loss, mask, dim=-1).sum(), float(token_loss.shape[0])
    if mode == "token_mean":
        return (token_loss * mask.to(token_loss.dtype)).sum(), float(mask.sum())
    if mode == "constant":
        if constant is None:
            raise ValueError("aggregation 'constant' needs a positive constant")
        return masked_sum_normalize(token_loss, mask, constant), float(token_loss.shape[0])
    raise ValueError(f"unknown aggregation {mode!r} (seq_mean, token_mean, constant)")


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖ref) per sampled token: exp(ref − π) − (ref − π) − 1 ≥ 0."""
    d = ref_logp - logp
    return d.exp() - d - 1.0


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One published combination of the three choices (see module docstring)."""

    baseline: Baseline
    normalizer: Normalizer
    reweight: Reweight
    aggregation: Aggregation
    eps_low: float = 0.2
    eps_high: float = 0.2
    dynamic_sampling: bool = False
    overlong_filter: bool = False


ALGORITHMS: dict[str, Algorithm] = {
    "reinforce": Algorithm("none", "none", "none", "seq_mean"),
    "reinforce_baseline": Algorithm("mean", "none", "none", "seq_mean"),
    "rloo": Algorithm("loo", "none", "none", "seq_mean"),
    "grpo": Algorithm("mean", "std", "clip", "seq_mean"),
    "dr_grpo": Algorithm("mean", "none", "clip", "constant"),
    "dapo": Algorithm(
        "mean", "std", "clip", "token_mean", 0.2, 0.28, dynamic_sampling=True, overlong_filter=True
    ),
    "gspo": Algorithm("mean", "std", "seq_clip", "seq_mean", 3e-4, 4e-4),
    "maxrl": Algorithm("mean", "mean", "clip", "seq_mean"),
}


# -- PPO


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens: advantages and returns (B, T).
    δ_t = r_t + γ V_{t+1} − V_t (V after the last valid token is 0), A_t = δ_t + γλ A_{t+1};
    returns = A + V. Masked (padding) positions give 0 and do not carry values across."""
    b, t = rewards.shape
    m = mask.to(values.dtype)
    adv = torch.zeros_like(values)
    last = torch.zeros(b, dtype=values.dtype, device=values.device)
    next_value = torch.zeros(b, dtype=values.dtype, device=values.device)
    for i in reversed(range(t)):
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        last = (delta + gamma * lam * last) * m[:, i]
        adv[:, i] = last
        next_value = values[:, i] * m[:, i]
    return adv, (adv + values) * m


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
) -> torch.Tensor:
    """PPO's clipped value loss: ½ · masked mean of max((V − R)², (clip(V, V_old ± c) − R)²)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)


def kl_penalized_rewards(
    scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """Per-token rewards (B, T): −β·(log π − log ref) at every response token, plus the
    sequence score (B,) at its last valid token (the RLHF reward shaping of InstructGPT)."""
    m = mask.to(logp.dtype)
    rewards = -kl_coef * (logp - ref_logp) * m
    last = (m.cumsum(-1) == m.sum(-1, keepdim=True)) & mask  # (B, T) the final valid token
    return rewards + scores[:, None] * last.to(logp.dtype)


# -- Distillation


def distill_token_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: Literal["forward", "reverse", "jsd"] = "forward",
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """Per-position divergence (…,) between teacher p and student q over the vocabulary, both
    softened by the temperature T, scaled by T² (comparable gradient magnitudes). ``forward``:
    KL(p‖q) (mode covering); ``reverse``: KL(q‖p) (mode seeking); ``jsd``: GKD's generalised
    JSD β·KL(p‖m) + (1−β)·KL(q‖m), m = β·p + (1−β)·q (β=0.5: the JSD; β → 0: forward KL / β
    up to scaling)."""
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(
            f"student vocabulary {student_logits.shape[-1]} != teacher's {teacher_logits.shape[-1]}"
        )
    t = float(temperature)
    lq = torch.log_softmax(student_logits.float() / t, dim=-1)  # (…, V)
    lp = torch.log_softmax(teacher_logits.float() / t, dim=-1)  # (…, V)
    if kind == "forward":
        out = (lp.exp() * (lp - lq)).sum(-1)
    elif kind == "reverse":
        out = (lq.exp() * (lq - lp)).sum(-1)
    elif kind == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
        lm = torch.logsumexp(
            torch.stack(
                [lp + torch.log(torch.tensor(beta)), lq + torch.log(torch.tensor(1 - beta))]
            ),
            dim=0,
        )
        out = beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)
    else:
        raise ValueError(f"unknown distillation loss {kind!r} (forward, reverse, jsd)")
    return out * t * t
