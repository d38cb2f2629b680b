"""The compiled decode step (lmforge.serve.compiled): token-identical greedy output to the eager
engine and to lmforge.generate, the KV pages written in place, and the eager fallback."""

from __future__ import annotations

import pytest
import torch

from lmforge.generate import generate
from lmforge.model import ModelConfig, TransformerLM
from lmforge.serve import Engine, SamplingParams

V = 97


def _model(**kw) -> TransformerLM:
    torch.manual_seed(0)
    base = dict(vocab_size=V, context_length=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    return TransformerLM(ModelConfig(**{**base, **kw})).eval()


def _prompts(lengths=(3, 17, 40, 5)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kw", [{}, dict(qk_norm=True, head_dim=32)])
def test_compiled_decode_is_token_identical(kw: dict) -> None:
    model = _model(**kw)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=10)
    want = [generate(model, [p], 10, temperature=0)[0] for p in prompts]
    eager = Engine(model, block_size=8, num_blocks=64, compile=False).generate(prompts, params)
    eng = Engine(model, block_size=8, num_blocks=64, compile=True)
    got = eng.generate(prompts, params)
    assert eng.decoder is not None and eng.decoder.failed is None  # it really ran compiled
    assert [o.outputs[0].token_ids for o in eager] == want
    assert [o.outputs[0].token_ids for o in got] == want
    # batch sizes 4 down to 1 were all decoded (one dynamic compile + the batch-1 one)
    assert eng.allocator.num_used == 0


def test_compiled_decode_writes_the_pages_in_place() -> None:
    """The custom op's cache mutation reaches the engine's cache tensors (same storage)."""
    from lmforge.serve.compiled import CompiledDecode
    from lmforge.serve.runner import PagedKVCache, StepBatch, forward_step

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
