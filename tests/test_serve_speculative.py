"""Speculative decoding: greedy output token-identical to plain greedy decoding (draft model and
n-gram drafts), and the rejection sampler's emitted tokens distributed exactly as the target's p
(χ² goodness of fit, fixed synthetic p and q, 2·10⁵ draws, several seeds)."""

from __future__ import annotations

import pytest
import scipy.stats as scipy_stats
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.serve.speculative import DraftModel, NgramDraft, Speculative, verify

V = 61


def _model(seed: int, layers: int = 2) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, context_length=128, d_model=32, n_layers=layers, n_heads=4)
    return TransformerLM(cfg).eval()


def _one(eng: Engine, prompt: list[int], params: SamplingParams):
    return eng.generate([prompt], params)[0].outputs[0]


def _dists(seed: int, k: int, v: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    p = torch.rand(k + 1, v, generator=g)
    q = torch.rand(k, v, generator=g)
    p[:, 0] = 0.0  # a token the target never emits but the draft proposes
    q[:, -1] = 0.0  # one the draft never proposes
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _chi2_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    keep = p > 0
    expected = p[keep].double() / p[keep].double().sum() * counts.sum()
    return float(scipy_stats.chisquare(counts[keep].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_sampling_matches_target_distribution(k: int, seed: int) -> None:
    n = 200_000
    p, q = _dists(seed, k)
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q, n, replacement=True, generator=g).T  # (n, k) drafts ~ q
    n_acc, nxt = verify(p.expand(n, -1, -1), q.expand(n, -1, -1), draft, g)
    first = torch.where(n_acc > 0, draft[:, 0], nxt)  # the first emitted token
    counts = torch.bincount(first, minlength=p.shape[1]).double()
    assert counts[0] == 0  # p(0) = 0: never emitted
    assert _chi2_pvalue(counts, p[0]) > 1e-3
    # the expected acceptance rate at the first position is Σ min(p, q)
    rate = float((n_acc > 0).double().mean())
    assert abs(rate - float(torch.minimum(p[0], q[0]).sum())) < 0.01


def test_one_hot_drafts_are_exact_too() -> None:
    """n-gram drafts have a one-hot q: accept with p(x), else draw from p without x."""
    n, p = 200_000, _dists(3, 1)[0]
    g = torch.Generator().manual_seed(7)
    draft = torch.full((n, 1), 2, dtype=torch.long)
    q = torch.nn.functional.one_hot(torch.tensor([2]), p.shape[1]).float()
    n_acc, nxt = verify(p.expand(n, -1, -1), q.expand(n, -1, -1), draft, g)
    first = torch.where(n_acc > 0, draft[:, 0], nxt)
    counts = torch.bincount(first, minlength=p.shape[1]).double()
    assert _chi2_pvalue(counts, p[0]) > 1e-3


@pytest.mark.parametrize("k", [1, 3])
def test_one_hot_drafts_without_q_draw_what_the_explicit_q_draws(k: int) -> None:
    """verify(q=None) (the n-gram and MTP proposers: q never built) takes the same random
    numbers and the same residual values as verify with the explicit one-hot q: identical
    draws, rejected and bonus rows alike (drafts of probability 0, 1 and in between)."""
    n, p = 4_000, _dists(4, k)[0]
    g = torch.Generator().manual_seed(9)
    draft = torch.randint(0, p.shape[1], (n, k), generator=g)
    q = torch.nn.functional.one_hot(draft, p.shape[1]).float()  # (n, k, V)
    pb = p.expand(n, -1, -1)
    a = verify(pb, q, draft, torch.Generator().manual_seed(11))
    b = verify(pb, None, draft, torch.Generator().manual_seed(11))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert 0 < int((a[0] == k).sum()) < n and int((a[0] == 0).sum()) > 0  # every case ran


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_verify_is_rejection_sampling_on_one_hot_rows(k: int) -> None:
    """verify_greedy (the engine's path for greedy requests) against verify on the one-hot
    distributions a greedy request samples from, drafts agreeing with the argmax for 0..k."""
    from lmforge.serve.speculative import verify_greedy, verify_probs

    g = torch.Generator().manual_seed(12)
    for trial in range(40):
        logits = torch.randn(k + 1, V, generator=g)
        best = logits.argmax(-1)
        agree = trial % (k + 1)  # leading drafts equal to the argmax
        draft = best[:k].clone()
        if agree < k:
            draft[agree] = (best[agree] + 1 + trial) % V  # a different token there
        want = verify(verify_probs(logits, SamplingParams(temperature=0))[None], None,
                      draft[None], torch.Generator().manual_seed(trial))  # fmt: skip
        got = verify_greedy(logits, draft)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert int(got[0]) == agree


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculative_is_token_identical(k: int) -> None:
    target, small = _model(0), _model(1, layers=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 30)]
    prompts.append([3, 4, 5, 6, 3, 4, 5, 6, 3, 4])  # repetitive: n-gram drafts get accepted
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = [o.outputs[0].token_ids for o in Engine(target).generate(prompts, params)]
    for draft in (DraftModel(small), DraftModel(target), NgramDraft()):
        spec = Speculative(draft, k)
        eng = Engine(target, speculative=spec)
        got = [_one(eng, p, params).token_ids for p in prompts]
        assert got == plain, type(draft).__name__
        if isinstance(draft, DraftModel) and draft.model is target:
            assert spec.stats.acceptance == 1.0  # a perfect draft is always accepted


def test_sampled_logprobs_follow_the_contract_and_stops() -> None:
    target, small = _model(0), _model(1, layers=1)
    prompt = [1, 2, 3, 4, 5]
    params = SamplingParams(temperature=0.8, top_k=10, seed=0, max_tokens=12)
    out = _one(Engine(target, speculative=Speculative(DraftModel(small), 3)), prompt, params)
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    with torch.no_grad():
        logits = target(torch.tensor([prompt + out.token_ids]))[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(out.token_ids)[:, None])
    torch.testing.assert_close(torch.tensor(out.logprobs), want[:, 0], atol=2e-5, rtol=0)
    greedy = Engine(target).generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    stop = greedy[0].outputs[0].token_ids[5]
    cut = _one(
        Engine(target, speculative=Speculative(NgramDraft(), 4)),
        prompt,
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop,)),
    )
    ids = greedy[0].outputs[0].token_ids
    assert cut.token_ids == ids[: ids.index(stop) + 1] and cut.finish_reason == "stop"


