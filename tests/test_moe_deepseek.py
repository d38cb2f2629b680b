"""DeepSeek-V3's MoE options in lmforge's one MoE layer: group-limited routing against its
per-token definition, the routed scale, the first dense layers, both expert backends equal
(forward and backward), generation with a KV cache, config errors in one line, checkpoints
keeping the fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.model import moe as M
from lmforge.model.moe_config import MoEConfig
from lmforge.utils.config import ConfigError, load_config

DEEPSEEK = dict(n_experts=8, top_k=2, expert_d_ff=16, score="sigmoid", n_groups=4, top_groups=2,
                routed_scale=2.5, n_shared_experts=1, first_dense_layers=1)  # fmt: skip


def _cfg(**moe) -> ModelConfig:
    return ModelConfig(
        vocab_size=97,
        context_length=32,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        moe=MoEConfig(**{**DEEPSEEK, **moe}),
    )


def _layer(cfg: ModelConfig, backend: str = "reference") -> M.MoEFFN:
    torch.manual_seed(0)
    layer = M.MoEFFN(cfg).double()
    with torch.no_grad():  # a router with spread and a non-zero selection bias: no near-ties
        layer.router.weight.normal_(0, 0.5)
        layer.expert_bias.copy_(torch.randn(cfg.moe.n_experts) * 0.2)
    layer.backend = backend
    return layer


def _route_by_definition(scores, bias, mc: MoEConfig):  # type: ignore[no-untyped-def]
    """Per token, in plain Python: groups ranked by the sum of their two best biased scores,
    the top_k biased scores among the best top_groups groups' experts, gate weights the
    unbiased scores (normalised) times routed_scale."""
    per = mc.n_experts // mc.n_groups
    out = []
    for s in scores.tolist():
        sel = [v + b for v, b in zip(s, bias.tolist())]
        groups = [sorted(sel[g * per : (g + 1) * per])[-2:] for g in range(mc.n_groups)]
        best = sorted(range(mc.n_groups), key=lambda g: -sum(groups[g]))[: mc.top_groups]
        allowed = [e for e in range(mc.n_experts) if e // per in best]
        chosen = sorted(allowed, key=lambda e: -sel[e])[: mc.top_k]
        w = [s[e] for e in chosen]
        if mc.norm_top_k:
            w = [v / sum(w) for v in w]
        out.append({e: v * mc.routed_scale for e, v in zip(chosen, w)})
    return out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("groups", [(4, 2), (4, 1), (2, 1), (1, 1)])
def test_group_limited_routing_matches_its_definition(groups, norm) -> None:
    cfg = _cfg(n_groups=groups[0], top_groups=groups[1], norm_top_k=norm)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 8, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(8, generator=g, dtype=torch.float64) * 0.3
    r, scores = M.route(logits, cfg, bias)
    want = _route_by_definition(scores, bias, cfg.moe)
    got = [{} for _ in want]
    for t, e, w in zip(r.token_idx.tolist(), r.expert_idx.tolist(), r.weight.tolist()):
        got[t][e] = w
    for t, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys(), f"token {t}"
        assert [a[e] for e in b] == pytest.approx(list(b.values()), rel=1e-12)
    if groups[1] == 1:  # one group per token: both experts from the same group
        experts = r.expert_idx.view(-1, 2) // (8 // groups[0])
        assert bool((experts[:, 0] == experts[:, 1]).all())


def test_groups_change_the_choice() -> None:
    """The group limit is not a no-op on these scores: some token's choice differs without it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g, dtype=torch.float64) * 2
    r4, _ = M.route(logits, _cfg(top_groups=1))
    r1, _ = M.route(logits, _cfg(n_groups=1, top_groups=1))
    assert not torch.equal(r4.expert_idx, r1.expert_idx)


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("routing", ["token_choice", "token_choice_capacity"])
def test_grouped_matches_reference_forward_backward(shared: int, routing: str) -> None:
    cfg = _cfg(n_shared_experts=shared, routing=routing, capacity_factor=0.8)
    ref, fast = _layer(cfg, "reference"), _layer(cfg, "grouped")
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yf = ref(xr), fast(xf)
    torch.testing.assert_close(yf, yr, rtol=1e-10, atol=1e-10)
    gout = torch.randn_like(yr)
    (yr * gout).sum().backward()
    (yf * gout).sum().backward()
    torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-10, atol=1e-10)
    for (name, pr), pf in zip(ref.named_parameters(), fast.parameters()):
        assert pr.grad is not None and pf.grad is not None, name
        torch.testing.assert_close(pf.grad, pr.grad, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("routing", ["token_choice", "expert_choice"])
@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_routed_scale_scales_the_routed_experts_only(backend: str, routing: str) -> None:
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    groups = {"n_groups": 1, "top_groups": 1} if routing == "expert_choice" else {}
    one = _layer(_cfg(routed_scale=1.0, routing=routing, **groups), backend)
    scaled = _layer(_cfg(routed_scale=2.5, routing=routing, **groups), backend)
    assert one.shared is not None
    with torch.no_grad():
        shared = one.shared(x)
        torch.testing.assert_close(scaled(x) - shared, 2.5 * (one(x) - shared))


def test_first_dense_layers_and_every_place_the_moe_layers() -> None:
    from lmforge.model.transformer import _FFN

    mc = MoEConfig(n_experts=4, first_dense_layers=2, every=2)
    assert [mc.is_moe_layer(i) for i in range(6)] == [False, False, False, True, False, True]
    model = TransformerLM(dataclasses.replace(_cfg(), mtp_depth=1))
    kinds = [type(b.ffn) for b in model.layers]
    assert kinds == [_FFN, M.MoEFFN, M.MoEFFN]
    assert isinstance(model.mtp.layers[0].block.ffn, M.MoEFFN)  # layer index 3: past the dense


def test_kv_cache_generation_matches_full_recompute() -> None:
    from lmforge.generate.engine import generate, greedy_generate_reference

    torch.manual_seed(0)
    model = TransformerLM(_cfg()).eval()
    for layer in M.moe_layers(model):
        layer.expert_bias.copy_(torch.randn(8) * 0.1)
    prompt = [5, 17, 3, 44, 2]
    want = greedy_generate_reference(model, prompt, 8)
    assert generate(model, [prompt, [9, 9]], 8, temperature=0.0)[0] == want


@pytest.mark.parametrize(
    "override, key",
    [
        ("--model.moe.first_dense_layers=-1", "first_dense_layers"),
        ("--model.moe.routed_scale=0", "routed_scale"),
        ("--model.moe.routed_scale=inf", "routed_scale"),
        ("--model.moe.n_groups=0", "n_groups"),
        ("--model.moe.n_groups=3", "n_groups"),  # 8 experts do not split into 3 groups
        ("--model.moe.n_groups=8", "n_groups"),  # groups of 1: nothing to rank by top-2
        ("--model.moe.top_groups=5", "top_groups"),
        ("--model.moe.top_groups=0", "top_groups"),
        ("--model.moe.routing=expert_choice", "n_groups"),
        ("--model.moe.first_dense_layers=12", "first_dense_layers"),  # all dense, no MTP
    ],
)
def test_bad_values_are_one_line_naming_the_key(tmp_path, override: str, key: str) -> None:
    from lmforge.config import RunConfig

    path = tmp_path / "m.toml"
    path.write_text(
        "[model]\nd_model = 32\nn_heads = 4\n[model.moe]\nn_experts = 8\ntop_k = 2\n"
        'score = "sigmoid"\nn_groups = 4\ntop_groups = 2\nrouted_scale = 2.5\n',
        encoding="utf-8",
    )
    rc = load_config(RunConfig, path, [])
    assert rc.model.moe.n_groups == 4 and rc.model.moe.routed_scale == 2.5
    with pytest.raises(ConfigError, match=key) as e:
        load_config(RunConfig, path, [override])
    assert "\n" not in str(e.value)


def test_top_k_beyond_the_groups_is_refused() -> None:
    with pytest.raises(ValueError, match=r"moe\.top_k \(5\) exceeds"):
        MoEConfig(n_experts=8, top_k=5, n_groups=4, top_groups=2)


def test_checkpoint_round_trip_keeps_the_fields_and_the_bias(tmp_path) -> None:
    from lmforge.config import RunConfig
    from lmforge.train import load_for_inference, save_checkpoint

    cfg = _cfg(bias_update_rate=1e-3)
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    for layer in M.moe_layers(model):
        layer.expert_bias.copy_(torch.randn(8) * 0.1)
    path = save_checkpoint(tmp_path / "ck", model, None, 3, config=RunConfig(model=cfg))
    loaded, _ = load_for_inference(path)
    assert loaded.config.moe == cfg.moe
    x = torch.randint(0, 97, (2, 12))
    torch.testing.assert_close(loaded(x), model(x))
    torch.testing.assert_close(loaded.layers[1].ffn.expert_bias, model.layers[1].ffn.expert_bias)


@pytest.mark.gpu
def test_cuda_bf16_grouped_matches_reference_without_host_sync() -> None:
    """On CUDA under bf16 autocast the group-limited routing adds no host sync to the training
    forward + backward (top-k and masks only), and the grouped GEMMs (torch._grouped_mm) match
    the reference loop on the same routing to bf16 rounding."""
    cfg = dataclasses.replace(_cfg(expert_d_ff=64, z_loss_coef=1e-3), d_model=128)
    layers = {}
    for backend in ("reference", "grouped"):
        layers[backend] = _layer(cfg, backend).float().cuda().train()
    x = torch.randn(2, 200, 128, device="cuda", requires_grad=True)

    def step(layer: M.MoEFFN) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
            loss = y.float().square().mean() + layer.aux_loss()
        loss.backward()
        return y.float().detach()

    ref = step(layers["reference"])
    step(layers["grouped"])  # warm-up: Triton compilation, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step(layers["grouped"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=3e-2)
