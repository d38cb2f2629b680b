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
    # The Trainer's AdamW has stepped: two fp32 moments per parameter (plus step counts).
    assert r.memory["optimizer"] >= 2 * r.memory["parameters"] > 0
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


def test_cuda_kernel_gaps_splits_idle_time_at_the_threshold() -> None:
    # Kernel intervals (µs): two overlapping, a 2 µs launch gap, a 50 µs host wait; CPU events
    # are ignored.
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from lmforge.bench.timing import cuda_kernel_gaps

    def ev(a: float, b: float, dev=DeviceType.CUDA):
        return SimpleNamespace(device_type=dev, time_range=SimpleNamespace(start=a, end=b))

    events = [ev(0, 10), ev(5, 12), ev(14, 20), ev(70, 80), ev(0, 500, DeviceType.CPU)]
    g = cuda_kernel_gaps(SimpleNamespace(events=lambda: events), short_us=8.0)
    assert g == dict(busy=12 + 6 + 10, span=80, short=2, long=50, n_short=1, n_long=1)
    empty = cuda_kernel_gaps(SimpleNamespace(events=lambda: []))
    assert empty["span"] == 0 and empty["busy"] == 0
