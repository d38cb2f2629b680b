"""Corpus-scale deduplication without holding documents in memory: exact documents, exact lines,
MinHash + LSH near-duplicates.

Every method is MapReduce-shaped and parallel over files (``workers`` processes): a map pass over
the input files writes hashes, partitioned into buckets, to a work folder on disk; a reduce pass
per bucket finds what repeats; a final pass per input file streams the documents again and writes
one output per input (same name; plain text inputs stay plain text, other formats become
``NAME.jsonl.gz``). Only hashes, signatures and their bucket files are held, one bucket at a time.

Near-duplicates: each document is normalised (NFD, accents and punctuation removed, lower case,
whitespace collapsed) and cut into word n-gram shingles; each shingle is hashed once to 32 bits,
and the ``num_hashes`` permutations are ``(a·h + b) mod p`` over the whole (num_hashes, shingles)
array at once (p = 2³²−5, a < 2³¹, so nothing overflows uint64). Signatures are cut into
``num_bands`` bands; documents sharing a band bucket are candidates, each candidate pair is
verified by the true Jaccard similarity of the two shingle-hash sets (a 32-bit hash collision can
merge two shingles; at corpus sizes here that is negligible), clusters come from union-find, and
the lowest (file, position) of each cluster is kept with its text unchanged.

Exercised by ``lmforge data run configs/pipelines/dedup.toml``, ``tests/test_data_dedup.py`` and
``PYTHONPATH=src python benchmarks/data.py --minhash-docs 100000``.
"""

from __future__ import annotations

import gzip
import itertools
import os
import re
import shutil
import tempfile
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.data.core import Document
from lmforge.data.readers import detect_format, document_to_json, read_documents
from lmforge.utils.io import atomic_write
from lmforge.utils.procs import exit_with_parent

_P = 4294967291  # largest prime below 2**32
_MASK64 = (1 << 64) - 1


@dataclass
class DedupStats:
    """Totals of one deduplication run."""

    docs_in: int = 0
    docs_out: int = 0
    lines_in: int = 0
    lines_out: int = 0
    candidate_pairs: int = 0
    duplicate_pairs: int = 0
    clusters: int = 0
    outputs: list[Path] = field(default_factory=list)


# ----------------------------------------------------------------------------- shared plumbing


def output_path_for(path: str | os.PathLike, output_directory: str | os.PathLike) -> Path:
    """Where a dedup pass writes the survivors of ``path``: plain text keeps its name; anything
    else becomes gzip JSONL (``a.jsonl`` → ``a.jsonl.gz``, ``b.warc.gz`` → ``b.warc.gz.jsonl.gz``)."""
    p = Path(path)
    out = Path(output_directory)
    if detect_format(p) == "text":
        return out / p.name
    name = p.name
    if name.endswith(".jsonl.gz"):
        return out / name
    if name.endswith(".jsonl"):
        return out / f"{name}.gz"
    if name.endswith(".jsonl.zst"):
        return out / f"{name[:-4]}.gz"
    return out / f"{name}.jsonl.gz"


def write_documents(path: str | os.PathLike, docs: Iterator[Document], as_text: bool) -> int:
    """Write ``docs`` atomically: concatenated text when ``as_text``, else gzip JSONL. Returns count."""
    n = 0
    with atomic_write(path, "wb") as raw:
        if as_text:
            for d in docs:
                raw.write(d.text.encode("utf-8"))
                n += 1
            return n
        # mtime=0 keeps the gzip bytes identical across reruns (idempotent outputs compare equal).
        with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as gz:
            for d in docs:
                gz.write(document_to_json(d).encode("utf-8"))
                gz.write(b"\n")
                n += 1
    return n


def _check_names(inputs: Sequence[Path], output_directory: Path) -> list[Path]:
    outs = [output_path_for(p, output_directory) for p in inputs]
    if len(set(outs)) != len(outs):
        raise ValueError("two input files map to the same output name; rename one of them")
    return outs


