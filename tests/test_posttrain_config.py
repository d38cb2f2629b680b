"""The post-training commands on the one config tree: `[sft]`, `[dpo]`, `[rl]`, `[distill]` and
`[train]`; defaults < command defaults < --config file < dotted overrides < flags; every bad value
is one line at load, before any model is read."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import RunConfig
from lmforge.posttrain._cli import COMMAND_DEFAULTS, resolve_config
from lmforge.posttrain.config import ALGORITHM_NAMES
from lmforge.posttrain.losses import ALGORITHMS
from lmforge.utils.config import load_config, read_toml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "posttrain"


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_algorithm_names_match_the_losses() -> None:
    assert set(ALGORITHM_NAMES) == {*ALGORITHMS, "ppo"}


def test_shipped_configs_are_run_configs() -> None:
    files = sorted(CONFIGS.glob("*.toml"))
    assert {f.name for f in files} >= {"sft-smollm2.toml", "dpo-hh-smollm2.toml",
                                      "rl-arithmetic.toml", "rl-gsm8k-smollm2.toml",
                                      "distill-smollm2.toml"}  # fmt: skip
    for f in files:
        data = read_toml(f)
        assert set(data) <= {"sft", "dpo", "rl", "distill", "train"}, f
        command = f.name.split("-")[0]
        load_config(RunConfig, f, base=COMMAND_DEFAULTS[command])  # every key known and valid


def test_precedence_defaults_command_file_overrides_flags(tmp_path: Path) -> None:
    plain = resolve_config("rl")
    assert (plain.rl.iterations, plain.train.lr, plain.train.out_dir) == (60, 1e-3, "runs/rl")
    assert (plain.train.beta2, plain.train.weight_decay) == (0.99, 0.0)  # the command's
    cfg = resolve_config("rl", str(CONFIGS / "rl-arithmetic.toml"), ["train.lr=2e-3"],
                         {"rl.algo": "dapo"})  # fmt: skip
    assert (cfg.rl.algo, cfg.rl.iterations, cfg.train.lr) == ("dapo", 40, 2e-3)
    assert cfg.train.out_dir == "runs/rl-arithmetic"
    f = tmp_path / "s.toml"
    f.write_text('[sft]\nmodel = "m"\ndata = "d.jsonl"\npacking = false\n[train]\nlr = 1\n')
    cfg = resolve_config("sft", str(f), (), {"sft.data": "other.jsonl"}, examples_per_step=10)
    assert (cfg.sft.model, cfg.sft.data, cfg.sft.packing) == ("m", "other.jsonl", False)
    assert cfg.train.lr == 1.0 and cfg.train.grad_accum == 3  # 10 examples / 4 per micro-batch


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sft", "--lr", "-1"], "train.lr must be positive, got -1.0"),
        (["dpo", "--lr", "-1"], "train.lr must be positive"),
        (["rl", "--lr", "-1"], "train.lr must be positive"),
        (["rl", "--lr", "0"], "train.lr must be positive"),
        (["dpo", "--beta", "1.5"], r"dpo.beta must lie in (0, 1), got 1.5"),
        (["dpo", "--beta", "0"], r"dpo.beta must lie in (0, 1)"),
        (["rl", "--group-size", "1"], "rl.group_size must be at least 2 for grpo"),
        (["rl", "--algo", "nope"], "rl.algo 'nope' is unknown"),
        (["rl", "--micro-batch", "0"], "train.batch_size must be positive, got 0"),
        (["rl", "--eval-every", "-1"], "train.eval_every must be 0 or more"),
        (["rl", "--prompts-per-step", "-2"], "rl.prompts_per_step must be at least 1"),
        (["rl", "--queue-size", "-1"], "rl.queue_size must be 0 or more"),
        (["rl", "--temperature", "0"], "rl.temperature must be positive"),
        (["rl", "--train.lr=oops"], "train.lr"),
        (["rl", "--rl.stepz=3"], "unknown config key 'rl.stepz'"),
        (["distill", "--beta", "2"], "distill.beta must lie in [0, 1]"),
        (["sft", "--data", "d.jsonl"], "`lmforge sft` needs --model"),
        (["distill", "--teacher", "t", "--student", "s"], "needs --data"),
    ],
)
def test_bad_value_is_one_line_before_any_model(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["--model", str(tmp_path / "absent.gguf")] if argv[0] in ("sft", "dpo") else []
    if "--data" not in argv and argv[0] in ("sft", "dpo") and "needs" not in message:
        model += ["--data", str(tmp_path / "absent.jsonl")]
    if argv[0] == "sft" and "needs --model" in message:
        model = []
    assert main([*argv, *model, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()  # nothing written for a bad config


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[sft]\nstepz = 3\n", "unknown config key 'sft.stepz'"),
        ('[train]\nmax_steps = "100"\n', "train.max_steps"),
        ("[sft]\nlr = -2e-5\n", "unknown config key 'sft.lr'"),  # lr lives in [train]
        ("[train]\nlr = -2e-5\n", "train.lr must be positive"),
        ('[dpo]\nloss = "kto"\n', "dpo.loss"),
        ("[sft\n", "is not valid TOML"),
    ],
)
def test_bad_config_file_is_one_line(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    argv = ["sft", "--config", str(f), "--model", "m", "--data", "d", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "o").exists()


def test_cli_refuses_a_negative_lr_at_once() -> None:
    # Before: `sft --lr -1` tracebacked after 20-53 s of loading the model.
    done = subprocess.run(
        [sys.executable, "-m", "lmforge", "sft", "--lr", "-1", "--model",
         str(REPO.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"),
         "--data", "x.jsonl"],
        capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO / "src")},
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "train.lr must be positive" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_run_saves_the_resolved_tree_that_repeats_it(tmp_path: Path) -> None:
    out = tmp_path / "rl"
    tiny = ["--digits", "1", "--warmup-steps", "3", "--iterations", "1", "--prompts-per-step",
            "2", "--group-size", "2", "--eval-size", "4", "--quiet", "--out", str(out)]  # fmt: skip
    assert main(["rl", "--config", str(CONFIGS / "rl-arithmetic.toml"), *tiny]) == 0
    saved = out / "config.toml"
    cfg = resolve_config("rl", str(saved))
    assert (cfg.rl.digits, cfg.rl.iterations, cfg.rl.group_size, cfg.train.lr) == (1, 1, 2, 1e-3)
    assert cfg.train.out_dir == str(out) and cfg.train.progress is False
    first = json.loads((out / "summary.json").read_text())
    assert first["samples"] == 4
    again = tmp_path / "again"
    assert main(["rl", "--config", str(saved), "--out", str(again)]) == 0
    second = json.loads((again / "summary.json").read_text())
    assert second["accuracy_after"] == first["accuracy_after"]  # same seed, same tree
