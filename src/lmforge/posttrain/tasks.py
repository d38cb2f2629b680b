"""Verifiable tasks and rewards: GSM8K and MATH checkers, a format reward, and the CPU-sized
arithmetic task with its character tokenizer.

A reward function maps ``(item, response_text)`` (``item``: the task's record, holding the
reference answer) to a :class:`Reward`. GSM8K and MATH answers are parsed with
``lmforge.eval.answers`` so training rewards and evaluation agree.
Exercised by ``pytest tests/test_posttrain_rl.py -k reward``.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmforge.utils.errors import LmforgeError


@dataclasses.dataclass(frozen=True)
class Reward:
    """A rollout's reward with its components."""

    total: float
    answer: float = 0.0
    format: float = 0.0


_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>(.*?)</answer>\s*$", re.DOTALL)


def format_reward(text: str) -> float:
    """1 when the response is ``<think>…</think> <answer>…</answer>`` (nothing after), else 0."""
    return 1.0 if _FORMAT.match(text) else 0.0


def _answer_span(text: str) -> str:
    """The text inside ``<answer>…</answer>`` when present (the last one), else the whole text."""
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return found[-1] if found else text


def gsm8k_reward(item: dict[str, Any], text: str, format_weight: float = 0.0) -> Reward:
    """1 when the last number of the answer equals ``item["answer"]``'s ``#### N`` value
    (``lmforge.eval.answers`` canonicalisation), plus ``format_weight`` × :func:`format_reward`."""
    from lmforge.eval.answers import gsm8k_reference, parse_gsm8k_response

    ref = item.get("reference")
    if ref is None:
        try:
            ref = gsm8k_reference(str(item["answer"]))
        except (KeyError, ValueError) as e:
            raise LmforgeError(f"GSM8K item has no usable 'answer' ({e})") from None
    pred = parse_gsm8k_response(_answer_span(text))
    ans = 1.0 if pred is not None and pred == ref else 0.0
    fmt = format_reward(text)
    return Reward(ans + format_weight * fmt, ans, fmt)


def math_reward(item: dict[str, Any], text: str, format_weight: float = 0.0) -> Reward:
    """1 when the boxed (or "answer is") answer equals ``item["answer"]`` after MATH
    normalisation, plus ``format_weight`` × :func:`format_reward`."""
    from lmforge.eval.answers import math_answers_equal, parse_math_response

    if "answer" not in item:
        raise LmforgeError("MATH item has no 'answer'")
    span = _answer_span(text)
    pred = parse_math_response(span) or span.strip()
    ans = 1.0 if math_answers_equal(pred, str(item["answer"])) else 0.0
    fmt = format_reward(text)
    return Reward(ans + format_weight * fmt, ans, fmt)


# -- The arithmetic task


