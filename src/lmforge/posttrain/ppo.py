"""PPO for language models (RLHF as InstructGPT runs it): a value head, GAE, clipped policy and
value losses, a per-token KL penalty to the reference policy, advantage whitening.

The value head is a linear layer on the policy's final hidden state (shared trunk). Per
iteration: sample one completion per prompt, score it (a verifiable reward or a learned reward
model — any ``reward_fn(item, text)``), build per-token rewards = −β·(log π_old − log π_ref)
plus the score on the last token, run GAE with the old values, whiten the advantages, then
``epochs`` passes of the clipped policy loss (token mean) + ``vf_coef`` × the clipped value loss.
Exercised by ``pytest tests/test_posttrain_losses.py -k "gae or value"`` (the math) and
``lmforge rl --task arithmetic --algo ppo``.

Shape legend: B batch, T tokens, D model dim.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.core import IGNORE, encode_text, masked_mean, masked_whiten, token_logprobs
from lmforge.posttrain.losses import gae, kl_penalized_rewards, policy_token_loss, value_loss
from lmforge.posttrain.models import clone_frozen
from lmforge.posttrain.rollout import SamplingParams


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


def run_ppo(
    model: nn.Module,
    engine: Any,
    tokenizer: Any,
    sample_items: Callable[[int], list[dict[str, Any]]],
    reward_fn: Callable[[dict[str, Any], str], Any],
    cfg: PPOConfig,
    *,
    iterations: int,
    prompts_per_step: int,
    eval_fn: Callable[[], float] | None = None,
    eval_every: int = 5,
    target: float | None = None,
    log: Callable[[dict[str, Any]], None] | None = None,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """PPO iterations on ``model`` in place (the engine samples from the same module)."""
    from lmforge.posttrain.core import decode_ids
    from lmforge.posttrain.dpo import hidden_size
    from lmforge.posttrain.rl import build_samples

    device = next(model.parameters()).device
    pv = PolicyWithValue(model, hidden_size(model)).to(device)
    ref = clone_frozen(model)
    opt = torch.optim.AdamW(pv.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                            n=cfg.samples_per_prompt)  # fmt: skip
    eos = set(engine.eos_ids)
    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    seen = 0
    for it in range(1, iterations + 1):
        items = sample_items(prompts_per_step)
        prompts = [encode_text(tokenizer, x["prompt"]) for x in items]
        model.eval()
        outs = engine.generate(prompts, params)
        flat_p: list[Sequence[int]] = []
        comps, scores = [], []
        for item, p, o in zip(items, prompts, outs):
            for c in o.outputs:
                text = decode_ids(tokenizer, [t for t in c.token_ids if t not in eos])
                scores.append(float(reward_fn(item, text).total))
                flat_p.append(p)
                comps.append(c)
        seen += len(comps)
        s = build_samples(flat_p, comps, torch.zeros(len(comps)), torch.tensor(scores))
        ids, labels = s.batch.input_ids.to(device), s.batch.labels.to(device)
        mask = labels != IGNORE
        with torch.no_grad():
            _, old_values = pv(ids)
            ref_logp = token_logprobs(ref(ids), labels, cfg.temperature)
            old_logp = s.old_logp.to(device)
            rewards = kl_penalized_rewards(s.rewards.to(device), old_logp, ref_logp, mask,
                                           cfg.kl_coef)  # fmt: skip
            adv, returns = gae(rewards, old_values * mask, mask, cfg.gamma, cfg.lam)
            adv = masked_whiten(adv, mask)
        pv.train()
        for _ in range(cfg.epochs):
            logits, values = pv(ids)
            logp = token_logprobs(logits, labels, cfg.temperature)
            pl, clipped = policy_token_loss(logp, old_logp, adv, mask, "clip", cfg.clip, cfg.clip)
            vl = value_loss(values, old_values, returns, mask, cfg.vf_clip)
            loss = masked_mean(pl, mask) + cfg.vf_coef * vl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(pv.parameters(), 1.0)
            opt.step()
        pv.eval()
        engine.version += 1
        rec: dict[str, Any] = {
            "iteration": it, "samples": seen, "time_s": time.perf_counter() - t0,
            "reward": sum(scores) / len(scores), "value_loss": float(vl),
            "kl": float(masked_mean(old_logp - ref_logp, mask)),
            "clip_fraction": float(clipped.float().sum() / mask.sum().clamp_min(1)),
        }  # fmt: skip
        if eval_fn is not None and (it % eval_every == 0 or it == iterations):
            model.eval()
            rec["eval_accuracy"] = eval_fn()
        history.append(rec)
        if log is not None:
            log(rec)
        if progress is not None:
            progress.update(1)
        if target is not None and rec.get("eval_accuracy", -1.0) >= target:
            break
    return history
