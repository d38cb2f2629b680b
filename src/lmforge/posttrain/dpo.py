"""Preference optimisation: DPO, IPO, conservative DPO and SimPO, and a Bradley–Terry reward model.

Data: JSONL (or .jsonl.gz) records ``{"prompt", "chosen", "rejected"}``, or HH-RLHF's
``{"chosen", "rejected"}`` full dialogues (``\\n\\nHuman: … \\n\\nAssistant: …``), split at their
last common ``\\n\\nAssistant:`` into a shared prompt and the two final replies.

:class:`DPOObjective` and :class:`RewardModelObjective` run in the one Trainer loop. Metrics:
reward accuracy (implicit reward of chosen > rejected) and margin, on training batches and on
a held-out split. Shape legend: B pairs, T tokens.
Exercised by ``pytest tests/test_posttrain_dpo.py``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.config import DPOConfig
from lmforge.posttrain.core import (
    Batch,
    collate,
    encode_text,
    prompt_response_example,
    sequence_logprobs,
    set_random_state,
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


def _pair_scores(
    model: nn.Module, chunk: Sequence[Any], cfg: DPOConfig, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # chosen and rejected scores (B,) each from one forward of 2B rows: summed response
    # log-probs (IPO and SimPO: averaged over the response tokens)
    batch = pair_batch(chunk, pad_id).to(next(model.parameters()).device)
    logp, _ = sequence_logprobs(model, batch.input_ids, batch.labels)
    s = (logp * batch.mask).sum(-1)  # (2B,)
    if cfg.loss in ("ipo", "simpo"):
        s = s / batch.mask.sum(-1).clamp_min(1)
    return s[: len(chunk)], s[len(chunk) :]


@torch.no_grad()
def reference_scores(
    model: nn.Module, pairs: Sequence[Any], cfg: DPOConfig, pad_id: int, progress: bool = False,
    batch_size: int = 8,
) -> torch.Tensor:  # fmt: skip
    """The reference policy's scores (N, 2): computed once, before training, and cached."""
    from tqdm import tqdm

    out = []
    for i in tqdm(range(0, len(pairs), batch_size), desc="reference", disable=not progress):
        pc, pr = _pair_scores(model, pairs[i : i + batch_size], cfg, pad_id)
        out.append(torch.stack([pc, pr], -1).cpu())
    return torch.cat(out)


