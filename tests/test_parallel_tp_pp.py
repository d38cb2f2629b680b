"""Tensor and pipeline parallelism reproduce single-process losses; hierarchical = flat
all-reduce; build_strategy wires the trainer's contract; bad layouts stop with one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.parallel._testing import run_workers, tiny_model_config

STEPS = 3
B, T = 4, 16


def _loss(model, x, y):
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def _batches(steps: int = STEPS, seed: int = 7, n: int = B):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 64, (n, T), generator=g), torch.randint(0, 64, (n, T), generator=g))
        for _ in range(steps)
    ]


def _model(**cfg):
    from lmforge.model import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(tiny_model_config(**cfg))


def _single_losses(micro: int = 1, **cfg) -> list[float]:
    model = _model(**cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            loss = _loss(model, xm, ym)
            (loss / micro).backward()
            total += loss.item() / micro
        opt.step()
        out.append(total)
    return out


def _strategy_worker(
    rank: int, world: int, overrides: dict, micro: int, cfg: dict | None = None
) -> dict:
    from lmforge.parallel import ParallelConfig, build_strategy
    from lmforge.utils import Runtime

    cfg = cfg or {}
    model = _model(**cfg)
    pcfg = ParallelConfig(**overrides)
    strategy = build_strategy(model, pcfg, Runtime(rank=rank, world_size=world))
    opt = strategy.make_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    dp = strategy.mesh.layout.dp
    dp_i = strategy.mesh.coords[0]
    losses = []
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        xs, ys = x.chunk(dp)[dp_i], y.chunk(dp)[dp_i]
        micro_batches = list(zip(xs.chunk(micro), ys.chunk(micro)))
        loss = strategy.forward_backward(micro_batches, _loss)
        strategy.clip_grad_norm(float("inf"))
        opt.step()
        losses.append(loss.item())
    state = strategy.full_state_dict()
    out = {"losses": losses, "keys": sorted(state)}
    if hasattr(strategy, "runner"):
        out["bubble"] = strategy.runner.last_bubble
    ref = _model(**cfg)
    out["shapes_ok"] = all(state[k].shape == v.shape for k, v in ref.state_dict().items())
    return out


def _quick_tp_pp_worker(rank: int, world: int) -> dict:
    """TP=2 and PP=2 (1F1B) losses with their references, and a bad layout's message."""
    out: dict = {}
    gate = {"attn_output_gate": True}  # Qwen3-Next's gate: W_gate split by query heads
    for name, overrides, micro, cfg in (
        ("tp2", {"tp": 2}, 1, {}),
        ("pp2", {"pp": 2}, 4, {}),
        ("tp2_gate", {"tp": 2}, 1, gate),
    ):
        out[name] = (
            _strategy_worker(rank, world, overrides, micro, cfg)["losses"],
            _single_losses(micro=micro, **cfg),
        )
    out["bad_layout"] = (_bad_layout_worker(rank, world, {"dp": 2, "tp": 2}), None)
    return out


@pytest.mark.dist
def test_quick_tp_and_pp_match_single_process() -> None:
    """Default tier: TP=2 and PP=2 (1F1B) losses within 1e-5; a bad layout's one-line error."""
    for r in run_workers(_quick_tp_pp_worker, 2, timeout=120):
        for name, (losses, ref) in r.items():
            if name == "bad_layout":
                assert "world size is 2" in losses and "\n" not in losses, losses
                continue
            assert max(abs(a - b) for a, b in zip(losses, ref)) <= 1e-5, (name, losses, ref)


@pytest.mark.dist_slow
@pytest.mark.parametrize(
    "overrides,micro",
    [
        ({"tp": 2}, 1),
        ({"pp": 2, "schedule": "1f1b"}, 4),
    ],
    ids=["tp2", "pp2-1f1b"],
)
def test_tp_and_pp_match_single_process(overrides: dict, micro: int) -> None:
    ref = _single_losses(micro=micro)
    results = run_workers(_strategy_worker, 2, overrides, micro)
    keys = sorted(_model().state_dict())
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref)) <= 1e-5, (r["losses"], ref)
        assert r["keys"] == keys and r["shapes_ok"]
    if "pp" in overrides:
        b = results[0]["bubble"]
        assert b["theory_idle_over_busy"] == pytest.approx(1 / micro)
        assert 0.0 <= b["measured_idle_fraction"] < 1.0


