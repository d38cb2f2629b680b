"""Answer extraction and normalisation for generative evaluation (GSM8K, MATH, MMLU by generation).

Pure string functions, no model: a model's free-text output goes in, a canonical answer comes out,
so that equivalent answers compare equal (``0.5``, ``\\frac12``, ``1/2`` and ``\\dfrac{1}{2}`` are
the same answer; ``10^\\circ``, ``\\$10`` and ``10 \\text{ cm}`` are ``10``).

Simplification: equivalence is string normalisation (after the MATH benchmark's ``strip_string``
rules) plus exact rational/float comparison of plain numbers, fractions and tuples of them; no
symbolic algebra (``\\sqrt{8}`` and ``2\\sqrt{2}`` stay different). Exercised by
``pytest tests/test_eval_answers.py`` and ``lmforge eval --tasks gsm8k,math500``.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Protocol

# A number as people write it in word problems: optional sign, thousands separators, decimals.
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")


def _canonical_number(text: str) -> str:
    """``"1,000.50"`` → ``"1000.5"``; ``"18.00"`` → ``"18"``; ``"-0"`` → ``"0"``."""
    text = text.replace(",", "")
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return text
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10f}".rstrip("0").rstrip(".")


def parse_gsm8k_response(model_output: str) -> str | None:
    """The last number in a model's GSM8K answer, canonicalised; ``None`` when there is none.

    ``"... so she makes $18.00 a day.\\n#### 18"`` → ``"18"``; commas and trailing zeros are
    dropped so ``"1,000"`` and ``"1000.0"`` both give ``"1000"``.
    """
    matches = _NUMBER.findall(model_output)
    if not matches:
        return None
    return _canonical_number(matches[-1])


def gsm8k_reference(answer: str) -> str:
    """The gold number of a GSM8K ``answer`` field (the text after ``####``), canonicalised."""
    _, sep, tail = answer.rpartition("####")
    if not sep:
        raise ValueError("GSM8K answer has no '#### N' line")
    return _canonical_number(tail.strip().replace("$", ""))


class _HasChoices(Protocol):
    choices: list[str]
    labels: list[str]


_LETTER_PATTERNS = (
    r"answer is\s*:?\s*\(?([A-J])\b\)?",
    r"answer\s*:\s*\(?([A-J])\b\)?",
    r"^\s*\(?([A-J])\)?\s*(?:[.):]|$)",
    r"\(([A-J])\)",
    r"\b([A-J])\s*[.)]\s",
    r"^\s*([A-J])\b",
)


def parse_mmlu_response(example: _HasChoices, model_output: str) -> str | None:
    """The choice letter a generated answer picks, or ``None`` when it picks none or is ambiguous.

    Tries, in order: "the answer is (B)", "Answer: B", a leading "B." / "(B)", a lone letter, and
    finally the exact text of exactly one choice. Only letters the example offers count.
    """
    labels = list(example.labels)
    text = model_output.strip()
    for pattern in _LETTER_PATTERNS:
        for m in re.finditer(pattern, text, flags=re.IGNORECASE | re.MULTILINE):
            letter = m.group(1).upper()
            # a lowercase "a" is usually the article; require upper case unless after "answer".
            if m.group(1).islower() and "answer" not in pattern:
                continue
            if letter in labels:
                return letter
    lowered = text.lower()
    hits = [
        label
        for label, choice in zip(labels, example.choices)
        if choice.strip() and choice.strip().lower() in lowered
    ]
    return hits[0] if len(hits) == 1 else None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces kept.

    ``\\boxed 5`` (no braces) gives ``"5"``; an unbalanced box gives ``None``.
    """
    starts = list(re.finditer(r"\\(?:boxed|fbox)\s*", text))
    if not starts:
        return None
    i = starts[-1].end()
    if i < len(text) and text[i] != "{":
        rest = re.match(r"[^\s$]+", text[i:])
        return rest.group(0) if rest else None
    end = _group_end(text, i)
    return text[i + 1 : end - 1] if end else None


def _group_end(s: str, i: int) -> int:
    """The index after the brace group opening at ``s[i]``; 0 when it never closes."""
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] == "{") - (s[j] == "}")
        if depth == 0:
            return j + 1
    return 0


def parse_math_response(model_output: str) -> str | None:
    """The answer of a generated MATH solution: the last boxed expression, else "answer is X"."""
    boxed = extract_boxed(model_output)
    if boxed is not None:
        return boxed
    m = re.findall(r"answer is\s*:?\s*\$?([^\n$]+?)\$?\s*\.?\s*$", model_output, re.MULTILINE)
    return m[-1].strip() if m else None


_UNIT_WORDS = (
    "units|unit|cm|mm|km|m|meters|meter|inches|inch|feet|foot|ft|yards|miles|degrees|degree|"
    "dollars|dollar|cents|cent|hours|hour|minutes|minute|seconds|second|days|day|sq|square|"
    "pounds|pound|mph|cups|cup"
)


def _strip_text_macros(s: str) -> str:
    # "10 \text{ cm}" / "10\text{ inches}": a \text starting with a space after content is a unit.
    s = re.sub(r"(?<=\S)\s*\\(?:text|mbox|textbf|mathrm)\{\s+[^{}]*\}\s*$", "", s)
    # any other \text{X} keeps X: "\text{(A)}" → "(A)".
    prev = None
    while prev != s:
        prev = s
        s = re.sub(r"\\(?:text|mbox|textbf|mathrm|textnormal|operatorname)\{([^{}]*)\}", r"\1", s)
    return s


def _fix_fracs(s: str) -> str:
    # "\frac12" → "\frac{1}{2}", "\frac1{72}" → "\frac{1}{72}", "\frac{1}2" → "\frac{1}{2}".
    out = []
    i = 0
    while i < len(s):
        if not s.startswith("\\frac", i):
            out.append(s[i])
            i += 1
            continue
        out.append("\\frac")
        i += 5
        for _ in range(2):  # a braced argument as it is (to the end if unclosed), else one char
            if i < len(s):
                end = (_group_end(s, i) or len(s)) if s[i] == "{" else i + 1
                out.append(s[i:end] if s[i] == "{" else "{" + s[i] + "}")
                i = end
    return "".join(out)


def normalize_math_answer(answer: str) -> str:
    """A canonical string for a MATH answer so that notational variants compare equal.

    Removes ``$``/``\\$``, ``\\left``/``\\right``, spacing macros, ``^\\circ``, ``\\%``, trailing
    units (``\\text{ cm}``, ``5 inches``) and a short ``x =`` prefix; maps ``\\dfrac``/``\\tfrac``
    to ``\\frac``; completes ``\\frac12`` to ``\\frac{1}{2}`` and ``\\sqrt3`` to ``\\sqrt{3}``; writes
    a plain fraction ``a/b`` or decimal as ``\\frac{a}{b}``; drops all spaces.
    """
    s = str(answer).strip()
    s = s.replace("\n", "").replace("\\!", "")
    s = re.sub(r"\\\\+", r"\\", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\\[,;: ]", " ", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s)
    s = s.replace("\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = _strip_text_macros(s)
    s = s.strip().rstrip(".").strip()
    s = re.sub(rf"^([-+]?[\d.,/]+)\s*(?:(?:{_UNIT_WORDS})\b\s*)+$", r"\1", s)
    # "x = 5" → "5" (a short left side only: "y = 2x + 3" keeps its meaning as an equation)
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if len(lhs.strip()) <= 2:
            s = rhs.strip()
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)  # "\sqrt3" → "\sqrt{3}"
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)  # ".5" → "0.5"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")  # thousands separators, never inside tuples like "1,2"
    value = _as_fraction(s)
    if value is not None:
        s = _fraction_str(value)
    return s


def _fraction_str(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _as_fraction(s: str) -> Fraction | None:
    """Exact value of a plain number, ``a/b`` or ``\\frac{a}{b}`` (numbers only), else None."""
    s = s.strip()
    m = re.fullmatch(r"([-+]?)\\frac\{([-+]?[\d.]+)\}\{([-+]?[\d.]+)\}", s)
    try:
        if m:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
            return -value if m.group(1) == "-" else value
        m = re.fullmatch(r"([-+]?[\d.]+)/([-+]?[\d.]+)", s)
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
        if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def math_answers_equal(prediction: str | None, reference: str, rel_tol: float = 1e-6) -> bool:
    """True when two MATH answers are the same after normalisation.

    Equal canonical strings match; otherwise both sides are compared as exact numbers (rel_tol
    covers decimals rounded by the model), element by element for tuples and intervals with the
    same brackets.
    """
    if prediction is None:
        return False
    a, b = normalize_math_answer(prediction), normalize_math_answer(reference)
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    if fa is not None and fb is not None:
        return math.isclose(float(fa), float(fb), rel_tol=rel_tol, abs_tol=1e-12)
    brackets = "()[]"
    if len(a) > 1 and len(b) > 1 and a[0] == b[0] and a[-1] == b[-1] and a[0] in brackets:
        a, b = a[1:-1], b[1:-1]
    pa, pb = _split_top_level(a), _split_top_level(b)
    if len(pa) > 1 and len(pa) == len(pb):
        return all(math_answers_equal(x, y, rel_tol) for x, y in zip(pa, pb))
    return False
