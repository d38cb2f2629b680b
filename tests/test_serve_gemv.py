"""The decode GEMV (lmforge.serve._gemv_triton) and its use in the compiled decode step.

The kernel against a float64 matmul on random (never zero) inputs — M 1..8, N and K off the
tiles, split-K, fp32/fp16/bf16 — the ``lmforge_serve::gemv`` custom op under
``torch.compile(fullgraph=True)`` equal to eager, and the compiled decode step with every
projection on the GEMV against the eager step (logits) and ``lmforge.generate`` (greedy
tokens). The kernels run under TRITON_INTERPRET=1 in a subprocess (tiny shapes) and on the GPU
with ``-m gpu``; ``-m slow`` also lowers the table's launches to Hopper cubins (no GPU needed).
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch

from _interp import run_pytest_in_interpreter
from _sm90 import compile_sm90, ptxas_registers

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None
V = 97

# (M, N, K, config (block_n, block_k, split) or None for the default): ragged N and K, splits
# that do and do not divide the chunk count, a 32-row tile
CASES = [
    (1, 100, 200, (64, 64, 2)),
    (2, 130, 256, (64, 128, 1)),
    (3, 64, 128, (32, 64, 2)),
    (5, 70, 300, (64, 64, 3)),
    (7, 257, 96, (64, 32, 2)),
    (8, 190, 520, None),
]


def _inputs(m, n, k, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) + 0.1).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * 0.1 + 0.01).to(device, dtype)
    return x, w


def _tol(dtype):
    # fp32 accumulation in every case; the output rounded to bf16/fp16 (relative 2^-8 / 2^-11)
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]


def _check(got, x, w, dtype):
    from lmforge.serve._gemv_triton import gemv_reference

    want = gemv_reference(x, w)
    assert got.dtype == dtype and got.shape == want.shape
    tol = _tol(dtype)
    torch.testing.assert_close(got.double().cpu(), want, atol=tol * want.abs().max(), rtol=tol)


def _model(seed=0, **kw):
    from lmforge.model import ModelConfig, TransformerLM

    torch.manual_seed(seed)
    base = dict(vocab_size=V, context_length=128, d_model=64, n_layers=2, n_heads=4,
                n_kv_heads=2, d_ff=160)  # fmt: skip
    model = TransformerLM(ModelConfig(**{**base, **kw})).eval()
    with torch.no_grad():  # logits far from flat: greedy is not decided by rounding
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
    return model


def _prompts(lengths=(3, 17, 40, 5)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def _decode_batch(device="cpu"):
    from lmforge.serve.model_runner import StepBatch

    def t(x, dtype=torch.long):
        return torch.tensor(x, dtype=dtype, device=device)

    return StepBatch(
        tokens=t([5, 7, 11]), positions=t([0, 2, 9]), slots=t([4, 10, 20]),
        block_tables=t([[1, 0, 0], [2, 0, 0], [3, 5, 0]], torch.int32),
        ctx_lens=t([1, 3, 10], torch.int32), last_rows=t([0, 1, 2]), q_lens=[1, 1, 1],
        ctx_lens_list=[1, 3, 10], tables_list=[[1], [2], [3, 5]],
    )  # fmt: skip


def _count_calls(monkeypatch, module, name: str) -> dict:
    """Wrap ``module.name`` so each call is counted in the returned ``{"n": ...}``."""
    calls = {"n": 0}
    real = getattr(module, name)

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(module, name, counting)
    return calls


def _count_gemv(monkeypatch) -> dict:
    from lmforge.serve import _gemv_triton

    return _count_calls(monkeypatch, _gemv_triton, "gemv_partials")


def _step_logits(model, device, decoder_fn):
    """Logits of one decode step (3 sequences, pages pre-filled at random) and the caches."""
    from lmforge.serve.model_runner import PagedKVCache

    cfg = model.config
    dtype = next(model.parameters()).dtype
    cache = PagedKVCache(cfg.n_layers, 8, 4, cfg.kv_heads, cfg.head_dim, torch.device(device),
                         dtype)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    with torch.inference_mode():
        return decoder_fn(cache, _decode_batch(device)), cache


if not _CHILD:

    @pytest.mark.requires("triton")
    def test_table_configs_are_valid() -> None:
        """Every table launch: power-of-two tiles (tl.arange), a chunk no wider than K, at most
        one split per chunk and MAX_SPLIT splits (inductor unrolls that sum into the consumer)."""
        from lmforge.serve._gemv_triton import MAX_ROWS, MAX_SPLIT, TABLE, default_config
        from lmforge.serve.compiled import GEMV_MAX_ROWS, SUM_UNROLL

        configs = [(n, k, c) for (n, k), c in TABLE.items() if c is not None]
        configs += [(n, k, default_config(n, k)) for n, k in [(96, 64), (50000, 4096), (8, 16)]]
        assert MAX_SPLIT < SUM_UNROLL  # the compiled step unrolls every split's sum
        assert GEMV_MAX_ROWS <= MAX_ROWS  # the compiled step's GEMV batches fit the kernel
        for n, k, c in configs:
            assert c.block_n in (32, 64, 128) and c.block_k & (c.block_k - 1) == 0, (n, k, c)
            assert 16 <= c.block_k <= max(16, k), (n, k, c)
            assert 1 <= c.split <= min(MAX_SPLIT, -(-k // c.block_k)), (n, k, c)
        # the TinyLlama-1.1B shapes (packed q/k/v, o, packed w1/w3, w2, LM head) are all listed
        for shape in [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048)]:
            assert shape in TABLE

    @pytest.mark.requires("triton")
    def test_gemv_plan_marks_plain_half_precision_projections() -> None:
        """The plan: off on the CPU by default, forced on it covers every projection; a Linear
        with a hook (or an fp32 weight by default) keeps the module call."""
        from lmforge.serve.compiled import GEMV_DTYPES, CompiledDecode, gemv_plan, pack_weights
        from lmforge.serve.model_runner import PagedKVCache

        model = _model()
        cfg = model.config
        cache = PagedKVCache(2, 4, 4, cfg.kv_heads, cfg.head_dim, torch.device("cpu"),
                             torch.float32)  # fmt: skip
        from lmforge.serve._gemv_triton import gemv_config

        def on(plan):  # which projections are on the GEMV
            return tuple(tuple(bool(f) for f in layer) for layer in plan[0]), bool(plan[1])

        assert CompiledDecode(model, cache, None).gemv is None  # CPU: torch's matmul
        forced = CompiledDecode(model, cache, None, gemv=True).gemv
        assert on(forced) == (((True,) * 5,) * 2, True)
        # the splits are the table's (here default_config's) for each weight
        packed = pack_weights(model)
        want = [gemv_config(*w.shape, w.device).split for w in
                (packed[0][0], model.layers[0].attn.output_proj.weight, packed[0][1],
                 model.layers[0].ffn.w2.weight)]  # fmt: skip
        assert (
            list(forced[0][0][:4]) == want
            and forced[1] == gemv_config(V, 64, torch.device("cpu")).split
        )
        assert on(gemv_plan(model, packed, GEMV_DTYPES)) == (((False,) * 5,) * 2, False)  # fp32
        model.layers[1].attn.output_proj.register_forward_hook(lambda *a: None)
        plan = gemv_plan(model, packed, (torch.float32,))
        assert on(plan) == (((True,) * 5, (True, False, True, True, True)), True)
        assert on(gemv_plan(model, None, (torch.float32,)))[0][0] == (False, True, False, False,
                                                                     False)  # fmt: skip
        qk = _model(qk_norm=True, head_dim=32)  # QK-norm: fused too (RMSNorm in the kernel)
        qk_plan = gemv_plan(qk, pack_weights(qk), (torch.float32,))
        assert on(qk_plan)[0][0] == (True,) * 5
        qk.layers[0].attn.k_norm.register_forward_hook(lambda *a: None)  # not a plain norm
        qk_plan = gemv_plan(qk, pack_weights(qk), (torch.float32,))
        assert on(qk_plan)[0] == ((True,) * 4 + (False,), (True,) * 5)

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    @pytest.mark.parametrize("part", ["kernel", "step_with", "step_under or step_gemv"])
    def test_gemv_in_interpreter_subprocess(part) -> None:
        # three children, each under ~10 s: the kernels and the op against float64 / eager;
        # the compiled step against the eager one; another table's split, the fallback
        run_pytest_in_interpreter(__file__, "-k", part)

    @pytest.mark.slow
    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    def test_engine_gemv_in_interpreter_subprocess() -> None:
        # the engine under the interpreter, and the compiled step of a QK-norm model
        run_pytest_in_interpreter(__file__, "-m", "slow", "-k", "engine or step_with", timeout=600)

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_gemv_kernel_at_table_shapes_gpu(dtype) -> None:
        """Every table shape at 1, 3 and 8 rows against float64."""
        from lmforge.serve._gemv_triton import TABLE, gemv_triton

        g = torch.Generator(device="cuda").manual_seed(0)
        for (n, k), cfg in TABLE.items():
            if cfg is None:
                continue
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.1 + 0.01).to(dtype)
            for m in (1, 3, 8):
                x = (torch.randn(m, k, device="cuda", generator=g) + 0.1).to(dtype)
                _check(gemv_triton(x, w), x, w, dtype)

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("case", CASES)
    def test_gemv_kernel_ragged_gpu(case, dtype) -> None:
        from lmforge.serve._gemv_triton import GemvConfig, gemv_triton

        m, n, k, cfg = case
        x, w = _inputs(m, n, k, dtype, "cuda")
        _check(gemv_triton(x, w, GemvConfig(*cfg) if cfg else None), x, w, dtype)

    @pytest.mark.gpu
    def test_gemv_op_under_inductor_gpu() -> None:
        """fullgraph inductor with dynamic rows: one graph, the op's output equal to eager up to
        bf16 rounding (Inductor adds the split-K partials inside the consumer's kernel)."""
        from lmforge.serve.compiled import gemv

        fn = torch.compile(lambda x, w: torch.relu(gemv(x, w)) + 1, fullgraph=True, dynamic=True)
        for m in (2, 5, 8):
            x, w = _inputs(m, 2048, 5632, torch.bfloat16, "cuda", seed=m)
            torch.testing.assert_close(fn(x, w), torch.relu(gemv(x, w)) + 1)

    @pytest.mark.gpu
    def test_compiled_step_folds_split_k_sums_gpu() -> None:
        """TinyLlama's layer shapes (splits of 2 and 8 in the table): inductor's code for the
        compiled step has no kernel that only adds GEMV partial sums — each layer's sum is
        unrolled into the kernel that consumes it (SwiGLU, residual add + RMSNorm); only the
        LM head's (split 8 at this vocab), the graph's output, stays a kernel of its own."""
        import re

        from torch._inductor.utils import run_and_get_code

        from lmforge.serve.compiled import CompiledDecode

        model = _model(d_model=2048, n_heads=32, n_kv_heads=4, d_ff=5632).cuda()
        model = model.to(torch.bfloat16)
        torch._dynamo.reset()
        codes = []

        def step(cache, batch):
            dec = CompiledDecode(model, cache, None)
            out, code = run_and_get_code(dec, batch)
            codes.extend(code)
            assert dec.failed is None and dec.gemv is not None
            return out

        _step_logits(model, "cuda", step)
        kernels = re.findall(r"Source Nodes: \[([^\]]*)\], Original ATen: \[([^\]]*)\]",
                             "\n".join(codes))  # fmt: skip
        assert any("lmforge_serve.gemv" in aten for _, aten in kernels)
        sums = {int(n) for src, _ in kernels for n in re.findall(r"\bsum_(\d+)", src)}
        alone = {src.strip() for src, aten in kernels if aten.strip() == "aten.sum"}
        assert len(sums) == 2 * 3 + 1  # o, w1|w3, w2 per layer (q|k|v: the RoPE kernel), head
        assert alone == {f"sum_{max(sums)}"}

    @pytest.mark.gpu
    def test_compiled_step_with_gemv_matches_cublas_step_bf16_gpu() -> None:
        """A bf16 step: the compiled step with the GEMV against the one without, close."""
        from lmforge.serve.compiled import CompiledDecode

        model = _model(n_layers=3).cuda().to(torch.bfloat16)
        on, _ = _step_logits(model, "cuda", lambda c, b: CompiledDecode(model, c, None)(b))
        off, _ = _step_logits(
            model, "cuda", lambda c, b: CompiledDecode(model, c, None, gemv=False)(b)
        )
        assert float((on - off).abs().max() / off.abs().max()) < 2e-2

    @pytest.mark.gpu
    @pytest.mark.parametrize("kw", [{}, dict(qk_norm=True, head_dim=32)])
    def test_engine_greedy_with_gemv_equals_generate_gpu(monkeypatch, kw) -> None:
        """fp32 model (and one with QK-norm), the GEMV forced on (fp32 is not its default): the
        engine's greedy tokens through the compiled step in CUDA graphs (buckets 1-8) equal
        lmforge.generate's."""
        from lmforge.generate import generate
        from lmforge.serve import Engine, SamplingParams, compiled

        monkeypatch.setattr(compiled, "_gemv_dtypes", lambda dev: (torch.float32,))
        calls = _count_gemv(monkeypatch)
        model = _model(**kw).cuda()
        prompts = _prompts((3, 17, 40, 5, 60))
        want = [generate(model, [p], 12, temperature=0)[0] for p in prompts]
        eng = Engine(model, block_size=16, num_blocks=64, compile=True, cuda_graphs=True,
                     max_num_seqs=8)  # fmt: skip
        got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
        assert eng.decoder.failed is None and eng.decoder.gemv is not None and calls["n"] > 0
        assert eng.graphs is not None and eng.graphs.graphs
        assert [o.outputs[0].token_ids for o in got] == want

    @pytest.mark.gpu
    def test_engine_bf16_default_gemv_in_graphs_gpu(monkeypatch) -> None:
        """A bf16 engine on CUDA takes the GEMV by default, in CUDA graphs, without falling
        back; its greedy tokens are the cuBLAS engine's up to bf16 rounding: each sequence
        equal until (if at all) a step where the cuBLAS engine's top two tokens are a near-tie,
        the log-probs on the common prefix close."""
        from lmforge.serve import Engine, SamplingParams, compiled

        model = _model(n_layers=3).cuda().to(torch.bfloat16)
        prompts = _prompts((3, 17, 40, 5, 60))
        params = SamplingParams(temperature=0, max_tokens=12, logprobs=5)
        calls = _count_gemv(monkeypatch)
        eng = Engine(model, block_size=16, num_blocks=64, cuda_graphs=True, max_num_seqs=8)
        got = [o.outputs[0] for o in eng.generate(prompts, params)]
        assert eng.decoder.failed is None and eng.decoder.gemv is not None and calls["n"] > 0
        assert eng.graphs is not None and eng.graphs.graphs
        monkeypatch.setattr(compiled, "_gemv_dtypes", lambda dev: None)
        ref_eng = Engine(model, block_size=16, num_blocks=64, cuda_graphs=True, max_num_seqs=8)
        assert ref_eng.decoder.gemv is None
        ref = [o.outputs[0] for o in ref_eng.generate(prompts, params)]
        equal = 0
        for g, r in zip(got, ref, strict=True):
            j = next((i for i, (a, b) in enumerate(zip(g.token_ids, r.token_ids)) if a != b),
                     len(r.token_ids))  # fmt: skip
            equal += j == len(r.token_ids)
            for i in range(j):
                assert abs(g.logprobs[i] - r.logprobs[i]) < 0.1, (i, g.logprobs, r.logprobs)
            if j < len(r.token_ids):  # a flip: only where cuBLAS's two best nearly tie
                alt = r.top_logprobs[j].get(g.token_ids[j])
                assert alt is not None and r.logprobs[j] - alt < 0.25, (j, r.top_logprobs[j])
        assert equal >= len(prompts) // 2

    def _compile_sm90(cfg, even_k=True, dtype="bf16"):
        import triton.language as tl

        from lmforge.serve import _gemv_triton as gt

        consts = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, MP=16,
                      EVEN_K=even_k, MMA={"bf16": tl.bfloat16, "fp16": tl.float16}[dtype],
                      PREC="tf32")  # fmt: skip

        def arg(name):  # N, K and the row strides are multiples of 16 here, M is not
            if name.endswith("_ptr"):
                return ("*fp32" if name == "out_ptr" else "*" + dtype), True
            return "i32", name != "M"

        return compile_sm90(gt._gemv_kernel, consts, arg, cfg.warps, cfg.stages)

    @pytest.mark.slow
    @pytest.mark.skipif(not _HAS_TRITON, reason="needs triton")
    def test_table_launches_compile_for_sm90_without_spills() -> None:
        """Each distinct table launch lowered to a Hopper cubin on the CPU: wgmma for 64-row
        tiles, W streamed by 16-byte cp.async copies, shared memory for >= 2 programs an SM
        where the tile allows, no spills."""
        from lmforge.serve._gemv_triton import TABLE

        for cfg in sorted({c for c in TABLE.values() if c is not None}, key=str):
            compiled = _compile_sm90(cfg)
            ptx = compiled.asm["ptx"]
            assert "wgmma.mma_async" in ptx or cfg.block_n < 64, cfg
            assert re.search(r"cp\.async\.cg\.shared\.global .*0x10", ptx), cfg
            assert compiled.metadata.shared * (2 if cfg.block_k <= 128 else 1) <= 232448, cfg
            regs, spills = ptxas_registers(ptx)
            assert spills == 0, cfg
            assert regs <= 255, cfg
        masked = _compile_sm90(TABLE[(960, 576)], even_k=False, dtype="fp16")
        assert ptxas_registers(masked.asm["ptx"])[1] == 0

    @pytest.mark.slow
    @pytest.mark.skipif(not _HAS_TRITON, reason="needs triton")
    @pytest.mark.parametrize("e", [64, 128])
    def test_rope_kv_kernel_compiles_for_sm90(e) -> None:
        import triton.language as tl

        from lmforge.serve._rope_kv_triton import _rope_kv_kernel as jit

        ptrs = {"p_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64",
                "slot_ptr": "*i64", "q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
                "qn_ptr": "*bf16", "kn_ptr": "*bf16", "eps": "fp32"}  # fmt: skip
        for qk_norm in (False, True):
            consts = dict(SPLIT=8, H=32, KV=4, HALF=e // 2, HP=e // 2, DTYPE=tl.bfloat16,
                          QK_NORM=qk_norm)  # fmt: skip
            compiled = compile_sm90(jit, consts, lambda n: (ptrs.get(n, "i32"), False), warps=1)
            assert ptxas_registers(compiled.asm["ptx"])[1] == 0

