"""PPO for language models (RLHF as InstructGPT runs it): a value head, GAE, clipped policy and
value losses, a per-token KL penalty to the reference policy, advantage whitening.

The value head is a linear layer on the policy's final hidden state (shared trunk). Per
iteration: sample one completion per prompt, score it (a verifiable reward or a learned reward
model — any ``reward_fn(item, text)``), build per-token rewards = −β·(log π_old − log π_ref)
plus the score on the last token, run GAE with the old values, whiten the advantages, then
``epochs`` passes of the clipped policy loss (token mean) + ``vf_coef`` × the clipped value loss.
Shape legend: B batch, T tokens, D model dim. Exercised by ``pytest
tests/test_posttrain_losses.py -k "gae or value"`` and ``lmforge rl --algo ppo``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.core import IGNORE, decode_ids, masked_mean, masked_whiten, token_logprobs
from lmforge.posttrain.losses import gae, kl_penalized_rewards, policy_token_loss, value_loss
from lmforge.posttrain.models import clone_frozen
from lmforge.posttrain.rl import _RolloutObjective, build_samples


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """PPO hyperparameters."""

    lr: float = 1e-3
    max_tokens: int = 16
    temperature: float = 1.0
    kl_coef: float = 0.02
    "β of the per-token KL penalty to the initial policy"
    clip: float = 0.2
    vf_clip: float = 0.2
    vf_coef: float = 0.5
    gamma: float = 1.0
    lam: float = 0.95
    epochs: int = 2
    samples_per_prompt: int = 4


class PolicyWithValue(nn.Module):
    """An lmforge or transformers LM plus a scalar value head on its final hidden state."""

    def __init__(self, lm: nn.Module, hidden: int) -> None:
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) -> logits (B, T, V), values (B, T)."""
        if hasattr(self.lm, "forward_hidden"):
            h = self.lm.forward_hidden(ids)  # (B, T, D)
            logits = self.lm.logits_from_hidden(h)
        else:
            out = self.lm(input_ids=ids, output_hidden_states=True)
            h, logits = out.hidden_states[-1], out.logits
        return logits, self.value_head(h.float()).squeeze(-1)


class PPOObjective(_RolloutObjective):
    """PPO (the iteration of the module docstring) as a :class:`~lmforge.train.Objective`; the
    Trainer's model is the :class:`PolicyWithValue`. Every ``epochs`` steps :meth:`before_step`
    samples ``prompts_per_step × samples_per_prompt`` completions on the serving engine (which
    shares ``policy.lm``); each step is one pass over that batch (one micro-batch of weight 1).
    The prompt/seed RNG and the rollout batch are the objective's state (exact resume)."""

    name = "ppo"

    def __init__(
        self, policy: PolicyWithValue, engine: Any, tokenizer: Any,
        draw: Callable[[int, random.Random], list[dict[str, Any]]],
        reward_fn: Callable[[dict[str, Any], str], Any], cfg: PPOConfig, *,
        prompts_per_step: int, eos_ids: Sequence[int] = (),
        eval_items: Sequence[dict[str, Any]] = (), seed: int = 0, target: float = 0.0,
    ) -> None:  # fmt: skip
        self.policy, self.engine, self.tokenizer = policy, engine, tokenizer
        self.draw, self.reward_fn, self.cfg = draw, reward_fn, cfg
        self.prompts_per_step = prompts_per_step
        self.eos = list(eos_ids)
        self.eval_items, self.eval_max_tokens = list(eval_items), cfg.max_tokens
        self.ref = clone_frozen(policy.lm)
        self.rng = random.Random(seed)
        self.target, self.should_stop = target, False
        self.passes_left = 0
        self.batch: dict[str, torch.Tensor] | None = None
        self._stats: dict[str, float] = {}
        self.samples_seen = 0

    @torch.no_grad()
    def _rollout(self, version: int) -> None:
        cfg = self.cfg
        items, prompts, outs, _ = self._sample(
            version, cfg.samples_per_prompt, cfg.temperature, cfg.max_tokens
        )
        stop = set(self.eos)
        flat_p: list[Sequence[int]] = []
        comps, scores = [], []
        for item, p, o in zip(items, prompts, outs):
            for c in o.outputs:
                text = decode_ids(self.tokenizer, [t for t in c.token_ids if t not in stop])
                scores.append(float(self.reward_fn(item, text).total))
                flat_p.append(p)
                comps.append(c)
        self.samples_seen += len(comps)
        s = build_samples(flat_p, comps, torch.zeros(len(comps)), torch.tensor(scores))
        device = next(self.policy.parameters()).device
        ids, labels = s.batch.input_ids.to(device), s.batch.labels.to(device)
        mask = labels != IGNORE
        _, old_values = self.policy(ids)
        ref_logp = token_logprobs(self.ref(ids), labels, cfg.temperature)
        old_logp = s.old_logp.to(device)
        rewards = kl_penalized_rewards(s.rewards.to(device), old_logp, ref_logp, mask,
                                       cfg.kl_coef)  # fmt: skip
        adv, returns = gae(rewards, old_values * mask, mask, cfg.gamma, cfg.lam)
        adv = masked_whiten(adv, mask)
        self.batch = {"ids": ids, "labels": labels, "old_logp": old_logp,
                      "old_values": old_values, "adv": adv, "returns": returns}  # fmt: skip
        self._stats = {"reward": sum(scores) / len(scores), "samples": float(self.samples_seen),
                       "kl": float(masked_mean(old_logp - ref_logp, mask))}  # fmt: skip

    def before_step(self, trainer: Any, step: int) -> None:
        """A new rollout batch every ``epochs`` steps."""
        if self.passes_left == 0:
            self._rollout(step - 1)
            self.passes_left = self.cfg.epochs
        self.passes_left -= 1

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The rollout batch (one micro-batch per step)."""
        assert self.batch is not None
        return self.batch

    def loss(
        self, model: nn.Module, b: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(clipped policy loss + vf_coef × value loss, 1)."""
        cfg = self.cfg
        mask = b["labels"] != IGNORE
        logits, values = model(b["ids"])
        logp = token_logprobs(logits, b["labels"], cfg.temperature)
        pl, clipped = policy_token_loss(logp, b["old_logp"], b["adv"], mask, "clip", cfg.clip,
                                        cfg.clip)  # fmt: skip
        vl = value_loss(values, b["old_values"], b["returns"], mask, cfg.vf_clip)
        self._stats["value_loss"] = float(vl.detach())
        self._stats["clip_fraction"] = float(clipped.float().sum() / mask.sum().clamp_min(1))
        return masked_mean(pl, mask) + cfg.vf_coef * vl, torch.ones(())

    def metrics(self) -> dict[str, float]:
        """Reward, KL to the start, value loss and clip fraction."""
        return dict(self._stats)

    def state_dict(self) -> dict:
        """Prompt/seed RNG, the rollout batch and the passes left over it."""
        out = self._loop_state()
        if self.batch is not None:
            out["batch"] = {k: v.cpu() for k, v in self.batch.items()}
        return out

    def load_state_dict(self, state: dict) -> None:
        self._load_loop_state(state)
        device = next(self.policy.parameters()).device
        if "batch" in state:
            self.batch = {k: v.to(device) for k, v in state["batch"].items()}
