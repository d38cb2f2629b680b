"""``parallel.ep`` in the trainer: gloo processes with expert parallelism (each rank its share
of the experts, its own rows of a fixed global batch) reproduce the single-process trainer on
the whole batch, and a resumed EP run continues exactly; bad layouts are refused in one line.

Tolerance: fp32, 1e-5 relative on losses, gradient norms and every weight (the sums run in a
different order: per-rank means, all-to-all, one flat all-reduce). The Switch aux loss is off
because each rank computes it from its own tokens (documented in ``lmforge.parallel.ep``); the
z-loss and the auxiliary-loss-free bias are on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.parallel._testing import run_workers

STEPS, B, T = 4, 2, 16
MOE = dict(n_experts=4, top_k=2, expert_d_ff=32, aux_loss_coef=0.0, z_loss_coef=1e-3)


def _cfg(shard: str, out: str, ep: int, **train: object):
    from lmforge.config import RunConfig
    from lmforge.model.moe_config import MoEConfig
    from lmforge.parallel._testing import tiny_model_config
    from lmforge.parallel.config import ParallelConfig
    from lmforge.train import DataConfig, TrainConfig

    base = dict(out_dir=out, device="cpu", precision="fp32", batch_size=B, context_length=T,
                max_steps=STEPS, warmup_steps=1, lr=3e-3, grad_clip=0.05, progress=False,
                plot=False, eval_every=0, save_every=0)  # fmt: skip
    base.update(train)
    moe = MoEConfig(bias_update_rate=0.01, **MOE)
    return RunConfig(
        model=tiny_model_config(vocab_size=512, moe=moe),
        train=TrainConfig(**base),
        data=DataConfig(train=(shard,)),
        parallel=ParallelConfig(ep=ep, backend="gloo"),
    )


def _feed(trainer, rows: slice, world: int) -> None:
    # Each call hands the trainer its rows of this iteration's fixed global batch.
    g = torch.Generator().manual_seed(7)
    batches = [
        (torch.randint(0, 512, (world * B, T), generator=g),
         torch.randint(0, 512, (world * B, T), generator=g))
        for _ in range(STEPS)
    ]  # fmt: skip
    trainer.sampler.next_batch = lambda b, device: tuple(
        t[rows].to(device) for t in batches[trainer.iteration]
    )


def _state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.strategy.full_state_dict().items()}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-12)) for k in b)


def _worker(rank: int, world: int, shard: str, folder: str, ep: int) -> dict[str, object]:
    from lmforge.train import Trainer
    from lmforge.utils.runtime import Runtime

    rt = Runtime(device="cpu", rank=rank, local_rank=rank, world_size=world)
    mine = slice(rank * B, (rank + 1) * B)
    tr = Trainer(_cfg(shard, f"{folder}/ep{rank}", ep), rt)
    out: dict[str, object] = {
        "kind": type(tr.strategy).__name__,
        "local_experts": tr.model.layers[0].ffn.w1.shape[0],
        "tokens_per_step": tr.plan.tokens_per_step,
    }
    _feed(tr, mine, world)
    recs = [tr.train_step()[:2] for _ in range(STEPS)]
    state = _state(tr)
    # Resume: 2 steps, a checkpoint, then a fresh EP trainer continues to STEPS.
    cut = f"{folder}/cut"  # shared by the ranks, as under torchrun (rank 0 writes)
    first = Trainer(_cfg(shard, cut, ep, max_steps=2), rt)
    _feed(first, mine, world)
    first.run()
    again = Trainer(_cfg(shard, cut, ep), rt)
    out["resumed_at"] = again.iteration
    _feed(again, mine, world)
    again.run()
    out["resume_diff"] = max((v - state[k]).abs().max().item() for k, v in _state(again).items())
    if rank == 0:
        ref = Trainer(_cfg(shard, f"{folder}/ref", 1, batch_size=world * B))
        out["ref_tokens_per_step"] = ref.plan.tokens_per_step
        _feed(ref, slice(0, world * B), world)
        ref_recs = [ref.train_step()[:2] for _ in range(STEPS)]
        ref_state = _state(ref)
        out["loss_diff"] = max(abs(a[0] - b[0]) / b[0] for a, b in zip(recs, ref_recs))
        out["norm_diff"] = max(abs(a[1] - b[1]) / b[1] for a, b in zip(recs, ref_recs))
        out["clipped"] = min(b[1] for b in ref_recs) > 0.05
        out["param_diff"] = _rel(state, ref_state)
        bias = [v for k, v in ref_state.items() if k.endswith("expert_bias")]
        out["bias_moved"] = any(float(b.abs().sum()) > 0 for b in bias)
        # A single process cannot resume the EP run's per-rank optimizer states: one line.
        try:
            Trainer(_cfg(shard, cut, 1))
            out["refused"] = ""
        except Exception as e:
            out["refused"] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture()
def shard(tmp_path: Path) -> str:
    from lmforge.train.data import write_shard

    return str(write_shard(tmp_path / "t.bin", np.arange(4000) % 97, 512))


def _check(results: list[dict[str, object]], world: int, ep: int) -> None:
    for r in results:
        assert r["kind"] == "ExpertParallelStrategy", r
        assert r["local_experts"] == MOE["n_experts"] // ep, r
        assert r["tokens_per_step"] == world * B * T, r
        assert r["resumed_at"] == 2 and r["resume_diff"] == 0.0, r
    r = results[0]
    assert r["ref_tokens_per_step"] == r["tokens_per_step"], r
    assert r["clipped"] and r["bias_moved"], (
        "the clip and the bias must act for the test to cover them"
    )
    assert r["loss_diff"] < 1e-5 and r["norm_diff"] < 1e-5 and r["param_diff"] < 1e-5, r
    assert "LmforgeError" in r["refused"] and "parallel.ep" in r["refused"], r["refused"]


@pytest.mark.dist
def test_trainer_ep2_matches_single_process_and_resumes(shard: str, tmp_path: Path) -> None:
    _check(run_workers(_worker, 2, shard, str(tmp_path), 2, timeout=240), 2, 2)


@pytest.mark.dist_slow
def test_trainer_dp2_ep2_matches_single_process_and_resumes(shard: str, tmp_path: Path) -> None:
    # 4 ranks: EP groups {0, 1} and {2, 3}; expert gradients also reduced over {0, 2}, {1, 3}.
    _check(run_workers(_worker, 4, shard, str(tmp_path), 2, timeout=300), 4, 2)


# -- refusals (one process, no spawn)


def test_ep_layout_refusals_name_the_key() -> None:
    from lmforge.parallel.config import ParallelConfig
    from lmforge.parallel.ep import check_expert_layout
    from lmforge.utils.errors import LmforgeError

    cases = [
        (ParallelConfig(ep=2), 1, "must divide the world size 1"),
        (ParallelConfig(ep=3), 4, "must divide the world size 4"),
        (ParallelConfig(ep=2, tp=2), 4, "parallel.tp=2"),
        (ParallelConfig(ep=2, pp=2), 4, "parallel.pp=2"),
        (ParallelConfig(ep=2, fsdp=True), 4, "parallel.fsdp=true"),
        (ParallelConfig(ep=2, zero1=True), 4, "parallel.zero1=true"),
        (ParallelConfig(ep=2, dp=2), 4, "leave parallel.dp=0"),
        (ParallelConfig(ep=0), 4, "parallel.ep must be >= 1"),
    ]
    for pcfg, world, msg in cases:
        with pytest.raises(LmforgeError, match=msg.replace(".", r"\.")):
            check_expert_layout(pcfg, world)
    check_expert_layout(ParallelConfig(ep=2), 4)  # fine
    check_expert_layout(ParallelConfig(ep=2, dp=4), 4)


def test_ep_model_refusals() -> None:
    from lmforge.model import TransformerLM
    from lmforge.model.moe_config import MoEConfig
    from lmforge.parallel._testing import tiny_model_config
    from lmforge.parallel.ep import check_expert_model
    from lmforge.utils.errors import LmforgeError

    dense = TransformerLM(tiny_model_config(), device="meta")
    with pytest.raises(LmforgeError, match="needs a mixture-of-experts model"):
        check_expert_model(2, dense)
    moe6 = TransformerLM(tiny_model_config(moe=MoEConfig(n_experts=6, top_k=2)), device="meta")
    with pytest.raises(LmforgeError, match=r"parallel\.ep=4 must divide model\.moe\.n_experts=6"):
        check_expert_model(4, moe6)
    check_expert_model(2, moe6)
    check_expert_model(1, dense)


def test_trainer_refuses_ep_on_one_process(shard: str, tmp_path: Path) -> None:
    from lmforge.train import Trainer
    from lmforge.utils.errors import LmforgeError

    with pytest.raises(LmforgeError, match=r"parallel\.ep=2 must divide the world size 1"):
        Trainer(_cfg(shard, str(tmp_path / "run"), 2))
    cfg = _cfg(shard, str(tmp_path / "dense"), 1)
    dense = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, n_experts=0))
    Trainer(dataclasses.replace(cfg, model=dense))  # ep=1 (the default) on a dense model: fine


def test_fast_path_under_ep() -> None:
    # EP keeps the fused loss and the sync-free step, clips through the strategy (a sharded
    # norm), and refuses master weights (its shards replace the expert weights).
    from lmforge.parallel._testing import tiny_model_config
    from lmforge.train import TrainConfig
    from lmforge.train.fastpath import FastPathRuntime, resolve_fast_path
    from lmforge.utils.errors import LmforgeError

    rt = FastPathRuntime(device_type="cuda", world_size=2, strategy="ep", triton=True)
    fast = resolve_fast_path(tiny_model_config(), TrainConfig(precision="bf16", loss="auto"), rt)
    assert fast.loss == "fused" and fast.sync_free and not fast.clip_in_update
    assert not fast.master_weights and fast.adamw == "triton" and not fast.cuda_graph
    with pytest.raises(LmforgeError, match=r"master_weights=on needs .*got ep"):
        resolve_fast_path(
            tiny_model_config(), TrainConfig(precision="bf16", master_weights="on"), rt
        )
