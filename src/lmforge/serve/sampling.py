"""Per-request sampling: parameters, and pure functions of a batch of logits.

Shape legend: B rows (one per sequence sampled this step), V vocab, N top-n logprobs.

Logprob semantics (the RL trainer depends on them): the logprob reported for a sampled token is
``log_softmax(logits / T)[token]`` over the full vocabulary in float32, T the request's
temperature (T = 1 for greedy), taken *before* top-k / top-p / min-p truncation. A trainer that
recomputes ``log_softmax(model(x) / T)`` gets the same number, so at learning rate 0 every
importance ratio is 1. Truncation only changes which token is drawn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = ["SamplingParams", "logprobs_of", "sample_tokens", "truncated_probs"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled (OpenAI's knobs plus RL's needs)."""

    temperature: float = 1.0
    "softmax temperature; 0 = greedy (argmax)"
    top_k: int = 0
    "keep the k most likely tokens (0 = off)"
    top_p: float = 1.0
    "keep the smallest set of most likely tokens whose probability reaches top_p (1 = off)"
    min_p: float = 0.0
    "drop tokens whose probability is below min_p × the most likely one's (0 = off)"
    max_tokens: int = 16
    "most new tokens per sample"
    n: int = 1
    "independent samples of the prompt"
    seed: int | None = None
    "per-request RNG seed (sample i of n uses seed + i); None = the engine's generator"
    stop_token_ids: tuple[int, ...] = ()
    "ids that end a sample (returned as its last token, finish_reason 'stop')"
    logprobs: int | None = None
    "also return the top-n alternatives' logprobs at every step (None = off)"
    ignore_eos: bool = False
    "keep going past the engine's EOS id (benchmarks)"
    stop: Sequence[str] = ()
    "strings that end a sample once its text contains one (the engine needs a tokenizer)"

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.stop, str):
            raise ValueError("stop must be a list of strings, not one string")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        """Whether the sample is the argmax (temperature 0)."""
        return self.temperature == 0


def _effective_temperature(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [p.temperature if p.temperature > 0 else 1.0 for p in params],
        dtype=torch.float32,
        device=device,
    )  # (B,)


def logprobs_of(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``log_softmax(logits / T)`` per row, float32, full vocabulary: (B, V) -> (B, V)."""
    t0 = params[0].temperature if params else 1.0
    if all(p.temperature == t0 for p in params):  # one temperature: a scalar, no tensor built
        t = t0 if t0 > 0 else 1.0
        x = logits.float()
        return torch.log_softmax(x if t == 1.0 else x / t, dim=-1)  # (B, V)
    temps = _effective_temperature(params, logits.device)
    return torch.log_softmax(logits.float() / temps[:, None], dim=-1)  # (B, V)


def truncated_probs(logprobs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution one row is drawn from: its (V,) logprobs after top-k, top-p, min-p.

    Order as in vLLM / HF: top-k, then top-p on what is left (the token crossing the threshold is
    kept), then min-p relative to the most likely token. At least one token always survives.
    """
    lp = logprobs  # (V,)
    if p.top_k and p.top_k < lp.shape[-1]:
        kth = lp.topk(p.top_k).values[-1]
        lp = lp.masked_fill(lp < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_lp, order = lp.sort(descending=True)  # (V,)
        probs = sorted_lp.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= p.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        lp = lp.masked_fill(drop, float("-inf"))
    if p.min_p > 0:
        lp = lp.masked_fill(lp < lp.max() + torch.log(torch.tensor(p.min_p)), float("-inf"))
    return lp.softmax(-1)  # (V,)


def _plain(p: SamplingParams) -> bool:
    return p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0


def sample_tokens(
    logprobs: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of ``logprobs`` (B, V) -> (B,) long.

    Greedy rows take the argmax. Other rows draw from :func:`truncated_probs` with their own
    generator when they have one (seeded requests reproduce whatever they are batched with);
    rows with no generator and no truncation are drawn together in one call (the common case
    for throughput), by the exponential race ``argmax(p / Exp(1))``, which is an exact draw;
    ``default_generator`` (None = torch's global RNG) serves the rows without their own.
    """
    out = logprobs.argmax(dim=-1)  # (B,) greedy default
    batch = [
        i
        for i, (p, g) in enumerate(zip(params, generators, strict=True))
        if not p.greedy and g is None and _plain(p)
    ]
    if batch:
        idx = torch.tensor(batch, device=logprobs.device)
        probs = logprobs[idx].exp()  # (b, V)
        noise = torch.empty_like(probs).exponential_(generator=default_generator)  # (b, V)
        race = probs / noise  # (b, V)
        out[idx] = race.argmax(dim=-1)
    done = set(batch)
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.greedy or i in done:
            continue
        probs = truncated_probs(logprobs[i], p)  # (V,)
        out[i] = torch.multinomial(probs, 1, generator=g or default_generator)[0]
    return out