def _pmap(fn: Callable[..., Any], jobs: Sequence[tuple], workers: int) -> list[Any]:
    if workers <= 1 or len(jobs) <= 1:
        return [fn(*j) for j in jobs]
    # Workers exit if this process is killed (kill -9 leaves no chance to shut the pool down).
    with ProcessPoolExecutor(
        max_workers=min(workers, len(jobs)),
        initializer=exit_with_parent,
        initargs=(os.getpid(),),
    ) as ex:
        return list(ex.map(fn, *zip(*jobs)))


def _hash64(s: str) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(s.encode("utf-8", errors="surrogatepass"))


class _WorkDir:
    """A scratch folder for bucket files, removed afterwards unless the caller named it."""

    def __init__(self, work_dir: str | os.PathLike | None, output_directory: Path) -> None:
        self.own = work_dir is None
        if work_dir is None:
            output_directory.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=".dedup-", dir=output_directory))
        else:
            self.path = Path(work_dir)
            self.path.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        if self.own:
            shutil.rmtree(self.path, ignore_errors=True)


# ----------------------------------------------------------------------------- exact lines


def _line_hashes(text: str) -> tuple[list[str], Any]:
    import numpy as np

    lines = text.splitlines(keepends=True)
    hashes = np.fromiter(
        (_hash64(ln.rstrip("\r\n")) for ln in lines), dtype=np.uint64, count=len(lines)
    )
    return lines, hashes


def _lines_map(i: int, path: str, fmt: str, work: str, buckets: int) -> int:
    import numpy as np

    parts: list[Any] = []
    for doc in read_documents(path, fmt):
        parts.append(_line_hashes(doc.text)[1])
    h = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
    which = h % np.uint64(buckets)
    for b in range(buckets):
        np.save(Path(work) / f"lines-f{i}-b{b}.npy", h[which == b])
    return len(parts)


def _lines_reduce(b: int, n_files: int, work: str) -> None:
    import numpy as np

    h = np.concatenate([np.load(Path(work) / f"lines-f{i}-b{b}.npy") for i in range(n_files)])
    uniq, counts = np.unique(h, return_counts=True)
    np.save(Path(work) / f"dups-b{b}.npy", uniq[counts > 1])


def _lines_write(path: str, fmt: str, out: str, work: str, buckets: int) -> tuple[int, int, int]:
    import numpy as np

    dups = np.sort(np.concatenate([np.load(Path(work) / f"dups-b{b}.npy") for b in range(buckets)]))
    as_text = detect_format(path) == "text" and fmt in ("auto", "text")
    counts = [0, 0, 0]  # docs out, lines in, lines out

    def survivors() -> Iterator[Document]:
        for doc in read_documents(path, fmt):
            lines, h = _line_hashes(doc.text)
            if len(dups):
                pos = np.searchsorted(dups, h).clip(max=len(dups) - 1)
                keep = dups[pos] != h
            else:
                keep = np.ones(len(h), dtype=bool)
            counts[1] += len(lines)
            counts[2] += int(keep.sum())
            text = "".join(ln for ln, k in zip(lines, keep) if k)
            if not text.strip() and not as_text:
                continue
            counts[0] += 1
            yield Document(doc.id, text, doc.metadata)

    write_documents(out, survivors(), as_text)
    return counts[0], counts[1], counts[2]


