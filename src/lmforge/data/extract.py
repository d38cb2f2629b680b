"""HTML → text with charset detection: resiliparse by default, trafilatura as an option.

Exercised by the ``html`` pipeline step (``lmforge data run configs/pipelines/web.toml``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lmforge.data.core import Document, Mapper


def extract_text_from_html_bytes(html_bytes: bytes, backend: str = "resiliparse") -> str | None:
    """Plain text of an HTML page given as raw bytes, or ``None`` when nothing can be extracted.

    The charset is detected from the bytes (meta tags, BOM, then statistics) by resiliparse and
    the page decoded with replacement of undecodable bytes. ``backend="trafilatura"`` extracts the
    main content only and needs the optional ``trafilatura`` package.
    """
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    if not html_bytes:
        return None
    html = bytes_to_str(html_bytes, detect_encoding(html_bytes))
    if backend == "resiliparse":
        from resiliparse.extract.html2text import extract_plain_text

        text = extract_plain_text(html)
    elif backend == "trafilatura":
        try:
            import trafilatura
        except ImportError:
            raise ImportError(
                "backend 'trafilatura' needs the trafilatura package (pip install trafilatura)"
            ) from None
        text = trafilatura.extract(html, favor_precision=True, include_comments=False)
    else:
        raise ValueError(f"unknown HTML backend {backend!r} (known: resiliparse, trafilatura)")
    if text is None:
        return None
    text = text.strip()
    return text or None


# ----------------------------------------------------------------------------- pipeline step


@dataclass(frozen=True)
class HtmlOptions:
    """``html``: extract text from the raw HTML a WARC reader parked in ``html_bytes``."""

    backend: Literal["resiliparse", "trafilatura"] = "resiliparse"
    "text extractor"


class HtmlStep(Mapper):
    """Extract text from ``metadata['html_bytes']``; pages with no text are dropped."""

    name = "html"

    def __init__(self, opts: HtmlOptions = HtmlOptions(), **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts

    def map(self, doc: Document) -> Document | str:
        raw = doc.metadata.pop("html_bytes", None)
        if raw is None:
            return doc if doc.text else "no_html"
        text = extract_text_from_html_bytes(raw, self.opts.backend)
        if not text:
            return "no_text"
        doc.text = text
        return doc
