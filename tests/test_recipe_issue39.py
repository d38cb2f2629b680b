"""Issue 39 item 6 for the two commands the recipe's training stages run that
tests/test_one_line_errors.py does not cover: `lmforge train` and `lmforge sft` into a read-only
output folder are one line naming the folder, before any model or data is loaded.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest

from lmforge.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder no file can be created in (chmod 555; as root, who writes anyway, mkstemp in it
    raises the PermissionError a normal user gets)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:
        real = tempfile.mkstemp

        def refuse(*args, **kwargs):
            where = Path(kwargs.get("dir") or (args[2] if len(args) > 2 else "."))
            if where.resolve().is_relative_to(ro.resolve()):
                raise PermissionError(errno.EACCES, "Permission denied")
            return real(*args, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    yield ro
    ro.chmod(0o755)


@pytest.mark.parametrize("command", ["train", "sft"])
def test_read_only_out_is_one_line(
    command: str, unwritable: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    if command == "train":
        argv = ["train", "--config", str(REPO / "configs" / "demo.toml"),
                f"--train.out_dir={unwritable}", "--train.device=cpu"]  # fmt: skip
    else:  # the model is never read: the folder is checked first
        argv = ["sft", "--model", str(tmp_path / "no-model"), "--data",
                str(REPO / "examples" / "chat" / "sft.jsonl"), "--out", str(unwritable),
                "--device", "cpu"]  # fmt: skip
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert "cannot write to train.out_dir" in err[0] and str(unwritable) in err[0]
    assert "Traceback" not in err[0]
