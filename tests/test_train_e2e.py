"""The trainer end to end: CLI run, bad-step skipping, and kill-and-resume with an identical curve."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.checkpoint import list_checkpoints
from lmforge.config import RunConfig, load_run_config
from lmforge.model import load_preset
from lmforge.train import (
    DataConfig,
    TrainConfig,
    Trainer,
    latest_checkpoint,
    load_checkpoint,
    train,
)
from lmforge.train.data import write_shard
from lmforge.train.trainer import read_metrics
from lmforge.utils.errors import LmforgeError

REPO = Path(__file__).resolve().parents[1]


def _make_shards(folder: Path) -> tuple[Path, Path]:
    # A learnable stream: a repeating 50-token cycle with 10% random tokens.
    rng = np.random.default_rng(0)
    base = np.tile(np.arange(50), 1200)
    toks = np.where(rng.random(base.size) < 0.1, rng.integers(0, 512, base.size), base)
    train = write_shard(folder / "train.bin", toks[:50000], 512, num_bytes=150000)
    val = write_shard(folder / "val.bin", toks[50000:], 512, num_bytes=30000)
    return train, val


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _make_shards(tmp_path_factory.mktemp("shards"))


def _overrides(out_dir: Path, shards: tuple[Path, Path]) -> list[str]:
    return [
        f'data.train=["{shards[0]}"]',
        f'data.val=["{shards[1]}"]',
        f"train.out_dir={out_dir}",
        "train.device=cpu",
        "train.precision=fp32",
        "train.batch_size=4",
        "train.context_length=32",
        "train.lr=3e-3",
        "train.warmup_steps=5",
        f"train.max_steps={_STEPS}",
        "train.log_every=1",
        "train.eval_every=20",
        "train.eval_batches=4",
        "train.save_every=10",
        "train.keep_last=2",
        "train.progress=false",
    ]


_STEPS = 60
_TINY = REPO / "configs" / "tiny.toml"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # one intra-op thread, as in-process (see _one_thread)
    return env


@pytest.fixture(scope="module")
def killed_run(
    shards: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str]:
    """`lmforge train` killed with SIGKILL after 25+ steps, then the same command again."""
    out = tmp_path_factory.mktemp("killed")
    cmd = [sys.executable, "-m", "lmforge", "train", "--config", str(_TINY)]
    cmd += ["--" + o for o in _overrides(out, shards)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    killed_at = 0
    while time.monotonic() < deadline and proc.poll() is None:
        steps = [
            r["step"] for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "train"
        ]
        if steps and steps[-1] >= 25:
            proc.send_signal(signal.SIGKILL)
            killed_at = steps[-1]
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert 25 <= killed_at < _STEPS
    resumed = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out, resumed.stderr


@pytest.fixture(scope="module")
def reference_run(shards: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run uninterrupted, through the Python API (``lmforge.train.train``)."""
    out = tmp_path_factory.mktemp("full")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = train(load_run_config(_TINY, _overrides(out, shards)))
    finally:
        torch.set_num_threads(n)
    assert result["iteration"] == _STEPS
    return out


def _curve(out: Path) -> list[tuple]:
    return [
        (r["step"], r["loss"], r["lr"], r["grad_norm"])
        for r in read_metrics(out / "metrics.jsonl")
        if r.get("event") == "train"
    ]


def test_cli_end_to_end(killed_run: tuple[Path, str]) -> None:
    out, stderr = killed_run
    assert "resumed from" in stderr and "tokens/step" in stderr
    for name in ("config.toml", "metrics.jsonl", "loss_curve.png"):
        assert (out / name).is_file(), name
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curve = _curve(out)
    assert [s for s, *_ in curve] == list(range(1, _STEPS + 1))
    first, last = np.mean([c[1] for c in curve[:5]]), np.mean([c[1] for c in curve[-5:]])
    assert last < first - 1.0, (first, last)  # it learns the cycle
    records = read_metrics(out / "metrics.jsonl")
    final = next(r for r in records if r.get("event") == "final")
    assert final["iteration"] == _STEPS and np.isfinite(final["val_loss"]) and final["val_bpb"] > 0
    assert [p.name for p in list_checkpoints(out)] == ["step_0000050", "step_0000060"]
    ckpt = latest_checkpoint(out)
    assert {p.name for p in ckpt.iterdir()} >= {
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
        "config.toml",
        "meta.json",
    }
    assert json.loads((ckpt / "meta.json").read_text())["val_loss"] == final["val_loss"]


