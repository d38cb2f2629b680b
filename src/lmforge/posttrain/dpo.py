"""Preference optimisation: DPO, IPO, conservative DPO and SimPO, and a Bradley–Terry reward model.

Data: JSONL (or .jsonl.gz) records ``{"prompt", "chosen", "rejected"}``, or HH-RLHF's
``{"chosen", "rejected"}`` full dialogues (``\\n\\nHuman: … \\n\\nAssistant: …``), split at their
last common ``\\n\\nAssistant:`` into a shared prompt and the two final replies.

The reference policy's sequence log-probs are computed once before training and cached (they
never change), so the reference model is not kept in memory during training. Metrics: loss,
reward accuracy (implicit reward of chosen > rejected), reward margin, on training batches and
on a held-out split. Exercised by ``pytest tests/test_posttrain_dpo.py``.

Shape legend: B pairs, T tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.core import (
    Batch,
    collate,
    encode_text,
    prompt_response_example,
    sequence_logprobs,
)
from lmforge.posttrain.losses import bradley_terry_loss, dpo_loss, simpo_loss
from lmforge.utils.errors import LmforgeError

_ASSISTANT = "\n\nAssistant:"


def split_pair(rec: dict[str, Any], where: str) -> tuple[str, str, str]:
    """``(prompt, chosen, rejected)`` of a preference record (see the module docstring)."""
    if not isinstance(rec.get("chosen"), str) or not isinstance(rec.get("rejected"), str):
        raise LmforgeError(f"{where}: needs string fields 'chosen' and 'rejected'")
    if "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise LmforgeError(f"{where}: 'prompt' must be a string")
        return rec["prompt"], rec["chosen"], rec["rejected"]
    c, r = rec["chosen"], rec["rejected"]
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n]:
        n += 1
    cut = c.rfind(_ASSISTANT, 0, n)
    if cut < 0:
        raise LmforgeError(f"{where}: no common '{_ASSISTANT.strip()}' prefix to split at")
    cut += len(_ASSISTANT)
    return c[:cut], c[cut:], r[cut:]


@dataclasses.dataclass
class PairBatch:
    """Chosen and rejected sequences of B pairs, stacked as one batch of 2B rows
    (chosen first) so one forward scores both."""

    batch: Batch
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None


def tokenize_pairs(
    records: Sequence[dict[str, Any]], tokenizer: Any, max_len: int, eos_id: int | None,
    where: str = "data",
) -> list[tuple[list[int], list[int], list[int]]]:  # fmt: skip
    """Token ids ``(prompt, chosen, rejected)``, the prompt cut from the left to fit ``max_len``."""
    out = []
    for n, rec in enumerate(records, start=1):
        p, c, r = split_pair(rec, f"{where} record {n}")
        pi, ci, ri = (encode_text(tokenizer, s) for s in (p, c, r))
        if eos_id is not None:
            ci, ri = [*ci, eos_id], [*ri, eos_id]
        ci, ri = ci[: max_len // 2], ri[: max_len // 2]
        keep = max_len - max(len(ci), len(ri))
        pi = pi[-keep:] if keep > 0 else pi[-1:]
        out.append((pi, ci, ri))
    return out


def pair_batch(pairs: Sequence[tuple[list[int], list[int], list[int]]], pad_id: int) -> Batch:
    """One batch of 2B rows: the chosen sequences, then the rejected ones."""
    exs = [prompt_response_example(p, c) for p, c, _ in pairs]
    exs += [prompt_response_example(p, r) for p, _, r in pairs]
    return collate(exs, pad_id)


def sequence_scores(model: nn.Module, batch: Batch, average: bool = False) -> torch.Tensor:
    """Summed (or per-token averaged) response log-probs per row (2B,)."""
    logp, _ = sequence_logprobs(model, batch.input_ids, batch.labels)
    total = (logp * batch.mask).sum(-1)
    return total / batch.mask.sum(-1).clamp_min(1) if average else total


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """Preference-optimisation hyperparameters."""

    loss: str = "dpo"
    "dpo | ipo | cdpo | simpo"
    beta: float = 0.1
    "inverse temperature β (SimPO: its β, typically 2)"
    label_smoothing: float = 0.1
    "cDPO's label-flip probability ε"
    simpo_gamma: float = 0.5
    "SimPO's target margin γ"
    lr: float = 5e-6
    "AdamW learning rate"
    epochs: int = 1
    "passes over the training pairs"
    batch_size: int = 8
    "pairs per optimizer step"
    max_len: int = 512
    "longest prompt + response, in tokens"
    seed: int = 0
    "shuffling seed"


def _avg(cfg: DPOConfig) -> bool:
    return cfg.loss in ("ipo", "simpo")  # IPO and SimPO use length-averaged log-probs


@torch.no_grad()
def reference_scores(
    model: nn.Module, pairs: Sequence[Any], cfg: DPOConfig, pad_id: int, progress: bool = False
) -> torch.Tensor:
    """The reference policy's scores (N, 2): computed once, before training, and cached."""
    from tqdm import tqdm

    device = next(model.parameters()).device
    out = []
    for i in tqdm(range(0, len(pairs), cfg.batch_size), desc="reference", disable=not progress):
        chunk = pairs[i : i + cfg.batch_size]
        s = sequence_scores(model, pair_batch(chunk, pad_id).to(device), _avg(cfg))
        out.append(torch.stack([s[: len(chunk)], s[len(chunk) :]], -1).cpu())
    return torch.cat(out)


