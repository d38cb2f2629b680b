"""Quantized KV cache (fp8 e4m3 / int8 rows with a float32 scale per token and kv-head).

Checked here: the quantize/dequantize round trip against its stated error bound; the torch
references on a quantized cache against the float64 reference on the same (dequantized) cache;
the Triton decode (one pass and flash-decoding partitions) and prefill kernels against the torch
references on the same quantized cache (tight: only the summation order differs), under
TRITON_INTERPRET=1 in a subprocess and on the GPU with -m gpu; quantized-cache attention against
full-precision float64 attention within a stated bound; the engine's greedy tokens and log-probs
with an fp8/int8 cache against the unquantized cache; the KV budget counting the smaller rows;
one line for an unknown dtype.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from _interp import run_pytest_in_interpreter
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.context import PagedKVCache
from lmforge.serve.attention import (
    dequantize_kv,
    kv_cache_dtype,
    kv_head_dim,
    paged_attention_float64,
    paged_decode,
    paged_decode_reference,
    paged_prefill,
    quantize_kv,
    write_kv,
)
from lmforge.utils.errors import LmforgeError

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None

FORMATS = [torch.float8_e4m3fn, torch.int8]
SHAPES = [  # (H, K, E, BS, lens)
    (4, 2, 16, 4, [5, 1, 11]),
    (6, 1, 8, 8, [17, 8]),  # MQA, a context exactly one block
    (4, 4, 32, 16, [3, 40, 16, 1]),  # MHA
]
# |x − dequant(quant(x))| / amax(row): int8 rounds to half a step of amax/127; e4m3 keeps 3
# mantissa bits (half an ulp: 2^-4 of |x| ≤ amax), and its subnormals' step is 2^-9 of scale
ROUNDTRIP_BOUND = {torch.int8: 0.5 / 127 + 1e-6, torch.float8_e4m3fn: 2**-4 + 1e-6}
# max |attention(quantized cache) − attention(fp cache)| on randn inputs (float64 math);
# measured on the test input: int8 0.014, fp8 0.081
ATTN_BOUND = {torch.int8: 0.02, torch.float8_e4m3fn: 0.12}


def _setup(h, k, e, bs, lens, fmt, q_rows=None, q_dtype=torch.float32, device="cpu", seed=0):
    """Random full-precision K/V for every slot, written quantized through ``write_kv``;
    shuffled block tables. Returns q, the quantized caches, the fp caches, tables, bt, lens."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in lens) + 3
    kf = torch.randn(nb, bs, k, e, generator=g) * 2  # not unit scale: the scales matter
    vf = torch.randn(nb, bs, k, e, generator=g)
    kc = torch.zeros(nb, bs, k, e + 4, dtype=fmt, device=device)
    vc = torch.zeros_like(kc)
    write_kv(kc, vc, torch.arange(nb * bs, device=device),
             kf.reshape(-1, k, e).to(device), vf.reshape(-1, k, e).to(device))  # fmt: skip
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        m = -(-n // bs)
        tables.append(perm[used : used + m])
        used += m
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(q_rows or len(lens), h, e, generator=g).to(device, q_dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, kc, vc, kf, vf, tables, bt.to(device), lens_t


def _want_decode(q, kc, vc, tables, lens):
    return torch.stack(
        [
            paged_attention_float64(q[i : i + 1].cpu(), kc.cpu(), vc.cpu(), tables[i], n)[0]
            for i, n in enumerate(lens)
        ]
    )


def _want_prefill(q, kc, vc, tables, q_lens, lens):
    out, start = [], 0
    for table, t, n in zip(tables, q_lens, lens, strict=True):
        out.append(
            paged_attention_float64(q[start : start + t].cpu(), kc.cpu(), vc.cpu(), table, n)
        )
        start += t
    return torch.cat(out)


def _q_lens(lens):
    return [max(1, n // 2) for n in lens]  # chunks after a cached prefix, decode rows among them


if not _CHILD:

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_roundtrip_within_the_format_bound(fmt) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 3, 32, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
        q = quantize_kv(x, fmt)
        assert q.shape == (64, 3, 36) and q.dtype == fmt and kv_head_dim(q) == 32
        err = (dequantize_kv(q) - x).abs() / x.abs().amax(-1, keepdim=True)
        assert float(err.max()) <= ROUNDTRIP_BOUND[fmt]
        # a zero row stays zero (no 0/0), and the row's max is exact in both formats
        z = dequantize_kv(quantize_kv(torch.zeros(2, 1, 8), fmt))
        assert torch.equal(z, torch.zeros(2, 1, 8))
        i = x.abs().argmax(-1, keepdim=True)
        torch.testing.assert_close(
            dequantize_kv(q).gather(-1, i), x.gather(-1, i), rtol=1e-6, atol=0
        )

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_write_kv_quantizes_into_the_slots(fmt) -> None:
        kc = torch.zeros(3, 4, 2, 12, dtype=fmt)
        vc = torch.zeros_like(kc)
        k, v = torch.randn(2, 2, 8) + 3, torch.randn(2, 2, 8) - 3
        write_kv(kc, vc, torch.tensor([9, 2]), k, v)  # block 2 offset 1, block 0 offset 2
        tol = ROUNDTRIP_BOUND[fmt] * 7  # relative to amax(row) ≤ ~7 here
        torch.testing.assert_close(dequantize_kv(kc[2, 1]), k[0], atol=tol, rtol=0)
        torch.testing.assert_close(dequantize_kv(vc[0, 2]), v[1], atol=tol, rtol=0)
        assert int((kc.view(torch.uint8) != 0).any(-1).any(-1).sum()) == 2

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("shape", SHAPES)
    def test_references_on_a_quantized_cache_match_float64(shape, fmt) -> None:
        """The torch decode and prefill paths dequantize explicitly: equal to the float64 math
        on the same dequantized cache."""
        h, k, e, bs, lens = shape
        q, kc, vc, _kf, _vf, tables, bt, lens_t = _setup(h, k, e, bs, lens, fmt)
        got = paged_decode_reference(q, kc, vc, bt.long(), lens_t.long())
        want = _want_decode(q, kc, vc, tables, lens)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        q_lens = _q_lens(lens)
        qp = torch.randn(sum(q_lens), h, e, generator=torch.Generator().manual_seed(2))
        got = paged_prefill(qp, kc, vc, tables, q_lens, lens, use_triton=False)
        want = _want_prefill(qp, kc, vc, tables, q_lens, lens)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_quantized_attention_within_bound_of_full_precision(fmt) -> None:
        """The cost of quantizing: float64 attention over the quantized cache vs over the
        full-precision keys/values it was written from."""
        h, k, e, bs, lens = 8, 2, 64, 16, [200, 77, 1, 130]
        q, kc, vc, kf, vf, tables, _bt, _ = _setup(h, k, e, bs, lens, fmt)
        quant = _want_decode(q, kc, vc, tables, lens)
        full = _want_decode(q, kf, vf, tables, lens)
        err = float((quant - full).abs().max())
        assert 0 < err <= ATTN_BOUND[fmt], err

    def test_unknown_kv_cache_dtype_is_one_line() -> None:
        assert kv_cache_dtype("auto") is None and kv_cache_dtype("fp8") == torch.float8_e4m3fn
        with pytest.raises(LmforgeError, match=r"unknown kv cache dtype 'fp4'.*auto, fp8, int8"):
            kv_cache_dtype("fp4")
        from lmforge.serve import Engine

        with pytest.raises(LmforgeError, match="unknown kv cache dtype"):
            Engine(_model(), num_blocks=8, kv_cache_dtype="e5m2")

    def test_kv_cache_dtype_flag() -> None:
        """``--kv-cache-dtype`` reaches the engine's keywords; an unknown name is one line
        before any model loads."""
        import argparse

        from lmforge.serve.loading import add_engine_args, engine_flags

        p = argparse.ArgumentParser()
        add_engine_args(p)
        assert engine_flags(p.parse_args([]))["kv_cache_dtype"] == "auto"
        assert engine_flags(p.parse_args(["--kv-cache-dtype", "int8"]))["kv_cache_dtype"] == "int8"
        with pytest.raises(LmforgeError, match="unknown kv cache dtype 'bf8'"):
            engine_flags(p.parse_args(["--kv-cache-dtype", "bf8"]))

    def test_budget_counts_the_smaller_rows() -> None:
        """Per block: bf16 2E bytes per row, fp8/int8 E + 4: the engine sized from memory holds
        more than 1.8x the blocks at E 64 (the scale costs 4/E of the halving)."""
        model = _model(d_model=256, n_heads=4).to(torch.bfloat16)  # E 64
        bf16 = PagedKVCache.bytes_per_block(model, 16, torch.bfloat16)
        for fmt in FORMATS:
            small = PagedKVCache.bytes_per_block(model, 16, fmt)
            assert small == 2 * 2 * 16 * 2 * (64 + 4)  # K and V, 2 layers, 16 slots, 2 heads
            assert bf16 / small == pytest.approx(128 / 68)
            cache = PagedKVCache(2, 3, 16, 2, 64, torch.device("cpu"), fmt)
            assert cache.k.shape == (2, 3, 16, 2, 68) and cache.head_dim == 64
            assert cache.k.nbytes + cache.v.nbytes == 3 * small
        from lmforge.serve import Engine
        from lmforge.serve.model_runner import kv_blocks_for_memory

        budget = 64 << 20
        n = {d: kv_blocks_for_memory(budget, 0.8, 0, PagedKVCache.bytes_per_block(model, 16, d))
             for d in (torch.bfloat16, torch.int8)}  # fmt: skip
        assert n[torch.int8] / n[torch.bfloat16] > 1.85
        blocks = {
            d: Engine(
                model, block_size=16, kv_cache_dtype=d, memory_probe=lambda: budget
            ).runner.num_blocks
            for d in ("auto", "fp8")
        }
        assert blocks["fp8"] > 1.8 * blocks["auto"]

    @pytest.mark.parametrize("fmt", ["int8", "fp8"])
    def test_engine_greedy_with_a_quantized_cache(fmt) -> None:
        """Greedy decoding (prefill, chunked prefill, decode; torch paths on the CPU) with a
        quantized cache vs the fp32 cache: log-probs of the generated tokens within a bound
        while the tokens agree; int8 agrees on every token of this model (measured: max
        log-prob error int8 0.018, fp8 0.057)."""
        from lmforge.serve import Engine, SamplingParams

        model = _model()
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 17, 40, 5, 33)]
        params = SamplingParams(temperature=0, max_tokens=16)
        outs = {}
        for d in ("auto", fmt):
            engine = Engine(model, block_size=8, kv_cache_dtype=d, max_num_batched_tokens=32)
            outs[d] = [o.outputs[0] for o in engine.generate(prompts, params)]
        errs, same = [], 0
        for a, b in zip(outs["auto"], outs[fmt], strict=True):
            same += a.token_ids == b.token_ids
            for x, y, ta, tb in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids, strict=True):
                errs.append(abs(x - y))
                if ta != tb:
                    break
        assert 0 < max(errs) <= {"int8": 0.05, "fp8": 0.15}[fmt], max(errs)
        assert same >= {"int8": 5, "fp8": 4}[fmt]

    @pytest.mark.parametrize("fmt", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
    def test_compiled_decode_on_a_quantized_cache(fmt) -> None:
        """The compiled decode step (the cache through the ``decode_attention`` custom op, the
        quantizing write inside it) equals the eager engine on the same quantized cache, and
        writes the engine's pages in place."""
        from lmforge.serve import Engine, SamplingParams

        model = _model()
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 17, 40, 5)]
        params = SamplingParams(temperature=0, max_tokens=10)
        outs = {}
        for compiled in (False, True):
            engine = Engine(model, block_size=8, num_blocks=64, kv_cache_dtype=fmt,
                            compile=compiled)  # fmt: skip
            ptr = engine.runner.cache.k.data_ptr()
            outs[compiled] = [o.outputs[0] for o in engine.generate(prompts, params)]
            if compiled:
                assert engine.runner.decoder is not None and engine.runner.decoder.failed is None
            assert engine.runner.cache.k.data_ptr() == ptr
        for a, b in zip(outs[False], outs[True], strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)

    def test_startup_line_names_the_kv_dtype() -> None:
        from lmforge.serve import Engine
        from lmforge.serve.engine_process import engine_summary

        line = engine_summary(Engine(_model(), num_blocks=8, kv_cache_dtype="fp8"))
        assert line.endswith("KV dtype fp8 e4m3 + a float32 scale per token/head"), line

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    def test_triton_kernels_in_interpreter_subprocess() -> None:
        run_pytest_in_interpreter(__file__, timeout=600)

    @pytest.mark.gpu
    @pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("shape", [*SHAPES, (32, 4, 128, 16, [*list(range(1, 1000, 31)), 1])])
    def test_triton_kernels_gpu(shape, fmt, q_dtype) -> None:
        """Decode and prefill kernels on the GPU (fp8 converted by the hardware path) against
        the float64 math on the same quantized cache."""
        h, k, e, bs, lens = shape
        q, kc, vc, _kf, _vf, tables, bt, lens_t = _setup(h, k, e, bs, lens, fmt, None, q_dtype,
                                                         "cuda")  # fmt: skip
        tol = 1e-4 if q_dtype == torch.float32 else 2e-2
        got = paged_decode(q, kc, vc, bt, lens_t, use_triton=True)
        want = _want_decode(q, kc, vc, tables, lens)
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)
        q_lens = _q_lens(lens)
        qp = torch.randn(sum(q_lens), h, e, device="cuda").to(q_dtype)
        got = paged_prefill(qp, kc, vc, tables, q_lens, lens, use_triton=True)
        want = _want_prefill(qp, kc, vc, tables, q_lens, lens)
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)

    @pytest.mark.gpu
    @pytest.mark.parametrize("fmt", ["int8", "fp8"])
    def test_engine_cuda_graphs_and_compile_gpu(fmt) -> None:
        """The compiled decode step (custom ops, quantizing write_kv, kernel dequantization)
        inside CUDA graphs equals the eager engine on the same quantized cache."""
        from lmforge.serve import Engine, SamplingParams

        model = _model(d_model=128).cuda().to(torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 17, 40, 5)]
        params = SamplingParams(temperature=0, max_tokens=24)
        outs = {}
        for fast in (False, True):
            engine = Engine(model, num_blocks=64, kv_cache_dtype=fmt, cuda_graphs=fast,
                            compile=fast)  # fmt: skip
            assert "compiled decode step " + ("on" if fast else "off") in engine.startup_line
            outs[fast] = [o.outputs[0] for o in engine.generate(prompts, params)]
        for a, b in zip(outs[False], outs[True], strict=True):
            n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), 24)
            assert n >= 8  # bf16 summation order may flip a near-tie late, never early
            for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=True):
                assert abs(x - y) < 0.05

