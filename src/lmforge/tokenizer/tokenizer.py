"""The byte-level BPE tokenizer: encode, decode, stream, and the GPT-2 / lmforge file formats.

Encoding splits the text on special tokens (longest match first), pre-tokenizes each stretch with
the GPT-2 pattern, and applies merges by rank inside each pre-token, in id space: ``_merge_map``
sends an adjacent id pair to (rank, merged id). Pre-token → ids results are cached, which is
where nearly all the speed comes from on natural text. The slow reference is
``lmforge.tokenizer._reference.reference_encode``; corpus-scale encoding goes through the tiktoken
export (``lmforge.tokenizer.export``), which returns identical ids.

On-disk format written by :meth:`Tokenizer.save` (a self-contained folder)::

    vocab.json              GPT-2 format: {token as byte-mapped unicode: id}, specials included
    merges.txt              GPT-2 format: "#version: 0.2" then one "A B" merge per line
    lmforge_tokenizer.json  {"format": "lmforge-bpe-v1", "special_tokens": {text: id},
                             "pattern": ..., "vocab_size": V, "sha256": fingerprint}
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import regex

from lmforge.tokenizer._pretokenize import GPT2_PATTERN, special_split_regex
from lmforge.tokenizer.train import check_special_tokens
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

FORMAT = "lmforge-bpe-v1"
META_FILE = "lmforge_tokenizer.json"
EOT = "<|endoftext|>"
_CACHE_LIMIT = 1 << 18  # distinct pre-tokens cached before the cache is reset


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map used in ``vocab.json``/``merges.txt``.

    Printable Latin-1 bytes map to themselves; the other 68 (controls, space, ...) map to
    U+0100 upwards in byte order, so every token is a whitespace-free string.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of :func:`bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


def token_to_str(token: bytes) -> str:
    """A token's bytes as GPT-2's byte-mapped string."""
    m = bytes_to_unicode()
    return "".join(m[x] for x in token)


def str_to_token(s: str) -> bytes | None:
    """Inverse of :func:`token_to_str`; None when ``s`` holds a character outside the map."""
    m = unicode_to_bytes()
    try:
        return bytes(m[c] for c in s)
    except KeyError:
        return None


class Tokenizer:
    """Byte-level BPE tokenizer over ``vocab`` (id → bytes) and ordered ``merges``.

    ``special_tokens`` are matched in the text before pre-tokenization, longest first; a special
    already in ``vocab`` (same bytes) keeps its id, otherwise it gets the next free id.
    Simplification: encoding is pure Python with a pre-token cache; use
    :func:`lmforge.tokenizer.to_tiktoken` for corpus-scale speed. Exercised by
    ``lmforge tokenizer encode --tokenizer DIR --input F --out X.bin``.
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Sequence[str] | None = None,
    ) -> None:
        self.vocab: dict[int, bytes] = {int(i): bytes(b) for i, b in vocab.items()}
        self.merges: list[tuple[bytes, bytes]] = [(bytes(a), bytes(b)) for a, b in merges]
        self.special_tokens: list[str] = check_special_tokens(special_tokens)
        specials_b = {s.encode("utf-8") for s in self.special_tokens}
        # Ordinary tokens by bytes; the lowest id wins if a vocabulary repeats bytes.
        self._ids: dict[bytes, int] = {}
        special_found: dict[bytes, int] = {}
        for i in sorted(self.vocab):
            b = self.vocab[i]
            if b in specials_b:
                special_found.setdefault(b, i)
            else:
                self._ids.setdefault(b, i)
        self.special_ids: dict[str, int] = {}
        next_id = max(self.vocab, default=-1) + 1
        for s in self.special_tokens:
            b = s.encode("utf-8")
            if b in special_found:
                self.special_ids[s] = special_found[b]
            else:
                self.vocab[next_id] = b
                self.special_ids[s] = next_id
                next_id += 1
        missing = [x for x in range(256) if bytes([x]) not in self._ids]
        if missing:
            raise LmforgeError(
                f"vocabulary lacks {len(missing)} of the 256 single bytes (first: byte {missing[0]})"
            )
        self._byte_ids: list[int] = [self._ids[bytes([x])] for x in range(256)]
        self._merge_map: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, (a, b) in enumerate(self.merges):
            ia, ib, im = self._ids.get(a), self._ids.get(b), self._ids.get(a + b)
            if ia is None or ib is None or im is None:
                bad = a if ia is None else b if ib is None else a + b
                raise LmforgeError(
                    f"merge {rank + 1} ({token_to_str(a)} {token_to_str(b)}): token "
                    f"{token_to_str(bad)!r} is not in the vocabulary"
                )
            self._merge_map.setdefault((ia, ib), (rank, im))
        self._pat = regex.compile(GPT2_PATTERN)
        self._special_re = special_split_regex(self.special_tokens)
        self._special_capture = (
            None if self._special_re is None else regex.compile(f"({self._special_re.pattern})")
        )
        self._max_special = max((len(s) for s in self.special_tokens), default=0)
        self._cache: dict[str, list[int]] = {}
        self._sha256: str | None = None

    # ----------------------------------------------------------------- properties
    @property
    def vocab_size(self) -> int:
        """Number of ids the model needs: the largest id + 1."""
        return max(self.vocab) + 1

    @property
    def eot_id(self) -> int | None:
        """Id of ``<|endoftext|>`` if it is a special token, else None."""
        return self.special_ids.get(EOT)

    @property
    def sha256(self) -> str:
        """Stable hex SHA-256 of vocab, merges and special tokens (recorded in shards, checkpoints)."""
        if self._sha256 is None:
            h = hashlib.sha256(FORMAT.encode() + b"\n")
            for i in sorted(self.vocab):
                h.update(f"{i} {self.vocab[i].hex()}\n".encode())
            h.update(b"merges\n")
            for a, b in self.merges:
                h.update(f"{a.hex()} {b.hex()}\n".encode())
            h.update(json.dumps(self.special_ids, sort_keys=True).encode())
            self._sha256 = h.hexdigest()
        return self._sha256

    def fingerprint(self) -> str:
        """Same as :attr:`sha256`."""
        return self.sha256

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"special_tokens={self.special_tokens})"
        )

    def __getstate__(self) -> dict:
        # Compiled patterns pickle fine, but the cache can be large; workers rebuild their own.
        state = self.__dict__.copy()
        state["_cache"] = {}
        return state

    # ----------------------------------------------------------------- encode
    def _bpe(self, piece: str) -> list[int]:
        byte_ids = self._byte_ids
        ids = [byte_ids[x] for x in piece.encode("utf-8")]
        mm = self._merge_map
        while len(ids) > 1:
            best = None
            best_rank = -1
            for p in itertools.pairwise(ids):
                m = mm.get(p)
                if m is not None and (best is None or m[0] < best_rank):
                    best, best_rank = p, m[0]
            if best is None:
                break
            a, b = best
            new = mm[best][1]
            out: list[int] = []
            i, n = 0, len(ids)
            while i < n:
                if ids[i] == a and i + 1 < n and ids[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            ids = out
        return ids

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        cache = self._cache
        for piece in self._pat.findall(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._bpe(piece)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens in the text become their ids."""
        out: list[int] = []
        if self._special_capture is None:
            self._encode_ordinary(text, out)
            return out
        for i, part in enumerate(self._special_capture.split(text)):
            if i % 2:
                out.append(self.special_ids[part])
            elif part:
                self._encode_ordinary(part, out)
        return out

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Stream the ids of the concatenation of ``iterable`` (e.g. an open file's lines).

        Memory stays bounded by the longest pre-token: the buffer keeps only text whose split may
        still change when more arrives (the last two pre-tokens, and anything that could start a
        special token).
        """
        buf = ""
        threshold = 1 << 12
        for chunk in iterable:
            buf += chunk
            if len(buf) < threshold:
                continue
            ids, buf = self._encode_prefix(buf)
            yield from ids
            # When little could be cut (one huge pre-token), wait for twice as much text before
            # trying again, so the rescans stay linear in the input.
            threshold = max(1 << 12, 2 * len(buf))
        if buf:
            yield from self.encode(buf)

    def _encode_prefix(self, buf: str) -> tuple[list[int], str]:
        """Encode the part of ``buf`` whose tokens cannot depend on text after it."""
        out: list[int] = []
        n = len(buf)
        start = 0
        # A special match starting at s with s + longest special <= n is final (no longer special
        # could still match there, and no earlier start can match later). Text up to its end
        # encodes independently of what follows.
        if self._special_capture is not None:
            pieces = self._special_capture.split(buf)
            pos = 0
            stop = 0
            for i, part in enumerate(pieces):
                if i % 2 and pos + self._max_special <= n:
                    stop = i + 1
                pos += len(part)
            for i in range(stop):
                part = pieces[i]
                if i % 2:
                    out.append(self.special_ids[part])
                elif part:
                    self._encode_ordinary(part, out)
            start = sum(len(p) for p in pieces[:stop])
        # No special can start before n - longest special + 1 (it would have matched). Within that
        # region all but the last two pre-tokens are final: each depends on at most one character
        # past its end (or two for a contraction), and the two after it supply those.
        limit = n - max(self._max_special - 1, 0)
        if self._special_re is not None:
            m = self._special_re.search(buf, start)
            if m is not None:
                limit = min(limit, m.start())
        if limit <= start:
            return out, buf[start:]
        starts = [m.start() for m in self._pat.finditer(buf, start, limit)]
        if len(starts) < 3:
            return out, buf[start:]
        cut = starts[-2]
        self._encode_ordinary(buf[start:cut], out)
        return out, buf[cut:]

    # ----------------------------------------------------------------- decode
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD."""
        vocab = self.vocab
        try:
            data = b"".join([vocab[int(i)] for i in ids])
        except KeyError as e:
            raise ValueError(f"token id {e.args[0]} is not in the vocabulary") from None
        return data.decode("utf-8", errors="replace")

    def id_to_bytes(self, i: int) -> bytes:
        """The bytes of one token."""
        return self.vocab[i]

    # ----------------------------------------------------------------- files
    @classmethod
    def from_files(
        cls,
        vocab_path: str | os.PathLike,
        merges_path: str | os.PathLike,
        special_tokens: Sequence[str] | None = None,
    ) -> Tokenizer:
        """Load GPT-2's ``vocab.json`` (``encoder.json``) and ``merges.txt`` (``vocab.bpe``).

        A special token found in ``vocab.json`` (literally, or byte-mapped) keeps that id.
        """
        vocab_path, merges_path = Path(vocab_path), Path(merges_path)
        for p in (vocab_path, merges_path):
            if not p.is_file():
                raise LmforgeError(f"tokenizer file not found: {p}")
        try:
            raw = json.loads(vocab_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LmforgeError(f"{vocab_path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict) or not raw:
            raise LmforgeError(f"{vocab_path}: expected a JSON object {{token: id}}")
        specials = check_special_tokens(special_tokens)
        vocab: dict[int, bytes] = {}
        for key, i in raw.items():
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise LmforgeError(f"{vocab_path}: token {key!r} has id {i!r}, expected an int ≥ 0")
            if i in vocab:
                raise LmforgeError(f"{vocab_path}: id {i} is used twice")
            b = key.encode("utf-8") if key in specials else str_to_token(key)
            if b is None:
                raise LmforgeError(
                    f"{vocab_path}: token {key!r} is not in GPT-2's byte-to-unicode mapping"
                )
            vocab[i] = b
        merges: list[tuple[bytes, bytes]] = []
        try:
            lines = merges_path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise LmforgeError(f"{merges_path}: not UTF-8 text") from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip() or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            pa = str_to_token(parts[0]) if len(parts) == 2 else None
            pb = str_to_token(parts[1]) if len(parts) == 2 else None
            if pa is None or pb is None or not pa or not pb:
                raise LmforgeError(
                    f"{merges_path}:{lineno}: expected two byte-mapped tokens 'A B', got {line!r}"
                )
            merges.append((pa, pb))
        try:
            return cls(vocab, merges, specials)
        except LmforgeError as e:
            raise LmforgeError(f"{vocab_path.parent}: {e}") from None

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``vocab.json``, ``merges.txt`` and ``lmforge_tokenizer.json`` into ``directory``
        (each atomically); :meth:`load` reads them back. Returns the folder."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        vocab_json: dict[str, int] = {}
        for i in sorted(self.vocab):
            key = token_to_str(self.vocab[i])
            if key in vocab_json:
                raise LmforgeError(
                    f"cannot save: ids {vocab_json[key]} and {i} hold the same bytes {key!r}"
                )
            vocab_json[key] = i
        atomic_write_text(d / "vocab.json", json.dumps(vocab_json, ensure_ascii=False) + "\n")
        lines = ["#version: 0.2"] + [f"{token_to_str(a)} {token_to_str(b)}" for a, b in self.merges]
        atomic_write_text(d / "merges.txt", "\n".join(lines) + "\n")
        meta = {
            "format": FORMAT,
            "special_tokens": self.special_ids,
            "pattern": GPT2_PATTERN,
            "vocab_size": self.vocab_size,
            "sha256": self.sha256,
        }
        atomic_write_text(d / META_FILE, json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load a folder written by :meth:`save`; checks the recorded fingerprint."""
        d = Path(directory)
        meta_path = d / META_FILE
        if not meta_path.is_file():
            raise LmforgeError(f"{d}: not an lmforge tokenizer folder (no {META_FILE})")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LmforgeError(f"{meta_path}: not valid JSON") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise LmforgeError(f"{meta_path}: format is not {FORMAT!r}")
        specials = meta.get("special_tokens") or {}
        if not isinstance(specials, dict):
            raise LmforgeError(f"{meta_path}: special_tokens must be an object {{text: id}}")
        tok = cls.from_files(d / "vocab.json", d / "merges.txt", list(specials))
        if tok.special_ids != specials:
            raise LmforgeError(f"{meta_path}: special token ids disagree with vocab.json")
        if meta.get("sha256") and meta["sha256"] != tok.sha256:
            raise LmforgeError(
                f"{d}: files do not match the recorded sha256 (corrupt or edited tokenizer)"
            )
        return tok
