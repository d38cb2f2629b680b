"""The GPU benchmarks' CPU smoke runs: each script's ``--quick`` path (its correctness checks
and its table) on a tiny model, so a device call is never the first run of a changed script.

``benchmarks/serve_hybrid.py`` (decode timed apart from prefill, memory per sequence, batch
sizes per engine), ``benchmarks/mla_engine.py`` (the clock serve_hybrid borrows) and
``benchmarks/window_attention.py`` (the windowed kernel's check, under Triton's interpreter).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, env: dict | None = None) -> str:
    full = {**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args],
                          capture_output=True, text=True, env=full, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_serve_hybrid_quick_reports_decode_apart_and_memory() -> None:
    out = _run("serve_hybrid.py", "--device", "cpu", "--quick", "--patterns", "A,GGGW")
    assert "check GGGW: engine greedy == lmforge.generate: ok" in out
    assert "blocks behind each window given back" in out  # GGGW: only W pages
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["A"], ["GGGW"])]
    assert [(r[0], r[1]) for r in rows] == [("A", "1"), ("A", "4"), ("GGGW", "1"), ("GGGW", "4")]


def test_mla_engine_quick_times_decode_steps() -> None:
    out = _run("mla_engine.py", "--device", "cpu", "--quick")
    assert out.count("engine greedy == lmforge.generate: ok") == 3
    assert "prefill excluded, timed apart" in out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_window_attention_quick_checks_the_kernel() -> None:
    out = _run("window_attention.py", "--device", "cpu", "--quick",
               env={"TRITON_INTERPRET": "1"})  # fmt: skip
    assert out.count(" ok") == 4 and "FAILED" not in out
