"""Contamination check: word n-gram overlap between a corpus and evaluation sets.

The evaluation side is small (thousands of questions), so its n-gram hashes sit in one in-memory
set; the corpus side streams. A document is contaminated when it shares at least ``min_matches``
n-grams with any evaluation item. Simplifications: n-grams are over normalised words (the
MinHash normalisation), hashed to 64 bits; evaluation items shorter than ``n`` words contribute no
n-gram and so are not checked (lower ``n`` for short-question sets such as MMLU).

Exercised by the ``contamination`` pipeline step and ``tests/test_data_pipeline.py``.
"""

from __future__ import annotations

import csv
import functools
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lmforge.data.core import Document, Filter
from lmforge.data.dedup import normalize_for_shingles


def _eval_texts(path: Path) -> Iterator[str]:
    name = path.name.lower()
    if name.endswith(".csv"):
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            for row in csv.reader(f):
                yield " ".join(row[:-1] if len(row) > 1 else row)  # last MMLU column is the key
        return
    if name.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(1)
            f.seek(0)
            records = json.load(f) if head == "[" else (json.loads(ln) for ln in f if ln.strip())
            for rec in records:
                if isinstance(rec, dict):
                    yield " ".join(_strings(rec))
        return
    yield path.read_text(encoding="utf-8", errors="replace")


def _strings(obj: object) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def ngram_hashes(text: str, n: int) -> set[int]:
    """64-bit hashes of the normalised word n-grams of ``text``."""
    import xxhash

    w = normalize_for_shingles(text)
    return {
        xxhash.xxh3_64_intdigest(" ".join(w[i : i + n]).encode()) for i in range(len(w) - n + 1)
    }


class ContaminationIndex:
    """The n-gram hashes of evaluation sets, for overlap queries against corpus documents."""

    def __init__(self, n: int = 13) -> None:
        self.n = n
        self.hashes: set[int] = set()
        self.items = 0

    @classmethod
    def from_paths(cls, paths: Sequence[str | os.PathLike], n: int = 13) -> ContaminationIndex:
        """Index every file under ``paths`` (.jsonl/.json records, .csv rows, text files)."""
        idx = cls(n)
        for spec in paths:
            p = Path(spec)
            files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
            for f in files:
                if f.suffix.lower() in (".jsonl", ".json", ".csv", ".txt"):
                    for t in _eval_texts(f):
                        idx.add(t)
        return idx

    def add(self, text: str) -> None:
        """Add one evaluation item."""
        self.hashes |= ngram_hashes(text, self.n)
        self.items += 1

    def matches(self, text: str) -> int:
        """How many of ``text``'s distinct n-grams occur in the evaluation sets."""
        return len(ngram_hashes(text, self.n) & self.hashes)


# ----------------------------------------------------------------------------- pipeline step


@dataclass(frozen=True)
class ContaminationOptions:
    """``contamination``: n-gram overlap with evaluation sets, reported and optionally removed."""

    eval_paths: tuple[str, ...]
    "evaluation files or folders (.jsonl/.json/.csv/.txt)"
    n: int = 13
    "n-gram length in words"
    min_matches: int = 1
    "shared n-grams that make a document contaminated"
    action: Literal["report", "remove"] = "remove"
    "report only (metadata + counters) or also drop"


class ContaminationFilter(Filter):
    """Count (and optionally drop) documents sharing n-grams with evaluation sets."""

    name = "contamination"

    def __init__(self, opts: ContaminationOptions, **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts
        self.index = _contamination_index(opts.eval_paths, opts.n)

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        m = self.index.matches(doc.text)
        if m >= self.opts.min_matches:
            doc.metadata["contaminated_ngrams"] = m
            self.stats.notes["contaminated_docs"] += 1
            if self.opts.action == "remove":
                return False, "contaminated"
        return True


@functools.cache
def _contamination_index(paths: tuple[str, ...], n: int) -> Any:
    # Built once per process: every shard a worker runs shares it.
    return ContaminationIndex.from_paths(paths, n)
