"""Tokenizer commands on bad input: disk full, invalid values, binary files given as text."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest

from lmforge.cli import main
from lmforge.tokenizer import Tokenizer, train_bpe
from lmforge.utils.corpus import looks_binary

EOT = "<|endoftext|>"
TEXT = "The quick brown fox jumps over the lazy dog. " * 40 + "Ünïcødé çafé ✓\n"


@pytest.fixture
def tok_dir(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3)
    vocab, merges = train_bpe([corpus], 300, [EOT], workers=1)
    return Tokenizer(vocab, merges, [EOT]).save(tmp_path / "tok")


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    # Progress bars share stderr; the error itself is one line and there is no traceback.
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lmforge ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_encode_disk_full_is_one_line_and_keeps_the_old_shard(
    tmp_path: Path,
    tok_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = tmp_path / "in.txt"
    src.write_text(TEXT)
    out = tmp_path / "tokens" / "train.bin"
    args = ["tokenizer", "encode", "--tokenizer", str(tok_dir), "--input", str(src)]
    assert main([*args, "--out", str(out), "--workers", "1"]) == 0
    old = out.read_bytes()
    capsys.readouterr()
    from lmforge.tokenizer import shards

    def full(*a: object, **kw: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "_encode_job", full)
    assert main([*args, "--out", str(out), "--workers", "1"]) == 2
    line = _one_error_line(capsys)
    assert "no space left" in line and str(out.parent) in line and "kept unchanged" in line
    assert out.read_bytes() == old
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.bin", "train.bin.json"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(["--workers", "0"], "--workers must be at least 1"), (["--workers", "-2"], "got -2")],
)
def test_encode_refuses_invalid_values(
    tmp_path: Path,
    tok_dir: Path,
    extra: list[str],
    needle: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = tmp_path / "in.txt"
    src.write_text(TEXT)
    rc = main(
        ["tokenizer", "encode", "--tokenizer", str(tok_dir), "--input", str(src), "--out",
         str(tmp_path / "o.bin"), *extra]
    )  # fmt: skip
    assert rc == 2 and needle in _one_error_line(capsys)
    assert not (tmp_path / "o.bin").exists()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["--holdout-files", "1.5"], "--holdout-files must be in [0, 1)"),
        (["--holdout-files", "-0.1"], "--holdout-files"),
    ],
)
def test_train_refuses_invalid_values(
    tmp_path: Path, extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.txt"
    src.write_text(TEXT)
    rc = main(
        ["tokenizer", "train", "--input", str(src), "--vocab-size", "300", "--out",
         str(tmp_path / "tok"), *extra]
    )  # fmt: skip
    assert rc == 2 and needle in _one_error_line(capsys)


def test_binary_training_file_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text(TEXT * 2)
    (data / "b.txt").write_bytes(bytes(range(256)) * 40)  # an executable or image renamed .txt
    rc = main(
        ["tokenizer", "train", "--input", str(data), "--vocab-size", "300", "--out",
         str(tmp_path / "tok"), "--workers", "1", "--holdout-files", "0"]
    )  # fmt: skip
    assert rc == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    binary = [ln for ln in warnings if "does not look like text" in ln]
    assert len(binary) == 1 and "b.txt" in binary[0] and "NUL" in binary[0]
    assert any("were not valid UTF-8" in ln for ln in warnings)  # and its bytes are counted


def test_looks_binary(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    # Multi-byte characters cut at the probe's end are not counted as binary.
    text.write_text("çé✓ " * 5000)
    assert looks_binary(text) is None
    latin1 = tmp_path / "l.txt"
    latin1.write_bytes("café crème brûlée ".encode("latin-1") * 500)
    assert looks_binary(latin1) is None  # a few stray bytes per line: still text
    ctrl = tmp_path / "c.bin"
    ctrl.write_bytes(bytes(range(1, 32)) * 300)
    assert "not UTF-8 text" in (looks_binary(ctrl) or "")
    nul = tmp_path / "n.bin"
    nul.write_bytes(b"abc\x00def")
    assert looks_binary(nul) == "it holds NUL bytes"


@pytest.mark.parametrize("workers", ["1", "2"])
def test_encode_counts_invalid_utf8(
    tmp_path: Path, tok_dir: Path, workers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_bytes(b"caf\xe9 au lait \xff\xfe\n" + TEXT.encode())
    (data / "b.jsonl").write_bytes(b'{"text": "ok \\u00e9"}\n{"text": "bad \xc3 end"}\n')
    out = tmp_path / "t.bin"
    rc = main(["tokenizer", "encode", "--tokenizer", str(tok_dir), "--input", str(data),
               "--out", str(out), "--workers", workers])  # fmt: skip
    assert rc == 0
    import json

    meta = json.loads((tmp_path / "t.bin.json").read_text())
    assert meta["invalid_utf8_bytes"] == 4 and meta["documents"] == 3
    assert "4 bytes of the input were not valid UTF-8" in capsys.readouterr().err
    ids = np.fromfile(out, dtype=np.uint16).tolist()
    assert Tokenizer.load(tok_dir).decode(ids).count("\ufffd") == 4


@pytest.mark.parametrize("workers", ["1", "2"])
def test_train_counts_invalid_utf8(
    tmp_path: Path, workers: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        (data / f"{i}.txt").write_bytes(TEXT.encode() * 2 + b"na\xefve \xe2\x82 cut\n")
    rc = main(["tokenizer", "train", "--input", str(data), "--vocab-size", "300", "--out",
               str(tmp_path / "tok"), "--workers", workers, "--holdout-files", "0"])  # fmt: skip
    assert rc == 0
    err = capsys.readouterr().err
    assert "6 bytes of the training text were not valid UTF-8" in err  # 3 per file


def test_train_bpe_matches_the_replace_decoding(tmp_path: Path) -> None:
    # Counting must not change what is trained on: errors="replace" text, one U+FFFD per bad run.
    raw = TEXT.encode() + b"caf\xe9 \xe2\x82\xe2\x82 end\n"
    bad = tmp_path / "bad.txt"
    bad.write_bytes(raw)
    clean = tmp_path / "clean.txt"
    clean.write_text(raw.decode("utf-8", "replace"))
    stats: dict[str, int] = {}
    assert train_bpe([bad], 320, [EOT], workers=1, stats=stats) == train_bpe(
        [clean], 320, [EOT], workers=1
    )
    assert stats == {"invalid_utf8_bytes": 5}
