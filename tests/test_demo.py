"""``lmforge demo``: the CPU tier of the recipe, its flags as recipe overrides."""

from __future__ import annotations

import argparse
import shutil
import sysconfig
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.demo import demo_overrides, tiny_cpu_recipe
from lmforge.recipe import load_recipe
from lmforge.recipe.markers import DONE, read_marker

REPO = Path(__file__).resolve().parents[1]


def _args(*argv: str) -> argparse.Namespace:
    from lmforge._demo_cli import register

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    return sub.choices["demo"].parse_args(list(argv))


def test_demo_defaults_are_the_tiny_cpu_recipe() -> None:
    # A wall-clock budget made the demo's quality depend on the machine's load (issue 21 item 4).
    args = _args()
    assert args.max_minutes == 0 and demo_overrides(args) == []
    cfg = load_recipe(tiny_cpu_recipe())
    assert cfg.recipe.out == "runs/demo" and cfg.recipe.device == "cpu"
    assert cfg.pretrain.steps > 0 and cfg.recipe.threads == 0  # step budget; threads: auto
    assert cfg.tokenizer.vocab_size == 4096 and cfg.pretrain.config == "configs/demo.toml"


def test_demo_flags_are_recipe_overrides(tmp_path: Path) -> None:
    args = _args("--preset", "tiny", "--vocab-size", "300", "--max-steps", "7", "--device", "cpu",
                 "--out", str(tmp_path), "--max-minutes", "2", "--data", "examples/text",
                 "--lr", "1e-3", "--batch-size", "4", "--tokenizer-mb", "0.5")  # fmt: skip
    cfg = load_recipe(tiny_cpu_recipe(), demo_overrides(args))
    assert cfg.tokenizer.vocab_size == 300 and cfg.pretrain.steps == 7
    assert cfg.pretrain.config.endswith("configs/tiny.toml") and cfg.recipe.out == str(tmp_path)
    assert cfg.pretrain.overrides == ("train.max_minutes=2.0",)
    assert cfg.data.files == ("examples/text",) and cfg.data.pipelines == ()
    assert cfg.pretrain.lr == 1e-3 and cfg.pretrain.batch_size == 4
    assert cfg.tokenizer.train_mb == 0.5


def test_demo_bad_data_path_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "input not found" in err[0]


def test_demo_bad_preset_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--preset", "nosuch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such preset" in err[0]


def test_demo_on_user_data_until_pretrain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = tmp_path / "corpus"
    data.mkdir()
    for name in ("os.py", "argparse.py", "dataclasses.py", "functools.py", "typing.py", "ast.py"):
        shutil.copy(stdlib / name, data / name)
    monkeypatch.chdir(REPO)  # the recipe's relative paths (configs/) are the repository's
    out = tmp_path / "demo"
    argv = ["demo", "--recipe", "tests/data/recipe-mini.toml", "--data", str(data), "--out",
            str(out), "--max-steps", "6", "--until", "pretrain", "--sample-tokens", "4"]  # fmt: skip
    assert main(argv) == 0
    pre = read_marker(out / "train" / DONE)
    assert pre is not None and pre["metrics"]["steps"] == 6  # the step budget, exactly
    assert "samples of the pretrained model" in capsys.readouterr().out
    assert main(argv) == 0  # a rerun skips every finished stage
    assert "pretrain: already done" in capsys.readouterr().err
