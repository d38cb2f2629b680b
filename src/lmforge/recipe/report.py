"""The report card: ``OUT/report.md`` with each stage's settings, time, tokens and metrics, the
evaluation table (with anchors) and loss/reward curves as PNG files under ``OUT/report/``.

Everything is read back from the stages' completion markers and their own ``metrics.jsonl``
files, so the card can be rebuilt at any time (``lmforge recipe run CONFIG --from report``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmforge.recipe.config import RecipeConfig
from lmforge.recipe.markers import DONE, read_marker
from lmforge.utils.io import atomic_write_text


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def curve(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """The ``(xs, ys)`` of the rows holding numeric ``x`` and ``y``."""
    xs, ys = [], []
    for r in rows:
        if isinstance(r.get(x), int | float) and isinstance(r.get(y), int | float):
            xs.append(float(r[x]))
            ys.append(float(r[y]))
    return xs, ys


# (stage, metrics file under out, x key, y keys, title)
CURVES = (
    ("pretrain", "train/metrics.jsonl", "step", ("loss", "val_loss"), "pretraining loss"),
    ("sft", "sft/metrics.jsonl", "step", ("loss",), "SFT loss (assistant tokens)"),
    ("rl", "rl/metrics.jsonl", "iteration", ("reward", "eval_accuracy"), "RL reward / accuracy"),
)


def plot_series(
    rows: list[dict[str, Any]], x: str, ys: tuple[str, ...]
) -> tuple[str, dict[str, tuple[list[float], list[float]]]]:
    """(x key, {y: (xs, values)}) of a metrics log for a curve: ``x`` or the other of "step" /
    "iteration", whichever gives more points (the trainer logs "step" on every event; older RL
    logs "iteration" on its final one only); series without points are left out."""

    def pick(key: str) -> dict[str, tuple[list[float], list[float]]]:
        found = {y: curve(rows, key, y) for y in ys}
        return {y: s for y, s in found.items() if s[0]}

    other = "iteration" if x == "step" else "step"
    series, alt = pick(x), pick(other)
    if sum(len(s[0]) for s in alt.values()) > sum(len(s[0]) for s in series.values()):
        return other, alt
    return x, series


def _plot(out: Path, name: str, rows: list[dict[str, Any]], x: str, ys: tuple[str, ...],
          title: str) -> Path | None:  # fmt: skip
    x, series = plot_series(rows, x, ys)
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for y, (xs, vs) in series.items():
        ax.plot(xs, vs, marker="o" if len(xs) < 30 else None, label=y)
    ax.set_xlabel(x)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "report" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_report(
    cfg: RecipeConfig, out: Path, stages: Sequence[Any], model_path: Callable[..., Any]
) -> Path:
    """Write ``out/report.md`` (and its PNG curves) from the stages' markers; returns its path."""
    lines = [f"# lmforge recipe report card — {out}", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device "
             f"`{cfg.recipe.device}`. Rebuild with `lmforge recipe run CONFIG --from report`.",
             ""]  # fmt: skip
    lines += ["| stage | time | ran on | key metrics |", "|---|---:|---|---|"]
    markers: dict[str, dict[str, Any]] = {}
    total = 0.0
    for st in stages:
        if st.name == "report":
            continue
        m = read_marker(out / st.dirs[0] / DONE)
        if m is None:
            lines.append(
                f"| {st.name} | — | — | {'disabled' if not st.enabled(cfg) else 'not run'} |"
            )
            continue
        markers[st.name] = m
        total += float(m.get("seconds", 0.0))
        metrics = m.get("metrics", {})
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in metrics.items()
                          if not isinstance(v, dict) and k != "model")  # fmt: skip
        if st.name == "eval":
            shown = "see the table below"
        # eval rows come from a cache filled on any machine: each row says where it ran
        ran_on = "each row's (below)" if st.name == "eval" else m.get("where", "—")
        # eval rows are scored once and cached, maybe elsewhere: their times are in the table
        secs = "per row (below)" if st.name == "eval" else f"{float(m.get('seconds', 0)):.0f} s"
        lines.append(f"| {st.name} | {secs} | {ran_on} | {shown} |")
    # eval: the recipe models' rows' own times (anchors are scored once, anywhere)
    ev = markers.get("eval", {}).get("metrics", {})
    total -= float(markers.get("eval", {}).get("seconds", 0.0))
    total += sum(float(r.get("seconds", 0.0)) for n, r in ev.items()
                 if isinstance(r, dict) and n in cfg.eval.models)  # fmt: skip
    lines += ["", f"Total stage time: {total / 60:.1f} min (eval: the recipe models' rows).", ""]

    if ev:
        cols = sorted({k for row in ev.values() for k in row if k not in ("model", "ran_on")})
        lines += ["## Evaluation (`lmforge eval`, same settings for every row)", "",
                  f"Tasks `{cfg.eval.tasks}` on `{cfg.eval.data_dir}`"
                  + (f" (at most {cfg.eval.limit} per task)" if cfg.eval.limit else "")
                  + ". `core`: accuracy centered on chance (0 = chance, 1 = perfect), "
                  "averaged over the accuracy tasks.", "",
                  "| model | " + " | ".join(cols) + " | ran on |",
                  "|---|" + "---:|" * len(cols) + "---|"]  # fmt: skip
        for name, row in ev.items():
            lines.append(f"| {name} | " + " | ".join(_fmt(row.get(c, "—")) for c in cols)
                         + f" | {row.get('ran_on', '—')} |")  # fmt: skip
        lines.append("")

    plots = []
    for stage, rel, x, ys, title in CURVES:
        if stage in markers:
            p = _plot(out, stage, _rows(out / rel), x, ys, title)
            if p is not None:
                plots.append((title, p))
    if plots:
        lines += ["## Curves", ""]
        lines += [f"![{title}]({p.relative_to(out)})" for title, p in plots]
        lines.append("")

    lines += ["## Settings of each stage", ""]
    for name, m in markers.items():
        lines += [f"<details><summary>{name} (key {m.get('key')})</summary>", "", "```json",
                  json.dumps(m.get("settings", {}), indent=2, sort_keys=True), "```",
                  "</details>", ""]  # fmt: skip
    result = model_path(cfg, out, "rl")
    lines += ["## Use the result", "", "```bash",
              f"lmforge chat --checkpoint {result} --temperature 0.7",
              f"lmforge serve --checkpoint {result} --port 8000", "```", ""]  # fmt: skip
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path
