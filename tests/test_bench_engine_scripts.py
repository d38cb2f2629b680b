"""The GPU benchmarks' CPU smoke runs: each script's ``--quick`` path (its correctness checks
and its table) on a tiny model, so a device call is never the first run of a changed script.

``benchmarks/serve_hybrid.py`` (decode timed apart from prefill, memory per sequence, batch
sizes per engine), ``benchmarks/mla_engine.py`` (the clock serve_hybrid borrows) and
``benchmarks/window_attention.py`` (the windowed kernel's check, under Triton's interpreter) and
``benchmarks/linear_attention.py`` (its float64 checks and the files it writes).
"""

from __future__ import annotations

import importlib.util
import json
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


def test_serve_hybrid_quick_reports_decode_apart_and_memory(tmp_path: Path) -> None:
    out = _run("serve_hybrid.py", "--device", "cpu", "--quick", "--patterns", "A,GGGW",
               "--out", str(tmp_path))  # fmt: skip
    assert "check GGGW: engine greedy == lmforge.generate: ok" in out
    assert "blocks behind each window given back" in out  # GGGW: only W pages
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["A"], ["GGGW"])]
    assert [(r[0], r[1]) for r in rows] == [("A", "1"), ("A", "4"), ("GGGW", "1"), ("GGGW", "4")]
    saved = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["kind"], r["batch"]) for r in saved] == [(r[0], int(r[1])) for r in rows]


def test_mla_engine_quick_times_decode_steps() -> None:
    out = _run("mla_engine.py", "--device", "cpu", "--quick")
    assert out.count("engine greedy == lmforge.generate: ok") == 3
    picked = _run("mla_engine.py", "--device", "cpu", "--quick", "--kinds", "MLA")
    assert picked.count("engine greedy == lmforge.generate: ok") == 1 and "[MLA]" in picked
    assert "prefill excluded, timed apart" in out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_window_attention_quick_checks_the_kernel() -> None:
    out = _run("window_attention.py", "--device", "cpu", "--quick",
               env={"TRITON_INTERPRET": "1"})  # fmt: skip
    assert out.count(" ok") == 4 and "FAILED" not in out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_linear_attention_smoke_run_writes_its_results(tmp_path: Path) -> None:
    """``linear_attention.py --device cpu`` (the interpreter): the float64 checks pass and the
    results land in --out (each length's row as it finishes, then the whole run). The files
    were never written before: the script called ``atomic_write``, a context manager."""
    out = _run("linear_attention.py", "--device", "cpu", "--out", str(tmp_path),
               env={"TRITON_INTERPRET": "1"})  # fmt: skip
    assert "correctness: ok" in out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["ok"] and [r["T"] for r in saved["rows"]] == [32, 64]
    assert {"gated delta torch.float32", "ssd/linear torch.float32"} <= set(saved["correctness"])
    partial = json.loads((tmp_path / "rows.partial.json").read_text())
    assert [r["T"] for r in partial] == [32, 64]
    assert "| 32 | 2 |" in (tmp_path / "table.md").read_text()


def test_grpo_step_update_check_allows_one_ulp_not_a_real_difference() -> None:
    """``posttrain_grpo_step.update_agreement``: two AdamW updates that differ by one ulp of the
    updated weight pass (at lr 2e-6 that is ~1.5% of the update), an error of a quarter of
    the update in one element (several ulps) does not."""
    import torch

    spec = importlib.util.spec_from_file_location(
        "posttrain_grpo_step", REPO / "benchmarks" / "posttrain_grpo_step.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(0)
    w = torch.rand(4096, generator=g) * 0.5 + 0.25  # weights in [0.25, 0.75)
    step = torch.full_like(w, -2e-6) * torch.sign(torch.randn(4096, generator=g))
    after_old = w + step
    after_new = after_old.clone()
    after_new[::97] = torch.nextafter(after_new[::97], torch.full_like(after_new[::97], 9.0))
    d_old, d_new = {"w": after_old - w}, {"w": after_new - w}
    ulp = {"w": torch.maximum(mod._ulp(after_old), mod._ulp(after_new))}
    one_ulp = mod.update_agreement(d_new, d_old, ulp)
    assert one_ulp["worst"] <= 1.0 and one_ulp["rel_diff"] > 1e-3  # the bare check would fail
    assert 0 < one_ulp["differ"] < 0.02
    off = {"w": d_old["w"].clone()}
    off["w"][5] += 5e-7  # ~8 ulps of a weight below 0.75
    assert mod.update_agreement(off, d_old, ulp)["worst"] > 1.0
