"""Slow, obviously-correct references for the fast paths (used only by tests).

``reference_train`` recounts every pair after every merge; ``reference_encode`` applies merges by
rank to each pre-token with no cache and no id-space tricks. The fast code must agree exactly.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import regex

from lmforge.tokenizer._pretokenize import GPT2_PATTERN, special_split_regex


def reference_train(
    text: str, vocab_size: int, special_tokens: Sequence[str] = ()
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """BPE training by full recount per merge; same id layout and tie rule as ``train_bpe``."""
    special_re = special_split_regex(list(special_tokens))
    parts = [text] if special_re is None else special_re.split(text)
    words: Counter[tuple[bytes, ...]] = Counter()
    for part in parts:
        for tok in regex.findall(GPT2_PATTERN, part):
            b = tok.encode("utf-8")
            words[tuple(bytes([x]) for x in b)] += 1
    merges: list[tuple[bytes, bytes]] = []
    specials = list(dict.fromkeys(special_tokens))
    while 256 + len(merges) + len(specials) < vocab_size:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for w, c in words.items():
            for p in itertools.pairwise(w):
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        merged: Counter[tuple[bytes, ...]] = Counter()
        for w, c in words.items():
            out: list[bytes] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    vocab = {i: bytes([i]) for i in range(256)}
    for a, b in merges:
        vocab[len(vocab)] = a + b
    for s in specials:
        vocab[len(vocab)] = s.encode("utf-8")
    return vocab, merges


def reference_encode(
    text: str,
    vocab: dict[int, bytes],
    merges: Sequence[tuple[bytes, bytes]],
    special_tokens: Sequence[str] = (),
) -> list[int]:
    """Encode by repeatedly merging the lowest-rank adjacent pair of each pre-token (GPT-2's
    ``bpe()``), specials matched longest-first."""
    rank = {m: i for i, m in enumerate(merges)}
    specials = set(special_tokens)
    ids_of = {b: i for i, b in vocab.items() if b.decode("utf-8", "replace") not in specials}
    special_ids = {
        b.decode("utf-8"): i for i, b in vocab.items() if b.decode("utf-8", "replace") in specials
    }
    special_re = special_split_regex(list(special_tokens))
    pieces = [text] if special_re is None else regex.split(f"({special_re.pattern})", text)
    out: list[int] = []
    for piece in pieces:
        if piece in specials:
            out.append(special_ids[piece])
            continue
        for tok in regex.findall(GPT2_PATTERN, piece):
            parts = [bytes([x]) for x in tok.encode("utf-8")]
            while len(parts) > 1:
                cands = [(rank.get(p, len(rank)), p) for p in itertools.pairwise(parts)]
                r, best = min(cands)
                if r == len(rank):
                    break
                merged: list[bytes] = []
                i = 0
                while i < len(parts):
                    if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                        merged.append(parts[i] + parts[i + 1])
                        i += 2
                    else:
                        merged.append(parts[i])
                        i += 1
                parts = merged
            out.extend(ids_of[p] for p in parts)
    return out
