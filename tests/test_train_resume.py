"""A training out_dir under faults and reruns (issue 21 items 7, 8, 9, 13 for train).

The lock, the config check on resume, one-line config validation, a full disk, an empty
validation shard, a rerun of a finished run and a corrupt latest checkpoint; plus the trainer's
extension points (callbacks, aux_loss, build_optimizer).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.checkpoint import list_checkpoints
from lmforge.config import RunConfig, load_run_config
from lmforge.model import load_preset
from lmforge.train import DataConfig, TrainConfig, Trainer, build_optimizer
from lmforge.train.data import write_shard
from lmforge.train.metrics import read_metrics
from lmforge.train.state import OutDirLock, config_changes
from lmforge.utils.errors import LmforgeError

REPO = Path(__file__).resolve().parents[1]


def _cfg(tmp: Path, val_tokens: int = 0, **train: object) -> RunConfig:
    shard = write_shard(tmp / "t.bin", np.arange(4000) % 97, 512)
    val = (str(write_shard(tmp / "v.bin", np.arange(val_tokens) % 97, 512)),) if val_tokens else ()
    base = dict(out_dir=str(tmp / "run"), device="cpu", precision="fp32", batch_size=2,
                context_length=16, max_steps=4, eval_every=0, save_every=2, plot=False,
                progress=False)  # fmt: skip
    base.update(train)
    return RunConfig(
        model=load_preset("tiny"),
        train=TrainConfig(**base),
        data=DataConfig(train=(str(shard),), val=val),
    )


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.lr=-1e-3", "train.lr must be positive"),
        ("train.beta1=1.5", r"train.beta1 must lie in \[0, 1\)"),
        ("train.beta2=-0.1", r"train.beta2 must lie in \[0, 1\)"),
        ("train.eps=-1", "train.eps must be positive"),
        ("train.weight_decay=-0.1", "train.weight_decay must be 0 or more"),
        ("train.context_length=-3", "train.context_length must be 0"),
        ("train.min_lr=1.0", r"train.min_lr \(1.0\) must not exceed train.lr"),
        ("train.warmup_steps=-1", "train.warmup_steps must be 0 or more"),
    ],
)
def test_invalid_optimizer_values_are_one_line_at_load(override: str, message: str) -> None:
    with pytest.raises(LmforgeError, match=message):
        load_run_config(None, [override])


def test_cli_prints_one_line_for_an_invalid_value() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lmforge", "train", "--train.lr=-1e-3"],
        capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO / "src")},
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "train.lr must be positive" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_out_dir_lock_refuses_a_second_holder(tmp_path: Path) -> None:
    a = OutDirLock(tmp_path)
    a.acquire()
    try:
        with pytest.raises(LmforgeError, match=r"is in use by another run \(pid \d+\)"):
            OutDirLock(tmp_path).acquire()
    finally:
        a.release()
    b = OutDirLock(tmp_path)  # released: free again
    b.acquire()
    b.release()


def test_a_run_into_a_locked_out_dir_stops_with_one_line(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    holder = OutDirLock(cfg.train.out_dir)
    holder.acquire()
    try:
        with pytest.raises(LmforgeError, match="is in use by another run"):
            Trainer(cfg).run()
    finally:
        holder.release()
    assert Trainer(cfg).run()["iteration"] == 4


def test_config_changes_name_the_keys() -> None:
    old = {"train": {"lr": 1e-3, "max_steps": 10}, "model": {"d_model": 64}}
    new = {"train": {"lr": 2e-3, "max_steps": 20}, "model": {"d_model": 64}}
    assert config_changes(old, new) == ["train.lr: 0.001 -> 0.002"]  # max_steps may change
    assert config_changes(old, old) == []


def test_resume_with_a_changed_config_needs_the_flag(tmp_path: Path) -> None:
    Trainer(_cfg(tmp_path, max_steps=2)).run()
    changed = _cfg(tmp_path, max_steps=4, lr=1e-3)
    with pytest.raises(LmforgeError, match=r"different config \(train\.lr: 0\.0003 -> 0\.001\)"):
        Trainer(changed)
    t = Trainer(_cfg(tmp_path, max_steps=4, lr=1e-3, allow_config_change=True))
    assert t.iteration == 2 and t.run()["iteration"] == 4
    # Only a longer run (max_steps is a free key): resumes without the flag.
    assert Trainer(_cfg(tmp_path, max_steps=6, lr=1e-3, allow_config_change=True)).iteration == 4


def test_rerun_of_a_finished_run_appends_nothing(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, val_tokens=400)
    first = Trainer(cfg).run()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    again = Trainer(cfg).run()
    assert (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() == lines
    assert again["stopped"] == "already_finished"
    assert again["train_loss"] == first["train_loss"] and np.isfinite(again["train_loss"])
    assert again["val_loss"] == first["val_loss"]


def test_empty_validation_shard_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LmforgeError, match=r"validation shard .*v\.bin holds 5 tokens"):
        Trainer(_cfg(tmp_path, val_tokens=5))


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tmp_path: Path, capsys) -> None:
    Trainer(_cfg(tmp_path, max_steps=4, save_every=2, keep_last=3)).run()
    ckpts = list_checkpoints(tmp_path / "run")
    assert [c.name for c in ckpts] == ["step_0000002", "step_0000004"]
    (ckpts[-1] / "model.safetensors").write_bytes(b"not a safetensors file")
    t = Trainer(_cfg(tmp_path, max_steps=4, save_every=2, keep_last=3))
    assert t.iteration == 2 and t.resumed_from == ckpts[0]
    err = capsys.readouterr().err
    assert "step_0000004 is corrupt" in err and "resumed from" in err
    assert t.run()["iteration"] == 4


def test_disk_full_during_a_checkpoint_is_one_line(tmp_path: Path, monkeypatch) -> None:
    import lmforge.train.resume as resume

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(resume, "save_checkpoint", full)
    with pytest.raises(LmforgeError, match=r"no space left on the device holding .*checkpoints"):
        Trainer(_cfg(tmp_path, max_steps=2, save_every=0)).run()


def test_disk_full_while_logging_is_one_line(tmp_path: Path) -> None:
    from lmforge.train.metrics import MetricsLogger

    log = MetricsLogger(tmp_path, False, "", {})

    class Full:
        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    log.file = Full()  # type: ignore[assignment]
    with pytest.raises(LmforgeError, match=r"kept: metrics\.jsonl up to the previous line"):
        log.log({"event": "train", "step": 1})


def test_callbacks_see_each_step_and_their_keys_are_logged(tmp_path: Path) -> None:
    seen = []

    def cb(trainer, step, metrics):
        seen.append(step)
        metrics["double_loss"] = 2 * metrics["loss"]

    t = Trainer(_cfg(tmp_path, max_steps=4, log_every=2), callbacks=[cb])
    t.deferred = True  # callbacks still see every step at once
    t.run()
    assert seen == [1, 2, 3, 4]
    recs = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["event"] == "train"]
    assert [r["step"] for r in recs] == [2, 4]
    assert all(r["double_loss"] == pytest.approx(2 * r["loss"]) for r in recs)


def test_aux_losses_of_modules_join_the_loss(tmp_path: Path) -> None:
    t = Trainer(_cfg(tmp_path))
    x, y = t.sampler.next_batch(2, "cpu")
    base = t.loss_fn(t.model, x, y)
    t.model.layers[0].aux_loss = lambda: torch.tensor(0.25)
    t._aux_modules = [t.model.layers[0]]
    assert float(t.loss_fn(t.model, x, y).detach()) == pytest.approx(float(base.detach()) + 0.25)


def test_build_optimizer_groups_and_hyperparameters(tmp_path: Path) -> None:
    from lmforge.model import TransformerLM

    model = TransformerLM(load_preset("tiny"))
    cfg = dataclasses.replace(TrainConfig(), lr=1e-3, weight_decay=0.2, beta1=0.8)
    opt = build_optimizer(model, cfg)
    decay, other = opt.param_groups
    assert decay["weight_decay"] == 0.2 and other["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in other["params"])
    assert decay["lr"] == 1e-3 and decay["betas"] == (0.8, cfg.beta2)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


# ---------------------------------------------------------------------------------------------
# Nothing a user does is lost (issue 39 item 4): signals, wall-clock checkpoints, reruns


def _job(tmp: Path, script: str) -> subprocess.CompletedProcess:
    # a training job in its own process, built by this file's _cfg (one thread, as conftest)
    code = (
        f"import sys, os, signal; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import torch; torch.set_num_threads(1)\n"
        "from pathlib import Path\n"
        "from test_train_resume import _cfg\n"
        "from lmforge.train import Trainer\n"
    ) + script
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True,
                          text=True)  # fmt: skip


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_saves_a_checkpoint_and_stops(tmp_path: Path, sig: str) -> None:
    # Before: SIGTERM exited without a checkpoint (up to save_every - 1 steps lost).
    done = _job(
        tmp_path,
        f"""
