"""AdamW and clip_grad_norm against their torch counterparts."""

from __future__ import annotations

import pytest
import torch

from lmforge.train import AdamW, clip_grad_norm
from lmforge.train.optim import grad_norm_and_clip_coef


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (3, 4, 5), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _clone(ps: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]


@pytest.mark.parametrize("foreach", [True, False])
def test_adamw_matches_torch_over_1000_steps(foreach: bool) -> None:
    ours_p = _params(0)
    ref_p = _clone(ours_p)

    def groups(ps: list[torch.nn.Parameter]) -> list[dict]:
        # Two groups with different decay, as the trainer builds them.
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]

    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    ours = AdamW(groups(ours_p), weight_decay=0.1, foreach=foreach, **kw)
    ref = torch.optim.AdamW(groups(ref_p), weight_decay=0.1, foreach=False, **kw)
    for step in range(1000):
        g = torch.Generator().manual_seed(1000 + step)
        grads = [torch.randn(p.shape, generator=g) for p in ours_p]
        for p, q, gr in zip(ours_p, ref_p, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        if step == 500:  # schedules change lr between steps
            for opt in (ours, ref):
                for group in opt.param_groups:
                    group["lr"] = 1e-3
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(
            ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], atol=1e-6, rtol=0
        )


def test_adamw_skips_params_without_grad_and_state_dict_roundtrip() -> None:
    ps = _params(1)
    opt = AdamW(ps, lr=1e-2)
    ps[0].grad = torch.ones_like(ps[0])
    before = ps[1].detach().clone()
    opt.step()
    assert torch.equal(ps[1], before)
    assert ps[1] not in opt.state
    opt2 = AdamW(_clone(ps), lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    assert float(opt2.state_dict()["state"][0]["step"]) == 1.0


def test_adamw_rejects_bad_hyperparameters() -> None:
    with pytest.raises(ValueError):
        AdamW(_params(0), lr=-1.0)
    with pytest.raises(ValueError):
        AdamW(_params(0), betas=(1.0, 0.9))


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("foreach", [True, False])
def test_clip_grad_norm_matches_torch(max_norm: float, foreach: bool) -> None:
    ours_p, ref_p = _params(2), _params(2)
    g = torch.Generator().manual_seed(3)
    for p, q in zip(ours_p, ref_p):
        gr = 3 * torch.randn(p.shape, generator=g)
        p.grad, q.grad = gr.clone(), gr.clone()
    ours_p[-1].grad = ref_p[-1].grad = None  # a parameter without gradient is skipped
    n_ours = clip_grad_norm(ours_p, max_norm, foreach=foreach)
    n_ref = torch.nn.utils.clip_grad_norm_(ref_p, max_norm)
    torch.testing.assert_close(n_ours, n_ref)
    for p, q in zip(ours_p[:-1], ref_p[:-1]):
        torch.testing.assert_close(p.grad, q.grad)


def test_clip_grad_norm_no_grads_and_nan() -> None:
    assert float(clip_grad_norm(_params(0), 1.0)) == 0.0
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert torch.isnan(clip_grad_norm([p], 1.0))


def test_adamw_compiled_path_matches_torch() -> None:
    """The torch.compile'd update (the GPU training path) equals torch's AdamW within 1e-6."""
    ours_p = _params(3)
    ref_p = _clone(ours_p)
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = AdamW(ours_p, compiled=True, **kw)
    ref = torch.optim.AdamW(ref_p, foreach=False, **kw)
    for step in range(300):
        g = torch.Generator().manual_seed(5000 + step)
        for p, q in zip(ours_p, ref_p):
            gr = torch.randn(p.shape, generator=g)
            p.grad, q.grad = gr.clone(), gr.clone()
        if step == 150:  # a schedule change must not recompile or diverge
            for opt in (ours, ref):
                opt.param_groups[0]["lr"] = 1e-3
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_adamw_step_if_matches_torch_and_skips_exactly(compiled: bool) -> None:
    # The device-gated update: with ok=True it is torch's AdamW (1000 steps, lr change midway);
    # with ok=False (here with NaN gradients) parameters, moments and step counts stay as they
    # were, bit for bit, and the bias correction continues from the last applied step.
    ours_p = _params(2)
    ref_p = _clone(ours_p)
    groups = lambda ps: [
        {"params": ps[:2], "weight_decay": 0.1},
        {"params": ps[2:], "weight_decay": 0.0},
    ]
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    ours = AdamW(groups(ours_p), weight_decay=0.1, compiled=compiled, **kw)
    ref = torch.optim.AdamW(groups(ref_p), weight_decay=0.1, foreach=False, **kw)
    n = 120 if compiled else 1000
    for step in range(n):
        g = torch.Generator().manual_seed(2000 + step)
        grads = [torch.randn(p.shape, generator=g) for p in ours_p]
        skip = step % 37 == 5
        for p, q, gr in zip(ours_p, ref_p, grads):
            p.grad = torch.full_like(gr, float("nan")) if skip else gr.clone()
            q.grad = gr.clone()
        if step == n // 2:
            for opt in (ours, ref):
                for group in opt.param_groups:
                    group["lr"] = 1e-3
        if skip:
            before = [(p.detach().clone(), ours.state[p]["exp_avg"].clone()) for p in ours_p]
            ours.step_if(torch.tensor(False))
            for p, (b, m) in zip(ours_p, before):
                assert torch.equal(p, b) and torch.equal(ours.state[p]["exp_avg"], m)
            continue
        ours.step_if(torch.tensor(True))
        ref.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
        assert float(ours.state[p]["step"]) == float(ref.state[q]["step"])


@pytest.mark.parametrize("compiled", [False, True])
def test_step_if_with_grad_scale_equals_clip_then_step(compiled: bool) -> None:
    # Clipping folded into the update (the trainer's one-process path): the norm and factor
    # from grad_norm_and_clip_coef, the factor applied as the update reads each gradient, give
    # bit-identical results to clip_grad_norm scaling the gradients in place first.
    a_p = _params(3)
    b_p = _clone(a_p)
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, compiled=compiled)
    a, b = AdamW(a_p, **kw), AdamW(b_p, **kw)
    for step in range(12):
        g = torch.Generator().manual_seed(7000 + step)
        for p, q in zip(a_p, b_p):
            gr = 3.0 * torch.randn(p.shape, generator=g)
            p.grad, q.grad = gr.clone(), gr.clone()
        norm_a, coef = grad_norm_and_clip_coef(a_p, 1.0)
        assert 0 < float(coef) < 1  # the gradients really are clipped
        a.step_if(torch.tensor(True), grad_scale=coef)
        norm_b = clip_grad_norm(b_p, 1.0)
        b.step_if(torch.tensor(True))
        assert torch.equal(norm_a, norm_b)
    for p, q in zip(a_p, b_p):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])


