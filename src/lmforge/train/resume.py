"""A trainer's checkpoints: what goes in (weights, optimizer, samplers, RNG, skip statistics), how
a run resumes from them, and what a rerun of a finished run returns.

* :func:`save`: every rank calls it (the gathers are collectives); rank 0 writes the folder
  atomically. A full disk stops the run with one line; the previous checkpoints are untouched.
* :func:`restore_latest`: the newest checkpoint that loads (a corrupt one is reported and the
  next older one tried), written under this run's config up to
  :data:`lmforge.train.state.FREE_KEYS`, unless ``train.allow_config_change``.

They take the parts of a run they read or write, never the Trainer: the Trainer gathers its
state (:func:`trainer_state`) and applies what a checkpoint gives back (``apply``).
Exercised by ``pytest tests/test_train_e2e.py tests/test_train_resume.py``.
"""

from __future__ import annotations

import json
import sys
import tomllib
from collections.abc import Callable
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
from lmforge.train.metrics import disk_full_is_one_line, read_metrics
from lmforge.train.state import config_changes, rng_state
from lmforge.utils.config import config_to_dict, from_dict
from lmforge.utils.errors import LmforgeError

if TYPE_CHECKING:
    from lmforge.parallel import Strategy

__all__ = ["finished_result", "latest_checkpoint", "restore_latest", "save", "trainer_state"]

OBJECTIVE_FILE = "objective.pt"
"an objective's state_dict in a checkpoint folder (read with torch.load(weights_only=True))"


def _optimizer_is_per_rank(strategy: Strategy) -> bool:
    # one optimizer state (single, DDP, ZeRO-1 gathers) or one per rank (FSDP, TP, PP)
    if strategy.world_size == 1:
        return False
    return bool(getattr(strategy, "per_rank_optimizer_state", True))


def trainer_state(strategy: Strategy, dp_rank: int, sampler: Any, schedule: dict[str, Any],
                  stepper: Any) -> dict[str, Any]:  # fmt: skip
    """The loop's state a checkpoint holds: ``schedule``, every data-parallel replica's
    ``sampler`` position (a collective; none for an objective), RNG states, skip statistics."""
    samplers: dict[str, Any] = {}
    if sampler is not None:
        mine = (dp_rank, sampler.state_dict())
        if strategy.world_size == 1 or not torch.distributed.is_initialized():
            samplers = {str(mine[0]): mine[1]}
        else:
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, mine)
            samplers = {str(r): st for r, st in gathered}
    return {"schedule": schedule, "samplers": samplers, "rng": rng_state(),
            "bad_steps": stepper.bad_steps, "loss_ema": stepper.loss_ema,
            "good_steps": stepper.good_steps}  # fmt: skip


def save(strategy: Strategy, optimizer: torch.optim.Optimizer, masters: dict[str, Any],
         out_dir: Path, step: int, *, state: dict[str, Any], objective_state: dict | None,
         run_config: Any, tokenizer_dir: str | None, tokens: int, keep_last: int,
         is_main: bool, val_loss: float | None = None) -> Path:  # fmt: skip
    """Checkpoint step ``step`` to ``out_dir/checkpoints/step_…`` and prune old ones.
    ``objective_state`` (None when pretraining) is saved as ``objective.pt``. With a per-rank
    optimizer state (FSDP, TP, PP) rank r > 0 stages ``optimizer-rank{r}.safetensors`` for
    rank 0 to move into the checkpoint before the atomic rename."""
    weights = strategy.full_state_dict()  # a collective in sharded strategies: every rank
    for name, (_, master) in masters.items():
        weights[name] = master  # the fp32 weights, not their bf16 copies
    opt_state = optimizer.state_dict()  # gathered (a collective) under ZeRO-1
    path = checkpoint_path(out_dir, step)
    per_rank = _optimizer_is_per_rank(strategy)
    staging = path.parent / f".staging-{path.name}"
    kept = "the earlier checkpoints in " + str(path.parent)
    with disk_full_is_one_line(path.parent, kept):
        if objective_state is not None and is_main:
            # data position, RNG streams, buffers; moved in before the atomic rename
            staging.mkdir(parents=True, exist_ok=True)
            torch.save(objective_state, staging / OBJECTIVE_FILE)
        if per_rank:
            if strategy.rank > 0:
                staging.mkdir(parents=True, exist_ok=True)
                name = f"optimizer-rank{strategy.rank:05d}.safetensors"
                save_optimizer_state(staging / name, opt_state)
            strategy.barrier()
        if is_main:
            meta = {"val_loss": val_loss, "tokens": tokens,
                    "optimizer_ranks": strategy.world_size if per_rank else 1}  # fmt: skip
            save_checkpoint(path, weights, opt_state, step, trainer_state=state,
                            config=run_config, tokenizer_dir=tokenizer_dir, meta=meta,
                            extra_dir=staging if staging.is_dir() else None)  # fmt: skip
            prune_checkpoints(out_dir, keep_last)
    strategy.barrier()
    return path


