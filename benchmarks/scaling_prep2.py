"""Assemble the carry folder of the second scaling attempt (benchmarks/archive/session-2026-12-01/scaling2.md) on this machine.

The device machine has no network and no ``../shared``, so it gets one self-contained folder:
``data/`` (train.bin, val.bin and their sidecars, as written by ``lmforge tokenizer encode``; the
first attempt's Gutenberg 1,024-BPE tokens are reused, see benchmarks/archive/session-2026-12-01/scaling.md §2), a copy of ``src/``
and of ``benchmarks/scaling_sweep.py``; val.bin is cut to its first ``--val-tokens`` tokens
(the windows validation reads). Files are copied to a temporary folder and renamed into
place, so a failed copy never leaves a half-written carry folder; over ``--max-mb`` is refused.

    python benchmarks/scaling_prep2.py --data /work/main/.carry/scaling/data \\
        --out /work/main/.carry/scaling2
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

_DATA_FILES = ("train.bin", "train.bin.json", "val.bin", "val.bin.json")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _copy_val_head(src: Path, dst: Path, tokens: int) -> None:
    """The first ``tokens`` of the val shard with its sidecar's count (and bytes, scaled).

    Validation reads fixed sequential windows from the shard's start (``eval_batches``), so the
    head keeps exactly the windows the sweep scores (1,024 × 256 tokens); the rest only costs
    carry space.
    """
    import json

    import numpy as np

    from lmforge.train.data import open_shard

    shard = open_shard(src)
    n = min(tokens, len(shard.tokens))
    np.asarray(shard.tokens[:n]).tofile(dst)
    meta = json.loads(src.with_name(src.name + ".json").read_text(encoding="utf-8"))
    if meta.get("bytes"):
        meta["bytes"] = round(meta["bytes"] * n / meta["count"])
    meta["trimmed_from_count"], meta["count"] = meta["count"], n
    dst.with_name(dst.name + ".json").write_text(json.dumps(meta, indent=1), encoding="utf-8")


def assemble(
    data: Path, repo: Path, out: Path, max_mb: float = 40.0, val_tokens: int = 300_000
) -> int:
    """Build ``out`` from the token folder ``data`` and the repo's code; return its size in bytes."""
    from lmforge.train.data import open_shard  # checks each shard against its sidecar
    from lmforge.utils.errors import LmforgeError

    for name in _DATA_FILES:
        if not (data / name).is_file():
            raise LmforgeError(f"{data / name} is missing (write it with lmforge tokenizer encode)")
    for name in ("train.bin", "val.bin"):
        open_shard(data / name)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "data").mkdir(parents=True)
    (tmp / "benchmarks").mkdir()
    for name in ("train.bin", "train.bin.json"):
        shutil.copy2(data / name, tmp / "data" / name)
    _copy_val_head(data / "val.bin", tmp / "data" / "val.bin", val_tokens)
    open_shard(tmp / "data" / "val.bin")
    shutil.copytree(
        repo / "src", tmp / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    shutil.copy2(repo / "benchmarks" / "scaling_sweep.py", tmp / "benchmarks" / "scaling_sweep.py")
    size = _size(tmp)
    if size > max_mb * 1e6:
        shutil.rmtree(tmp)
        raise LmforgeError(f"carry folder would be {size / 1e6:.1f} MB, over {max_mb} MB")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return size


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", type=Path, required=True, help="folder with train.bin/val.bin")
    ap.add_argument("--out", type=Path, required=True, help="carry folder to (re)create")
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--max-mb", type=float, default=40.0)
    ap.add_argument("--val-tokens", type=int, default=300_000, help="head of val.bin to keep")
    args = ap.parse_args()
    from lmforge.utils.errors import LmforgeError

    try:
        size = assemble(args.data, args.repo, args.out, args.max_mb, args.val_tokens)
    except LmforgeError as e:
        sys.exit(f"scaling_prep2: {e}")
    print(f"{args.out}: {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
