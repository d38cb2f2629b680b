"""Heuristic quality rules: Gopher (Rae et al. 2021, appendix A) and C4 (Raffel et al. 2020).

Each rule returns a named reason when it rejects, so a pipeline's table shows which rule dropped
how much. Thresholds live in :class:`GopherConfig` / :class:`C4Config`, which double as the
pipeline steps' option tables. Simplification: words are whitespace tokens with surrounding
punctuation stripped (Gopher used a tokenizer), and sentences for the C4 count are split on
terminal punctuation.

Exercised by ``lmforge data run configs/pipelines/web.toml`` and ``tests/test_data_text.py``.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from lmforge.data.core import Document, Filter, Mapper

_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~“”‘’«»…"
_STOP_WORDS = frozenset(("the", "be", "to", "of", "and", "that", "have", "with"))
_BULLETS = ("•", "●", "○", "■", "□", "▪", "▫", "–", "-", "*", "·", "◦", "‣", "⁃")
_PARA_SPLIT = re.compile(r"\n{2,}")


@dataclass(frozen=True)
class GopherConfig:
    """Thresholds of the Gopher quality and repetition rules (defaults from the paper)."""

    min_words: int = 50
    "fewer words than this: drop"
    max_words: int = 100_000
    "more words than this: drop"
    min_mean_word_length: float = 3.0
    "mean word length (characters) below this: drop"
    max_mean_word_length: float = 10.0
    "mean word length above this: drop"
    max_ellipsis_lines_ratio: float = 0.3
    "fraction of lines ending in '...' or '…' above this: drop"
    min_alpha_words_ratio: float = 0.8
    "fraction of words with an alphabetic character below this: drop"
    max_symbol_word_ratio: float = 0.1
    "('#' + ellipses) per word above this: drop"
    max_bullet_lines_ratio: float = 0.9
    "fraction of lines starting with a bullet above this: drop"
    min_stop_words: int = 2
    "fewer distinct English stop words (the, be, to, of, and, that, have, with): drop; 0 disables"
    max_dup_line_fraction: float = 0.3
    "fraction of lines that repeat an earlier line above this: drop"
    max_dup_para_fraction: float = 0.3
    "fraction of paragraphs that repeat an earlier one above this: drop"
    max_dup_line_char_fraction: float = 0.2
    "characters in repeated lines over all characters above this: drop"
    max_dup_para_char_fraction: float = 0.2
    "characters in repeated paragraphs over all characters above this: drop"
    top_ngram_max_fraction: tuple[float, ...] = (0.2, 0.18, 0.16)
    "for n = 2, 3, 4: characters covered by the most frequent n-gram above this: drop"
    dup_ngram_max_fraction: tuple[float, ...] = (0.15, 0.14, 0.13, 0.12, 0.11, 0.10)
    "for n = 5..10: characters covered by repeated n-grams above this: drop"


def _words(text: str) -> list[str]:
    return [w for w in (t.strip(_PUNCT) for t in text.split()) if w]


def _dup_fractions(items: list[str]) -> tuple[float, float]:
    # (fraction of items that repeat an earlier one, their characters over all characters)
    if not items:
        return 0.0, 0.0
    seen: set[str] = set()
    dup = dup_chars = total_chars = 0
    for it in items:
        total_chars += len(it)
        if it in seen:
            dup += 1
            dup_chars += len(it)
        else:
            seen.add(it)
    return dup / len(items), dup_chars / max(total_chars, 1)


def _top_ngram_fraction_reference(words: list[str], n: int, total_chars: int) -> float:
    """Slow reference: characters of the most frequent n-gram times its count, over all."""
    ngrams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    if not ngrams:
        return 0.0
    gram, count = ngrams.most_common(1)[0]
    if count <= 1:
        return 0.0
    return sum(len(w) for w in gram) * count / max(total_chars, 1)


def _dup_ngram_fraction_reference(words: list[str], n: int, total_chars: int) -> float:
    """Slow reference: characters of words covered by any repeated n-gram (each word once)."""
    if len(words) < n:
        return 0.0
    first: dict[tuple[str, ...], int] = {}
    covered = bytearray(len(words))
    for i in range(len(words) - n + 1):
        g = tuple(words[i : i + n])
        j = first.setdefault(g, i)
        if j != i:
            covered[i : i + n] = b"\x01" * n
            covered[j : j + n] = b"\x01" * n
    return sum(len(w) for w, c in zip(words, covered) if c) / max(total_chars, 1)


class _NgramStats:
    """Vectorised n-gram repetition statistics of one document (numpy).

    Words become integer ids; the n-gram at position i is keyed by a polynomial over ids
    (uint64, wrapping). A key collision would need two different n-grams to agree on 64 bits, so
    the results equal the references' (tested on random texts).
    """

    def __init__(self, words: list[str]) -> None:
        import numpy as np

        vocab: dict[str, int] = {}
        self.ids = np.fromiter(
            (vocab.setdefault(w, len(vocab) + 1) for w in words), np.uint64, len(words)
        )
        self.lens = np.fromiter((len(w) for w in words), np.int64, len(words))
        self.total = max(int(self.lens.sum()), 1)
        self.np = np

    def _keys(self, n: int):  # (L,) uint64 keys of the L = len - n + 1 n-grams
        np = self.np
        length = len(self.ids) - n + 1
        key = np.zeros(length, np.uint64)
        with np.errstate(over="ignore"):
            for k in range(n):
                key = key * np.uint64(0x9E3779B97F4A7C15) + self.ids[k : k + length]
        return key

    def top_fraction(self, n: int) -> float:
        np = self.np
        if len(self.ids) < n:
            return 0.0
        _, first, counts = np.unique(self._keys(n), return_index=True, return_counts=True)
        best = int(np.argmax(counts))
        if counts[best] <= 1:
            return 0.0
        # Ties: the reference (Counter.most_common) takes the n-gram seen first.
        tied = np.flatnonzero(counts == counts[best])
        pos = int(first[tied].min())
        return int(self.lens[pos : pos + n].sum()) * int(counts[best]) / self.total

    def dup_fraction(self, n: int) -> float:
        np = self.np
        if len(self.ids) < n:
            return 0.0
        _, first, inverse = np.unique(self._keys(n), return_index=True, return_inverse=True)
        starts = first[inverse]  # first occurrence of each position's n-gram
        dup = np.flatnonzero(starts != np.arange(len(starts)))
        if len(dup) == 0:
            return 0.0
        marks = np.zeros(len(self.ids) + 1, np.int64)
        for s in (dup, starts[dup]):
            np.add.at(marks, s, 1)
            np.add.at(marks, s + n, -1)
        covered = np.cumsum(marks[:-1]) > 0
        return int(self.lens[covered].sum()) / self.total


def gopher_reason(text: str, cfg: GopherConfig = GopherConfig()) -> str | None:
    """The name of the first Gopher rule ``text`` fails, or ``None`` when it passes them all."""
    words = _words(text)
    n = len(words)
    if n < cfg.min_words:
        return "gopher_too_few_words"
    if n > cfg.max_words:
        return "gopher_too_many_words"
    mean_len = sum(len(w) for w in words) / n
    if mean_len < cfg.min_mean_word_length or mean_len > cfg.max_mean_word_length:
        return "gopher_mean_word_length"
    symbols = text.count("#") + text.count("...") + text.count("…")
    if symbols / n > cfg.max_symbol_word_ratio:
        return "gopher_symbol_word_ratio"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if lines:
        if sum(ln.startswith(_BULLETS) for ln in lines) / len(lines) > cfg.max_bullet_lines_ratio:
            return "gopher_bullet_lines"
        ellipsis = sum(ln.endswith(("...", "…")) for ln in lines)
        if ellipsis / len(lines) > cfg.max_ellipsis_lines_ratio:
            return "gopher_ellipsis_lines"
    if sum(any(c.isalpha() for c in w) for w in words) / n < cfg.min_alpha_words_ratio:
        return "gopher_alpha_words"
    if cfg.min_stop_words and len(_STOP_WORDS.intersection(w.lower() for w in words)) < (
        cfg.min_stop_words
    ):
        return "gopher_stop_words"
    line_frac, line_chars = _dup_fractions(lines)
    if line_frac > cfg.max_dup_line_fraction:
        return "gopher_dup_lines"
    if line_chars > cfg.max_dup_line_char_fraction:
        return "gopher_dup_line_chars"
    paras = [p.strip() for p in _PARA_SPLIT.split(text) if p.strip()]
    para_frac, para_chars = _dup_fractions(paras)
    if para_frac > cfg.max_dup_para_fraction:
        return "gopher_dup_paragraphs"
    if para_chars > cfg.max_dup_para_char_fraction:
        return "gopher_dup_paragraph_chars"
    ng = _NgramStats(words)
    for n_, limit in zip((2, 3, 4), cfg.top_ngram_max_fraction):
        if ng.top_fraction(n_) > limit:
            return f"gopher_top_{n_}gram"
    for n_, limit in zip(range(5, 11), cfg.dup_ngram_max_fraction):
        if ng.dup_fraction(n_) > limit:
            return f"gopher_dup_{n_}gram"
    return None


def gopher_quality_filter(text: str, cfg: GopherConfig = GopherConfig()) -> bool:
    """True when ``text`` passes every Gopher quality and repetition rule."""
    return gopher_reason(text, cfg) is None


@dataclass(frozen=True)
class C4Config:
    """Options of the C4 rules: line-level cleaning, then document-level drops."""

    min_words_per_line: int = 3
    "lines with fewer words are removed"
    require_terminal_punctuation: bool = True
    "remove lines not ending in . ! ? or a quote"
    max_word_length: int = 1000
    "remove lines containing a longer word"
    remove_javascript_lines: bool = True
    "remove lines mentioning 'javascript'"
    remove_policy_lines: bool = True
    "remove lines about cookies, terms of use, privacy policy"
    drop_lorem_ipsum: bool = True
    "drop documents containing 'lorem ipsum'"
    drop_curly_bracket: bool = True
    "drop documents containing '{' (code)"
    min_sentences: int = 5
    "drop documents with fewer sentences after cleaning"


_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies")
_TERMINAL = (".", "!", "?", '"', "'", "”", "’")
_SENTENCE_END = re.compile(r"[.!?]+(?:\s|$)")


def c4_clean(text: str, cfg: C4Config = C4Config()) -> tuple[str | None, str]:
    """(cleaned text, "") or (None, reason): C4's line removals followed by its document drops."""
    low = text.lower()
    if cfg.drop_lorem_ipsum and "lorem ipsum" in low:
        return None, "c4_lorem_ipsum"
    if cfg.drop_curly_bracket and "{" in text:
        return None, "c4_curly_bracket"
    kept = []
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        words = s.split()
        if len(words) < cfg.min_words_per_line:
            continue
        if cfg.require_terminal_punctuation and not s.endswith(_TERMINAL):
            continue
        if max(len(w) for w in words) > cfg.max_word_length:
            continue
        ls = s.lower()
        if cfg.remove_javascript_lines and "javascript" in ls:
            continue
        if cfg.remove_policy_lines and any(p in ls for p in _POLICY):
            continue
        kept.append(s)
    cleaned = "\n".join(kept)
    if not cleaned:
        return None, "c4_no_lines"
    if len(_SENTENCE_END.findall(cleaned)) < cfg.min_sentences:
        return None, "c4_too_few_sentences"
    return cleaned, ""


# ----------------------------------------------------------------------------- pipeline step


class GopherFilter(Filter):
    """Gopher quality and repetition rules; each drop names the rule."""

    name = "gopher"

    def __init__(self, opts: GopherConfig | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts or GopherConfig()

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        reason = gopher_reason(doc.text, self.opts)
        return True if reason is None else (False, reason)


class C4Step(Mapper):
    """C4 line cleaning then document rules."""

    name = "c4"

    def __init__(self, opts: C4Config | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts or C4Config()

    def map(self, doc: Document) -> Document | str:
        text, reason = c4_clean(doc.text, self.opts)
        if text is None:
            return reason
        doc.text = text
        return doc
