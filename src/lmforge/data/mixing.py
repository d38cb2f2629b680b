"""Mixing sources with weights and per-source epoch caps (UniMax, Chung et al. 2023).

Given each source's size in tokens, a weight and an epoch cap, :func:`mix_plan` splits a token
budget by weight, caps every source at ``max_epochs × size`` and hands the excess to the
uncapped sources in proportion to their weights (water-filling); UniMax is the case of equal
weights. The plan reports each source's effective epochs; :func:`write_mixture` materialises it
(whole epochs repeated, the fractional epoch sampled per document with a seed).

Exercised by ``lmforge data mix`` and ``tests/test_data_pipeline.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MixSource:
    """One source of a mixture."""

    name: str
    "source name"
    tokens: int
    "tokens available in the source (one epoch)"
    weight: float = 1.0
    "relative share of the budget before capping"
    max_epochs: float = 4.0
    "never repeat the source more than this many times"


@dataclass(frozen=True)
class MixRow:
    """A source's share of a plan."""

    name: str
    tokens_available: int
    tokens_taken: float
    effective_epochs: float
    capped: bool


def mix_plan(sources: Sequence[MixSource], token_budget: int) -> tuple[list[MixRow], float]:
    """Split ``token_budget`` over ``sources``; returns (rows, shortfall in tokens).

    The shortfall is positive when every source hits its cap before the budget is met.
    """
    if token_budget < 0:
        raise ValueError("token budget must be non-negative")
    for s in sources:
        if s.tokens < 0 or s.weight < 0 or s.max_epochs < 0:
            raise ValueError(f"source {s.name!r}: tokens, weight and max_epochs must be >= 0")
    take = {s.name: 0.0 for s in sources}
    open_ = [s for s in sources if s.weight > 0 and s.tokens > 0 and s.max_epochs > 0]
    remaining = float(token_budget)
    while open_ and remaining > 1e-9:
        wsum = sum(s.weight for s in open_)
        capped = []
        for s in open_:
            cap = s.max_epochs * s.tokens - take[s.name]
            if remaining * s.weight / wsum >= cap:
                capped.append((s, cap))
        if not capped:
            for s in open_:
                take[s.name] += remaining * s.weight / wsum
            remaining = 0.0
            break
        for s, cap in capped:
            take[s.name] += cap
            remaining -= cap
        open_ = [s for s in open_ if all(s is not c for c, _ in capped)]
    rows = [
        MixRow(
            s.name,
            s.tokens,
            take[s.name],
            take[s.name] / s.tokens if s.tokens else 0.0,
            s.tokens > 0 and take[s.name] >= s.max_epochs * s.tokens - 1e-6,
        )
        for s in sources
    ]
    return rows, max(0.0, remaining)


def format_mix_table(rows: Sequence[MixRow], shortfall: float) -> str:
    """A markdown table of a plan, with the shortfall (if any) on the last line."""
    out = ["| source | tokens | taken | share | epochs | capped |", "|---|---:|---:|---:|---:|:-:|"]
    total = sum(r.tokens_taken for r in rows) or 1.0
    for r in rows:
        out.append(
            f"| {r.name} | {r.tokens_available:,} | {r.tokens_taken:,.0f} | "
            f"{r.tokens_taken / total:.1%} | {r.effective_epochs:.2f} | {'yes' if r.capped else ''} |"
        )
    if shortfall > 0:
        out.append(f"\nshortfall: {shortfall:,.0f} tokens (every source is at its epoch cap)")
    return "\n".join(out)


def count_tokens(files: Sequence[str | os.PathLike], tokenizer: str = "bytes") -> int:
    """Tokens in ``files`` (every readable format) under ``tokenizer`` (``"bytes"`` or a folder)."""
    from lmforge.data.readers import read_documents
    from lmforge.data.shards import load_encoder

    enc = load_encoder(tokenizer)
    return sum(len(enc.encode(d.text)) for f in files for d in read_documents(f))


def write_mixture(
    rows: Sequence[MixRow],
    source_files: dict[str, Sequence[str | os.PathLike]],
    out_dir: str | os.PathLike,
    seed: int = 0,
) -> dict[str, int]:
    """Materialise a plan: ``out_dir/NAME.jsonl.gz`` per source, documents repeated per epochs.

    A source planned for ``e`` epochs writes every document ``floor(e)`` times plus once more
    for a seeded, per-document random ``e - floor(e)`` fraction, so the tokens written match
    the plan in expectation. Returns documents written per source. Order within a file is the
    reading order (shuffling is the trainer's job).
    """
    import math

    import xxhash

    from lmforge.data.core import Document
    from lmforge.data.dedup import write_documents
    from lmforge.data.readers import read_documents

    written: dict[str, int] = {}
    for r in rows:
        full = math.floor(r.effective_epochs)
        frac = r.effective_epochs - full

        def docs(r: MixRow = r, full: int = full, frac: float = frac) -> Iterator[Document]:
            for f in source_files[r.name]:
                for d in read_documents(f):
                    u = xxhash.xxh64_intdigest(f"{r.name}/{d.id}".encode(), seed=seed) / 2**64
                    for _ in range(full + (u < frac)):
                        d.metadata["source"] = r.name
                        yield d

        written[r.name] = write_documents(Path(out_dir) / f"{r.name}.jsonl.gz", docs(), False)
    return written
