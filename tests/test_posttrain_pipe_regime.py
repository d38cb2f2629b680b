"""The Pipeline RL benchmark's task: worked column-by-column answers (the pipeline's own run is
in test_posttrain_pipeline.py)."""

from __future__ import annotations

import random

from lmforge.posttrain.scratchpad import ScratchpadAdditionTask
from lmforge.posttrain.tasks import ArithmeticTask


def test_scratchpad_worked_answers_add_up() -> None:
    task = ScratchpadAdditionTask(digits=3)
    plain = ArithmeticTask(digits=3)
    rng = random.Random(0)
    for it in task.sample(200, rng):
        a, b, text = it["a"], it["b"], it["answer"]
        assert len(text) + 1 == task.answer_tokens == 30
        cols = [text[i * 8 : (i + 1) * 8] for i in range(3)]
        carry = 0
        for i, col in enumerate(cols):  # least significant column first
            x, y = (a // 10**i) % 10, (b // 10**i) % 10
            assert col == f"{x}+{y}+{carry}={x + y + carry:02d}"
            carry = (x + y + carry) // 10
        assert text[24:] == f"={a + b:04d}" and it["sum"] == f"{a + b:04d}"
        assert task.reward(it, text).answer == 1.0 and task.reward(it, text).format == 1.0
        wrong = task.worked(a, b, carries=False)
        assert wrong.rsplit("=", 1)[1] == plain.carryless(a, b)  # the parent's school error
        assert "+1=" not in wrong
        assert task.reward(it, wrong).answer == float(plain.carryless(a, b) == it["sum"])
    it = task._item(457, 168)
    assert it["answer"] == "7+8+0=155+6+1=124+1+1=06=0625"
    # the final answer is graded, the working is not; the layout is the format component
    assert task.reward(it, "=0625").answer == 1.0 and task.reward(it, "=0625").format == 0.0
    assert task.reward(it, "7+8+0=155+6+1=124+1+1=06=0626").answer == 0.0
    assert task.reward(it, "0625").answer == 0.0
    held = {(i["a"], i["b"]) for i in task.eval_set(100)}
    assert held == {(i["a"], i["b"]) for i in plain.eval_set(100)}  # same held-out split
