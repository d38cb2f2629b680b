"""Reading finished runs for a fit: sweep JSONL, CSV, or IsoFLOP-curve JSON, into one table.

Formats (by extension):

- ``.jsonl`` — one finished run per line, as ``lmforge scaling run`` writes them: ``parameters``,
  ``tokens``, ``loss`` and optionally ``flops`` and ``budget`` (the planned budget).
- ``.csv`` — header ``parameters,tokens,loss`` and optionally ``flops``.
- ``.json`` — a list of ``{"parameters", "compute_budget", "final_loss"}`` (IsoFLOP curves, e.g.
  ``../shared/data/scaling/isoflops_curves.json``); tokens are ``C / (6N)``.

Every problem (missing file, bad row, non-positive value) is one :class:`LmforgeError` line naming
the file and the row.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import iter_jsonl


@dataclasses.dataclass(frozen=True)
class RunTable:
    """Finished runs as float64 columns (one entry per run)."""

    parameters: np.ndarray
    "N"
    tokens: np.ndarray
    "D"
    loss: np.ndarray
    "final loss"
    flops: np.ndarray
    "training FLOPs (6ND when the source gives none)"
    budget: np.ndarray
    "the budget each run belongs to (planned, or runs of near-equal FLOPs grouped)"

    def __len__(self) -> int:
        return int(self.parameters.size)

    def select(self, keep: np.ndarray) -> RunTable:
        """The runs where ``keep`` is true."""
        return RunTable(*(getattr(self, f.name)[keep] for f in dataclasses.fields(self)))

    def drop_worst(self, k: int) -> RunTable:
        """Without the ``k`` highest-loss runs."""
        if k <= 0:
            return self
        if k >= len(self):
            raise LmforgeError(f"--drop-worst {k} would drop all {len(self)} runs")
        keep = np.ones(len(self), bool)
        keep[np.argsort(self.loss, kind="stable")[len(self) - k :]] = False
        return self.select(keep)


def _num(value: Any, where: str, key: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise LmforgeError(f"{where}: {key} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x <= 0:
        raise LmforgeError(f"{where}: {key} must be a positive finite number, got {value!r}")
    return x


def _row(
    rec: Any, where: str, loss_keys: tuple[str, ...]
) -> tuple[float, float, float, float, float]:
    if not isinstance(rec, dict):
        raise LmforgeError(f"{where}: expected an object with parameters, tokens and loss")
    n = _num(rec.get("parameters"), where, "parameters")
    loss_key = next((k for k in loss_keys if k in rec), loss_keys[0])
    loss = _num(rec.get(loss_key), where, loss_key)
    if "tokens" in rec:
        d = _num(rec["tokens"], where, "tokens")
        c = _num(rec["flops"], where, "flops") if rec.get("flops") is not None else 6 * n * d
    elif "compute_budget" in rec:
        c = _num(rec["compute_budget"], where, "compute_budget")
        d = c / (6 * n)
    else:
        raise LmforgeError(f"{where}: needs tokens (or compute_budget)")
    budget = rec.get("budget", rec.get("compute_budget"))
    b = _num(budget, where, "budget") if budget is not None else math.nan
    return n, d, loss, c, b


def load_runs(path: str | Path) -> RunTable:
    """Read runs from a sweep JSONL, a CSV or an IsoFLOP-curve JSON (see the module docstring)."""
    from lmforge.scaling.fit import group_budgets

    p = Path(path)
    if not p.is_file():
        raise LmforgeError(f"runs file not found: {p}")
    rows: list[tuple[float, ...]] = []
    loss_keys = ("loss", "final_loss", "val_loss")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        rows = [_row(rec, f"{p}:{i}", loss_keys) for i, rec in iter_jsonl(p, "runs file")]
    elif suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise LmforgeError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, list):
            raise LmforgeError(f"{p}: expected a JSON list of runs")
        rows = [_row(rec, f"{p}[{i}]", loss_keys) for i, rec in enumerate(data)]
    elif suffix == ".csv":
        reader = csv.DictReader(p.read_text(encoding="utf-8").splitlines())
        need = {"parameters", "tokens", "loss"}
        if reader.fieldnames is None or not need <= set(reader.fieldnames):
            raise LmforgeError(
                f"{p}: a CSV needs the columns parameters,tokens,loss[,flops], got "
                f"{','.join(reader.fieldnames or [])}"
            )
        for i, rec in enumerate(reader, 2):
            rec = {k: v for k, v in rec.items() if v not in (None, "")}
            rows.append(_row(rec, f"{p}:{i}", ("loss",)))
    else:
        raise LmforgeError(
            f"{p}: unknown runs format {p.suffix!r} (expected .jsonl, .csv or .json)"
        )
    if not rows:
        raise LmforgeError(f"{p}: no runs")
    arr = np.asarray(rows, dtype=np.float64)  # (R, 5): N, D, loss, C, budget
    budget = arr[:, 4]
    if np.isnan(budget).any():
        budget = group_budgets(arr[:, 3])
    return RunTable(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], budget)
