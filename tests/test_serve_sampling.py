"""The sampler's logit bias and penalties: the batched :func:`apply_penalties` equals the
one-token-at-a-time float64 reference on random rows; SamplingParams validates the new fields;
the engine applies them (greedy decode with a huge bias / repetition penalty)."""

from __future__ import annotations

import random

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine
from lmforge.serve.sampling import SamplingParams, apply_penalties, apply_penalties_reference
from lmforge.utils.errors import LmforgeError


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kind = rng.randrange(6)
    if kind == 0:
        return SamplingParams()  # untouched row
    bias = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(4))}
    return SamplingParams(
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 3.0)]),
        logit_bias=bias if kind != 1 else {},
    )


@pytest.mark.parametrize("seed", range(6))
def test_apply_penalties_equals_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, V = 7, 53
    logits = torch.randn(B, V) * 3  # (B, V): positive and negative logits
    params = [_random_params(rng, V) for _ in range(B)]
    n_prompt = [rng.randrange(1, 9) for _ in range(B)]
    # small vocab window so tokens repeat in prompt and output
    token_ids = [[rng.randrange(12) for _ in range(n + rng.randrange(0, 15))] for n in n_prompt]
    before = logits.clone()
    got = apply_penalties(logits, params, token_ids, n_prompt)
    want = apply_penalties_reference(logits, params, token_ids, n_prompt)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-4)
    assert torch.equal(logits, before)  # pure: the caller's logits are unchanged
    changed = (got != logits).any(dim=-1)
    for i, p in enumerate(params):
        if not p.penalised:
            assert not changed[i]


def test_untouched_batch_is_returned_as_is() -> None:
    logits = torch.randn(3, 10)
    assert apply_penalties(logits, [SamplingParams()] * 3, [[1], [2], [3]], [1, 1, 1]) is logits


def test_penalty_definitions_on_one_row() -> None:
    # output [4, 4, 5] after prompt [6]: counts 4 -> 2, 5 -> 1; 6 is only in the prompt
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 2.0, -2.0, 3.0, 1.0]])
    toks, n_prompt = [[6, 4, 4, 5]], [1]
    fp = SamplingParams(frequency_penalty=0.5)
    assert apply_penalties(logits, [fp], toks, n_prompt)[0, 4:7].tolist() == [1.0, -2.5, 3.0]
    pp = SamplingParams(presence_penalty=0.5)
    assert apply_penalties(logits, [pp], toks, n_prompt)[0, 4:7].tolist() == [1.5, -2.5, 3.0]
    rp = SamplingParams(repetition_penalty=2.0)
    assert apply_penalties(logits, [rp], toks, n_prompt)[0, 4:8].tolist() == [1.0, -4.0, 1.5, 1.0]
    lb = SamplingParams(logit_bias={7: -100, 0: 5})
    out = apply_penalties(logits, [lb], toks, n_prompt)[0]
    assert out[0].item() == 6.0 and out[7].item() == -99.0


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 100]"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {5: 101}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
    ],
)
def test_sampling_params_validate_the_new_fields(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**kw)


def test_logit_bias_is_hashable_and_checked_against_the_vocab() -> None:
    p = SamplingParams(logit_bias={9: 1.0, 3: -1})
    assert p.logit_bias == ((3, -1.0), (9, 1.0)) and hash(p) == hash(
        SamplingParams(logit_bias={3: -1, 9: 1.0})
    )
    with pytest.raises(LmforgeError, match="token id 9 is not in"):
        p.check_vocab(9)


def _engine() -> Engine:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, context_length=64, d_model=32, n_layers=2, n_heads=4)
    return Engine(TransformerLM(cfg).eval(), block_size=8, num_blocks=64)


def test_engine_applies_bias_and_penalties() -> None:
    eng = _engine()
    prompt = [1, 2, 3, 4, 5]
    biased = eng.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, logit_bias={7: 100})
    )
    assert biased[0].outputs[0].token_ids == [7] * 6
    # a huge repetition penalty on a fully biased vocabulary: no token can repeat a seen one
    rp = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=100.0,
                        logit_bias={t: 50 for t in range(40)})  # fmt: skip
    out = eng.generate([prompt], rp)[0].outputs[0].token_ids
    assert len(set(out)) == len(out) and not set(out) & set(prompt)
    with pytest.raises(LmforgeError, match="logit_bias token id 40"):
        eng.add_request(prompt, SamplingParams(logit_bias={40: 1}))