def exact_line_deduplication(
    input_files: Sequence[str | os.PathLike],
    output_directory: str | os.PathLike,
    *,
    fmt: str = "auto",
    workers: int = 1,
    num_buckets: int = 16,
    work_dir: str | os.PathLike | None = None,
) -> DedupStats:
    """Remove every line that occurs more than once anywhere in the corpus, everywhere.

    Two passes over a hash-count table on disk: count 64-bit line hashes per bucket, then rewrite
    each input keeping only lines whose hash occurred once. Writes one output per input file into
    ``output_directory`` (see :func:`output_path_for`); documents left empty are dropped from
    JSONL outputs. Lines compare without their line ending.
    """
    inputs = [Path(p) for p in input_files]
    out_dir = Path(output_directory)
    outs = _check_names(inputs, out_dir)
    stats = DedupStats()
    with _WorkDir(work_dir, out_dir) as work:
        docs_in = _pmap(
            _lines_map,
            [(i, str(p), fmt, str(work), num_buckets) for i, p in enumerate(inputs)],
            workers,
        )
        _pmap(_lines_reduce, [(b, len(inputs), str(work)) for b in range(num_buckets)], workers)
        results = _pmap(
            _lines_write,
            [(str(p), fmt, str(o), str(work), num_buckets) for p, o in zip(inputs, outs)],
            workers,
        )
    stats.docs_in = sum(docs_in)
    for docs_out, lines_in, lines_out in results:
        stats.docs_out += docs_out
        stats.lines_in += lines_in
        stats.lines_out += lines_out
    stats.outputs = outs
    return stats


# ----------------------------------------------------------------------------- exact documents


def _docs_map(i: int, path: str, fmt: str, work: str, buckets: int) -> int:
    import numpy as np

    h = np.fromiter((_hash64(d.text) for d in read_documents(path, fmt)), dtype=np.uint64)
    idx = np.arange(len(h), dtype=np.uint64) | np.uint64(i << 32)  # global id: file << 32 | doc
    which = h % np.uint64(buckets)
    for b in range(buckets):
        m = which == b
        np.save(Path(work) / f"docs-f{i}-b{b}.npy", np.stack([h[m], idx[m]], axis=1))
    return len(h)


def _docs_reduce(b: int, n_files: int, work: str) -> None:
    import numpy as np

    a = np.concatenate([np.load(Path(work) / f"docs-f{i}-b{b}.npy") for i in range(n_files)])
    a = a[np.lexsort((a[:, 1], a[:, 0]))]  # by hash, then earliest document first
    dup = np.zeros(len(a), dtype=bool)
    dup[1:] = a[1:, 0] == a[:-1, 0]
    np.save(Path(work) / f"drop-b{b}.npy", a[dup, 1])


def _load_drops(work: str, prefix: str, parts: int, i: int) -> set[int]:
    import numpy as np

    gids = np.concatenate([np.load(Path(work) / f"{prefix}{b}.npy") for b in range(parts)])
    mine = gids[(gids >> np.uint64(32)) == np.uint64(i)] & np.uint64(0xFFFFFFFF)
    return set(mine.tolist())


def _drop_write(
    i: int,
    path: str,
    fmt: str,
    out: str,
    drops: set[int] | None,
    work: str,
    prefix: str,
    parts: int,
) -> int:
    if drops is None:
        drops = _load_drops(work, prefix, parts, i)
    as_text = detect_format(path) == "text" and fmt in ("auto", "text")
    docs = (d for k, d in enumerate(read_documents(path, fmt)) if k not in drops)
    return write_documents(out, docs, as_text)


def exact_document_deduplication(
    input_files: Sequence[str | os.PathLike],
    output_directory: str | os.PathLike,
    *,
    fmt: str = "auto",
    workers: int = 1,
    num_buckets: int = 16,
    work_dir: str | os.PathLike | None = None,
) -> DedupStats:
    """Keep the first copy (by file order, then position) of every exactly repeated document text."""
    inputs = [Path(p) for p in input_files]
    out_dir = Path(output_directory)
    outs = _check_names(inputs, out_dir)
    stats = DedupStats()
    with _WorkDir(work_dir, out_dir) as work:
        counts = _pmap(
            _docs_map,
            [(i, str(p), fmt, str(work), num_buckets) for i, p in enumerate(inputs)],
            workers,
        )
        _pmap(_docs_reduce, [(b, len(inputs), str(work)) for b in range(num_buckets)], workers)
        kept = _pmap(
            _drop_write,
            [
                (i, str(p), fmt, str(o), None, str(work), "drop-b", num_buckets)
                for i, (p, o) in enumerate(zip(inputs, outs))
            ],
            workers,
        )
    stats.docs_in, stats.docs_out, stats.outputs = sum(counts), sum(kept), outs
    return stats


