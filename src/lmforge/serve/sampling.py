"""Per-request sampling: parameters, and pure functions of a batch of logits.

Shape legend: B rows (one per sequence sampled this step), V vocab, N top-n logprobs, L the
longest output among the penalised rows.

Order of a step (as vLLM's sampler): :func:`apply_penalties` (``logit_bias``, then the
repetition, frequency and presence penalties, which need each row's prompt and output ids),
then :func:`logprobs_of` (temperature, log-softmax), then :func:`sample_tokens` (truncation and
the draw). Rows that ask for none of the penalties cost nothing in the first stage.

Logprob semantics (the RL trainer depends on them): the logprob reported for a sampled token is
``log_softmax(logits / T)[token]`` over the full vocabulary in float32, T the request's
temperature (T = 1 for greedy), taken *before* top-k / top-p / min-p truncation. A trainer that
recomputes ``log_softmax(model(x) / T)`` gets the same number, so at learning rate 0 every
importance ratio is 1. Truncation only changes which token is drawn. With a logit bias or a
penalty the reported logprob is of the biased / penalised logits (the distribution the token
was drawn from); RL rollouts use neither.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from lmforge.utils.errors import LmforgeError

__all__ = [
    "SamplingParams",
    "apply_penalties",
    "apply_penalties_reference",
    "logprobs_of",
    "sample_tokens",
    "truncated_probs",
]


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
    presence_penalty: float = 0.0
    "subtracted from the logit of every token already in the output, once (OpenAI, [-2, 2])"
    frequency_penalty: float = 0.0
    "subtracted from a token's logit once per time it is in the output (OpenAI, [-2, 2])"
    repetition_penalty: float = 1.0
    "tokens in the prompt or output: positive logits divided by it, negative multiplied (HF)"
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    "token id -> added to its logit, in [-100, 100] (kept as sorted (id, bias) pairs)"

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (0 < self.repetition_penalty <= 100 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}"
            )
        items = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        pairs = []
        for t, b in items:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r}")
            pairs.append((t, float(b)))
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs)))

    def check_vocab(self, vocab_size: int) -> None:
        """Raise LmforgeError (one line) when a ``logit_bias`` id is not in ``[0, vocab_size)``."""
        for t, _ in self.logit_bias:  # type: ignore[misc]
            if t >= vocab_size:
                raise LmforgeError(f"logit_bias token id {t} is not in [0, {vocab_size})")

    @property
    def penalised(self) -> bool:
        """Whether :func:`apply_penalties` changes this row (needs its prompt / output ids)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        """Whether the sample is the argmax (temperature 0)."""
        return self.temperature == 0


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    n_prompt: Sequence[int],
) -> torch.Tensor:
    """``logits`` (B, V) with each row's logit bias and penalties applied: (B, V).

    Row i's sequence is ``token_ids[i]``: its first ``n_prompt[i]`` ids are the prompt, the
    rest the output so far. In order: ``logit_bias`` is added; the repetition penalty divides
    the positive (multiplies the negative) logits of tokens seen in the prompt or the output;
    the frequency penalty is subtracted once per occurrence in the output, the presence penalty
    once per distinct output token (OpenAI's definitions; prompts do not count for them).
    Returns ``logits`` itself when no row is penalised, else a new float32 tensor. Batched:
    one scatter of the output counts for all penalised rows, no per-token Python on the
    device. :func:`apply_penalties_reference` is the readable version it is tested against.
    """
    rows = [i for i, p in enumerate(params) if p.penalised]
    if not rows:
        return logits
    x = logits.float().clone()  # (B, V): pure (the caller's logits are not changed)
    V, dev = x.shape[-1], x.device
    bias_r, bias_t, bias_v = [], [], []
    for i in rows:
        for t, b in params[i].logit_bias:  # type: ignore[misc]
            bias_r.append(i)
            bias_t.append(t)
            bias_v.append(b)
    if bias_r:
        idx = (torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev))
        x.index_put_(idx, torch.tensor(bias_v, device=dev), accumulate=True)
    pen = [i for i in rows if params[i].presence_penalty or params[i].frequency_penalty
           or params[i].repetition_penalty != 1.0]  # fmt: skip
    if not pen:
        return x
    outs = [list(token_ids[i][n_prompt[i] :]) for i in pen]
    width = max(1, max(len(o) for o in outs))
    padded = torch.tensor([o + [V] * (width - len(o)) for o in outs], device=dev)  # (R, L)
    counts = torch.zeros(len(pen), V + 1, device=dev)  # (R, V + 1): column V takes the padding
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    counts = counts[:, :V]  # (R, V)
    sub = x[pen]  # (R, V)
    rep = [params[i].repetition_penalty for i in pen]
    if any(r != 1.0 for r in rep):
        seen = counts > 0  # (R, V)
        for j, i in enumerate(pen):
            if rep[j] != 1.0:
                prompt = torch.tensor(list(token_ids[i][: n_prompt[i]]), device=dev)
                seen[j, prompt] = True
        r = torch.tensor(rep, device=dev)[:, None]  # (R, 1)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    freq = torch.tensor([params[i].frequency_penalty for i in pen], device=dev)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in pen], device=dev)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).float()  # (R, V)
    x[pen] = sub
    return x


def apply_penalties_reference(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    n_prompt: Sequence[int],
) -> torch.Tensor:
    """:func:`apply_penalties` one row and one token at a time, in float64 (the test oracle)."""
    out = logits.double().clone()  # (B, V)
    for i, p in enumerate(params):
        row = out[i]
        for t, b in p.logit_bias:  # type: ignore[misc]
            row[t] += b
        prompt = list(token_ids[i][: n_prompt[i]])
        output = list(token_ids[i][n_prompt[i] :])
        if p.repetition_penalty != 1.0:
            for t in set(prompt) | set(output):
                v = float(row[t])
                row[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(output):
            row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


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
        if not p.greedy and g is None and p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0
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
