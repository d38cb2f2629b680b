"""The output processor: what the engine sampled (ids, logprobs) becomes text, beside the server.

The engine works on token ids only; the server's process turns each request's new ids into
text (incremental detokenization, :mod:`lmforge.serve.detok`) and ends samples on ``stop``
strings here, outside the engine's lock (and, with :mod:`lmforge.serve.engine_process`, outside
the engine's process), as vLLM's output processor does. A sample that hit a stop string is
finished at once (its text never goes past the stop string, its ids end at the token that
completed it); the server then aborts the engine's request, which may have sampled a token or
two more meanwhile (they are dropped, never shown).

The engine side sends :class:`Delta` objects (one per request per step, O(new tokens)); the
handler feeds them to one :class:`OutputProcessor` per request.

Exercised by ``pytest tests/test_serve_server.py`` (streamed text equals non-streamed text and
the solo engine's decode; stop strings spanning tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from lmforge.serve.detok import IncrementalDetokenizer, StopMatcher, make_detokenizer, release

__all__ = [
    "Delta",
    "DeltaTracker",
    "OutputProcessor",
    "Piece",
    "SampleDelta",
    "engine_counts",
    "join_pieces",
]


@dataclasses.dataclass(slots=True)
class SampleDelta:
    """What one sample gained in one engine step (ids only: no text)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None
    "'stop' (a stop / EOS id: the last id is not text), 'length', None running"


@dataclasses.dataclass(slots=True)
class Delta:
    """A request's progress in one engine step; ``error`` set when the engine failed."""

    samples: list[SampleDelta]
    finished: bool
    error: str | None = None
    status: int = 500
    "the HTTP status of ``error`` (429: the queue filled up before the request was admitted)"


class DeltaTracker:
    """The engine side's view of one request: what it has sent, so each step's :class:`Delta`
    is sliced from the end of the engine's lists (O(new tokens), not O(output))."""

    __slots__ = ("n_tokens",)

    def __init__(self, n: int) -> None:
        self.n_tokens = [0] * n

    def delta(self, out: Any) -> Delta:
        """The :class:`Delta` of ``out`` (an engine ``RequestOutput``) since the last call."""
        samples = []
        for o in out.outputs:
            i = o.index
            a, b = self.n_tokens[i], len(o.token_ids)
            if a == b and o.finish_reason is None:
                continue
            self.n_tokens[i] = b
            tops = o.top_logprobs[a:b] if o.top_logprobs is not None else []
            samples.append(SampleDelta(i, o.token_ids[a:b], o.logprobs[a:b], tops, o.finish_reason))
        return Delta(samples, out.finished)


def engine_counts(engine: Any) -> dict[str, float]:
    """The engine's gauges and counters that ``/metrics`` reports (read between steps)."""
    a = engine.allocator
    return {
        "running": len(engine.running),
        "waiting": len(engine.waiting),
        "kv_used": a.num_used,
        "kv_total": a.num_blocks,
        "generated_tokens": engine.stats["generated_tokens"],
        "preemptions": engine.stats["preemptions"],
        "prefix_hits": a.hits,
    }


@dataclasses.dataclass(slots=True)
class Piece:
    """What one sample adds to the response: text, the ids behind it, why it ended."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None


class _Sample:
    __slots__ = ("detok", "done", "stops")

    def __init__(self, detok: IncrementalDetokenizer, stops: Sequence[str]) -> None:
        self.detok = detok
        self.stops = StopMatcher(stops) if stops else None
        self.done = False

    def feed(self, sd: SampleDelta) -> Piece:
        texts: list[str] = []
        ids, last = sd.token_ids, len(sd.token_ids) - 1
        for j, tok in enumerate(ids):
            piece, hit = release(
                self.detok, self.stops, tok, sd.finish_reason if j == last else None
            )
            texts.append(piece)
            if hit is not None:  # ends here: ids up to this token, nothing after
                self.done = True
                return Piece("".join(texts), ids[: j + 1], sd.logprobs[: j + 1],
                             sd.top_logprobs[: j + 1], "stop")  # fmt: skip
        self.done = sd.finish_reason is not None
        return Piece("".join(texts), ids, sd.logprobs, sd.top_logprobs, sd.finish_reason)


class OutputProcessor:
    """One request's text side: its ``n`` samples' detokenizers and stop-string matchers."""

    def __init__(self, tokenizer: Any, prompt: Sequence[int], n: int, stops: Sequence[str]) -> None:
        self.samples = [_Sample(make_detokenizer(tokenizer, prompt), stops) for _ in range(n)]

    @property
    def finished(self) -> bool:
        """Every sample has ended (by the engine or by a stop string)."""
        return all(s.done for s in self.samples)

    def process(self, deltas: Sequence[Delta]) -> dict[int, Piece]:
        """Per sample index, what ``deltas`` (in order) add; finished samples add nothing."""
        out: dict[int, Piece] = {}
        for d in deltas:
            for sd in d.samples:
                s = self.samples[sd.index]
                if s.done:
                    continue
                p = s.feed(sd)
                prev = out.get(sd.index)
                out[sd.index] = p if prev is None else join_pieces(prev, p)
        return out


def join_pieces(a: Piece, b: Piece) -> Piece:
    """``a`` then ``b`` as one piece (b's finish reason)."""
    return Piece(a.text + b.text, a.token_ids + b.token_ids, a.logprobs + b.logprobs,
                 a.top_logprobs + b.top_logprobs, b.finish_reason)  # fmt: skip
