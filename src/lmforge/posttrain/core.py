"""Building blocks shared by every post-training objective: model calls, tokenization with a
response mask, per-token log-probs and entropy, masked reductions.

Everything works on any module mapping token ids to logits (an lmforge ``TransformerLM`` or a
transformers model) and any tokenizer with ``encode(str) -> list[int]`` (lmforge's or a
transformers one, called with ``add_special_tokens=False``).

Shape legend: B batch, T sequence, V vocab.
Exercised by ``pytest tests/test_posttrain_core.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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
    """Logits (B, T, V) of token ids (B, T) under any token-ids → logits module. ``attention``:
    optional :class:`~lmforge.posttrain.packing.Packed` information; without it every row is
    one causal sequence starting at position 0."""
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
    T ≤ 0 (greedy) counts as 1 and :data:`IGNORE` labels give 0: the exact definition the
    rollout engine records (:mod:`lmforge.posttrain.rollout`)."""
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
    """Sum of ``x`` where ``mask`` is true, divided by a fixed ``constant`` (not the count): Dr.
    GRPO's aggregation, which does not inflate short responses' per-token gradient."""
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


# -- Tokenization


def set_random_state(rng: Any, state: Any) -> None:
    """``rng.setstate(state)`` for a ``random.Random`` state read back from a checkpoint
    (``torch.load`` gives its inner tuple as a list)."""
    v, internal, gauss = state
    rng.setstate((v, tuple(internal), gauss))


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