else:

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("shape", SHAPES)
    def test_triton_decode_matches_reference(shape, fmt) -> None:
        h, k, e, bs, lens = shape
        q, kc, vc, _kf, _vf, tables, bt, lens_t = _setup(h, k, e, bs, lens, fmt)
        got = paged_decode(q, kc, vc, bt, lens_t, use_triton=True)
        ref = paged_decode_reference(q, kc, vc, bt.long(), lens_t.long())
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        want = _want_decode(q, kc, vc, tables, lens)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("n_parts", [2, 3])
    def test_triton_split_decode_matches_reference(n_parts, fmt) -> None:
        """Flash-decoding partitions (some empty for the short sequences) on a quantized cache."""
        from lmforge.serve._attention_triton import paged_decode_triton

        lens = [150, 37, 1]
        q, kc, vc, _kf, _vf, tables, bt, lens_t = _setup(4, 2, 16, 4, lens, fmt)
        got = paged_decode_triton(q, kc, vc, bt, lens_t, n_parts=n_parts)
        want = _want_decode(q, kc, vc, tables, lens)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("fmt", FORMATS)
    @pytest.mark.parametrize("shape", SHAPES)
    def test_triton_prefill_matches_reference(shape, fmt) -> None:
        h, k, e, bs, lens = shape
        q_lens = _q_lens(lens)
        q, kc, vc, _kf, _vf, tables, bt, lens_t = _setup(h, k, e, bs, lens, fmt, sum(q_lens))
        got = paged_prefill(q, kc, vc, tables, q_lens, lens, block_table_tensor=bt,
                            ctx_lens_tensor=lens_t, use_triton=True)  # fmt: skip
        ref = paged_prefill(q, kc, vc, tables, q_lens, lens, use_triton=False)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        want = _want_prefill(q, kc, vc, tables, q_lens, lens)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _model(**kw) -> TransformerLM:
    torch.manual_seed(0)
    base = dict(vocab_size=97, context_length=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)
    return TransformerLM(ModelConfig(**{**base, **kw})).eval()
