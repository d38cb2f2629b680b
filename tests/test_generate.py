"""lmforge.generate, the reference decoder: the one sampler's properties (lmforge.serve.sampling,
which the reference and the engine share), KV-cache decode vs full recompute. The command,
``lmforge generate``, is tested in tests/test_generate_cli.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmforge.generate import generate, greedy_generate_reference
from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve.sampling import SamplingParams, logprobs_of, sample_tokens
from lmforge.utils import LmforgeError

TINY = ModelConfig(
    vocab_size=300, context_length=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2
)


def _model(seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(dataclasses.replace(TINY, **kw)).eval()


# ----------------------------------------------------------------------------- sampling


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One draw per row from the one sampler, every row with the same parameters."""
    p = SamplingParams(temperature, top_k or 0, 1.0 if top_p is None else top_p)
    params = [p] * logits.shape[0]
    lp = logprobs_of(logits, params)  # (B, V)
    return sample_tokens(lp, params, [None] * len(params), default_generator=generator)


def _logits(b: int = 4, v: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_sample_temperature_zero_is_argmax():
    logits = _logits()
    assert torch.equal(sample_next_token(logits, temperature=0.0), logits.argmax(-1))
    assert torch.equal(sample_next_token(logits, temperature=0.0, top_k=3), logits.argmax(-1))
    # A tiny temperature concentrates all mass on the argmax as well.
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        assert torch.equal(sample_next_token(logits, 1e-4, generator=gen), logits.argmax(-1))
    assert torch.equal(sample_next_token(logits, 1.0, top_k=1), logits.argmax(-1))


def test_sample_top_k_support():
    logits = _logits(b=1).expand(4000, -1)
    gen = torch.Generator().manual_seed(0)
    tokens = sample_next_token(logits, 1.0, top_k=5, generator=gen)
    allowed = set(logits[0].topk(5).indices.tolist())
    assert set(tokens.tolist()) == allowed  # all five reachable, nothing else


def test_sample_top_p_mass():
    logits = _logits(b=1, v=30, seed=3)
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    p = 0.7
    n_keep = int((cum < p).sum()) + 1  # smallest prefix reaching p
    nucleus = set(order[:n_keep].tolist())
    assert probs[order[:n_keep]].sum() >= p > probs[order[: n_keep - 1]].sum()
    gen = torch.Generator().manual_seed(0)
    tokens = sample_next_token(logits.expand(5000, -1), 1.0, top_p=p, generator=gen)
    assert set(tokens.tolist()) == nucleus
    # Within the nucleus, frequencies follow the renormalised probabilities.
    counts = torch.bincount(tokens, minlength=30).float() / 5000
    renorm = torch.zeros(30)
    keep = torch.tensor(sorted(nucleus))
    renorm[keep] = probs[keep] / probs[keep].sum()
    assert (counts - renorm).abs().max() < 0.03
    # top_p so small that only the most likely token survives.
    assert torch.equal(sample_next_token(logits, 1.0, top_p=1e-6), logits.argmax(-1))


def test_sample_matches_softmax_distribution_and_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    for temperature in (1.0, 2.0):
        tokens = sample_next_token(logits.expand(20000, -1), temperature, generator=gen)
        freq = torch.bincount(tokens, minlength=4).float() / 20000
        assert (freq - (logits[0] / temperature).softmax(-1)).abs().max() < 0.015


def test_sample_is_pure_and_seeded():
    logits = _logits()
    before = logits.clone()
    a = sample_next_token(logits, 0.8, 10, 0.9, torch.Generator().manual_seed(5))
    b = sample_next_token(logits, 0.8, 10, 0.9, torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and torch.equal(logits, before)


# ----------------------------------------------------------------------------- generation


PROMPTS = [[5, 17, 42], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [250, 3, 99, 12, 4]]


@pytest.mark.parametrize(
    "kw",
    [{"attention": "reference"}, {"attention": "sdpa", "qk_norm": True}, {"tie_embeddings": True}],
)
def test_kv_cache_greedy_equals_full_recompute(kw):
    model = _model(**kw)
    n = 16
    cached = generate(model, PROMPTS, n, temperature=0.0)
    reference = [greedy_generate_reference(model, p, n) for p in PROMPTS]
    assert cached == reference
    assert all(len(c) == n for c in cached)
    # The batch composition does not change a row's result.
    assert generate(model, [PROMPTS[2]], n, temperature=0.0) == [reference[2]]


def test_stop_tokens():
    model = _model()
    prompt = PROMPTS[0]
    full = greedy_generate_reference(model, prompt, 12)
    stop = full[4]
    cut = full.index(stop)
    out = generate(model, [prompt, PROMPTS[2]], 12, temperature=0.0, stop_tokens=[stop])
    assert out[0] == full[:cut]  # the stop token itself is not returned
    other = greedy_generate_reference(model, PROMPTS[2], 12)
    expected_other = other[: other.index(stop)] if stop in other else other
    assert out[1] == expected_other
    assert generate(model, [prompt], 12, temperature=0.0, stop_tokens=[full[0]]) == [[]]


def test_sampled_generation_is_seeded_and_in_vocab():
    model = _model()
    a = generate(model, PROMPTS, 10, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    b = generate(model, PROMPTS, 10, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    c = generate(model, PROMPTS, 10, temperature=1.0, top_k=50, top_p=0.9, seed=8)
    assert a == b and a != c
    assert all(0 <= t < TINY.vocab_size for row in a for t in row)


def test_generation_limits():
    model = _model()
    assert generate(model, PROMPTS, 0) == [[], [], [], []]
    assert generate(model, [], 5) == []
    with pytest.raises(LmforgeError, match="context_length"):
        generate(model, [[1] * 40], 10)
    with pytest.raises(LmforgeError, match="at least one token"):
        generate(model, [[1], []], 3)


def test_vocab_limit_restricts_sampling():
    model = _model()
    out = generate(model, PROMPTS, 8, temperature=1.5, seed=0, vocab_limit=10)
    assert all(0 <= t < 10 for row in out for t in row)


@pytest.mark.gpu
def test_kv_cache_greedy_equals_full_recompute_on_cuda():
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, attention="sdpa", norm="auto", qk_norm=True)
    model = TransformerLM(cfg, device="cuda").eval()
    cached = generate(model, PROMPTS, 16, temperature=0.0)
    assert cached == [greedy_generate_reference(model, p, 16) for p in PROMPTS]
    sampled = generate(model, PROMPTS, 16, temperature=0.8, top_p=0.9, seed=0)
    assert sampled == generate(model, PROMPTS, 16, temperature=0.8, top_p=0.9, seed=0)