def _check_config(run_config: Any, out_dir: Path, ckpt: Path, allow_change: bool,
                  is_main: bool) -> None:  # fmt: skip
    # The config the checkpoint was written with against this run's: one line naming the keys.
    f = ckpt / "config.toml"
    if not f.is_file():
        return
    try:
        old = tomllib.loads(f.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        raise LmforgeError(f"checkpoint {ckpt}: config.toml is not valid TOML") from None
    try:  # the run's own config class: train imports nothing above it (no lmforge.config)
        old_dict = config_to_dict(from_dict(type(run_config), old))  # defaults filled in, as now
    except LmforgeError:
        old_dict = old  # written by another version: compare what it says
    changes = config_changes(old_dict, config_to_dict(run_config))
    if not changes:
        return
    listed = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
    if not allow_change:
        raise LmforgeError(
            f"train.out_dir {out_dir} holds a run with a different config ({listed}); "
            "resume with --train.allow_config_change=true, or use a new train.out_dir"
        )
    if is_main:
        print(f"lmforge train: resuming under a changed config: {listed}", file=sys.stderr)


Apply = Callable[[int, dict[str, Any], "dict | None"], None]
"""``apply(step, trainer_state, objective_state)``: the Trainer takes back what a checkpoint
holds besides weights and optimizer (``objective_state`` None when it has no objective.pt)."""


def _restore(strategy: Strategy, optimizer: torch.optim.Optimizer, masters: dict[str, Any],
             ckpt: Path, apply: Apply) -> None:  # fmt: skip
    meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    saved_ranks = int(meta.get("optimizer_ranks", 1))
    per_rank = _optimizer_is_per_rank(strategy)
    want = strategy.world_size if per_rank else 1
    if saved_ranks != want:
        raise LmforgeError(
            f"checkpoint {ckpt} holds {saved_ranks} optimizer state(s) but this parallel "
            f"layout needs {want}; resume with the layout that wrote it"
        )
    own = per_rank and strategy.rank > 0

    def load_model(state: dict[str, torch.Tensor]) -> None:
        # The checkpoint's fp32 weights go to the masters as they are, and rounded to the copies.
        strategy.load_full_state_dict(state)
        with torch.no_grad():
            for name, (copy, master) in masters.items():
                master.copy_(state[name])
                copy.copy_(master)

    it = load_checkpoint(ckpt, None, None if own else optimizer, load_model=load_model)
    if own:
        load_optimizer_state(ckpt / f"optimizer-rank{strategy.rank:05d}.safetensors", optimizer)
    f = ckpt / OBJECTIVE_FILE
    apply(it, read_trainer_state(ckpt),
          torch.load(f, weights_only=True) if f.is_file() else None)  # fmt: skip


def restore_latest(strategy: Strategy, optimizer: torch.optim.Optimizer,
                   masters: dict[str, Any], out_dir: Path, run_config: Any, apply: Apply, *,
                   is_main: bool) -> Path | None:  # fmt: skip
    """Resume from the newest intact checkpoint of ``out_dir``, if there is one: the weights
    into ``strategy`` (and ``masters``), the optimizer state, and ``apply(step, trainer state,
    objective state)`` for the rest; returns the checkpoint's folder (None: no checkpoint)."""
    tc = run_config.train
    ckpts = list_checkpoints(out_dir)
    if not ckpts:
        if is_main:  # said, so a rerun after an early kill never restarts silently
            print(f"lmforge train: no checkpoint in {out_dir}: starting from step 0",
                  file=sys.stderr)  # fmt: skip
        return None
    if not tc.resume:
        raise LmforgeError(
            f"train.out_dir {out_dir} already holds checkpoints (latest {ckpts[-1].name}); "
            "use a new train.out_dir or train.resume=true"
        )
    _check_config(run_config, out_dir, ckpts[-1], tc.allow_config_change, is_main)
    for i, ckpt in enumerate(reversed(ckpts)):
        try:
            _restore(strategy, optimizer, masters, ckpt, apply)
        except (LmforgeError, OSError, KeyError, ValueError, json.JSONDecodeError) as e:
            older = ckpts[-2 - i] if i + 1 < len(ckpts) else None
            if older is None:
                raise LmforgeError(
                    f"no intact checkpoint in {out_dir}: {ckpt.name} is corrupt ({e})"
                ) from None
            if is_main:
                print(f"lmforge train: checkpoint {ckpt} is corrupt ({e}); trying {older.name}",
                      file=sys.stderr)  # fmt: skip
            continue
        if i and is_main:
            print(f"lmforge train: resumed from {ckpt} (newer ones were corrupt)", file=sys.stderr)
        return ckpt
    return None


def finished_result(out_dir: Path, step: int, max_steps: int, checkpoint: Path | None,
                    is_main: bool) -> dict[str, Any]:  # fmt: skip
    """The result of a run already at ``max_steps`` (``step``): its recorded final metrics,
    nothing new appended (no evaluation, no checkpoint, no NaN train loss)."""
    records = read_metrics(out_dir / "metrics.jsonl")
    finals = [r for r in records if r.get("event") == "final" and r.get("step") == step]
    if is_main:
        print(f"lmforge train: {out_dir} already finished at step {step} "
              f"(train.max_steps={max_steps}); nothing to do", file=sys.stderr)  # fmt: skip
    if finals:
        out = {k: v for k, v in finals[-1].items() if k not in ("event", "step")}
        out["stopped"] = "already_finished"
        return out
    trains = [r for r in records if r.get("event") == "train"]
    return {"iteration": step, "stopped": "already_finished",
            "train_loss": trains[-1]["loss"] if trains else None,
            "checkpoint": str(checkpoint)}  # fmt: skip
