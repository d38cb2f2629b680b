"""RL with verifiable rewards on the one Trainer and the serving engine: rollouts (versions set
between engine steps), rewards, the ratio-equals-one test per algorithm, weighted accumulation,
and CPU end-to-end runs of GRPO and PPO."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from lmforge.config import RunConfig
from lmforge.model import ModelConfig, TransformerLM
from lmforge.posttrain import rl
from lmforge.posttrain.core import IGNORE, sequence_logprobs
from lmforge.posttrain.rollout import rollout_engine
from lmforge.posttrain.tasks import (
    ArithmeticTask,
    Reward,
    format_reward,
    gsm8k_reward,
    math_reward,
)
from lmforge.serve import SamplingParams
from lmforge.train import TrainConfig, Trainer
from lmforge.train.metrics import read_metrics
from lmforge.train.objective import forward_backward


def tiny_lm(vocab: int = 30, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(vocab_size=vocab, context_length=48, d_model=32, n_layers=2,
                                     n_heads=4, n_kv_heads=2))  # fmt: skip


def _train_cfg(tmp: Path, steps: int, lr: float, **kw: Any) -> RunConfig:
    base = dict(out_dir=str(tmp), device="cpu", precision="fp32", lr=lr, min_lr=0.0, beta2=0.99,
                weight_decay=0.0, schedule="constant", warmup_steps=0, max_steps=steps,
                batch_size=256, eval_every=0, save_every=0, log_every=1, plot=False,
                progress=False)  # fmt: skip
    base.update(kw)
    return RunConfig(train=TrainConfig(**base))


def _first_digit(item: dict, text: str) -> Reward:
    hit = float(text[:1] == item["prompt"][0])
    return Reward(hit, hit, 0.0)


def _draw(task: ArithmeticTask) -> Any:
    return lambda n, rng: task.sample(n, rng)


def test_engine_records_the_version_set_between_steps() -> None:
    # Pipeline RL's in-flight update: weights copied in place and the version moved between two
    # engine steps; the running sequence keeps its KV cache and later tokens carry the new one.
    model = tiny_lm().eval()
    other = tiny_lm(seed=1)
    eng = rollout_engine(model)
    rid = eng.add_request([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=6))
    done = None
    steps = 0
    while eng.has_unfinished():
        if steps == 3:
            with torch.no_grad():
                for p, q in zip(model.parameters(), other.parameters()):
                    p.copy_(q)
            eng.update_weights({}, 7)
        for out in eng.step():
            if out.request_id == rid and out.finished:
                done = out
        steps += 1
    assert done is not None
    versions = done.outputs[0].policy_versions
    assert versions[0] == 0 and versions[-1] == 7 and sorted(versions) == versions


def test_rewards_reuse_eval_parsing() -> None:
    assert gsm8k_reward({"answer": "so #### 1,000"}, "it is 1000.0").total == 1.0
    assert gsm8k_reward({"answer": "#### 7"}, "<think>x</think> <answer>8</answer>").answer == 0.0
    r = gsm8k_reward(
        {"answer": "#### 7"}, "<think>3+4</think> <answer>7</answer>", format_weight=0.1
    )
    assert (r.answer, r.format) == (1.0, 1.0) and r.total == pytest.approx(1.1)
    assert math_reward({"answer": "\\frac{1}{2}"}, "so \\boxed{0.5}").answer == 1.0
    assert format_reward("<answer>1</answer>") == 0.0
    task = ArithmeticTask(digits=2)
    item = task.sample(1, random.Random(0))[0]
    assert task.reward(item, item["answer"]).total == 1.0
    assert task.carryless(58, 67) == "015"
    held = {it["prompt"] for it in task.eval_set(50)}
    train = {it["prompt"] for it in task.sample(500, random.Random(1))}
    assert not held & train


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo", "rloo"])
def test_ratio_is_one_before_any_update(name: str) -> None:
    """The engine's sampled-token log-probs equal the trainer's: with the weights unchanged (lr
    0) every ratio is 1, so nothing is clipped, for every reweighting."""
    task = ArithmeticTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1)
    eng = rollout_engine(model, [tok.eos_id])
    obj = rl.GRPOObjective(eng, tok, _draw(task), _first_digit, name, prompts_per_step=4,
                           group_size=4, epochs=1, micro_batch=5, max_tokens=4,
                           temperature=0.8, eos_ids=[tok.eos_id], seed=1)  # fmt: skip
    obj.before_step(None, 1)
    s = obj.samples
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, s.batch.input_ids, s.batch.labels, 0.8)
    mask = s.batch.labels != IGNORE
    assert float(((logp - s.old_logp).exp() - 1)[mask].abs().max()) < 1e-4  # paged KV vs full
    for _ in range(obj.micro_batches()):
        loss, _ = obj.loss(model, obj.next_batch())
        assert torch.isfinite(loss)
    assert obj.metrics()["clip_fraction"] == 0.0


def test_cpu_end_to_end_grpo_raises_reward(tmp_path: Path) -> None:
    """From a random tiny model, GRPO in the Trainer raises a pluggable verifiable reward (the
    response starts by copying the prompt's first digit: chance ≈ 1/14)."""
    task = ArithmeticTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1)
    obj = rl.GRPOObjective(rollout_engine(model, [tok.eos_id]), tok, _draw(task), _first_digit,
                           "grpo", prompts_per_step=16, group_size=8, epochs=1,
                           micro_batch=256, max_tokens=2, eos_ids=[tok.eos_id], seed=1)  # fmt: skip
    Trainer(_train_cfg(tmp_path, 30, 5e-3), model=model, objective=obj).run()
    hist = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["event"] == "train"]
    first = sum(h["reward"] for h in hist[:5]) / 5
    last = sum(h["reward"] for h in hist[-5:]) / 5
    assert last > first + 0.2, (first, last)


