"""Fused projections: one q/k/v GEMM and one w1/w3 GEMM against concatenated weights.

The fused path (``ModelConfig.fused_projections``, default off) must equal calling the modules one
by one (``fused_projections=False``, the reference), keep parameter names, fall back whenever
calling the modules would do something else (hooks, subclasses, mixed dtypes) and trace into
one graph under ``torch.compile``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.modules import module as torch_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lmforge.model import KVCache, Linear, ModelConfig, SwiGLU, TransformerLM
from lmforge.model.layers import _cat_weights, _fusable

TINY = ModelConfig(
    vocab_size=97, context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2
)
_GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}


def _pair(**overrides) -> tuple[TransformerLM, TransformerLM]:
    """(fused, unfused) models with identical weights."""
    models = []
    for fused in (True, False):
        torch.manual_seed(0)
        cfg = dataclasses.replace(TINY, fused_projections=fused, **overrides)
        models.append(TransformerLM(cfg))
    return models[0], models[1]


def _ids(b: int = 2, t: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (b, t), generator=g)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


class _CountGemms(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in _GEMMS
        return func(*args, **(kwargs or {}))


def _gemms(fn) -> int:
    with _CountGemms() as mode:
        fn()
    return mode.count


@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_equals_unfused_fp32_forward_and_backward(kv, qk_norm):
    fused, ref = _pair(n_kv_heads=kv, qk_norm=qk_norm)
    assert list(fused.state_dict()) == list(ref.state_dict())  # same names, same order
    ids = _ids()
    a, b = fused(ids), ref(ids)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    a.square().mean().backward()
    b.square().mean().backward()
    ga, gb = _grads(fused), _grads(ref)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fused_equals_unfused_bf16_autocast():
    fused, ref = _pair(qk_norm=True)
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = fused(ids), ref(ids)
    assert a.dtype == b.dtype == torch.bfloat16
    torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02)
    a.float().square().mean().backward()
    b.float().square().mean().backward()
    for name, g in _grads(fused).items():
        torch.testing.assert_close(g, _grads(ref)[name], rtol=0.05, atol=2e-3, msg=name)


def test_swiglu_fused_equals_reference_and_gets_named_gradients():
    torch.manual_seed(0)
    ffn = SwiGLU(48)
    assert ffn.fused
    x = torch.randn(2, 5, 48, requires_grad=True)
    y = ffn(x)
    (y * torch.linspace(-1, 1, 48)).sum().backward()
    got = {n: p.grad.clone() for n, p in ffn.named_parameters()} | {"x": x.grad.clone()}
    ffn.zero_grad()
    x.grad = None
    ffn.fused = False
    y_ref = ffn(x)
    (y_ref * torch.linspace(-1, 1, 48)).sum().backward()
    want = {n: p.grad for n, p in ffn.named_parameters()} | {"x": x.grad}
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    assert set(got) == {"w1.weight", "w2.weight", "w3.weight", "x"}
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fused_path_launches_fewer_gemms_with_the_same_flops():
    fused, ref = _pair()
    ids = _ids()
    n_fused = _gemms(lambda: fused(ids))
    n_ref = _gemms(lambda: ref(ids))
    # Per layer: qkv, output_proj, w1|w3, w2 (4) instead of q, k, v, output_proj, w1, w3, w2 (7).
    assert n_ref - n_fused == 3 * TINY.n_layers
    flops = []
    for model in (fused, ref):
        with FlopCounterMode(display=False) as counter:
            model(ids).sum().backward()
        flops.append(counter.get_total_flops())
    assert flops[0] == flops[1]


def test_kv_cache_decode_matches_unfused():
    fused, ref = _pair(qk_norm=True)
    ids = _ids(t=10)
    outs = []
    for model in (fused, ref):
        cache = KVCache.for_model(model, batch_size=2, max_seq_len=16)
        parts = [model(ids[:, :6], kv_cache=cache)]
        parts += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(6, 10)]
        outs.append(torch.cat(parts, dim=1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def _double_input(module, args):
    return (args[0] * 2,)


@pytest.mark.parametrize("where", ["attn.k_proj", "ffn.w3"])
def test_forward_pre_hook_forces_the_module_calls(where):
    """A hook (tensor parallelism's kind) must run: the fused path would silently skip it."""
    fused, ref = _pair()
    for model in (fused, ref):
        model.layers[0].get_submodule(where).register_forward_pre_hook(_double_input)
    ids = _ids()
    torch.testing.assert_close(fused(ids), ref(ids), rtol=1e-5, atol=1e-6)
    plain, _ = _pair()
    assert not torch.allclose(fused(ids), plain(ids))  # the hook changed the result


def test_forward_and_backward_hooks_disable_fusion():
    calls = []
    lin = Linear(4, 4)
    other = Linear(4, 4)
    assert _fusable(lin, other)
    handle = lin.register_forward_hook(lambda m, a, out: calls.append(1))
    assert not _fusable(lin, other)
    handle.remove()
    handle = other.register_full_backward_hook(lambda m, gi, go: None)
    assert not _fusable(lin, other)
    handle.remove()
    assert _fusable(lin, other)


def test_global_module_hook_is_honoured():
    fused, _ = _pair()
    seen: list[str] = []
    names = {m: n for n, m in fused.named_modules()}

    def hook(module, args, out):
        seen.append(names.get(module, "?"))

    handle = torch_module.register_module_forward_hook(hook)
    try:
        assert not _fusable(fused.layers[0].attn.q_proj, fused.layers[0].attn.k_proj)
        fused(_ids())
    finally:
        handle.remove()
    assert "layers.0.attn.k_proj" in seen and "layers.1.ffn.w3" in seen
    assert _fusable(fused.layers[0].attn.q_proj, fused.layers[0].attn.k_proj)


def test_subclass_forward_override_and_mixed_dtypes_disable_fusion():
    class Scaled(Linear):
        def forward(self, x):
            return 3 * super().forward(x)

    a, b = Linear(4, 4), Linear(4, 4)
    assert not _fusable(a, Scaled(4, 4))
    c = Linear(4, 4)
    c.forward = lambda x: x  # an instance-level override (as a wrapping library might do)
    assert not _fusable(a, c)
    b.to(torch.float64)
    assert not _fusable(a, b)

    fused, ref = _pair()
    for model in (fused, ref):
        scaled = Scaled(TINY.d_model, TINY.kv_heads * TINY.head_dim)
        scaled.weight = model.layers[1].attn.v_proj.weight
        model.layers[1].attn.v_proj = scaled
    ids = _ids()
    torch.testing.assert_close(fused(ids), ref(ids), rtol=1e-5, atol=1e-6)


def test_compiles_to_one_graph_and_matches_eager():
    fused, _ = _pair(qk_norm=True)
    ids = _ids()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fused)(ids)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(fused)(ids)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    # aot_eager traces forward and backward like inductor does, without compiling C++.
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    out = compiled(ids)
    out.square().mean().backward()
    got = {n: g.clone() for n, g in _grads(fused).items()}
    fused.zero_grad()
    eager = fused(ids)
    eager.square().mean().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    for name, g in _grads(fused).items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=name)
    torch._dynamo.reset()


