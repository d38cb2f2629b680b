"""The Pipeline RL benchmark's pieces: the scratchpad task, the synchronous loop's step hook and
the train step's time breakdown (the pipeline's own run is in test_posttrain_pipeline.py)."""

from __future__ import annotations

import random

from lmforge.posttrain import rl
from lmforge.posttrain.rollout import LocalEngine
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


def test_sync_loop_step_hook_and_time_breakdown() -> None:
    task = ScratchpadAdditionTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1)
    eng = LocalEngine(model, eos_ids=[tok.eos_id])
    seen = []

    def on_step(rec: dict, m: object) -> None:
        assert m is model
        seen.append(rec["iteration"])

    cfg = rl.StepConfig(rl.algorithm("grpo"), max_tokens=task.answer_tokens, micro_batch=8)
    hist = rl.run_iterations(model, eng, tok, rl.random_sampler(task, 1), task.reward, cfg,
                             iterations=3, prompts_per_step=4, group_size=4, lr=1e-3,
                             eval_fn=lambda: 0.5, eval_every=2, on_step=on_step)  # fmt: skip
    assert seen == [1, 2, 3]
    assert [("eval_accuracy" in h) for h in hist] == [False, True, True]
    assert all(h["eval_s"] >= 0 for h in hist if "eval_accuracy" in h)
    for h in hist:
        for k in ("gen_s", "score_s", "fwd_s", "bwd_s", "opt_s"):
            assert h[k] >= 0.0, k
    assert [h["samples"] for h in hist] == [16, 32, 48]
