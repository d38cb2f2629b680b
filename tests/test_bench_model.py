"""``lmforge bench model`` on the CPU: the code paths run and the table is written."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from lmforge.bench.model import bench_model, format_result


@pytest.mark.parametrize("residual,swiglu", [(None, None), ("autocast", "auto")])
def test_bench_model_runs_on_cpu(residual: str | None, swiglu: str | None) -> None:
    # swiglu="auto" on the CPU takes the reference gate (the packed kernel is CUDA's).
    torch.manual_seed(0)
    r = bench_model(
        "tiny", 2, 32, 1, 1, "cpu", profile=False, residual_dtype=residual, rope="reference",
        swiglu=swiglu,
    )  # fmt: skip
    assert math.isfinite(r.step_ms) and r.step_ms > 0
    table = format_result(r)
    assert "| tiny | 2×32 |" in table and "parameters" in table


def test_bench_model_cli_rejects_a_bad_residual_choice() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lmforge", "bench", "model", "--residual", "fp8", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--residual" in done.stderr
    assert "Traceback" not in done.stderr
