"""Every model switch served right: the engine against the reference loop, table-driven.

For each row (one model switch, a combination that ships in ``configs/*.toml`` at tiny sizes,
and engine settings: chunked prefill, a prefix-cache hit, preemption), on the CPU in fp32
(every letter of ``model.layers``, DSA's S included):

- greedy tokens from :class:`lmforge.serve.Engine` equal ``lmforge.generate``'s (the readable
  reference loop over a contiguous KV cache);
- every engine log-prob is within 1e-5 of the model's own ``log_softmax`` over the full
  sequence (one training-style forward, no cache).

The engine runs ``TransformerLM.forward`` with a paged context (``lmforge.model.context``), so
a switch the engine dropped (muP's q scale and output multiplier did, before) shows up here.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import tomllib

import pytest
import torch

from lmforge.generate import generate
from lmforge.model import ModelConfig, MoEConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams

V = 101
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
BASE = dict(vocab_size=V, context_length=64, d_model=64, n_layers=2, n_heads=4)
DEEPSEEK_MOE = MoEConfig(n_experts=8, top_k=2, expert_d_ff=32, n_shared_experts=1, score="sigmoid",
                         n_groups=4, top_groups=2, routed_scale=2.5, first_dense_layers=1)  # fmt: skip

MLA = dict(attention_type="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12)  # fmt: skip
GROUPED = dict(linear_heads=2, linear_v_heads=4, linear_v_head_dim=8)  # 2 q/k : 4 value heads
QWEN3_NEXT_MOE = MoEConfig(n_experts=4, top_k=2, expert_d_ff=32, n_shared_experts=1,
                           shared_gate=True, first_dense_layers=1)  # fmt: skip
DSA_MIXED = dict(layers="GSWA", n_layers=4, window=5, n_kv_heads=2, dsa_topk=3, dsa_index_heads=3)
SWITCHES: dict[str, dict] = {
    "plain": {},
    "mup": dict(mup=True, mup_base_width=16, mup_base_head_dim=8),
    "qk_norm": dict(qk_norm=True),
    "soft_cap": dict(logit_soft_cap=3.0),
    "tied_head": dict(tie_embeddings=True),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "head_dim": dict(head_dim=24, n_kv_heads=2),
    "rope_scaling": dict(
        rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_context=16, rope_theta=500.0
    ),
    "moe": dict(moe=MoEConfig(n_experts=4, top_k=2, expert_d_ff=32, n_shared_experts=1)),
    "moe_deepseek": dict(MLA, moe=DEEPSEEK_MOE),  # DeepSeek-V3: MLA, groups, scale, dense first
    # multi-head latent attention: the engine's latent paged cache (prefill explicit form,
    # decode absorbed through StepOps.attend_latent); with CLA one cache layer for two blocks
    "mla": dict(MLA, q_lora_rank=24),
    "mla_cla": dict(MLA, kv_share_every=2, tie_embeddings=True),
    # cross-layer KV sharing for standard attention (L not a multiple of k): consumers read
    # their producer's pages, the cache holds ceil(L / k) layers
    "gqa_cla": dict(n_kv_heads=2, kv_share_every=2, n_layers=5, qk_norm=True),
    "mha_cla": dict(kv_share_every=3, n_layers=4),
    # hybrid layer patterns (model.layers): recurrent-state slots for G/M/L, a window mask over
    # the pages for W (window 5: shorter than most prompts, so keys leave it)
    "gdn": dict(layers="GGGA", n_layers=4),
    "mamba2": dict(layers="MMMA", n_layers=4),
    "linear": dict(layers="LLAA", n_layers=4),
    "window": dict(layers="WWWA", n_layers=4, window=5),  # W layers in per-sequence rings
    "window_only": dict(layers="WW", window=5),  # blocks behind the window go back
    "mixed": dict(layers="GMWA", n_layers=4, window=5, n_kv_heads=2),
    "mla_hybrid": dict(MLA, layers="GMLA", n_layers=4),
    # DeepSeek sparse attention: indexer keys paged beside K/V, top-4 of up to 31 keys per
    # token (selection drops keys), alone and among G/W layers
    "dsa": dict(layers="SASA", n_layers=4, dsa_topk=4, dsa_index_heads=2, dsa_index_dim=8),
    "dsa_mixed": dict(DSA_MIXED, dsa_index_dim=8, qk_norm=True),
    # Qwen3-Next's attention output gate and partial rotary (Bamba, GPT-NeoX), and the two HF
    # hybrids they come with (GDN + gated attention; Mamba-2 with its own gated-norm eps)
    "output_gate": dict(attn_output_gate=True, qk_norm=True, n_kv_heads=2),
    "partial_rope": dict(rotary_dim=8),
    "qwen3_next": dict(
        layers="GGGA", n_layers=4, attn_output_gate=True, qk_norm=True, rotary_dim=4
    ),
    "bamba": dict(layers="MMAM", n_layers=4, rotary_dim=8, ssm_norm_eps=1e-5),
    # grouped value heads (Qwen3-Next's 16:32 at 2:4, value width ≠ key width): state slots of
    # (4, 16, 8); and the real Qwen3-Next's MoE (softmax top-k, one shared expert scaled by
    # σ(x W_g), the first layer dense) on top
    "gdn_grouped": dict(GROUPED, layers="GGGA", n_layers=4),
    "qwen3_next_moe": dict(
        GROUPED,
        layers="GGGA",
        n_layers=4,
        attn_output_gate=True,
        qk_norm=True,
        rotary_dim=4,
        moe=QWEN3_NEXT_MOE,
    ),
    "all": dict(
        mup=True,
        mup_base_width=32,
        mup_base_head_dim=8,
        qk_norm=True,
        logit_soft_cap=4.0,
        tie_embeddings=True,
        n_kv_heads=2,
        head_dim=24,
        rope_scaling="llama3",
        rope_original_context=16,
        moe=MoEConfig(n_experts=4, top_k=2, expert_d_ff=32, every=2),
    ),
}


def _shipped(path: pathlib.Path) -> dict:
    """The [model] table of a shipped config at tiny sizes: its switches kept (GQA ratio, tied
    head, RoPE theta, QK-norm, muP, soft-cap, MoE routing), its sizes shrunk."""
    model = dict(tomllib.loads(path.read_text())["model"])
    heads = model.get("n_heads", 12)
    ratio = heads // (model.get("n_kv_heads") or heads)
    small_heads = 3 if heads % 4 else 4
    kw = {k: v for k, v in model.items() if k not in ("moe", "d_ff", "head_dim")}
    kw.update(BASE, n_heads=small_heads, d_model=16 * small_heads)
    kw["n_kv_heads"] = max(1, small_heads // ratio) if small_heads % ratio == 0 else small_heads
    if "head_dim" in model:
        kw["head_dim"] = 24
    if kw.get("mup"):
        kw.update(mup_base_width=kw["d_model"] // 2, mup_base_head_dim=8)
    if "moe" in model:
        moe = dict(model["moe"])
        n_exp = min(moe.get("n_experts", 4), 8)
        moe.update(n_experts=n_exp, top_k=min(moe.get("top_k", 2), n_exp), expert_d_ff=32)
        kw["moe"] = MoEConfig(**moe)
    return kw


SHIPPED = {
    f"config:{p.relative_to(CONFIGS)}": _shipped(p)
    for p in sorted([*CONFIGS.glob("*.toml"), *CONFIGS.glob("scaling/*.toml")])
    if "model" in tomllib.loads(p.read_text())
}

# engine settings: default, chunked prefill (a token budget of one block: prompts over
# several steps, mixed with decodes), prefill-only prefix cache off
ENGINES = {
    "default": dict(block_size=4, num_blocks=96),
    "chunked": dict(block_size=4, num_blocks=96, max_num_batched_tokens=4),
    "no_prefix_cache": dict(block_size=4, num_blocks=96, enable_prefix_cache=False),
    # 10 blocks for prompts + outputs needing 20: sequences are preempted and recomputed
    "preempt": dict(block_size=4, num_blocks=10),
}
HYBRIDS = ("gdn", "mamba2", "linear", "window", "mixed", "mla_hybrid", "dsa", "dsa_mixed",
           "qwen3_next", "bamba", "gdn_grouped", "qwen3_next_moe")  # fmt: skip

ROWS = [(name, kw, "default") for name, kw in {**SWITCHES, **SHIPPED}.items()]
ROWS += [
    (name, SWITCHES[name], e)
    for name in ("mup", "all", "mla", "mla_cla", "gqa_cla", "mha_cla")
    for e in ("chunked", "no_prefix_cache")
]
ROWS += [(name, SWITCHES[name], e) for name in HYBRIDS for e in ("chunked", "preempt")]


def _model(kw: dict) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**{**BASE, **kw})).eval()
    with torch.no_grad():  # logits far from flat: greedy is not decided by rounding
        # (linear mixers keep their init: doubled, their recurrences amplify fp32 rounding
        # past the 1e-5 log-prob tolerance while the logits are no less peaked)
        linear = {id(p) for b in model.layers if b.recurrent for p in b.attn.parameters()}
        for p in model.parameters():
            if p.dim() == 2 and id(p) not in linear:
                p.mul_(2.0)
    return model


def _prompts(lengths=(3, 13, 21, 6)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def _check_logprobs(model: TransformerLM, prompt: list[int], out) -> None:
    """The engine's log-probs against log_softmax of the model's own full-sequence forward.

    Hybrid patterns with linear layers (G, M, L) are checked against that forward in float64:
    in fp32 the chunked recurrence (full recompute) and the token-by-token one (decode) round
    differently by ~1e-5 in a log-prob, each being within ~8e-6 of the float64 value."""
    seq = prompt + out.token_ids
    if any(c in "GML" for c in model.config.layer_types):
        model = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = model(torch.tensor([seq]))[0]  # (T, V)
    lp = torch.log_softmax(logits, -1)
    rows = torch.arange(len(prompt) - 1, len(seq) - 1)
    want = lp[rows, torch.tensor(out.token_ids)]
    got = torch.tensor(out.logprobs, dtype=want.dtype)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("switch", "kw", "engine"), ROWS, ids=[f"{r[0]}-{r[2]}" for r in ROWS])
def test_engine_equals_reference(switch: str, kw: dict, engine: str) -> None:
    model = _model(kw)
    prompts = _prompts()
    n = 10
    want = [generate(model, [p], n, temperature=0)[0] for p in prompts]
    eng = Engine(model, **ENGINES[engine])
    cfg = model.config
    if cfg.kv_share_every > 1 and cfg.attention_type == "gqa":  # K/V of the producers only
        layers = -(-cfg.n_layers // cfg.kv_share_every)
        shape = (layers, ENGINES[engine]["num_blocks"] + 1, 4, cfg.kv_heads, int(cfg.head_dim))
        assert eng.cache.k.shape == eng.cache.v.shape == shape
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = eng.generate(prompts, params)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want, f"{switch}: engine tokens differ from lmforge.generate"
    for prompt, o in zip(prompts, outs, strict=True):
        _check_logprobs(model, prompt, o.outputs[0])
    assert eng.allocator.num_used == 0
    if engine == "preempt":
        assert eng.stats["preemptions"] > 0
    if eng.runner.states is not None:  # every recurrent-state slot is back
        assert sorted(eng.scheduler.free_state_slots) == list(range(eng.runner.states.num_slots))


@pytest.mark.parametrize(
    "switch", ["mup", "all", "mla", "mla_cla", "gqa_cla", "mha_cla", "window_only", "dsa"]
)
def test_prefix_cache_hit_serves_the_same_tokens(switch: str) -> None:
    """A second request that shares the first's prompt prefix takes its cached blocks (a hit),
    and still gives the reference's tokens and log-probs."""
    model = _model(SWITCHES[switch])
    (first,) = _prompts((17,))
    second = [*first[:12], 5, 9, 2]
    eng = Engine(model, block_size=4, num_blocks=96)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.generate([first], params)
    hits = eng.allocator.hits
    (out,) = eng.generate([second], params)
    assert eng.allocator.hits - hits == 3  # the 12 shared tokens: three full blocks of 4
    assert out.outputs[0].token_ids == generate(model, [second], 8, temperature=0)[0]
    _check_logprobs(model, second, out.outputs[0])


