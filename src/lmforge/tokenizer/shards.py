"""Token shards: ``NAME.bin`` (raw little-endian uint16/uint32 ids) plus sidecar ``NAME.bin.json``.

Documents are concatenated, each followed by ``<|endoftext|>`` when the tokenizer has it. The
sidecar records::

    {"format": "lmforge-tokens-v1", "dtype": "uint16", "count": N, "vocab_size": V,
     "tokenizer_sha256": "...", "documents": D, "source_files": [...], "bytes": UTF-8 bytes}

``bytes`` (of the encoded text, eot excluded) lets training report bits per byte. Files are
encoded in parallel worker processes, each writing a temporary part; the parent concatenates the
parts in input order, so the shard does not depend on the number of workers.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import multiprocessing as mp
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmforge.tokenizer.tokenizer import Tokenizer
from lmforge.utils.corpus import expand_inputs, iter_texts
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write, atomic_write_text
from lmforge.utils.procs import exit_with_parent

SHARD_FORMAT = "lmforge-tokens-v1"
_DOCS_PER_WRITE = 256  # documents encoded per batch before their ids are written out
_MIN_JOB_BYTES = 1 << 20  # files are grouped into jobs of at least this many bytes


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """The sidecar of one token shard."""

    path: Path
    "the .bin file"
    dtype: str
    "uint16 or uint32"
    count: int
    "number of token ids"
    vocab_size: int
    "vocabulary size of the tokenizer that wrote it"
    tokenizer_sha256: str
    "fingerprint of that tokenizer"
    documents: int
    "non-empty documents encoded (one eot after each when the tokenizer has one)"
    bytes: int
    "UTF-8 bytes of the encoded text"
    source_files: tuple[str, ...] = ()
    "input files, in order"


def shard_dtype(vocab_size: int) -> str:
    """``uint16`` when every id fits (vocab ≤ 65536), else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_shard_info(path: str | os.PathLike) -> ShardInfo:
    """Read and check the sidecar of ``path`` (the ``.bin`` file)."""
    p = Path(path)
    side = _sidecar(p)
    if not side.is_file():
        raise LmforgeError(f"token shard {p} has no sidecar {side.name}")
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LmforgeError(f"sidecar {side} is not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
        raise LmforgeError(f"sidecar {side}: format is not {SHARD_FORMAT!r}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise LmforgeError(f"sidecar {side}: dtype {meta.get('dtype')!r}, expected uint16/uint32")
    return ShardInfo(
        path=p,
        dtype=meta["dtype"],
        count=int(meta["count"]),
        vocab_size=int(meta["vocab_size"]),
        tokenizer_sha256=str(meta.get("tokenizer_sha256", "")),
        documents=int(meta.get("documents", 0)),
        bytes=int(meta.get("bytes", 0)),
        source_files=tuple(meta.get("source_files", ())),
    )


def read_token_shard(path: str | os.PathLike) -> Any:
    """The ids of a shard as a read-only ``np.memmap`` of shape (N,), checked against its sidecar."""
    import numpy as np

    info = read_shard_info(path)
    p = Path(path)
    if not p.is_file():
        raise LmforgeError(f"token shard not found: {p}")
    dtype = np.dtype("<u2" if info.dtype == "uint16" else "<u4")
    size = p.stat().st_size
    if size != info.count * dtype.itemsize:
        raise LmforgeError(
            f"token shard {p}: {size} bytes on disk, sidecar says {info.count} {info.dtype} ids"
        )
    if info.count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(p, dtype=dtype, mode="r")


def _make_encoder(tokenizer: Tokenizer, fast: bool, threads: int = 1):
    """A ``list[str] -> list[list[int]]`` batch encoder: tiktoken when exact, else our own."""
    if fast:
        from lmforge.tokenizer.export import tiktoken_compatible, to_tiktoken

        if tiktoken_compatible(tokenizer) is None:
            enc = to_tiktoken(tokenizer)
            if threads > 1:
                # tiktoken's Rust core releases the GIL, so threads help inside one big file.
                return lambda docs: enc.encode_batch(
                    docs, num_threads=threads, allowed_special="all"
                )
            return lambda docs: [enc.encode(d, allowed_special="all") for d in docs]
    return lambda docs: [tokenizer.encode(d) for d in docs]


# Per-process encoder of a worker pool, set once by _init_worker (spawned workers only), so the
# tokenizer is sent and the tiktoken encoder built once per worker, not once per file.
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Tokenizer, fast: bool, parent_pid: int | None = None) -> None:
    exit_with_parent(parent_pid)
    _WORKER["encode"] = _make_encoder(tokenizer, fast)
    _WORKER["eot"] = tokenizer.eot_id


def _encode_job_in_worker(job: tuple[list[str], str, str, str]) -> tuple[int, ...]:
    return _encode_job(job, _WORKER["encode"], _WORKER["eot"])


def _encode_job(
    job: tuple[list[str], str, str, str], encode_batch, eot: int | None
) -> tuple[int, int, int, int, int]:
    """Encode a group of input files into one raw part file.

    Returns (count, documents, text bytes, input file bytes, invalid UTF-8 bytes replaced).
    """
    import numpy as np

    srcs, part, dtype, text_key = job
    count = docs = nbytes = 0
    invalid = [0]
    np_dtype = np.dtype("<u2" if dtype == "uint16" else "<u4")
    with open(part, "wb") as f:
        batch: list[str] = []

        def flush() -> int:
            n = 0
            for ids in encode_batch(batch):
                if eot is not None:
                    ids.append(eot)
                np.asarray(ids, dtype=np_dtype).tofile(f)
                n += len(ids)
            batch.clear()
            return n

        for src in srcs:
            for text in iter_texts(src, text_key=text_key, invalid=invalid):
                if not text:
                    continue  # an empty document would add a lone eot
                batch.append(text)
                docs += 1
                nbytes += len(text.encode("utf-8"))
                if len(batch) >= _DOCS_PER_WRITE:
                    count += flush()
        count += flush()
    return count, docs, nbytes, sum(os.path.getsize(x) for x in srcs), invalid[0]


def _group_files(files: Sequence[Path], target: int) -> list[list[str]]:
    """Consecutive files grouped into jobs of about ``target`` bytes (order kept)."""
    groups: list[list[str]] = []
    size = 0
    for f in files:
        if not groups or size >= target:
            groups.append([])
            size = 0
        groups[-1].append(str(f))
        size += f.stat().st_size
    return groups


def encode_files(
    tokenizer_or_dir: Tokenizer | str | os.PathLike,
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    workers: int | None = None,
    text_key: str = "text",
    *,
    progress: bool = False,
    fast: bool = True,
) -> dict[str, Any]:
    """Encode every document of ``inputs`` into one shard ``out`` (``NAME.bin`` + sidecar).

    ``inputs`` are files, folders or globs (see :func:`lmforge.utils.expand_inputs`); files are
    encoded in ``workers`` processes (default: usable CPUs) with the tiktoken export when it is
    exact for this tokenizer (``fast``), else with :meth:`Tokenizer.encode`; a single input file
    is encoded with tiktoken's threads instead. Both the shard and the sidecar are written
    atomically; the shard does not depend on ``workers``. Returns the sidecar dict.
    Exercised by ``lmforge tokenizer encode --tokenizer DIR --input PATH --out X.bin``.
    """
    from lmforge.tokenizer._pretokenize import default_workers

    tok = (
        tokenizer_or_dir
        if isinstance(tokenizer_or_dir, Tokenizer)
        else Tokenizer.load(tokenizer_or_dir)
    )
    files = expand_inputs(list(inputs))
    out_path = Path(out)
    if out_path.is_dir():
        raise LmforgeError(f"--out {out_path} is a folder; give a file name such as train.bin")
    dtype = shard_dtype(tok.vocab_size)
    nworkers = default_workers() if workers is None else max(1, workers)
    had = out_path.exists()
    try:
        return _encode_into(tok, files, out_path, dtype, nworkers, text_key, progress, fast)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        kept = f"the earlier {out_path.name} is kept unchanged" if had else "nothing was kept"
        raise LmforgeError(
            f"no space left on the device holding {out_path.parent}: {out_path} not written "
            f"({kept}; temporary parts removed); free space and rerun"
        ) from None


def _encode_into(
    tok: Tokenizer,
    files: list[Path],
    out_path: Path,
    dtype: str,
    nworkers: int,
    text_key: str,
    progress: bool,
    fast: bool,
) -> dict[str, Any]:
    # Parts per job into a temporary folder beside the shard, then one atomic concatenation.
    out_path.parent.mkdir(parents=True, exist_ok=True)
    total = sum(f.stat().st_size for f in files)
    # Several jobs per worker balance uneven files; one job per file when files are big.
    groups = _group_files(files, max(_MIN_JOB_BYTES, total // (nworkers * 8)))
    count = docs = nbytes = 0
    with tempfile.TemporaryDirectory(prefix=f".{out_path.name}.", dir=out_path.parent) as tmp:
        jobs = [(g, os.path.join(tmp, f"{k}.part"), dtype, text_key) for k, g in enumerate(groups)]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="encode", leave=False)
        stats: list[tuple[int, ...]] = []
        try:
            if nworkers <= 1 or len(jobs) <= 1:
                encode_batch = _make_encoder(tok, fast, threads=nworkers)
                for job in jobs:
                    stats.append(_encode_job(job, encode_batch, tok.eot_id))
                    if bar is not None:
                        bar.update(stats[-1][3])
            else:
                # spawn: safe even when the parent already runs threads (torch, tqdm monitors).
                ctx = mp.get_context("spawn")
                n = min(nworkers, len(jobs))
                init = (tok, fast, os.getpid())
                with ctx.Pool(n, initializer=_init_worker, initargs=init) as pool:
                    # imap keeps input order, so parts concatenate in input order.
                    for r in pool.imap(_encode_job_in_worker, jobs):
                        stats.append(r)
                        if bar is not None:
                            bar.update(r[3])
        finally:
            if bar is not None:
                bar.close()
        with atomic_write(out_path, "wb") as f:
            for (c, d, b, _, _), job in zip(stats, jobs):
                count, docs, nbytes = count + c, docs + d, nbytes + b
                with open(job[1], "rb") as part:
                    while chunk := part.read(1 << 24):
                        f.write(chunk)
    meta: dict[str, Any] = {
        "format": SHARD_FORMAT,
        "dtype": dtype,
        "count": count,
        "vocab_size": tok.vocab_size,
        "tokenizer_sha256": tok.sha256,
        "documents": docs,
        "source_files": [str(f) for f in files],
        "bytes": nbytes,
        "invalid_utf8_bytes": sum(s[4] for s in stats),
    }
    atomic_write_text(_sidecar(out_path), json.dumps(meta, indent=1) + "\n")
    return meta
