"""Running a planned sweep through the trainer, resumably, into one results JSONL.

Layout of a sweep folder::

    plan.json                the plan (base run config + grid points), copied at the first run
    results.jsonl            one line per finished point (the resume key is the point's id)
    points/<id>/             the point's train.out_dir (config, metrics.jsonl, checkpoints)

A killed sweep run again continues where it stopped: finished points (in ``results.jsonl``) are
never rerun, and the point that was running resumes from its own latest checkpoint through the
trainer's resume. Each result line is appended and fsynced in one write; a torn last line (a kill
during the write) is dropped and that point rerun from its final checkpoint. Exercised by
``pytest tests/test_scaling_sweep.py``; the command is ``lmforge scaling run``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmforge.scaling.plan import GridPoint
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

PLAN_VERSION = 1


def plan_to_json(base: Any, points: Sequence[GridPoint], meta: dict[str, Any]) -> str:
    """The plan file's text: the base run config as a dict, the points, how they were made."""
    from lmforge.utils.config import config_to_dict

    return json.dumps(
        {
            "version": PLAN_VERSION,
            "meta": meta,
            "base": config_to_dict(base),
            "points": [dataclasses.asdict(p) for p in points],
        },
        indent=1,
    )


def read_plan(path: str | Path) -> tuple[Any, list[GridPoint], dict[str, Any]]:
    """(base RunConfig, points, meta) of a plan file, each problem one clear line."""
    from lmforge.config import RunConfig
    from lmforge.utils.config import from_dict

    p = Path(path)
    if not p.is_file():
        raise LmforgeError(f"sweep plan not found: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LmforgeError(f"sweep plan {p} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
        raise LmforgeError(
            f"sweep plan {p}: expected a version-{PLAN_VERSION} plan from lmforge scaling plan"
        )
    base = from_dict(RunConfig, data.get("base", {}))
    names = {f.name for f in dataclasses.fields(GridPoint)}
    points = []
    for i, rec in enumerate(data.get("points", [])):
        if not isinstance(rec, dict) or set(rec) != names:
            raise LmforgeError(
                f"sweep plan {p}: point {i} must have exactly the keys {sorted(names)}"
            )
        points.append(GridPoint(**rec))
    if not points:
        raise LmforgeError(f"sweep plan {p} has no points")
    return base, points, dict(data.get("meta", {}))


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Finished points of a ``results.jsonl`` (a torn last line from a kill is skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    lines = p.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue  # killed mid-write: that point reruns (from its final checkpoint)
            raise LmforgeError(f"{p}:{i + 1}: corrupt result line (not JSON)") from None
    return out


def _append_line(path: Path, record: dict[str, Any]) -> None:
    # One write of one line, then fsync: a kill leaves at most a torn last line.
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_torn_tail(path: Path) -> None:
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        atomic_write_text(path, text[: text.rfind("\n") + 1])


def point_config(base: Any, point: GridPoint, out_dir: Path, device: str | None) -> Any:
    """The point's RunConfig: the base with the point's shape, steps and folder."""
    from lmforge.config import RunConfig
    from lmforge.utils.config import config_to_dict, from_dict

    data = config_to_dict(base)
    for key, value in point.overrides().items():
        section, name = key.split(".")
        data[section][name] = value
    data["model"]["n_kv_heads"] = None
    data["model"]["d_ff"] = None
    data["train"]["out_dir"] = str(out_dir)
    data["train"]["resume"] = True
    data["train"]["progress"] = False
    data["train"]["plot"] = False
    # Warm-up scaled into short runs: the base's warm-up, at most a tenth of the run.
    data["train"]["warmup_steps"] = min(
        int(data["train"]["warmup_steps"]), max(point.steps // 10, 1)
    )
    if device:
        data["train"]["device"] = device
    return from_dict(RunConfig, data)


def _curve(metrics_path: Path) -> list[list[float]]:
    from lmforge.train.trainer import read_metrics

    return [
        [float(r["tokens"]), float(r["loss"])]
        for r in read_metrics(metrics_path)
        if r.get("event") == "train" and "loss" in r
    ]


def run_sweep(
    plan_path: str | Path,
    out_dir: str | Path,
    device: str | None = None,
    only: Sequence[str] = (),
    callbacks: Callable[[GridPoint], Sequence[Callable[..., None]]] | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Train every point of the plan not yet in ``out_dir/results.jsonl``; return all results.

    ``only`` restricts the run to those point ids. ``callbacks(point)`` gives the trainer
    callbacks of a point (e.g. the gradient-noise-scale estimate). Progress is a bar over the
    sweep's FLOPs.
    """
    from tqdm import tqdm

    from lmforge.train.trainer import train

    out = Path(out_dir)
    base, points, _meta = read_plan(plan_path)
    out.mkdir(parents=True, exist_ok=True)
    saved_plan = out / "plan.json"
    text = Path(plan_path).read_text(encoding="utf-8")
    if saved_plan.is_file():
        if (
            Path(plan_path).resolve() != saved_plan.resolve()
            and saved_plan.read_text("utf-8") != text
        ):
            raise LmforgeError(
                f"{out} already holds a different sweep plan; use a new folder or the same plan"
            )
    else:
        atomic_write_text(saved_plan, text)
    results_path = out / "results.jsonl"
    _drop_torn_tail(results_path)
    done = {r.get("id") for r in read_results(results_path)}
    if only:
        unknown = set(only) - {p.id for p in points}
        if unknown:
            raise LmforgeError(f"unknown point id(s): {', '.join(sorted(unknown))}")
        points = [p for p in points if p.id in set(only)]
    todo = [p for p in points if p.id not in done]
    total = sum(p.flops for p in points)
    bar = tqdm(
        total=total,
        initial=total - sum(p.flops for p in todo),
        desc="sweep",
        unit="FLOP",
        unit_scale=True,
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not progress,
    )
    try:
        for point in todo:
            bar.set_postfix_str(
                f"{point.id} N={point.parameters / 1e6:.2f}M D={point.tokens / 1e6:.2f}M"
            )
            cfg = point_config(base, point, out / "points" / point.id, device)
            t0 = time.monotonic()
            cbs = list(callbacks(point)) if callbacks else []
            res = train(cfg, callbacks=cbs)
            loss = res.get("val_loss", res.get("train_loss"))
            record = {
                **dataclasses.asdict(point),
                "loss": loss,
                "loss_kind": "val_loss" if "val_loss" in res else "train_loss",
                "train_loss": res.get("train_loss"),
                "val_loss": res.get("val_loss"),
                "curve": _curve(Path(cfg.train.out_dir) / "metrics.jsonl"),
                "elapsed_s": time.monotonic() - t0,
                "device": cfg.train.device,
            }
            _append_line(results_path, record)
            bar.update(point.flops)
    finally:
        bar.close()
    return read_results(results_path)