@pytest.mark.parametrize("switch", ["gdn", "mixed", "window"])
def test_repeated_prompt_with_linear_layers_is_recomputed(switch: str) -> None:
    """Linear layers and W rings turn the prefix cache off (a cached block holds K/V, not the
    recurrent state or ring after it): a repeated prompt takes no cached block, still exact."""
    model = _model(SWITCHES[switch])
    (prompt,) = _prompts((17,))
    eng = Engine(model, block_size=4, num_blocks=96)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.generate([prompt], params)
    (out,) = eng.generate([prompt], params)
    assert eng.allocator.hits == 0
    assert out.outputs[0].token_ids == generate(model, [prompt], 8, temperature=0)[0]
    _check_logprobs(model, prompt, out.outputs[0])


def test_rows_cover_every_switch() -> None:
    """The table names every ModelConfig switch the serving path must honour."""
    on = {k for kw in SWITCHES.values() for k in kw}
    assert {"mup", "qk_norm", "logit_soft_cap", "tie_embeddings", "n_kv_heads", "head_dim",
            "rope_scaling", "moe", "attention_type", "kv_share_every", "layers",
            "window", "dsa_topk"} <= on  # fmt: skip
    kinds = {c for kw in SWITCHES.values() for c in kw.get("layers", "A")}
    assert kinds == set("AWGMLS")
    assert len(SHIPPED) >= 5 and any(
        dataclasses.asdict(kw["moe"]) for kw in SHIPPED.values() if "moe" in kw
    )


