"""The fast path on several processes: the trainer under DDP and FSDP equals one process.

Two gloo processes run :class:`lmforge.train.Trainer` steps with the sync-free step (the skip
decision and the update on the device, clipping folded into the update under DDP), the fused
linear + cross-entropy (DDP) and bf16 master weights (DDP), each rank drawing its half of a
fixed global batch; a single-process trainer in the same worker runs the whole batch. The
Triton AdamW and the CUDA graph need CUDA: see the single-rank NCCL test in
``tests/test_train_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.parallel._testing import run_workers

STEPS, B, T = 4, 2, 16


def _cfg(shard: str, out: str, strategy: str, **train: object):
    from lmforge.config import RunConfig
    from lmforge.parallel._testing import tiny_model_config
    from lmforge.parallel.config import ParallelConfig
    from lmforge.train import DataConfig, TrainConfig

    base = dict(out_dir=out, device="cpu", precision="fp32", batch_size=B, context_length=T,
                max_steps=STEPS, warmup_steps=1, lr=3e-3, grad_clip=0.05, progress=False)  # fmt: skip
    base.update(train)
    return RunConfig(
        model=tiny_model_config(vocab_size=512),
        train=TrainConfig(**base),
        data=DataConfig(train=(shard,)),
        parallel=ParallelConfig(fsdp=strategy == "fsdp", backend="gloo"),
    )


def _global_batches(vocab: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, vocab, (2 * B, T), generator=g),
            torch.randint(0, vocab, (2 * B, T), generator=g),
        )
        for _ in range(STEPS)
    ]


def _feed(trainer, rows: slice) -> None:
    # Each call hands the trainer its rows of the fixed global batch of this iteration.
    batches = _global_batches()
    trainer.sampler.next_batch = lambda b, device: tuple(
        t[rows].to(device) for t in batches[trainer.iteration]
    )


def _run(trainer) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    trainer.deferred = True  # the sync-free step (the default on CUDA), forced on the CPU
    records = [trainer.train_step()[:2] for _ in range(STEPS)]
    state = {k: v.detach().float().clone() for k, v in trainer.strategy.full_state_dict().items()}
    for name, (_, master) in trainer.masters.items():
        state[name] = master.detach().clone()
    return records, state


def _worker(rank: int, world: int, shard: str, folder: str, strategy: str, train: dict):
    from lmforge.train import Trainer
    from lmforge.utils.runtime import Runtime

    dist_rt = Runtime(device="cpu", rank=rank, local_rank=rank, world_size=world)
    trainer = Trainer(_cfg(shard, f"{folder}/d{rank}", strategy, **train), dist_rt)
    fast = trainer.fast
    _feed(trainer, slice(rank * B, (rank + 1) * B))
    recs, state = _run(trainer)
    out: dict[str, object] = {
        "fused": trainer.fused is not None,
        "masters": bool(trainer.masters),
        "clip_in_update": trainer.stepper.clip_in_update,
        "adamw": fast.adamw,
    }
    if rank == 0:
        ref = Trainer(_cfg(shard, f"{folder}/ref", "single", **{**train, "batch_size": 2 * B}))
        _feed(ref, slice(0, 2 * B))
        ref_recs, ref_state = _run(ref)
        out["loss_diff"] = max(abs(a[0] - b[0]) for a, b in zip(recs, ref_recs))
        out["norm_diff"] = max(abs(a[1] - b[1]) / b[1] for a, b in zip(recs, ref_recs))
        out["clipped"] = min(b[1] for b in ref_recs) > 0.05
        out["param_diff"] = max(
            float((state[k] - v).abs().max() / (v.abs().max() + 1e-12))
            for k, v in ref_state.items()
        )
    return out


@pytest.fixture()
def shard(tmp_path: Path) -> str:
    from lmforge.train.data import write_shard

    return str(write_shard(tmp_path / "t.bin", np.arange(4000) % 97, 512))


CASES = [  # (strategy, train overrides, tolerance)
    ("ddp", {"loss": "fused"}, 1e-5),
    ("ddp", {"loss": "fused", "precision": "bf16", "master_weights": "on"}, 1e-2),
    ("fsdp", {}, 1e-5),
]


def _all_cases(rank: int, world: int, shard: str, folder: str) -> list[dict]:
    # One spawn for every case (starting two processes costs more than a case).
    return [
        _worker(rank, world, shard, f"{folder}/{i}", strategy, train)
        for i, (strategy, train, _) in enumerate(CASES)
    ]


@pytest.mark.dist
def test_trainer_fast_path_on_two_processes_matches_one(shard: str, tmp_path: Path) -> None:
    results = run_workers(_all_cases, 2, shard, str(tmp_path), timeout=180)
    for (strategy, train, tol), r in zip(CASES, results[0], strict=True):
        assert r["clipped"], "the clip must act for the test to cover it"
        assert r["loss_diff"] < tol and r["norm_diff"] < tol and r["param_diff"] < tol, r
        assert r["fused"] == (strategy == "ddp"), r
        assert r["masters"] == (train.get("master_weights") == "on"), r
        assert r["clip_in_update"] == (strategy == "ddp"), r