class CharTokenizer:
    """A character tokenizer for the arithmetic task: id 0 = padding, 1 = end of sequence, then
    one id per character of ``alphabet``."""

    def __init__(self, alphabet: str = "0123456789+=") -> None:
        self.alphabet = alphabet
        self.pad_id = 0
        self.eos_id = 1
        self._ids = {c: i + 2 for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        """Number of ids (padding and EOS included)."""
        return len(self.alphabet) + 2

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; a character outside the alphabet is a one-line error."""
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise LmforgeError(f"character {e.args[0]!r} is not in the task alphabet") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids (padding and EOS dropped)."""
        return "".join(self.alphabet[i - 2] for i in ids if i >= 2)


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Addition of two ``digits``-digit numbers: prompt ``"07+45="``, answer ``"052"`` (operands
    zero-padded to ``digits``, the sum to ``digits + 1``: the reward is an exact string match).

    The pairs are split once, deterministically, into a held-out set (index a·10^d + b with
    ``(index · 2654435761) mod 2^32 < 2^32 / holdout_every``) and the training pairs, so held-out
    accuracy measures generalisation, not memorisation.

    The weak start: a fraction ``carry_drop`` of :meth:`warmup_answer`'s answers *forget every
    carry* (the school error), so the warm-started model answers greedily with the carry-less
    sum (right on about 0.55^digits of the pairs) but still gives the right answer some
    probability: RL has something to select.
    """

    digits: int = 3
    holdout_every: int = 10
    carry_drop: float = 0.6

    def tokenizer(self) -> CharTokenizer:
        return CharTokenizer()

    @property
    def answer_tokens(self) -> int:
        """Tokens of an answer with its EOS."""
        return self.digits + 2

    def _held_out(self, a: int, b: int) -> bool:
        idx = a * 10**self.digits + b
        return (idx * 2654435761) % 2**32 < 2**32 // self.holdout_every

    def _item(self, a: int, b: int) -> dict[str, Any]:
        d = self.digits
        return {"prompt": f"{a:0{d}d}+{b:0{d}d}=", "answer": f"{a + b:0{d + 1}d}", "a": a, "b": b}

    def sample(self, n: int, rng: random.Random, held_out: bool = False) -> list[dict[str, Any]]:
        """``n`` random items ``{"prompt", "answer", "a", "b"}`` from one split."""
        hi = 10**self.digits
        out: list[dict[str, Any]] = []
        while len(out) < n:
            a, b = rng.randrange(hi), rng.randrange(hi)
            if self._held_out(a, b) == held_out:
                out.append(self._item(a, b))
        return out

    def eval_set(self, n: int = 200, seed: int = 1234) -> list[dict[str, Any]]:
        """A fixed held-out evaluation set."""
        return self.sample(n, random.Random(seed), held_out=True)

    def carryless(self, a: int, b: int) -> str:
        """The sum with every carry forgotten, as an answer string."""
        d = self.digits
        da, db = f"{a:0{d}d}", f"{b:0{d}d}"
        return "0" + "".join(str((int(x) + int(y)) % 10) for x, y in zip(da, db))

    def warmup_answer(self, item: dict[str, Any], rng: random.Random) -> str:
        """The warm-start target: the carry-less sum with probability ``carry_drop``, else the sum."""
        if rng.random() < self.carry_drop:
            return self.carryless(item["a"], item["b"])
        return item["answer"]

    @staticmethod
    def reward(item: dict[str, Any], text: str) -> Reward:
        """1 when the response is exactly the sum; format 1 when it is digits only."""
        fmt = 1.0 if re.fullmatch(r"\d+", text) else 0.0
        ans = 1.0 if text == item["answer"] else 0.0
        return Reward(ans, ans, fmt)


# -- Datasets on disk


def read_jsonl(path: str | Path, where: str = "") -> list[dict[str, Any]]:
    """Records of a JSONL file (``.gz`` too); a missing file or malformed line is one-line error."""
    from lmforge.utils.io import iter_jsonl

    return [rec for _, rec in iter_jsonl(path, f"{where or 'data'} file")]


# -- GSM8K as a chat task: the prompt the policy sees, and the SFT target made from a train answer

GSM8K_INSTRUCTION = " Think step by step, then give the final answer after '####'."
"appended to every GSM8K question (SFT, RL and evaluation use the same prompt)"

_CALCULATOR = re.compile(r"<<[^<>]*>>")


def gsm8k_user_message(question: str) -> str:
    """The user turn of a GSM8K problem: the question and :data:`GSM8K_INSTRUCTION`."""
    return question + GSM8K_INSTRUCTION


def gsm8k_sft_response(answer: str) -> str:
    """A GSM8K train ``answer`` as an assistant reply: the worked solution without the dataset's
    ``<<48/2=24>>`` calculator annotations, ending in ``#### N`` (what the checker reads)."""
    body, sep, tail = answer.rpartition("####")
    if not sep or not tail.strip():
        raise LmforgeError("GSM8K answer has no '#### N' line")
    lines = [ln.rstrip() for ln in _CALCULATOR.sub("", body).strip().splitlines()]
    steps = "\n".join(ln for ln in lines if ln)
    return (steps + "\n" if steps else "") + f"#### {tail.strip()}"
