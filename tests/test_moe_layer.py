"""MoE layer: routing modes, balancing terms, reference vs grouped expert compute (fwd + bwd),
config wiring, checkpoints and KV-cache generation."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.model import ModelConfig, TransformerLM
from lmforge.model import moe as M
from lmforge.model.moe_config import MoEConfig
from lmforge.utils.config import ConfigError, load_config


def _cfg(**moe) -> ModelConfig:
    base = dict(n_experts=4, top_k=2, expert_d_ff=16)
    base.update(moe)
    return ModelConfig(
        vocab_size=97,
        context_length=32,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        moe=MoEConfig(**base),
    )


def _layer(cfg: ModelConfig, seed: int = 0, dtype=torch.float64) -> M.MoEFFN:
    torch.manual_seed(seed)
    layer = M.MoEFFN(cfg).to(dtype)
    with torch.no_grad():  # a router of realistic spread, so top-k choices are not near-ties
        layer.router.weight.normal_(0, 0.5)
    return layer


ROUTINGS = ["token_choice", "token_choice_capacity", "expert_choice"]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_grouped_matches_reference_forward_backward(routing: str, shared: int, score: str) -> None:
    cfg = _cfg(routing=routing, n_shared_experts=shared, score=score, capacity_factor=0.8)
    ref = _layer(cfg)
    fast = _layer(cfg)
    fast.backend = "grouped"
    ref.backend = "reference"
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yf = ref(xr), fast(xf)
    torch.testing.assert_close(yf, yr, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(yr)
    (yr * g).sum().backward()
    (yf * g).sum().backward()
    torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-10, atol=1e-10)
    for (name, pr), pf in zip(ref.named_parameters(), fast.parameters()):
        assert pr.grad is not None and pf.grad is not None, name
        torch.testing.assert_close(pf.grad, pr.grad, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_shared_gate_scales_the_shared_experts_per_token(backend: str) -> None:
    """moe.shared_gate (Qwen3-Next's shared_expert_gate): the output is the routed experts' plus
    σ(x W_g) · shared(x), W_g (1, D), per token; W_g gets a gradient."""
    gated = _layer(_cfg(n_shared_experts=2, shared_gate=True))
    plain = _layer(_cfg(n_shared_experts=2))
    state = gated.state_dict()
    plain.load_state_dict({k: v for k, v in state.items() if not k.startswith("shared_gate.")})
    assert tuple(gated.shared_gate.weight.shape) == (1, 32)
    gated.backend = plain.backend = backend
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        shared = plain.shared(x)
        gate = torch.sigmoid(x @ gated.shared_gate.weight.t())  # (3, 7, 1)
        want = plain(x) - shared + gate * shared
    y = gated(x)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    y.square().sum().backward()
    assert gated.shared_gate.weight.grad is not None
    assert gated.shared_gate.weight.grad.abs().sum() > 0


def test_reference_equals_per_token_float64_sum() -> None:
    # The reference against the definition, token by token: Σ_k w_k · SwiGLU_e_k(x).
    cfg = _cfg(n_experts=5, top_k=3)
    layer = _layer(cfg)
    x = torch.randn(6, 32, dtype=torch.float64)
    scores = (x @ layer.router.weight.t()).softmax(-1)
    want = torch.zeros_like(x)
    for i in range(6):
        top = scores[i].topk(3).indices
        w = scores[i, top] / scores[i, top].sum()
        for e, we in zip(top.tolist(), w):
            h = torch.nn.functional.silu(layer.w1[e] @ x[i]) * (layer.w3[e] @ x[i])
            want[i] += we * (layer.w2[e] @ h)
    torch.testing.assert_close(layer(x[None])[0], want.detach())


@pytest.mark.parametrize("transposed_w", [False, True])
def test_grouped_mm_function_matches_float64_loop(transposed_w: bool) -> None:
    # transposed_w: w a (N, O, K) weight seen as (N, K, O), as expert_rows passes it; the weight
    # gradient is then computed in that layout (gy.t() @ x per group, transposed).
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(9, 16, requires_grad=True)
    if transposed_w:
        w_leaf = torch.randn(4, 8, 16, requires_grad=True)
        w = w_leaf.transpose(1, 2)
    else:
        w_leaf = w = torch.randn(4, 16, 8, requires_grad=True)
    try:
        y = M._GroupedMM.apply(x, w, offs)
    except RuntimeError as e:  # some builds run _grouped_mm on CUDA only
        pytest.skip(f"torch._grouped_mm does not run on this CPU build: {e}")
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.cat([p @ w64[e] for e, p in enumerate(torch.split(x64, counts.tolist()))])
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(9, 8)
    y.backward(g)
    ref.backward(g.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    gw = w_leaf.grad.transpose(1, 2) if transposed_w else w_leaf.grad
    torch.testing.assert_close(gw.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_token_choice_is_top_k_and_dropless() -> None:
    cfg = _cfg(n_experts=6, top_k=2)
    scores = torch.rand(10, 6, dtype=torch.float64).softmax(-1)
    r, _ = M.route(scores.log(), cfg, torch.zeros(6))
    idx = r.expert_idx.view(10, 2)
    assert torch.equal(idx.sort(-1).values, scores.topk(2).indices.sort(-1).values)
    assert r.kept.all() and r.top_k == 2
    torch.testing.assert_close(r.weight.view(10, 2).sum(-1), torch.ones(10, dtype=torch.float64))
    assert r.load.sum() == 20


def test_capacity_drops_overflow_in_priority_order() -> None:
    cfg = _cfg(n_experts=4, top_k=1, routing="token_choice_capacity", capacity_factor=1.0)
    # Every token prefers expert 0; capacity = ceil(8 · 1 / 4) = 2: the two highest scores stay.
    logits = torch.full((8, 4), -5.0)
    logits[:, 0] = torch.linspace(0, 1, 8)
    r, _ = M.route(logits, cfg, torch.zeros(4))
    assert r.kept.sum() == 2
    assert r.kept.nonzero().squeeze(1).tolist() == [6, 7]
    assert (r.weight[~r.kept] == 0).all()


def test_capacity_never_exceeds_slots() -> None:
    torch.manual_seed(1)
    idx = torch.randint(0, 5, (40, 3))
    w = torch.rand(40, 3)
    keep = M.capacity_keep(idx, w, 9, 5)
    per_expert = torch.bincount(idx[keep], minlength=5)
    want = torch.minimum(torch.bincount(idx.reshape(-1), minlength=5), torch.tensor(9))
    assert torch.equal(per_expert, want)


def test_expert_choice_gives_each_expert_capacity_tokens() -> None:
    cfg = _cfg(n_experts=4, top_k=2, routing="expert_choice", capacity_factor=1.0)
    r, scores = M.route(torch.randn(12, 4), cfg)
    cap = M.expert_capacity(12, 2, 4, 1.0)
    assert cap == 6
    assert torch.equal(torch.bincount(r.expert_idx, minlength=4), torch.full((4,), cap))
    for e in range(4):
        mine = r.token_idx[r.expert_idx == e]
        assert set(mine.tolist()) == set(scores[:, e].topk(cap).indices.tolist())


def test_bias_selects_but_does_not_weigh() -> None:
    cfg = _cfg(n_experts=4, top_k=1, norm_top_k=False)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    r, scores = M.route(logits, cfg, bias)
    assert r.expert_idx.tolist() == [3]  # selected through the bias
    torch.testing.assert_close(r.weight, scores[0, 3:4])  # weighed by the unbiased score


def test_update_expert_bias_moves_toward_mean_load() -> None:
    cfg = _cfg(bias_update_rate=0.01)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    layer = next(M.moe_layers(model))
    layer.load_acc.copy_(torch.tensor([10.0, 2.0, 5.0, 3.0]))  # mean 5
    M.update_expert_bias(model)
    assert layer.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    assert layer.load_acc.sum() == 0


def test_bias_update_balances_a_skewed_router() -> None:
    # Aux-free balancing on its own: a router that sends every token to expert 0 gets balanced
    # by the selection bias alone (sigmoid scores, as DeepSeek-V3).
    cfg = _cfg(n_experts=4, top_k=1, score="sigmoid", bias_update_rate=0.01, aux_loss_coef=0.0)
    layer = _layer(cfg, dtype=torch.float32)
    torch.manual_seed(0)
    x = torch.randn(1, 256, 32)
    x[..., 0] = 3.0
    with torch.no_grad():
        layer.router.weight[0, 0] = 3.0  # expert 0's logit +9 for every token
    layer.train()
    layer(x)
    before = layer._stats[0].item()
    for _ in range(150):
        layer(x)
        M.update_expert_bias(layer)
    layer(x)
    after = layer._stats[0].item()
    assert before > 3.9  # max/mean load 4 = all tokens on one expert
    assert after < 1.3
    assert layer.expert_bias[0] < 0 < layer.expert_bias[1:].min()


def test_switch_aux_and_z_loss_values() -> None:
    n, m = 4, 8
    uniform = torch.full((m, n), 1.0 / n)
    balanced = torch.full((n,), m * 2 / n)
    assert M.switch_aux_loss(uniform, balanced, 2).item() == pytest.approx(1.0)
    skewed = torch.tensor([m * 2.0, 0, 0, 0])
    p = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).expand(m, n)
    assert M.switch_aux_loss(p, skewed, 2).item() == pytest.approx(4 * 0.7)
    logits = torch.randn(5, n, dtype=torch.float64)
    want = torch.log(logits.exp().sum(-1)).pow(2).mean()
    torch.testing.assert_close(M.router_z_loss(logits).double(), want)
    assert M.routing_entropy(uniform).item() == pytest.approx(math.log(n))


def test_aux_loss_only_in_training_and_has_router_gradient() -> None:
    cfg = _cfg(aux_loss_coef=0.1, z_loss_coef=1e-3)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    x = torch.randint(0, 97, (2, 16))
    model(x)
    aux = M.aux_loss(model)
    assert aux is not None and aux.item() > 0
    aux.backward()
    assert all(layer.router.weight.grad.abs().sum() > 0 for layer in M.moe_layers(model))
    model.eval()
    model(x)
    assert M.aux_loss(model) is None
    metrics = M.moe_metrics(model)
    assert set(metrics) >= {"moe/L0/load_max_mean", "moe/L1/dropped", "moe/L1/entropy"}


def test_every_k_th_layer_and_config_overrides(tmp_path) -> None:
    from lmforge.model.transformer import _FFN

    cfg = _cfg(every=2)
    model = TransformerLM(cfg)
    assert isinstance(model.layers[0].ffn, _FFN)
    assert isinstance(model.layers[1].ffn, M.MoEFFN)
    path = tmp_path / "m.toml"
    path.write_text("[model]\nd_model = 64\nn_heads = 4\n", encoding="utf-8")
    from lmforge.config import RunConfig

    rc = load_config(RunConfig, path, ["--model.moe.n_experts=8", "--model.moe.top_k=2"])
    assert rc.model.moe.n_experts == 8 and rc.model.moe.top_k == 2
    with pytest.raises(ConfigError, match=r"model\.moe\.nexperts"):
        load_config(RunConfig, path, ["--model.moe.nexperts=8"])
    with pytest.raises(ConfigError, match="top_k"):
        load_config(RunConfig, path, ["--model.moe.n_experts=2", "--model.moe.top_k=3"])


def test_checkpoint_round_trip_keeps_bias(tmp_path) -> None:
    from lmforge.config import RunConfig
    from lmforge.train import load_for_inference, save_checkpoint

    cfg = _cfg(bias_update_rate=0.01, n_shared_experts=1)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    for layer in M.moe_layers(model):
        layer.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    run = RunConfig(model=cfg)
    path = save_checkpoint(tmp_path / "ck", model, None, 3, config=run)
    loaded, _ = load_for_inference(path)
    x = torch.randint(0, 97, (2, 12))
    model.eval()
    torch.testing.assert_close(loaded(x), model(x))
    assert loaded.layers[0].ffn.expert_bias.tolist() == pytest.approx([0.1, -0.2, 0.3, 0.0])


def test_kv_cache_generation_matches_full_recompute() -> None:
    from lmforge.generate.engine import generate, greedy_generate_reference

    cfg = _cfg(n_shared_experts=1)
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    prompt = [5, 17, 3, 44, 2]
    want = greedy_generate_reference(model, prompt, 8)
    got = generate(model, [prompt, [9, 9]], 8, temperature=0.0)[0]
    assert got == want


def test_invalid_moe_config_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"moe\.routing"):
        MoEConfig(n_experts=4, routing="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"moe\.every"):
        MoEConfig(n_experts=4, every=0)
    with pytest.raises(ValueError, match=r"moe\.shared_gate needs shared experts"):
        MoEConfig(n_experts=4, shared_gate=True)


def _grouped_vs_float64(device: str, dtype: torch.dtype, routing: str, tokens: int) -> None:
    # The same routing decisions for both, fixed (no_grad: the two backward passes below must not
    # share the router's graph — the first would free what the second needs, which is the
    # RuntimeError the first H200 run of this test raised inside autograd's engine); the
    # ``dtype`` grouped path against float64 math.
    cfg = ModelConfig(
        d_model=128,
        n_heads=4,
        moe=MoEConfig(n_experts=8, top_k=2, expert_d_ff=64, routing=routing, capacity_factor=1.0),
    )
    layer = _layer(cfg).to(device)
    x = torch.randn(tokens, 128, device=device, dtype=torch.float64)
    with torch.no_grad():
        r, _ = M.route(x @ layer.router.weight.t(), cfg, layer.expert_bias)
    r = r._replace(weight=r.weight.float())
    w64 = [p.detach().clone().requires_grad_() for p in (layer.w1, layer.w2, layer.w3)]
    x64 = x.clone().requires_grad_()
    want = M.experts_reference(x64, *w64, r._replace(weight=r.weight.double()))
    wb = [p.detach().to(dtype).requires_grad_() for p in w64]
    xb = x.to(dtype).requires_grad_()
    if device == "cuda":
        assert M.grouped_mm_available(xb, wb[0].transpose(1, 2))
    got = M.experts_grouped(xb, *wb, r)
    scale = want.abs().max().item()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g.float())
    for a, b in zip([xb, *wb], [x64, *w64]):
        s = b.grad.abs().max().item()
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1.5 * tol, atol=1.5 * tol * s)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_grouped_fp32_cpu_matches_float64_reference(routing: str) -> None:
    # The GPU test's body on CPU (fp32, the per-segment loop and the torch gather/combine).
    torch.manual_seed(0)
    _grouped_vs_float64("cpu", torch.float32, routing, 333)


def test_grouped_mm_layout_rules() -> None:
    # torch._grouped_mm's operand rules (its meta function): 16-byte aligned data pointer,
    # row- or column-major last two dims, the other stride a multiple of 16 bytes.
    x = torch.randn(40, 24, dtype=torch.bfloat16)
    assert M.grouped_mm_layout_ok(x)
    assert M.grouped_mm_layout_ok(x.t())  # the weight gradient's x.t(): column-major
    assert not M.grouped_mm_layout_ok(x[:, 1:])  # stride 24 but the pointer is 2 bytes off
    assert not M.grouped_mm_layout_ok(torch.randn(40, 20, dtype=torch.bfloat16)[:, :12].t())
    assert M.grouped_mm_layout_ok(torch.randn(40, 12, dtype=torch.bfloat16)[::2])  # 48 B rows
    assert not M.grouped_mm_layout_ok(torch.randn(40, 12, dtype=torch.bfloat16)[:, :8])  # 24 B
    assert not M.grouped_mm_layout_ok(torch.ones(()).expand(40, 24))  # sum()'s stride-0 grad
    assert M.grouped_mm_layout_ok(torch.randn(40, 12, dtype=torch.bfloat16)[:, :8].contiguous())
    for bad in (x[:, 1:17], torch.ones((), dtype=torch.bfloat16).expand(40, 24)):
        fixed = M._gmm_operand(bad)
        assert M.grouped_mm_layout_ok(fixed) and torch.equal(fixed, bad)
    w = torch.randn(4, 24, 16, dtype=torch.bfloat16)
    assert M.grouped_mm_layout_ok(w) and M.grouped_mm_layout_ok(w.transpose(1, 2))
    # The fast path refuses what the op cannot take (the per-segment loop runs instead).
    assert not M.grouped_mm_available(x)  # CPU
    assert not M.grouped_mm_available(torch.randn(0, 24, dtype=torch.bfloat16))


def test_gather_sum_and_combine_backward_reference_float64() -> None:
    # The torch forms of the Triton kernels against autograd on the un-permuted definition.
    torch.manual_seed(0)
    m, k, d = 7, 3, 10
    order = torch.randperm(m * k)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(m * k)
    ys = torch.randn(m * k, d, dtype=torch.float64, requires_grad=True)
    w = torch.rand(m * k, dtype=torch.float64, requires_grad=True)
    want = (ys[inv].view(m, k, d) * w.view(m, k, 1)).sum(1)
    got = M.gather_sum_reference(ys, inv, k, w, torch.float64)
    torch.testing.assert_close(got, want)
    g = torch.randn(m, d, dtype=torch.float64)
    want.backward(g)
    dys, dw = M.combine_backward_reference(g, ys.detach(), order, inv, w.detach(), k)
    torch.testing.assert_close(dys, ys.grad)
    torch.testing.assert_close(dw, w.grad)
    # The gather's backward: each token sums its k sorted gradient rows.
    x = torch.randn(m, d, dtype=torch.float64, requires_grad=True)
    xs = M._Gather.apply(x, order, inv, k, torch.float64)
    torch.testing.assert_close(xs, x[order // k])
    gs = torch.randn_like(xs)
    xs.backward(gs)
    torch.testing.assert_close(x.grad, torch.zeros_like(x).index_add_(0, order // k, gs))


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [400, 333])
def test_grouped_bf16_cuda_matches_float64_reference(routing: str, tokens: int) -> None:
    torch.manual_seed(0)
    _grouped_vs_float64("cuda", torch.bfloat16, routing, tokens)


@pytest.mark.gpu
def test_grouped_bf16_cuda_odd_shapes_take_the_loop() -> None:
    # K or O not a multiple of 8: the fast path refuses torch._grouped_mm, the loop still matches.
    x = torch.randn(50, 20, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 20, 12, device="cuda", dtype=torch.bfloat16)
    assert not M.grouped_mm_available(x, w)
    assert M.grouped_mm_available(x[:, :16].contiguous(), w[:, :16, :8])
    counts = torch.tensor([10, 0, 25, 15], device="cuda")
    offs = torch.cumsum(counts, 0).to(torch.int32)
    got = M.grouped_mm(x, w, counts, offs).double()
    ref = torch.cat([p.double() @ w[e].double() for e, p in enumerate(x.split([10, 0, 25, 15]))])
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_expert_counts_equal_bincount() -> None:
    torch.manual_seed(0)
    idx = torch.randint(0, 7, (300,))
    assert torch.equal(M.expert_counts(idx, 9), torch.bincount(idx, minlength=9))
    assert torch.equal(M.expert_counts(idx[:0], 3), torch.zeros(3, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS)
def test_moe_layer_forward_backward_has_no_host_sync(routing: str) -> None:
    # torch.bincount reads its max on the host on CUDA; a sync per layer exposes the host's launch
    # latency on the GPU timeline. Training forward + backward under bf16 autocast must not sync.
    cfg = ModelConfig(
        d_model=128,
        n_heads=4,
        moe=MoEConfig(n_experts=8, top_k=2, expert_d_ff=64, routing=routing, z_loss_coef=1e-3),
    )
    layer = _layer(cfg, dtype=torch.float32).cuda().train()
    x = torch.randn(2, 200, 128, device="cuda", requires_grad=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = layer(x).float().square().mean() + layer.aux_loss()
        loss.backward()

    step()  # warm-up: Triton compilation, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_grouped_mm_function_takes_a_stride_0_gradient_in_bf16() -> None:
    # y.sum() hands backward an expanded (stride-0) gradient, which torch._grouped_mm's layout
    # rules reject on CUDA: _GroupedMM copies it first. bf16, as on the GPU (CPU kernel here).
    torch.manual_seed(0)
    counts = torch.tensor([4, 0, 3, 9])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(16, 16, dtype=torch.bfloat16, requires_grad=True)
    w_leaf = torch.randn(4, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    try:
        y = M._GroupedMM.apply(x, w_leaf.transpose(1, 2), offs)
    except RuntimeError as e:
        pytest.skip(f"torch._grouped_mm does not run in bf16 on this CPU build: {e}")
    y.sum().backward()
    x64 = x.detach().double().requires_grad_()
    w64 = w_leaf.detach().double().transpose(1, 2).requires_grad_()
    parts = torch.split(x64, counts.tolist())
    torch.cat([p @ w64[e] for e, p in enumerate(parts)]).sum().backward()
    for got, want in ((x.grad, x64.grad), (w_leaf.grad.transpose(1, 2), w64.grad)):
        s = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * s)


def test_model_logits_grouped_match_reference_fp32_and_bf16_with_the_same_routing() -> None:
    # A deep MoE model under bf16 differs between the two paths mainly through top-k flips: the
    # paths round activations differently, near-tied router scores then pick other experts, and
    # the change spreads. So the bf16 comparison feeds the reference the grouped run's routing
    # (benchmarks/moe.py --train checks the GPT-2-small model the same way); fp32 routes alike.
    cfg = ModelConfig(d_model=64, n_layers=6, n_heads=4, vocab_size=128, context_length=64,
                      attention="sdpa", moe=MoEConfig(n_experts=32, top_k=4, expert_d_ff=16))  # fmt: skip
    torch.manual_seed(0)
    model = TransformerLM(cfg).train()
    ids = torch.randint(0, 128, (2, 64))
    layers = list(M.moe_layers(model))

    def run(backend: str, bf16: bool, replay: list | None = None):  # type: ignore[no-untyped-def]
        for i, layer in enumerate(layers):
            layer.backend, layer.record_routing = backend, True
            if replay is not None:
                layer.expert_compute = lambda lay, x, r, ri=replay[i]: M._compute_reference(
                    lay, x, ri
                )
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(ids).float()
        for layer in layers:
            layer.expert_compute = None
        return out, [layer.last_routing.expert_idx.clone() for layer in layers]

    got, routes = run("grouped", False)
    want, own = run("reference", False)
    assert all(torch.equal(a, b) for a, b in zip(routes, own))  # fp32: the same choices
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    got, _ = run("grouped", True)
    grouped_routing = [layer.last_routing for layer in layers]
    want, _ = run("reference", True, replay=grouped_routing)
    assert ((got - want).abs().max() / want.abs().max()).item() < 3e-2


def _router_want(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):  # type: ignore[no-untyped-def]
    # float64 math of the bf16-input, fp32-output router GEMM and its gradients (g rounded to
    # bf16, as autocast rounds any Linear's incoming gradient)
    xd, wd, gd = (t.detach().to(torch.bfloat16).double() for t in (x, w, g))
    return xd @ wd.t(), (gd @ wd).to(torch.bfloat16).double(), gd.t() @ xd  # dx in bf16


def test_router_logits_bf16_inputs_fp32_output_match_float64() -> None:
    # The router GEMM under autocast: inputs rounded to bf16, fp32 logits (CUDA: torch.mm's
    # out_dtype overload); backward: the gradient rounded to bf16, dx in bf16, dw in fp32.
    torch.manual_seed(0)
    x = torch.randn(37, 24, requires_grad=True)
    w = torch.randn(6, 24, requires_grad=True)
    g = torch.randn(37, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = M.router_logits(x, w)
    assert logits.dtype == torch.float32
    (logits * g).sum().backward()
    want, gx, gw = _router_want(x, w, g)
    torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), gx, rtol=8e-3, atol=1e-5)  # one bf16 rounding
    torch.testing.assert_close(w.grad.double(), gw, rtol=1e-5, atol=1e-4)
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_router_logits_fp32_and_float64_stay_exact() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(9, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    torch.testing.assert_close(M.router_logits(x, w), x @ w.t(), rtol=0, atol=0)
    torch.testing.assert_close(M.router_logits(x.float(), w.float()), x.float() @ w.float().t())


@pytest.mark.gpu
def test_router_logits_cuda_bf16_match_float64() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert M._mm_out_dtype_ok()
    torch.manual_seed(0)
    x = torch.randn(4099, 768, device="cuda", requires_grad=True)
    w = (0.02 * torch.randn(64, 768, device="cuda")).requires_grad_()
    g = torch.randn(4099, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = M.router_logits(x, w)
    assert logits.dtype == torch.float32
    (logits * g).sum().backward()
    want, gx, gw = _router_want(x, w, g)
    scale = want.abs().max().item()
    torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(x.grad.double(), gx, rtol=8e-3, atol=1e-5 * gx.abs().max().item())
    torch.testing.assert_close(w.grad.double(), gw, rtol=1e-5, atol=1e-5 * gw.abs().max().item())
