"""Log-likelihood scoring with a language model: continuations, rolling windows, perplexity.

The engine works on token ids (the model never sees text); the text-level helpers take a tokenizer
with ``encode``/``decode``/``eot_id`` and report per-byte numbers so models with different
tokenizers compare fairly: bits per byte = total negative log-likelihood in nats / (ln 2 · UTF-8
bytes of the scored text).

Shape legend: B batch, T sequence, D model dim, V vocab.

Exercised by ``pytest tests/test_eval_scoring.py`` and ``lmforge eval --tasks ppl,arc,mmlu``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from tqdm import tqdm

from lmforge.utils.errors import LmforgeError


class TextTokenizer(Protocol):
    """What evaluation needs from a tokenizer (lmforge's ``Tokenizer`` or the HF wrapper)."""

    eot_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _context_length(model: Any) -> int:
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "context_length", 1 << 30))


def _device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


@torch.no_grad()
def _logprobs_at(
    model: Any, batch: torch.Tensor, positions: list[torch.Tensor], targets: list[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(log p(target), target is the argmax) at given positions of each row of ``batch`` (B, T).

    Only the needed rows of the LM head are computed when the model exposes ``forward_hidden``
    (lmforge's TransformerLM), so a (B, T, V) logit tensor is never built for long contexts.
    """
    if hasattr(model, "forward_hidden") and hasattr(model, "logits_from_hidden"):
        hidden = model.forward_hidden(batch)  # (B, T, D)
        # A generator: one row's (n, V) logits exist at a time.
        rows = (model.logits_from_hidden(hidden[b, pos]) for b, pos in enumerate(positions))
    else:
        logits_all = model(batch)  # (B, T, V)
        rows = (logits_all[b, pos] for b, pos in enumerate(positions))
    out = []
    for logits, tgt in zip(rows, targets):
        logits = logits.float()  # (n, V)
        logp = torch.log_softmax(logits, dim=-1)
        out.append((logp.gather(-1, tgt[:, None])[:, 0], logits.argmax(-1) == tgt))
    return out


def score_sequences(
    model: Any,
    items: Sequence[tuple[Sequence[int], int]],
    *,
    batch_size: int = 8,
    progress: bool = False,
    desc: str = "scoring",
) -> list[tuple[list[float], bool]]:
    """Per-token log-probabilities of the last ``n`` tokens of each sequence, and all-greedy flag.

    Each item is ``(tokens, n)`` with ``len(tokens) <= context_length + 1`` and ``1 <= n <
    len(tokens)``: the model reads ``tokens[:-1]`` and the last ``n`` tokens are scored. Items are
    batched longest first with right padding (causal attention never looks right, so padding
    changes nothing for real positions). Returns one ``(logprobs, greedy)`` per item, in order.
    """
    max_len = _context_length(model)
    device = _device(model)
    batch_size = max(1, batch_size)
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
    results: list[tuple[list[float], bool] | None] = [None] * len(items)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    bar = tqdm(total=len(items), desc=desc, disable=not progress, leave=False)
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            width = max(len(items[i][0]) - 1 for i in idx)
            batch = torch.zeros(len(idx), width, dtype=torch.long)  # (B, T)
            positions, targets = [], []
            for row, i in enumerate(idx):
                tokens, n = items[i]
                if not 1 <= n < len(tokens):
                    raise ValueError(f"item {i}: need 1 <= n < len(tokens), got n={n}")
                if len(tokens) - 1 > max_len:
                    raise ValueError(f"item {i}: {len(tokens) - 1} inputs > context {max_len}")
                inp = torch.tensor(tokens[:-1], dtype=torch.long)
                batch[row, : len(inp)] = inp
                t = len(tokens) - 1
                positions.append(torch.arange(t - n, t, device=device))
                targets.append(torch.tensor(tokens[-n:], dtype=torch.long, device=device))
            scored = _logprobs_at(model, batch.to(device), positions, targets)
            for i, (lp, greedy) in zip(idx, scored):
                results[i] = (lp.double().cpu().tolist(), bool(greedy.all()))
            bar.update(len(idx))
    finally:
        bar.close()
        if was_training and hasattr(model, "train"):
            model.train()
    return results  # type: ignore[return-value]


def score_continuations(
    model: Any,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 8,
    progress: bool = False,
    desc: str = "loglikelihood",
) -> list[tuple[float, bool]]:
    """log p(continuation | context) and whether greedy decoding would produce the continuation.

    ``requests`` are ``(context_ids, continuation_ids)`` pairs; the context must be non-empty (put
    an end-of-text id first to score from the start of a document). A pair longer than the model's
    context keeps its rightmost tokens (the continuation stays whole).
    """
    max_len = _context_length(model)
    items = []
    for i, (ctx, cont) in enumerate(requests):
        if not ctx:
            raise ValueError(f"request {i}: empty context (prepend the end-of-text id)")
        if not cont:
            raise ValueError(f"request {i}: empty continuation")
        if len(cont) > max_len:
            raise ValueError(f"request {i}: continuation of {len(cont)} tokens > context {max_len}")
        tokens = [*ctx, *cont][-(max_len + 1) :]
        items.append((tokens, len(cont)))
    scored = score_sequences(model, items, batch_size=batch_size, progress=progress, desc=desc)
    return [(math.fsum(lp), greedy) for lp, greedy in scored]


def rolling_windows(
    n_tokens: int, max_len: int, stride: int | None = None
) -> list[tuple[int, int, int]]:
    """Windows ``(lo, a, b)`` that score every token of a document once.

    With ``s = [prefix] + tokens`` (length n+1), a window feeds ``s[lo:b-1]`` (at most ``max_len``
    inputs) and scores targets ``s[a:b]``. ``stride`` tokens are scored per window (default
    ``max_len``: disjoint windows, as lm-evaluation-harness's rolling log-likelihood); a smaller
    stride gives every scored token at least ``max_len - stride`` tokens of context.
    """
    stride = max_len if stride is None else stride
    if not 1 <= stride <= max_len:
        raise ValueError(f"stride must be in [1, {max_len}], got {stride}")
    windows = []
    a = 1
    while a <= n_tokens:
        b = min(n_tokens + 1, a + (max_len if a == 1 else stride))
        lo = max(0, b - 1 - max_len)
        windows.append((lo, a, b))
        a = b
    return windows


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """Negative log-likelihood of some text, per token and per byte."""

    nll: float
    "total negative log-likelihood (nats)"
    tokens: int
    "tokens scored"
    bytes: int
    "UTF-8 bytes of the scored text"

    @property
    def loss(self) -> float:
        """Mean NLL per token (nats)."""
        return self.nll / max(1, self.tokens)

    @property
    def perplexity(self) -> float:
        """exp(loss): per-token perplexity (depends on the tokenizer)."""
        return math.exp(min(self.loss, 700.0))

    @property
    def bits_per_byte(self) -> float:
        """NLL in bits per UTF-8 byte (comparable across tokenizers)."""
        return self.nll / math.log(2.0) / max(1, self.bytes)

    def as_dict(self) -> dict[str, float]:
        """Plain numbers for a JSON report."""
        return {
            k: getattr(self, k) for k in ("loss", "perplexity", "bits_per_byte", "tokens", "bytes")
        }


def _document_items(
    s: Sequence[int], max_len: int, stride: int | None
) -> list[tuple[list[int], int]]:
    """Scoring items for every token of ``s`` but the first (the prefix)."""
    return [(list(s[lo:b]), b - a) for lo, a, b in rolling_windows(len(s) - 1, max_len, stride)]


def perplexity(
    model: Any,
    tokenizer: TextTokenizer,
    texts: Sequence[str],
    *,
    batch_size: int = 8,
    stride: int | None = None,
    max_tokens: int | None = None,
    max_windows: int | None = None,
    progress: bool = False,
) -> PerplexityResult:
    """Perplexity and bits per byte of ``texts`` (each an independent document).

    Each document is scored from its start (after the end-of-text id, which acts as BOS) in
    rolling windows of the model's context length (see :func:`rolling_windows`). ``max_tokens``
    caps the tokens scored per document; its bytes are then those of the scored prefix.
    ``max_windows`` caps the work in all: at most that many context-length windows of tokens are
    scored, from the first document on (``lmforge eval --limit``). Text with no token to score
    raises :class:`~lmforge.utils.errors.LmforgeError` (its perplexity would read as 1.0).
    Simplification: with a tokenizer that has no end-of-text id the first token of each document
    is context only (its bytes still count).
    """
    max_len = _context_length(model)
    items: list[tuple[list[int], int]] = []
    n_bytes = 0
    n_tokens = 0
    budget = None if max_windows is None else max_windows * max_len
    for text in texts:
        if budget is not None and n_tokens >= budget:
            break
        ids = tokenizer.encode(text)
        cap = max_tokens
        if budget is not None:
            # One scored target per input token (the eot prefix, when there is one, is context).
            left = budget - n_tokens + (0 if tokenizer.eot_id is not None else 1)
            cap = left if cap is None else min(cap, left)
        if cap is not None and len(ids) > cap:
            ids = ids[:cap]
            n_bytes += len(tokenizer.decode(ids).encode("utf-8"))
        else:
            n_bytes += len(text.encode("utf-8"))
        prefix = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
        s = [*prefix, *ids]
        if len(s) < 2:
            continue
        n_tokens += len(s) - 1
        items += _document_items(s, max_len, stride)
    if n_tokens == 0:
        raise LmforgeError("perplexity: no tokens to score (the text is empty)")
    scored = score_sequences(model, items, batch_size=batch_size, progress=progress, desc="ppl")
    nll = -math.fsum(x for lp, _ in scored for x in lp)
    return PerplexityResult(nll=nll, tokens=n_tokens, bytes=n_bytes)


def conditional_perplexity(
    model: Any,
    tokenizer: TextTokenizer,
    pairs: Sequence[tuple[str, str]],
    *,
    batch_size: int = 8,
    progress: bool = False,
) -> PerplexityResult:
    """Perplexity and bits per byte of responses given their prompts (prompt tokens not scored).

    Each ``(prompt, response)`` is tokenized as ``[eot] + encode(prompt) + encode(response)``; only
    the response tokens count, and the bytes are the response's UTF-8 bytes.
    """
    requests = []
    n_bytes = 0
    for prompt, response in pairs:
        ctx, cont = encode_pair(tokenizer, prompt, response)
        if not cont:
            continue
        requests.append((ctx, cont))
        n_bytes += len(response.encode("utf-8"))
    scored = score_continuations(
        model, requests, batch_size=batch_size, progress=progress, desc="cond-ppl"
    )
    nll = -math.fsum(lp for lp, _ in scored)
    return PerplexityResult(nll=nll, tokens=sum(len(c) for _, c in requests), bytes=n_bytes)


def encode_pair(
    tokenizer: TextTokenizer, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """Token ids of ``(context, continuation)``; the context starts with the end-of-text id.

    The end-of-text id plays the part of BOS: lmforge models see it between training documents,
    so a prompt after it reads as the start of a document (and an empty context still works).
    """
    stripped = context.rstrip(" ")  # trailing spaces go to the continuation (as tokenizers expect)
    context, continuation = stripped, context[len(stripped) :] + continuation
    ctx = tokenizer.encode(context) if context else []
    prefix = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    return [*prefix, *ctx], tokenizer.encode(continuation)
