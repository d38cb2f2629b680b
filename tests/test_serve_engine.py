"""The engine against lmforge.generate (greedy token-identical) under preemption, chunked prefill
and prefix caching; the logprob contract; per-request sampling options; weight updates in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.generate import generate
from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.serve.sampling import truncated_probs
from lmforge.utils import LmforgeError

V = 97
SMOL = Path("/work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf")


def _model(seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    base = dict(vocab_size=V, context_length=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    return TransformerLM(ModelConfig(**{**base, **kw})).eval()


def _prompts(lengths=(3, 17, 40, 5, 33, 9), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(block_size=8, num_blocks=64, max_num_batched_tokens=256),  # plain
        dict(block_size=4, num_blocks=26, max_num_batched_tokens=16),  # chunks + preemption
        dict(block_size=16, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=2),
    ],
)
def test_greedy_matches_generate_reference(engine_kw: dict) -> None:
    model = _model()
    prompts = _prompts()
    want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    engine = Engine(model, **engine_kw)
    got = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in got)
    assert engine.allocator.num_used == 0
    if engine_kw["num_blocks"] == 26:
        assert engine.stats["preemptions"] > 0  # the small cache did force recomputation


def test_prefix_cache_hit_gives_the_same_output_as_a_miss() -> None:
    model = _model()
    shared = _prompts((40,))[0]
    prompts = [[*shared, 5, 6], [*shared, 7], shared[:20]]
    miss = Engine(model, block_size=8, enable_prefix_cache=False).generate(prompts, GREEDY)
    engine = Engine(model, block_size=8)
    first = engine.generate(prompts[:1], GREEDY)
    hits_before = engine.allocator.hits
    got = engine.generate(prompts, GREEDY)
    assert engine.allocator.hits - hits_before >= 4 + 4 + 2  # full blocks of the shared prefix
    assert first[0].outputs[0].token_ids == miss[0].outputs[0].token_ids
    for a, b in zip(got, miss, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(
            torch.tensor(a.outputs[0].logprobs),
            torch.tensor(b.outputs[0].logprobs),
            atol=1e-5,
            rtol=0,
        )
    assert engine.allocator.num_used == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=10),
        SamplingParams(temperature=1.3, top_p=0.6, min_p=0.05, seed=4, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=10),
        SamplingParams(temperature=1.0, max_tokens=10),  # the batched (unseeded) path
    ],
)
def test_logprobs_are_what_a_trainer_computes(params: SamplingParams) -> None:
    """logprob[i] = log_softmax(logits / T)[token_i] over the full vocabulary, before truncation."""
    model = _model()
    prompt = _prompts((11,))[0]
    out = Engine(model, block_size=4).generate([prompt], params)[0].outputs[0]
    seq = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(seq)[0, len(prompt) - 1 : -1].float()  # (T, V) predicting each new token
    t = params.temperature if params.temperature > 0 else 1.0
    want = torch.log_softmax(logits / t, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=2e-5, rtol=0)
    if params.top_k:  # every token drawn from the truncated set
        ranks = (logits > logits.gather(1, torch.tensor(out.token_ids)[:, None])).sum(-1)
        assert int(ranks.max()) < params.top_k


def test_seeded_requests_reproduce_whatever_they_are_batched_with() -> None:
    model = _model()
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=8)
    prompts = _prompts((30, 6, 12))
    alone = Engine(model).generate(prompts[1:2], p)[0].outputs[0].token_ids
    crowd = Engine(model, max_num_batched_tokens=16).generate(
        prompts, [SamplingParams(temperature=1.0, max_tokens=8), p, p]
    )
    assert crowd[1].outputs[0].token_ids == alone


def test_n_samples_stop_ids_eos_and_top_logprobs() -> None:
    model = _model()
    prompt = _prompts((7,))[0]
    greedy = Engine(model).generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop = greedy[3]
    first_stop = greedy.index(stop)
    out = (
        Engine(model)
        .generate(
            [prompt],
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop,), logprobs=3),
        )[0]
        .outputs[0]
    )
    assert out.token_ids == greedy[: first_stop + 1] and out.finish_reason == "stop"
    assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.token_ids)
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(top) == 3 and top[tok] == pytest.approx(lp) and max(top.values()) == top[tok]
    eos = Engine(model, eos_token_id=stop).generate([prompt], GREEDY)[0].outputs[0]
    assert eos.token_ids == greedy[: first_stop + 1] and eos.finish_reason == "stop"
    ign = (
        Engine(model, eos_token_id=stop)
        .generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        .outputs[0]
    )
    assert ign.token_ids == greedy
    many = Engine(model).generate([prompt], SamplingParams(n=4, seed=0, max_tokens=6))[0]
    assert [o.index for o in many.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in many.outputs}) > 1


def test_abort_and_invalid_requests() -> None:
    model = _model()
    engine = Engine(model, block_size=4, num_blocks=16)
    rid = engine.add_request(_prompts((20,))[0], SamplingParams(max_tokens=30))
    engine.step()
    assert engine.allocator.num_used > 0
    engine.abort(rid)
    assert engine.allocator.num_used == 0 and not engine.has_unfinished()
    with pytest.raises(LmforgeError, match="at least one token"):
        engine.add_request([])
    with pytest.raises(LmforgeError, match="context is 128"):
        engine.add_request([1] * 128)
    with pytest.raises(LmforgeError, match=r"token ids must be in \[0, 97\)"):
        engine.add_request([1, V])
    with pytest.raises(LmforgeError, match="needs 30 KV blocks, the cache has 16"):
        engine.add_request([1] * 90, SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_update_weights_in_place_keeps_running_requests() -> None:
    model, other = _model(0), _model(5)
    prompt = _prompts((9,))[0]
    engine = Engine(model, block_size=4)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10))
    outs = []
    for _ in range(4):
        outs += engine.step()
    engine.update_weights(other.state_dict(), version=1)  # a Mapping; pairs work too
    while engine.has_unfinished():
        outs += engine.step()
    final = [o for o in outs if o.request_id == rid][-1].outputs[0]
    assert final.policy_versions == [0] * 4 + [1] * 6
    assert len(final.token_ids) == 10
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, other.state_dict()[name])
    # The continuation after the update attends to the KV computed under the old weights: the
    # tokens differ from a fresh run with the new weights from the start.
    with pytest.raises(LmforgeError, match="no parameter 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))], version=2)


def test_truncation_matches_generate_sampling_rules() -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)) * 3
    lp = torch.log_softmax(logits, -1)[0]
    probs = truncated_probs(lp, SamplingParams(top_k=7, top_p=0.8))
    kept = probs > 0
    order = lp.argsort(descending=True)
    assert kept[order[:1]].all() and int(kept.sum()) <= 7
    mass = lp.exp()[order].cumsum(0)
    n_p = int((mass < 0.8).sum()) + 1  # the token crossing top_p is kept
    assert int(kept.sum()) == min(7, n_p)
    mp = truncated_probs(lp, SamplingParams(min_p=0.2))
    assert torch.equal(mp > 0, lp.exp() >= 0.2 * lp.exp().max())


@pytest.mark.slow
@pytest.mark.skipif(not SMOL.is_file(), reason="shared SmolLM2 GGUF not present")
def test_smollm2_greedy_matches_generate() -> None:
    from lmforge.hf.gguf import import_gguf

    model, tok, _ = import_gguf(SMOL, context_length=256)
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")]
    want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    got = Engine(model, block_size=16, max_num_batched_tokens=8).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8)
    )
    assert [o.outputs[0].token_ids for o in got] == want
    assert "Paris" in tok.decode(got[0].outputs[0].token_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_engine_greedy_matches_generate(graphs: bool) -> None:
    """On CUDA: the Triton decode kernel (and CUDA-graph replay) give generate's greedy tokens."""
    model = _model().cuda()
    prompts = _prompts()
    want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    engine = Engine(model, block_size=8, num_blocks=64, cuda_graphs=graphs, max_num_seqs=8)
    if graphs:
        assert engine.graphs is not None and engine.graphs.graphs  # captured, not fallen back
    got = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want
    assert engine.allocator.num_used == 0


