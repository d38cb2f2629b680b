"""`--config FILE` for the post-training commands: flags override the file, the file overrides
the defaults; unknown keys, wrong types, other tables: one line naming the key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmforge.cli import build_parser, main
from lmforge.posttrain._cli import read_config, resolve_options

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "posttrain"


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _resolve(argv: list[str]):
    args, extra = build_parser().parse_known_args(argv)
    assert not extra
    return resolve_options(args)


def test_shipped_configs_are_valid() -> None:
    files = sorted(CONFIGS.glob("*.toml"))
    assert {f.name for f in files} >= {
        "sft-smollm2.toml",
        "dpo-hh-smollm2.toml",
        "rl-arithmetic.toml",
        "rl-gsm8k-smollm2.toml",
    }
    for f in files:
        command = f.name.split("-")[0]
        args, _ = build_parser().parse_known_args([command])
        assert args.posttrain_command == command
        assert read_config(f, command, args.posttrain_spec)  # every key checked, none unknown


def test_flags_override_the_file_which_overrides_defaults(tmp_path: Path) -> None:
    cfg = CONFIGS / "rl-arithmetic.toml"
    args = _resolve(["rl", "--config", str(cfg), "--iterations", "3", "--algo", "dapo"])
    assert (args.iterations, args.algo) == (3, "dapo")  # flags
    assert (args.group_size, args.warmup_steps, args.out) == (8, 1000, "runs/rl-arithmetic")
    assert (args.kl_coef, args.pipeline, args.max_lag) == (0.0, False, 4)  # defaults
    plain = _resolve(["rl"])
    assert (plain.iterations, plain.task, plain.out) == (60, "arithmetic", None)
    f = tmp_path / "s.toml"
    f.write_text('[sft]\nmodel = "m"\ndata = "d.jsonl"\nno_packing = true\nlr = 1\n')
    args = _resolve(["sft", "--config", str(f), "--data", "other.jsonl"])
    assert (args.model, args.data, args.no_packing) == ("m", "other.jsonl", True)
    assert args.lr == 1.0 and isinstance(args.lr, float)  # an int where a float goes is fine


@pytest.mark.parametrize(
    ("text", "command", "message"),
    [
        ("[sft]\nstepz = 3\n", "sft", "unknown key 'stepz'"),
        ("[sft]\nbatch-size = 3\n", "sft", "did you mean 'batch_size'"),
        ('[sft]\nsteps = "100"\n', "sft", "key 'steps' must be an integer, got str '100'"),
        ("[sft]\nlr = true\n", "sft", "key 'lr' must be a number"),
        ("[sft]\nno_packing = 1\n", "sft", "key 'no_packing' must be true or false"),
        ('[dpo]\nloss = "kto"\n', "dpo", "key 'loss' is 'kto', expected one of dpo, ipo"),
        ('[rl]\ntask = "arithmetic"\n', "sft", "table [rl] does not belong to `lmforge sft`"),
        ("steps = 3\n", "sft", "top-level key 'steps' does not belong"),
        ("[sft\n", "sft", "is not valid TOML"),
        ('[sft]\ndata = "d.jsonl"\n', "sft", "`lmforge sft` needs --model (or 'model' in"),
    ],
)
def test_bad_config_is_one_line(
    tmp_path: Path, text: str, command: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    assert main([command, "--config", str(f), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()  # nothing written for a bad config


def test_missing_file_and_missing_required_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dpo", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["distill", "--teacher", "t", "--student", "s"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs --data" in err[0]


def test_run_saves_resolved_config_that_repeats_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rl"
    tiny = ["--digits", "1", "--warmup-steps", "3", "--iterations", "1", "--prompts-per-step",
            "2", "--group-size", "2", "--eval-size", "4", "--quiet", "--out", str(out)]  # fmt: skip
    assert main(["rl", "--config", str(CONFIGS / "rl-arithmetic.toml"), *tiny]) == 0
    saved = out / "config.toml"
    args = _resolve(["rl", "--config", str(saved)])
    assert (args.digits, args.iterations, args.group_size, args.lr) == (1, 1, 2, 1e-3)
    assert args.out == str(out) and args.quiet is True
    first = json.loads((out / "summary.json").read_text())
    assert main(["rl", "--config", str(saved)]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["accuracy_after"] == first["accuracy_after"]  # same seed, same options
    assert again["samples"] == first["samples"] == 4
