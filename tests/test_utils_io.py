"""Atomic writes (lmforge.utils.io): the umask applies, a failure leaves nothing behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lmforge.utils.io import atomic_write, atomic_write_bytes, atomic_write_text


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_atomic_write_applies_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    before = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.txt", "text")
        atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
        plain = tmp_path / "plain.txt"
        plain.write_text("reference")  # what open() gives under the same umask
    finally:
        os.umask(before)
    for name in ("a.txt", "b.bin"):
        got = stat.S_IMODE((tmp_path / name).stat().st_mode)
        assert got == mode == stat.S_IMODE(plain.stat().st_mode), (name, oct(got))


def test_atomic_write_failure_leaves_no_temp_file(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), atomic_write(tmp_path / "x.bin") as f:
        f.write(b"partial")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
