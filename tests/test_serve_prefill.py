"""The varlen paged prefill kernel: against a float64 reference on random (never zero) inputs —
several sequences per step with different chunk and context lengths (whole prompts, chunks after
a cached prefix, decode rows with q_len 1, lengths off the block size and the tile), GQA ratios 1
and 4, head dims 64 and 128, scrambled block tables — and the engine's greedy tokens with the
kernel equal to those without it. The kernel runs under TRITON_INTERPRET=1 in a subprocess (tiny
shapes) and on the GPU with -m gpu."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from _interp import run_pytest_in_interpreter
from _sm90 import compile_sm90
from lmforge.serve.attention import paged_attention_float64, paged_prefill, prefill_plan

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None

# (H, K, E, BS, [(q_len, ctx_len), ...]): ctx includes the chunk (already in the pages)
CASES = [
    (4, 4, 64, 4, [(37, 37), (5, 23), (1, 9), (1, 1), (18, 50), (16, 16)]),  # MHA
    (8, 2, 128, 16, [(3, 70), (33, 33), (1, 17), (17, 40), (2, 2)]),  # GQA 4, E 128
    (4, 1, 16, 8, [(9, 9), (1, 31), (40, 41)]),  # MQA, E below the 16-wide dot: padded
]


def _step(h, k, e, bs, seqs, dtype=torch.float32, device="cpu", seed=0):
    """Random pages + queries for one step; blocks scrambled, spare entries padding the tables."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-ctx // bs) for _, ctx in seqs) + 5
    kc = (torch.randn(nb, bs, k, e, generator=g) + 0.1).to(device, dtype)
    vc = (torch.randn(nb, bs, k, e, generator=g) + 0.1).to(device, dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for _, ctx in seqs:
        m = -(-ctx // bs)
        tables.append(perm[used : used + m])
        used += m
    width = max(len(t) for t in tables) + 1  # one extra column: padding is never read
    bt = torch.tensor([t + [perm[-1]] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [t for t, _ in seqs]
    ctx = [c for _, c in seqs]
    q = (torch.randn(sum(q_lens), h, e, generator=g) + 0.1).to(device, dtype)
    return q, kc, vc, tables, bt.to(device), q_lens, ctx


def _want(q, kc, vc, tables, q_lens, ctx):
    out, start = [], 0
    for table, t, n in zip(tables, q_lens, ctx, strict=True):
        out.append(
            paged_attention_float64(q[start : start + t].cpu(), kc.cpu(), vc.cpu(), table, n)
        )
        start += t
    return torch.cat(out)  # (N, H, E) float64


def _want_window(q, kc, vc, tables, q_lens, ctx, window):
    """float64 sliding-window prefill: the row at position p sees keys p − window < n ≤ p."""
    out, start = [], 0
    for table, t, n in zip(tables, q_lens, ctx, strict=True):
        pos_k = torch.arange(n)
        blocks = torch.tensor(table)[pos_k // kc.shape[1]]
        keys = kc[blocks, pos_k % kc.shape[1]].double()  # (n, K, E)
        vals = vc[blocks, pos_k % kc.shape[1]].double()
        qs = q[start : start + t].double()  # (t, H, E)
        g = qs.shape[1] // keys.shape[1]
        keys, vals = keys.repeat_interleave(g, 1), vals.repeat_interleave(g, 1)  # (n, H, E)
        s = torch.einsum("the,nhe->htn", qs, keys) / qs.shape[-1] ** 0.5
        d = torch.arange(n - t, n)[:, None] - pos_k[None, :]  # (t, n) query − key position
        s = s.masked_fill(~((d >= 0) & (d < window)), float("-inf"))
        out.append(torch.einsum("htn,nhe->the", s.softmax(-1), vals))
        start += t
    return torch.cat(out)


def _kernel(q, kc, vc, bt, q_lens, ctx, block_m, block_n=None):
    from lmforge.serve._prefill_triton import paged_prefill_triton

    plan = prefill_plan(q_lens, ctx, q.device, block_m=block_m)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=q.device)
    return paged_prefill_triton(q, kc, vc, bt, ctx_t, plan, block_n=block_n)


def _tiny_model(n_kv_heads: int, head_dim: int | None = None, context: int = 128):
    from lmforge.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, context_length=context, d_model=64, n_layers=2, n_heads=4,
                      n_kv_heads=n_kv_heads, head_dim=head_dim, d_ff=96)  # fmt: skip
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # logits far from flat: greedy is not decided by rounding
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
    return model


def _engine_prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 128, (13,), generator=g).tolist()
    # two prompts share 13 tokens (3 full blocks of 4 hit the prefix cache for the later one:
    # a chunk after a cached prefix); the 40-token budget chunks the long ones and mixes
    # decode rows into prefill steps
    return [
        [*shared, 5, 6, 7],
        torch.randint(0, 128, (29,), generator=g).tolist(),
        [9],
        shared + torch.randint(0, 128, (6,), generator=g).tolist(),
        torch.randint(0, 128, (7,), generator=g).tolist(),
    ]


def _greedy(model, use_triton: bool, device: str = "cpu") -> list[list[int]]:
    from lmforge.serve import Engine, SamplingParams

    eng = Engine(model, device=device, block_size=4, num_blocks=96, max_num_batched_tokens=40,
                 use_triton=use_triton, compile=False)  # fmt: skip
    out = eng.generate(_engine_prompts(), SamplingParams(temperature=0, max_tokens=6))
    assert eng.allocator.num_used == 0
    return [o.outputs[0].token_ids for o in out]


if not _CHILD:

    def test_plan_lists_every_row_once_long_tiles_by_work() -> None:
        from lmforge.serve._prefill_triton import SHORT_ROWS

        q_lens, ctx = [130, 1, 16, 17, 64], [130, 500, 16, 300, 64]
        plan = prefill_plan(q_lens, ctx, torch.device("cpu"), block_m=64)
        cu, l_seq, l_m, s_seq, _ = (x.tolist() for x in plan.parts())
        assert cu == [0, 130, 131, 147, 164, 228]
        assert s_seq == [1, 2]  # q_len <= SHORT_ROWS rows: the 16-row launch, longest first
        plan1 = prefill_plan(q_lens, ctx, torch.device("cpu"), block_m=16)
        assert plan1.n_short == 0 and plan1.n_long == 9 + 1 + 1 + 2 + 4  # 16-row tiles, one launch
        assert SHORT_ROWS == 16
        rows = {(s, m + r) for s, m in zip(l_seq, l_m, strict=True) for r in range(64)}
        rows = {(s, r) for s, r in rows if r < q_lens[s]}
        assert len(rows) == 130 + 17 + 64 and len(l_seq) == 3 + 1 + 1
        keys = [min(ctx[s], ctx[s] - q_lens[s] + m + 64) for s, m in zip(l_seq, l_m, strict=True)]
        assert keys == sorted(keys, reverse=True)

    def test_paged_prefill_on_cpu_is_the_torch_reference() -> None:
        q, kc, vc, tables, bt, q_lens, ctx = _step(*CASES[0])
        got = paged_prefill(q, kc, vc, tables, q_lens, ctx, block_table_tensor=bt)
        torch.testing.assert_close(got.double(), _want(q, kc, vc, tables, q_lens, ctx),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    @pytest.mark.parametrize("part", ["kernel", "engine"])
    def test_prefill_kernel_in_interpreter_subprocess(part) -> None:
        # two children, each under ~10 s: the kernel against float64, the engine's tokens
        run_pytest_in_interpreter(__file__, "-k", "engine" if part == "engine" else "not engine")

    _BIG = (16, 8, 128, 16, [(t, t) for t in (100, 1024, 777)] + [(1, n) for n in range(5, 2000, 97)]
            + [(300, 1500), (64, 64), (65, 129), (129, 1000)])  # fmt: skip

    @pytest.mark.gpu
    @pytest.mark.parametrize(
        ("case", "dtype"),
        [(_BIG, torch.bfloat16), (_BIG, torch.float16), (_BIG, torch.float32),
         *[(c, torch.bfloat16) for c in CASES]],
    )  # fmt: skip
    def test_prefill_kernel_gpu(case, dtype) -> None:
        h, k, e, bs, seqs = case
        q, kc, vc, tables, bt, q_lens, ctx = _step(h, k, e, bs, seqs, dtype, "cuda")
        got = paged_prefill(q, kc, vc, tables, q_lens, ctx, block_table_tensor=bt)  # auto: kernel
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double().cpu(), _want(q, kc, vc, tables, q_lens, ctx),
                                   atol=tol, rtol=tol)  # fmt: skip

    @pytest.mark.gpu
    def test_forward_step_bf16_kernel_matches_torch_gpu() -> None:
        """A bf16 model's step logits (chunks after cached prefixes, whole prompts, decode rows)
        with the prefill kernel against the SDPA loop: close, and the same argmax almost always
        (bf16 rounds the two paths differently, so greedy tokens may differ at near-ties)."""
        from lmforge.serve.model_runner import PagedKVCache, StepBatch, forward_step

        model = _tiny_model(2, 64, context=1024).cuda().to(torch.bfloat16)
        cfg, bs = model.config, 16
        seqs = [(1, n) for n in range(3, 600, 37)] + [(40, 300), (129, 129), (17, 17), (5, 90)]
        _q, _kc, _vc, tables, bt, q_lens, ctx = _step(4, 2, 64, bs, seqs, device="cuda")
        nb = int(bt.max()) + 1
        cache = PagedKVCache(cfg.n_layers, nb, bs, 2, 64, torch.device("cuda"), torch.bfloat16)
        cache.k.normal_()
        cache.v.normal_()
        g = torch.Generator().manual_seed(5)
        tok, pos, slots, last = [], [], [], []
        for table, t, c in zip(tables, q_lens, ctx, strict=True):
            pos += range(c - t, c)
            slots += [table[p // bs] * bs + p % bs for p in range(c - t, c)]
            tok += torch.randint(0, cfg.vocab_size, (t,), generator=g).tolist()
            last.append(len(tok) - 1)

        def lng(x):
            return torch.tensor(x, dtype=torch.long, device="cuda")

        batch = StepBatch(tokens=lng(tok), positions=lng(pos), slots=lng(slots), block_tables=bt,
                          ctx_lens=torch.tensor(ctx, dtype=torch.int32, device="cuda"),
                          last_rows=lng(last), q_lens=q_lens, ctx_lens_list=ctx,
                          tables_list=tables)  # fmt: skip
        with torch.inference_mode():
            a = forward_step(model, cache, batch, use_triton=True)
            b = forward_step(model, cache, batch, use_triton=False)
        assert float((a - b).abs().max() / b.abs().max()) < 5e-2
        assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.8

    @pytest.mark.gpu
    def test_engine_greedy_with_prefill_kernel_equals_torch_gpu() -> None:
        model = _tiny_model(1, 32).cuda()  # fp32: both paths exact enough for equal greedy
        assert _greedy(model, True, "cuda") == _greedy(model, False, "cuda")

else:

    @pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (32, 16), (128, 64)])
    @pytest.mark.parametrize("case", CASES)
    def test_prefill_kernel_matches_float64(case, block_m, block_n) -> None:
        """block_m 16: every chunk in 16-row tiles; 32 and 128 (the GPU's tile, with its
        64-key tiles): chunks of <= 16 rows in the short launch, the rest in long tiles (two
        launches into one output)."""
        q, kc, vc, tables, bt, q_lens, ctx = _step(*case)
        got = _kernel(q, kc, vc, bt, q_lens, ctx, block_m, block_n)
        torch.testing.assert_close(got.double(), _want(q, kc, vc, tables, q_lens, ctx),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip

    @pytest.mark.parametrize("block_m", [16, 32])
    @pytest.mark.parametrize("window", [1, 3, 8, 33])
    @pytest.mark.parametrize("case", CASES)
    def test_prefill_kernel_window_matches_float64(case, window, block_m) -> None:
        """A W layer's prefill: each row sees its last ``window`` keys; the key tiles before
        the tile's first window are skipped, rows whose window starts past a tile keep a
        finite running max (no NaN), decode rows and chunks after a prefix alike."""
        from lmforge.serve._prefill_triton import paged_prefill_triton

        q, kc, vc, tables, bt, q_lens, ctx = _step(*case)
        plan = prefill_plan(q_lens, ctx, q.device, block_m=block_m)
        ctx_t = torch.tensor(ctx, dtype=torch.int32)
        got = paged_prefill_triton(q, kc, vc, bt, ctx_t, plan, block_n=16, window=window)
        want = _want_window(q, kc, vc, tables, q_lens, ctx, window)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    def test_prefill_kernel_one_launch_for_all_chunks() -> None:
        """short_tiles=False (the benchmark's peer): decode rows in 32-row tiles, one launch."""
        from lmforge.serve._prefill_triton import paged_prefill_triton
        from lmforge.serve._prefill_triton import prefill_plan as build

        q, kc, vc, tables, bt, q_lens, ctx = _step(*CASES[1])
        plan = build(q_lens, ctx, q.device, 32, short_tiles=False)
        assert plan.n_short == 0
        got = paged_prefill_triton(q, kc, vc, bt, torch.tensor(ctx, dtype=torch.int32), plan)
        torch.testing.assert_close(got.double(), _want(q, kc, vc, tables, q_lens, ctx),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_prefill_kernel_half_precision(dtype) -> None:
        h, k, e, bs, seqs = CASES[1]
        q, kc, vc, tables, _bt, q_lens, ctx = _step(h, k, e, bs, seqs, dtype)
        got = paged_prefill(q, kc, vc, tables, q_lens, ctx, use_triton=True)  # lists only
        assert got.dtype == dtype
        # P rounded to the MMA dtype for P·V (fp16 here; bf16 runs fp32 dots in the
        # interpreter) and the output rounded to dtype
        tol = 5e-3 if dtype == torch.float16 else 1e-2
        torch.testing.assert_close(got.double(), _want(q, kc, vc, tables, q_lens, ctx),
                                   atol=tol, rtol=tol)  # fmt: skip

    def test_engine_greedy_with_prefill_kernel_equals_torch(monkeypatch) -> None:
        """Chunked prefill, a cached prefix and decode rows in prefill steps, GQA 4: the engine
        with the kernels (prefill + decode) gives the torch paths' greedy tokens."""
        from lmforge.serve import _prefill_triton

        launches = {"long": 0, "short": 0}
        real = _prefill_triton.paged_prefill_triton

        def counting(q, kc, vc, bt, ctx, plan, **kw):
            launches["long"] += plan.n_long > 0
            launches["short"] += plan.n_short > 0
            return real(q, kc, vc, bt, ctx, plan, **kw)

        monkeypatch.setattr(_prefill_triton, "paged_prefill_triton", counting)
        model = _tiny_model(1)
        want = _greedy(model, False)
        assert launches == {"long": 0, "short": 0}
        assert _greedy(model, True) == want
        assert launches["long"] > 0 and launches["short"] > 0  # decode rows were mixed in


def _compile_sm90(
    dtype: str, e: int, block_m: int, block_n: int, warps: int, stages: int, windowed=False
):
    """The prefill kernel lowered to a Hopper cubin (no GPU needed: Triton's bundled ptxas)."""
    import triton
    import triton.language as tl

    from lmforge.serve import _prefill_triton as pt

    mma = {"bf16": tl.bfloat16, "fp16": tl.float16}[dtype]
    consts = dict(G=2, E=e, EP=max(16, triton.next_power_of_2(e)), BS=16, BLOCK_M=block_m,
                  BLOCK_N=block_n, MMA=mma, PREC="tf32", QUANT=0, WINDOWED=windowed)  # fmt: skip

    def arg(name):  # the int inputs and stride_bts: do_not_specialize(_on_alignment)
        if name.endswith("_ptr"):
            ints = name in pt._INT_INPUTS
            return ("*i32" if ints else "*" + dtype), not ints
        if name == "qk_scale":
            return "fp32", False
        return "i32", name != "stride_bts"

    return compile_sm90(pt._paged_prefill_kernel, consts, arg, warps, stages)


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_TRITON or _CHILD, reason="needs triton, not the interpreter")
@pytest.mark.parametrize("e", [64, 128, 256])
def test_prefill_kernel_compiles_for_sm90(e) -> None:
    """The default launch configs (long tiles: wgmma, short 16-row tiles) fit Hopper's shared
    memory; caught here on a CPU machine rather than on the GPU host."""
    from lmforge.serve._prefill_triton import SHORT_ROWS, default_block_m, launch_config

    bm = default_block_m(e)
    for dtype in ("bf16", "fp16"):
        long = _compile_sm90(dtype, e, bm, *launch_config(bm, e, 2))
        assert long.metadata.shared <= 232448
        assert "wgmma.mma_async" in long.asm["ptx"]
        short = _compile_sm90(dtype, e, SHORT_ROWS, *launch_config(SHORT_ROWS, e, 2))
        assert short.metadata.shared <= 232448
    # a W layer's variant (the window's masked loop only), long tiles
    windowed = _compile_sm90("bf16", e, bm, *launch_config(bm, e, 2), windowed=True)
    assert windowed.metadata.shared <= 232448 and "wgmma.mma_async" in windowed.asm["ptx"]


@pytest.mark.requires("triton")
def test_prefill_falls_back_to_torch_when_the_kernel_cannot_build(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Triton build error at the kernel's first launch: one line on stderr, the torch path's
    result, and later calls skip the kernel."""
    from triton.runtime.errors import OutOfResources

    from lmforge.serve import _prefill_triton, attention

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(_prefill_triton, "paged_prefill_triton", broken)
    monkeypatch.setattr(attention, "_PREFILL_FAILED", False)
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16)
    q = torch.randn(7, 4, 16)
    tables, q_lens, ctx_lens = [[3, 1], [5]], [5, 2], [5, 3]
    want = attention.paged_prefill_reference(q, k_cache, v_cache, tables, q_lens, ctx_lens)
    got = attention.paged_prefill(q, k_cache, v_cache, tables, q_lens, ctx_lens, use_triton=True)
    torch.testing.assert_close(got, want)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prefill kernel failed to build" in err[0]
    assert attention._PREFILL_FAILED
    attention.paged_prefill(q, k_cache, v_cache, tables, q_lens, ctx_lens)  # auto: kernel skipped
    assert len(calls) == 1


@pytest.mark.requires("triton")
def test_engine_skips_a_prefill_kernel_that_failed_to_build(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine's default (kernel where it runs): after the first build failure no later
    layer or step tries the kernel again — one stderr line for the whole run, the torch path's
    tokens. The CPU stands in for CUDA in the rule (the rule itself unchanged)."""
    from triton.runtime.errors import OutOfResources

    from lmforge.serve import _prefill_triton, attention, step

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise OutOfResources(300000, 232448, "shared memory")

    real = attention.prefill_kernel_on

    def as_if_cuda(device, head_dim):
        return real(torch.device("cuda"), head_dim)

    model = _tiny_model(2)
    want = _greedy(model, use_triton=False)
    monkeypatch.setattr(_prefill_triton, "paged_prefill_triton", broken)
    monkeypatch.setattr(attention, "_PREFILL_FAILED", False)
    for module in (attention, step):
        monkeypatch.setattr(module, "prefill_kernel_on", as_if_cuda)
    assert _greedy(model, use_triton=None) == want  # several prefill steps, 2 layers each
    err = [line for line in capsys.readouterr().err.splitlines() if "prefill kernel" in line]
    assert len(calls) == 1 and len(err) == 1


def test_prefill_kernel_rule_keeps_wide_heads_on_torch() -> None:
    """Heads wider than the kernel takes (and the CPU) stay on the torch path by default."""
    from lmforge.serve import attention

    if attention.triton_decode_available(torch.device("cuda")):
        cuda = torch.device("cuda")
        assert attention.prefill_kernel_on(cuda, attention.PREFILL_MAX_HEAD_DIM)
        assert not attention.prefill_kernel_on(cuda, attention.PREFILL_MAX_HEAD_DIM * 2)
    assert not attention.prefill_kernel_on(torch.device("cpu"), 64)
