"""The trainer on one CUDA GPU: bf16 autocast, torch.compile, the auto (fused) loss (tier ``gpu``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config import RunConfig
from lmforge.model import load_preset
from lmforge.train import DataConfig, TrainConfig, Trainer, load_for_inference
from lmforge.train.data import write_shard
from lmforge.train.trainer import read_metrics

pytestmark = pytest.mark.gpu


def _cfg(tmp: Path, **train: object) -> RunConfig:
    rng = np.random.default_rng(0)
    base = np.tile(np.arange(50), 2000)
    toks = np.where(rng.random(base.size) < 0.1, rng.integers(0, 512, base.size), base)
    tr = write_shard(tmp / "train.bin", toks[:90000], 512, num_bytes=270000)
    va = write_shard(tmp / "val.bin", toks[90000:], 512, num_bytes=30000)
    t = dict(
        out_dir=str(tmp / "run"),
        device="cuda",
        precision="bf16",
        batch_size=8,
        context_length=64,
        max_steps=60,
        lr=3e-3,
        warmup_steps=5,
        log_every=1,
        eval_every=30,
        eval_batches=4,
        save_every=30,
        progress=False,
    )
    t.update(train)
    return RunConfig(
        model=load_preset("tiny"),
        train=TrainConfig(**t),
        data=DataConfig(train=(str(tr),), val=(str(va),)),
    )


@pytest.mark.parametrize("compile_", [False, True])
def test_trains_on_gpu_bf16(tmp_path: Path, compile_: bool) -> None:
    result = Trainer(_cfg(tmp_path, compile=compile_, loss="auto")).run()
    curve = [
        r["loss"]
        for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
        if r.get("event") == "train"
    ]
    assert len(curve) == 60 and np.mean(curve[-5:]) < np.mean(curve[:5]) - 1.0
    assert np.isfinite(result["val_loss"])
    model, _ = load_for_inference(tmp_path / "run", device="cuda")
    assert next(model.parameters()).dtype == torch.float32  # fp32 master weights were saved


def test_fused_and_reference_losses_agree_on_gpu(tmp_path: Path) -> None:
    ref = Trainer(_cfg(tmp_path, loss="reference"))
    fused = Trainer(_cfg(tmp_path, loss="fused"))
    x, y = ref.sampler.next_batch(8, "cuda")
    a, b = ref.loss_fn(ref.model, x, y), fused.loss_fn(fused.model, x, y)
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)  # bf16 logits


def _run_with_nan_step(trainer: Trainer, run_dir: Path, nan_at: int):
    # Run with the loss made NaN at iteration nan_at; (train/skip records, final weights).
    real = trainer.loss_fn

    def faulty(model, x, y, trainer=trainer, real=real):  # type: ignore[no-untyped-def]
        loss = real(model, x, y)
        return loss * float("nan") if trainer.iteration == nan_at else loss

    trainer.loss_fn = faulty  # type: ignore[method-assign]
    trainer.run()
    recs = [
        (r["event"], r["step"], r["loss"])
        for r in read_metrics(run_dir / "run" / "metrics.jsonl")
        if r.get("event") in ("train", "skip")
    ]
    return recs, [p.detach().clone() for p in trainer.model.parameters()]


def _run_with_device_nan(trainer: Trainer, run_dir: Path, nan_at: int):
    # Run with the loss multiplied by a device factor that is NaN at iteration nan_at (set
    # before each launch, so a captured CUDA graph reads it like any input); (train/skip
    # records, the run's result).
    factor = torch.ones((), device="cuda")
    real, launch = trainer.loss_fn, trainer.launch_step

    def faulty(model, x, y, real=real, factor=factor):  # type: ignore[no-untyped-def]
        return real(model, x, y) * factor

    def launch_step(trainer=trainer, launch=launch, factor=factor):  # type: ignore[no-untyped-def]
        factor.fill_(float("nan") if trainer.iteration == nan_at else 1.0)
        return launch()

    trainer.loss_fn = faulty  # type: ignore[method-assign]
    trainer.launch_step = launch_step  # type: ignore[method-assign]
    result = trainer.run()
    recs = [
        (r["event"], r["step"], r["loss"])
        for r in read_metrics(run_dir / "run" / "metrics.jsonl")
        if r.get("event") in ("train", "skip")
    ]
    return recs, result


def _same_run(a, b, skipped_step: int) -> None:
    # Same records (the NaN step skipped in both), same weights within the atomics noise: not
    # bitwise, as CUDA's embedding backward accumulates with atomics (run-to-run noise) and
    # Adam's m/√v amplifies it on rows whose gradients are ~0 (a few embedding entries).
    (ra, pa), (rb, pb) = a, b
    assert [r[:2] for r in ra] == [r[:2] for r in rb]
    assert ("skip", skipped_step) in [r[:2] for r in rb]
    np.testing.assert_allclose([r[2] for r in ra], [r[2] for r in rb], rtol=2e-3)
    for x, y in zip(pa, pb):
        off = ((x - y).abs() > 2e-3 + 2e-3 * y.abs()).float().mean().item()
        assert off < 1e-3, off


@pytest.mark.parametrize("compile_", [False, True])
def test_sync_free_step_equals_synchronous_step_on_gpu(tmp_path: Path, compile_: bool) -> None:
    # On CUDA the trainer defaults to the device-gated step read one step late; with a NaN step
    # injected it logs the same records and ends with the same weights as the host-decided step.
    runs = []
    for name, deferred in (("sync", False), ("deferred", True)):
        (tmp_path / name).mkdir()
        cfg = _cfg(tmp_path / name, compile=compile_, max_steps=20, eval_every=0, save_every=0)
        trainer = Trainer(cfg)
        assert trainer.deferred
        trainer.deferred = deferred
        runs.append(_run_with_nan_step(trainer, tmp_path / name, nan_at=7))
    _same_run(*runs, skipped_step=8)


@pytest.mark.parametrize(
    "compile_,adamw", [(False, "compiled"), (True, "compiled"), (False, "triton"), (True, "triton")]
)
def test_cuda_graph_step_equals_eager_step(tmp_path: Path, compile_: bool, adamw: str) -> None:
    # train.cuda_graph: after 3 warm-up steps the whole step is captured once and replayed.
    # Same records (a NaN step skipped on the device included), same weights as the eager
    # sync-free step; the NaN comes from a device factor set before each step, which the
    # captured graph reads like any input. With the Triton update the graph holds the copy of
    # its address table (the gradients live in the graph's pool, not where eager steps had them).
    runs = []
    for name, graph in (("eager", False), ("graph", True)):
        (tmp_path / name).mkdir()
        cfg = _cfg(
            tmp_path / name,
            compile=compile_,
            cuda_graph=graph,
            adamw=adamw,
            max_steps=20,
            eval_every=10,
            save_every=0,
        )
        trainer = Trainer(cfg)
        recs, result = _run_with_device_nan(trainer, tmp_path / name, nan_at=11)
        assert (trainer.stepper.graph is not None) == graph and not trainer.stepper.graph_off
        runs.append((recs, [p.detach().clone() for p in trainer.model.parameters()], result))
    (ra, pa, res_a), (rb, pb, res_b) = runs
    assert [r[:2] for r in ra] == [r[:2] for r in rb] and ("skip", 12) in [r[:2] for r in rb]
    np.testing.assert_allclose([r[2] for r in ra], [r[2] for r in rb], rtol=2e-3)
    assert res_b["val_loss"] == pytest.approx(res_a["val_loss"], rel=2e-3)
    for x, y in zip(pa, pb):  # embedding-backward atomics: not bitwise (see the test above)
        off = ((x - y).abs() > 2e-3 + 2e-3 * y.abs()).float().mean().item()
        assert off < 1e-3, off


def test_triton_adamw_trains_like_the_compiled_update(tmp_path: Path) -> None:
    # train.adamw=triton (auto's choice on one CUDA process) against the compiled update: the
    # same records and weights within the atomics noise, a NaN step skipped by both.
    runs = []
    for name in ("compiled", "triton"):
        (tmp_path / name).mkdir()
        cfg = _cfg(tmp_path / name, adamw=name, max_steps=20, eval_every=0, save_every=0)
        trainer = Trainer(cfg)
        assert trainer.optimizer.fused == (name == "triton")
        runs.append(_run_with_nan_step(trainer, tmp_path / name, nan_at=9))
    _same_run(*runs, skipped_step=10)


@pytest.mark.parametrize(
    "adamw,graph", [("triton", False), ("triton", True), ("compiled", False), ("foreach", False)]
)
def test_master_weights_train_like_autocast_over_fp32_on_gpu(
    tmp_path: Path, adamw: str, graph: bool
) -> None:
    # train.master_weights (auto's choice here): bf16 matmul weights written by the update from
    # fp32 masters, against bf16 autocast over fp32 weights — the same records (a NaN step
    # skipped by both) and masters within the atomics noise; each copy is its master rounded.
    runs = []
    for mw in ("off", "on"):
        (tmp_path / mw).mkdir()
        cfg = _cfg(
            tmp_path / mw, compile=True, adamw=adamw, master_weights=mw, cuda_graph=graph,
            max_steps=20, eval_every=0, save_every=0,
        )  # fmt: skip
        trainer = Trainer(cfg)
        assert bool(trainer.masters) == (mw == "on")
        recs, _ = _run_with_device_nan(trainer, tmp_path / mw, nan_at=9)
        assert (trainer.stepper.graph is not None) == graph
        weights = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
        for name, (copy, master) in trainer.masters.items():
            assert copy.dtype == torch.bfloat16 and torch.equal(copy, master.bfloat16()), name
            weights[name] = master.detach().clone()
        runs.append((recs, list(weights.values())))
    _same_run(*runs, skipped_step=10)


@pytest.mark.parametrize("launch", [None, (4096, 8, 1), (2048, 8, 4), (1024, 4, 8)])
def test_triton_adamw_kernel_matches_reference_on_gpu(launch, monkeypatch) -> None:
    # The kernel on CUDA against the torch formula (float64 scalars, fp32 tensors), 5 steps,
    # tensors around the slice and chunk sizes, a clip factor; then a skipped step. ``launch``:
    # (BLOCK, WARPS, SLICES), None for the default.
    from lmforge.kernels import _adamw_triton, adamw_multi_tensor_, adamw_reference_

    if launch is not None:
        for name, value in zip(("BLOCK", "WARPS", "SLICES"), launch):
            monkeypatch.setattr(_adamw_triton, name, value)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4097,), (768, 768), (3,), (50304, 64), (4096,), (10000,)]

    def rand(s, lo=0.0):
        return (
            torch.randn(s, generator=gen, device="cuda").abs() * 0.01 + 1e-4
            if lo
            else (torch.randn(s, generator=gen, device="cuda"))
        )

    a = [
        [rand(s) for s in shapes],
        [rand(s) for s in shapes],
        [rand(s) * 0.1 for s in shapes],
        [rand(s, lo=1) for s in shapes],
        [
            torch.tensor(float(t), dtype=torch.float64, device="cuda")
            for t in (0, 1, 7, 100, 2999, 5)
        ],
    ]
    b = [[x.clone() for x in xs] for xs in a]
    hp = torch.tensor([6e-4, 0.1, 0.9, 0.95, 1e-8], dtype=torch.float64, device="cuda")
    scale = torch.tensor(0.5, device="cuda")
    ok = torch.tensor(True, device="cuda")
    for _ in range(5):
        adamw_multi_tensor_(*a, hp, ok, scale)
        adamw_reference_(*b, hp, ok, scale)
    for xs, ys in zip(a, b):
        for x, y in zip(xs, ys):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-7)
    before = [[x.clone() for x in xs] for xs in a]
    adamw_multi_tensor_(*a, hp, torch.tensor(False, device="cuda"), scale)
    for xs, ys in zip(a, before):
        assert all(torch.equal(x, y) for x, y in zip(xs, ys))
    # No host sync in an update, with or without moved gradients (a sync per step cost 3 ms of
    # a GPT-2-small step once: the trainer's host must run ahead).
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adamw_multi_tensor_(*a, hp, ok, scale)
        a[1] = [g * 0.5 for g in a[1]]
        adamw_multi_tensor_(*a, hp, ok, scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_fast_path_under_a_single_rank_nccl_group_equals_one_process(
    tmp_path: Path, fsdp: bool
) -> None:
    # The distributed strategies keep the fast path (FastPath): under DDP the Triton AdamW,
    # bf16 master weights, the fused loss, the sync-free step with clipping in the update;
    # under FSDP the Triton AdamW and the sync-free step. A single-rank NCCL group runs the real
    # wrappers and collectives; the records and weights equal the plain process's.
    import os

    import torch.distributed as dist

    from lmforge.parallel._testing import free_port

    def final_state(trainer: Trainer) -> dict[str, torch.Tensor]:
        state = {
            k: v.detach().float().clone() for k, v in trainer.strategy.full_state_dict().items()
        }
        for name, (_, master) in trainer.masters.items():
            state[name] = master.detach().clone()
        return state

    (tmp_path / "one").mkdir()
    kw = dict(loss="auto", max_steps=20, eval_every=0, save_every=0, grad_clip=0.5)
    if fsdp:  # what FSDP runs (reference loss, fp32 weights), so both run the same math
        kw.update(loss="reference", master_weights="off")
    one = Trainer(_cfg(tmp_path / "one", **kw))
    recs_one, _ = _run_with_nan_step(one, tmp_path / "one", nan_at=9)
    state_one = final_state(one)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        (tmp_path / "dist").mkdir()
        cfg = _cfg(tmp_path / "dist", **kw)
        from lmforge.parallel.config import ParallelConfig

        cfg = RunConfig(model=cfg.model, train=cfg.train, data=cfg.data,
                        parallel=ParallelConfig(fsdp=fsdp))  # fmt: skip
        d = Trainer(cfg)
        assert type(d.strategy).__name__ == ("FSDPStrategy" if fsdp else "DDPStrategy")
        fp = d.fast
        assert fp.adamw == "triton" and fp.sync_free and d.deferred and not fp.cuda_graph
        assert fp.master_weights == (not fsdp) and (fp.loss == "fused") == (not fsdp)
        assert d.stepper.clip_in_update == (not fsdp)
        recs_d, _ = _run_with_nan_step(d, tmp_path / "dist", nan_at=9)
        state_d = final_state(d)
    finally:
        dist.destroy_process_group()
    assert [r[:2] for r in recs_d] == [r[:2] for r in recs_one]
    assert ("skip", 10) in [r[:2] for r in recs_d]
    np.testing.assert_allclose([r[2] for r in recs_d], [r[2] for r in recs_one], rtol=2e-3)
    for k, v in state_one.items():  # embedding-backward atomics: not bitwise
        off = ((state_d[k] - v).abs() > 2e-3 + 2e-3 * v.abs()).float().mean().item()
        assert off < 1e-3, (k, off)
