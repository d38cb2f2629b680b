"""Exact document, exact line and MinHash near-duplicate deduplication (lmforge.data.dedup)."""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lmforge.data import (
    exact_document_deduplication,
    exact_line_deduplication,
    jaccard,
    minhash_deduplication,
)
from lmforge.data.dedup import minhash_params, minhash_signature, shingle_hashes

# Every test here hashes through xxhash, part of the [data] extra.
pytestmark = pytest.mark.requires("xxhash")

VOCAB = [f"w{i}" for i in range(5000)]


def _doc(rng: random.Random, n: int = 120) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"id": f"{path.stem}-{i}", "text": t}) + "\n" for i, t in enumerate(texts)
        )
    )
    return path


def _read_jsonl_gz(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in gzip.decompress(path.read_bytes()).splitlines()]


def test_exact_line_dedup_matches_reference(tmp_path: Path) -> None:
    rng = random.Random(0)
    pool = [f"line {i} " + _doc(rng, 5) for i in range(60)]
    files = []
    for k in range(4):
        lines = [rng.choice(pool) for _ in range(30)] + [f"unique {k} {j}" for j in range(5)]
        p = tmp_path / "in" / f"doc{k}.txt"
        p.parent.mkdir(exist_ok=True)
        p.write_text("\n".join(lines) + "\n")
        files.append(p)
    counts = Counter(ln for p in files for ln in p.read_text().splitlines())
    st = exact_line_deduplication(files, tmp_path / "out", num_buckets=4, workers=2)
    assert [o.name for o in st.outputs] == [p.name for p in files]
    for p in files:
        want = [ln for ln in p.read_text().splitlines() if counts[ln] == 1]
        got = (tmp_path / "out" / p.name).read_text().splitlines()
        assert got == want
    assert st.lines_in == sum(counts.values())
    assert st.lines_out == sum(1 for c in counts.values() if c == 1)
    assert not any(x.name.startswith(".dedup") for x in (tmp_path / "out").iterdir())


def test_exact_line_dedup_jsonl_drops_emptied_documents(tmp_path: Path) -> None:
    a = _write_jsonl(tmp_path / "a.jsonl", ["shared\nkeep a", "shared"])
    b = _write_jsonl(tmp_path / "b.jsonl", ["keep b\nshared"])
    exact_line_deduplication([a, b], tmp_path / "out")
    ra = _read_jsonl_gz(tmp_path / "out" / "a.jsonl.gz")
    rb = _read_jsonl_gz(tmp_path / "out" / "b.jsonl.gz")
    assert [r["text"] for r in ra] == ["keep a"]
    assert [r["text"] for r in rb] == ["keep b\n"]


def test_exact_document_dedup_keeps_first(tmp_path: Path) -> None:
    a = _write_jsonl(tmp_path / "a.jsonl", ["x", "y", "x", "z"])
    b = _write_jsonl(tmp_path / "b.jsonl", ["y", "w"])
    st = exact_document_deduplication([a, b], tmp_path / "out", num_buckets=3)
    assert (st.docs_in, st.docs_out) == (6, 4)
    assert [r["id"] for r in _read_jsonl_gz(tmp_path / "out" / "a.jsonl.gz")] == [
        "a-0",
        "a-1",
        "a-3",
    ]
    assert [r["id"] for r in _read_jsonl_gz(tmp_path / "out" / "b.jsonl.gz")] == ["b-1"]


def test_minhash_signature_matches_slow_reference() -> None:
    sh = shingle_hashes("The quick brown fox jumps over the lazy dog again and again", 3)
    a, b = minhash_params(16, seed=3)
    fast = minhash_signature(sh, a, b)
    p = 4294967291
    slow = [min((int(ai) * int(h) + int(bi)) % p for h in sh) for ai, bi in zip(a[:, 0], b[:, 0])]
    assert fast.tolist() == slow


