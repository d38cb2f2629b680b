"""Readers: WARC (fastwarc), WET, JSONL (.gz/.zst), Parquet and plain text into :class:`Document`.

A bad record or a bad file never stops a run: malformed JSON lines, records without text, WARC
records that fail to parse and files that cannot be opened are counted in the reader's
:class:`ReadStats` (``malformed``, ``bad_files``) and skipped. Because a WARC stream cannot be
re-synchronised after a broken header, a truncated WARC yields the records before the break.

A WARC file is read by record type, whatever its name says: ``response`` records give HTML
(their HTTP body with ``Transfer-Encoding: chunked`` and ``Content-Encoding`` gzip/deflate/br
undone first, as a browser would), ``conversion`` records (WET) give text; a file of
``metadata`` records only (WAT) holds no text, and its records are counted as malformed
``wat_metadata``. Invalid UTF-8 is replaced by U+FFFD and counted
(``invalid_utf8_bytes``/``invalid_utf8_records``), never silently.

Exercised by ``lmforge data run configs/pipelines/web.toml`` and ``tests/test_data_readers.py``.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.data.core import Document
from lmforge.utils.corpus import count_replaced, decode_counted

FORMATS = ("auto", "warc", "wet", "jsonl", "parquet", "text")


@dataclass
class ReadStats:
    """What reading saw: files, records read, records skipped by reason, files that failed."""

    files: int = 0
    records: int = 0
    malformed: Counter = field(default_factory=Counter)
    bad_files: list[str] = field(default_factory=list)
    invalid_utf8_bytes: int = 0
    "bytes that were not valid UTF-8, each replaced by U+FFFD"
    invalid_utf8_records: int = 0
    "records holding at least one such byte"
    decoded: Counter = field(default_factory=Counter)
    "HTTP bodies decoded before extraction, by encoding (chunked, gzip, deflate, br)"


def _counted(text: str, n: int, stats: ReadStats) -> str:
    if n:
        stats.invalid_utf8_bytes += n
        stats.invalid_utf8_records += 1
    return text


def _count_invalid(text: str, stats: ReadStats) -> str:
    # Text read with errors="surrogateescape": counted, then shown as errors="replace" would.
    return _counted(*count_replaced(text), stats)


def decode_utf8(data: bytes, stats: ReadStats) -> str:
    """``data`` as UTF-8 (``errors="replace"``); the invalid bytes are counted in ``stats``."""
    return _counted(*decode_counted(data), stats)


class HttpBodyError(ValueError):
    """An HTTP body whose transfer or content encoding cannot be undone."""


def dechunk(body: bytes) -> bytes:
    """Undo ``Transfer-Encoding: chunked`` (RFC 9112 §7.1): hex size line, data, CRLF, …, 0.

    Chunk extensions and trailers are ignored. A body cut off inside a chunk (WARC records of
    truncated fetches) keeps what arrived; a body that does not start with a size line raises.
    """
    out = bytearray()
    pos, n = 0, len(body)
    while pos < n:
        eol = body.find(b"\n", pos)
        if eol < 0:
            eol = n
        line = body[pos:eol].split(b";", 1)[0].strip()
        try:
            size = int(line, 16)
        except ValueError:
            if not out and pos == 0:
                raise HttpBodyError("not chunked: no chunk size line") from None
            break  # garbage after the last chunk: what came before stands
        if size == 0:
            break
        start = eol + 1
        out += body[start : start + size]
        pos = start + size
        # Each chunk's data ends with CRLF (tolerate a bare LF).
        if body[pos : pos + 2] == b"\r\n":
            pos += 2
        elif body[pos : pos + 1] == b"\n":
            pos += 1
    return bytes(out)


def decode_content(body: bytes, encoding: str) -> bytes:
    """Undo one ``Content-Encoding``: gzip/x-gzip, deflate (zlib or raw), br, identity."""
    enc = encoding.strip().lower()
    try:
        if enc in ("", "identity", "none"):
            return body
        if enc in ("gzip", "x-gzip"):
            if body[:2] != b"\x1f\x8b":
                return body  # already decoded by the crawler that kept the header
            # A stream object, so a truncated fetch keeps what decompressed.
            return zlib.decompressobj(wbits=31).decompress(body)
        if enc == "deflate":
            try:
                return zlib.decompress(body)  # RFC 1950 zlib framing, as the RFC says
            except zlib.error:
                return zlib.decompress(body, wbits=-15)  # the raw deflate many servers send
        if enc == "br":
            try:
                import brotli
            except ImportError:
                raise HttpBodyError("br body needs the brotli package") from None
            return brotli.decompress(body)
        if enc == "zstd":
            import zstandard

            return zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 30)
    except HttpBodyError:
        raise
    except Exception as e:  # zlib.error, brotli.error, zstd errors: a corrupt body
        raise HttpBodyError(f"{enc} body does not decode: {e}") from None
    raise HttpBodyError(f"unknown content encoding {enc!r}")


def decode_http_body(
    body: bytes, transfer_encoding: str, content_encoding: str, stats: ReadStats
) -> bytes:
    """The entity an HTTP response carried: transfer codings, then content codings, undone."""
    codings = [c.strip().lower() for c in transfer_encoding.split(",") if c.strip()]
    if "chunked" in codings:
        try:
            body = dechunk(body)
            stats.decoded["chunked"] += 1
        except HttpBodyError:
            pass  # the archiver de-chunked the body but kept the header
        codings.remove("chunked")
    # Content codings apply in the order listed, so they are undone in reverse; a transfer
    # coding other than chunked (gzip, rare) is undone the same way.
    encs = [c.strip() for c in content_encoding.split(",") if c.strip()] + codings
    for enc in reversed(encs):
        if enc.lower() in ("identity", "none"):
            continue
        body = decode_content(body, enc)
        stats.decoded[enc.lower()] += 1
    return body


def detect_format(path: str | os.PathLike) -> str:
    """Guess a reader format from a file name (``.warc.wet.gz`` → wet, ``.jsonl.zst`` → jsonl)."""
    name = Path(path).name.lower()
    for ext in (".gz", ".zst", ".lz4", ".bad"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    if name.endswith(".wet"):
        return "wet"
    if name.endswith((".warc", ".arc")):
        return "warc"
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _open_binary(path: Path) -> io.BufferedIOBase:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def _read_warc(path: Path, stats: ReadStats, wet: bool) -> Iterator[Document]:
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    # fastwarc detects gzip/lz4 itself from the magic bytes, so the raw file goes in. Every
    # record type is read: a WET or WAT file named or configured as WARC is detected from its
    # records, not read as empty.
    wanted = WarcRecordType.response | WarcRecordType.conversion | WarcRecordType.metadata
    with open(path, "rb") as f:
        it = iter(ArchiveIterator(f, record_types=wanted, parse_http=False))
        idx = docs = metadata = 0
        while True:
            try:
                rec = next(it)
            except StopIteration:
                break
            except Exception:  # fastwarc raises OSError/ValueError variants on broken headers
                stats.malformed["warc_header"] += 1
                break
            idx += 1
            try:
                kind = rec.record_type
                if kind == WarcRecordType.response:
                    rec.parse_http()
                body = rec.reader.read()
                rid = rec.record_id or f"{path.name}/{idx}"
                url = rec.headers.get("WARC-Target-URI", "")
                date = rec.headers.get("WARC-Date", "")
            except Exception:
                stats.malformed["warc_record"] += 1
                continue
            meta = {"url": url, "date": date, "source": path.name}
            if kind == WarcRecordType.metadata:
                metadata += 1  # crawl metadata beside responses, or a WAT file's JSON
                continue
            stats.records += 1
            if kind == WarcRecordType.conversion:
                docs += 1
                yield Document(rid, decode_utf8(body, stats), meta)
                continue
            if wet:
                stats.malformed["html_response_in_wet"] += 1  # needs format "warc" + html step
                continue
            h = rec.http_headers
            if h is None:
                stats.malformed["no_http_headers"] += 1
                continue
            ctype = h.get("Content-Type", "") or ""
            if ctype and "html" not in ctype.lower():
                stats.malformed["not_html"] += 1
                continue
            try:
                body = decode_http_body(
                    body,
                    h.get("Transfer-Encoding", "") or "",
                    h.get("Content-Encoding", "") or "",
                    stats,
                )
            except HttpBodyError:
                stats.malformed["bad_content_encoding"] += 1
                continue
            meta["html_bytes"] = body
            docs += 1
            yield Document(rid, "", meta)
    if metadata and not docs:
        # A WAT file (metadata only): none of it is document text, which must not pass unseen.
        stats.malformed["wat_metadata"] += metadata


def _read_jsonl(path: Path, stats: ReadStats, text_key: str, id_key: str) -> Iterator[Document]:
    with io.TextIOWrapper(_open_binary(path), encoding="utf-8", errors="surrogateescape") as f:
        lineno = 0
        while True:
            try:
                line = f.readline()
            except (OSError, EOFError, ValueError):
                # A truncated .gz/.zst ends here; what was read so far stands.
                stats.malformed["truncated_file"] += 1
                return
            if not line:
                return
            lineno += 1
            if not line.strip():
                continue
            line = _count_invalid(line, stats)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                stats.malformed["bad_json"] += 1
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get(text_key), str):
                stats.malformed["no_text"] += 1
                continue
            stats.records += 1
            meta = rec.get("metadata") if isinstance(rec.get("metadata"), dict) else {}
            extra = {k: v for k, v in rec.items() if k not in (text_key, id_key, "metadata")}
            rid = str(rec.get(id_key, f"{path.name}/{lineno}"))
            yield Document(rid, rec[text_key], {**extra, **meta})


def _read_parquet(path: Path, stats: ReadStats, text_key: str, id_key: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if text_key not in names:
        stats.malformed["no_text_column"] += 1
        return
    cols = [text_key] + ([id_key] if id_key in names else [])
    row = 0
    for batch in pf.iter_batches(columns=cols, batch_size=1024):
        texts = batch.column(0).to_pylist()
        ids = batch.column(1).to_pylist() if len(cols) > 1 else [None] * len(texts)
        for text, rid in zip(texts, ids):
            row += 1
            if not isinstance(text, str):
                stats.malformed["no_text"] += 1
                continue
            stats.records += 1
            yield Document(str(rid) if rid is not None else f"{path.name}/{row}", text, {})


def read_documents(
    path: str | os.PathLike,
    fmt: str = "auto",
    *,
    text_key: str = "text",
    id_key: str = "id",
    stats: ReadStats | None = None,
) -> Iterator[Document]:
    """Yield the documents of one file; never raises for bad content (see ``stats``).

    ``fmt`` is one of ``auto, warc, wet, jsonl, parquet, text``. WARC yields HTML responses with
    the raw body in ``metadata["html_bytes"]`` and empty text (the ``html`` step extracts it); WET
    yields the extracted text; ``text`` treats the whole file as one document.
    """
    p = Path(path)
    st = stats if stats is not None else ReadStats()
    st.files += 1
    kind = detect_format(p) if fmt == "auto" else fmt
    if kind not in FORMATS:
        raise ValueError(f"unknown input format {fmt!r} (known: {', '.join(FORMATS)})")
    try:
        if kind in ("warc", "wet"):
            yield from _read_warc(p, st, wet=kind == "wet")
        elif kind == "jsonl":
            yield from _read_jsonl(p, st, text_key, id_key)
        elif kind == "parquet":
            yield from _read_parquet(p, st, text_key, id_key)
        else:
            with _open_binary(p) as f:
                data = f.read()
            st.records += 1
            yield Document(p.name, decode_utf8(data, st), {"source": p.name})
    except (OSError, EOFError, ValueError) as e:
        # An unreadable file (missing, permissions, corrupt container) is recorded, not fatal.
        st.bad_files.append(f"{p}: {type(e).__name__}: {e}")


def read_warc(path: str | os.PathLike, stats: ReadStats | None = None) -> Iterator[Document]:
    """HTML responses of a WARC file (plain, .gz or .lz4); see :func:`read_documents`."""
    return read_documents(path, "warc", stats=stats)


def read_wet(path: str | os.PathLike, stats: ReadStats | None = None) -> Iterator[Document]:
    """Text conversion records of a WET file; see :func:`read_documents`."""
    return read_documents(path, "wet", stats=stats)


def read_jsonl(
    path: str | os.PathLike, text_key: str = "text", stats: ReadStats | None = None
) -> Iterator[Document]:
    """Records of a JSONL file (.jsonl, .jsonl.gz, .jsonl.zst); see :func:`read_documents`."""
    return read_documents(path, "jsonl", text_key=text_key, stats=stats)


def read_parquet(
    path: str | os.PathLike, text_key: str = "text", stats: ReadStats | None = None
) -> Iterator[Document]:
    """Rows of a Parquet file's ``text_key`` column; see :func:`read_documents`."""
    return read_documents(path, "parquet", text_key=text_key, stats=stats)


def read_text(path: str | os.PathLike, stats: ReadStats | None = None) -> Iterator[Document]:
    """A plain text file as one document; see :func:`read_documents`."""
    return read_documents(path, "text", stats=stats)


def document_to_json(doc: Document) -> str:
    """One JSONL line for ``doc`` (metadata values that are bytes are left out)."""
    meta = {k: v for k, v in doc.metadata.items() if not isinstance(v, bytes | bytearray)}
    return json.dumps({"id": doc.id, "text": doc.text, "metadata": meta}, ensure_ascii=False)
