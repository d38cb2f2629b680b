"""Post-training objectives in the one Trainer: learning, the weighted accumulation, and exact
resume after ``kill -9`` (SFT, DPO, GRPO and PPO with their rollouts on the serving engine,
distillation); Pipeline RL's resume (learner state, versions and prompt stream exact; rollouts
not: see :class:`~lmforge.posttrain.pipeline.PipelineObjective`).

Also a script: ``python tests/test_posttrain_resume.py KIND OUT_DIR STEPS [KILL_AT]`` trains
KIND (sft, dpo, grpo, ppo, distill, pipeline) on a tiny model, SIGKILLing itself after step
KILL_AT when given.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lmforge.config import RunConfig
from lmforge.posttrain.config import DistillConfig, DPOConfig, SFTConfig
from lmforge.posttrain.core import Example, collate, encode_text, prompt_response_example
from lmforge.posttrain.distill import DistillObjective
from lmforge.posttrain.dpo import DPOObjective, hidden_size
from lmforge.posttrain.models import clone_frozen
from lmforge.posttrain.ppo import PolicyWithValue, PPOConfig, PPOObjective
from lmforge.posttrain.rl import GRPOObjective, arithmetic_model
from lmforge.posttrain.rollout import rollout_engine
from lmforge.posttrain.sft import SFTObjective
from lmforge.posttrain.tasks import ArithmeticTask
from lmforge.train import TrainConfig, Trainer
from lmforge.train.metrics import read_metrics
from lmforge.train.objective import forward_backward

REPO = Path(__file__).resolve().parents[1]


def _cfg(out: Path, steps: int, **train: Any) -> RunConfig:
    base = dict(out_dir=str(out), device="cpu", precision="fp32", batch_size=4, grad_accum=2,
                max_steps=steps, lr=3e-3, min_lr=0.0, schedule="constant", warmup_steps=0,
                weight_decay=0.0, eval_every=0, save_every=1, log_every=1, plot=False,
                progress=False)  # fmt: skip
    base.update(train)
    return RunConfig(train=TrainConfig(**base))


def _examples(task: ArithmeticTask, n: int, seed: int = 0) -> list[Example]:
    tok = task.tokenizer()
    items = task.sample(n, random.Random(seed))
    return [prompt_response_example(encode_text(tok, it["prompt"]),
                                    encode_text(tok, it["answer"]), tok.eos_id)
            for it in items]  # fmt: skip


def build(kind: str, out: Path, steps: int, callbacks: tuple = ()) -> Trainer:
    """A Trainer for ``kind`` on a tiny arithmetic model (same weights and data every call)."""
    task = ArithmeticTask(digits=2)
    tok = task.tokenizer()
    model = arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1)
    if kind == "sft":
        obj: Any = SFTObjective(_examples(task, 40), SFTConfig(max_len=32, packing=True), 4, "cpu")
        return Trainer(_cfg(out, steps), model=model, objective=obj, callbacks=callbacks)
    if kind == "dpo":
        pairs = []
        for it in task.sample(24, random.Random(1)):
            p = encode_text(tok, it["prompt"])
            good = [*encode_text(tok, it["answer"]), tok.eos_id]
            bad = [*encode_text(tok, str(int(it["answer"]) + 1)), tok.eos_id]
            pairs.append((p, good, bad))
        obj = DPOObjective(model, pairs[:20], pairs[20:], DPOConfig(beta=0.5), 4)
        return Trainer(_cfg(out, steps, grad_accum=1), model=model, objective=obj,
                       callbacks=callbacks)  # fmt: skip
    if kind == "distill":
        teacher = clone_frozen(arithmetic_model(tok.vocab_size, seed=1, d_model=32, n_layers=1))
        obj = DistillObjective(teacher, DistillConfig(max_len=32), 4, corpus=_examples(task, 40),
                               seed=2)  # fmt: skip
        return Trainer(_cfg(out, steps), model=model, objective=obj, callbacks=callbacks)
    engine = rollout_engine(model, [tok.eos_id], seed=0)

    def draw(n: int, rng: random.Random) -> list[dict[str, Any]]:
        return task.sample(n, rng)

    if kind == "ppo":
        pv = PolicyWithValue(model, hidden_size(model))
        pcfg = PPOConfig(max_tokens=task.answer_tokens, samples_per_prompt=4, epochs=2)
        obj = PPOObjective(pv, engine, tok, draw, task.reward, pcfg, prompts_per_step=4,
                           eos_ids=[tok.eos_id], eval_items=task.eval_set(8), seed=3)  # fmt: skip
        return Trainer(_cfg(out, steps, lr=1e-3, grad_accum=1), model=pv, objective=obj,
                       callbacks=callbacks)  # fmt: skip
    assert kind == "grpo"
    obj = GRPOObjective(engine, tok, draw, task.reward, "grpo", prompts_per_step=4,
                        group_size=4, epochs=2, micro_batch=6, max_tokens=task.answer_tokens,
                        eos_ids=[tok.eos_id], eval_items=task.eval_set(8), seed=3)  # fmt: skip
    return Trainer(_cfg(out, steps, lr=1e-3), model=model, objective=obj, callbacks=callbacks)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _killer(at: int) -> Any:
    def cb(trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
        if step == at:
            os.kill(os.getpid(), signal.SIGKILL)

    return cb


# ---------------------------------------------------------------------------------------------


def test_sft_objective_learns_in_the_trainer(tmp_path: Path) -> None:
    trainer = build("sft", tmp_path / "run", 30)
    trainer.run()
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
              if r.get("event") == "train"]  # fmt: skip
    first = next(
        r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["event"] == "train"
    )
    assert len(losses) == 30 and first["tokens"] > 0
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


def test_weighted_accumulation_equals_the_whole_batch(tmp_path: Path) -> None:
    # Σ loss_sum / Σ weight over micro-batches of different token counts = the token mean of
    # the whole batch at once (a mean of micro-batch means would not be).
    trainer = build("sft", tmp_path / "run", 1)
    exs = _examples(ArithmeticTask(digits=2), 6)
    obj = trainer.objective
    obj.cfg = SFTConfig(max_len=32, packing=False)
    whole = (collate(exs), None)
    parts = [(collate(exs[:1]), None), (collate(exs[1:]), None)]
    model = trainer.model
    for p in model.parameters():
        p.grad = None
    loss_whole, w = forward_backward(trainer.strategy, [whole], obj)
    g_whole = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    loss_parts, w2 = forward_backward(trainer.strategy, parts, obj)
    assert w == w2
    torch.testing.assert_close(loss_parts, loss_whole, rtol=1e-6, atol=1e-6)
    for a, p in zip(g_whole, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-7)
    # without batch_weight the graphs are kept until the total is known: the same gradients
    for p in model.parameters():
        p.grad = None

    class NoWeight:
        def loss(self, m: Any, b: Any) -> Any:
            return obj.loss(m, b)

    forward_backward(trainer.strategy, parts, NoWeight())
    for a, p in zip(g_whole, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-7)


def test_grpo_at_lr_zero_every_importance_ratio_is_one(tmp_path: Path) -> None:
    # The serve engine's recorded log-probs are the trainer's own (same temperature, full
    # vocabulary): before any update, new / old = 1 on every completion token.
    trainer = build("grpo", tmp_path / "run", 1)
    obj = trainer.objective
    obj.temperature = 0.7
    obj.before_step(trainer, 1)
    from lmforge.posttrain.core import sequence_logprobs

    s = obj.samples
    with torch.no_grad():
        logp, _ = sequence_logprobs(trainer.model, s.batch.input_ids, s.batch.labels, 0.7)
    mask = s.batch.mask
    assert int(mask.sum()) > 20
    ratio = torch.exp(logp - s.old_logp)[mask]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)
    assert (s.versions[mask] == 0).all()


@pytest.mark.parametrize(
    "kind,steps,kill_at",
    [("sft", 5, 3), ("dpo", 4, 2), ("grpo", 5, 3), ("ppo", 5, 3), ("distill", 4, 2)],
)
def test_kill_9_resumes_bit_exactly(tmp_path: Path, kind: str, steps: int, kill_at: int) -> None:
    straight = build(kind, tmp_path / "straight", steps)
    straight.run()
    want = _weights(straight)
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, str(Path(__file__)), kind, str(out), str(steps)]
    first = subprocess.run([*cmd, str(kill_at)], env=env, capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert (out / "checkpoints").is_dir()
    second = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stderr
    resumed = build(kind, out, steps)  # loads the final checkpoint
    assert resumed.iteration == steps
    got = _weights(resumed)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    a = [r for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if r["event"] == "train"]
    b = [r for r in read_metrics(out / "metrics.jsonl") if r["event"] == "train"]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def run_pipeline_rl(out: Path, steps: int, kill_at: int | None = None) -> None:
    """Pipeline RL (engine process + trainer) on the 1-digit task into ``out``, checkpointing
    every step; SIGKILLs the trainer after step ``kill_at`` (the engine is left to notice),
    writing the pids of its child processes to ``out/children`` first."""
    from lmforge.posttrain.pipeline import PipelineConfig, run_pipeline

    task = ArithmeticTask(digits=1)
    model = arithmetic_model(task.tokenizer().vocab_size, seed=0, d_model=32, n_layers=1)
    cfg = PipelineConfig(iterations=steps, prompts_per_step=4, group_size=4, digits=1,
                         max_tokens=task.answer_tokens, eval_every=100, eval_size=4, lr=1e-2)  # fmt: skip

    def on_step(rec: dict[str, Any], m: Any) -> None:
        if rec["step"] == kill_at:
            me = os.getpid()
            kids = Path(f"/proc/{me}/task/{me}/children").read_text().split()
            (out / "children").write_text(" ".join(kids))
            os.kill(me, signal.SIGKILL)

    run_cfg = _cfg(out, steps, lr=1e-2, beta2=0.99, grad_accum=1, batch_size=256)
    run_pipeline(model, cfg, progress=False, on_step=on_step, run_config=run_cfg)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def test_pipeline_rl_resumes_after_kill_9(tmp_path: Path) -> None:
    """What a Pipeline RL resume promises: the learner's checkpoint, the batch and version
    numbering and the prompt stream continue exactly as in an uninterrupted run; the engine
    restarts from the checkpoint's weights (its first batch is all lag 0, ratio 1 against the
    trainer). The rollouts are not compared: where weight swaps land is timing."""
    steps, kill_at = 6, 4
    run_pipeline_rl(tmp_path / "straight", steps)
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, str(Path(__file__)), "pipeline", str(out), str(steps)]
    first = subprocess.run([*cmd, str(kill_at)], env=env, capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    # the orphaned engine process (and multiprocessing's helper) exit by themselves
    kids = [int(p) for p in (out / "children").read_text().split()]
    assert kids
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in kids)
    assert (out / "checkpoints" / f"step_{kill_at - 1:07d}").is_dir()
    second = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stderr
    a = [r for r in read_metrics(tmp_path / "straight" / "metrics.jsonl") if r["event"] == "train"]
    b = [r for r in read_metrics(out / "metrics.jsonl") if r["event"] == "train"]
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for key in ("iteration", "version", "samples", "prompt_digest"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert len({r["prompt_digest"] for r in b}) == steps  # the stream moved on every batch
    back = b[kill_at - 1]  # the resumed engine's first batch: the checkpoint's weights, lag 0
    assert back["max_lag"] == 0 and back["weight_check_version"] == kill_at - 1
    assert back["weight_check"] < 1e-12
    assert back["sync_check_tokens"] > 0 and back["sync_check"] < 1e-4


if __name__ == "__main__":
    torch.set_num_threads(1)  # as conftest.py runs the uninterrupted run: same reductions
    kind, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    if kind == "pipeline":
        run_pipeline_rl(out, steps, at)
    else:
        build(kind, out, steps, (_killer(at),) if at is not None else ()).run()
