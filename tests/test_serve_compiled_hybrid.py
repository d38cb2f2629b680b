"""The compiled decode step for MLA (latent cache, CLA), GQA + CLA and hybrid layer patterns (G, M, L, W
beside A): greedy tokens equal the eager engine's and ``lmforge.generate``'s, log-probs within
1e-5 (fp32), the step compiles without a graph break and without a recompile after warm-up,
chunked prefill (a token budget under the prompts) and a one-token prompt (its state slot
zeroed in a decode-only step) included; the custom ops update the caches and slot states in
place; on CUDA the same through CUDA graphs (``pytest -m gpu``).

CPU inductor compiles take tens of seconds each: one MLA+CLA and one mixed hybrid run through
inductor by default (the other patterns under ``-m slow``); every other kind is traced whole
(fullgraph) through aot_eager, which is fast.
"""

from __future__ import annotations

import pytest
import torch

from lmforge.generate import generate
from lmforge.model import ModelConfig, MoEConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams

V = 97
MLA = dict(
    attention_type="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=12,
)  # fmt: skip
KINDS = {
    "mla": dict(MLA, n_layers=2),
    "mla_cla2": dict(MLA, n_layers=4, kv_share_every=2, q_lora_rank=24),
    # GQA + CLA: consumers pass no K/V to the decode-attention op (read the producer's pages)
    "gqa_cla2": dict(n_layers=3, n_kv_heads=2, kv_share_every=2, qk_norm=True),
    "GGGA": dict(layers="GGGA"),
    "MMMA": dict(layers="MMMA"),
    "LLAA": dict(layers="LLAA"),
    "GMWA": dict(layers="GMWA"),
    # DeepSeek sparse attention: top-4 of up to 40 keys, alone and among G/W layers
    "SASA": dict(layers="SASA", dsa_topk=4, dsa_index_heads=2, dsa_index_dim=8),
    "GSWA": dict(layers="GSWA", dsa_topk=3, dsa_index_dim=8, qk_norm=True),
    # Qwen3-Next's shape: grouped value heads (2 q/k heads : 4 value heads of 8, state slots
    # (4, 16, 8)), gated attention, MoE with a gated shared expert past a dense first layer
    "qwen3_next_moe": dict(
        layers="GGGA",
        linear_heads=2,
        linear_v_heads=4,
        linear_v_head_dim=8,
        qk_norm=True,
        attn_output_gate=True,
        rotary_dim=4,
        moe=MoEConfig(
            n_experts=4,
            top_k=2,
            expert_d_ff=32,
            n_shared_experts=1,
            shared_gate=True,
            first_dense_layers=1,
        ),
    ),
}
FAST = ("mla_cla2", "GMWA")
# the every-kind trace's slow tier: FAST's kinds (traced by the inductor test) and the MoE
# hybrid, whose trace alone takes ~16 s (its writes are traced by the custom-op test below)
TRACE_SLOW = (*FAST, "qwen3_next_moe")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: dynamo's cache lives on ``decode_forward``'s code
    object, so another model's graphs (and the recompile limit they count towards) would
    otherwise carry over between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(kind: str) -> TransformerLM:
    torch.manual_seed(0)
    kw = KINDS[kind]
    cfg = ModelConfig(vocab_size=V, context_length=64, d_model=64, n_heads=4, window=5,
                      **{"n_layers": len(kw.get("layers", "AA")), **kw})  # fmt: skip
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains
        for p in model.parameters():
            if p.dim() == 1 and p.shape[0] > 1:
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (17, 1, 3, 25)]