def test_n_samples_share_the_prompt_blocks() -> None:
    model = _model()
    prompt = _prompts((37,))[0]  # 4 full blocks of 8 + 5 tokens
    engine = Engine(model, block_size=8)
    out = engine.generate([prompt], SamplingParams(temperature=0, n=4, max_tokens=6))[0]
    solo = Engine(model, block_size=8).generate([prompt], GREEDY)[0].outputs[0].token_ids[:6]
    assert all(o.token_ids == solo for o in out.outputs)
    assert engine.allocator.hits == 3 * 4  # samples 1..3 each reuse sample 0's 4 full blocks
    assert engine.allocator.num_used == 0


def test_random_workloads_match_generate_and_free_everything() -> None:
    """Hypothesis picks prompts (shared prefixes included), budgets, cache sizes and n: greedy
    outputs stay generate's and every block comes back, whatever preemption happens."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    torch.manual_seed(0)
    model = TransformerLM(
        ModelConfig(vocab_size=V, context_length=64, d_model=32, n_layers=1, n_heads=2)
    ).eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def want(p: list[int], n: int) -> list[int]:
        key = (*p, -n)
        if key not in cache:
            cache[key] = generate(model, [p], n, temperature=0)[0]
        return cache[key]

    base = _prompts((20,))[0]
    prompt = st.builds(
        lambda k, tail: base[:k] + tail,
        st.integers(0, 20),
        st.lists(st.integers(0, V - 1), min_size=1, max_size=8),
    )

    seen = {"preemptions": 0, "hits": 0}

    @settings(max_examples=12, deadline=None, derandomize=True, database=None)
    @given(
        st.lists(st.tuples(prompt, st.integers(1, 10), st.integers(1, 2)), min_size=1, max_size=5),
        st.sampled_from([4, 8]),
        st.integers(8, 24),
        st.integers(12, 40),
    )
    def check(reqs, block_size, budget, extra_blocks) -> None:
        need = max(-(-(len(p) + m) // block_size) for p, m, _ in reqs)
        engine = Engine(
            model,
            block_size=block_size,
            num_blocks=need + extra_blocks // block_size,
            max_num_batched_tokens=budget,
        )
        params = [SamplingParams(temperature=0, max_tokens=m, n=n) for _, m, n in reqs]
        outs = engine.generate([p for p, _, _ in reqs], params)
        for (p, m, _), out in zip(reqs, outs, strict=True):
            for o in out.outputs:
                assert o.token_ids == want(p, m)
        assert engine.allocator.num_used == 0 and not engine.has_unfinished()
        seen["preemptions"] += engine.stats["preemptions"]
        seen["hits"] += engine.allocator.hits

    check()
    assert seen["preemptions"] > 0 and seen["hits"] > 0  # the workloads did exercise both


def test_engine_splits_step_time_between_decode_and_prefill_steps() -> None:
    """stats: steps that carried prefill ("mixed") and pure decode steps, counted and timed."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=64, context_length=64, d_model=32, n_layers=1,
                                      n_heads=2, n_kv_heads=1)).eval()  # fmt: skip
    eng = Engine(model, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    eng.generate(
        [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]], SamplingParams(max_tokens=5, temperature=0)
    )
    st = eng.stats
    # 12 prompt tokens at 8 per step: 2 prefill steps (the second samples the first token),
    # then 4 decode steps for the other 4 tokens
    assert (st["mixed_steps"], st["decode_steps"]) == (2, 4) and st["steps"] == 6
    assert st["mixed_s"] > 0 and st["decode_s"] > 0


def test_defaults_on_cpu_are_eager_and_said_in_one_line() -> None:
    """On the CPU, Engine(model) neither captures graphs nor compiles, and says so."""
    engine = Engine(_model(), num_blocks=32)
    assert engine.graphs is None and engine.decoder is None
    line = engine.startup_line
    assert "\n" not in line and "CUDA graphs off" in line and "compiled decode step off" in line


@pytest.mark.gpu
def test_gpu_defaults_are_graphs_and_the_compiled_step() -> None:
    """On CUDA, Engine(model) with no flags is the measured-best path: CUDA graphs around the
    compiled decode step (flags turn each off), with generate's greedy tokens."""
    model = _model().cuda()
    prompts = _prompts()
    want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    engine = Engine(model, block_size=8, num_blocks=64, max_num_seqs=8)
    assert engine.graphs is not None and engine.graphs.graphs
    assert engine.decoder is not None and engine.decoder.failed is None
    assert "CUDA graphs on" in engine.startup_line
    assert "compiled decode step on" in engine.startup_line
    got = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want
    off = Engine(model, block_size=8, num_blocks=64, cuda_graphs=False, compile=False)
    assert off.graphs is None and off.decoder is None
