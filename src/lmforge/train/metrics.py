"""Metrics of a training run: ``metrics.jsonl`` (always), TensorBoard and W&B (when asked for).

One JSON record per line: ``{"event": "plan" | "train" | "eval" | "skip" | "final", "step": …}``.
On resume the file is cut back to the checkpoint's step (:func:`truncate_metrics`), so the
logged curve continues as if never interrupted. A full disk while writing ends the run with one
line naming the folder and what was kept (:func:`disk_full_is_one_line`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.utils.config import config_to_dict, save_config
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write, atomic_write_text

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


@contextlib.contextmanager
def disk_full_is_one_line(folder: str | Path, kept: str) -> Iterator[None]:
    """Turn ENOSPC (and EDQUOT) raised inside into one :class:`LmforgeError` line naming
    ``folder`` and what was ``kept`` intact."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise LmforgeError(
            f"no space left on the device holding {folder}; kept: {kept}. Free space and rerun "
            "(the run resumes from the last checkpoint)"
        ) from None


class MetricsLogger:
    """metrics.jsonl always; TensorBoard and W&B only when asked for (imported then)."""

    def __init__(self, out_dir: Path, tensorboard: bool, wandb_project: str, config: dict) -> None:
        self.path = out_dir / "metrics.jsonl"
        self.file = open(self.path, "a", encoding="utf-8")
        self.tb = None
        self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise LmforgeError(
                    "train.tensorboard=true needs the tensorboard package (pip install tensorboard)"
                ) from None
            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise LmforgeError(
                    "train.wandb is set but the wandb package is missing (pip install wandb)"
                ) from None
            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(out_dir))

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (a JSON line, flushed) and forward its numbers to TB / W&B."""
        # One line per record, flushed, so a killed run loses at most the line being written.
        with disk_full_is_one_line(self.path.parent, "metrics.jsonl up to the previous line"):
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        step = int(record.get("step", 0))
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        """Close the file and the optional loggers."""
        try:
            self.file.close()
        except OSError:
            pass  # a full disk was already reported by log()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (a torn last line from a killed run is skipped)."""
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def truncate_metrics(path: Path, iteration: int) -> None:
    # A killed run may have logged steps after its last checkpoint; the resumed run redoes them.
    records = [r for r in read_metrics(path) if int(r.get("step", 0)) <= iteration]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def plot_loss_curve(metrics: list[dict[str, Any]], path: str | Path) -> None:
    """Write train (and validation) loss against step to a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in metrics if r.get("event") == "train"]
    val = [(r["step"], r["val_loss"]) for r in metrics if r.get("event") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def start_run_log(trainer: Trainer) -> MetricsLogger | None:
    """On rank 0: config.toml, a fresh or truncated metrics.jsonl, the plan record and the
    start line on stderr; the logger to use (None on other ranks)."""
    if not trainer.is_main:
        return None
    tc, plan = trainer.tcfg, trainer.plan
    trainer.out_dir.mkdir(parents=True, exist_ok=True)
    save_config(trainer.run_config, trainer.out_dir / "config.toml")
    if trainer.resumed_from is not None:
        truncate_metrics(trainer.out_dir / "metrics.jsonl", trainer.iteration)
    else:  # a fresh run: nothing from an earlier attempt that never checkpointed
        atomic_write_text(trainer.out_dir / "metrics.jsonl", "")
    loggers = MetricsLogger(
        trainer.out_dir, tc.tensorboard, tc.wandb, config_to_dict(trainer.run_config)
    )
    rec: dict[str, Any] = {"event": "plan", "step": trainer.iteration, **vars(plan)}
    rec["fast_path"] = trainer.fast.summary()
    if trainer.resumed_from is not None:
        rec["resumed_from"] = str(trainer.resumed_from)
    loggers.log(rec)
    if not trainer.pretraining:
        print(
            f"lmforge train: objective {trainer.objective.name}, {plan.n_params / 1e6:.2f}M "
            f"params, {plan.max_steps} steps, device {trainer.device}; adamw "
            f"{trainer.fast.adamw}"
            + (f"; resumed from {trainer.resumed_from}" if trainer.resumed_from else ""),
            file=sys.stderr,
        )
        return loggers
    print(
        f"lmforge train: {plan.n_params / 1e6:.2f}M params, {plan.tokens_per_step} tokens/step, "
        f"{plan.max_steps} steps = {plan.total_tokens / 1e6:.2f}M tokens, "
        f"{plan.flops_per_step:.3g} FLOPs/step, device {trainer.device}; {trainer.fast.summary()}"
        + (f"; resumed from {trainer.resumed_from}" if trainer.resumed_from else ""),
        file=sys.stderr,
    )
    return loggers
