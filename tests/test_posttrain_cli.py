"""The four commands: --help with examples, one-line errors, and a tiny `lmforge rl` run."""

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
    assert "examples:" in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rl", "--algo", "nope", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown RL algorithm 'nope'" in err[0]
    assert main(["sft", "--model", str(tmp_path / "missing"), "--data", "x.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model not found" in err[0]


@pytest.mark.parametrize("engine", ["auto", "serve"])
def test_rl_arithmetic_command_runs(tmp_path: Path, engine: str) -> None:
    out = tmp_path / "rl"
    args = ["rl", "--task", "arithmetic", "--digits", "1", "--warmup-steps", "5", "--iterations", "2",
            "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8", "--quiet",
            "--rollout-engine", engine, "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["samples"] == 32
    assert (out / "curve.png").is_file() and (out / "model" / "model.safetensors").is_file()
    assert (out / "warm_start" / "config.toml").is_file()
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["iteration"] == 0 and len(lines) == 3


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


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--micro-batch", "0", "must be >= 1, got 0"),
        ("--eval-every", "0", "must be >= 1, got 0"),
        ("--prompts-per-step", "-2", "must be >= 1, got -2"),
        ("--group-size", "0", "must be >= 1, got 0"),
        ("--queue-size", "-1", "must be >= 0, got -1"),
        ("--micro-batch", "x", "invalid int value: 'x'"),
    ],
)
def test_rl_counts_must_be_positive(
    tmp_path: Path, flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A zero micro-batch or eval interval is argparse's usage error naming the flag (no
    traceback from deep in a run); the same value in a --config file is one line too."""
    with pytest.raises(SystemExit) as exc:
        main(["rl", "--pipeline", flag, value, "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1 and f"argument {flag}: {says}" in errors[0], err
    assert "Traceback" not in "\n".join(err) and not (tmp_path / "o").exists()
    if value.lstrip("-").isdigit():
        f = tmp_path / "bad.toml"
        key = flag.removeprefix("--").replace("-", "_")
        f.write_text(f"[rl]\n{key} = {value}\n")
        assert main(["rl", "--config", str(f), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"key '{key}' must be an integer >= " in err[0], err
        assert not (tmp_path / "o").exists()