def pair_losses(
    model: nn.Module, chunk: Sequence[Any], ref: torch.Tensor, cfg: DPOConfig, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and implicit rewards (chosen, rejected) of a chunk of pairs."""
    pc, pr = _pair_scores(model, chunk, cfg, pad_id)
    if cfg.loss == "simpo":
        return simpo_loss(pc, pr, cfg.beta, cfg.simpo_gamma)
    if cfg.loss not in ("dpo", "ipo", "cdpo"):
        raise LmforgeError(f"unknown preference loss {cfg.loss!r} (dpo, ipo, cdpo, simpo)")
    ref = ref.to(pc.device)
    return dpo_loss(pc, pr, ref[:, 0], ref[:, 1], cfg.beta, cfg.loss, cfg.label_smoothing)  # type: ignore[arg-type]


def _ordered(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    # 1 per pair scored in the right order, ½ for a tie
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


@torch.no_grad()
def preference_accuracy(
    model: nn.Module, pairs: Sequence[Any], ref: torch.Tensor, cfg: DPOConfig, pad_id: int,
    batch_size: int = 8,
) -> dict[str, float]:  # fmt: skip
    """Held-out accuracy of the implicit reward (ties count ½), its mean margin, and the
    accuracy of the policy's own log-probs (log π(chosen) > log π(rejected), no reference)."""
    acc, margin, lp_acc = 0.0, 0.0, 0.0
    for i in range(0, len(pairs), batch_size):
        pc, pr = _pair_scores(model, pairs[i : i + batch_size], cfg, pad_id)
        lp_acc += float(_ordered(pc, pr).sum())
        if cfg.loss == "simpo":
            rc, rr = cfg.beta * pc, cfg.beta * pr
        else:
            r = ref[i : i + batch_size].to(pc.device)
            rc, rr = cfg.beta * (pc - r[:, 0]), cfg.beta * (pr - r[:, 1])
        acc += float(_ordered(rc, rr).sum())
        margin += float((rc - rr).sum())
    n = len(pairs)
    return {"accuracy": acc / n, "margin": margin / n, "logp_accuracy": lp_acc / n}


class _PairObjective:
    """What the preference objectives share: training pairs, ``batch_size`` at a time, in an
    order shuffled per epoch (order, position and RNG are the resume state); held-out pairs."""

    def __init__(
        self,
        train_pairs: Sequence[Any],
        eval_pairs: Sequence[Any],
        batch_size: int,
        seed: int,
        pad_id: int,
    ) -> None:
        if not train_pairs:
            raise LmforgeError("no training pairs")
        self.train_pairs, self.eval_pairs = list(train_pairs), list(eval_pairs)
        self.batch_size, self.pad_id = batch_size, pad_id
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.pos = 0

    def _next_indices(self) -> list[int]:
        if self.pos >= len(self.order):
            self.order = list(range(len(self.train_pairs)))
            self.rng.shuffle(self.order)
            self.pos = 0
        idx = self.order[self.pos : self.pos + self.batch_size]
        self.pos += len(idx)
        return idx

    def state_dict(self) -> dict:
        """Pair order, position and RNG."""
        return {"stream": {"rng": self.rng.getstate(), "order": list(self.order), "pos": self.pos}}

    def load_state_dict(self, state: dict) -> None:
        set_random_state(self.rng, state["stream"]["rng"])
        self.order, self.pos = list(state["stream"]["order"]), int(state["stream"]["pos"])


def steps_per_epoch(n_pairs: int, batch_size: int) -> int:
    """Optimizer steps of one pass over ``n_pairs`` (the last batch may be smaller)."""
    return -(-n_pairs // batch_size)


class DPOObjective(_PairObjective):
    """DPO, IPO, cDPO or SimPO as a :class:`~lmforge.train.Objective`: ``batch_size`` pairs a
    micro-batch, ``loss`` the sum of the per-pair losses with weight B. The reference policy's
    scores are computed once from the starting weights (``reference="cached"``; kept in the
    objective's state, so a resumed run keeps them) or by a frozen copy of the starting model
    on every batch (``"online"``)."""

    name = "dpo"

    def __init__(
        self,
        model: nn.Module,
        train_pairs: Sequence[Any],
        eval_pairs: Sequence[Any],
        cfg: DPOConfig,
        batch_size: int,
        seed: int = 0,
        pad_id: int = 0,
        progress: bool = False,
    ) -> None:
        super().__init__(train_pairs, eval_pairs, batch_size, seed, pad_id)
        self.cfg, self.progress = cfg, progress
        self.start = model  # the reference: scored before the first step, or kept frozen
        self.ref_model: nn.Module | None = None
        if cfg.reference == "online" and cfg.loss != "simpo":
            from lmforge.posttrain.models import clone_frozen

            self.ref_model = clone_frozen(model)
        self.ref_train: torch.Tensor | None = None
        self.ref_eval: torch.Tensor | None = None
        self._stats: list[torch.Tensor] = []

    def _refs(self) -> None:
        # Cached reference scores, from the starting weights (before any step runs).
        if self.ref_train is not None or self.ref_model is not None or self.cfg.loss == "simpo":
            return
        bs = self.batch_size
        self.ref_train = reference_scores(self.start, self.train_pairs, self.cfg, self.pad_id,
                                          self.progress, bs)  # fmt: skip
        self.ref_eval = (
            reference_scores(self.start, self.eval_pairs, self.cfg, self.pad_id, batch_size=bs)
            if self.eval_pairs
            else torch.zeros(0, 2)
        )

    def _ref_of(self, pairs: Sequence[Any], cached: torch.Tensor | None) -> torch.Tensor:
        if self.cfg.loss == "simpo":
            return torch.zeros(len(pairs), 2)
        if self.ref_model is not None:
            return reference_scores(self.ref_model, pairs, self.cfg, self.pad_id,
                                    batch_size=self.batch_size)  # fmt: skip
        assert cached is not None
        return cached

    def next_batch(self) -> tuple[list[Any], torch.Tensor]:
        """The next pairs and their reference scores (B, 2)."""
        self._refs()
        idx = self._next_indices()
        pairs = [self.train_pairs[j] for j in idx]
        cached = self.ref_train[idx] if self.ref_train is not None else None
        return pairs, self._ref_of(pairs, cached)

    def batch_weight(self, batch: tuple[list[Any], torch.Tensor]) -> float:
        """Pairs in the micro-batch."""
        return float(len(batch[0]))

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-pair losses, pairs)."""
        pairs, ref = batch
        loss, rc, rr = pair_losses(model, pairs, ref, self.cfg, self.pad_id)
        d = torch.stack([(rc > rr).float().sum(), (rc - rr).sum(), rc.sum(), rr.sum(),
                         torch.tensor(float(len(pairs)), device=rc.device)]).detach()  # fmt: skip
        self._stats.append(d.cpu())
        return loss.sum(), torch.tensor(float(len(pairs)))

    def metrics(self) -> dict[str, float]:
        """Implicit-reward accuracy, margin and means over the last step's pairs."""
        if not self._stats:
            return {}
        acc, margin, rc, rr, n = torch.stack(self._stats).sum(0).tolist()
        self._stats = []
        return {"reward_accuracy": acc / n, "reward_margin": margin / n,
                "reward_chosen": rc / n, "reward_rejected": rr / n}  # fmt: skip

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out accuracy and margin of the implicit reward, and log-prob accuracy."""
        if not self.eval_pairs:
            return {}
        self._refs()
        ref = self._ref_of(self.eval_pairs, self.ref_eval)
        got = preference_accuracy(model, self.eval_pairs, ref, self.cfg, self.pad_id,
                                  self.batch_size)  # fmt: skip
        return {f"eval_{k}": v for k, v in got.items()}

    def state_dict(self) -> dict:
        """Pair order, position, RNG and the cached reference scores."""
        out = super().state_dict()
        if self.ref_train is not None:
            out["ref_train"], out["ref_eval"] = self.ref_train, self.ref_eval
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "ref_train" in state:
            self.ref_train, self.ref_eval = state["ref_train"], state["ref_eval"]


# -- Reward model


class RewardModel(nn.Module):
    """An LM (lmforge or transformers) with a scalar head on the last response token's final
    hidden state (the LM head's logits are not computed)."""

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
    return bradley_terry_loss(sc, sr), _ordered(sc, sr)


class RewardModelObjective(_PairObjective):
    """A Bradley–Terry reward model as a :class:`~lmforge.train.Objective`: the Trainer's model
    is the :class:`RewardModel` (LM + scalar head); loss −log σ(s_chosen − s_rejected) summed
    over the pairs, weight B; ``evaluate`` gives the held-out pair accuracy."""

    name = "reward_model"

    def __init__(
        self, train_pairs: Sequence[Any], eval_pairs: Sequence[Any], batch_size: int,
        seed: int = 0, pad_id: int = 0,
    ) -> None:  # fmt: skip
        super().__init__(train_pairs, eval_pairs, batch_size, seed, pad_id)
        self._hits: list[float] = []

    def next_batch(self) -> list[Any]:
        return [self.train_pairs[j] for j in self._next_indices()]

    def batch_weight(self, batch: list[Any]) -> float:
        """Pairs in the micro-batch."""
        return float(len(batch))

    def loss(self, model: nn.Module, batch: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of Bradley–Terry losses, pairs)."""
        loss, hit = reward_pair_loss(model, batch, self.pad_id)  # type: ignore[arg-type]
        self._hits.extend(hit.detach().cpu().tolist())
        return loss.sum(), torch.tensor(float(len(batch)))

    def metrics(self) -> dict[str, float]:
        """Pair accuracy over the last step."""
        out = {"accuracy": sum(self._hits) / len(self._hits)} if self._hits else {}
        self._hits = []
        return out

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out pair accuracy."""
        hits = [reward_pair_loss(model, self.eval_pairs[i : i + self.batch_size], self.pad_id)[1]  # type: ignore[arg-type]
                for i in range(0, len(self.eval_pairs), self.batch_size)]  # fmt: skip
        return {"eval_accuracy": float(torch.cat(hits).mean())} if hits else {}
