"""The target's own MTP modules as the engine's speculative proposer (``--speculative mtp``):
greedy output token-identical to plain decoding, sampled log-probs follow the engine's
contract, the drafts are ``mtp_draft``'s over the target's full-forward hidden states, and a
trained MTP module's drafts are accepted."""

from __future__ import annotations

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.mtp import MTPDraft, mtp_draft
from lmforge.serve import Engine, SamplingParams
from lmforge.serve.speculative import Speculative, mtp_draft_for, propose, speculative_from_flag
from lmforge.utils.errors import LmforgeError

V = 61
MLA = dict(attention_type="mla", kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
           v_head_dim=8)  # fmt: skip


def _model(seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    base = dict(vocab_size=V, context_length=128, d_model=32, n_layers=2, n_heads=4, mtp_depth=2)
    return TransformerLM(ModelConfig(**{**base, **kw})).eval()


@pytest.mark.parametrize("kw", [{}, MLA, {**MLA, "kv_share_every": 2, "mtp_depth": 1}])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_mtp_speculation_is_token_identical(kw: dict, k: int) -> None:
    target = _model(**kw)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 9, 30)]
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = Engine(target).generate(prompts, params)
    spec = speculative_from_flag(target, "mtp", k)
    eng = Engine(target, speculative=spec)
    got = eng.generate(prompts, params)
    for a, b in zip(got, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(
            torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs),
            atol=1e-5, rtol=0,
        )  # fmt: skip
    assert spec.stats.drafted > 0 and eng.stats["spec_steps"] > 0
    assert eng.allocator.num_used == 0


