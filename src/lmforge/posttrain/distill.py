"""Logit distillation from a teacher: on a corpus (the teacher scores fixed sequences) or
on-policy (the student samples, the teacher scores every sampled token, as in GKD / on-policy
distillation). Losses: forward KL, reverse KL, generalised JSD, with a temperature
(:func:`lmforge.posttrain.losses.distill_token_loss`). Teacher and student can differ in size;
their vocabularies must match. Exercised by ``pytest tests/test_posttrain_distill.py``.

Shape legend: B batch, T tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lmforge.posttrain.core import IGNORE, Batch, collate, model_logits, prompt_response_example
from lmforge.posttrain.losses import distill_token_loss
from lmforge.posttrain.rollout import LocalEngine, SamplingParams
from lmforge.utils.errors import LmforgeError


def vocab_size(model: nn.Module) -> int:
    """Output vocabulary of a model (from its config, else from a one-token forward)."""
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    if isinstance(v, int):
        return v
    with torch.no_grad():
        dev = next(model.parameters()).device
        return model_logits(model, torch.zeros(1, 1, dtype=torch.long, device=dev)).shape[-1]


def check_vocabularies(teacher: nn.Module, student: nn.Module) -> None:
    """One-line error unless teacher and student share the vocabulary size."""
    vt, vs = vocab_size(teacher), vocab_size(student)
    if vt != vs:
        raise LmforgeError(f"teacher vocabulary ({vt}) differs from the student's ({vs}): "
                           "distillation needs the same tokenizer")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Distillation hyperparameters."""

    loss: str = "forward"
    "forward | reverse | jsd"
    temperature: float = 1.0
    "softening temperature of both distributions"
    beta: float = 0.5
    "JSD mixture weight"
    lr: float = 1e-3
    "AdamW learning rate"
    steps: int = 100
    "optimizer steps"
    batch_size: int = 16
    "sequences per step"
    max_tokens: int = 16
    "on-policy: tokens the student samples per prompt"


def distill_loss(
    student: nn.Module, teacher: nn.Module, batch: Batch, cfg: DistillConfig
) -> torch.Tensor:
    """Mean divergence over the labelled positions of ``batch``."""
    s = model_logits(student, batch.input_ids)  # (B, T, V)
    with torch.no_grad():
        t = model_logits(teacher, batch.input_ids)  # (B, T, V)
    per = distill_token_loss(s, t, cfg.loss, cfg.temperature, cfg.beta)  # type: ignore[arg-type]
    mask = batch.labels != IGNORE
    return (per * mask).sum() / mask.sum().clamp_min(1)


def train_distill(
    student: nn.Module,
    teacher: nn.Module,
    cfg: DistillConfig,
    *,
    corpus: Sequence[Any] | None = None,
    prompts: Callable[[int], list[list[int]]] | None = None,
    eos_ids: Sequence[int] = (),
    pad_id: int = 0,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Distil ``teacher`` into ``student`` in place, on ``corpus`` (a list of
    :class:`~lmforge.posttrain.core.Example`) or on-policy from ``prompts(n)``."""
    from tqdm import tqdm

    check_vocabularies(teacher, student)
    if (corpus is None) == (prompts is None):
        raise LmforgeError("distillation needs exactly one of a corpus or prompts (on-policy)")
    device = next(student.parameters()).device
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.0)
    engine = LocalEngine(student, eos_ids=eos_ids) if prompts is not None else None
    g = torch.Generator().manual_seed(0)
    history = []
    for step in tqdm(range(1, cfg.steps + 1), desc="distill", disable=not progress):
        if engine is not None:
            assert prompts is not None
            student.eval()
            ps = prompts(cfg.batch_size)
            outs = engine.generate(ps, SamplingParams(temperature=1.0, max_tokens=cfg.max_tokens))
            exs = [prompt_response_example(o.prompt_token_ids, o.outputs[0].token_ids or [pad_id])
                   for o in outs]  # fmt: skip
        else:
            assert corpus is not None
            idx = torch.randint(len(corpus), (cfg.batch_size,), generator=g).tolist()
            exs = [corpus[i] for i in idx]
        batch = collate(exs, pad_id).to(device)
        student.train()
        loss = distill_loss(student, teacher, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        history.append({"step": step, "loss": float(loss.detach())})
    student.eval()
    return history