def cb(trainer, step, metrics):
    if step == 3:
        os.kill(os.getpid(), signal.{sig})
cfg = _cfg(Path({str(tmp_path)!r}), max_steps=50, save_every=0, save_every_minutes=0.0)
print(Trainer(cfg, callbacks=[cb]).run()["stopped"])
""",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == sig
    assert f"{sig} at step 3: saving a checkpoint" in done.stderr
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_0000003"]


def test_checkpoints_by_wall_clock_as_well_as_steps(tmp_path: Path) -> None:
    # Before: only every save_every steps (the demo had none until its end).
    cfg = _cfg(tmp_path, max_steps=4, save_every=0, save_every_minutes=1e-9, keep_last=10)
    Trainer(cfg).run()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == [
        f"step_{s:07d}" for s in (1, 2, 3, 4)
    ]
    assert TrainConfig().save_every_minutes > 0  # on by default
    with pytest.raises(LmforgeError, match="save_every_minutes must be 0 or more"):
        load_run_config(None, ["train.save_every_minutes=-1"])


def test_a_start_without_checkpoint_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    Trainer(_cfg(tmp_path))
    assert f"no checkpoint in {tmp_path / 'run'}: starting from step 0" in capsys.readouterr().err


def test_a_new_attempt_appends_to_metrics(tmp_path: Path) -> None:
    # Before: a rerun after kill -9 before the first checkpoint truncated metrics.jsonl.
    job = f"""
def cb(trainer, step, metrics):
    if step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
cfg = _cfg(Path({str(tmp_path)!r}), max_steps=4, save_every=0, save_every_minutes=0.0,
           log_every=1)
Trainer(cfg, callbacks=[cb] if len(sys.argv) < 2 else []).run()
"""
    first = _job(tmp_path, job)
    assert first.returncode == -9 and not list_checkpoints(tmp_path / "run")
    path = tmp_path / "run" / "metrics.jsonl"
    before = path.read_text().splitlines()
    assert any('"step": 2' in line for line in before)
    second = _job(tmp_path, job.replace("len(sys.argv) < 2", "False"))
    assert second.returncode == 0, second.stderr[-2000:]
    assert "no checkpoint in" in second.stderr
    after = path.read_text().splitlines()
    assert after[: len(before)] == before  # appended, never truncated
    events = [r["event"] for r in read_metrics(path, all_attempts=True)]
    assert events.count("attempt") == 2
    view = [r["step"] for r in read_metrics(path) if r["event"] == "train"]
    assert view == [1, 2, 3, 4]  # one run's curve: the second attempt's
