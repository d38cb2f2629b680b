"""WSD cooldown branches: the loss at several token counts from one stable-phase run.

One run trains at constant LR (after the usual warm-up) and checkpoints at each branch point
s_i = T_i − d_i; each branch copies that checkpoint into its own folder and resumes with the WSD
schedule of total length T_i, whose linear decay covers the last d_i = round(f·T_i) steps (so up to
s_i its learning rate is exactly the stable run's). A branch is therefore the same computation as
a separate WSD run of T_i steps — resume is exact — at a cost of max(s_i) + Σ d_i steps instead of
Σ T_i (MiniCPM; Hägele et al. 2024). Optionally separate cosine runs of each length are trained for
comparison. The stable phase runs in segments (``max_steps`` = each s_i in turn, resumed), which
the constant schedule makes identical to one uninterrupted run.

Exercised by ``pytest tests/test_scaling_branches.py``; the command is ``lmforge scaling branch``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text


def branch_points(
    totals: Sequence[int], decay_fraction: float, warmup: int
) -> list[tuple[int, int]]:
    """(T_i, s_i) per total length: the decay is round(f·T_i) steps, branching at s_i = T_i − d_i."""
    if not 0 < decay_fraction < 1:
        raise LmforgeError(f"decay fraction must lie in (0, 1), got {decay_fraction}")
    out = []
    for t in sorted(set(totals)):
        d = round(decay_fraction * t)
        s = t - d
        if d < 1 or s < warmup:
            raise LmforgeError(
                f"branch at {t} steps: its decay ({d} steps) must be ≥ 1 and start after the "
                f"{warmup} warm-up steps"
            )
        out.append((t, s))
    return out


def _with(cfg: Any, **train: Any) -> Any:
    tc = cfg.train
    if any(f.name == "allow_config_change" for f in dataclasses.fields(tc)):
        train["allow_config_change"] = True  # branches resume under a different schedule
    return dataclasses.replace(cfg, train=dataclasses.replace(tc, **train))


def _final_loss(res: dict[str, Any]) -> float:
    return float(res.get("val_loss", res.get("train_loss")))


def run_branches(
    base: Any,
    totals: Sequence[int],
    out_dir: str | Path,
    decay_fraction: float = 0.2,
    compare_cosine: bool = False,
) -> list[dict[str, Any]]:
    """Stable run + one cooldown branch per total length (+ separate cosine runs); one record each.

    Records: ``steps``, ``tokens``, ``branch_from``, ``wsd_loss`` and, with ``compare_cosine``,
    ``cosine_loss`` and ``rel_diff`` = wsd/cosine − 1. Written to ``out_dir/branches.json``.
    """
    from lmforge.checkpoint import checkpoint_path
    from lmforge.train.trainer import train

    out = Path(out_dir)
    points = branch_points(totals, decay_fraction, base.train.warmup_steps)
    stable_dir = out / "stable"
    keep = len(points) + 1
    tokens_per_step = (
        base.train.batch_size
        * base.train.grad_accum
        * (base.train.context_length or base.model.context_length)
    )
    for s in sorted({s for _, s in points}):
        print(f"lmforge scaling branch: stable phase to step {s}", file=sys.stderr)
        train(
            _with(
                base,
                out_dir=str(stable_dir),
                schedule="constant",
                max_steps=s,
                save_every=0,
                keep_last=keep,
                resume=True,
            )
        )
    records = []
    for t, s in points:
        src = checkpoint_path(stable_dir, s)
        if not src.is_dir():
            raise LmforgeError(f"stable run has no checkpoint at step {s} ({src})")
        bdir = out / f"wsd_{t}"
        dst = checkpoint_path(bdir, s)
        if not dst.is_dir() and not checkpoint_path(bdir, t).is_dir():
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.parent / f".copy-{dst.name}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp)
            tmp.rename(dst)  # a branch folder holds a whole checkpoint or none
        print(f"lmforge scaling branch: cooldown {s} → {t}", file=sys.stderr)
        res = train(
            _with(
                base,
                out_dir=str(bdir),
                schedule="wsd",
                max_steps=t,
                decay_fraction=(t - s) / t,
                save_every=0,
                keep_last=1,
                resume=True,
            )
        )
        rec: dict[str, Any] = {
            "steps": t,
            "tokens": t * tokens_per_step,
            "branch_from": s,
            "wsd_loss": _final_loss(res),
        }
        if compare_cosine:
            print(f"lmforge scaling branch: separate cosine run of {t} steps", file=sys.stderr)
            cres = train(
                _with(
                    base,
                    out_dir=str(out / f"cosine_{t}"),
                    schedule="cosine",
                    max_steps=t,
                    save_every=0,
                    keep_last=1,
                    resume=True,
                )
            )
            rec["cosine_loss"] = _final_loss(cres)
            rec["rel_diff"] = rec["wsd_loss"] / rec["cosine_loss"] - 1.0
        records.append(rec)
    summary = {
        "decay_fraction": decay_fraction,
        "steps_branches": max(s for _, s in points) + sum(t - s for t, s in points),
        "steps_separate": sum(t for t, _ in points),
        "points": records,
    }
    atomic_write_text(out / "branches.json", json.dumps(summary, indent=1))
    return records
