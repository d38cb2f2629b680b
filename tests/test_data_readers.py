"""WARC/WET/WAT and text readers: HTTP body decoding, record-type detection, invalid UTF-8 counts."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path

import pytest

from lmforge.data.readers import (
    HttpBodyError,
    ReadStats,
    dechunk,
    decode_http_body,
    read_documents,
)

HTML = (
    b"<html><head><title>Creative Commons</title></head><body>"
    + b"<p>Homepage of a page long enough to need several chunks. </p>" * 40
    + b"</body></html>"
)


def _chunked(data: bytes, size: int = 300, ext: bool = False) -> bytes:
    out = b""
    for i in range(0, len(data), size):
        piece = data[i : i + size]
        out += f"{len(piece):x}".encode() + (b";name=v" if ext else b"") + b"\r\n" + piece + b"\r\n"
    return out + b"0\r\nX-Trailer: 1\r\n\r\n"


def _warc_record(
    payload: bytes, kind: str = "response", ctype: str = "application/http; msgtype=response"
) -> bytes:
    head = (
        "WARC/1.0\r\n"
        f"WARC-Type: {kind}\r\n"
        "WARC-Record-ID: <urn:uuid:00000000-0000-0000-0000-000000000001>\r\n"
        "WARC-Target-URI: http://example.com/\r\n"
        "WARC-Date: 2024-05-01T00:00:00Z\r\n"
        f"Content-Type: {ctype}\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    return head + payload + b"\r\n\r\n"


def _http(body: bytes, *headers: str) -> bytes:
    lines = ["HTTP/1.1 200 OK", "Content-Type: text/html; charset=utf-8", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _read(path: Path, fmt: str = "warc") -> tuple[list, ReadStats]:
    st = ReadStats()
    return list(read_documents(path, fmt, stats=st)), st


def test_dechunk_sizes_extensions_trailers_and_truncation() -> None:
    assert dechunk(_chunked(HTML)) == HTML
    assert dechunk(_chunked(HTML, 7, ext=True)) == HTML
    assert dechunk(b"5\nhello\n0\n") == b"hello"  # bare LF line ends
    cut = _chunked(HTML)[:1000]
    assert HTML.startswith(dechunk(cut)) and len(dechunk(cut)) > 500  # what arrived stands
    with pytest.raises(HttpBodyError):
        dechunk(b"<html>not chunked</html>")


def _deflate_raw(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


ENCODINGS = {
    "plain": (lambda b: b, ()),
    "chunked": (_chunked, ("Transfer-Encoding: chunked",)),
    "gzip": (gzip.compress, ("Content-Encoding: gzip",)),
    "deflate-zlib": (zlib.compress, ("Content-Encoding: deflate",)),
    "deflate-raw": (_deflate_raw, ("Content-Encoding: deflate",)),
    "chunked+gzip": (
        lambda b: _chunked(gzip.compress(b), 100),
        ("Content-Encoding: gzip", "Transfer-Encoding: chunked"),
    ),
}


@pytest.mark.requires("fastwarc")
@pytest.mark.parametrize(
    "name", [*ENCODINGS, pytest.param("br", marks=pytest.mark.requires("brotli"))]
)
def test_warc_reader_decodes_http_bodies(tmp_path: Path, name: str) -> None:
    if name == "br":
        import brotli

        encode, headers = brotli.compress, ("Content-Encoding: br",)
    else:
        encode, headers = ENCODINGS[name]
    path = tmp_path / "one.warc"
    path.write_bytes(_warc_record(_http(encode(HTML), *headers)))
    docs, st = _read(path)
    assert [d.metadata["html_bytes"] for d in docs] == [HTML]
    assert st.records == 1 and not st.malformed


@pytest.mark.requires("fastwarc")
def test_warc_reader_counts_undecodable_bodies(tmp_path: Path) -> None:
    bad = gzip.compress(HTML)[:10] + b"\x00" * 50  # a gzip header, then garbage
    path = tmp_path / "bad.warc.gz"
    path.write_bytes(
        gzip.compress(
            _warc_record(_http(bad, "Content-Encoding: gzip"))
            + _warc_record(_http(HTML, "Content-Encoding: compress"))
            + _warc_record(_http(HTML))
        )
    )
    docs, st = _read(path)
    assert [d.metadata["html_bytes"] for d in docs] == [HTML]
    assert st.malformed["bad_content_encoding"] == 2


def test_decode_http_body_order_and_counts() -> None:
    st = ReadStats()
    body = _chunked(gzip.compress(zlib.compress(HTML)))
    # Content-Encoding "deflate, gzip": deflate applied first, so gzip is undone first.
    assert decode_http_body(body, "chunked", "deflate, gzip", st) == HTML
    assert st.decoded == {"chunked": 1, "gzip": 1, "deflate": 1}
    # A header that says chunked over a body the archiver already de-chunked.
    assert decode_http_body(HTML, "chunked", "", ReadStats()) == HTML


@pytest.mark.requires("fastwarc")
def test_wet_and_wat_records_are_detected_in_a_warc(tmp_path: Path) -> None:
    text = b"A WET conversion record holds the page text.\nSecond line."
    path = tmp_path / "mixed.warc"  # named .warc, holds WET and WAT records
    path.write_bytes(
        _warc_record(text, "conversion", "text/plain")
        + _warc_record(b'{"Envelope": {}}', "metadata", "application/json")
        + _warc_record(b"\xff\xfebad utf-8 \xc3", "conversion", "text/plain")
    )
    docs, st = _read(path, "warc")
    assert [d.text for d in docs] == [text.decode(), "\ufffd\ufffdbad utf-8 \ufffd"]
    assert not st.malformed  # metadata beside documents (as in crawl WARCs) is not an error
    assert st.invalid_utf8_bytes == 3 and st.invalid_utf8_records == 1
    wet_docs, _ = _read(path, "wet")
    assert [d.text for d in wet_docs] == [d.text for d in docs]
    wat = tmp_path / "only.warc"
    wat.write_bytes(_warc_record(b"{}", "metadata", "application/json") * 3)
    docs, st = _read(wat, "warc")
    assert docs == [] and st.malformed == {"wat_metadata": 3}


def test_jsonl_and_text_count_invalid_utf8(tmp_path: Path) -> None:
    jl = tmp_path / "a.jsonl"
    jl.write_bytes(
        json.dumps({"id": "ok", "text": "fine"}).encode()
        + b'\n{"id": "bad", "text": "caf\xe9 \xff"}\n'
    )
    docs, st = _read(jl, "jsonl")
    assert [d.text for d in docs] == ["fine", "caf\ufffd \ufffd"]
    assert (st.invalid_utf8_bytes, st.invalid_utf8_records) == (2, 1)
    # A cut multi-byte character: 2 bad bytes, one U+FFFD, exactly as errors="replace" shows it.
    cut = tmp_path / "cut.txt"
    cut.write_bytes(b"price \xe2\x82 euro")
    docs, st = _read(cut, "text")
    assert docs[0].text == b"price \xe2\x82 euro".decode("utf-8", "replace") == "price \ufffd euro"
    assert st.invalid_utf8_bytes == 2
    txt = tmp_path / "a.txt"
    txt.write_bytes("clean \ufffd already".encode() + b" \x80")
    docs, st = _read(txt, "text")
    assert docs[0].text == "clean \ufffd already \ufffd"
    assert (st.invalid_utf8_bytes, st.invalid_utf8_records) == (1, 1)


@pytest.mark.requires("fastwarc")
def test_shared_warcs_decode_chunked_bodies(shared_data: Path) -> None:
    # The dolma wget WARCs hold 6 chunked responses; they used to reach extraction with their
    # hex chunk sizes in the text. Our decoding must agree with fastwarc's own.
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    for name in ("sample-0000.warc.gz", "sample-0001.warc.gz"):
        path = shared_data / "web" / "dolma" / name
        docs, st = _read(path)
        with open(path, "rb") as f:
            peer = {}
            for rec in ArchiveIterator(f, record_types=WarcRecordType.response, parse_http=False):
                rec.parse_http(auto_decode="all")
                peer[rec.record_id] = rec.reader.read()
        assert docs and st.decoded["chunked"] >= 1
        for d in docs:
            body = d.metadata["html_bytes"]
            assert body == peer[d.id]
            assert not re.match(rb"[0-9a-fA-F]+\r\n", body), body[:20]  # no chunk size left


@pytest.mark.requires("fastwarc")
def test_shared_wet_and_wat_read_as_warc(shared_data: Path) -> None:
    web = shared_data / "web" / "cc_whirlwind"
    docs, st = _read(web / "whirlwind.warc.wet.gz", "warc")
    assert len(docs) == 1 and len(docs[0].text.split()) > 20
    docs, st = _read(web / "whirlwind.warc.wat.gz", "warc")
    assert docs == [] and st.malformed["wat_metadata"] >= 1
