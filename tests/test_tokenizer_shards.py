"""Token shards (encode_files, read_token_shard) and the ``lmforge tokenizer`` CLI."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from lmforge.cli import main
from lmforge.tokenizer import (
    Tokenizer,
    encode_files,
    read_shard_info,
    read_token_shard,
    shard_dtype,
    train_bpe,
)
from lmforge.utils.errors import LmforgeError

EOT = "<|endoftext|>"
TEXT = (
    "def main(argv):\n    return 0\n\n"
    "The quick brown fox jumps over the lazy dog. We'll see what's there, don't worry!\n"
    "Ünïcödé text, 日本語, numbers 12345 and 3.14159; tabs\tand  spaces   here.\n"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("shards")
    corpus = d / "corpus.txt"
    corpus.write_text((TEXT + EOT) * 40, encoding="utf-8")
    vocab, merges = train_bpe(corpus, 400, [EOT], workers=1)
    return Tokenizer(vocab, merges, [EOT]).save(d / "tok")


def _inputs(d: Path) -> list[Path]:
    d.mkdir(exist_ok=True)
    a = d / "a.txt"
    a.write_text(TEXT * 3, encoding="utf-8")
    b = d / "b.jsonl.gz"
    with gzip.open(b, "wt", encoding="utf-8") as f:
        for i in range(5):
            f.write(json.dumps({"text": f"doc {i}: " + TEXT[: 30 * (i + 1)]}) + "\n")
    c = d / "c.md"
    c.write_text(
        "# Title\n\nSome *markdown* " + EOT + " with a special inside.\n", encoding="utf-8"
    )
    return [a, b, c]


def test_encode_files_shard_and_sidecar(
    tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmforge.tokenizer.shards as shards

    monkeypatch.setattr(shards, "_MIN_JOB_BYTES", 1)  # one job per file: exercise the pool
    tok = Tokenizer.load(tok_dir)
    files = _inputs(tmp_path / "in")
    out = tmp_path / "out" / "train.bin"
    meta = encode_files(tok_dir, [tmp_path / "in"], out, workers=2)
    ids = read_token_shard(out)
    assert ids.dtype == np.uint16 and isinstance(ids, np.memmap)
    # Expected: every document, own encoder, eot after each, files in sorted order.
    docs = [TEXT * 3] + [f"doc {i}: " + TEXT[: 30 * (i + 1)] for i in range(5)]
    docs.append("# Title\n\nSome *markdown* " + EOT + " with a special inside.\n")
    expected = [i for d in docs for i in [*tok.encode(d), tok.eot_id]]
    assert ids.tolist() == expected
    assert meta == json.loads((out.parent / "train.bin.json").read_text())
    assert meta["format"] == "lmforge-tokens-v1" and meta["dtype"] == "uint16"
    assert meta["count"] == len(expected) and meta["documents"] == len(docs)
    assert meta["bytes"] == sum(len(d.encode()) for d in docs)
    assert meta["tokenizer_sha256"] == tok.sha256 and meta["vocab_size"] == tok.vocab_size
    assert meta["source_files"] == [str(f) for f in files]
    info = read_shard_info(out)
    assert info.count == len(expected) and info.source_files == tuple(meta["source_files"])
    # One worker and the slow own-encoder path give the same bytes.
    out2 = tmp_path / "out" / "serial.bin"
    encode_files(tok, [tmp_path / "in"], out2, workers=1, fast=False)
    assert out2.read_bytes() == out.read_bytes()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_shard_dtype_and_bad_shards(tmp_path: Path) -> None:
    assert shard_dtype(65536) == "uint16" and shard_dtype(65537) == "uint32"
    p = tmp_path / "x.bin"
    p.write_bytes(b"\x00" * 6)
    with pytest.raises(LmforgeError, match="no sidecar"):
        read_token_shard(p)
    (tmp_path / "x.bin.json").write_text(
        json.dumps({"format": "lmforge-tokens-v1", "dtype": "uint32", "count": 2, "vocab_size": 9})
    )
    with pytest.raises(LmforgeError, match="6 bytes on disk"):
        read_token_shard(p)


def test_cli_train_and_encode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"f{i}.txt").write_text((TEXT + f" file {i}\n") * 30, encoding="utf-8")
    tok = tmp_path / "tok"
    rc = main(
        ["tokenizer", "train", "--input", str(data), "--vocab-size", "350",
         "--special-token", EOT, "--out", str(tok), "--workers", "1", "--export"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "bytes/token" in out and "peak RSS" in out and "held-out" in out
    assert (tok / "tokenizer.json").is_file() and Tokenizer.load(tok).vocab_size == 350
    rc = main(
        ["tokenizer", "encode", "--tokenizer", str(tok), "--input", str(data),
         "--out", str(tmp_path / "s" / "all.bin"), "--workers", "1"]
    )  # fmt: skip
    assert rc == 0 and "uint16 tokens" in capsys.readouterr().out
    assert read_shard_info(tmp_path / "s" / "all.bin").documents == 4


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["train", "--input", "/nonexistent/x.txt", "--vocab-size", "300", "--out", "T"],
         "input not found"),
        (["train", "--input", "CORPUS", "--vocab-size", "200", "--out", "T"], "too small"),
        (["train", "--input", "EMPTY", "--vocab-size", "300", "--out", "T"], "empty corpus"),
        (["encode", "--tokenizer", "CORPUS_DIR", "--input", "CORPUS", "--out", "T/x.bin"],
         "not an lmforge tokenizer"),
        (["encode", "--tokenizer", "BAD_TOK", "--input", "CORPUS", "--out", "T/x.bin"],
         "not valid JSON"),
    ],
)  # fmt: skip
def test_cli_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], match: str
) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n", encoding="utf-8")
    empty = tmp_path / "e.txt"
    empty.write_text("", encoding="utf-8")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "lmforge_tokenizer.json").write_text('{"format": "lmforge-bpe-v1"}')
    (bad / "vocab.json").write_text("{oops")
    (bad / "merges.txt").write_text("#version: 0.2\n")
    subst = {
        "CORPUS": str(corpus),
        "EMPTY": str(empty),
        "CORPUS_DIR": str(tmp_path),
        "BAD_TOK": str(bad),
        "T": str(tmp_path / "t"),
        "T/x.bin": str(tmp_path / "t" / "x.bin"),
    }
    rc = main(["tokenizer", *[subst.get(a, a) for a in argv]])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and match in err and "Traceback" not in err


def test_gutenberg_sample(shared_data: Path, tmp_path: Path) -> None:
    """Real text: train on one Gutenberg book, check the fast shard path against encode()."""
    books = sorted((shared_data / "text" / "gutenberg").glob("*.txt"))
    if not books:
        pytest.skip("no Gutenberg books in shared data")
    book = tmp_path / "book.txt"
    book.write_bytes(books[0].read_bytes()[:300_000])
    vocab, merges = train_bpe(book, 1000, [EOT], workers=1)
    tok = Tokenizer(vocab, merges, [EOT])
    meta = encode_files(tok, [book], tmp_path / "b.bin", workers=1)
    ids = read_token_shard(tmp_path / "b.bin")
    text = book.read_text(encoding="utf-8", errors="replace")
    assert ids.tolist() == [*tok.encode(text), tok.eot_id]
    assert 2.5 < meta["bytes"] / meta["count"] < 5.0  # English BPE at 1k vocab: about 2.8


@pytest.mark.slow
def test_gutenberg_exports_agree(shared_data: Path, tmp_path: Path) -> None:
    """Slow tier: 4 MB of books, vocab 8000; own encoder, tiktoken and HF exports agree."""
    from tokenizers import Tokenizer as HFTokenizer

    from lmforge.tokenizer import save_hf_tokenizer_json, to_tiktoken

    books = sorted((shared_data / "text" / "gutenberg").glob("*.txt"))
    if len(books) < 2:
        pytest.skip("not enough Gutenberg books in shared data")
    train = tmp_path / "train.txt"
    train.write_bytes(EOT.encode().join(b.read_bytes() for b in books[:-1])[:4_000_000])
    vocab, merges = train_bpe(train, 8000, [EOT], workers=2)
    tok = Tokenizer(vocab, merges, [EOT])
    held = books[-1].read_text(encoding="utf-8", errors="replace")[:500_000] + EOT + "tail"
    ids = tok.encode(held)
    assert to_tiktoken(tok).encode(held, allowed_special="all") == ids
    hf = HFTokenizer.from_file(str(save_hf_tokenizer_json(tok, tmp_path / "tokenizer.json")))
    assert hf.encode(held, add_special_tokens=False).ids == ids
    assert tok.decode(ids) == held


def test_cli_train_accepts_jsonl_and_parquet(tmp_path: Path) -> None:
    """`tokenizer train` takes .jsonl.gz and .parquet like every data argument; documents are
    joined by the special token, so the trained vocabulary has it and no merge spans two docs."""
    import gzip
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmforge.cli import main
    from lmforge.tokenizer import Tokenizer

    docs = [f"document number {i} talks about tokenizers and merges" for i in range(200)]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in docs[:100])
    pq.write_table(pa.table({"body": docs[100:]}), tmp_path / "b.parquet")
    out = tmp_path / "tok"
    rc = main(
        ["tokenizer", "train", "--input", str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.parquet"),
         "--text-key", "body", "--vocab-size", "300", "--out", str(out), "--holdout-files", "0"]
    )  # fmt: skip
    assert rc == 0
    tok = Tokenizer.load(out)
    assert tok.vocab_size == 300 and tok.eot_id is not None
    text = "document number 7 talks about tokenizers"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode())  # merges were learned from the records
