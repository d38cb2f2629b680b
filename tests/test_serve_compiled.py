"""The compiled decode step (lmforge.serve.compiled): token-identical greedy output to the eager
engine and to lmforge.generate, the KV pages written in place, and the eager fallback."""

from __future__ import annotations

import pytest
import torch

from lmforge.generate import generate
from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams

V = 97


def _model(seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    base = dict(vocab_size=V, context_length=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    return TransformerLM(ModelConfig(**{**base, **kw})).eval()


def _prompts(lengths=(3, 17, 40, 5)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        pytest.param(dict(qk_norm=True, head_dim=32), marks=pytest.mark.slow),
        # Qwen3-Next's output gate with partial rotary: the gate rides in the traced forward,
        # partial RoPE takes the unfused rotary path
        pytest.param(
            dict(attn_output_gate=True, qk_norm=True, rotary_dim=4), marks=pytest.mark.slow
        ),
    ],
)
def test_compiled_decode_is_token_identical(kw: dict) -> None:
    model = _model(**kw)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=10)
    want = [generate(model, [p], 10, temperature=0)[0] for p in prompts]
    eager = Engine(model, block_size=8, num_blocks=64, compile=False).generate(prompts, params)
    from torch._dynamo.utils import counters

    eng = Engine(model, block_size=8, num_blocks=64, compile=True)  # compiles (warm-up)
    graphs = counters["stats"]["unique_graphs"]
    got = eng.generate(prompts, params)
    assert eng.decoder is not None and eng.decoder.failed is None  # it really ran compiled
    assert [o.outputs[0].token_ids for o in eager] == want
    assert [o.outputs[0].token_ids for o in got] == want
    # batches of 4 down to 1 sequences and tables 1 to 7 blocks wide: no recompile after the
    # warm-up's two graphs (dynamic, and batch 1)
    assert counters["stats"]["unique_graphs"] == graphs
    assert eng.allocator.num_used == 0


def test_compiled_decode_writes_the_pages_in_place() -> None:
    """The custom op's cache mutation reaches the engine's cache tensors (same storage)."""
    from lmforge.serve.compiled import CompiledDecode
    from lmforge.serve.model_runner import PagedKVCache, StepBatch, forward_step

    model = _model()
    cfg = model.config

    def run(fn):
        cache = PagedKVCache(cfg.n_layers, 6, 4, cfg.kv_heads, cfg.head_dim, torch.device("cpu"),
                             torch.float32)  # fmt: skip
        ptr = cache.k.data_ptr()
        batch = StepBatch(
            tokens=torch.tensor([5, 7]), positions=torch.tensor([0, 2]),
            slots=torch.tensor([4, 10]), block_tables=torch.tensor([[1, 0], [2, 0]], dtype=torch.int32),
            ctx_lens=torch.tensor([1, 3], dtype=torch.int32), last_rows=torch.tensor([0, 1]),
            q_lens=[1, 1], ctx_lens_list=[1, 3], tables_list=[[1], [2]],
        )  # fmt: skip
        with torch.inference_mode():
            logits = fn(cache, batch)
        assert cache.k.data_ptr() == ptr
        return logits, cache

    want, c0 = run(lambda c, b: forward_step(model, c, b))
    got, c1 = run(lambda c, b: CompiledDecode(model, c, None)(b))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c1.k, c0.k)
    torch.testing.assert_close(c1.v, c0.v)
    assert c1.k[:, 1, 0].abs().sum() > 0 and c1.k[:, 2, 2].abs().sum() > 0


# (CLA's prefill step is also traced whole, fast, by tests/test_serve_compiled_hybrid.py)
@pytest.mark.parametrize(
    "kw", [{}, pytest.param(dict(kv_share_every=2), id="gqa_cla", marks=pytest.mark.slow)]
)
def test_compiled_prefill_step_equals_eager_with_one_graph(kw: dict) -> None:
    """Prefill (mixed) steps through the compiled ``mixed_forward``: chunked prefills with
    decode rows mixed in, a lone sequence (padded with a scratch row), a prefix-cache hit;
    greedy tokens equal lmforge.generate, log-probs those of the eager engine within 1e-5, and
    no graph beyond the warm-up's one."""
    from torch._dynamo.utils import counters

    model = _model(**kw)
    prompts = _prompts((3, 17, 40, 5, 1, 9))
    params = SamplingParams(temperature=0, max_tokens=8)
    want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    kw = dict(block_size=8, num_blocks=64, max_num_batched_tokens=16)
    eager = Engine(model, compile=False, **kw).generate(prompts, params)
    eng = Engine(model, compile=True, **kw)  # compiles both steps (warm-up)
    assert "compiled prefill step on" in eng.startup_line
    graphs = counters["stats"]["unique_graphs"]
    kinds = {"lone": 0, "mixed": 0}
    real = eng.decoder.mixed

    def counted(batch):
        kinds["lone" if len(batch.q_lens) == 1 else "mixed"] += 1
        return real(batch)

    eng.decoder.mixed = counted
    got = eng.generate(prompts, params)
    lone = eng.generate([prompts[2]], params)  # alone, and its 40-token prefix cached
    assert eng.decoder.mixed_failed is None and kinds["lone"] > 0 and kinds["mixed"] > 0
    assert eng.allocator.hits > 0
    assert [o.outputs[0].token_ids for o in got] == want
    assert lone[0].outputs[0].token_ids == want[2]
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs),
            atol=1e-5, rtol=0,
        )  # fmt: skip
    assert counters["stats"]["unique_graphs"] == graphs  # sizes 1..40 tokens, 1..4 sequences


