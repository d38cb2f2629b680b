"""Next-token sampling: a pure function of the logits (and a random generator).

Shape legend: B batch, V vocab.
"""

from __future__ import annotations

import torch


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token id per row of ``logits`` (B, V) -> (B,) long.

    ``temperature`` ≤ 0 means greedy (argmax; top-k/top-p are then irrelevant). Otherwise the
    logits are divided by the temperature, then restricted to the ``top_k`` largest (exactly k
    tokens, ties broken by index) and then to the smallest set of most likely tokens whose
    probability reaches ``top_p`` (the token that crosses the threshold is kept, so at least
    one token always survives). Sampling uses ``generator`` when given, else torch's global RNG.
    Exercised by ``pytest tests/test_generate.py -k sample``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (B, V), got shape {tuple(logits.shape)}")
    if temperature <= 0:
        return logits.argmax(dim=-1)  # (B,)
    scores = logits.float() / temperature  # (B, V)
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        values, indices = scores.topk(top_k, dim=-1)  # (B, k)
        scores = torch.full_like(scores, float("-inf")).scatter(-1, indices, values)
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)  # (B, V)
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (B, V)
        # Drop a token when the more likely ones already reach top_p; the first always stays.
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # (B, V)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
