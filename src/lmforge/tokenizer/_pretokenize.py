"""Pre-tokenization: special-token splitting, the GPT-2 pattern, and parallel streaming counts.

Training never holds the corpus in memory: each file is cut into chunks whose boundaries fall on a
special token (or, when a long stretch has none, on a newline between two printable ASCII
characters, where the GPT-2 pattern always splits anyway), and worker processes read, split and
count one chunk at a time. The parent only merges the per-chunk counts of distinct pre-tokens.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import regex

from lmforge.utils.corpus import decode_counted
from lmforge.utils.procs import exit_with_parent

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"The GPT-2 pre-tokenization pattern (identical to tiktoken's ``gpt2`` pat_str)."

# A chunk boundary without a special token: "\n" between two printable ASCII bytes. The pattern
# always ends a pre-token after such a "\n" and starts a new one at the next byte, so cutting
# there cannot change the pre-tokens (a run of whitespace never spans a printable byte).
_SAFE_NEWLINE = regex.compile(rb"(?<=[\x21-\x7e])\n(?=[\x21-\x7e])")

_SCAN_BYTES = 1 << 20  # read this much at a time while looking for a boundary
_MAX_SPECIAL_SCAN = 16 << 20  # give up on finding a special token after this many bytes

Task = list[tuple[str, int, int]]  # (path, start byte, end byte) ranges counted by one worker


def special_split_regex(special_tokens: Sequence[str]) -> regex.Pattern | None:
    """A pattern matching any special token, longest first, so overlapping specials resolve to the
    longest match at the leftmost position (regex alternation takes the first alternative)."""
    if not special_tokens:
        return None
    ordered = sorted(set(special_tokens), key=lambda s: (-len(s), s))
    return regex.compile("|".join(regex.escape(s) for s in ordered))


def _find_boundary(f, pos: int, size: int, needles: Sequence[bytes]) -> int:
    """The first chunk boundary at or after ``pos``: the start of a special token, else a safe
    newline, else the end of the file."""
    keep = max((len(n) for n in needles), default=1) - 1
    scanned = 0
    start = pos
    # First pass: a special token (documents are usually separated by one).
    while needles and start < size and scanned < _MAX_SPECIAL_SCAN:
        f.seek(start)
        buf = f.read(_SCAN_BYTES + keep)
        hits = [i for i in (buf.find(n) for n in needles) if i >= 0]
        if hits:
            return start + min(hits)
        if len(buf) < _SCAN_BYTES + keep:
            break
        start += _SCAN_BYTES
        scanned += _SCAN_BYTES
    # Second pass: a newline between printable characters, close to pos.
    start = pos
    while start < size:
        f.seek(max(0, start - 1))
        buf = f.read(_SCAN_BYTES + 2)
        m = _SAFE_NEWLINE.search(buf, 1 if start > 0 else 0)
        if m:
            return max(0, start - 1) + m.end()
        if len(buf) < _SCAN_BYTES + 2:
            break
        start += _SCAN_BYTES
    return size


def plan_tasks(
    paths: Sequence[Path], special_tokens: Sequence[str], chunk_bytes: int
) -> list[Task]:
    """Cut the files into byte ranges of about ``chunk_bytes`` at safe boundaries, then group small
    ranges (whole small files) into tasks of about ``chunk_bytes`` each."""
    needles = [s.encode("utf-8") for s in special_tokens if s]
    ranges: list[tuple[str, int, int]] = []
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            continue
        if size <= chunk_bytes:
            ranges.append((str(p), 0, size))
            continue
        with open(p, "rb") as f:
            start = 0
            while start < size:
                end = _find_boundary(f, start + chunk_bytes, size, needles)
                ranges.append((str(p), start, end))
                start = end
    tasks: list[Task] = []
    current: Task = []
    current_bytes = 0
    for r in ranges:
        current.append(r)
        current_bytes += r[2] - r[1]
        if current_bytes >= chunk_bytes:
            tasks.append(current)
            current, current_bytes = [], 0
    if current:
        tasks.append(current)
    return tasks


def iter_ordinary_parts(text: str, special_re: regex.Pattern | None) -> Iterator[str]:
    """The stretches of ``text`` between special tokens (the specials themselves dropped)."""
    if special_re is None:
        yield text
        return
    yield from special_re.split(text)


def count_task(
    task: Task, special_tokens: Sequence[str], invalid: list[int] | None = None
) -> Counter[str]:
    """Count the pre-tokens of one task's byte ranges (runs in a worker process).

    Invalid UTF-8 bytes become U+FFFD; ``invalid[0]`` (when given) counts them.
    """
    pat = regex.compile(GPT2_PATTERN)
    special_re = special_split_regex(special_tokens)
    counts: Counter[str] = Counter()
    for path, start, end in task:
        with open(path, "rb") as f:
            f.seek(start)
            # Ranges end on newlines or special tokens, so no character is cut at a boundary.
            text, n = decode_counted(f.read(end - start))
        if invalid is not None:
            invalid[0] += n
        for part in iter_ordinary_parts(text, special_re):
            if part:
                counts.update(pat.findall(part))
    return counts


def _count_task_star(args: tuple[Task, Sequence[str]]) -> tuple[int, Counter[str], int]:
    task, specials = args
    invalid = [0]
    counts = count_task(task, specials, invalid)
    return sum(e - s for _, s, e in task), counts, invalid[0]


def count_pretokens(
    paths: Sequence[Path],
    special_tokens: Sequence[str],
    workers: int,
    chunk_bytes: int | None = None,
    progress: bool = False,
    stats: dict[str, int] | None = None,
) -> Counter[str]:
    """Distinct pre-tokens of all files with their counts, counted in ``workers`` processes.

    Memory stays bounded by ``workers × chunk_bytes`` of text plus the distinct pre-tokens.
    ``stats["invalid_utf8_bytes"]`` (when given) receives the invalid bytes replaced by U+FFFD.
    """
    total = sum(p.stat().st_size for p in paths)
    if chunk_bytes is None:
        # Several tasks per worker balance uneven chunks; 64 MB caps the text one worker holds.
        chunk_bytes = int(min(64 << 20, max(1 << 20, total // max(1, workers * 4))))
    tasks = plan_tasks(paths, special_tokens, chunk_bytes)
    counts: Counter[str] = Counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="pre-tokenize", leave=False)
    jobs = [(t, list(special_tokens)) for t in tasks]
    invalid = 0
    try:
        if workers <= 1 or len(tasks) <= 1:
            results: Iterator[tuple[int, Counter[str], int]] = map(_count_task_star, jobs)
            for nbytes, c, bad in results:
                counts.update(c)
                invalid += bad
                if bar is not None:
                    bar.update(nbytes)
        else:
            # spawn: safe even when the parent already runs threads (torch, tqdm monitors).
            ctx = mp.get_context("spawn")
            n = min(workers, len(tasks))
            with ctx.Pool(n, initializer=exit_with_parent, initargs=(os.getpid(),)) as pool:
                for nbytes, c, bad in pool.imap_unordered(_count_task_star, jobs):
                    counts.update(c)
                    invalid += bad
                    if bar is not None:
                        bar.update(nbytes)
    finally:
        if bar is not None:
            bar.close()
    if stats is not None:
        stats["invalid_utf8_bytes"] = stats.get("invalid_utf8_bytes", 0) + invalid
    return counts


def default_workers() -> int:
    """Worker processes for pre-tokenization: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
