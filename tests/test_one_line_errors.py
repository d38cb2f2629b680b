"""What a new user hit first (issue 39 item 6): each mistake is one line, never a traceback.

A read-only folder cannot be made with chmod when the tests run as root (root writes anyway), so
:func:`unwritable` then makes the operating system's refusal explicit: creating a file in that
folder raises the same PermissionError a normal user gets.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.scaling.fit import ParametricFit, ParametricLaw, fit_warnings, parametric_report
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import ensure_writable_dir, iter_jsonl

REPO = Path(__file__).resolve().parents[1]
TEXT = str(REPO / "examples" / "text" / "tinyshakespeare" / "input.txt")


@pytest.fixture
def unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder no file can be created in (chmod 555; as root, mkstemp refuses it)."""
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


def _one_line(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    err = [e for e in err if not e.startswith(("pre-tokenize", "merges"))]  # progress bars
    assert len(err) == 1, err
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def test_ensure_writable_dir(tmp_path: Path, unwritable: Path) -> None:
    assert ensure_writable_dir(tmp_path / "a" / "b").is_dir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(LmforgeError, match="is a file, expected a folder"):
        ensure_writable_dir(tmp_path / "f")
    with pytest.raises(LmforgeError, match=r"cannot write to output folder .*Permission denied"):
        ensure_writable_dir(unwritable)


def test_tokenizer_train_read_only_out(unwritable: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["tokenizer", "train", "--input", TEXT, "--vocab-size", "260", "--out",
               str(unwritable / "tok")])  # fmt: skip
    assert rc == 2
    _one_line(capsys, "cannot write to --out", "Permission denied")


def test_tokenizer_train_out_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "existing.txt"
    f.write_text("x")
    rc = main(["tokenizer", "train", "--input", TEXT, "--vocab-size", "260", "--out", str(f)])
    assert rc == 2
    _one_line(capsys, "is a file, expected a folder")


def test_tokenizer_encode_out_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["tokenizer", "encode", "--tokenizer", str(tmp_path), "--input", TEXT, "--out",
               str(tmp_path)])  # fmt: skip
    assert rc == 2
    _one_line(capsys, "is a directory")


def test_hf_export_and_import_read_only_out(
    tmp_path: Path, unwritable: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["hf", "export", "--checkpoint", str(tmp_path), "--out", str(unwritable)]) == 2
    _one_line(capsys, "cannot write to --out", "Permission denied")
    assert main(["hf", "import", "--model", str(tmp_path), "--out", str(unwritable / "c")]) == 2
    _one_line(capsys, "cannot write to --out")


def test_config_that_is_a_directory_or_empty(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--config", str(tmp_path)]) == 2
    _one_line(capsys, "is a directory, expected a file")
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing here\n")
    assert main(["train", "--config", str(empty)]) == 2  # not the 162M default on the CPU
    _one_line(capsys, "is empty")


def test_jsonl_reader_names_a_directory(tmp_path: Path) -> None:
    with pytest.raises(LmforgeError, match="is a directory, expected a file"):
        list(iter_jsonl(tmp_path, "runs file"))


def test_pairwise_writes_under_runs_not_the_source_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    src = tmp_path / "examples" / "eval"
    src.mkdir(parents=True)
    shutil.copy(REPO / "examples" / "eval" / "battles.jsonl", src / "battles.jsonl")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--pairwise", "examples/eval/battles.jsonl"]) == 0
    assert not (src / "ratings.json").exists()
    ratings = json.loads((tmp_path / "runs" / "ratings" / "battles.json").read_text())
    assert ratings["n_games"] > 0
    capsys.readouterr()
    assert main(["eval", "--pairwise", "examples/eval"]) == 2
    _one_line(capsys, "is a directory")


def test_scaling_fit_warnings() -> None:
    # the case: E collapsed to 1.7e-38 on 6 points, printed with no warning
    w = fit_warnings({"E": 1.7e-38, "A": 200.0, "alpha": 0.3, "beta": 0.28}, None, 2.0)
    assert len(w) == 1 and "E = 1.7e-38 collapsed" in w[0]
    w = fit_warnings({"E": 1.7, "alpha": 0.0, "beta": 10.0}, None, 2.0)
    assert len(w) == 2 and all("sits on its bound" in x for x in w)
    w = fit_warnings({"E": 1.7, "A": 50.0, "B": 3.0}, {"A": [0.5, 4e4], "B": [-1.0, 5.0]}, 2.0)
    assert "spans 5 orders of magnitude" in w[0] and "includes zero" in w[1]
    assert fit_warnings({"E": 1.7, "alpha": 0.3, "beta": 0.3}, {"E": [1.6, 1.8]}, 2.0) == []
    law = ParametricLaw(E=1.7e-38, A=200.0, B=300.0, alpha=0.3, beta=0.3)
    fit = ParametricFit(law, 1e-5, (0.0,) * 5, 24, False, {}, min_loss=2.0)
    assert any("collapsed" in x for x in parametric_report(fit, [])["warnings"])
