"""The Triton kernels as torch custom ops: torch.compile traces them without graph breaks.

Runs the kernels through Triton's CPU interpreter, so, as in ``test_kernels_interp.py``, the
default-tier test re-runs this file in a subprocess with ``TRITON_INTERPRET=1`` set before Triton
is imported. Inside the child: ``torch.library.opcheck`` on every op (schema, fake tensors,
autograd registration, AOT dispatch with dynamic shapes), each public op compiled with
``fullgraph=True`` against eager (forward and gradients), the tiny model (flash attention, Triton
RMSNorm) plus the fused loss compiled as one graph with zero graph breaks, and the trainer's
compiled fused-loss path. The compiled checks use the ``aot_eager`` backend (Dynamo + fake
tensors + AOTAutograd, which is where graph breaks and fake/real mismatches show) so the file
stays fast; the Inductor variant is in the ``slow`` tier.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _interp import SRC, run_pytest_in_interpreter

_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _run_child(marker: str, select: str = "") -> None:
    args = ["-m", marker] + (["-k", select] if select else [])
    run_pytest_in_interpreter(__file__, *args, timeout=900)


# The child's tests in groups of roughly equal time, so no single default-tier test runs long.
_GROUPS = {
    "models": "tiny_model",
    "trainer and opcheck": "trainer or explain or opcheck",
    "public ops": "not tiny_model and not trainer and not explain and not opcheck",
}


def test_importing_kernels_registers_ops_without_importing_triton() -> None:
    code = (
        "import sys, torch, lmforge.kernels\n"
        "assert 'triton' not in sys.modules, 'lmforge.kernels imported triton'\n"
        "for name in ('flash_attn_fwd', 'flash_attn_bwd', 'rms_norm_fwd', 'rms_norm_bwd',\n"
        "             'swiglu_fwd', 'swiglu_bwd', 'rope', 'rope_packed_split', 'rope_packed_join',\n"
        "             'linear_ce_fwd', 'linear_ce_bwd'):\n"
        "    assert hasattr(torch.ops.lmforge, name), name\n"
        "print('ok')\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


if not _CHILD:

    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    @pytest.mark.parametrize("group", list(_GROUPS))
    def test_compiled_kernels_in_interpreter_subprocess(group: str) -> None:
        _run_child("not slow", _GROUPS[group])

    @pytest.mark.slow
    @pytest.mark.skipif(not _HAS_TRITON, reason="triton is not installed")
    def test_compiled_kernels_inductor_in_interpreter_subprocess() -> None:
        _run_child("slow")

else:
    import dataclasses

    from torch._dynamo.utils import counters

    from lmforge.kernels import (
        flash_attention,
        fused_linear_cross_entropy,
        rms_norm,
        rope,
        rope_packed,
        swiglu,
        swiglu_packed,
    )
    from lmforge.model import TransformerLM, load_preset

    ops = torch.ops.lmforge

    def _randn(*shape: int, seed: int = 0, grad: bool = False) -> torch.Tensor:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        return x.requires_grad_(grad)

    def _targets(n: int, v: int) -> torch.Tensor:
        t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(9))
        t[::4] = -100  # some ignored rows
        return t

    def _opcheck_cases() -> list[tuple[str, tuple]]:
        # Forward ops get inputs that require grad (opcheck then also checks their autograd);
        # backward ops, which have no autograd of their own, get plain tensors.
        q = _randn(1, 2, 20, 16, seed=1, grad=True)  # (B, H, T, E)
        k, v = _randn(1, 1, 20, 16, seed=2, grad=True), _randn(1, 1, 20, 16, seed=3, grad=True)
        qkv = (q.detach(), k.detach(), v.detach())
        out, lse = ops.flash_attn_fwd(*qkv, True)
        x, w = _randn(10, 24, seed=4, grad=True), _randn(24, seed=5, grad=True)
        rstd = ops.rms_norm_fwd(x.detach(), w.detach(), 1e-5, None)[1]
        a, b = _randn(3, 40, seed=6, grad=True), _randn(3, 40, seed=7, grad=True)
        cos, sin = _randn(7, 8, seed=8), _randn(7, 8, seed=9)
        h, wv = _randn(12, 16, seed=10, grad=True), _randn(50, 16, seed=11, grad=True)
        t, ce = _targets(12, 50), (-100, 1e-3)  # ignore_index, z_loss
        ce_bwd = (h.detach(), wv.detach(), t, _randn(12), *ce, 8, True, True, True)
        return [
            ("flash_attn_fwd causal", (ops.flash_attn_fwd, (q, k, v, True))),
            ("flash_attn_fwd full", (ops.flash_attn_fwd, (q, k, v, False))),
            ("flash_attn_fwd window", (ops.flash_attn_fwd, (q, k, v, True, 6))),
            ("flash_attn_bwd", (ops.flash_attn_bwd, (*qkv, out, lse, _randn(*out.shape), True))),
            (
                "flash_attn_bwd window",
                (ops.flash_attn_bwd, (*qkv, out, lse, _randn(*out.shape), True, 6)),
            ),
            ("rms_norm_fwd", (ops.rms_norm_fwd, (x, w, 1e-5, None))),
            ("rms_norm_fwd bf16 out", (ops.rms_norm_fwd, (x, w, 1e-5, torch.bfloat16))),
            ("rms_norm_bwd", (ops.rms_norm_bwd, (x.detach(), w.detach(), rstd, _randn(10, 24)))),
            ("swiglu_fwd", (ops.swiglu_fwd, (a, b))),
            ("swiglu_bwd", (ops.swiglu_bwd, (a.detach(), b.detach(), _randn(3, 40)))),
            ("swiglu_packed_fwd", (ops.swiglu_packed_fwd, (_randn(3, 80, seed=14, grad=True),))),
            ("swiglu_packed_bwd", (ops.swiglu_packed_bwd, (_randn(3, 80), _randn(3, 40)))),
            ("rope", (ops.rope, (_randn(2, 7, 16, seed=12, grad=True), cos, sin, False, 1))),
            (
                "rope heads",
                (ops.rope, (_randn(2, 7, 3, 16, seed=13, grad=True), cos, sin, False, 3)),
            ),
            (
                "rope_packed_split",
                (
                    ops.rope_packed_split,
                    (_randn(2, 7, 48, seed=15, grad=True), cos, sin, 2, 1, False),
                ),
            ),
            (
                "rope_packed_join",
                (
                    ops.rope_packed_join,
                    (
                        _randn(2, 7, 2, 16, seed=16, grad=True),
                        _randn(2, 7, 1, 16, seed=17, grad=True),
                        cos,
                        sin,
                        2,
                        1,
                        True,
                    ),
                ),
            ),
            ("ce mean", (ops.linear_ce_fwd, (h, wv, t, *ce, "mean", 8, True, True, True, True))),
            (
                "ce sum dh only",
                (ops.linear_ce_fwd, (h, wv, t, *ce, "sum", 0, True, True, False, True)),
            ),
            ("ce none", (ops.linear_ce_fwd, (h, wv, t, *ce, "none", 8, True, False, False, True))),
            (
                "ce torch chunks",
                (ops.linear_ce_fwd, (h, wv, t, *ce, "mean", 8, False, True, True, True)),
            ),
            (
                "ce mean unchecked",
                (ops.linear_ce_fwd, (h, wv, t, *ce, "mean", 8, True, True, True, False)),
            ),
            ("ce bwd", (ops.linear_ce_bwd, ce_bwd)),
        ]

    _CASES = _opcheck_cases()

    @pytest.mark.parametrize("case", range(len(_CASES)), ids=[name for name, _ in _CASES])
    def test_opcheck(case: int) -> None:
        op, args = _CASES[case][1]
        torch.library.opcheck(op, args)

    def _public_cases():
        cos, sin = _randn(7, 8, seed=20), _randn(7, 8, seed=21)
        t = _targets(12, 50)

        def ce(reduction: str, backend: str = "auto"):
            def fn(h, w):
                return fused_linear_cross_entropy(
                    h, w, t, z_loss=1e-3, reduction=reduction, backend=backend, chunk_rows=8
                )

            return fn, ((12, 16), (50, 16))

        return {
            # (B, H, T, E) from a (B, T, H, E) transpose, as the model passes it: strided q/k/v.
            "flash": (
                lambda q, k, v: flash_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
                ),
                ((1, 21, 4, 16), (1, 21, 2, 16), (1, 21, 2, 16)),
            ),
            "flash 3-D": (lambda q, k, v: flash_attention(q, k, v, False), ((2, 9, 16),) * 3),
            "rms_norm": (lambda x, w: rms_norm(x, w, 1e-5), ((2, 5, 24), (24,))),
            "swiglu": (swiglu, ((3, 40), (3, 40))),
            "swiglu_packed": (swiglu_packed, ((3, 80),)),
            "rope": (lambda x: rope(x, cos, sin), ((2, 7, 16),)),
            "rope (T, H, E)": (lambda x: rope(x, cos, sin, seq_dim=-3), ((2, 7, 3, 16),)),
            # q and k out of one packed buffer, joined again so the check sees one tensor.
            "rope_packed": (
                lambda qk: torch.cat([t.flatten(-2) for t in rope_packed(qk, cos, sin, 2, 1)], -1),
                ((2, 7, 48),),
            ),
            "ce mean": ce("mean"),
            "ce sum": ce("sum"),
            "ce none": ce("none"),
            "ce torch": ce("mean", "torch"),
        }

    _PUBLIC = _public_cases()

    @pytest.mark.parametrize("name", list(_PUBLIC))
    def test_public_op_compiles_fullgraph_and_matches_eager(name: str) -> None:
        fn, shapes = _PUBLIC[name]
        inputs = [_randn(*s, seed=30 + i) for i, s in enumerate(shapes)]
        eager_in = [x.clone().requires_grad_() for x in inputs]
        comp_in = [x.clone().requires_grad_() for x in inputs]
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        want, got = fn(*eager_in), compiled(*comp_in)
        assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        g = _randn(*want.shape, seed=40)
        for a, b in zip(
            torch.autograd.grad(got, comp_in, g), torch.autograd.grad(want, eager_in, g)
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    def _model_and_loss(autocast: bool = False):
        cfg = dataclasses.replace(
            load_preset("tiny"), attention="flash", norm="triton", swiglu="triton", rope="packed"
        )
        torch.manual_seed(0)
        eager = TransformerLM(cfg)
        comp = TransformerLM(cfg)
        comp.load_state_dict(eager.state_dict())
        gen = torch.Generator().manual_seed(1)
        x = torch.randint(0, cfg.vocab_size, (2, 21), generator=gen)  # 21: ragged tiles
        y = torch.randint(0, cfg.vocab_size, (2, 21), generator=gen)

        def loss_fn(model, x, y):
            # As the trainer on a GPU: bf16 autocast, whose casts happen outside the ops.
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                h = model.forward_hidden(x)  # (B, T, D)
                w = model.lm_head.weight
                return fused_linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, y.reshape(-1))

        return eager, comp, x, y, loss_fn

    def _check_model(backend: str, exact: bool, autocast: bool = False) -> None:
        eager, comp, x, y, loss_fn = _model_and_loss(autocast)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(loss_fn, backend=backend, fullgraph=True)
        want, got = loss_fn(eager, x, y), compiled(comp, x, y)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1
        want.backward()
        got.backward()
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, want, **tol)
        ref = dict(eager.named_parameters())
        for name, p in comp.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad, **tol, msg=name)

    def test_tiny_model_with_fused_loss_is_one_graph_equal_to_eager() -> None:
        _check_model("aot_eager", exact=True)

    def test_tiny_model_under_bf16_autocast_is_one_graph_equal_to_eager() -> None:
        _check_model("aot_eager", exact=True, autocast=True)

    def test_explain_reports_no_graph_breaks() -> None:
        eager, _, x, y, loss_fn = _model_and_loss()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(loss_fn)(eager, x, y)
        assert explained.graph_break_count == 0 and explained.graph_count == 1

    def test_trainer_compiles_hidden_states_and_fused_loss_as_one_graph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import functools

        import numpy as np

        from lmforge.config import RunConfig
        from lmforge.train import DataConfig, TrainConfig, Trainer
        from lmforge.train.data import write_shard

        shard = write_shard(tmp_path / "t.bin", np.arange(4000) % 97, 512)
        model = dataclasses.replace(load_preset("tiny"), attention="flash", norm="triton")

        def trainer(out: str, compile: bool) -> Trainer:
            tc = TrainConfig(
                out_dir=str(tmp_path / out), device="cpu", precision="fp32", batch_size=2,
                context_length=16, loss="fused", z_loss=1e-3, compile=compile,
            )  # fmt: skip
            return Trainer(RunConfig(model=model, train=tc, data=DataConfig(train=(str(shard),))))

        ref = trainer("eager", False)
        # Inductor's C++ build would dominate the runtime; the graph capture is what is tested.
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
        comp = trainer("compiled", True)
        torch._dynamo.reset()
        counters.clear()
        for _ in range(2):
            (la, na, _), (lb, nb, _) = ref.train_step(), comp.train_step()
            assert la == pytest.approx(lb, rel=1e-6) and na == pytest.approx(nb, rel=1e-6)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] == 1

    def test_autograd_function_classes_match_the_public_ops() -> None:
        # The .apply entry points run the same ops under their own autograd.Function.
        from lmforge.kernels import FlashAttentionTriton

        pairs = [
            (lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True), flash_attention,
             ((2, 9, 16),) * 3),
        ]  # fmt: skip
        for via_class, public, shapes in pairs:
            inputs = [_randn(*s, seed=60 + i, grad=True) for i, s in enumerate(shapes)]
            a, b = via_class(*inputs), public(*inputs)
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            g = _randn(*a.shape, seed=70)
            for x, y in zip(torch.autograd.grad(a, inputs, g), torch.autograd.grad(b, inputs, g)):
                torch.testing.assert_close(x, y, rtol=0, atol=0)

    def test_reloading_a_kernel_module_keeps_its_ops() -> None:
        import importlib

        # The module (the package's attribute of that name is the function it exports).
        rms_norm_module = importlib.import_module("lmforge.kernels.rms_norm")
        importlib.reload(rms_norm_module)
        x = _randn(4, 24, grad=True)
        y = rms_norm(x, torch.ones(24), 1e-5)
        (dx,) = torch.autograd.grad(y.sum(), x)
        assert dx.shape == x.shape and rms_norm_module.rms_norm_fwd is ops.rms_norm_fwd.default

    @pytest.mark.slow
    def test_tiny_model_inductor_matches_eager() -> None:
        # Inductor (C++ on CPU) also reorders and re-lays out buffers around the ops.
        _check_model("inductor", exact=False)