def test_kill_and_resume_gives_identical_curve(
    killed_run: tuple[Path, str], reference_run: Path
) -> None:
    out, _ = killed_run
    assert _curve(out) == _curve(reference_run)
    evals = [
        [
            (r["step"], r["val_loss"])
            for r in read_metrics(o / "metrics.jsonl")
            if r.get("event") == "eval"
        ]
        for o in (out, reference_run)
    ]
    assert [s for s, _ in evals[0]] == [20, 40, 60]
    assert evals[0] == evals[1]


def _cfg(shards: tuple[Path, Path], out: Path, **train: object) -> RunConfig:
    base = dict(
        out_dir=str(out),
        device="cpu",
        precision="fp32",
        batch_size=2,
        context_length=16,
        max_steps=12,
        warmup_steps=2,
        log_every=1,
        eval_every=0,
        eval_batches=1,
        save_every=5,
        progress=False,
        plot=False,
    )
    base.update(train)
    return RunConfig(
        model=load_preset("tiny"),
        train=TrainConfig(**base),
        data=DataConfig(train=(str(shards[0]),), val=(str(shards[1]),)),
    )


def _poison(trainer: Trainer, bad_steps: set[int]) -> None:
    real = trainer.loss_fn

    def loss_fn(model, x, y):  # type: ignore[no-untyped-def]
        loss = real(model, x, y)
        return loss * float("nan") if trainer.iteration in bad_steps else loss

    trainer.loss_fn = loss_fn  # type: ignore[method-assign]


def test_nan_step_is_skipped(shards: tuple[Path, Path], tmp_path: Path) -> None:
    trainer = Trainer(_cfg(shards, tmp_path / "run", max_bad_steps=3))
    _poison(trainer, {3, 4})
    result = trainer.run()
    assert result["iteration"] == 12
    skips = [
        r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "skip"
    ]
    assert [r["step"] for r in skips] == [4, 5] and "non-finite" in skips[0]["reason"]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_sync_free_steps_equal_synchronous_steps(shards: tuple[Path, Path], tmp_path: Path) -> None:
    # The device-gated, one-step-late loop (the default on one process) against the synchronous
    # host-decided loop: same logged records (skips, spike statistics, losses) and the same
    # final weights, with a NaN step and a loss spike along the way.
    runs = []
    for name, deferred in (("sync", False), ("deferred", True)):
        trainer = Trainer(_cfg(shards, tmp_path / name, max_steps=16, spike_factor=2.0))
        trainer.deferred = deferred  # the default on CUDA; forced here on the CPU
        real = trainer.loss_fn

        def faulty(model, x, y, trainer=trainer, real=real):  # type: ignore[no-untyped-def]
            loss = real(model, x, y)
            if trainer.iteration == 4:
                return loss * float("nan")
            return loss * 100.0 if trainer.iteration == 13 else loss

        trainer.loss_fn = faulty  # type: ignore[method-assign]
        trainer.run()
        recs = [
            {k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "elapsed_s")}
            for r in read_metrics(tmp_path / name / "metrics.jsonl")
            if r.get("event") in ("train", "skip")
        ]
        runs.append((recs, [p.detach().clone() for p in trainer.model.parameters()], trainer))
    (recs_a, params_a, a), (recs_b, params_b, b) = runs
    assert [r["step"] for r in recs_b if r["event"] == "skip"] == [5, 14]
    assert len(recs_a) == len(recs_b)
    for ra, rb in zip(recs_a, recs_b):
        assert ra.keys() == rb.keys() and ra["step"] == rb["step"]
        for k in ("loss", "grad_norm", "lr"):
            if k in ra:
                assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-7, nan_ok=True), (k, ra, rb)
    for pa, pb in zip(params_a, params_b):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)
    assert (a.stepper.good_steps, a.stepper.bad_steps) == (
        b.stepper.good_steps,
        b.stepper.bad_steps,
    )
    assert a.stepper.loss_ema == pytest.approx(b.stepper.loss_ema, rel=1e-6)


def test_bad_steps_in_a_row_stop_the_run(shards: tuple[Path, Path], tmp_path: Path) -> None:
    trainer = Trainer(_cfg(shards, tmp_path / "run", max_bad_steps=3))
    _poison(trainer, set(range(6, 100)))
    with pytest.raises(LmforgeError, match="after 3 consecutive bad steps") as info:
        trainer.run()
    assert "step_0000005" in str(info.value)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_0000005"]
    fresh = Trainer(_cfg(shards, tmp_path / "other"))
    assert load_checkpoint(latest_checkpoint(tmp_path / "run"), fresh.model, fresh.optimizer) == 5
    assert all(torch.isfinite(p).all() for p in fresh.model.parameters())


