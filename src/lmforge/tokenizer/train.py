"""Byte-level BPE training (GPT-2 style) with incremental pair counts.

Token ids: 0..255 are the single bytes (id = byte value), then one id per merge in merge order,
then the special tokens. Merged-token ids therefore equal their merge rank plus 256, which is
exactly tiktoken's ``mergeable_ranks`` layout, so a trained tokenizer exports to tiktoken without
any id remapping.

The merge loop never recounts: each distinct pre-token ("word") is a str with one character per
token id (so finding and replacing a pair are C-level ``str.find``/``str.replace`` calls) and a
count; ``pair_counts`` holds every adjacent pair's total, ``pair_words`` the words where a pair may
occur, and a max-heap (lazy: entries may hold stale, higher counts and are refreshed when popped)
finds the most frequent pair. Merging (a, b) touches only the words in ``pair_words[(a, b)]``.
Counts of existing pairs only ever fall during a merge (only pairs with the new token appear), so
a stale heap entry always over-estimates and the refresh-on-pop rule returns the true maximum.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from pathlib import Path

from lmforge.tokenizer._pretokenize import count_pretokens, default_workers
from lmforge.utils.errors import LmforgeError

_COMPLEMENT = bytes(range(255, -1, -1))  # byte x → 255 - x


def _desc_key(token: bytes) -> str:
    # Ascending order of this key is descending lexicographic order of the bytes: complemented
    # bytes, and a terminator above every byte so a proper prefix sorts after its extensions.
    # A str (one character per byte) is built and compared in C, unlike a tuple of ints.
    return token.translate(_COMPLEMENT).decode("latin-1") + "\u0100"


def check_special_tokens(special_tokens: Sequence[str] | None) -> list[str]:
    """De-duplicated special tokens in order; an empty string is an error."""
    out: list[str] = []
    for s in special_tokens or ():
        if not isinstance(s, str) or not s:
            raise LmforgeError(f"special tokens must be non-empty strings, got {s!r}")
        if s not in out:
            out.append(s)
    return out


def _as_paths(input_path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(input_path, (str, os.PathLike)):
        items = [input_path]
    else:
        items = list(input_path)
    if not items:
        raise LmforgeError("train_bpe: no input files given")
    paths = [Path(p) for p in items]
    for p in paths:
        if not p.is_file():
            raise LmforgeError(f"input not found: {p}")
    return paths


def merge_words(
    word_counts: dict[bytes, int],
    num_merges: int,
    progress: bool = False,
) -> list[tuple[bytes, bytes]]:
    """Run ``num_merges`` BPE merges over distinct words (bytes → count); returns the merges.

    Ties between equally frequent pairs go to the lexicographically greater pair of bytes.
    Stops early when no pair occurs any more.
    """
    # A word is a str with one character per token (chr(id)), so finding and replacing a pair
    # are single C-level str.find / str.replace calls; a pair is the 2-character string "ab".
    tokens: list[bytes] = [bytes([i]) for i in range(256)]
    keys: list[str] = [_desc_key(t) for t in tokens]
    words: list[str] = []
    counts: list[int] = []
    for w, c in word_counts.items():
        if len(w) > 1:  # a single byte never takes part in a merge
            words.append(w.decode("latin-1"))  # byte x → chr(x)
            counts.append(c)

    pair_counts: dict[str, int] = {}
    pair_words: dict[str, set[int]] = {}
    for wi, w in enumerate(words):
        c = counts[wi]
        for k in range(len(w) - 1):
            p = w[k : k + 2]
            pair_counts[p] = pair_counts.get(p, 0) + c
            s = pair_words.get(p)
            if s is None:
                pair_words[p] = {wi}
            else:
                s.add(wi)
    # Heap entries: (-count, key(a), key(b), pair): the smallest entry is the most frequent pair,
    # ties broken towards the lexicographically greatest (bytes(a), bytes(b)).
    heap = [(-c, keys[ord(p[0])], keys[ord(p[1])], p) for p, c in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[bytes, bytes]] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_merges, unit="merge", desc="merges", leave=False)
    push, pop = heapq.heappush, heapq.heappop
    while len(merges) < num_merges and heap:
        neg, ka, kb, ab = pop(heap)
        current = pair_counts.get(ab, 0)
        if current != -neg:
            if current > 0:
                push(heap, (-current, ka, kb, ab))
            continue
        new_id = len(tokens)
        new = chr(new_id)
        a, b = ab
        ta, tb = tokens[ord(a)], tokens[ord(b)]
        tokens.append(ta + tb)
        keys.append(_desc_key(ta + tb))
        merges.append((ta, tb))
        del pair_counts[ab]
        fresh: list[str] = []  # pairs with the new token, each listed once
        for wi in pair_words.pop(ab):
            w = words[wi]
            j = w.find(ab)
            if j < 0:
                continue  # index entries are never removed: this word lost the pair earlier
            c = counts[wi]
            n = len(w)
            end = -1  # end of the previous occurrence
            # Only the pairs around each occurrence change: (L, a) → (L, new) on the left and
            # (b, R) → (new, R) on the right. When two occurrences touch ("abab"), the left
            # neighbour of the second is the new token, taking back the (new, a) the first added.
            while j >= 0:
                if j > 0:
                    left = new if j == end else w[j - 1]
                    p = left + a
                    if p != ab:
                        pair_counts[p] -= c
                    p = left + new
                    pair_counts[p] = pair_counts.get(p, 0) + c
                    s = pair_words.get(p)
                    if s is None:  # pairs with the new token first appear in this merge
                        pair_words[p] = {wi}
                        fresh.append(p)
                    else:
                        s.add(wi)
                end = j + 2
                if end < n:
                    p = b + w[end]
                    if p != ab:
                        pair_counts[p] -= c
                    p = new + w[end]
                    pair_counts[p] = pair_counts.get(p, 0) + c
                    s = pair_words.get(p)
                    if s is None:  # pairs with the new token first appear in this merge
                        pair_words[p] = {wi}
                        fresh.append(p)
                    else:
                        s.add(wi)
                j = w.find(ab, end)
            words[wi] = w.replace(ab, new)
        for p in fresh:
            c = pair_counts[p]
            if c > 0:
                push(heap, (-c, keys[ord(p[0])], keys[ord(p[1])], p))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return merges


def train_bpe(
    input_path: str | os.PathLike | Sequence[str | os.PathLike],
    vocab_size: int,
    special_tokens: Sequence[str] | None = None,
    *,
    workers: int | None = None,
    progress: bool = False,
    chunk_bytes: int | None = None,
    stats: dict[str, int] | None = None,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE tokenizer on one file or a list of files.

    Returns ``(vocab, merges)``: ``vocab`` maps ids to bytes (256 single bytes, one token per merge,
    then the special tokens; ``vocab_size`` in total unless the corpus runs out of pairs first),
    ``merges`` lists the merged pairs in order. Text is split on special tokens first (they never
    take part in a merge), then pre-tokenized with :data:`GPT2_PATTERN`; merges never cross a
    pre-token. Files are pre-tokenized in ``workers`` processes (default: all usable CPUs), in
    streamed chunks that end on a special token.

    Simplification: text is decoded as UTF-8 with invalid bytes replaced (U+FFFD), as every reader
    in lmforge does; ``stats["invalid_utf8_bytes"]`` (when given) counts them. Exercised by ``lmforge tokenizer train --input F --vocab-size N --out DIR``.
    """
    specials = check_special_tokens(special_tokens)
    if isinstance(vocab_size, bool) or not hasattr(vocab_size, "__index__"):
        raise LmforgeError(f"vocab_size must be an integer, got {vocab_size!r}")
    vocab_size = int(vocab_size)
    if vocab_size > 0x10FFFF:  # a token id is stored as one character in the merge loop
        raise LmforgeError(f"vocab_size {vocab_size} is too large (at most {0x10FFFF})")
    if vocab_size < 256 + len(specials):
        raise LmforgeError(
            f"vocab_size {vocab_size} is too small: it must be at least 256 bytes + "
            f"{len(specials)} special tokens = {256 + len(specials)}"
        )
    paths = _as_paths(input_path)
    if sum(p.stat().st_size for p in paths) == 0:
        names = paths[0] if len(paths) == 1 else f"{len(paths)} input files"
        raise LmforgeError(f"empty corpus: {names} holds no text")
    nworkers = default_workers() if workers is None else max(1, workers)
    pretokens = count_pretokens(paths, specials, nworkers, chunk_bytes, progress, stats)
    if not pretokens:
        raise LmforgeError(f"empty corpus: {paths[0]} holds nothing but special tokens")
    word_counts: dict[bytes, int] = {}
    for s, c in pretokens.items():
        b = s.encode("utf-8")
        word_counts[b] = word_counts.get(b, 0) + c
    del pretokens
    merges = merge_words(word_counts, vocab_size - 256 - len(specials), progress)
    vocab: dict[int, bytes] = {i: bytes([i]) for i in range(256)}
    for a, b in merges:
        vocab[len(vocab)] = a + b
    for s in specials:
        vocab[len(vocab)] = s.encode("utf-8")
    return vocab, merges