@pytest.mark.slow
def test_arithmetic_headline_grpo_from_weak_start(tmp_path: Path) -> None:
    """The README's ``lmforge rl --task arithmetic`` path: warm start to A0 ≤ 0.3, GRPO to ≥ 0.9."""
    import json

    from lmforge.cli import main

    assert main(["rl", "--task", "arithmetic", "--iterations", "40", "--quiet",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["accuracy_before"] <= 0.3 and summary["accuracy_after"] >= 0.9, summary


def test_ppo_raises_reward_on_a_pluggable_reward(tmp_path: Path) -> None:
    from lmforge.posttrain.dpo import hidden_size
    from lmforge.posttrain.ppo import PolicyWithValue, PPOConfig, PPOObjective

    task = ArithmeticTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1)
    pv = PolicyWithValue(model, hidden_size(model))
    cfg = PPOConfig(max_tokens=2, kl_coef=0.01, samples_per_prompt=8, epochs=2)
    obj = PPOObjective(pv, rollout_engine(model, [tok.eos_id]), tok, _draw(task), _first_digit,
                       cfg, prompts_per_step=16, eos_ids=[tok.eos_id], seed=1)  # fmt: skip
    Trainer(_train_cfg(tmp_path, 60, 5e-3, beta2=0.99), model=pv, objective=obj).run()
    hist = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["event"] == "train"]
    first = sum(h["reward"] for h in hist[:10]) / 10
    last = sum(h["reward"] for h in hist[-10:]) / 10
    assert last > first + 0.2, (first, last)


def test_rollout_kv_blocks_leave_the_trainer_room() -> None:
    """A rollout engine's cache: max_num_seqs full contexts, capped at a share of free memory,
    never below one context (the H200 GRPO run ran out of memory with the serving default)."""
    from lmforge.posttrain.rollout import rollout_kv_blocks

    per_block = 1 << 20  # 1 MiB
    # plenty of memory: 256 contexts of 2048 tokens in 16-token blocks, not more
    assert rollout_kv_blocks(2048, per_block, 1 << 40) == 256 * 128
    # 10 GiB free, 30%: 3 GiB of blocks
    assert rollout_kv_blocks(2048, per_block, 10 << 30, fraction=0.3) == int(0.3 * (10 << 30)) >> 20
    # too little memory: still one full context, the engine's admission floor
    assert rollout_kv_blocks(2048, per_block, 1 << 20) == 128
    assert rollout_kv_blocks(100, per_block, 1 << 40, block_size=16, max_num_seqs=4) == 4 * 7


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
def test_grpo_micro_batches_match_one_batch(name: str) -> None:
    """Micro-batch weights computed up front (each backward right after its forward) give the
    gradient of the whole batch at once, for each aggregation (seq_mean, constant, token_mean
    with DAPO's overlong filter)."""
    task = ArithmeticTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1)
    from lmforge.parallel import Strategy

    strategy = Strategy(model)

    def varied(item: dict, text: str) -> Reward:  # rewards that differ within a group
        r = float(sum(map(ord, text)) % 3) / 2
        return Reward(r, r, 0.0)

    grads = []
    for mb in (1000, 2):
        obj = rl.GRPOObjective(rollout_engine(model, [tok.eos_id]), tok, _draw(task),
                               varied, name, prompts_per_step=3, group_size=3, epochs=2,
                               micro_batch=mb, max_tokens=4, temperature=0.8,
                               eos_ids=[tok.eos_id], seed=1)  # fmt: skip
        obj.before_step(None, 1)
        obj.samples.advantages = torch.randn(
            len(obj.samples), generator=torch.Generator().manual_seed(0)
        )
        obj.before_step(None, 2)  # the second pass: micro-batches of the changed samples
        model.zero_grad(set_to_none=True)
        micro = [obj.next_batch() for _ in range(obj.micro_batches())]
        assert len(micro) == (1 if mb == 1000 else -(-len(obj.samples) // 2))
        forward_backward(strategy, micro, obj)
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