def test_loss_spike_is_skipped(shards: tuple[Path, Path], tmp_path: Path) -> None:
    trainer = Trainer(_cfg(shards, tmp_path / "run", max_steps=16, spike_factor=2.0))
    real = trainer.loss_fn

    def spiky(model, x, y):  # type: ignore[no-untyped-def]
        loss = real(model, x, y)
        return loss * 100.0 if trainer.iteration == 13 else loss

    trainer.loss_fn = spiky  # type: ignore[method-assign]
    trainer.run()
    skips = [
        r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "skip"
    ]
    assert [r["step"] for r in skips] == [14] and "spike" in skips[0]["reason"]


def test_user_errors_are_one_line(shards: tuple[Path, Path], tmp_path: Path) -> None:
    cfg = _cfg(shards, tmp_path / "run")
    with pytest.raises(LmforgeError, match=r"data\.train is empty"):
        Trainer(RunConfig(model=cfg.model, train=cfg.train, data=DataConfig()))
    with pytest.raises(LmforgeError, match=r"exceeds model\.context_length"):
        Trainer(_cfg(shards, tmp_path / "run", context_length=1000))


@pytest.mark.dist_slow
def test_ddp_and_zero1_resume_equal_uninterrupted_ddp(
    shards: tuple[Path, Path], tmp_path: Path
) -> None:
    """2-process gloo: DDP 30 steps == ZeRO-1 20 steps + resume to 30 (every replica's data
    position is checkpointed; the ZeRO-1 optimizer state is gathered into the checkpoint);
    FSDP 20 + resume to 30 follows the same curve."""

    def run(out: Path, steps: int, *extra: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        cmd += ["-m", "lmforge", "train", "--config", str(_TINY)]
        cmd += ["--" + o for o in _overrides(out, shards)]
        cmd += [f"--train.max_steps={steps}", "--train.schedule=constant", "--train.eval_every=0"]
        cmd += ["--parallel.dp=2", *extra]
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run(tmp_path / "ddp", 30)
    run(tmp_path / "zero1", 20, "--parallel.zero1=true")
    run(tmp_path / "zero1", 30, "--parallel.zero1=true")
    assert _curve(tmp_path / "zero1") == _curve(tmp_path / "ddp")
    # FSDP keeps a different optimizer shard per rank: one file per rank in the checkpoint.
    run(tmp_path / "fsdp", 20, "--parallel.fsdp=true")
    assert (latest_checkpoint(tmp_path / "fsdp") / "optimizer-rank00001.safetensors").is_file()
    run(tmp_path / "fsdp", 30, "--parallel.fsdp=true")
    ddp, fsdp = _curve(tmp_path / "ddp"), _curve(tmp_path / "fsdp")
    assert [c[0] for c in fsdp] == [c[0] for c in ddp]
    # reduce-scatter sums in another order than all-reduce: equal to float rounding only
    np.testing.assert_allclose([c[1] for c in fsdp], [c[1] for c in ddp], rtol=0, atol=1e-5)


def test_real_text_bits_per_byte(shared_data: Path, tmp_path: Path) -> None:
    """Tiny Shakespeare as byte tokens (1 byte per token): bits per byte = loss / ln 2."""
    text = (shared_data / "text" / "tinyshakespeare" / "input.txt").read_bytes()
    ids = np.frombuffer(text, dtype=np.uint8)
    split = int(0.9 * ids.size)
    tr = write_shard(tmp_path / "train.bin", ids[:split], 256, num_bytes=split)
    va = write_shard(tmp_path / "val.bin", ids[split:], 256, num_bytes=ids.size - split)
    cfg = _cfg((tr, va), tmp_path / "run", max_steps=40, batch_size=8, context_length=32, lr=3e-3)
    result = Trainer(cfg).run()
    assert result["val_loss"] < np.log(256)  # better than uniform over bytes
    assert result["val_bpb"] == pytest.approx(result["val_loss"] / np.log(2))


def test_cuda_graph_option_is_ignored_off_cuda(shards: tuple[Path, Path], tmp_path: Path) -> None:
    # train.cuda_graph only applies to one CUDA process; on the CPU the run is the plain one.
    a = Trainer(_cfg(shards, tmp_path / "a", max_steps=4, cuda_graph=True))
    b = Trainer(_cfg(shards, tmp_path / "b", max_steps=4))
    ra, rb = a.run(), b.run()
    assert a.stepper.graph is None and ra["train_loss"] == rb["train_loss"]


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.toml")))
def test_shipped_run_configs_load(name: str) -> None:
    # Every run config in configs/ parses and validates (keys, types, allowed values).
    from lmforge.config import load_run_config

    cfg = load_run_config(REPO / "configs" / name)
    assert cfg.model.d_model > 0 and cfg.train.batch_size > 0
