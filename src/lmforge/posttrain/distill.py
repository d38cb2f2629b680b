"""Logit distillation from a teacher, on a corpus (the teacher scores fixed sequences) or
on-policy (the student samples on the serving engine, the teacher scores every sampled token,
as in GKD): forward KL, reverse KL or generalised JSD with a temperature
(:func:`lmforge.posttrain.losses.distill_token_loss`). Teacher and student can differ in size;
their vocabularies must match. Shape legend: B batch, T tokens, V vocab.
Exercised by ``pytest tests/test_posttrain_distill.py``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.config import DistillConfig
from lmforge.posttrain.core import (
    IGNORE,
    Batch,
    Example,
    collate,
    model_logits,
    prompt_response_example,
    set_random_state,
)
from lmforge.posttrain.losses import distill_token_loss
from lmforge.posttrain.rollout import rollout_engine, sample
from lmforge.utils.errors import LmforgeError


def check_vocabularies(teacher: nn.Module, student: nn.Module) -> None:
    """One-line error unless teacher and student share the vocabulary size (each model's
    config's, else the width of a one-token forward's logits)."""
    sizes = []
    for model in (teacher, student):
        v = getattr(getattr(model, "config", None), "vocab_size", None)
        if not isinstance(v, int):
            with torch.no_grad():
                dev = next(model.parameters()).device
                v = model_logits(model, torch.zeros(1, 1, dtype=torch.long, device=dev)).shape[-1]
        sizes.append(v)
    vt, vs = sizes
    if vt != vs:
        raise LmforgeError(f"teacher vocabulary ({vt}) differs from the student's ({vs}): "
                           "distillation needs the same tokenizer")  # fmt: skip


def distill_loss(
    student: nn.Module, teacher: nn.Module, batch: Batch, cfg: DistillConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed divergence over the labelled positions of ``batch``, their count)."""
    s = model_logits(student, batch.input_ids)  # (B, T, V)
    with torch.no_grad():
        t = model_logits(teacher, batch.input_ids)  # (B, T, V)
    per = distill_token_loss(s, t, cfg.loss, cfg.temperature, cfg.beta)  # (B, T)
    mask = batch.labels != IGNORE
    return (per * mask).sum(), mask.sum().float()


class DistillObjective:
    """Distillation as a :class:`~lmforge.train.Objective`: ``batch_size`` sequences per
    micro-batch from ``corpus`` or, on-policy, sampled by the student from ``prompts`` (seeded,
    so a resumed run samples the same); loss summed over target tokens, their count the weight."""

    name = "distill"

    def __init__(
        self,
        teacher: nn.Module,
        cfg: DistillConfig,
        batch_size: int,
        *,
        corpus: Sequence[Example] | None = None,
        prompts: Sequence[list[int]] | None = None,
        eos_ids: Sequence[int] = (),
        seed: int = 0,
        pad_id: int = 0,
    ) -> None:
        if (corpus is None) == (prompts is None):
            raise LmforgeError("distillation needs exactly one of a corpus or prompts (on-policy)")
        if not (corpus or prompts):
            raise LmforgeError("no distillation data")
        self.teacher, self.cfg, self.batch_size = teacher, cfg, batch_size
        self.corpus, self.prompts = corpus, prompts
        self.eos, self.pad_id = list(eos_ids), pad_id
        self.rng = random.Random(seed)
        self.engine: Any = None
        self.version = 0

    def before_step(self, trainer: Any, step: int) -> None:
        """On-policy: the engine (built once, on the student) samples under this step's weights."""
        if self.prompts is not None and self.engine is None:
            self.engine = rollout_engine(trainer.model, self.eos)
        self.version = step - 1

    def next_batch(self) -> Batch:
        """The next ``batch_size`` sequences (sampled by the student on-policy)."""
        if self.corpus is not None:
            exs = [self.corpus[self.rng.randrange(len(self.corpus))]
                   for _ in range(self.batch_size)]  # fmt: skip
        else:
            assert self.prompts is not None
            ps = [self.prompts[self.rng.randrange(len(self.prompts))]
                  for _ in range(self.batch_size)]  # fmt: skip
            outs = sample(self.engine, ps, self.rng, self.version, max_tokens=self.cfg.max_tokens,
                          eos_ids=self.eos)  # fmt: skip
            exs = [prompt_response_example(p, o.outputs[0].token_ids or [self.pad_id])
                   for p, o in zip(ps, outs)]  # fmt: skip
        device = next(self.teacher.parameters()).device
        return collate(exs, self.pad_id).to(device)

    def batch_weight(self, batch: Batch) -> float:
        """Target tokens."""
        return float((batch.labels != IGNORE).sum())

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed divergence, target tokens)."""
        return distill_loss(model, self.teacher, batch, self.cfg)

    def state_dict(self) -> dict:
        """The RNG that picks sequences or prompts and sampling seeds."""
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        set_random_state(self.rng, state["rng"])
