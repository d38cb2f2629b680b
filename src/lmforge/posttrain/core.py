"""Building blocks shared by every post-training loop: model calls, tokenization with a response
mask, per-token log-probs and entropy, masked reductions and a gradient-accumulation step.

Everything works on any module mapping token ids to logits: an lmforge ``TransformerLM`` (called
as ``model(ids)``), or a transformers model (called as ``model(input_ids=...)`` and read through
``.logits``). Tokenizers are anything with ``encode(str) -> list[int]`` (lmforge's ``Tokenizer``)
or a transformers tokenizer (``encode(text, add_special_tokens=False)``).

Shape legend: B batch, T sequence, V vocab.
Exercised by ``pytest tests/test_posttrain_core.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lmforge.utils.errors import LmforgeError

IGNORE = -100
"label value of positions that carry no loss (prompt, padding)"


def is_lmforge_model(model: nn.Module) -> bool:
    """Whether ``model`` is an lmforge ``TransformerLM`` (has ``forward_hidden`` and a config)."""
    return hasattr(model, "forward_hidden") and hasattr(model, "config")


def model_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention: Any | None = None,
) -> torch.Tensor:
    """Logits (B, T, V) of token ids (B, T) under any token-ids → logits module.

    ``attention`` is optional packing information (a :class:`~lmforge.posttrain.packing.Packed`
    mask object, see there); without it every row is one causal sequence starting at position 0.
    """
    if attention is not None:
        return attention.logits(model, input_ids)
    if is_lmforge_model(model):
        return model(input_ids)  # (B, T, V)
    out = model(input_ids=input_ids)
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor):
        raise LmforgeError(
            f"model {type(model).__name__} returned {type(out).__name__}, expected logits or an "
            "output with .logits"
        )
    return logits


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log_softmax(logits / T)[label] per position, in float32: (B, T, V), (B, T) -> (B, T).

    T ≤ 0 (greedy) counts as 1, as the rollout contract says. Labels equal to :data:`IGNORE`
    give 0. This is the exact definition the rollout engine records, so at learning rate 0
    every importance ratio is 1.
    """
    t = 1.0 if temperature <= 0 else float(temperature)
    scaled = logits.float() / t if t != 1.0 else logits.float()
    safe = labels.clamp_min(0)
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return logp.masked_fill(labels == IGNORE, 0.0)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of each position's next-token distribution: (B, T, V) -> (B, T), float32."""
    t = 1.0 if temperature <= 0 else float(temperature)
    logp = torch.log_softmax(logits.float() / t, dim=-1)  # (B, T, V)
    return -(logp.exp() * logp).sum(-1)  # (B, T)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is true (over everything, or along ``dim``); 0 where empty."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp_min(1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def masked_sum_normalize(
    x: torch.Tensor, mask: torch.Tensor, constant: float, dim: int | None = None
) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is true, divided by a fixed ``constant`` (not the count).

    Dr. GRPO's aggregation: a constant normalizer keeps long and short responses weighted by
    their token counts instead of inflating the short ones' per-token gradient.
    """
    if constant <= 0:
        raise ValueError(f"constant must be positive, got {constant}")
    m = mask.to(x.dtype)
    return (x * m).sum() / constant if dim is None else (x * m).sum(dim) / constant


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x − mean) / std over the masked entries (unbiased variance), as PPO whitens advantages."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum().clamp_min(2).to(x.dtype)
    var = var * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    attention: Any | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (B, T) of ``labels`` under ``model`` given ``input_ids`` (and, when
    asked, per-token entropies (B, T)); positions with label :data:`IGNORE` give 0."""
    logits = model_logits(model, input_ids, attention)  # (B, T, V)
    logp = token_logprobs(logits, labels, temperature)
    ent = token_entropy(logits, temperature) if with_entropy else None
    return logp, ent


