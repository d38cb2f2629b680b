"""Autoregressive generation with an explicit KV cache; token ids in, token ids out.

The engine knows nothing about text: the caller (e.g. ``lmforge generate``) encodes prompts and
decodes the result. One batched prefill over the left-padded prompts fills a
:class:`~lmforge.model.KVCache`, then each step feeds one token per row.

Shape legend: B batch, T sequence, V vocab.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from lmforge.model import KVCache
from lmforge.serve.sampling import SamplingParams, logprobs_of, sample_tokens
from lmforge.utils.errors import LmforgeError


def _generator(seed: int | torch.Generator | None, device: torch.device) -> torch.Generator | None:
    if seed is None or isinstance(seed, torch.Generator):
        return seed
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Iterable[int] = (),
    seed: int | torch.Generator | None = None,
    vocab_limit: int | None = None,
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` sampled tokens; return the new tokens only.

    ``model`` is a :class:`~lmforge.model.TransformerLM`. Prompts (non-empty lists of token ids,
    any lengths) are left-padded into one batch: padding slots are masked out of attention and
    positions count real tokens only, so every row computes what it would alone (up to
    float rounding). A row stops
    at its first token in ``stop_tokens`` (that token is not returned) or after
    ``max_new_tokens``; generation ends when every row has stopped. Sampling is
    the engine's sampler (:mod:`lmforge.serve.sampling`; ``temperature=0`` is greedy, ``top_k``
    None or 0 and ``top_p`` None or 1 are off); ``seed`` is an int, a
    ``torch.Generator`` or None (torch's global RNG). ``vocab_limit`` restricts sampling to ids
    below it (a model's vocabulary is often padded past its tokenizer's, e.g. 50304 vs 50257).
    The prompt plus new tokens must fit in the model's context. Hybrid layer patterns run as
    in training: W layers mask keys beyond the window, linear layers (G, M, L) carry their
    recurrent state in the cache, advanced over real tokens only (padding never enters it).
    Exercised by ``pytest tests/test_generate.py``.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise LmforgeError("every prompt needs at least one token")
    param = next(model.parameters())
    device = param.device
    ctx = model.config.context_length
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > ctx:
        raise LmforgeError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context_length {ctx}"
        )
    outputs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return outputs
    gen = _generator(seed, device)
    stops = set(stop_tokens)
    b = len(prompts)
    params = [SamplingParams(temperature, top_k or 0, 1.0 if top_p is None else top_p)] * b

    idx = torch.zeros(b, longest, dtype=torch.long, device=device)  # (B, T) left-padded
    valid = torch.zeros(b, longest, dtype=torch.bool, device=device)  # (B, T)
    for row, prompt in enumerate(prompts):
        idx[row, longest - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        valid[row, longest - len(prompt) :] = True
    cache = KVCache.for_model(model, b, max_seq_len=longest + max_new_tokens)
    logits = model(idx, kv_cache=cache, valid_mask=valid)[:, -1]  # (B, V)

    done = torch.zeros(b, dtype=torch.bool, device=device)  # (B,)
    stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        if vocab_limit is not None:
            logits[:, vocab_limit:] = float("-inf")
        lp = logprobs_of(logits, params)  # (B, V)
        token = sample_tokens(lp, params, [None] * b, default_generator=gen)  # (B,)
        hit_stop = torch.isin(token, stop_ids) if stops else torch.zeros_like(done)
        emit = ~done & ~hit_stop
        for row in emit.nonzero().flatten().tolist():
            outputs[row].append(int(token[row]))
        done = done | hit_stop
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        # Stopped rows still take a slot (the batch moves in lockstep) but as padding.
        logits = model(token[:, None], kv_cache=cache, valid_mask=~done[:, None])[:, -1]
    return outputs


@torch.inference_mode()
def greedy_generate_reference(model: nn.Module, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy continuation by full recomputation (no cache): the slow reference for :func:`generate`.

    Re-runs the whole sequence for each of the ``n`` new tokens and takes the argmax of the last
    position. Exercised by ``pytest tests/test_generate.py -k reference``.
    """
    device = next(model.parameters()).device
    seq = list(prompt)
    for _ in range(n):
        idx = torch.tensor([seq], dtype=torch.long, device=device)  # (1, T)
        seq.append(int(model(idx)[0, -1].argmax()))
    return seq[len(prompt) :]
