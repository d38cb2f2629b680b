"""The four commands: --help with examples, one-line errors, a tiny `lmforge rl` run and rerun."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmforge.cli import main


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    """`lmforge rl` sets one torch thread for the process; give the others theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("cmd", ["sft", "dpo", "rl", "distill"])
def test_help_has_examples(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "[train.lr]" in out  # each flag names its config key


def test_missing_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    assert main(["sft", "--model", str(tmp_path / "missing"), "--data", str(data),
                 "--out", str(tmp_path / "o")]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model not found" in err[0]


def test_rl_arithmetic_command_runs_and_a_rerun_resumes(tmp_path: Path) -> None:
    out = tmp_path / "rl"
    args = ["rl", "--task", "arithmetic", "--digits", "1", "--warmup-steps", "5", "--iterations",
            "2", "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8", "--quiet",
            "--eval-every", "1", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["samples"] == 32
    assert (out / "curve.png").is_file() and (out / "model" / "model.safetensors").is_file()
    assert (out / "warm_start" / "config.toml").is_file()
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["event"] == "train"] == [1, 2]
    assert [r["step"] for r in recs if r["event"] == "eval"] == [1, 2]
    first = next(r for r in recs if r["event"] == "train")
    assert "reward" in first and "clip_fraction" in first
    # a rerun of a finished run: both Trainer runs (warm start, RL) say so and change nothing
    i = args.index("--iterations") + 1
    assert main([*args[:i], "3", *args[i + 1 :]]) == 0  # one more iteration: resumes at step 2
    again = json.loads((out / "summary.json").read_text())
    assert again["iterations"] == 3 and again["accuracy_before"] == summary["accuracy_before"]


def test_rl_scratchpad_pipeline_command_runs(tmp_path: Path) -> None:
    # the worked-answer task needs a longer context than the plain one; the pipeline flags reach
    # the engine (queue 0: no token more than one version old)
    out = tmp_path / "rl"
    args = ["rl", "--task", "scratchpad", "--digits", "1", "--warmup-steps", "5", "--iterations",
            "2", "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "4", "--pipeline",
            "--queue-size", "0", "--engine-threads", "1", "--weight-transport", "shared",
            "--quiet", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "scratchpad" and summary["iterations"] == 2
    assert set(summary["staleness_histogram"]) <= {"0", "1"}
