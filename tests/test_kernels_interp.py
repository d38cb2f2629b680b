"""Triton kernels on CPU through Triton's interpreter, compared with float64 references.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, and the default suite runs
every module in one process, so the default-tier test here re-runs this file in a subprocess with
the variable set; inside that child the kernel tests themselves are collected. Shapes are tiny
(the interpreter executes every program in NumPy) and deliberately not multiples of the tiles.
bfloat16 attention is checked on the GPU only: the interpreter's ``tl.dot`` mishandles bf16.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from _interp import run_pytest_in_interpreter

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None


if not _CHILD:
    # The child's tests in two groups of roughly equal time (no single long default-tier test).
    _GROUPS = {
        "optimizer, rope, model": "adamw or rope or model_with",
        "attention, norm, loss, bench": "not adamw and not rope and not model_with",
    }

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    @pytest.mark.parametrize("group", list(_GROUPS))
    def test_triton_kernels_in_interpreter_subprocess(group: str) -> None:
        run_pytest_in_interpreter(__file__, "-k", _GROUPS[group])

else:
    import dataclasses

    import lmforge.model.attention as attn_mod
    from lmforge.kernels import (
        KernelUnsupportedError,
        attention_reference,
        flash_attention,
        flash_supported,
        fused_linear_cross_entropy,
        linear_cross_entropy_reference,
        rms_norm,
        rms_norm_reference,
    )

    TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}

    def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
        scale = max(1.0, want.abs().max().item())
        err = (got.double() - want).abs().max().item()
        assert err <= TOL[dtype] * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"

    def _grads(out, inputs, seed=1):
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
        return torch.autograd.grad(out, inputs, g), g

    # (B, H, K, T, S, E), causal, dtype, window; interpreter tiles are 32×16 / 16×32, so 37, 50,
    # 70 are ragged. Windows (causal, query i sees keys i − window < j ≤ i): inside one tile,
    # across tile edges, a multiple of the tiles, 1 (each query sees itself), and the model's W
    # layer (window < T, GQA)
    ATTN_CASES = [
        ((1, 2, 1, 37, 37, 16), True, torch.float32, None),
        ((2, 2, 2, 50, 50, 32), False, torch.float32, None),
        ((1, 2, 1, 33, 70, 16), True, torch.float32, None),
        ((1, 1, 1, 70, 33, 16), True, torch.float16, None),
        ((1, 2, 1, 70, 33, 16), False, torch.float16, None),
        ((1, 2, 1, 37, 37, 16), True, torch.float16, None),
        ((1, 2, 1, 70, 70, 16), True, torch.float32, 5),
        ((2, 4, 2, 96, 96, 32), True, torch.float32, 33),
        ((1, 2, 2, 64, 64, 16), True, torch.float32, 16),
        ((1, 1, 1, 45, 45, 16), True, torch.float32, 1),
        ((1, 2, 1, 70, 70, 16), True, torch.float16, 20),
    ]

    @pytest.mark.parametrize("shape, causal, dtype, window", ATTN_CASES)
    def test_flash_attention_triton_interpreted(shape, causal, dtype, window) -> None:
        """Forward and every gradient against the float64 reference (with a window: the kernels
        skip the tiles outside it and mask its edge; a window without causal is refused)."""
        b, h, kv, t, s, e = shape
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(b, h, t, e, generator=gen).to(dtype)
        k = torch.randn(b, kv, s, e, generator=gen).to(dtype)
        v = torch.randn(b, kv, s, e, generator=gen).to(dtype)
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_in = [x.double().requires_grad_() for x in (q, k, v)]
        assert flash_supported(*ins)
        out = flash_attention(*ins, is_causal=causal, window=window)
        ref = attention_reference(*ref_in, is_causal=causal, window=window)
        _close(out, ref, dtype, "O")
        got, g = _grads(out, ins)
        want = torch.autograd.grad(ref, ref_in, g.double())
        for name, a, w in zip("qkv", got, want):
            assert a.dtype == dtype
            _close(a, w, dtype, f"d{name}")
        if window is not None:
            with pytest.raises(KernelUnsupportedError, match="causal"):
                flash_attention(q, k, v, is_causal=False, window=window)

    def test_windowed_attention_layer_trains_through_the_kernel(monkeypatch) -> None:
        """A W layer of the model (backend sdpa, the default) runs the windowed flash kernel
        where it runs (here the interpreter) and matches the masked reference backend."""
        from lmforge.model import ModelConfig, TransformerLM

        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=64, context_length=64, d_model=32, n_layers=2, n_heads=2,
                          layers="WA", window=7)  # fmt: skip
        model = TransformerLM(cfg)
        ref = TransformerLM(dataclasses.replace(cfg, attention="reference"))
        ref.load_state_dict(model.state_dict())
        ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
        calls = []
        real = attn_mod.flash_attention

        def spy(*a, **kw):
            calls.append(kw.get("window"))
            return real(*a, **kw)

        monkeypatch.setattr(attn_mod, "flash_attention", spy)
        out = model(ids)
        out.float().sum().backward()
        assert calls == [7]  # the W layer; the A layer takes SDPA (backend sdpa)
        want = ref(ids)
        want.float().sum().backward()
        assert (out - want).abs().max().item() < 1e-4
        g = model.layers[0].attn.q_proj.weight.grad
        g_ref = ref.layers[0].attn.q_proj.weight.grad
        assert (g - g_ref).abs().max().item() < 1e-4 * max(1.0, g_ref.abs().max().item())

    def test_flash_attention_triton_strided_layout_and_errors() -> None:
        gen = torch.Generator().manual_seed(2)
        # (B, T, H, E) transposed to (B, H, T, E): strided, head dim contiguous — no copy needed.
        q = torch.randn(1, 45, 2, 16, generator=gen).transpose(1, 2)
        k = torch.randn(1, 45, 1, 16, generator=gen).transpose(1, 2)
        v = torch.randn(1, 45, 1, 16, generator=gen).transpose(1, 2)
        out = flash_attention(q, k, v, True)
        _close(out, attention_reference(q.double(), k.double(), v.double()), torch.float32, "O")
        with pytest.raises(KernelUnsupportedError, match="head dim 24"):
            flash_attention(
                torch.randn(1, 1, 8, 24), torch.randn(1, 1, 8, 24), torch.randn(1, 1, 8, 24)
            )
        with pytest.raises(KernelUnsupportedError, match="contiguous head dim"):
            x = torch.randn(1, 1, 16, 8).transpose(-1, -2)
            flash_attention(x, x, x)
        with pytest.raises(KernelUnsupportedError, match=r"dtype torch\.float64"):
            x = torch.randn(1, 1, 8, 16, dtype=torch.float64)
            flash_attention(x, x, x)
        assert not flash_supported(
            torch.randn(1, 1, 8, 24), torch.randn(1, 1, 8, 24), torch.randn(1, 1, 8, 24)
        )

    @pytest.mark.parametrize("shape", [(3, 5, 37), (70, 128), (2, 1000)])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    def test_rms_norm_triton_interpreted(shape, dtype) -> None:
        gen = torch.Generator().manual_seed(1)
        x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
        w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype)
        xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        y = rms_norm(xt, wt, 1e-5)
        ref = rms_norm_reference(xr, wr, 1e-5)
        assert y.dtype == dtype and y.shape == x.shape
        _close(y, ref, dtype, "y")
        got, g = _grads(y, (xt, wt))
        want = torch.autograd.grad(ref, (xr, wr), g.double())
        _close(got[0], want[0], dtype, "dx")
        # dw sums over all rows: compare relative to its size.
        _close(got[1] / max(1.0, want[1].abs().max().item()), want[1] / max(1.0, want[1].abs().max().item()), dtype, "dw")  # fmt: skip

    @pytest.mark.parametrize(
        "n, d, v, z_loss, reduction, dtype",
        [
            (50, 16, 1037, 1e-2, "mean", torch.float32),
            (50, 16, 1037, 1e-2, "mean", torch.bfloat16),
            (33, 32, 700, 0.0, "sum", torch.bfloat16),
            (20, 16, 2100, 1e-3, "none", torch.float32),
        ],
    )
    def test_fused_linear_cross_entropy_triton_interpreted(
        n, d, v, z_loss, reduction, dtype
    ) -> None:
        gen = torch.Generator().manual_seed(3)
        h = torch.randn(n, d, generator=gen).to(dtype)
        w = (torch.randn(v, d, generator=gen) * 0.3).to(dtype)
        t = torch.randint(0, v, (n,), generator=gen)
        t[::5] = -100
        ht, wt = h.clone().requires_grad_(), w.clone().requires_grad_()
        hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
        loss = fused_linear_cross_entropy(
            ht, wt, t, z_loss=z_loss, reduction=reduction, backend="triton", chunk_rows=16
        )
        ref = linear_cross_entropy_reference(hr, wr, t, z_loss=z_loss, reduction=reduction)
        _close(loss, ref, dtype, "loss")  # float32 math, but bf16 logits carry bf16 rounding
        got, g = _grads(loss, (ht, wt))
        want = torch.autograd.grad(ref, (hr, wr), g.double())
        for name, a, b in zip(("dh", "dW"), got, want):
            _close(a, b, dtype, name)

    def test_cross_entropy_chunk_kernel_interpreted() -> None:
        # The chunk kernel alone: loss rows and the in-place gradient against float64, ragged
        # last slice, ignored rows, the target in the last column, and a negative row scale
        # (the path that multiplies instead of folding the scale into the exponent).
        from lmforge.kernels import _cross_entropy_triton as k

        gen = torch.Generator().manual_seed(9)
        n, v, z_loss = 7, 2500, 1e-3
        z = torch.randn(n, v, generator=gen) * 3
        t = torch.randint(0, v, (n,), generator=gen)
        t[2], t[4] = -100, v - 1
        scale = torch.rand(n, generator=gen) + 0.5
        scale[4] = -0.7
        loss = torch.empty(n)
        got = z.clone()
        k.loss_and_grad_(got, t, scale, -100, z_loss, True, loss)
        # A persistent launch (3 programs walking the 7 rows): the same values.
        got_p, loss_p = z.clone(), torch.empty(n)
        k.loss_and_grad_(got_p, t, scale, -100, z_loss, True, loss_p, programs=3)
        torch.testing.assert_close(got_p, got, rtol=0, atol=0)
        torch.testing.assert_close(loss_p, loss, rtol=0, atol=0)
        z64 = z.double()
        lse = torch.logsumexp(z64, -1)
        valid = t != -100
        safe = torch.where(valid, t, 0)
        want_loss = torch.where(
            valid, lse - z64.gather(1, safe[:, None])[:, 0] + z_loss * lse**2, 0
        )
        want = torch.softmax(z64, -1) * (1 + 2 * z_loss * lse)[:, None]
        want[torch.arange(n), safe] -= 1
        want *= (scale.double() * valid)[:, None]
        torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)

    def test_rms_norm_writes_the_autocast_dtype_directly() -> None:
        # out_dtype=bf16 on fp32 input: y is the fp32 result in bf16; dx stays fp32 and
        # takes a bf16 upstream gradient; the model's triton norm does this under autocast.
        gen = torch.Generator().manual_seed(12)
        x = torch.randn(37, 40, generator=gen)
        w = torch.rand(40, generator=gen) + 0.5
        dy = torch.randn(37, 40, generator=gen).bfloat16()
        xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = rms_norm(xt, wt, 1e-5, out_dtype=torch.bfloat16)
        assert y.dtype == torch.bfloat16
        want = rms_norm_reference(x.double(), w.double(), 1e-5)
        # One bf16 rounding (the interpreter may truncate where the GPU rounds to nearest).
        torch.testing.assert_close(y.double(), want, atol=1e-2, rtol=8e-3)
        dx, dw = torch.autograd.grad(y, (xt, wt), dy)
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        rdx, rdw = torch.autograd.grad(rms_norm_reference(xr, wr, 1e-5), (xr, wr), dy.double())
        assert dx.dtype == torch.float32
        torch.testing.assert_close(dx.double(), rdx, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dw.double(), rdw, atol=1e-4, rtol=1e-5)
        from lmforge.model import ModelConfig
        from lmforge.model.attention import _Norm

        norm = _Norm(40, 1e-5, "triton")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert norm(x).dtype == torch.bfloat16
        assert norm(x).dtype == torch.float32 and ModelConfig  # outside autocast: x's dtype

    def test_bench_kernels_code_paths_run_on_cpu() -> None:
        # The GPU benchmark's check and timing code, on CPU through the interpreter with tiny
        # shapes: proves the code paths run (peers without a CPU build report "n/a").
        from lmforge.bench import kernels as bench
        from lmforge.bench.timing import markdown_table

        rows, ok = bench.check_attention(((torch.float32, 16, True, (1, 2, 1, 20)),), "cpu")
        assert ok, rows
        rows, ok = bench.check_rms_norm(((torch.float32, (10, 24)),), "cpu")
        assert ok, rows
        rows, ok = bench.check_cross_entropy(((20, 16, 70, 1e-4),), "cpu")
        assert ok, rows
        attn = bench.bench_attention([32], [16], 1, tokens=32, width=32, dtype=torch.float32,
                                     device="cpu")  # fmt: skip
        assert isinstance(attn[0][3], float) and isinstance(attn[0][4], float)
        rms = bench.bench_rms_norm([(16, 32)], 1, 1.0, device="cpu")
        assert isinstance(rms[0][1], float) and isinstance(rms[0][3], float)
        ce = bench.bench_cross_entropy([(16, 16, 50)], 1, device="cpu")
        assert isinstance(ce[0][1], float) and str(ce[0][2]).startswith("n/a")
        rows, ok = bench.check_elementwise("cpu", small=True)
        assert ok, rows
        ew = bench.bench_elementwise(1, "cpu", small=True)
        assert all(isinstance(x, float) for row in ew for x in row[2:])
        assert markdown_table(["a", "b"], [[1.5, "x"]]).count("|") == 9

    @pytest.mark.parametrize("block,warps,slices", [(4096, 8, 1), (1024, 4, 4)])
    def test_adamw_multi_tensor_kernel_interpreted(block, warps, slices, monkeypatch) -> None:
        # One launch over tensors smaller and larger than a slice and a chunk (ragged edges: a
        # chunk's last slice partial, or its later slices empty), against the per-tensor torch
        # formula; a False flag leaves every value as it was.
        from lmforge.kernels import _adamw_triton, adamw_multi_tensor_, adamw_reference_

        for name, value in (("BLOCK", block), ("WARPS", warps), ("SLICES", slices)):
            monkeypatch.setattr(_adamw_triton, name, value)
        gen = torch.Generator().manual_seed(11)
        shapes = [(5000,), (7, 3), (4096,), (1,), (64, 130), (2500,)]

        def state():
            return [
                [torch.randn(s, generator=gen) for s in shapes],  # params
                [torch.randn(s, generator=gen) * 2 for s in shapes],  # grads
                [torch.randn(s, generator=gen) * 0.1 for s in shapes],  # first moments
                [torch.rand(s, generator=gen) * 0.01 + 1e-4 for s in shapes],  # second moments
                [torch.tensor(float(t), dtype=torch.float64) for t in (0, 3, 10, 1, 250, 7)],
            ]

        hp = torch.tensor([3e-3, 0.1, 0.9, 0.95, 1e-8], dtype=torch.float64)
        scale = torch.tensor(0.37)
        a = state()
        # The one reference, run in float64 on the same values.
        b = [[x.to(torch.float64, copy=True) for x in xs] for xs in a]
        for i in range(4):
            if i == 2:  # new gradients elsewhere (as every training step has): the table follows
                a[1] = [g * -0.5 for g in a[1]]
                b[1] = [g * -0.5 for g in b[1]]
            adamw_multi_tensor_(*a, hp, torch.tensor(True), scale)
            adamw_reference_(*b, hp, torch.tensor(True), scale)
        for xs, ys in zip(a, b):
            for x, y in zip(xs, ys):
                torch.testing.assert_close(x.double(), y, rtol=2e-6, atol=1e-7)
        before = [[x.clone() for x in xs] for xs in a]
        adamw_multi_tensor_(*a, hp, torch.tensor(False), scale)
        for xs, ys in zip(a, before):
            assert all(torch.equal(x, y) for x, y in zip(xs, ys))
        with pytest.raises(KernelUnsupportedError, match="float32"):
            adamw_multi_tensor_([x.bfloat16() for x in a[0]], *a[1:], hp, torch.tensor(True), scale)

    def test_adamw_kernel_master_weights_interpreted() -> None:
        # Master weights: bf16 gradients (a bf16 model's) upcast as they are read, fp32 masters
        # and moments updated as the reference does, and every bf16 copy rewritten from its new
        # master, rounded to nearest even exactly as copy_ rounds; nothing moves on a False flag.
        from lmforge.kernels import adamw_multi_tensor_, adamw_reference_

        gen = torch.Generator().manual_seed(12)
        shapes = [(3000,), (5, 7), (1024,), (33, 65)]
        masters = [torch.randn(s, generator=gen) for s in shapes]
        grads = [(torch.randn(s, generator=gen) * 2).bfloat16() for s in shapes]
        ms = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
        vs = [torch.rand(s, generator=gen) * 0.01 + 1e-4 for s in shapes]
        steps = [torch.tensor(float(t), dtype=torch.float64) for t in (0, 4, 9, 100)]
        copies = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
        a = [masters, grads, ms, vs, steps, copies]
        # The one reference in float64 (masters, moments); gradients and copies keep bf16.
        b = [[x.to(torch.float64, copy=True) for x in xs] for xs in a[:5]]
        b[1] = [g.clone() for g in grads]
        b.append([c.clone() for c in copies])
        hp = torch.tensor([3e-3, 0.1, 0.9, 0.95, 1e-8], dtype=torch.float64)
        scale = torch.tensor(0.61)
        for _ in range(3):
            adamw_multi_tensor_(*a[:5], hp, torch.tensor(True), scale, a[5])
            adamw_reference_(*b[:5], hp, torch.tensor(True), scale, b[5])
        for xs, ys in zip(a[:5], b[:5]):
            for x, y in zip(xs, ys):
                torch.testing.assert_close(x.double(), y.double(), rtol=2e-6, atol=1e-7)
        for x, y in zip(a[5], b[5]):  # bf16 copies of nearly equal masters: one bf16 ulp
            torch.testing.assert_close(x.float(), y.float(), rtol=2**-7, atol=0)
        for m, c in zip(a[0], a[5]):
            assert torch.equal(c, m.bfloat16())
        before = [c.clone() for c in a[5]]
        adamw_multi_tensor_(*a[:5], hp, torch.tensor(False), scale, a[5])
        assert all(torch.equal(c, d) for c, d in zip(a[5], before))
        with pytest.raises(KernelUnsupportedError, match="copies must be all bf16 or all fp16"):
            adamw_multi_tensor_(*a[:5], hp, torch.tensor(True), scale, [c.float() for c in a[5]])
        with pytest.raises(KernelUnsupportedError, match="gradients must be float32 or"):
            mixed = [g.half() for g in a[1]]
            adamw_multi_tensor_(a[0], mixed, *a[2:5], hp, torch.tensor(True), scale, a[5])

    def test_adamw_fused_optimizer_matches_torch_interpreted() -> None:
        # AdamW(fused=True): step() and step_if() (skips with NaN gradients, a clip factor, an
        # lr change) against torch.optim.AdamW over 60 steps with two parameter groups.
        from lmforge.train import AdamW
        from lmforge.train.optim import grad_norm_and_clip_coef

        gen = torch.Generator().manual_seed(3)
        shapes = [(40, 130), (130,), (4100,), (3, 5)]
        ours_p = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]

        def groups(ps):
            return [
                {"params": ps[::2], "weight_decay": 0.1},
                {"params": ps[1::2], "weight_decay": 0.0},
            ]

        kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        ours = AdamW(groups(ours_p), fused=True, **kw)
        ref = torch.optim.AdamW(groups(ref_p), foreach=False, **kw)
        for step in range(60):
            g = torch.Generator().manual_seed(900 + step)
            grads = [torch.randn(p.shape, generator=g) * 3 for p in ours_p]
            skip = step % 17 == 4
            for p, q, gr in zip(ours_p, ref_p, grads):
                p.grad = torch.full_like(gr, float("nan")) if skip else gr.clone()
                q.grad = gr.clone()
            if step == 30:
                for opt in (ours, ref):
                    for group in opt.param_groups:
                        group["lr"] = 1e-3
            if skip:
                ours.step_if(torch.tensor(False))
                continue
            if step % 2:
                ours.step()
            else:
                _, coef = grad_norm_and_clip_coef(ours_p, 1.0)
                ours.step_if(torch.tensor(True), grad_scale=coef)
                torch.nn.utils.clip_grad_norm_(ref_p, 1.0)
            ref.step()
        for p, q in zip(ours_p, ref_p):
            torch.testing.assert_close(p, q, atol=2e-6, rtol=0)
            assert float(ours.state[p]["step"]) == float(ref.state[q]["step"])

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_swiglu_and_rope_triton_interpreted(dtype) -> None:
        from lmforge.kernels import rope, rope_reference, swiglu, swiglu_reference

        gen = torch.Generator().manual_seed(4)
        a = (torch.randn(3, 5000, generator=gen) * 3).to(dtype)  # ragged against the 4096 block
        b = torch.randn(3, 5000, generator=gen).to(dtype)
        ins = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        ref_in = [a.double().requires_grad_(), b.double().requires_grad_()]
        y, ref = swiglu(*ins), swiglu_reference(*ref_in)
        _close(y, ref, dtype, "swiglu")
        got, g = _grads(y, ins)
        for name, x, w in zip(("da", "db"), got, torch.autograd.grad(ref, ref_in, g.double())):
            _close(x, w, dtype, name)
        # The packed gate on one [a | b] buffer: the same values and gradients, the gradient
        # written as one [da | db] buffer; F = 2500 is ragged against the 2048-column block.
        from lmforge.kernels import KernelUnsupportedError, swiglu_packed, swiglu_packed_reference

        ab = torch.cat([a[:, :2500], b[:, :2500]], -1)  # (3, 5000)
        abt, abr = ab.clone().requires_grad_(), ab.double().requires_grad_()
        y, ref = swiglu_packed(abt), swiglu_packed_reference(abr)
        assert y.shape == (3, 2500)
        _close(y, ref, dtype, "swiglu_packed")
        _close(y, swiglu(a[:, :2500], b[:, :2500]), dtype, "swiglu_packed vs swiglu")
        got, g = _grads(y, (abt,))
        _close(got[0], torch.autograd.grad(ref, (abr,), g.double())[0], dtype, "dab")
        with pytest.raises(KernelUnsupportedError, match="even"):
            swiglu_packed(ab[:, :4999])
        # A short F (an MoE expert's): several rows per program, 37 rows ragged against them.
        ab = (torch.randn(37, 96, generator=gen) * 2).to(dtype)
        abt, abr = ab.clone().requires_grad_(), ab.double().requires_grad_()
        y, ref = swiglu_packed(abt), swiglu_packed_reference(abr)
        _close(y, ref, dtype, "swiglu_packed, short rows")
        got, g = _grads(y, (abt,))
        _close(got[0], torch.autograd.grad(ref, (abr,), g.double())[0], dtype, "dab, short rows")
        # RoPE against the model's own rotary layer, forward and backward.
        from lmforge.model import RotaryEmbedding

        layer = RotaryEmbedding(10000.0, 32, 64)
        t = 37
        x = torch.randn(2, 3, t, 32, generator=gen).to(dtype)
        pos = torch.arange(t)
        cos, sin = layer.cos[:t], layer.sin[:t]
        xt, xr = x.clone().requires_grad_(), x.double().requires_grad_()
        y = rope(xt, cos, sin)
        ref = rope_reference(xr, cos, sin)
        _close(y, ref, dtype, "rope")
        _close(
            layer(x.float(), pos), ref, torch.float32 if dtype == torch.float32 else dtype, "layer"
        )
        got, g = _grads(y, (xt,))
        _close(got[0], torch.autograd.grad(ref, (xr,), g.double())[0], dtype, "rope dx")
        # A head dim that is not a power of two: padded pair lanes, masked on load and store.
        x = torch.randn(3, 5, 48, generator=gen).to(dtype)
        tab = RotaryEmbedding(10000.0, 48, 8)
        y = rope(x, tab.cos[:5], tab.sin[:5])
        _close(y, rope_reference(x.double(), tab.cos[:5], tab.sin[:5]), dtype, "rope e=48")
        # The (…, T, H, E) layout (seq_dim=-3), as the projections write q and k: the same
        # values as rotating the head-transposed view, forward and backward.
        x = torch.randn(2, t, 3, 32, generator=gen).to(dtype)
        xt, xr = x.clone().requires_grad_(), x.double().requires_grad_()
        y = rope(xt, cos, sin, seq_dim=-3)
        ref = rope_reference(xr, cos, sin, seq_dim=-3)
        _close(y, ref, dtype, "rope (T, H, E)")
        torch.testing.assert_close(
            y.transpose(1, 2), rope(x.transpose(1, 2).contiguous(), cos, sin)
        )
        got, g = _grads(y, (xt,))
        _close(got[0], torch.autograd.grad(ref, (xr,), g.double())[0], dtype, "rope (T, H, E) dx")
        # Another launch (more rows per program): the same values.
        from lmforge.kernels import _elementwise_triton as ew

        c32, s32 = cos.float(), sin.float()
        for inverse in (False, True):
            want = ew.rope(x, c32, s32, inverse, 3)
            got_s = ew.rope(x, c32, s32, inverse, 3, config=(8192, 8))
            torch.testing.assert_close(got_s, want, rtol=0, atol=0)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_rope_packed_interpreted(dtype) -> None:
        # q and k rotated out of one (B, T, (Hq + Hk)·E) buffer into separate (B, T, H, E)
        # buffers, against the float64 reference, forward and backward (the gradient written as
        # one packed buffer); E = 48 pads the pair lanes; a gradient through q alone; the same
        # values as the one-tensor kernel on each half.
        from lmforge.kernels import KernelUnsupportedError, rope, rope_packed, rope_packed_reference
        from lmforge.model import RotaryEmbedding

        gen = torch.Generator().manual_seed(14)
        for hq, hk, e, t in ((4, 2, 32, 37), (3, 3, 48, 5)):
            layer = RotaryEmbedding(10000.0, e, 64)
            cos, sin = layer.cos[:t], layer.sin[:t]
            qk = torch.randn(2, t, (hq + hk) * e, generator=gen).to(dtype)
            qkt, qkr = qk.clone().requires_grad_(), qk.double().requires_grad_()
            (q, k), (qr, kr) = (
                rope_packed(qkt, cos, sin, hq, hk),
                rope_packed_reference(qkr, cos, sin, hq, hk),
            )
            assert q.shape == (2, t, hq, e) and k.shape == (2, t, hk, e) and q.is_contiguous()
            _close(q, qr, dtype, "rope_packed q")
            _close(k, kr, dtype, "rope_packed k")
            split = qk.unflatten(-1, (hq + hk, e))
            torch.testing.assert_close(q, rope(split[:, :, :hq].contiguous(), cos, sin, seq_dim=-3))
            gq, gk = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
            got = torch.autograd.grad((q.float() * gq).sum() + (k.float() * gk).sum(), qkt)[0]
            want = torch.autograd.grad(
                (qr * gq.double()).sum() + (kr * gk.double()).sum(), qkr, retain_graph=True
            )[0]
            _close(got, want, dtype, "rope_packed dqk")
            q_only = torch.autograd.grad(
                (rope_packed(qkt, cos, sin, hq, hk)[0].float() * gq).sum(), qkt
            )[0]
            _close(q_only, torch.autograd.grad((qr * gq.double()).sum(), qkr)[0], dtype, "dq only")
        with pytest.raises(KernelUnsupportedError, match="even E"):
            rope_packed(torch.randn(2, 5, 33), cos[:5], sin[:5], 2, 1)
        with pytest.raises(KernelUnsupportedError, match="cos/sin must be"):
            rope_packed(torch.randn(2, 6, 6 * 48), cos[:5], sin[:5], 3, 3)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_rope_packed_launches_interpreted(dtype, monkeypatch) -> None:
        # The per-row launch (ROPE_PACKED_TOKENS = 0), the token-block default and an odd token
        # block / head group: bit-identical to each other and close to float64, forward (split)
        # and backward (join, by −θ). Ragged edges: tokens not a multiple of the block, E = 48
        # (padded pair lanes), 3 + 1 heads (a partial head group); 4 + 4 heads of E = 32 and
        # 2 + 2 of E = 16 also fill whole tiles (the unmasked path); (T,) leading dims alone.
        from lmforge.kernels import _elementwise_triton as ew
        from lmforge.kernels import rope_packed_reference
        from lmforge.model import RotaryEmbedding

        gen = torch.Generator().manual_seed(15)
        launches = {
            "per-row": (0, ew.ROPE_PACKED_HEADS, ew.ROPE_PACKED_WARPS),
            "default": (ew.ROPE_PACKED_TOKENS, ew.ROPE_PACKED_HEADS, ew.ROPE_PACKED_WARPS),
            "odd": (4, 2, 2),
        }
        for lead, hq, hk, e in (((2, 37), 3, 1, 48), ((2, 20), 4, 4, 32), ((21,), 2, 2, 16)):
            t = lead[-1]
            layer = RotaryEmbedding(10000.0, e, 64)
            cos, sin = layer.cos[:t].float(), layer.sin[:t].float()
            qk = torch.randn(*lead, (hq + hk) * e, generator=gen).to(dtype)
            q_in = torch.randn(*lead, hq, e, generator=gen).to(dtype)
            k_in = torch.randn(*lead, hk, e, generator=gen).to(dtype)
            qr, kr = rope_packed_reference(qk.double(), cos, sin, hq, hk)
            back = torch.cat([q_in, k_in], -2).flatten(-2).double()
            dr = torch.cat(
                [x.flatten(-2) for x in rope_packed_reference(back, cos, -sin, hq, hk)], -1
            )
            outs = {}
            for name, (tokens, heads, warps) in launches.items():
                monkeypatch.setattr(ew, "ROPE_PACKED_TOKENS", tokens)
                monkeypatch.setattr(ew, "ROPE_PACKED_HEADS", heads)
                monkeypatch.setattr(ew, "ROPE_PACKED_WARPS", warps)
                q, k = ew.rope_packed(qk, None, None, cos, sin, hq, hk, False)
                d = ew.rope_packed(None, q_in, k_in, cos, sin, hq, hk, True)
                assert q.shape == (*lead, hq, e) and k.shape == (*lead, hk, e)
                assert d.shape == qk.shape and q.dtype == k.dtype == d.dtype == dtype
                what = f"{name} {lead} {hq}+{hk}×{e}"
                _close(q, qr, dtype, f"{what} q")
                _close(k, kr, dtype, f"{what} k")
                _close(d, dr, dtype, f"{what} join")
                outs[name] = (q, k, d)
            for name, got in outs.items():
                for a, b in zip(got, outs["per-row"]):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} vs per-row")

    @pytest.mark.parametrize("rope_backend", ["triton", "packed"])
    def test_model_with_lmforge_kernels_matches_reference_backends(rope_backend) -> None:
        # The model's flash / triton norm / triton RoPE / packed Triton SwiGLU backends and the
        # trainer's fused loss against sdpa + reference norm, RoPE and gate + full-logit
        # cross-entropy, forward and every parameter gradient.
        import dataclasses

        import torch.nn.functional as F

        from lmforge.model import TransformerLM, load_preset

        cfg = load_preset("tiny")  # GQA: 4 query heads over 2 key/value heads, head dim 16
        torch.manual_seed(0)
        ref = TransformerLM(dataclasses.replace(cfg, attention="sdpa", norm="reference"))
        fast = TransformerLM(
            dataclasses.replace(
                cfg, attention="flash", norm="triton", rope=rope_backend, swiglu="triton"
            )
        )
        fast.load_state_dict(ref.state_dict())
        x = torch.randint(0, cfg.vocab_size, (2, 21))  # 21: ragged against the 32×16 tiles
        y = torch.randint(0, cfg.vocab_size, (2, 21))
        loss_ref = F.cross_entropy(ref(x).reshape(-1, cfg.vocab_size), y.reshape(-1))
        loss_ref.backward()
        h = fast.forward_hidden(x)  # (B, T, D)
        loss = fused_linear_cross_entropy(h.reshape(-1, h.shape[-1]), fast.lm_head.weight,
                                          y.reshape(-1))  # fmt: skip
        loss.backward()
        assert abs(loss.item() - loss_ref.item()) < 1e-5
        ref_params = dict(ref.named_parameters())
        for name, p in fast.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, atol=1e-5, rtol=1e-4)
        # Explicit positions fall back to the reference rotation: the same logits as 0..T-1.
        pos = torch.arange(21)
        with torch.no_grad():
            torch.testing.assert_close(fast(x, pos), fast(x), atol=1e-5, rtol=1e-4)
