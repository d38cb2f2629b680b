"""Metrics of a training run: ``metrics.jsonl`` (always), TensorBoard and W&B (when asked for).

One JSON record per line: ``{"event": "attempt" | "plan" | "train" | "eval" | "skip" | "final",
"step": …}``. The file is only ever appended to: each attempt at a run (the first, a resume, a
rerun that found no checkpoint) starts with an ``attempt`` record at its first step, and
:func:`read_metrics` gives the run as if never interrupted. A full disk ends the run with one
line (:func:`disk_full_is_one_line`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmforge.utils.config import config_to_dict, save_config
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write


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
        """Append one record (a JSON line, flushed: a kill loses at most that line) and forward
        its numbers to TB / W&B."""
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
        try:
            self.file.close()
        except OSError:
            pass  # a full disk was already reported by log()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str | Path, all_attempts: bool = False) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` as one uninterrupted run: at each ``attempt`` record
    (step s) the earlier records past step s, and the earlier plan, are dropped from the view
    (``all_attempts``: every line as written). A torn last line from a killed run is skipped."""
    out: list[dict[str, Any]] = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not all_attempts and rec.get("event") == "attempt":
            s = int(rec.get("step", 0))
            out = [r for r in out if int(r.get("step", 0)) <= s and r.get("event") != "plan"]
        out.append(rec)
    return out


def plot_curves(path: str | Path, series: dict[str, list[tuple[float, float]]], xlabel: str,
                ylabel: str, title: str = "") -> None:  # fmt: skip
    """A PNG of one or more (x, y) curves (matplotlib, Agg backend; written atomically); the
    points of a curve of at most 50 are marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in series.items():
        if pts:
            ax.plot(*zip(*pts), "-o" if len(pts) <= 50 else "-", label=name, lw=1.2, ms=3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def plot_loss_curve(metrics: list[dict[str, Any]], path: str | Path) -> None:
    """Write train (and validation) loss against step to a PNG."""
    train = [(r["step"], r["loss"]) for r in metrics if r.get("event") == "train"]
    # an objective's own evaluate may report other numbers (recall, accuracy): plot val_loss only
    val = [(r["step"], r["val_loss"]) for r in metrics
           if r.get("event") == "eval" and "val_loss" in r]  # fmt: skip
    plot_curves(path, {"train loss": train, "validation loss": val}, "step",
                "loss (nats/token)")  # fmt: skip


def start_run_log(
    out_dir: Path,
    run_config: Any,
    plan: Any,
    *,
    iteration: int,
    resumed_from: Path | None,
    fast_summary: str,
    start_line: str,
) -> MetricsLogger:
    """On rank 0: config.toml, an ``attempt`` and a ``plan`` record appended to metrics.jsonl,
    and ``start_line`` on stderr; the logger to use."""
    tc = run_config.train
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(run_config, out_dir / "config.toml")
    path = out_dir / "metrics.jsonl"
    earlier = [r for r in read_metrics(path, all_attempts=True) if r.get("event") == "attempt"]
    loggers = MetricsLogger(out_dir, tc.tensorboard, tc.wandb, config_to_dict(run_config))
    resumed = {} if resumed_from is None else {"resumed_from": str(resumed_from)}
    loggers.log({"event": "attempt", "step": iteration, "attempt": len(earlier) + 1, **resumed})
    loggers.log(
        {"event": "plan", "step": iteration, **vars(plan), "fast_path": fast_summary, **resumed}
    )
    print(start_line + (f"; resumed from {resumed_from}" if resumed_from else ""), file=sys.stderr)
    return loggers