def _run(eng: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = eng.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@pytest.mark.parametrize(
    "kind", [k if k in FAST else pytest.param(k, marks=pytest.mark.slow) for k in KINDS]
)
def test_compiled_decode_equals_eager_and_generate(kind: str) -> None:
    from torch._dynamo.utils import counters

    model = _model(kind)
    prompts = _prompts()
    want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    engine = dict(block_size=4, num_blocks=64, max_num_batched_tokens=8)  # chunked prefill
    eager_ids, eager_lp = _run(Engine(model, compile=False, **engine), prompts)
    counters.clear()
    eng = Engine(model, compile=True, **engine)  # compiles (warm-up)
    assert "compiled decode step on" in eng.startup_line and "eager because" not in eng.startup_line
    graphs = counters["stats"]["unique_graphs"]
    ids, lp = _run(eng, prompts)
    assert eng.decoder is not None and eng.decoder.failed is None  # it really ran compiled
    assert eager_ids == want and ids == want
    for a, b in zip(lp, eager_lp, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert eng.allocator.num_used == 0
    if "moe" in KINDS[kind]:  # off CUDA bf16 the experts loop over counts read on the host
        return  # (torch._grouped_mm is CUDA bf16 only): a graph break there is expected
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile after the warm-up


@pytest.mark.parametrize(
    "kind", [k if k not in TRACE_SLOW else pytest.param(k, marks=pytest.mark.slow) for k in KINDS]
)
def test_every_kind_traces_whole(monkeypatch, kind: str) -> None:
    """Every kind's decode step traces as one graph (fullgraph: a break raises, and the step
    would fall back to eager) with no recompile past batch 2's dynamic graph and batch 1's;
    aot_eager keeps it fast (the inductor tests above compile the same trace)."""
    from torch._dynamo.utils import counters

    from lmforge.serve import compiled

    model = _model(kind)
    prompts = _prompts()
    want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    real = torch.compile
    monkeypatch.setattr(
        torch, "compile",
        lambda fn, **kw: real(fn, dynamic=True, fullgraph=True, backend="aot_eager"),
    )  # fmt: skip
    counters.clear()
    eng = Engine(model, compile=True, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    assert isinstance(eng.decoder, compiled.CompiledDecode)
    # warm-up: batch 2 (dynamic), batch 1; full-attention kinds also the prefill step's graph
    graphs = 2 + eng.decoder.mixed_on
    assert counters["stats"]["unique_graphs"] == graphs
    ids, _ = _run(eng, prompts)
    assert eng.decoder.failed is None and eng.decoder.mixed_failed is None and ids == want
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]


@pytest.mark.parametrize("kind", ["mla_cla2", "GMWA", pytest.param("MMMA", marks=pytest.mark.slow)])
def test_graph_replay_logic_on_cpu(kind: str) -> None:
    """Everything around a CUDA-graph replay, on the CPU (``DecodeGraphs(emulate=True)``: the
        eager step rerun on the static buffers): a batch of 3 padded to the bucket of 4 (padding
        rows in the scratch block and the scratch state slot), slots copied into the static buffer,
        a one-token prompt's slot zeroed before the replay; an MLA model's repeated prompt served from
    the prefix cache; tokens equal ``lmforge.generate``."""
    from lmforge.serve.cuda_graphs import DecodeGraphs

    model = _model(kind)
    prompts = _prompts()
    want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    eng = Engine(model, compile=False, block_size=4, num_blocks=64, max_num_seqs=4)
    graphs = DecodeGraphs(eng.runner, emulate=True)
    assert graphs.sizes == [1, 2, 4]
    seen = []
    run = graphs.run

    def counted(batch):
        seen.append((len(batch.q_lens), batch.state_fresh is not None))
        return run(batch)

    graphs.run = counted
    eng.runner.graphs = graphs
    ids, _ = _run(eng, [prompts[0], *prompts[2:]])  # three sequences: bucket 4
    one, _ = _run(eng, [prompts[1]])  # alone: its first step is decode-only, in a used slot
    assert ids + one == [want[0], *want[2:], want[1]]
    assert (3, False) in seen  # a padded replay
    if model.config.attention_type != "mla":
        assert (1, True) in seen  # the one-token prompt's slot zeroed before its replay
    else:  # MLA keeps the prefix cache: a repeated prompt's full blocks are hits
        again, _ = _run(eng, [prompts[0]])
        assert again == [want[0]] and eng.allocator.hits == 4  # 16 of its 17 tokens


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_graphs_of_the_compiled_step_equal_eager(kind: str) -> None:
    """On CUDA (graphs and compile on: the defaults) the tokens equal the eager engine's and
    ``lmforge.generate``'s, fp32, with graph padding rows in the scratch block and slot
    (log-probs within 1e-3: the Triton kernels' dot products may run in TF32)."""
    dev = torch.device("cuda")
    model = _model(kind).to(dev)
    prompts = _prompts()
    want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    engine = dict(block_size=4, num_blocks=64, max_num_batched_tokens=8, max_num_seqs=3)
    eager_ids, eager_lp = _run(
        Engine(model, device=dev, compile=False, cuda_graphs=False, **engine), prompts
    )
    eng = Engine(model, device=dev, **engine)
    line = eng.startup_line
    assert "CUDA graphs on" in line and "compiled decode step on" in line, line
    ids, lp = _run(eng, prompts)
    assert eng.decoder.failed is None
    assert eager_ids == want and ids == want
    for a, b in zip(lp, eager_lp, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


@pytest.mark.parametrize("window", [1, 3, 4, 5, 9, 64])
def test_window_decode_equals_the_host_list_path(window: int) -> None:
    """:func:`paged_window_decode` (device only: the last blocks a window can span, gathered by
    table column) == :func:`paged_window_attention` (sequence by sequence from host lists), for
    windows under, at and over the block size, ragged lengths and GQA; the pages written alike."""
    from types import SimpleNamespace

    from lmforge.model.kv_cache import paged_window_attention, paged_window_decode

    g = torch.Generator().manual_seed(0)
    nb, bs, kv, h, e = 12, 4, 2, 4, 8
    lens = [1, 4, 5, 11, 17]
    tables = [torch.randperm(nb - 1, generator=g)[: -(-n // bs)].tolist() for n in lens]
    width = max(map(len, tables))
    pad = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)])
    k_pages = torch.randn(1, nb, bs, kv, e, generator=g, dtype=torch.float64)
    v_pages = torch.randn(1, nb, bs, kv, e, generator=g, dtype=torch.float64)
    q = torch.randn(len(lens), h, e, generator=g, dtype=torch.float64)
    k = torch.randn(len(lens), kv, e, generator=g, dtype=torch.float64)
    v = torch.randn(len(lens), kv, e, generator=g, dtype=torch.float64)
    ctx = SimpleNamespace(
        k_cache=k_pages.clone(), v_cache=v_pages.clone(), slots=slots, ctx_lens_list=lens,
        q_lens=[1] * len(lens), tables_list=tables, ctx_lens=torch.tensor(lens),
    )  # fmt: skip
    want = paged_window_attention(q, k, v, 0, ctx, window)
    kp, vp = k_pages[0].clone(), v_pages[0].clone()
    got = paged_window_decode(q, k, v, kp, vp, slots, pad, torch.tensor(lens, dtype=torch.int32),
                              window)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(kp, ctx.k_cache[0])
    torch.testing.assert_close(vp, ctx.v_cache[0])


@pytest.mark.parametrize("kind", list(KINDS))
def test_cache_writes_are_inside_mutating_custom_ops(monkeypatch, kind: str) -> None:
    """No page or state write of the decode step is left to torch's own in-place ops
    (``index_copy_``, ``copy_``): functionalization would copy the whole cache buffer back
    into the engine's tensor every step (inductor did, for S layers, before their decode
    became ``lmforge_serve::sparse_decode_attention``)."""
    codes: list[str] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        codes.append(gm.code)
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: real(fn, dynamic=True, fullgraph=True, backend=record)
    )
    eng = Engine(_model(kind), compile=True, block_size=4, num_blocks=64)
    _run(eng, _prompts())
    assert codes and eng.decoder.failed is None
    for code in codes:
        assert "index_copy_" not in code and ".copy_(" not in code, kind
        if "S" in KINDS[kind].get("layers", ""):
            assert "sparse_decode_attention" in code
