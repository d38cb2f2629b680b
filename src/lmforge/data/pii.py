"""PII masking: e-mail addresses, US phone numbers and IPv4 addresses, each with a placeholder.

Exercised by the ``pii`` pipeline step and ``tests/test_data_text.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lmforge.data.core import Document, Mapper

EMAIL_PLACEHOLDER = "|||EMAIL_ADDRESS|||"
PHONE_PLACEHOLDER = "|||PHONE_NUMBER|||"
IP_PLACEHOLDER = "|||IP_ADDRESS|||"

_EMAIL = re.compile(r"[A-Za-z0-9._%+\-]+@(?:[A-Za-z0-9\-]+\.)+[A-Za-z]{2,}")
# Ten digits with optional +1, optional parentheses round the area code and one optional
# separator (space, dot or dash) between groups; not inside a longer run of digits.
_PHONE = re.compile(
    r"(?<![\w+])(?:\+?1[\s.\-]?)?(?:\(\d{3}\)|\d{3})[\s.\-]?\d{3}[\s.\-]?\d{4}(?!\w)"
)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\d.]*\d)")


def mask_emails(text: str) -> tuple[str, int]:
    """Replace e-mail addresses with ``|||EMAIL_ADDRESS|||``; returns (masked text, count)."""
    return _EMAIL.subn(EMAIL_PLACEHOLDER, text)


def mask_phone_numbers(text: str) -> tuple[str, int]:
    """Replace US phone numbers (2831823829, (283)-182-3829, (283) 182 3829, 283-182-3829)."""
    return _PHONE.subn(PHONE_PLACEHOLDER, text)


def mask_ips(text: str) -> tuple[str, int]:
    """Replace IPv4 addresses (each octet 0–255) with ``|||IP_ADDRESS|||``."""
    return _IPV4.subn(IP_PLACEHOLDER, text)


def mask_pii(text: str) -> tuple[str, dict[str, int]]:
    """All three maskings in turn; returns the text and a count per kind."""
    text, e = mask_emails(text)
    text, p = mask_phone_numbers(text)
    text, i = mask_ips(text)
    return text, {"emails": e, "phones": p, "ips": i}


# ----------------------------------------------------------------------------- pipeline step


@dataclass(frozen=True)
class PiiOptions:
    """``pii``: mask e-mail addresses, phone numbers and IPv4 addresses."""

    emails: bool = True
    "mask e-mail addresses"
    phones: bool = True
    "mask US phone numbers"
    ips: bool = True
    "mask IPv4 addresses"


class PiiStep(Mapper):
    """Mask PII; counts of masked items go to the step's ``notes`` counter."""

    name = "pii"

    def __init__(self, opts: PiiOptions = PiiOptions(), **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts

    def map(self, doc: Document) -> Document | str:
        text = doc.text
        for on, fn, key in (
            (self.opts.emails, mask_emails, "emails"),
            (self.opts.phones, mask_phone_numbers, "phones"),
            (self.opts.ips, mask_ips, "ips"),
        ):
            if on:
                text, n = fn(text)
                if n:
                    self.stats.notes[f"masked_{key}"] += n
        doc.text = text
        return doc