@pytest.mark.parametrize("switch", ["all"])
def test_compiled_decode_step_traces_the_model_forward(monkeypatch, switch: str) -> None:
    """The compiled decode and prefill steps are the model's own forward: traced whole
    (fullgraph, no graph break) for every switch at once, with the reference loop's greedy tokens and log-probs.
    aot_eager keeps the CPU test fast; inductor is the same trace (tests/test_serve_compiled.py)."""
    from lmforge.serve import compiled

    monkeypatch.setattr(compiled.CompiledDecode, "warmup", lambda self, *a: None)
    monkeypatch.setattr(compiled.CompiledDecode, "warmup_mixed", lambda self, *a: None)
    model = _model(SWITCHES[switch])
    prompts = _prompts()
    want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    eng = Engine(model, block_size=4, num_blocks=96, compile=True)
    eng.decoder._fn = torch.compile(compiled.decode_forward, dynamic=True, fullgraph=True,
                                    backend="aot_eager")  # fmt: skip
    # and the prefill (mixed) step: the same forward, traced whole
    eng.decoder._mixed_fn = torch.compile(compiled.mixed_forward, dynamic=True, fullgraph=True,
                                          backend="aot_eager")  # fmt: skip
    assert eng.decoder.mixed_on
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert eng.decoder.failed is None and eng.stats["decode_steps"] > 0
    assert eng.decoder.mixed_failed is None and eng.stats["mixed_steps"] > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    for prompt, o in zip(prompts, outs, strict=True):
        _check_logprobs(model, prompt, o.outputs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_engine_equals_reference_gpu(switch: str) -> None:
    """On CUDA with the defaults (CUDA graphs around the compiled decode step, the Triton paged
    kernels): every switch gives the reference loop's greedy tokens (fp32; log-probs within
    1e-3: the kernels' dot products may run in TF32)."""
    model = _model(SWITCHES[switch]).cuda()
    prompts = _prompts()
    want = [generate(model, [p], 10, temperature=0)[0] for p in prompts]
    eng = Engine(model, block_size=16, num_blocks=64, max_num_seqs=8)
    if eng.runner.host_reads:  # fp32 MoE experts, MLA, hybrid layers: eager by design
        assert eng.graphs is None and eng.decoder is None
        assert f"eager because {eng.runner.host_reads}" in eng.startup_line
    else:
        assert eng.graphs is not None and eng.decoder is not None
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert eng.decoder is None or eng.decoder.failed is None
    assert [o.outputs[0].token_ids for o in outs] == want
    for prompt, o in zip(prompts, outs, strict=True):
        seq = prompt + o.outputs[0].token_ids
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq], device="cuda"))[0].float(), -1)
        rows = torch.arange(len(prompt) - 1, len(seq) - 1)
        got = torch.tensor(o.outputs[0].logprobs)
        torch.testing.assert_close(got, lp[rows, o.outputs[0].token_ids].cpu(), atol=1e-3, rtol=0)
