"""Incremental detokenization and stop strings, one sequence at a time (the engine's text side).

The engine turns each sampled token into text as it goes, so a stop string ends the sequence
at the step it appears (its KV blocks are freed at once) and the server streams text that is
final. Per token the work is O(that token), never a re-decode of the whole output:

- **Byte-level tokenizers** (the tokenizer has ``id_to_bytes``: lmforge's BPE and every
  GPT-2-style import): the token's bytes go through an incremental UTF-8 decoder, which holds
  back an incomplete character until its last byte arrives. The pieces concatenate to exactly
  ``tokenizer.decode(ids)`` (the same U+FFFD replacement of invalid bytes, flushed at the end).
- **Any other ``decode(ids) -> str``** (HF ``tokenizers`` wrappers, SentencePiece-style
  decoders whose output depends on the neighbouring tokens): the offsets method vLLM uses.
  Decode a short window ``ids[prefix:]`` and ``ids[prefix:read]``; the difference is the new
  text, released only when it does not end in U+FFFD (an incomplete character). The window
  starts a few prompt tokens back so a leading-space marker decodes as it does in context, and
  it moves up with every release, so its length is the handful of tokens since the last one.

Stop strings (:class:`StopMatcher`): released text never ends with a possible beginning of a
stop string; that tail is held back until the next token decides. So a stop string that spans
token boundaries is found when its last character arrives, the text before it is all that was
ever released, and nothing of the stop string leaks into a stream. Invariant (why searching
only the held tail plus the new piece suffices): the held tail is the *longest* suffix of the
text that is a proper prefix of some stop string, so no match can start in released text.

Exercised by ``pytest tests/test_serve_detok.py`` (hypothesis: pieces equal the full decode;
stop cuts equal a token-by-token full-decode reference).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "StopMatcher", "make_detokenizer", "release"]

_CONTEXT = 5  # prompt tokens the windowed decoder starts with (as vLLM does)
_REPLACEMENT = "\ufffd"


class StopMatcher:
    """Finds the first stop string in a stream of text pieces, holding back possible starts."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str | None]:
        """(text now safe to release, the stop string matched or None).

        After a match the text before the stop string is released and nothing after it.
        """
        if not self.stops:
            return piece, None
        buf = self.held + piece
        cut, which = -1, None
        for s in self.stops:
            at = buf.find(s)
            if at != -1 and (cut == -1 or at < cut):
                cut, which = at, s
        if which is not None:
            self.held = ""
            return buf[:cut], which
        hold = 0
        for s in self.stops:  # the longest suffix of buf that is a proper prefix of a stop
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """The held tail (the sequence ended without a match: it is ordinary text)."""
        out, self.held = self.held, ""
        return out


class IncrementalDetokenizer:
    """One sequence's text: :meth:`feed` each new token, :meth:`flush` when it ends."""

    def __init__(
        self,
        decode: Callable[[list[int]], str] | None = None,
        id_to_bytes: Callable[[int], bytes] | None = None,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        if (decode is None) == (id_to_bytes is None):
            raise ValueError("give exactly one of decode, id_to_bytes")
        self._bytes = id_to_bytes
        self._decode = decode
        if id_to_bytes is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            self._ids = [int(t) for t in prompt_ids[len(prompt_ids) - _CONTEXT :]]
            self._prefix = 0  # window start
            self._read = len(self._ids)  # tokens whose text has been released

    def feed(self, token: int) -> str:
        """The text ``token`` completes (may be empty while a character is incomplete)."""
        if self._bytes is not None:
            return self._utf8.decode(self._bytes(token))
        self._ids.append(int(token))
        assert self._decode is not None
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        if len(now) <= len(before) or now.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or an incomplete character at the end: wait
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > 64:  # keep the list short: nothing before the window is read again
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return now[len(before) :]

    def flush(self) -> str:
        """Whatever is held back when the sequence ends (incomplete bytes become U+FFFD)."""
        if self._bytes is not None:
            return self._utf8.decode(b"", final=True)
        if self._read == len(self._ids):
            return ""
        assert self._decode is not None
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return now[len(before) :]


def make_detokenizer(tokenizer: Any, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
    """The fitting decoder for ``tokenizer`` (byte-level when it exposes ``id_to_bytes``)."""
    to_bytes = getattr(tokenizer, "id_to_bytes", None)
    if callable(to_bytes):
        return IncrementalDetokenizer(id_to_bytes=to_bytes)
    return IncrementalDetokenizer(decode=lambda ids: tokenizer.decode(ids), prompt_ids=prompt_ids)


def release(
    detok: IncrementalDetokenizer, stops: StopMatcher | None, token: int, reason: str | None
) -> tuple[str, str | None]:
    """The text sampled ``token`` releases and the stop string it completed (or None): the one
    per-token step of the engine's text and of the server's output processor. ``reason`` ends
    the sample here: 'stop' (an EOS / stop id, which is not text) or 'length'."""
    if reason == "stop":
        piece = detok.flush()
    else:
        piece = detok.feed(token)
        if reason is not None:
            piece += detok.flush()
    if stops is None:
        return piece, None
    piece, hit = stops.feed(piece)
    if hit is None and reason is not None:
        piece += stops.flush()
    return piece, hit
