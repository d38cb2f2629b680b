"""The main job end to end on a tiny corpus: tokenizer → shards → training → report → samples."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from lmforge.cli import main


def test_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = tmp_path / "corpus"
    data.mkdir()
    for name in ("os.py", "argparse.py", "dataclasses.py", "functools.py", "typing.py", "ast.py"):
        shutil.copy(stdlib / name, data / name)
    out = tmp_path / "demo"
    rc = main(
        ["demo", "--data", str(data), "--out", str(out), "--preset", "tiny", "--vocab-size", "300",
         "--max-steps", "30", "--eval-every", "10", "--eval-batches", "2",
         "--sample-tokens", "8", "--tokenizer-mb", "0.5", "--device", "cpu"]
    )  # fmt: skip
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["vocab_size"] == 300 and report["steps"] == 30  # the step budget, exactly
    assert report["val_loss"] > 0 and report["unigram_val_loss"] > 0
    assert Path(report["checkpoint"]).is_dir() and len(report["samples"]) == 4
    printed = capsys.readouterr().out
    assert "bits per byte" in printed and "unigram" in printed
    # Run again into the same folder: the earlier training run is set aside, not an error.
    rc = main(
        ["demo", "--data", str(data), "--out", str(out), "--preset", "tiny", "--vocab-size", "300",
         "--max-steps", "5", "--eval-every", "5", "--eval-batches", "1",
         "--sample-tokens", "4", "--tokenizer-mb", "0.5", "--device", "cpu"]
    )  # fmt: skip
    assert rc == 0 and (out / "train.previous").is_dir()
    assert json.loads((out / "report.json").read_text())["steps"] == 5


def test_demo_defaults_are_a_step_budget() -> None:
    # A wall-clock budget made the demo's quality depend on the machine's load (issue 21 item 4).
    import argparse

    from lmforge._demo_cli import DEMO_STEPS, register

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    args = sub.choices["demo"].parse_args([])
    assert args.max_minutes == 0 and args.max_steps == DEMO_STEPS > 0


def test_demo_bad_data_path_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "input not found" in err[0]