def test_drafts_are_mtp_draft_over_the_full_forward() -> None:
    """After a prefill through the engine the tapped hidden states are the full forward's, and
    the proposal is mtp_draft's on them."""
    target = _model()
    spec = Speculative(mtp_draft_for(target), 3)
    eng = Engine(target, speculative=spec)
    prompt = torch.randint(0, V, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    (out,) = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    seq = [*prompt, out.outputs[0].token_ids[0]]
    with torch.no_grad():
        h = target.forward_hidden(torch.tensor([prompt]))  # (1, n, D)
    torch.testing.assert_close(spec.tap.hidden[: len(prompt)], h[0], atol=1e-5, rtol=1e-5)

    class _Seq:
        tokens = seq

    drafts, q = propose(spec, _Seq(), 3, SamplingParams(), torch.Generator(), 16)
    want = mtp_draft(target.mtp, h, torch.tensor([seq]), 3, target.token_embeddings,
                     target.logits_from_hidden)  # fmt: skip
    # the engine's proposal stays on the device; its drafts are one-hot (q None: verify's case)
    assert isinstance(drafts, torch.Tensor) and q is None
    assert drafts.tolist() == want[0].tolist()


def test_sampled_logprobs_follow_the_contract() -> None:
    target = _model(**MLA)
    prompt = [1, 2, 3, 4, 5]
    params = SamplingParams(temperature=0.8, top_k=10, seed=0, max_tokens=12)
    eng = Engine(target, speculative=speculative_from_flag(target, "mtp", 3))
    out = eng.generate([prompt], params)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    with torch.no_grad():
        logits = target(torch.tensor([prompt + out.token_ids]))[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits / 0.8, -1).gather(1, torch.tensor(out.token_ids)[:, None])
    torch.testing.assert_close(torch.tensor(out.logprobs), want[:, 0], atol=2e-5, rtol=0)


def test_mtp_flag_needs_mtp_modules() -> None:
    with pytest.raises(LmforgeError, match="mtp_depth > 0"):
        speculative_from_flag(_model(mtp_depth=0), "mtp")


@pytest.mark.slow
def test_sampled_mtp_speculation_follows_the_target_distribution() -> None:
    """χ² through the engine: (t1, t2) after a prompt, t2 from a verify step with an MTP draft
    (k = 1 of room), 3000 seeded requests at temperature 1 over a 5-token vocabulary, against
    the target's exact joint p(t1) p(t2 | t1)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    v, n, prompt = 5, 3000, [1, 2, 3]
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=v, context_length=32, d_model=32, n_layers=1, n_heads=4,
                      mtp_depth=1)  # fmt: skip
    target = TransformerLM(cfg).eval()
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt]))[0, -1], -1)  # (V,)
        joint = torch.stack(
            [p1[a] * torch.softmax(target(torch.tensor([[*prompt, a]]))[0, -1], -1)
             for a in range(v)]
        )  # (V, V)  # fmt: skip
    spec = speculative_from_flag(target, "mtp", 2)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True)
              for i in range(n)]  # fmt: skip
    outs = Engine(target, speculative=spec).generate([prompt] * n, params)
    counts = torch.zeros(v * v, dtype=torch.float64)
    for o in outs:
        a, b = o.outputs[0].token_ids[:2]
        counts[a * v + b] += 1
    assert spec.stats.drafted >= n and 0 < spec.stats.accepted < spec.stats.drafted
    expected = joint.flatten().double() * n
    assert scipy_stats.chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, MLA])
def test_mtp_tap_is_fed_inside_the_compiled_step(kw: dict) -> None:
    """With the compiled decode step (the CUDA default; inductor on the CPU here) plain decode
    steps and verify rows run compiled, and the hidden-state tap is still written there: the
    same drafts are accepted as in the eager engine, and the tokens equal plain decoding."""
    target = _model(**kw, vocab_size=3)  # a small vocabulary: some random drafts are accepted
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 3, (n,), generator=g).tolist() for n in (1, 9, 30)]
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = [o.outputs[0].token_ids for o in Engine(target).generate(prompts, params)]
    stats = []
    for compile in (False, True):
        spec = speculative_from_flag(target, "mtp", 2)
        eng = Engine(target, speculative=spec, compile=compile)
        got = [o.outputs[0].token_ids for o in eng.generate(prompts, params)]
        assert got == plain
        stats.append((spec.stats.drafted, spec.stats.accepted))
    assert eng.decoder is not None and eng.decoder.failed is None
    assert stats[0] == stats[1] and stats[0][1] > 0


@pytest.mark.parametrize("kw", [{}, MLA, {"mtp_depth": 1}])
def test_cached_draft_steps_equal_the_reference_draft_for_draft(kw: dict) -> None:
    """The engine's MTP proposer keeps one KV cache per draft step across the proposals of a
    sequence: every proposal (greedy and sampled runs, so rounds accept different counts)
    equals mtp_draft's full recompute over the same hidden states, and it runs far fewer rows."""
    target = _model(**kw)
    seen: list[tuple[int, int]] = []

    class Checked(MTPDraft):
        def propose(self, hidden, tokens, k, key=None, *, on_device=False):  # type: ignore[override]
            got = super().propose(hidden, tokens, k, key, on_device=on_device)
            if key is not None:
                ids = torch.tensor([list(tokens)])
                want = mtp_draft(target.mtp, hidden[None], ids, k, target.token_embeddings,
                                 target.logits_from_hidden)  # fmt: skip
                as_list = got.tolist() if isinstance(got, torch.Tensor) else got
                assert as_list == want[0].tolist()
                seen.append((len(tokens), k))
            return got

    base = mtp_draft_for(target)
    drafter = Checked(base.mtp, base.embed, base.head, base.new_cache)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (2, 17, 40)]
    for params in (SamplingParams(temperature=0, max_tokens=20),
                   SamplingParams(temperature=1.0, seed=1, max_tokens=20)):  # fmt: skip
        spec = Speculative(drafter, 3)
        Engine(target, speculative=spec).generate(prompts, params)
    assert len(seen) > 20
    full = sum(k * (n - 1) for n, k in seen)  # rows the recompute runs
    assert drafter.rows_computed < full / 3