def test_engine_speculative_mode_is_token_identical_and_refuses_n() -> None:
    """``Engine(speculative=...)``: greedy output equals the plain engine's for n-gram and
    draft-model proposers (a perfect draft is always accepted), several prompts queued at once
    (served one at a time), the log-probs are the plain engine's; n > 1 is one clear line."""
    from lmforge.utils import LmforgeError

    target, small = _model(0), _model(1, layers=1)
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [1, 2], list(range(7, 37))]
    params = SamplingParams(temperature=0, max_tokens=14)
    plain = Engine(target).generate(prompts, params)
    for draft, k in ((NgramDraft(), 3), (DraftModel(target), 4), (DraftModel(small), 2)):
        spec = Speculative(draft, k)
        eng = Engine(target, speculative=spec)
        got = eng.generate(prompts, params)
        for a, b in zip(got, plain, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, type(draft).__name__
            torch.testing.assert_close(
                torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs),
                atol=1e-5, rtol=0,
            )  # fmt: skip
        assert spec.stats.drafted > 0 and eng.stats["spec_steps"] > 0
        assert eng.allocator.num_used == 0
        if isinstance(draft, DraftModel) and draft.model is target:
            assert spec.stats.acceptance == 1.0
    with pytest.raises(LmforgeError, match="one sample per request"):
        Engine(target, speculative=NgramDraft()).add_request([1, 2], SamplingParams(n=2))
    with pytest.raises(LmforgeError, match="speculative"):
        Engine(target, speculative="ngram")  # type: ignore[arg-type]


def test_verify_runs_as_decode_rows_and_is_exact() -> None:
    """The verify forward of the last token + k drafts runs as k + 1 one-token decode rows over
    the sequence's block table (the path the compiled step and CUDA graphs take), and greedy
    output still equals plain decoding, log-probs included."""
    target = _model(0)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1)
    plain = _one(Engine(target), prompt, params)
    eng = Engine(target, speculative=Speculative(DraftModel(target), 4))
    seen: list[list[int]] = []
    run = eng.runner.run
    eng.runner.run = lambda batch: (seen.append(list(batch.q_lens)), run(batch))[1]
    got = _one(eng, prompt, params)
    assert got.token_ids == plain.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(plain.logprobs),
                               atol=1e-5, rtol=0)  # fmt: skip
    verify = [q for q in seen if len(q) == 5]  # k + 1 rows of one sequence
    assert verify and all(q == [1] * 5 for q in verify)
    assert all(len(q) == 1 for q in seen if q not in verify)  # the prompt's prefill: one row


@pytest.mark.slow
def test_verify_through_the_compiled_step_is_exact() -> None:
    """With the compiled decode step on (the CUDA default; inductor on the CPU here), verify
    rows run compiled and greedy output equals plain eager decoding."""
    target = _model(0)
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = _one(Engine(target, compile=False), prompt, params)
    eng = Engine(target, compile=True, speculative=Speculative(NgramDraft(), 3))
    got = _one(eng, prompt, params)
    assert eng.decoder is not None and eng.decoder.failed is None
    assert got.token_ids == plain.token_ids and eng.speculative.stats.drafted > 0