# ----------------------------------------------------------------------------- MinHash + LSH

_PUNCT_RE = re.compile(r"[^\w\s]")
_ACCENT_RE = re.compile(r"[\u0300-\u036f]")


def normalize_for_shingles(text: str) -> list[str]:
    """NFD, strip accents and punctuation, lower-case, split on whitespace."""
    if not text.isascii():  # ASCII has no accents to strip: skip the Unicode work
        text = _ACCENT_RE.sub("", unicodedata.normalize("NFD", text))
    return _PUNCT_RE.sub(" ", text.lower()).split()


def shingle_hashes(text: str, ngrams: int) -> Any:
    """Sorted unique 32-bit hashes of the word ``ngrams``-shingles of normalised ``text``.

    Words are hashed once; n-gram hashes combine word hashes polynomially (vectorised) and are
    finished with a murmur3-style mix so that nearby combinations spread over 32 bits.
    """
    import numpy as np
    import xxhash

    words = normalize_for_shingles(text)
    if not words:
        return np.zeros(0, dtype=np.uint32)
    h32 = xxhash.xxh32_intdigest
    w = np.fromiter((h32(x.encode()) for x in words), dtype=np.uint64, count=len(words))
    n = min(ngrams, len(w))
    length = len(w) - n + 1
    h = np.zeros(length, dtype=np.uint64)
    for k in range(n):
        h = (h * np.uint64(1000003) + w[k : k + length]) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(13)
    return np.unique(h.astype(np.uint32))


