"""A trainer's checkpoints: what goes in (weights, optimizer, samplers, RNG, skip statistics), how
a run resumes from them, and what a rerun of a finished run returns.

* :func:`save`: every rank calls it (the gathers are collectives); rank 0 writes the folder
  atomically (:func:`lmforge.train.save_checkpoint`). A full disk stops the run with one line
  naming the folder; the previous checkpoints are untouched.
* :func:`restore_latest`: the newest checkpoint that loads; a corrupt one is reported and the
  next older one tried. The config it was written with must equal this run's, except the loop
  and logging keys (:data:`lmforge.train.state.FREE_KEYS`), unless
  ``train.allow_config_change``.
* :func:`finished_result`: a rerun of a run already at ``max_steps`` appends nothing and returns
  the recorded final metrics.

Exercised by ``pytest tests/test_train_e2e.py tests/test_train_resume.py``.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmforge.checkpoint.io import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_optimizer_state,
    prune_checkpoints,
    read_trainer_state,
    save_checkpoint,
    save_optimizer_state,
)
from lmforge.train.data import MixtureSampler
from lmforge.train.metrics import disk_full_is_one_line, read_metrics
from lmforge.train.state import config_changes, rng_state, set_rng_state
from lmforge.utils.config import config_to_dict
from lmforge.utils.errors import LmforgeError

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer

__all__ = ["finished_result", "latest_checkpoint", "restore_latest", "save"]

OBJECTIVE_FILE = "objective.pt"
"an objective's state_dict in a checkpoint folder (read with torch.load(weights_only=True))"


def _optimizer_is_per_rank(trainer: Trainer) -> bool:
    # Single process, DDP and ZeRO-1 (whose state_dict gathers) have one optimizer state;
    # FSDP, tensor and pipeline parallelism keep a different local state on every rank.
    if trainer.strategy.world_size == 1:
        return False
    return bool(getattr(trainer.strategy, "per_rank_optimizer_state", True))


def _sampler_states(trainer: Trainer) -> dict[str, Any]:
    # Every data-parallel replica has its own data position; all go into the checkpoint.
    if trainer.sampler is None:  # an objective's run: its position is in objective.pt
        return {}
    mine = (trainer.dp_rank, trainer.sampler.state_dict())
    if trainer.strategy.world_size == 1 or not torch.distributed.is_initialized():
        return {str(mine[0]): mine[1]}
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return {str(r): st for r, st in gathered}


def _trainer_state(trainer: Trainer, samplers: dict[str, Any]) -> dict[str, Any]:
    tc, st = trainer.tcfg, trainer.stepper
    return {
        "schedule": {"name": tc.schedule, "lr": trainer.current_lr, "max_steps": tc.max_steps},
        "samplers": samplers,
        "rng": rng_state(),
        "bad_steps": st.bad_steps,
        "loss_ema": st.loss_ema,
        "good_steps": st.good_steps,
    }


def save(trainer: Trainer, val_loss: float | None = None) -> Path:
    """Checkpoint ``trainer`` to ``out_dir/checkpoints/step_…`` and prune old ones.

    With a per-rank optimizer state (FSDP, TP, PP) rank r > 0 writes
    ``optimizer-rank{r}.safetensors`` into a staging folder that rank 0 moves into the
    checkpoint before the atomic rename.
    """
    strategy = trainer.strategy
    state = strategy.full_state_dict()  # a collective in sharded strategies: every rank
    for name, (_, master) in trainer.masters.items():
        state[name] = master  # the fp32 weights, not their bf16 copies
    samplers = _sampler_states(trainer)  # also a collective
    opt_state = trainer.optimizer.state_dict()  # gathered (a collective) under ZeRO-1
    path = checkpoint_path(trainer.out_dir, trainer.iteration)
    per_rank = _optimizer_is_per_rank(trainer)
    staging = path.parent / f".staging-{path.name}"
    kept = "the earlier checkpoints in " + str(path.parent)
    with disk_full_is_one_line(path.parent, kept):
        if not trainer.pretraining and trainer.is_main:
            # The objective's data position, RNG streams and buffers (rollouts, reference
            # log-probs), moved into the checkpoint folder before its atomic rename.
            staging.mkdir(parents=True, exist_ok=True)
            torch.save(trainer.objective.state_dict(), staging / OBJECTIVE_FILE)
        if per_rank:
            if strategy.rank > 0:
                staging.mkdir(parents=True, exist_ok=True)
                name = f"optimizer-rank{strategy.rank:05d}.safetensors"
                save_optimizer_state(staging / name, opt_state)
            strategy.barrier()
        if trainer.is_main:
            save_checkpoint(
                path,
                state,
                opt_state,
                trainer.iteration,
                trainer_state=_trainer_state(trainer, samplers),
                config=trainer.run_config,
                tokenizer_dir=trainer.dcfg.tokenizer or None,
                meta={
                    "val_loss": val_loss,
                    "tokens": trainer.iteration * trainer.plan.tokens_per_step,
                    "optimizer_ranks": strategy.world_size if per_rank else 1,
                },
                extra_dir=staging if staging.is_dir() else None,
            )
            prune_checkpoints(trainer.out_dir, trainer.tcfg.keep_last)
    strategy.barrier()
    return path


def _check_config(trainer: Trainer, ckpt: Path) -> None:
    # The config the checkpoint was written with against this run's: one line naming the keys.
    f = ckpt / "config.toml"
    if not f.is_file():
        return
    try:
        old = tomllib.loads(f.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        raise LmforgeError(f"checkpoint {ckpt}: config.toml is not valid TOML") from None
    from lmforge.utils.config import from_dict

    try:  # the run's own config class: train imports nothing above it (no lmforge.config)
        old_dict = config_to_dict(
            from_dict(type(trainer.run_config), old)
        )  # defaults filled in, as now
    except LmforgeError:
        old_dict = old  # written by another version: compare what it says
    changes = config_changes(old_dict, config_to_dict(trainer.run_config))
    if not changes:
        return
    listed = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
    if not trainer.tcfg.allow_config_change:
        raise LmforgeError(
            f"train.out_dir {trainer.out_dir} holds a run with a different config ({listed}); "
            "resume with --train.allow_config_change=true, or use a new train.out_dir"
        )
    if trainer.is_main:
        print(f"lmforge train: resuming under a changed config: {listed}", file=sys.stderr)


def _restore(trainer: Trainer, ckpt: Path) -> None:
    meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    saved_ranks = int(meta.get("optimizer_ranks", 1))
    per_rank = _optimizer_is_per_rank(trainer)
    want = trainer.strategy.world_size if per_rank else 1
    if saved_ranks != want:
        raise LmforgeError(
            f"checkpoint {ckpt} holds {saved_ranks} optimizer state(s) but this parallel "
            f"layout needs {want}; resume with the layout that wrote it"
        )
    rank = trainer.strategy.rank
    own = per_rank and rank > 0

    def load_model(state: dict[str, torch.Tensor]) -> None:
        # The checkpoint's fp32 weights go to the masters as they are, and rounded to the copies.
        trainer.strategy.load_full_state_dict(state)
        with torch.no_grad():
            for name, (copy, master) in trainer.masters.items():
                master.copy_(state[name])
                copy.copy_(master)

    it = load_checkpoint(ckpt, None, None if own else trainer.optimizer, load_model=load_model)
    if own:
        load_optimizer_state(ckpt / f"optimizer-rank{rank:05d}.safetensors", trainer.optimizer)
    state = read_trainer_state(ckpt)
    samplers = state.get("samplers", {})
    if not trainer.pretraining:
        f = ckpt / OBJECTIVE_FILE
        if not f.is_file():
            raise LmforgeError(f"checkpoint file missing: {f}")
        trainer.objective.load_state_dict(torch.load(f, weights_only=True))
    elif str(trainer.dp_rank) in samplers:
        trainer.sampler.load_state_dict(samplers[str(trainer.dp_rank)])
    else:
        # A replica the checkpoint did not have (more data-parallel ranks than before):
        # a fresh stream, seeded by rank and step, so replicas still differ.
        trainer.sampler = MixtureSampler(
            trainer.sampler_sources,
            trainer.T,
            trainer.dcfg.weights,
            seed=trainer.tcfg.seed + 1_000_003 * trainer.dp_rank + it,
            vocab_size=trainer.mcfg.vocab_size,
        )
        trainer.objective.sampler = trainer.sampler
    set_rng_state(state["rng"])
    trainer.stepper.restore(
        state.get("loss_ema"), int(state.get("good_steps", 0)), int(state.get("bad_steps", 0))
    )
    trainer.iteration = it
    trainer.resumed_from = ckpt


def restore_latest(trainer: Trainer) -> None:
    """Resume ``trainer`` from the newest intact checkpoint of its out_dir, if there is one."""
    ckpts = list_checkpoints(trainer.out_dir)
    if not ckpts:
        if trainer.is_main:  # said, so a rerun after an early kill never restarts silently
            print(f"lmforge train: no checkpoint in {trainer.out_dir}: starting from step 0",
                  file=sys.stderr)  # fmt: skip
        return
    if not trainer.tcfg.resume:
        raise LmforgeError(
            f"train.out_dir {trainer.out_dir} already holds checkpoints (latest {ckpts[-1].name}); "
            "use a new train.out_dir or train.resume=true"
        )
    _check_config(trainer, ckpts[-1])
    for i, ckpt in enumerate(reversed(ckpts)):
        try:
            _restore(trainer, ckpt)
        except (LmforgeError, OSError, KeyError, ValueError, json.JSONDecodeError) as e:
            older = ckpts[-2 - i] if i + 1 < len(ckpts) else None
            if older is None:
                raise LmforgeError(
                    f"no intact checkpoint in {trainer.out_dir}: {ckpt.name} is corrupt ({e})"
                ) from None
            if trainer.is_main:
                print(
                    f"lmforge train: checkpoint {ckpt} is corrupt ({e}); trying {older.name}",
                    file=sys.stderr,
                )
            continue
        if i and trainer.is_main:
            print(f"lmforge train: resumed from {ckpt} (newer ones were corrupt)", file=sys.stderr)
        return


def finished_result(trainer: Trainer) -> dict[str, Any]:
    """The result of a run already at ``max_steps``: its recorded final metrics, nothing new
    appended (no evaluation, no checkpoint, no NaN train loss)."""
    records = read_metrics(trainer.out_dir / "metrics.jsonl")
    finals = [
        r for r in records if r.get("event") == "final" and r.get("step") == trainer.iteration
    ]
    if trainer.is_main:
        print(
            f"lmforge train: {trainer.out_dir} already finished at step {trainer.iteration} "
            f"(train.max_steps={trainer.tcfg.max_steps}); nothing to do",
            file=sys.stderr,
        )
    if finals:
        out = {k: v for k, v in finals[-1].items() if k not in ("event", "step")}
        out["stopped"] = "already_finished"
        return out
    trains = [r for r in records if r.get("event") == "train"]
    return {
        "iteration": trainer.iteration,
        "stopped": "already_finished",
        "train_loss": trains[-1]["loss"] if trains else None,
        "checkpoint": str(trainer.resumed_from),
    }