def test_draft_caches_follow_a_new_sequence() -> None:
    """A proposal for another sequence (another key) starts the step caches afresh."""
    target = _model()
    drafter = mtp_draft_for(target)
    g = torch.Generator().manual_seed(4)
    a = torch.randint(0, V, (12,), generator=g).tolist()
    b = torch.randint(0, V, (9,), generator=g).tolist()
    with torch.no_grad():
        ha, hb = (target.forward_hidden(torch.tensor([t[:-1]]))[0] for t in (a, b))
    first = drafter.propose(ha, a, 3, key="a")
    assert drafter.propose(hb, b, 3, key="b") == drafter.propose(hb, b, 3)
    assert drafter.propose(ha, a, 3, key="a2") == first


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_verify_replays_a_decode_graph(k: int) -> None:
    """The verify forward (k + 1 one-token decode rows of the one sequence) is a graph replay
    like a plain decode step (emulated graphs on the CPU: the same buckets and staging). The
    engine's buckets used to be sized by ``max_num_seqs`` (1 in speculative mode), so every
    verify missed them and launched each kernel of the step on its own (one part of a
    speculative step costing 58x (k=1) to 200x (k=4) a plain one on the H100)."""
    from lmforge.serve.cuda_graphs import DecodeGraphs

    target = _model()
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 9, 30)]
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = [o.outputs[0].token_ids for o in Engine(target).generate(prompts, params)]
    spec = speculative_from_flag(target, "mtp", k)
    eng = Engine(target, speculative=spec)
    graphs = eng.runner.graphs = DecodeGraphs(eng.runner, emulate=True)
    assert k + 1 in graphs.sizes
    replayed: list[tuple[int, bool]] = []
    run = graphs.run

    def counted(batch):
        out = run(batch)
        replayed.append((len(batch.q_lens), out is not None))
        return out

    graphs.run = counted
    got = [o.outputs[0].token_ids for o in eng.generate(prompts, params)]
    assert got == plain and eng.stats["spec_steps"] > 0
    # a verify is 2 to k + 1 rows (fewer drafts near max_tokens), a plain decode step 1
    assert sum(rows > 1 for rows, _ in replayed) == eng.stats["spec_steps"]
    assert any(rows == k + 1 for rows, _ in replayed)
    assert all(hit for _, hit in replayed)  # every decode-only step, verify or plain, replayed


def test_mtp_proposal_is_one_replay_and_no_host_read() -> None:
    """A steady-state MTP proposal is one replay of a captured fixed-shape program (emulated
    on the CPU: rerun on the same static buffers, as a CUDA graph replays them) that reads
    nothing on the host whatever k and the position: the engine feeds its device drafts to the
    verify forward and reads them with the verify's results. It used to run each draft step's
    block eagerly (~150 launches) and read every draft back (k syncs), then the k drafts once.
    Every proposal still equals mtp_draft's full recompute, greedy output equals plain
    decoding, only a sequence's first proposal (its whole prompt) runs outside the replay, and
    a speculative step reads the device once (the verify's results and the drafts together)."""
    from torch.overrides import TorchFunctionMode

    reads = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__"}

    class HostReads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += getattr(func, "__name__", "") in reads
            return func(*args, **(kwargs or {}))

    target = _model()
    seen: list[int] = []  # host reads of each cached proposal
    checking = [0]  # host reads of the checks below, inside engine steps

    class Checked(MTPDraft):
        def propose(self, hidden, tokens, k, key=None, *, on_device=False):  # type: ignore[override]
            if key is None:
                return super().propose(hidden, tokens, k)
            with HostReads() as mode:
                got = super().propose(hidden, tokens, k, key, on_device=on_device)
            seen.append(mode.n)
            assert on_device and isinstance(got, torch.Tensor)
            with HostReads() as check:  # the test's own reads, not the engine's
                ids = torch.tensor([list(tokens)])
                want = mtp_draft(target.mtp, hidden[None], ids, k, target.token_embeddings,
                                 target.logits_from_hidden)  # fmt: skip
                assert got.tolist() == want[0].tolist()
            checking[0] += check.n
            return got

    base = mtp_draft_for(target)
    drafter = Checked(base.mtp, base.embed, base.head, base.new_cache)
    drafter.graphs = True  # off CUDA: emulated replays
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (2, 17, 40)]
    requests = 0
    for params in (SamplingParams(temperature=0, max_tokens=30),
                   SamplingParams(temperature=1.0, seed=1, max_tokens=30)):  # fmt: skip
        spec = Speculative(drafter, 4)
        eng = Engine(target, speculative=spec)
        for i, prompt in enumerate(prompts):
            eng.add_request(prompt, params, request_id=str(i))
        outs: dict[str, list[int]] = {}
        while eng.has_unfinished():
            before, checking[0] = eng.stats["spec_steps"], 0
            with HostReads() as mode:
                for o in eng.step():
                    outs[o.request_id] = o.outputs[0].token_ids
            if eng.stats["spec_steps"] > before:  # the verify's results and the drafts: one read
                assert mode.n - checking[0] == 1
        got = [outs[str(i)] for i in range(len(prompts))]
        requests += len(prompts)
        if params.greedy:
            plain = Engine(target).generate(prompts, params)
            assert got == [o.outputs[0].token_ids for o in plain]
    assert len(seen) > 30 and seen == [0] * len(seen)
    assert drafter.host_reads == 0
    assert len(seen) - drafter.replays <= requests  # one catch-up proposal per sequence at most