@pytest.mark.dist_slow
@pytest.mark.parametrize(
    "overrides,micro",
    [
        ({"pp": 2, "schedule": "gpipe"}, 4),
        ({"dp": 2, "tp": 2}, 1),
        ({"dp": 2, "pp": 2}, 2),
        ({"dp": 2, "tp": 2, "fsdp": True}, 1),
        ({"zero1": True, "domain_size": 2}, 1),
    ],
    ids=["pp2-gpipe", "dp2xtp2", "dp2xpp2", "fsdp2xtp2", "zero1-hier"],
)
def test_composed_layouts_match_single_process(overrides: dict, micro: int) -> None:
    world = overrides.get("dp", 1) * overrides.get("tp", 1) * overrides.get("pp", 1)
    world = max(world, 4 if "domain_size" in overrides else world)
    ref = _single_losses(micro=micro)
    results = run_workers(_strategy_worker, world, overrides, micro, timeout=120)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref)) <= 1e-5, (r["losses"], ref)
        assert r["shapes_ok"]


def _hier_worker(rank: int, world: int) -> tuple[float, float]:
    import torch.distributed as dist

    from lmforge.parallel import HierarchicalGroups, hierarchical_all_reduce

    groups = HierarchicalGroups(2)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1001, generator=g).to(torch.float64)  # odd size: padding path
    flat = x.clone()
    dist.all_reduce(flat)
    hier = x.clone()
    hierarchical_all_reduce(hier, groups)
    # fp16 gradients 2048, 1, 1, 0 on the four ranks: an fp16 running sum stays at 2048
    # (2048 + 1 rounds back to 2048); lmforge's fp32 sum gives 2050, which fp16 represents.
    g16 = torch.full((8,), (2048.0, 1.0, 1.0, 0.0)[rank], dtype=torch.float16)
    hierarchical_all_reduce(g16, groups)
    return (hier - flat).abs().max().item(), g16[0].item()


@pytest.mark.dist_slow
def test_hierarchical_all_reduce_equals_flat() -> None:
    results = run_workers(_hier_worker, 4)
    # fp64 in, fp32 sums inside: equal to fp32 rounding of the values.
    assert max(d for d, _ in results) < 1e-5, results
    assert all(v == 2050.0 for _, v in results), results


def _bad_layout_worker(rank: int, world: int, overrides: dict) -> str:
    from lmforge.parallel import ParallelConfig, build_strategy
    from lmforge.utils import LmforgeError, Runtime

    try:
        build_strategy(_model(), ParallelConfig(**overrides), Runtime(rank=rank, world_size=world))
    except LmforgeError as e:
        return str(e)
    return "no error"


@pytest.mark.dist_slow
def test_bad_layout_stops_every_rank_with_one_line() -> None:
    msgs = run_workers(_bad_layout_worker, 2, {"dp": 2, "tp": 2}, timeout=30)
    assert all("world size is 2" in m and "\n" not in m for m in msgs), msgs


def test_layout_validation_messages() -> None:
    from lmforge.parallel._dist import resolve_layout
    from lmforge.utils import LmforgeError

    assert resolve_layout(8, tp=2, pp=2).dp == 2
    with pytest.raises(LmforgeError, match=r"2×2×1 = 4 but the world size is 8"):
        resolve_layout(8, dp=2, tp=2)
    with pytest.raises(LmforgeError, match=r"do not divide model\.n_layers=4"):
        resolve_layout(3, pp=3, n_layers=4)
    with pytest.raises(LmforgeError, match=r"tp=4 does not divide model\.n_kv_heads=2"):
        resolve_layout(4, tp=4, n_heads=4, n_kv_heads=2)
    with pytest.raises(LmforgeError, match="fsdp"):
        resolve_layout(4, pp=2, fsdp=True)
    layout = resolve_layout(8, dp=2, tp=2, pp=2)
    assert [layout.rank_of(*layout.coords(r)) for r in range(8)] == list(range(8))


def test_low_precision_reduction_bias_and_fp32_path() -> None:
    from lmforge.parallel.hierarchical import _ring_sum

    ones = list(torch.ones(4096, dtype=torch.float16).split(1))
    # A reduction that accumulates in fp16 stalls: at 2048 the fp16 spacing is 2, 2048 + 1 = 2048.
    assert _ring_sum(ones, accumulate=torch.float16).item() == 2048.0
    assert (
        _ring_sum(
            [torch.tensor([v], dtype=torch.float16) for v in (2048, 1, 1, 0)],
            accumulate=torch.float16,
        ).item()
        == 2048.0
    )
    # lmforge reduces in fp32 whatever the gradient dtype: exact.
    assert _ring_sum(ones, accumulate=torch.float32).item() == 4096.0