def pair_losses(
    model: nn.Module, chunk: Sequence[Any], ref: torch.Tensor, cfg: DPOConfig, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and implicit rewards (chosen, rejected) of a chunk of pairs."""
    device = next(model.parameters()).device
    s = sequence_scores(model, pair_batch(chunk, pad_id).to(device), _avg(cfg))
    pc, pr = s[: len(chunk)], s[len(chunk) :]
    if cfg.loss == "simpo":
        return simpo_loss(pc, pr, cfg.beta, cfg.simpo_gamma)
    if cfg.loss not in ("dpo", "ipo", "cdpo"):
        raise LmforgeError(f"unknown preference loss {cfg.loss!r} (dpo, ipo, cdpo, simpo)")
    ref = ref.to(device)
    return dpo_loss(pc, pr, ref[:, 0], ref[:, 1], cfg.beta, cfg.loss, cfg.label_smoothing)  # type: ignore[arg-type]


@torch.no_grad()
def preference_accuracy(
    model: nn.Module, pairs: Sequence[Any], ref: torch.Tensor, cfg: DPOConfig, pad_id: int
) -> dict[str, float]:
    """Held-out accuracy of the implicit reward (ties count ½), its mean margin, and the
    accuracy of the policy's own log-probs (log π(chosen) > log π(rejected), no reference)."""
    device = next(model.parameters()).device
    acc, margin, lp_acc = 0.0, 0.0, 0.0
    for i in range(0, len(pairs), cfg.batch_size):
        chunk = pairs[i : i + cfg.batch_size]
        s = sequence_scores(model, pair_batch(chunk, pad_id).to(device), _avg(cfg))
        pc, pr = s[: len(chunk)], s[len(chunk) :]
        lp_acc += float((pc > pr).float().sum() + 0.5 * (pc == pr).float().sum())
        if cfg.loss == "simpo":
            rc, rr = cfg.beta * pc, cfg.beta * pr
        else:
            r = ref[i : i + cfg.batch_size].to(device)
            rc, rr = cfg.beta * (pc - r[:, 0]), cfg.beta * (pr - r[:, 1])
        acc += float((rc > rr).float().sum() + 0.5 * (rc == rr).float().sum())
        margin += float((rc - rr).sum())
    n = len(pairs)
    return {"accuracy": acc / n, "margin": margin / n, "logp_accuracy": lp_acc / n}


def train_dpo(
    model: nn.Module,
    train_pairs: Sequence[Any],
    eval_pairs: Sequence[Any],
    cfg: DPOConfig,
    pad_id: int = 0,
    log_path: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run preference optimisation in place; returns held-out metrics before and after."""
    from tqdm import tqdm

    if not train_pairs:
        raise LmforgeError("no training pairs")
    ref_train = reference_scores(model, train_pairs, cfg, pad_id, progress)
    ref_eval = reference_scores(model, eval_pairs, cfg, pad_id, progress) if eval_pairs else None
    before = preference_accuracy(model, eval_pairs, ref_eval, cfg, pad_id) if eval_pairs else {}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    history = []
    step = 0
    model.train()
    for _ in range(cfg.epochs):
        order = list(range(len(train_pairs)))
        rng.shuffle(order)
        for i in tqdm(range(0, len(order), cfg.batch_size), desc="dpo", disable=not progress):
            idx = order[i : i + cfg.batch_size]
            loss, rc, rr = pair_losses(model, [train_pairs[j] for j in idx], ref_train[idx], cfg,
                                       pad_id)  # fmt: skip
            opt.zero_grad(set_to_none=True)
            loss.mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            rec = {"step": step, "loss": float(loss.detach().mean()),
                   "reward_accuracy": float((rc > rr).float().mean()),
                   "reward_margin": float((rc - rr).mean()),
                   "reward_chosen": float(rc.mean()), "reward_rejected": float(rr.mean())}  # fmt: skip
            history.append(rec)
            if log_path is not None:
                with open(log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
    model.eval()
    after = preference_accuracy(model, eval_pairs, ref_eval, cfg, pad_id) if eval_pairs else {}
    return {"before": before, "after": after, "steps": step, "history": history}


# ---------------------------------------------------------------------------------------------
# Reward model


class RewardModel(nn.Module):
    """An LM with a scalar head: the score of a sequence is the head applied to the last
    response token's final hidden state (the LM head is dropped from the computation: its
    logits are not used). Works on lmforge models (``forward_hidden``) and transformers models
    (``output_hidden_states``)."""

    def __init__(self, lm: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.lm = lm
        self.head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) -> final hidden states (B, T, D)."""
        if hasattr(self.lm, "forward_hidden"):
            return self.lm.forward_hidden(input_ids)
        out = self.lm(input_ids=input_ids, output_hidden_states=True)
        return out.hidden_states[-1]

    def forward(self, batch: Batch) -> torch.Tensor:
        """Scores (B,) of the rows of ``batch`` at their last labelled position."""
        h = self.hidden(batch.input_ids)  # (B, T, D)
        mask = batch.mask
        t = mask.shape[1]
        last = (mask.long() * torch.arange(t, device=mask.device)).argmax(-1)  # (B,)
        return self.head(h[torch.arange(h.shape[0]), last]).squeeze(-1)  # (B,)


def hidden_size(model: nn.Module) -> int:
    """Width D of a model's final hidden state."""
    cfg = getattr(model, "config", None)
    for attr in ("d_model", "hidden_size", "n_embd"):
        if cfg is not None and isinstance(getattr(cfg, attr, None), int):
            return getattr(cfg, attr)
    raise LmforgeError(f"cannot tell the hidden size of {type(model).__name__}")


def reward_pair_loss(
    rm: RewardModel, chunk: Sequence[Any], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bradley–Terry losses (B,) and correct-order flags (B,) of a chunk of pairs."""
    device = next(rm.parameters()).device
    s = rm(pair_batch(chunk, pad_id).to(device))
    sc, sr = s[: len(chunk)], s[len(chunk) :]
    return bradley_terry_loss(sc, sr), (sc > sr).float() + 0.5 * (sc == sr).float()


def train_reward_model(
    rm: RewardModel, train_pairs: Sequence[Any], eval_pairs: Sequence[Any], lr: float = 1e-5,
    epochs: int = 1, batch_size: int = 8, pad_id: int = 0, seed: int = 0, progress: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Fit a reward model on preference pairs; held-out pair accuracy before and after."""
    from tqdm import tqdm

    def accuracy() -> float:
        with torch.no_grad():
            hits = [reward_pair_loss(rm, eval_pairs[i : i + batch_size], pad_id)[1]
                    for i in range(0, len(eval_pairs), batch_size)]  # fmt: skip
        return float(torch.cat(hits).mean()) if hits else float("nan")

    before = accuracy()
    opt = torch.optim.AdamW(rm.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    history = []
    rm.train()
    for _ in range(epochs):
        order = list(range(len(train_pairs)))
        rng.shuffle(order)
        for i in tqdm(range(0, len(order), batch_size), desc="reward model", disable=not progress):
            loss, hit = reward_pair_loss(
                rm, [train_pairs[j] for j in order[i : i + batch_size]], pad_id
            )
            opt.zero_grad(set_to_none=True)
            loss.mean().backward()
            opt.step()
            history.append({"loss": float(loss.detach().mean()), "accuracy": float(hit.mean())})
    rm.eval()
    return {"before": before, "after": accuracy(), "history": history}