def test_compiled_prefill_failure_falls_back_to_eager_with_one_line(capsys) -> None:
    model = _model()
    eng = Engine(model, block_size=8, num_blocks=32, compile=True)

    def boom(*a, **k):
        raise RuntimeError("inductor exploded\nsecond line")

    eng.decoder._mixed_fn = boom
    p = _prompts((6, 11))
    out = eng.generate(p, SamplingParams(temperature=0, max_tokens=5))
    assert [o.outputs[0].token_ids for o in out] == [generate(model, [x], 5, temperature=0)[0]
                                                     for x in p]  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prefilling eagerly" in err[0] and "inductor exploded" in err[0]
    assert "compiled prefill step off" in eng.runner.describe()


def test_compiled_prefill_is_off_where_layers_read_host_lists(monkeypatch) -> None:
    """Windowed, linear, sparse and MLA layers prefill sequence by sequence from host lists:
    their mixed steps stay eager (the decode step is still compiled)."""
    from lmforge.serve import compiled

    monkeypatch.setattr(compiled.CompiledDecode, "warmup", lambda self, *a: None)
    model = _model(layers="AW", window=8)
    eng = Engine(model, block_size=8, num_blocks=32, compile=True)
    assert eng.decoder is not None and not eng.decoder.mixed_on
    assert "compiled prefill step off" in eng.startup_line


@pytest.mark.gpu
def test_compiled_decode_in_cuda_graphs_is_token_identical() -> None:
    """On the GPU: compiled step + CUDA graphs + the Triton kernels (decode, and the varlen
    prefill inside the compiled prefill step, chunked so decode rows mix in), fp32, vs
    lmforge.generate."""
    model = _model().cuda()
    prompts = _prompts((3, 17, 40, 5, 60))
    want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
    eng = Engine(
        model, block_size=16, num_blocks=64, compile=True, cuda_graphs=True, max_num_seqs=8,
        max_num_batched_tokens=32,
    )  # fmt: skip
    got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert eng.decoder.failed is None and eng.graphs is not None and eng.graphs.graphs
    assert eng.decoder.mixed_on and eng.decoder.mixed_failed is None
    assert [o.outputs[0].token_ids for o in got] == want


def test_compile_failure_falls_back_to_eager_with_one_line(capsys, monkeypatch) -> None:
    model = _model()
    eng = Engine(model, block_size=8, num_blocks=32, compile=True)

    def boom(*a, **k):
        raise RuntimeError("inductor exploded\nsecond line")

    monkeypatch.setattr(eng.decoder, "_fn", boom)
    p = _prompts((6,))
    out = eng.generate(p, SamplingParams(temperature=0, max_tokens=5))
    assert out[0].outputs[0].token_ids == generate(model, p, 5, temperature=0)[0]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decoding eagerly" in err[0] and "inductor exploded" in err[0]