# ---------------------------------------------------------------------------------------------
# Tokenization


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with either tokenizer family, never adding BOS/EOS by itself."""
    if hasattr(tokenizer, "apply_chat_template") or hasattr(tokenizer, "convert_tokens_to_ids"):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def decode_ids(tokenizer: Any, ids: Sequence[int]) -> str:
    """Text of token ids with either tokenizer family."""
    if hasattr(tokenizer, "convert_tokens_to_ids"):
        return tokenizer.decode(list(ids), skip_special_tokens=False)
    return tokenizer.decode(list(ids))


@dataclasses.dataclass
class Example:
    """One tokenized training sequence: ``tokens`` and a same-length ``trainable`` flag per token
    (True where the token is a target: assistant/response tokens)."""

    tokens: list[int]
    trainable: list[bool]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.trainable):
            raise ValueError("tokens and trainable must have the same length")

    def shifted(self) -> tuple[list[int], list[int]]:
        """``(inputs, labels)`` of length n−1: labels are the next tokens, IGNORE where the
        next token is not trainable (prompt) — the model is never trained to predict the prompt."""
        inputs = self.tokens[:-1]
        labels = [t if m else IGNORE for t, m in zip(self.tokens[1:], self.trainable[1:])]
        return inputs, labels


def prompt_response_example(
    prompt_ids: Sequence[int], response_ids: Sequence[int], eos_id: int | None = None
) -> Example:
    """Prompt then response (then ``eos_id`` when given, trained too); loss on the response only."""
    resp = list(response_ids) + ([] if eos_id is None else [eos_id])
    if not prompt_ids:
        raise LmforgeError("a prompt needs at least one token")
    return Example(list(prompt_ids) + resp, [False] * len(prompt_ids) + [True] * len(resp))


@dataclasses.dataclass
class Batch:
    """Right-padded tensors of a list of :class:`Example`: ``input_ids`` (B, T), ``labels`` (B, T)
    (IGNORE on prompt and padding), ``mask`` (B, T) bool = labels != IGNORE."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        """(B, T) bool: positions carrying a loss."""
        return self.labels != IGNORE

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on ``device``."""
        return Batch(self.input_ids.to(device), self.labels.to(device))


def collate(examples: Sequence[Example], pad_id: int = 0, max_len: int | None = None) -> Batch:
    """Stack examples into one right-padded :class:`Batch` (truncated to ``max_len`` inputs)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    pairs = [ex.shifted() for ex in examples]
    if max_len is not None:
        pairs = [(i[:max_len], lab[:max_len]) for i, lab in pairs]
    t = max(len(i) for i, _ in pairs)
    ids = torch.full((len(pairs), t), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((len(pairs), t), IGNORE, dtype=torch.long)  # (B, T)
    for row, (i, lab) in enumerate(pairs):
        ids[row, : len(i)] = torch.tensor(i, dtype=torch.long)
        labels[row, : len(lab)] = torch.tensor(lab, dtype=torch.long)
    return Batch(ids, labels)


# ---------------------------------------------------------------------------------------------
# Gradient accumulation


def accumulate_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], tuple[torch.Tensor, float]],
    max_grad_norm: float | None = None,
    weights: Sequence[float] | None = None,
) -> dict[str, float]:
    """One optimizer step over several micro-batches; returns ``loss``, ``grad_norm``, ``weight``.

    Loss normalization (stated, and tested): ``loss_fn(model, mb)`` returns ``(loss_sum,
    weight)`` — the *sum* of the per-unit losses in the micro-batch and how many units it holds
    (tokens for a token-level mean, sequences for a per-sequence mean). The step minimises
    Σ loss_sum / Σ weight over all micro-batches, so the gradient equals the one of the whole
    batch at once however it is split (a mean of micro-batch means would over-weight small
    micro-batches). With ``weights`` (each micro-batch's weight, known up front) every backward
    runs right after its forward with its final scale; without, the graphs are kept until the
    total is known (fine for small models; pass ``weights`` for large ones).
    """
    if not micro_batches:
        raise ValueError("accumulate_step needs at least one micro-batch")
    optimizer.zero_grad(set_to_none=True)
    total = None if weights is None else float(sum(weights))
    pending: list[torch.Tensor] = []
    loss_total = 0.0
    weight_total = 0.0
    for mb in micro_batches:
        loss_sum, weight = loss_fn(model, mb)
        weight_total += float(weight)
        loss_total += float(loss_sum.detach())
        if total is not None:
            if total > 0:
                (loss_sum / total).backward()
        else:
            pending.append(loss_sum)
    if pending and weight_total > 0:
        torch.autograd.backward([ls / weight_total for ls in pending])
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if max_grad_norm is not None and params:
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    elif params:
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
    else:
        norm = 0.0
    optimizer.step()
    return {
        "loss": loss_total / max(weight_total, 1e-12),
        "grad_norm": norm if math.isfinite(norm) else float("nan"),
        "weight": weight_total,
    }
