"""The pipeline's shape: a :class:`Document` record, streaming steps, filters, mappers and stats.

Every step is ``run(docs, rank, world_size) -> Iterator[Document]`` (datatrove's shape). A
:class:`Filter` only implements ``filter(doc) -> bool | (bool, reason)``; what it drops goes, with
the reason, to an optional exclusion sink. A :class:`Mapper` rewrites a document (or drops it by
returning a drop reason). Each step counts documents in and out, drops by reason, UTF-8 bytes
in and out and the seconds spent inside it, in a :class:`StepStats` that the executors merge
across shards and print as one table.

Exercised by ``lmforge data run configs/pipelines/web.toml``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Document:
    """One document flowing through a pipeline: a stable id, its text and free-form metadata.

    ``metadata`` values must be JSON-serialisable to be written out; readers may park raw bytes
    there (``html_bytes``) for the next step, and writers skip values that are bytes.
    """

    id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepStats:
    """Counters for one step: documents in/out, drops by reason, UTF-8 bytes in/out, seconds inside."""

    name: str
    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    dropped: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)
    "counts that are not drops (items masked, documents flagged)"

    def merge(self, other: StepStats) -> None:
        """Add ``other``'s counts to these (used to combine shards)."""
        self.docs_in += other.docs_in
        self.docs_out += other.docs_out
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.seconds += other.seconds
        self.dropped.update(other.dropped)
        self.notes.update(other.notes)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (stored next to each finished shard so a resumed run can report totals)."""
        return {
            "name": self.name,
            "docs_in": self.docs_in,
            "docs_out": self.docs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "seconds": self.seconds,
            "dropped": dict(self.dropped),
            "notes": dict(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepStats:
        """Inverse of :meth:`to_dict`."""
        return cls(
            name=d["name"],
            docs_in=d["docs_in"],
            docs_out=d["docs_out"],
            bytes_in=d["bytes_in"],
            bytes_out=d["bytes_out"],
            seconds=d["seconds"],
            dropped=Counter(d["dropped"]),
            notes=Counter(d.get("notes", {})),
        )


ExclusionSink = Callable[[Document, str, str], None]
"""Receives (document, step name, reason) for every dropped document."""


def _nbytes(doc: Document) -> int:
    return len(doc.text.encode("utf-8", errors="surrogatepass"))


class Step:
    """Base of every pipeline step: a streaming transformation with counters.

    Subclasses implement :meth:`process` (one document in, zero or one out, plus a drop reason) or
    override :meth:`run` entirely for steps that emit several documents per input.
    """

    name = "step"

    def __init__(self, exclusion: ExclusionSink | None = None) -> None:
        self.stats = StepStats(self.name)
        self.exclusion = exclusion

    def process(self, doc: Document) -> tuple[Document | None, str]:
        """Return (document or None, reason for the drop)."""
        raise NotImplementedError

    def run(
        self, docs: Iterable[Document], rank: int = 0, world_size: int = 1
    ) -> Iterator[Document]:
        """Apply :meth:`process` to each document, counting and timing, yielding survivors.

        ``rank``/``world_size`` say which shard of the job this is; per-document steps ignore them.
        """
        st = self.stats
        clock = time.perf_counter
        for doc in docs:
            st.docs_in += 1
            st.bytes_in += _nbytes(doc)
            t0 = clock()
            out, reason = self.process(doc)
            st.seconds += clock() - t0
            if out is None:
                st.dropped[reason] += 1
                if self.exclusion is not None:
                    self.exclusion(doc, self.name, reason)
                continue
            st.docs_out += 1
            st.bytes_out += _nbytes(out)
            yield out

    def __call__(self, docs: Iterable[Document]) -> Iterator[Document]:
        return self.run(docs)


class Filter(Step):
    """A step that keeps or drops documents unchanged: implement :meth:`filter` only."""

    name = "filter"

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        """True to keep; or (keep, reason) to name why a document is dropped."""
        raise NotImplementedError

    def process(self, doc: Document) -> tuple[Document | None, str]:
        r = self.filter(doc)
        if isinstance(r, tuple):
            keep, reason = r
        else:
            keep, reason = r, self.name
        return (doc if keep else None), reason


class Mapper(Step):
    """A step that rewrites documents: implement :meth:`map` returning the new doc or a drop reason."""

    name = "mapper"

    def map(self, doc: Document) -> Document | str:
        """The rewritten document, or a string naming why it is dropped."""
        raise NotImplementedError

    def process(self, doc: Document) -> tuple[Document | None, str]:
        r = self.map(doc)
        if isinstance(r, str):
            return None, r
        return r, ""


def run_steps(
    docs: Iterable[Document], steps: Iterable[Step], rank: int = 0, world_size: int = 1
) -> Iterator[Document]:
    """Chain ``steps`` lazily over ``docs`` (nothing runs until the result is iterated)."""
    stream: Iterable[Document] = docs
    for step in steps:
        stream = step.run(stream, rank, world_size)
    return iter(stream)
