"""A run folder's state outside the model: the RNG states, the folder lock, the config check.

* :func:`rng_state` / :func:`set_rng_state`: every RNG a step may draw from, for exact resume.
* :class:`OutDirLock`: an exclusive ``fcntl.flock`` on ``out_dir/.lock`` held for the whole run,
  so two runs never write one folder; the kernel drops it when the holder dies (no stale locks).
* :func:`config_changes`: the keys that differ between a checkpoint's config and this run's
  (a resume with changes stops unless ``train.allow_config_change``; :data:`FREE_KEYS` may
  change freely).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.utils.errors import LmforgeError

# Keys a resumed run may change without train.allow_config_change: where and how long it runs
# and what it logs, never what a step computes (max_steps moves a cosine schedule's end, but
# extending a run is the common case; the checkpoint records the schedule it was on).
FREE_KEYS = frozenset(
    f"train.{k}"
    for k in (
        "out_dir", "device", "max_steps", "max_minutes", "eval_every", "eval_batches",
        "log_every", "save_every", "save_every_minutes", "keep_last", "resume", "tensorboard", "wandb",
        "peak_tflops", "progress", "plot", "allow_config_change", "max_bad_steps",
    )
) | {"rl.iterations", "rl.target", "dpo.epochs"}  # fmt: skip


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys (outside :data:`FREE_KEYS`) whose values differ: ``"train.lr: 0.001 -> 0.002"``,
    between nested dicts as ``config_to_dict`` gives (a key on one side only counts as changed)."""
    a, b = _flatten(old), _flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if key in FREE_KEYS:
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            out.append(f"{key}: {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}")
    return out


class OutDirLock:
    """An exclusive lock on ``out_dir/.lock`` (POSIX ``flock``; a no-op where it is missing)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.path = Path(out_dir) / ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise one line naming the folder and the holder."""
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise LmforgeError(
                f"train.out_dir {self.path.parent} is in use by another run (pid {holder}); "
                "wait for it to finish or use another train.out_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, numpy and Python RNG states as JSON-able lists."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [
            np_state[0],
            np_state[1].tolist(),
            int(np_state[2]),
            int(np_state[3]),
            float(np_state[4]),
        ],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (CUDA only with the same device count)."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
