"""Atomic file writes (write to a temporary name in the same folder, fsync, then rename) and
the JSONL reader every stage uses.

A crash at any point leaves either the old file or the new one, never a half-written file.
``mkstemp`` creates its file 0600; the result is given the mode a plain ``open`` would have
(0666 less the process umask), so outputs stay readable to others as usual.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _umask() -> int:
    # Linux reports the umask in /proc without changing it; elsewhere it can only be read by
    # setting it, so it is set straight back.
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry itself is flushed.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator:
    """Open a temporary file beside ``path``; on clean exit fsync it and rename it over ``path``.

    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_write(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    with atomic_write(path, "w") as f:
        f.write(text)


def file_sha256(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


def iter_jsonl(path: str | os.PathLike, what: str = "data file") -> Iterator[tuple[int, dict]]:
    """(line number, record) of each non-blank line of a JSONL file (``.gz`` too). A missing or
    unreadable file, a line that is not JSON or not an object: one ``LmforgeError`` line naming
    ``what``, the path and the line."""
    import gzip
    import json

    from lmforge.utils.errors import LmforgeError

    p = Path(path)
    if p.is_dir():
        raise LmforgeError(f"{what} {p} is a directory, expected a file")
    if not p.is_file():
        raise LmforgeError(f"{what} not found: {p}")
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise LmforgeError(f"{p}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise LmforgeError(f"{p}:{n}: expected a JSON object per line")
                yield n, rec
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise LmforgeError(f"cannot read {p}: {e}") from None


def ensure_writable_dir(path: str | os.PathLike, what: str = "output folder") -> Path:
    """Create folder ``path`` (with its parents) and check that a file can be written in it,
    before any long work; a file in its place, a read-only folder or file system, or any other
    refusal is one :class:`~lmforge.utils.errors.LmforgeError` line naming ``what`` and why."""
    from lmforge.utils.errors import LmforgeError

    p = Path(path)
    if p.exists() and not p.is_dir():
        raise LmforgeError(f"{what} {p} is a file, expected a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".lmforge-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise LmforgeError(f"cannot write to {what} {p}: {e.strerror or e}") from None
    return p
