"""`lmforge scaling`: every subcommand has --help with examples, registering imports nothing heavy,
and user mistakes end in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.cli import main

SUBCOMMANDS = ("plan", "run", "fit", "predict", "branch", "coord-check", "lr-transfer")


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_help_has_examples(sub: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["scaling", sub, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"lmforge scaling {sub}" in out


def test_registering_imports_no_numpy_or_torch() -> None:
    code = (
        "import sys, argparse\n"
        "from lmforge.scaling import _cli\n"
        "p = argparse.ArgumentParser(); _cli.register(p.add_subparsers())\n"
        "print(sorted(m for m in ('torch', 'numpy', 'scipy') if m in sys.modules))\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": src},
        check=True,
    ).stdout
    assert out.strip() == "[]"


def test_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["scaling", "fit", "--runs", str(tmp_path / "none.jsonl")]) == 2
    assert "runs file not found" in capsys.readouterr().err
    assert main(["scaling", "fit", "--runs", str(tmp_path / "x.csv"), "--predict", "1e2x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    (tmp_path / "fit.json").write_text(json.dumps({"method": "isoflop-parabola", "params": {}}))
    assert (
        main(
            [
                "scaling",
                "predict",
                "--fit",
                str(tmp_path / "fit.json"),
                "--parameters",
                "1e6",
                "--tokens",
                "1e7",
            ]
        )
        == 2
    )
    assert "needs a parametric fit" in capsys.readouterr().err
    assert main(["scaling", "plan", "--budgets", "1e3", "--depths", "1"]) == 2
    assert "no point of the grid" in capsys.readouterr().err
