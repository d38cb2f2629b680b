"""HTML → text with charset detection: resiliparse by default, trafilatura as an option.

Exercised by the ``html`` pipeline step (``lmforge data run configs/pipelines/web.toml``).
"""

from __future__ import annotations


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