def minhash_params(num_hashes: int, seed: int = 0) -> tuple[Any, Any]:
    """The (a, b) coefficients of the ``num_hashes`` permutations, each (num_hashes, 1) uint64."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.integers(1, 1 << 31, size=(num_hashes, 1), dtype=np.uint64)
    b = rng.integers(0, 1 << 32, size=(num_hashes, 1), dtype=np.uint64)
    return a, b


def minhash_signature(shingles: Any, a: Any, b: Any) -> Any:
    """MinHash signature (num_hashes,) uint32 of a shingle-hash array: min over (a·h+b) mod p."""
    import numpy as np

    if len(shingles) == 0:
        return np.full(len(a), _P, dtype=np.uint32)  # empty documents collide only with each other
    perm = (a * shingles.astype(np.uint64)[None, :] + b) % np.uint64(_P)  # (num_hashes, S)
    return perm.min(axis=1).astype(np.uint32)


def _band_keys(sig: Any, num_bands: int) -> Any:
    # (N, num_hashes) uint32 → (N, num_bands) uint64 keys: a polynomial over each band's rows.
    import numpy as np

    n, k = sig.shape
    r = k // num_bands
    s = sig[:, : r * num_bands].reshape(n, num_bands, r).astype(np.uint64)
    key = np.zeros((n, num_bands), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(r):
            key = key * np.uint64(0x100000001B3) + s[:, :, j] + np.uint64(1)
    return key


def _minhash_map(
    i: int,
    path: str,
    fmt: str,
    work: str,
    num_hashes: int,
    num_bands: int,
    ngrams: int,
    seed: int,
    parts: int,
) -> int:
    import numpy as np

    a, b = minhash_params(num_hashes, seed)
    sigs, shingles, offsets = [], [], [0]
    for doc in read_documents(path, fmt):
        sh = shingle_hashes(doc.text, ngrams)
        shingles.append(sh)
        offsets.append(offsets[-1] + len(sh))
        sigs.append(minhash_signature(sh, a, b))
    n = len(sigs)
    d = Path(work)
    sig = np.stack(sigs) if sigs else np.zeros((0, num_hashes), np.uint32)  # (N, num_hashes)
    np.save(d / f"sh-f{i}.npy", np.concatenate(shingles) if shingles else np.zeros(0, np.uint32))
    np.save(d / f"off-f{i}.npy", np.asarray(offsets, dtype=np.int64))
    keys = _band_keys(sig, num_bands)  # (N, bands)
    band = np.broadcast_to(np.arange(num_bands, dtype=np.uint64), keys.shape)
    gid = np.broadcast_to((np.arange(n, dtype=np.uint64) | np.uint64(i << 32))[:, None], keys.shape)
    rows = np.stack([band.ravel(), keys.ravel(), gid.ravel()], axis=1)  # (N·bands, 3)
    which = rows[:, 1] % np.uint64(parts)
    for p in range(parts):
        np.save(d / f"lsh-f{i}-p{p}.npy", rows[which == p])
    return n


_MAX_ALL_PAIRS = 64


def _minhash_reduce(p: int, n_files: int, work: str) -> int:
    import numpy as np

    rows = np.concatenate([np.load(Path(work) / f"lsh-f{i}-p{p}.npy") for i in range(n_files)])
    rows = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    same = np.zeros(len(rows), dtype=bool)
    same[1:] = (rows[1:, 0] == rows[:-1, 0]) & (rows[1:, 1] == rows[:-1, 1])
    starts = np.flatnonzero(~same)
    ends = np.append(starts[1:], len(rows))
    pairs: list[tuple[int, int]] = []
    for s, e in zip(starts, ends):
        if e - s < 2:
            continue
        ids = rows[s:e, 2].tolist()
        if e - s <= _MAX_ALL_PAIRS:
            pairs.extend(itertools.combinations(ids, 2))
        else:
            # A huge bucket (boilerplate): chain neighbours and star to the first, which keeps
            # the candidate count linear; union-find still joins whatever verifies.
            pairs.extend(itertools.pairwise(ids))
            pairs.extend((ids[0], x) for x in ids[2:])
    arr = np.unique(np.asarray(pairs, dtype=np.uint64).reshape(-1, 2), axis=0)
    np.save(Path(work) / f"pairs-p{p}.npy", arr)
    return len(arr)


def _verify(chunk: Any, n_files: int, work: str, threshold: float) -> Any:
    import numpy as np

    d = Path(work)
    sh = [np.load(d / f"sh-f{i}.npy", mmap_mode="r") for i in range(n_files)]
    off = [np.load(d / f"off-f{i}.npy") for i in range(n_files)]

    def get(g: int) -> Any:
        f, k = g >> 32, g & 0xFFFFFFFF
        return np.asarray(sh[f][off[f][k] : off[f][k + 1]])

    keep = np.zeros(len(chunk), dtype=bool)
    for j, (x, y) in enumerate(chunk.tolist()):
        sx, sy = get(x), get(y)
        union = len(sx) + len(sy)
        if union == 0:
            keep[j] = True
            continue
        inter = len(np.intersect1d(sx, sy, assume_unique=True))
        keep[j] = inter / (union - inter) >= threshold
    return chunk[keep]


def _union_find_drops(pairs: Any) -> tuple[set[int], int]:
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    for x, y in pairs.tolist():
        rx, ry = find(x), find(y)
        if rx != ry:
            # The smaller id (earlier file, earlier position) becomes the root: it is kept.
            parent[max(rx, ry)] = min(rx, ry)
    drops = {x for x in parent if find(x) != x}
    roots = {find(x) for x in parent}
    return drops, len(roots)


def minhash_deduplication(
    input_files: Sequence[str | os.PathLike],
    num_hashes: int,
    num_bands: int,
    ngrams: int,
    jaccard_threshold: float,
    output_directory: str | os.PathLike,
    *,
    fmt: str = "auto",
    workers: int = 1,
    seed: int = 0,
    num_partitions: int = 8,
    work_dir: str | os.PathLike | None = None,
) -> DedupStats:
    """Near-duplicate removal: MinHash + LSH candidates, true-Jaccard check, one kept per cluster.

    ``num_hashes`` must be divisible by ``num_bands`` (rows per band = num_hashes / num_bands).
    Writes one output per input file into ``output_directory``; kept texts are unchanged.
    """
    import numpy as np

    if num_hashes <= 0 or num_bands <= 0 or num_hashes % num_bands:
        raise ValueError(
            f"num_hashes ({num_hashes}) must be a positive multiple of num_bands ({num_bands})"
        )
    if not 0.0 <= jaccard_threshold <= 1.0:
        raise ValueError(f"jaccard_threshold must be in [0, 1], got {jaccard_threshold}")
    inputs = [Path(p) for p in input_files]
    out_dir = Path(output_directory)
    outs = _check_names(inputs, out_dir)
    stats = DedupStats()
    with _WorkDir(work_dir, out_dir) as work:
        w = str(work)
        counts = _pmap(
            _minhash_map,
            [
                (i, str(p), fmt, w, num_hashes, num_bands, ngrams, seed, num_partitions)
                for i, p in enumerate(inputs)
            ],
            workers,
        )
        _pmap(_minhash_reduce, [(p, len(inputs), w) for p in range(num_partitions)], workers)
        cand = [np.load(work / f"pairs-p{p}.npy") for p in range(num_partitions)]
        # The same pair can meet in several bands, hence in several partitions.
        allc = np.unique(np.concatenate(cand), axis=0) if cand else np.zeros((0, 2), np.uint64)
        stats.candidate_pairs = len(allc)
        chunks = np.array_split(allc, max(1, min(workers * 4, len(allc))))
        verified = _pmap(_verify, [(c, len(inputs), w, jaccard_threshold) for c in chunks], workers)
        pairs = np.concatenate(verified) if verified else np.zeros((0, 2), np.uint64)
        stats.duplicate_pairs = len(pairs)
        drops, stats.clusters = _union_find_drops(pairs)
        per_file: dict[int, set[int]] = {i: set() for i in range(len(inputs))}
        for g in drops:
            per_file[g >> 32].add(g & 0xFFFFFFFF)
        kept = _pmap(
            _drop_write,
            [
                (i, str(p), fmt, str(o), per_file[i], w, "", 0)
                for i, (p, o) in enumerate(zip(inputs, outs))
            ],
            workers,
        )
    stats.docs_in, stats.docs_out, stats.outputs = sum(counts), sum(kept), outs
    return stats


def jaccard(a: str, b: str, ngrams: int = 5) -> float:
    """True Jaccard similarity of two texts' normalised word ``ngrams``-shingle sets (reference)."""

    def grams(t: str) -> set[tuple[str, ...]]:
        w = normalize_for_shingles(t)
        n = min(ngrams, len(w))
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)} if w else set()

    x, y = grams(a), grams(b)
    if not x and not y:
        return 1.0
    return len(x & y) / len(x | y)


# ----------------------------------------------------------------------------- pipeline step


@dataclass(frozen=True)
class DedupOptions:
    """``exact_dedup`` / ``line_dedup``: exact document or line deduplication over the corpus."""

    num_buckets: int = 16
    "hash buckets on disk (reduce tasks)"


@dataclass(frozen=True)
class MinhashOptions:
    """``minhash_dedup``: MinHash + LSH near-duplicate removal over the corpus."""

    num_hashes: int = 120
    "MinHash permutations"
    num_bands: int = 20
    "LSH bands (num_hashes must be a multiple); 20 × 6 rows catch J = 0.8 pairs 99.8% of the time"
    ngrams: int = 5
    "word n-gram shingle length"
    jaccard_threshold: float = 0.8
    "true Jaccard similarity at or above which two documents are duplicates"
    seed: int = 0
    "seed of the permutations"
    num_partitions: int = 8
    "LSH bucket partitions on disk (reduce tasks)"
