"""Text inputs: the embedded default corpus and local files (.txt, .jsonl[.gz|.zst], .parquet).

The default corpus is the Python standard library's own ``.py`` sources, which every CPython
installation carries, so the main job runs with no download. Every data argument in lmforge goes
through :func:`expand_inputs`, which accepts files, folders (searched recursively) and globs.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from lmforge.utils.errors import LmforgeError

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".py", ".md")


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files (site-packages excluded), sorted for determinism."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        raise LmforgeError(f"Python standard library not found at {stdlib}")
    files = [
        p
        for p in stdlib.rglob("*.py")
        if "site-packages" not in p.parts and "dist-packages" not in p.parts and p.is_file()
    ]
    if not files:
        raise LmforgeError(f"no .py files under {stdlib}")
    return sorted(files)


def _suffix(p: Path) -> str:
    name = p.name.lower()
    for s in (".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst"):
        if name.endswith(s):
            return s.replace(".json.", ".jsonl.")
    return p.suffix.lower()


def expand_inputs(
    specs: Sequence[str | os.PathLike], suffixes: Sequence[str] = TEXT_SUFFIXES
) -> list[Path]:
    """Resolve files, folders and globs into a sorted, de-duplicated list of input files.

    Raises :class:`LmforgeError` naming the first spec that matches nothing.
    """
    out: list[Path] = []
    for spec in specs:
        s = str(spec)
        if any(c in s for c in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(s, recursive=True)) if Path(m).is_file()]
        elif Path(s).is_dir():
            matches = sorted(
                p for p in Path(s).rglob("*") if p.is_file() and _suffix(p) in suffixes
            )
        elif Path(s).is_file():
            matches = [Path(s)]
        else:
            raise LmforgeError(f"input not found: {s}")
        if not matches:
            raise LmforgeError(f"no input files match {s} (expected {', '.join(suffixes)})")
        out.extend(matches)
    seen: set[Path] = set()
    unique = []
    for p in out:
        r = p.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(p)
    return unique


def looks_binary(path: str | os.PathLike, probe: int = 8192) -> str | None:
    """Why the start of a (plain, uncompressed) file does not look like text, or ``None``.

    NUL bytes, over 5% control characters (other than whitespace) or over 40% invalid UTF-8 in
    the first ``probe`` bytes mark an executable, image or archive given as text; legacy 8-bit
    text stays below those (its invalid bytes are counted by the readers instead).
    Compressed (.gz/.zst) and Parquet inputs are not probed.
    """
    p = Path(path)
    if p.name.lower().endswith((".gz", ".zst", ".parquet", ".lz4")):
        return None
    try:
        with open(p, "rb") as f:
            head = f.read(probe)
    except OSError:
        return None
    if not head:
        return None
    if b"\x00" in head:
        return "it holds NUL bytes"
    text = head.decode("utf-8", errors="surrogateescape")
    invalid = sum(1 for ch in text if "\udc80" <= ch <= "\udcff")
    control = sum(1 for ch in text if ch < " " and ch not in "\t\n\r\f\v\x1b")
    # Legacy 8-bit text (Latin-1) has invalid UTF-8 bytes but few controls; binary has both.
    if control > max(4, len(text) // 20) or invalid > max(4, len(text) * 2 // 5):
        return f"{control + invalid} of its first {len(head)} bytes are not UTF-8 text"
    return None


def _open_text_lines(path: Path) -> io.TextIOBase:
    suf = _suffix(path)
    if suf == ".jsonl.gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="surrogateescape")
    if suf == ".jsonl.zst":
        import zstandard

        raw = open(path, "rb")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.TextIOWrapper(reader, encoding="utf-8", errors="surrogateescape")
    return open(path, encoding="utf-8", errors="surrogateescape")


_LONE_SURROGATE = re.compile("[\udc80-\udcff]")


def count_replaced(text: str) -> tuple[str, int]:
    """Text read with ``errors="surrogateescape"`` → (the ``errors="replace"`` text, bad bytes).

    surrogateescape keeps one lone surrogate per invalid byte, so they can be counted; the text
    returned is exactly what ``errors="replace"`` gives (one U+FFFD per maximal bad sequence).
    """
    n = len(_LONE_SURROGATE.findall(text))
    if not n:
        return text, 0
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace"), n


def decode_counted(data: bytes) -> tuple[str, int]:
    """``data`` decoded as UTF-8 with ``errors="replace"``, and the number of invalid bytes."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        return count_replaced(data.decode("utf-8", "surrogateescape"))


def _replaced(text: str, invalid: list[int] | None) -> str:
    text, n = count_replaced(text)
    if invalid is not None:
        invalid[0] += n
    return text


def iter_texts(
    path: str | os.PathLike, text_key: str = "text", invalid: list[int] | None = None
) -> Iterator[str]:
    """Yield the documents of one file.

    Bytes that are not UTF-8 become U+FFFD; ``invalid[0]`` (when given) counts them.

    ``.txt``/``.py``/``.md``: the whole file is one document. ``.jsonl`` (optionally gzip or zstd):
    one document per line, its ``text_key`` field; malformed lines raise one clear error naming the
    file and line. ``.parquet``: the ``text_key`` column, streamed by record batch.
    """
    p = Path(path)
    if not p.is_file():
        raise LmforgeError(f"input not found: {p}")
    suf = _suffix(p)
    if suf == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(p)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise LmforgeError(f"{p}: not a readable Parquet file ({e})") from None
        if text_key not in pf.schema_arrow.names:
            raise LmforgeError(f"{p}: no column '{text_key}' (columns: {pf.schema_arrow.names})")
        for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
            for v in batch.column(0).to_pylist():
                if v:
                    yield v
        return
    if suf.startswith(".jsonl") or suf == ".json":
        with _open_text_lines(p) as f:
            for lineno, line in enumerate(f, 1):
                line = _replaced(line.strip(), invalid)
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    raise LmforgeError(f"{p}:{lineno}: malformed JSON line") from None
                if not isinstance(rec, dict) or not isinstance(rec.get(text_key), str):
                    raise LmforgeError(f"{p}:{lineno}: record has no string field '{text_key}'")
                yield rec[text_key]
        return
    try:
        yield _replaced(p.read_text(encoding="utf-8", errors="surrogateescape"), invalid)
    except OSError as e:
        raise LmforgeError(f"{p}: cannot read ({e.strerror})") from None


def run_folder_hint(path: str | os.PathLike) -> str:
    """``" (did you mean runs/demo/train?)"`` when ``path`` holds a training run one level down.

    ``lmforge demo --out runs/demo`` writes its run to ``runs/demo/train``; pointing a command at
    ``runs/demo`` is the usual slip, and the error should say where the run is.
    """
    p = Path(path)
    if not p.is_dir():
        return ""
    runs = sorted(c for c in p.iterdir() if (c / "checkpoints").is_dir())
    return f" (did you mean {runs[0]}?)" if runs else ""
