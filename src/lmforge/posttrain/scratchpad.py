"""Addition with a worked (scratchpad) answer: the arithmetic task with long responses.

Prompt ``"457+168="``; the response works the columns from the least significant one,
``x+y+c=ts`` each (digits, carry in, two-digit column total), then ``=`` and the padded sum::

    7+8+0=155+6+1=124+1+1=06=0625

Why: Pipeline RL's regime has responses much longer than prompts (reasoning chains), so
generation is a large share of an iteration; here a 3-digit response is 30 tokens against an
8-token prompt. Measured on the CPU (1 thread, 32 × 8 rollouts a step): generation is 34% of a
synchronous GRPO iteration, against 29% with the 5-token answers (training cost grows with the
sequence about as fast as decoding does).

Reward: 1 when the text after the last ``=`` is the sum (the working is not graded), format 1
for the worked layout. The weak start is the parent's: the warm-start mixture forgets every
carry a fraction ``carry_drop`` of the time.
Exercised by ``pytest tests/test_posttrain_pipe_regime.py``.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

from lmforge.posttrain.tasks import ArithmeticTask, Reward


@dataclasses.dataclass(frozen=True)
class ScratchpadAdditionTask(ArithmeticTask):
    """``digits``-digit addition answered column by column (see the module docstring)."""

    @property
    def answer_tokens(self) -> int:
        """Tokens of a worked response with its EOS: 8 per column, ``=``, the sum, EOS."""
        return 8 * self.digits + 1 + (self.digits + 1) + 1

    def worked(self, a: int, b: int, carries: bool = True) -> str:
        """The worked response; ``carries=False`` forgets every carry (the school error)."""
        d = self.digits
        da, db = f"{a:0{d}d}"[::-1], f"{b:0{d}d}"[::-1]  # least significant first
        cols, units, c = [], [], 0
        for x, y in zip(da, db):
            t = int(x) + int(y) + c
            cols.append(f"{x}+{y}+{c}={t:02d}")
            units.append(str(t % 10))
            c = t // 10 if carries else 0
        total = str(c) + "".join(reversed(units))
        return "".join(cols) + "=" + total

    def _item(self, a: int, b: int) -> dict[str, Any]:
        item = super()._item(a, b)
        item["sum"] = item["answer"]
        item["answer"] = self.worked(a, b)
        return item

    def warmup_answer(self, item: dict[str, Any], rng: random.Random) -> str:
        """The warm-start target: the carry-forgetting working with probability ``carry_drop``."""
        if rng.random() < self.carry_drop:
            return self.worked(item["a"], item["b"], carries=False)
        return item["answer"]

    @staticmethod
    def reward(item: dict[str, Any], text: str) -> Reward:
        """1 when the text after the last ``=`` is the sum; format 1 for the worked layout."""
        final = text.rsplit("=", 1)[-1] if "=" in text else ""
        ans = 1.0 if final == item["sum"] else 0.0
        d = len(item["sum"]) - 1
        fmt = 1.0 if re.fullmatch(rf"(\d\+\d\+[01]=\d\d){{{d}}}=\d{{{d + 1}}}", text) else 0.0
        return Reward(ans, ans, fmt)