def test_shingle_jaccard_matches_string_jaccard() -> None:
    rng = random.Random(1)
    base = _doc(rng, 80).split()
    for edits in (0, 3, 10, 30):
        other = list(base)
        for _ in range(edits):
            other[rng.randrange(len(other))] = rng.choice(VOCAB)
        x, y = " ".join(base), " ".join(other)
        sx, sy = shingle_hashes(x, 5), shingle_hashes(y, 5)
        inter = len(np.intersect1d(sx, sy))
        assert inter / (len(sx) + len(sy) - inter) == pytest.approx(jaccard(x, y, 5), abs=1e-9)
    # Normalisation: case, punctuation and accents do not matter.
    assert jaccard("Héllo, World! How are you", "hello world how are you", 2) == 1.0


def test_minhash_removes_planted_near_duplicates(tmp_path: Path) -> None:
    rng = random.Random(2)
    texts, near, far = [], [], []
    for i in range(60):
        base = _doc(rng).split()
        texts.append(" ".join(base))
        if i % 4 == 0:  # near duplicate: 2 substitutions → Jaccard ≈ 0.85
            t = list(base)
            for _ in range(2):
                t[rng.randrange(len(t))] = "CHANGED"
            near.append((" ".join(base), " ".join(t)))
            texts.append(" ".join(t))
        elif i % 4 == 1:  # distant: 30 substitutions → Jaccard well below 0.8
            t = list(base)
            for _ in range(30):
                t[rng.randrange(len(t))] = rng.choice(VOCAB)
            far.append(" ".join(t))
            texts.append(" ".join(t))
    for x, y in near:
        assert jaccard(x, y) >= 0.8
    files = [_write_jsonl(tmp_path / f"f{k}.jsonl", texts[k::3]) for k in range(3)]
    st = minhash_deduplication(files, 128, 16, 5, 0.8, tmp_path / "out", num_partitions=4)
    kept = [r["text"] for f in files for r in _read_jsonl_gz(tmp_path / "out" / f"{f.name}.gz")]
    assert st.docs_in == len(texts) and st.docs_out == len(texts) - len(near)
    assert set(kept) <= set(texts)  # kept documents' text unchanged
    for x, y in near:
        assert (x in kept) != (y in kept)
    for t in far:
        assert t in kept
    # Parallel workers give the same result.
    st2 = minhash_deduplication(files, 128, 16, 5, 0.8, tmp_path / "out2", workers=2)
    kept2 = [r["text"] for f in files for r in _read_jsonl_gz(tmp_path / "out2" / f"{f.name}.gz")]
    assert kept2 == kept and st2.docs_out == st.docs_out


def test_minhash_clusters_keep_one_and_validate_args(tmp_path: Path) -> None:
    rng = random.Random(3)
    base = _doc(rng, 200)
    texts = [base, base + " tail", "head " + base, _doc(rng, 200)]
    f = _write_jsonl(tmp_path / "c.jsonl", texts)
    st = minhash_deduplication([f], 64, 8, 5, 0.9, tmp_path / "out")
    kept = [r["text"] for r in _read_jsonl_gz(tmp_path / "out" / "c.jsonl.gz")]
    assert kept == [base, texts[3]] and st.clusters == 1
    with pytest.raises(ValueError, match="multiple of num_bands"):
        minhash_deduplication([f], 100, 8, 5, 0.8, tmp_path / "bad")


def test_dedup_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lmforge.cli import main

    rng = random.Random(4)
    base = _doc(rng, 150)
    a = _write_jsonl(tmp_path / "a.jsonl", [base, _doc(rng)])
    b = _write_jsonl(tmp_path / "b.jsonl", [base.replace("w", "W", 1), base])
    assert main(["data", "dedup", "minhash", str(a), str(b), "--out", str(tmp_path / "m")]) == 0
    assert "documents: 4 in, 2 kept" in capsys.readouterr().out
    assert main(["data", "dedup", "exact", str(a), str(b), "--out", str(tmp_path / "e")]) == 0
    assert "documents: 4 in, 3 kept" in capsys.readouterr().out
    assert main(["data", "dedup", "lines", str(a), str(b), "--out", str(tmp_path / "l")]) == 0
    assert "lines: 4 in, 2 kept" in capsys.readouterr().out
    bad = ["data", "dedup", "minhash", str(a), "--out", str(tmp_path / "x"), "--num-hashes", "7"]
    assert main(bad) == 2
    assert "multiple of num_bands" in capsys.readouterr().err
