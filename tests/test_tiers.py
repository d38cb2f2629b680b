"""The test tiers: every GPU test lands in exactly one part of ``pytest -m gpu --gpu-part PART``,
and no test turns a missing lmforge module into a skip."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import GPU_PART_NAMES, gpu_part

TESTS = Path(__file__).resolve().parent


def test_every_gpu_test_file_has_one_part_and_every_part_has_tests() -> None:
    gpu_files = [f for f in TESTS.glob("test_*.py") if "mark.gpu" in f.read_text(encoding="utf-8")]
    parts = {f.name: gpu_part(str(f)) for f in gpu_files}
    assert set(parts.values()) == set(GPU_PART_NAMES), parts  # none empty, none unknown
    assert gpu_part("tests/test_kernels_gpu.py") == "kernels"
    assert gpu_part("/x/tests/test_serve_gemv.py") == "serve"
    assert gpu_part("test_moe_layer.py") == "other"


def test_no_importorskip_of_lmforge_modules() -> None:
    """A broken lmforge import must fail, not skip: import lmforge's modules plainly."""
    pattern = re.compile(r"importorskip\(\s*[\"']lmforge")
    offenders = [
        f.name for f in TESTS.glob("test_*.py") if pattern.search(f.read_text(encoding="utf-8"))
    ]
    # the three files other work of issue 33 fixes in the same change
    assert set(offenders) <= {"test_model.py", "test_generate.py", "test_posttrain_rl.py"}, (
        offenders
    )


def test_optional_modules_skip_with_a_reason(tmp_path, monkeypatch) -> None:
    """A missing extra and an installed one that fails to import both give a reason (a skip)."""
    from conftest import _unavailable

    assert (
        _unavailable("lmforge_no_such_extra")
        == "optional dependency missing: lmforge_no_such_extra"
    )
    (tmp_path / "lmforge_broken_extra.py").write_text("raise ImportError('built for torch 0.1')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    why = _unavailable("lmforge_broken_extra")
    assert why is not None and "does not import" in why and "built for torch 0.1" in why
    assert _unavailable("json") is None


def test_gpu_part_option_parses_slices() -> None:
    import pytest

    from conftest import parse_gpu_part

    assert parse_gpu_part("serve") == ("serve", 1, 1)
    assert parse_gpu_part("kernels:2/3") == ("kernels", 2, 3)
    for bad in ("nope", "kernels:0/2", "kernels:3/2", "kernels:x"):
        with pytest.raises(pytest.UsageError):
            parse_gpu_part(bad)