def test_cat_weights_casts_like_autocast():
    a = torch.randn(6, 4, requires_grad=True)
    b = torch.randn(2, 4, requires_grad=True)
    plain = _cat_weights([a, b])
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, torch.cat([a, b]), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = _cat_weights([a, b])
    assert cast.dtype == torch.bfloat16
    torch.testing.assert_close(cast, torch.cat([a, b]).to(torch.bfloat16), rtol=0, atol=0)
    cast.float().sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


def test_flag_default_and_toggle():
    assert ModelConfig().fused_projections is False  # measured slower on an H200 (config doc)
    fused, _ = _pair()
    assert fused.layers[0].attn.fused_projections and fused.layers[0].ffn.fused
    ids = _ids()
    before = _gemms(lambda: fused(ids))
    for layer in fused.layers:
        layer.attn.fused_projections = False
        layer.ffn.fused = False
    assert _gemms(lambda: fused(ids)) == before + 3 * TINY.n_layers


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> int:
    """Bytes of distinct non-parameter storages autograd saves during one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(ids)
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "kw", [{"attention": "sdpa"}, {"attention": "sdpa", "qk_norm": True}, {"qk_norm": True}]
)
def test_activation_model_follows_the_flag(precision, kw):
    """The memory model tracks both paths (the fused q|k|v output stays alive whole)."""
    from lmforge.model import accounting

    b, t = 2, 16
    for model in _pair(**{"attention": "reference", **kw}):
        ids = _ids(b, t)
        measured = _saved_bytes(model, ids, precision == "bf16")
        estimate = accounting.activation_bytes(model.config, b, t, precision, include_loss=False)
        assert estimate == pytest.approx(measured, rel=0.01), model.config.fused_projections