def test_step_if_without_refresh_needs_loaded_hyperparameters() -> None:
    p = _params(1)
    opt = AdamW(p, lr=1e-2)
    for q in p:
        q.grad = torch.ones_like(q)
    with pytest.raises(RuntimeError, match="load_hyperparameters"):
        opt.step_if(torch.tensor(True), refresh=False)
    opt.load_hyperparameters()
    before = [q.detach().clone() for q in p]
    opt.param_groups[0]["lr"] = 0.0  # not loaded: the update still uses lr 1e-2
    opt.step_if(torch.tensor(True), refresh=False)
    assert all(not torch.equal(q, b) for q, b in zip(p, before))


def test_fused_adamw_off_cuda_says_what_it_needs() -> None:
    # The Triton update runs on CUDA (or under TRITON_INTERPRET=1, tested in
    # test_kernels_interp.py); elsewhere one clear error, and nothing is changed.
    import os

    from lmforge.kernels import KernelUnsupportedError

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel on CPU")
    p = _params(1)
    before = [q.detach().clone() for q in p]
    opt = AdamW(p, lr=1e-2, fused=True)
    for q in p:
        q.grad = torch.ones_like(q)
    with pytest.raises(KernelUnsupportedError, match=r"CUDA|triton"):
        opt.step()
    assert all(torch.equal(q, b) for q, b in zip(p, before))


