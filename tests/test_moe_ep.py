"""Expert parallelism on 2 gloo processes reproduces single-process training (float64): experts
sharded, tokens dispatched by all-to-all, replicated weights data-parallel, aux-free bias synced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.parallel._testing import run_workers, tiny_model_config

STEPS = 3
B, T = 2, 12
MOE = dict(n_experts=4, top_k=2, n_shared_experts=1, expert_d_ff=32, bias_update_rate=0.01)


def _model():
    from lmforge.model import TransformerLM
    from lmforge.model.moe_config import MoEConfig

    # aux loss off: the Switch term is computed from each rank's own tokens (documented).
    cfg = tiny_model_config(moe=MoEConfig(aux_loss_coef=0.0, z_loss_coef=1e-3, **MOE))
    torch.manual_seed(7)
    return TransformerLM(cfg).double()


def _batches(world: int):
    g = torch.Generator().manual_seed(99)
    return [
        (
            torch.randint(0, 64, (B * world, T), generator=g),
            torch.randint(0, 64, (B * world, T), generator=g),
        )
        for _ in range(STEPS)
    ]


def _loss(model, x, y):
    from lmforge.model import moe as M

    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    aux = M.aux_loss(model)
    return loss if aux is None else loss + aux


def _reference(world: int) -> dict[str, torch.Tensor]:
    from lmforge.model import moe as M

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in _batches(world):
        # Mean of the per-rank means (equal sizes) = the mean over the global batch; the z-loss
        # is per rank too, so average it the same way.
        loss = sum(
            _loss(model, x[r * B : (r + 1) * B], y[r * B : (r + 1) * B]) for r in range(world)
        )
        (loss / world).backward()
        opt.step()
        opt.zero_grad()
        M.update_expert_bias(model, distributed=False)  # one process: no all-reduce
    return {k: v.clone() for k, v in model.state_dict().items()}


def _ep_worker(rank: int, world: int, ep_size: int) -> dict[str, float]:
    from lmforge.model import moe as M
    from lmforge.parallel import ep

    want = _reference(world)  # in the worker: tensors do not travel back through the queue
    ep_group, edp_group = ep.expert_parallel_groups(ep_size)
    model = ep.apply_expert_parallel(_model(), ep_group)
    assert model.layers[0].ffn.w1.shape[0] == MOE["n_experts"] // ep_size
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in _batches(world):
        _loss(model, x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B]).backward()
        ep.sync_gradients(model, edp_group)
        opt.step()
        opt.zero_grad()
        M.update_expert_bias(model)  # loads summed over the world: every replica agrees
    got = ep.gather_expert_state(model, ep_group)
    assert set(got) == set(want)
    out = {k: (got[k] - want[k]).abs().max().item() for k in want}
    out["bias_moved"] = float(_bias_moves(want))
    return out


def _bias_moves(state: dict[str, torch.Tensor]) -> bool:
    return any(v.abs().sum() > 0 for k, v in state.items() if k.endswith("expert_bias"))


@pytest.mark.dist
def test_expert_parallel_matches_single_process() -> None:
    for diffs in run_workers(_ep_worker, 2, 2, timeout=90):
        assert diffs.pop("bias_moved") == 1.0
        assert max(diffs.values()) < 1e-10, max(diffs.items(), key=lambda kv: kv[1])


@pytest.mark.dist_slow
def test_expert_parallel_composed_with_data_parallel_matches_single_process() -> None:
    # 4 ranks: two EP groups {0, 1} and {2, 3}, each holding all experts once.
    for diffs in run_workers(_ep_worker, 4, 2, timeout=150):
        assert diffs.pop("bias_moved") == 1.0
        assert max(diffs.values()) < 1e-10, max(diffs.items(), key=lambda kv: kv[1])


def test_expert_parallel_needs_distributed() -> None:
    from lmforge.parallel import ep
    from lmforge.utils.errors import LmforgeError

    with pytest.raises(LmforgeError, match=r"torch\.distributed"):
        ep.apply_expert_parallel(_model())
    assert ep.is_expert_parameter("layers.1.ffn.w2")
    assert not ep.is_expert_parameter("layers.1.ffn.shared.w2.weight")
