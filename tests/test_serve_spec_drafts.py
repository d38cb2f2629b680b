"""Drafts for speculative decoding: the layer-truncated ("self-speculative") draft equals a
k-layer model holding the same weights; greedy speculative decoding with every draft kind
(truncated draft, separate draft model, n-gram prompt lookup) and with no draft is
token-identical to the engine's greedy decoding; ``benchmarks/speculative.py --quick`` runs on a
tiny random model; and, ``slow``, the same greedy identity on SmolLM2-135M-Instruct."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams
from lmforge.serve.speculative import (
    DraftModel,
    NgramDraft,
    Speculative,
    truncated_draft,
)
from lmforge.utils.errors import LmforgeError

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = next(
    (
        p
        for p in (
            REPO.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
            Path("/work/shared/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        )
        if p.is_file()
    ),
    None,
)
V = 67


def _model(seed: int = 0, layers: int = 4, tied: bool = True) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=V,
        context_length=128,
        d_model=32,
        n_layers=layers,
        n_heads=4,
        n_kv_heads=2,
        tie_embeddings=tied,
    )
    return TransformerLM(cfg).eval()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("share", [True, False])
def test_truncated_draft_equals_a_k_layer_model(tied: bool, share: bool) -> None:
    target = _model(tied=tied)
    draft = truncated_draft(target, 2, share=share)
    assert draft.config.n_layers == 2 and len(draft.layers) == 2
    # the reference: a fresh 2-layer model loaded with the target's first two blocks
    ref = TransformerLM(dataclasses.replace(target.config, n_layers=2)).eval()
    sd = target.state_dict()
    keep = {k: v for k, v in sd.items() if not k.startswith("layers.") or int(k.split(".")[1]) < 2}
    ref.load_state_dict(keep)
    idx = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(draft(idx), ref(idx), atol=0, rtol=0)
        # truncating all layers gives the target back
        torch.testing.assert_close(truncated_draft(target, 4)(idx), target(idx), atol=0, rtol=0)
    shared = draft.layers[0].attn.q_proj.weight is target.layers[0].attn.q_proj.weight
    assert shared == share
    if tied:
        assert draft.lm_head.weight is draft.token_embeddings.weight
    if not share:  # a copy to fine-tune: training it leaves the target alone
        before = target.layers[0].ffn.state_dict()
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(1.0)
        for k, v in target.layers[0].ffn.state_dict().items():
            assert torch.equal(v, before[k])


@pytest.mark.parametrize("bad", [0, 5, -1, 2.0])
def test_truncated_draft_rejects_bad_layer_counts(bad: object) -> None:
    with pytest.raises(LmforgeError, match="truncated draft needs 1 to 4 layers"):
        truncated_draft(_model(), bad)  # type: ignore[arg-type]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 23)]
    prompts.append([7, 8, 9, 10, 11] * 4)  # repetitive: n-gram drafts get accepted
    return prompts


@pytest.mark.parametrize("k", [2, 6])
def test_greedy_identity_for_every_draft_kind(k: int) -> None:
    target = _model()
    params = SamplingParams(temperature=0, max_tokens=14)
    prompts = _prompts()
    plain = [o.outputs[0].token_ids for o in Engine(target).generate(prompts, params)]
    drafts = {
        "none": None,
        "truncated 1": DraftModel(truncated_draft(target, 1)),
        "truncated 4": DraftModel(truncated_draft(target, 4)),
        "separate model": DraftModel(_model(seed=3, layers=1)),
        "n-gram": NgramDraft(),
    }
    for name, draft in drafts.items():
        spec = Speculative(draft, k) if draft is not None else None
        eng = Engine(target, speculative=spec)
        got = [eng.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        assert got == plain, name
        emitted, steps = eng.stats["generated_tokens"], eng.stats["steps"]
        assert emitted == sum(map(len, plain)), name
        assert 1 <= emitted / steps <= k + 1, name  # tokens per target forward
        if spec is None:
            assert emitted == steps and eng.stats["spec_steps"] == 0
            continue
        st = spec.stats
        assert st.accepted <= st.drafted, name
        if name == "truncated 4":  # all layers: the target itself, always accepted
            assert st.acceptance == 1.0
        if name == "n-gram":
            assert st.accepted > 0  # the repetitive prompt


def _bench_module():
    path = REPO / "benchmarks" / "speculative.py"
    spec = importlib.util.spec_from_file_location("_bench_speculative", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_quick_runs_on_a_tiny_random_model(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench_module()
    assert bench.main(["--tiny", "--quick", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "greedy speculative == plain greedy on every prompt: True" in out
    assert "| n-gram | 2 |" in out and "| layers 1/2 | 6 |" in out
    assert "temperature 0.7" in out


def test_benchmark_distill_option_runs_on_a_tiny_random_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = _bench_module()
    argv = ["--tiny", "--quick", "--ks", "2", "--temperatures", "0"]
    assert bench.main([*argv, "--distill-steps", "2", "--distill-prompts", "4"]) == 0
    out = capsys.readouterr().out
    assert (
        "distilled a 1-layer draft through the Trainer: 2 steps" in out
        and "| distilled layers 1/2 | 2 |" in out
    )


def test_break_even_acceptance_solves_the_expected_tokens_equation() -> None:
    be = _bench_module().break_even
    assert be(4, 0.9) == 0.0 and be(2, 3.0) is None  # free drafts / never pays
    for k, cost in ((2, 1.7), (4, 2.5), (6, 4.0)):
        a = be(k, cost)
        assert a is not None and 0 < a < 1
        assert abs(sum(a**i for i in range(k + 1)) - cost) < 1e-9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_identity_on_cuda() -> None:
    target = _model().cuda()
    params = SamplingParams(temperature=0, max_tokens=14)
    prompts = _prompts()
    plain = Engine(target, num_blocks=64)  # default CUDA path: graphs + compiled step
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for draft in (NgramDraft(), DraftModel(truncated_draft(target, 1))):
        eng = Engine(target, num_blocks=64, speculative=Speculative(draft, 4))
        assert [o.outputs[0].token_ids for o in eng.generate(prompts, params)] == want


@pytest.mark.slow
@pytest.mark.skipif(
    SMOLLM2 is None, reason="needs ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf"
)
def test_smollm2_greedy_identity_with_real_drafts() -> None:
    from lmforge.hf.gguf import import_gguf
    from lmforge.serve.templates import render_chat

    target, tok, template = import_gguf(SMOLLM2, context_length=1024)
    text = "The quick brown fox jumps over the lazy dog. " * 3
    msgs = [{"role": "user", "content": f"Repeat this exactly: {text}"}]
    prompt = tok.encode(render_chat(template, msgs))
    params = SamplingParams(temperature=0, max_tokens=24)
    want = Engine(target, eos_token_id=tok.eot_id).generate([prompt], params)[0].outputs[0]
    accepted = {}
    for name, draft in (
        ("n-gram", NgramDraft()),
        ("layers", DraftModel(truncated_draft(target, 10))),
    ):
        spec = Speculative(draft, 4)
        eng = Engine(target, eos_token_id=tok.eot_id, speculative=spec)
        assert eng.generate([prompt], params)[0].outputs[0].token_ids == want.token_ids, name
        accepted[name] = spec.stats.accepted
    assert accepted["n-gram"] > 0  # the answer repeats the prompt: prompt lookup gets accepted