else:

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    @pytest.mark.parametrize("case", CASES)
    def test_kernel_matches_float64(case, dtype) -> None:
        from lmforge.serve._gemv_triton import GemvConfig, gemv_partials, gemv_triton

        m, n, k, cfg = case
        x, w = _inputs(m, n, k, dtype)
        config = GemvConfig(*cfg) if cfg else None
        _check(gemv_triton(x, w, config), x, w, dtype)
        if config is not None:  # the partials' layout: one (M, N) slice per split
            assert gemv_partials(x, w, config).shape == (config.split, m, n)

    def test_kernel_strided_rows() -> None:
        """x as a row slice of a wider buffer (a view, as the packed q/k/v split makes)."""
        from lmforge.serve._gemv_triton import GemvConfig, gemv_triton

        x, w = _inputs(4, 96, 192, torch.float32)
        wide = torch.randn(4, 300)
        wide[:, 50:242] = x
        _check(gemv_triton(wide[:, 50:242], w, GemvConfig(32, 64, 2)), x, w, torch.float32)

    @pytest.mark.parametrize("qk_norm", [False, True])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("split", [1, 3])
    def test_kernel_rope_kv_write_matches_unfused(dtype, split, qk_norm) -> None:
        """(QK-norm +) RoPE + KV write from the q/k/v partials against the unfused torch path
        (sum, round, the model's RMSNorm and RotaryEmbedding, write_kv): equal q and pages,
        other slots untouched."""
        from lmforge.model.layers import RMSNorm, RotaryEmbedding
        from lmforge.serve._rope_kv_triton import rope_write_kv
        from lmforge.serve.attention import write_kv

        h, kvh, e, s, nb, bs = 4, 2, 24, 3, 5, 4  # E/2 = 12: pairs padded to 16 in the kernel
        g = torch.Generator().manual_seed(split)
        p = torch.randn(split, s, (h + 2 * kvh) * e, generator=g) + 0.1
        rope = RotaryEmbedding(10000.0, e, 64)
        pos = torch.tensor([0, 7, 63])
        slots = torch.tensor([3, 9, 17])
        kc = torch.randn(nb, bs, kvh, e, generator=g).to(dtype)
        vc = torch.randn(nb, bs, kvh, e, generator=g).to(dtype)
        kc0, vc0 = kc.clone(), vc.clone()
        qn, kn = RMSNorm(e, 1e-6).to(dtype), RMSNorm(e, 1e-6).to(dtype)
        with torch.no_grad():
            qn.weight.copy_(torch.rand(e, generator=g) + 0.5)
            kn.weight.copy_(torch.rand(e, generator=g) + 0.5)
        norms = (qn.weight, kn.weight, 1e-6) if qk_norm else ()
        q = rope_write_kv(p, rope.cos, rope.sin, pos, slots, kc, vc, h, dtype, *norms)
        y = p.sum(0).to(dtype)  # (S, N)
        wq, wk, wv = y.split([h * e, kvh * e, kvh * e], dim=-1)
        wq, wk = wq.reshape(s, h, e), wk.reshape(s, kvh, e)
        if qk_norm:
            wq, wk = qn(wq), kn(wk)
        wq = rope(wq.transpose(0, 1), pos).transpose(0, 1)
        wk = rope(wk.transpose(0, 1), pos).transpose(0, 1)
        write_kv(kc0, vc0, slots, wk, wv.reshape(s, kvh, e))
        # fp32: the same math (the sum of squares in another order with QK-norm); bf16: one
        # rounding apart at most
        tol = (1e-6 if qk_norm else 0) if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(q, wq, atol=tol, rtol=tol)
        torch.testing.assert_close(kc, kc0, atol=tol, rtol=tol)
        torch.testing.assert_close(vc, vc0, atol=0, rtol=0)

    def test_kernel_op_under_compile_fullgraph() -> None:
        """The custom op in a fullgraph compile (aot_eager: the fake's output shape and dtype
        meet the real one) with dynamic rows: equal to the eager op, no recompile across M."""
        from torch._dynamo.utils import counters

        from lmforge.serve.compiled import gemv

        def f(x, w):
            return torch.tanh(gemv(x, w)) * 2

        fn = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
        x, w = _inputs(2, 80, 2048, torch.float16)  # default config: a split-K launch
        fn(x, w)
        frames = counters["stats"]["unique_graphs"]
        for m in (3, 5, 8):
            x, w = _inputs(m, 80, 2048, torch.float16, seed=m)
            torch.testing.assert_close(fn(x, w), f(x, w), atol=0, rtol=0)
        assert counters["stats"]["unique_graphs"] == frames

    @pytest.mark.parametrize(
        "kw", [{}, pytest.param(dict(qk_norm=True, head_dim=32), marks=pytest.mark.slow)]
    )
    def test_step_with_gemv_matches_eager_step(monkeypatch, kw) -> None:
        """The compiled decode step (fullgraph, aot_eager) with every projection on the GEMV
        gives the eager step's logits and KV pages; the GEMV really ran (9 calls a step), and
        (QK-norm +) RoPE + the KV write ran fused (2 calls, one a layer)."""
        from lmforge.serve import _rope_kv_triton
        from lmforge.serve.compiled import CompiledDecode, decode_forward
        from lmforge.serve.model_runner import forward_step

        model = _model(**kw)
        want, c0 = _step_logits(model, "cpu", lambda c, b: forward_step(model, c, b))
        calls = _count_gemv(monkeypatch)
        fused = _count_calls(monkeypatch, _rope_kv_triton, "rope_write_kv")

        def compiled(cache, batch):
            dec = CompiledDecode(model, cache, None, gemv=True)
            dec._fn = torch.compile(decode_forward, dynamic=True, fullgraph=True,
                                    backend="aot_eager")  # fmt: skip
            out = dec(batch)
            assert dec.failed is None
            return out

        got, c1 = _step_logits(model, "cpu", compiled)
        assert calls["n"] == 2 * 4 + 1
        assert fused["n"] == 2
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(c1.k, c0.k)
        torch.testing.assert_close(c1.v, c0.v)

    def test_step_under_another_table_traces_its_own_split(monkeypatch) -> None:
        """Two engines on one model, the second made under a table with other splits: the
        splits are graph constants (static leading dims of the partial sums, so inductor can
        unroll their sum), the second traces its own graph (no shape mismatch between the
        traced partial sums and the launch) and both give the eager logits."""
        from lmforge.serve import _gemv_triton
        from lmforge.serve._gemv_triton import GemvConfig
        from lmforge.serve.compiled import CompiledDecode, decode_forward
        from lmforge.serve.model_runner import forward_step

        model = _model()
        want, _ = _step_logits(model, "cpu", lambda c, b: forward_step(model, c, b))
        traced = []  # per graph: the leading dim of every gemv's partial sums

        def recording(gm, example_inputs):
            dims = [n.meta["example_value"].shape[0] for n in gm.graph.nodes
                    if n.op == "call_function" and "lmforge_serve.gemv" in str(n.target)]  # fmt: skip
            traced.append(dims)
            return gm.forward

        fn = torch.compile(decode_forward, dynamic=True, fullgraph=True, backend=recording)
        plans = []

        def compiled(cache, batch):
            dec = CompiledDecode(model, cache, None, gemv=True)
            dec._fn = fn
            plans.append(dec.gemv)
            out = dec(batch)
            assert dec.failed is None and dec.gemv is not None
            return out

        got1, _ = _step_logits(model, "cpu", compiled)
        # w2 (64, 160): the default's split of 2 (64-wide chunks) -> 5 (32-wide chunks)
        monkeypatch.setitem(_gemv_triton.TABLE, (64, 160), GemvConfig(32, 32, 5))
        got2, _ = _step_logits(model, "cpu", compiled)
        assert plans[0][0][0][3] != plans[1][0][0][3] == 5
        assert len(traced) == 2 and all(type(d) is int for dims in traced for d in dims)
        for dims, plan in zip(traced, plans, strict=True):  # q|k|v, o, w1|w3, w2 per layer, head
            assert dims == [s for layer in plan[0] for s in layer[:4]] + [plan[1]]
        torch.testing.assert_close(got1, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got2, want, atol=1e-4, rtol=1e-4)

    def test_step_gemv_failure_falls_back_to_cublas_with_one_line(monkeypatch, capsys) -> None:
        """A failing GEMV launch: one line, the step rerun without the GEMV (the compiled step
        stays), the eager step's logits."""
        from lmforge.serve import _gemv_triton
        from lmforge.serve.compiled import CompiledDecode, decode_forward
        from lmforge.serve.model_runner import forward_step

        model = _model()
        want, _ = _step_logits(model, "cpu", lambda c, b: forward_step(model, c, b))

        def boom(*a, **k):
            raise RuntimeError("ptxas exploded\nsecond line")

        monkeypatch.setattr(_gemv_triton, "gemv_partials", boom)
        dec = {}

        def compiled(cache, batch):
            dec["d"] = CompiledDecode(model, cache, None, gemv=True)
            dec["d"]._fn = torch.compile(decode_forward, dynamic=True, backend="aot_eager")
            return dec["d"](batch)

        got, _ = _step_logits(model, "cpu", compiled)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert dec["d"].gemv is None and dec["d"].failed is None
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "decode GEMV failed" in err[0] and "ptxas exploded" in err[0]

    @pytest.mark.slow
    def test_engine_greedy_with_gemv_equals_generate(monkeypatch) -> None:
        """The engine (inductor-compiled step, the GEMV forced on for fp32 on the CPU): greedy
        tokens equal to lmforge.generate's."""
        from lmforge.generate import generate
        from lmforge.serve import Engine, SamplingParams, compiled

        monkeypatch.setattr(compiled, "_gemv_dtypes", lambda dev: (torch.float32,))
        calls = _count_gemv(monkeypatch)
        model = _model()
        prompts = _prompts()
        want = [generate(model, [p], 8, temperature=0)[0] for p in prompts]
        eng = Engine(model, block_size=8, num_blocks=64, compile=True)
        got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
        assert eng.decoder.failed is None and eng.decoder.gemv is not None and calls["n"] > 0
        assert [o.outputs[0].token_ids for o in got] == want
        assert eng.allocator.num_used == 0