@pytest.mark.parametrize("path", ["foreach", "single", "compiled", "step_if", "step_if_compiled"])
def test_master_weights_update_fp32_masters_and_round_their_copies(path: str) -> None:
    # AdamW(copies=...): the gradient comes from each bf16 copy, the fp32 master is updated
    # exactly as an fp32 parameter holding that (upcast) gradient would be, and the copy is
    # rewritten as the master rounded to bf16. Parameters without copies update as before,
    # and zero_grad clears the copies' gradients.
    masters = _params(4)
    ref_p = _clone(masters)
    copies = {m: torch.nn.Parameter(m.detach().bfloat16()) for m in masters[:3]}
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    flags = dict(
        foreach=dict(foreach=True),
        single=dict(foreach=False),
        compiled=dict(compiled=True),
        step_if=dict(),
        step_if_compiled=dict(compiled=True),
    )[path]
    ours = AdamW(masters, copies=copies, **kw, **flags)
    ref = AdamW(ref_p, **kw, **flags)
    for step in range(6):
        g = torch.Generator().manual_seed(800 + step)
        for m, q in zip(masters, ref_p):
            gr = torch.randn(m.shape, generator=g)
            if m in copies:
                copies[m].grad = gr.bfloat16()
                q.grad = gr.bfloat16().float()  # what autocast's cast backward would hand over
            else:
                m.grad, q.grad = gr.clone(), gr.clone()
        if path.startswith("step_if"):
            ours.step_if(torch.tensor(True))
            ref.step_if(torch.tensor(True))
        else:
            ours.step()
            ref.step()
        ours.zero_grad()
        assert all(c.grad is None for c in copies.values())
    for m, q in zip(masters, ref_p):
        assert torch.equal(m, q)
        assert torch.equal(ours.state[m]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
        if m in copies:
            assert copies[m].dtype == torch.bfloat16 and torch.equal(copies[m], m.bfloat16())
    assert "copies" not in str(ours.state_dict().keys())


def test_master_weight_copies_are_checked() -> None:
    ps = _params(5)
    with pytest.raises(ValueError, match="not among the parameters"):
        AdamW(ps[:1], copies={ps[1]: ps[1].detach().bfloat16()})
    with pytest.raises(ValueError, match="differ"):
        AdamW(ps, copies={ps[0]: torch.zeros(3, dtype=torch.bfloat16)})


def test_grad_norm_of_bf16_gradients_is_summed_in_fp32() -> None:
    # A bf16 model's gradients: the norm is accumulated and returned in float32 (a bf16 norm
    # would carry 3 significant digits into the clip factor).
    g = torch.Generator().manual_seed(9)
    ps = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in [(300, 7), (1000,)]]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
    want = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in ps]))
    for foreach in (True, False):
        norm, _ = grad_norm_and_clip_coef(ps, 1.0) if foreach else (None, None)
        if not foreach:
            norm = clip_grad_norm(ps, 1e9, foreach=False)
        assert norm.dtype == torch.float32
        assert abs(float(norm) - float(want)) / float(want) < 1e-6


_PATHS = {
    "foreach": dict(foreach=True),
    "compiled": dict(compiled=True),
    "step_if": dict(),
    "step_if_compiled": dict(compiled=True),
}


def _run_path(path: str, dtype: torch.dtype, steps: int) -> tuple[list, AdamW]:
    # One AdamW path over `steps` random steps: two groups, an lr change midway, and for the
    # gated paths a clip factor and skipped (NaN) steps. The reference (foreach=False) takes the
    # same route with ok / grad_scale applied by hand, so both see the same updates.
    ps = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params(6)]
    groups = [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]
    flags = _PATHS.get(path, dict(foreach=False))
    opt = AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **flags)
    gated = path.startswith("step_if")
    for step in range(steps):
        g = torch.Generator().manual_seed(4000 + step)
        grads = [torch.randn(p.shape, generator=g).to(dtype) for p in ps]
        skip = step % 11 == 3
        scale = torch.tensor(0.25 + (step % 5) / 8, dtype=torch.float32)
        if step == steps // 2:
            for group in opt.param_groups:
                group["lr"] = 1e-3
        if gated:
            for p, gr in zip(ps, grads):
                p.grad = torch.full_like(gr, float("nan")) if skip else gr
            opt.step_if(torch.tensor(not skip), grad_scale=scale)
        elif not skip:
            for p, gr in zip(ps, grads):
                p.grad = gr * scale.to(dtype)
            opt.step()
    return ps, opt


@pytest.mark.parametrize("path", list(_PATHS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_fast_path_matches_the_float64_reference(path: str, dtype: torch.dtype) -> None:
    # The one reference (AdamW(foreach=False) = kernels.adamw_reference_) in float64 against
    # each fast path: in float64 the math is the same up to rounding order (1e-12), in float32
    # the paths' error is float32 rounding only (the Triton path: tests/test_kernels_interp.py).
    steps = 40 if "compiled" in path else 200
    ref_p, ref = _run_path("reference", torch.float64, steps)
    ours_p, ours = _run_path(path, dtype, steps)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p.double(), q, atol=tol, rtol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                ours.state[p][key].double(), ref.state[q][key], atol=tol, rtol=tol
            )
        assert float(ours.state[p]["step"]) == float(ref.state[q]["step"])


def test_reference_matches_torch_adamw_in_float64() -> None:
    # The reference itself against the peer, in float64 (no rounding to hide a wrong formula).
    ours_p = [torch.nn.Parameter(p.detach().double()) for p in _params(7)]
    ref_p = _clone(ours_p)
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = AdamW(ours_p, foreach=False, **kw)
    ref = torch.optim.AdamW(ref_p, foreach=False, **kw)
    for step in range(300):
        g = torch.Generator().manual_seed(6000 + step)
        for p, q in zip(ours_p, ref_p):
            gr = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.grad, q.grad = gr.clone(), gr.clone()
        ours.step()
        ref.step()
    for p, q in zip(ours_p, ref_p):
        torch.testing.assert_close(p, q, atol=1e-13, rtol=0)