def test_packed_weights_are_views_and_updates_write_through() -> None:
    """Packing q/k/v and w1/w3 into one tensor keeps the parameters' values, a second engine
    reuses the packing, and update_weights reaches the compiled step."""
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng = Engine(model, block_size=8, num_blocks=32, compile=True)
    layer = model.layers[0]
    qkv, w13 = eng.decoder.packed[0]
    ptr = qkv.untyped_storage().data_ptr()
    assert layer.attn.k_proj.weight.untyped_storage().data_ptr() == ptr
    assert layer.ffn.w3.weight.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    again = Engine(model, block_size=8, num_blocks=32, compile=True)
    assert again.decoder.packed[0][0] is qkv
    new = _model(seed=5)
    eng.update_weights(new.state_dict(), version=1)
    p = _prompts((7,))
    got = eng.generate(p, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    assert got == generate(new, p, 6, temperature=0)[0]


@pytest.mark.parametrize("fmt", ["int4", pytest.param("int8", marks=pytest.mark.slow)])
def test_compiled_steps_serve_a_quantized_model(fmt: str) -> None:
    """Quantized linears (custom ops) inside the compiled decode and prefill steps: greedy
    tokens equal lmforge.generate on the same quantized model, and neither step fell back."""
    from lmforge.quant import QuantSpec, quantize_model

    model = quantize_model(_model(), QuantSpec(fmt, 32 if fmt == "int4" else None)).eval()
    assert type(model.layers[0].attn.q_proj).__name__ != "Linear"
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=8)
    want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
    eng = Engine(model, block_size=8, num_blocks=64, compile=True, compile_prefill=True)
    got = eng.generate(prompts, params)
    assert eng.decoder is not None and eng.decoder.failed is None
    assert eng.decoder.mixed_failed is None
    assert [o.outputs[0].token_ids for o in got] == want


def test_decode_gemv_plan_skips_quantized_linears(monkeypatch) -> None:
    """With the decode GEMV on (CUDA's default; forced here on the CPU interpreter's tables), a
    quantized model's compiled step keeps its quantized linears off the GEMV and serves
    lmforge.generate's tokens. The plan used to read ``.weight`` of every projection, which an
    Int4Linear has not: the engine failed on the H200 for every quantized format."""
    from lmforge.quant import QuantSpec, quantize_model
    from lmforge.serve import compiled

    model = quantize_model(_model(), QuantSpec("int4", 32)).eval()
    prompts = _prompts((3, 9))
    want = [generate(model, [p], 4, temperature=0)[0] for p in prompts]
    monkeypatch.setattr(compiled.CompiledDecode, "warmup", lambda self, *a: None)
    eng = Engine(model, block_size=4, num_blocks=16, compile=True)
    dec = compiled.CompiledDecode(eng.runner.model, eng.runner.cache, None, gemv=True)
    assert dec.gemv is not None
    assert all(g[:4] == (0, 0, 0, 0) for g in dec.gemv[0])  # every projection quantized
    dec._fn = torch.compile(compiled.decode_forward, dynamic=True, fullgraph=True,
                            backend="aot_eager")  # fmt: skip
    eng.runner.decoder = dec
    got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert dec.failed is None
    assert [o.outputs[0].token_ids for o in got] == want


def test_each_engine_compiles_its_own_decode_step(monkeypatch) -> None:
    """Dynamo keeps compiled graphs on the code object and silently runs it eagerly past 8: with
    one shared ``decode_forward`` the fifth engine of a process (2 graphs each here) decoded
    eagerly (on the H100, MTP's speculative engines at 26 ms a step against 0.43). Each engine
    now compiles a copy of its own, so every engine's warm-up still compiles."""
    from lmforge.serve import compiled

    torch._dynamo.reset()
    graphs: list[int] = []
    real = torch.compile

    def counting(fn, **kw):
        def backend(gm, example_inputs):
            graphs[-1] += 1
            return gm.forward

        return real(fn, dynamic=kw.get("dynamic"), backend=backend)

    monkeypatch.setattr(compiled.torch, "compile", counting)
    model = _model()
    prompts = _prompts((3, 9))
    want = [generate(model, [p], 4, temperature=0)[0] for p in prompts]
    for _ in range(5):
        graphs.append(0)
        eng = Engine(model, block_size=4, num_blocks=16, compile=True)
        got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in got] == want
        del eng
    assert all(n >= 2 for n in graphs), graphs  # batch 1 and batches >= 2, in every engine


def test_dropped_engine_frees_its_cache_without_a_collection() -> None:
    """The CUDA graphs hold their runner by a proxy: a dropped engine's KV cache goes at once,
    not at the next cyclic collection, which device memory never triggers (on the H100 the next
    engine of a benchmark ran out of memory). Emulated graphs on the CPU, the same objects."""
    import gc
    import weakref

    from lmforge.serve.cuda_graphs import DecodeGraphs

    model = _model()
    eng = Engine(model, block_size=4, num_blocks=16)
    eng.runner.graphs = DecodeGraphs(eng.runner, emulate=True)
    want = eng.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))
    assert eng.runner.graphs.graphs  # the replays were used
    cache = weakref.ref(eng.runner.cache.k)
    gc.disable()
    try:
        del eng
        assert cache() is None
    finally:
        gc.enable()
    assert want[0].outputs[0].token_ids
