"""Completion markers: what makes a rerun skip finished stages and resume a killed one.

A stage's *key* is a hash of its settings, the contents of its input files and the key of the
stage before it, so a changed setting or input re-runs that stage and (their keys chaining) every
later one. ``DIR/.recipe-done.json`` holds the key, settings, time and metrics of a finished
stage; ``DIR/.recipe-attempt.json`` the key of a started one: a stage killed mid-way resumes in
place when it can (pretraining, from its own checkpoints) under the same key, and otherwise its
folder is cleared and the stage restarts. Both files are written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lmforge.utils.io import atomic_write_text

DONE = ".recipe-done.json"
ATTEMPT = ".recipe-attempt.json"
_CONTENT_HASH_LIMIT = 64 << 20  # larger files (shared corpora) are identified by size + mtime


def file_digest(path: Path) -> str:
    """Content hash of a small file; size and modification time of a large one."""
    st = path.stat()
    if st.st_size > _CONTENT_HASH_LIMIT:
        return f"size={st.st_size},mtime={st.st_mtime_ns}"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def inputs_digest(paths: Iterable[str | os.PathLike]) -> dict[str, str]:
    """``{path: digest}`` of every file named or under a folder named (missing: "missing")."""
    out: dict[str, str] = {}
    for spec in paths:
        p = Path(spec)
        if p.is_dir():
            for f in sorted(q for q in p.rglob("*") if q.is_file()):
                out[str(f)] = file_digest(f)
        elif p.is_file():
            out[str(p)] = file_digest(p)
        else:
            out[str(p)] = "missing"
    return out


def stage_key(
    name: str, settings: Mapping[str, Any], inputs: Mapping[str, str], previous: str
) -> str:
    """The hash that identifies one run of a stage (see the module docstring)."""
    blob = json.dumps(
        {"stage": name, "settings": settings, "inputs": inputs, "previous": previous},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_marker(path: Path) -> dict[str, Any] | None:
    """The JSON marker at ``path``, or None when absent or unreadable (a torn write is absent)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(path: Path, record: Mapping[str, Any]) -> None:
    """Write marker ``record`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=2, default=str) + "\n")
