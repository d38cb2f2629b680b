"""RL with verifiable rewards: rollouts, rewards, the ratio-equals-one test, and a CPU end-to-end run."""

from __future__ import annotations

import random

import pytest
import torch

from lmforge.generate.engine import greedy_generate_reference
from lmforge.model import ModelConfig, TransformerLM
from lmforge.posttrain import rl
from lmforge.posttrain.core import IGNORE, sequence_logprobs
from lmforge.posttrain.rollout import LocalEngine, SamplingParams
from lmforge.posttrain.tasks import (
    ArithmeticTask,
    Reward,
    format_reward,
    gsm8k_reward,
    math_reward,
)


def tiny_lm(vocab: int = 30, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(vocab_size=vocab, context_length=48, d_model=32, n_layers=2,
                                     n_heads=4, n_kv_heads=2))  # fmt: skip


def test_rollout_greedy_matches_full_recompute_reference() -> None:
    model = tiny_lm().eval()
    eng = LocalEngine(model)
    prompts = [[3, 4, 5], [7], [9, 10, 11, 12, 13]]
    outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == greedy_generate_reference(model, p, 6)
        assert o.outputs[0].finish_reason == "length"


def test_rollout_records_contract_logprobs_versions_and_stops() -> None:
    model = tiny_lm().eval()
    eng = LocalEngine(model, eos_ids=[2])
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=8, n=3, seed=1, logprobs=2)
    outs = eng.generate([[3, 4], [5, 6, 7]], params)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    for o in outs:
        for c in o.outputs:
            seq = torch.tensor([o.prompt_token_ids + c.token_ids])
            logits = model(seq)[0, len(o.prompt_token_ids) - 1 : -1].double() / 0.7
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])
            # full-vocabulary log-softmax at T, before the top-k truncation
            torch.testing.assert_close(
                torch.tensor(c.logprobs).double(), ref[:, 0], atol=1e-4, rtol=0
            )
            assert c.policy_versions == [0] * len(c.token_ids)
            assert c.top_logprobs is not None and len(c.top_logprobs[0]) == 2
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == 2 and 2 not in c.token_ids[:-1]


def test_weight_update_mid_sequence_keeps_cache_and_records_versions() -> None:
    model = tiny_lm().eval()
    other = tiny_lm(seed=1)
    eng = LocalEngine(model)
    dec = eng.start([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=6))
    for _ in range(3):
        dec.step()
    cache_len = dec._m.cache.length
    eng.update_weights(((n, p.detach()) for n, p in other.named_parameters()), version=7)
    while not dec.done:
        dec.step()
    comp = dec.outputs()[0].outputs[0]
    # token 4's distribution was computed by the old weights (the forward after token 3 ran
    # before the swap), so it carries version 0; tokens 5 and 6 were computed by version 7
    assert comp.policy_versions == [0, 0, 0, 0, 7, 7]
    assert dec._m.cache.length == cache_len + 2  # the cache kept growing, never rebuilt
    assert torch.equal(model.lm_head.weight, other.lm_head.weight)


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
def test_ratio_is_one_at_lr_zero(name: str) -> None:
    """The engine's sampled-token log-probs equal the trainer's: at lr 0 every ratio is 1."""
    model = tiny_lm()
    eng = LocalEngine(model, eos_ids=[2])
    prompts = [[3, 4, 5], [6], [7, 8]]
    outs = eng.generate(prompts, SamplingParams(temperature=0.8, max_tokens=7, n=4, seed=0))
    comps = [c for o in outs for c in o.outputs]
    flat_prompts = [o.prompt_token_ids for o in outs for _ in o.outputs]
    adv = torch.randn(len(comps))
    samples = rl.build_samples(flat_prompts, comps, adv, torch.zeros(len(comps)))
    logp, _ = sequence_logprobs(model, samples.batch.input_ids, samples.batch.labels, 0.8)
    mask = samples.batch.labels != IGNORE
    ratio = (logp - samples.old_logp).exp()[mask]
    assert float((ratio - 1).abs().max()) < 1e-4  # stated tolerance: fp32 cache vs full forward
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = rl.StepConfig(rl.algorithm(name), max_tokens=7, micro_batch=5, temperature=0.8)
    stats = rl.rl_train_step(model, opt, samples, cfg)
    assert stats["clip_fraction"] == 0.0  # nothing clipped: every ratio is inside [1-ε, 1+ε]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_cpu_end_to_end_rl_raises_reward() -> None:
    """From a random tiny model, GRPO raises a pluggable verifiable reward (the response starts
    by copying the prompt's first digit: chance ≈ 1/14) within a few iterations."""
    task = ArithmeticTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1)
    eng = LocalEngine(model, eos_ids=[tok.eos_id])

    def reward(item: dict, text: str) -> Reward:
        hit = float(text[:1] == item["prompt"][0])
        return Reward(hit, hit, 0.0)

    cfg = rl.StepConfig(rl.algorithm("grpo"), max_tokens=2, micro_batch=256)
    hist = rl.run_iterations(model, eng, tok, rl.random_sampler(task, 1), reward, cfg,
                             iterations=30, prompts_per_step=16, group_size=8, lr=5e-3)  # fmt: skip
    first = sum(h["reward"] for h in hist[:5]) / 5
    last = sum(h["reward"] for h in hist[-5:]) / 5
    assert last > first + 0.2, (first, last)


@pytest.mark.slow
def test_arithmetic_headline_grpo_from_weak_start() -> None:
    """The README's ``lmforge rl --task arithmetic`` path: warm start to A0 ≤ 0.3, GRPO to ≥ 0.8."""
    task = ArithmeticTask(digits=3)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size)
    eng = LocalEngine(model, eos_ids=[tok.eos_id])
    ev = task.eval_set(200)
    wr = random.Random(5)
    rl.supervised_warmup(model, tok, rl.random_sampler(task, 0), 1000, 64, 3e-3, tok.eos_id,
                         answer_fn=lambda it: task.warmup_answer(it, wr))  # fmt: skip
    model.eval()
    a0 = rl.evaluate_accuracy(eng, tok, ev, task.reward, task.answer_tokens)
    cfg = rl.StepConfig(rl.algorithm("grpo"), max_tokens=task.answer_tokens, micro_batch=256)
    rl.run_iterations(model, eng, tok, rl.random_sampler(task, 1), task.reward, cfg,
                      iterations=40, prompts_per_step=32, group_size=8, lr=1e-3)  # fmt: skip
    model.eval()
    a1 = rl.evaluate_accuracy(eng, tok, ev, task.reward, task.answer_tokens)
    assert a0 <= 0.3 and a1 >= 0.8, (a0, a1)


def test_rollout_on_a_transformers_gpt2_matches_its_own_logprobs() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=30, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=1)  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).eval()
    eng = LocalEngine(model)
    prompts = [[3, 4, 5], [7]]  # different lengths: left padding, explicit positions
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=5, seed=0))
    comps = [o.outputs[0] for o in outs]
    s = rl.build_samples(prompts, comps, torch.zeros(2), torch.zeros(2))
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, s.batch.input_ids, s.batch.labels)
    mask = s.batch.labels != IGNORE
    assert float(((logp - s.old_logp).exp() - 1)[mask].abs().max()) < 1e-4


def test_ppo_raises_reward_on_a_pluggable_reward() -> None:
    from lmforge.posttrain.ppo import PPOConfig, run_ppo

    task = ArithmeticTask(digits=1)
    tok = task.tokenizer()
    model = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=32, n_layers=1)
    eng = LocalEngine(model, eos_ids=[tok.eos_id])

    def reward(item: dict, text: str) -> Reward:
        hit = float(text[:1] == item["prompt"][0])
        return Reward(hit, hit, 0.0)

    cfg = PPOConfig(lr=5e-3, max_tokens=2, kl_coef=0.01, samples_per_prompt=8)
    hist = run_ppo(model, eng, tok, rl.random_sampler(task, 1), reward, cfg, iterations=30,
                   prompts_per_step=16)  # fmt: skip
    first = sum(h["reward"] for h in hist[:5]) / 5
    last = sum(h["reward"] for h in hist[-5:]) / 5
    assert last > first + 0.2, (first, last)


def test_serve_engine_adapter_ratio_is_one() -> None:
    """After the merge: the serve engine's log-probs through make_engine equal the trainer's."""
    pytest.importorskip("lmforge.serve.engine")
    from lmforge.posttrain.rollout import make_engine

    model = tiny_lm()
    eng = make_engine(model, eos_ids=[2], prefer="serve")
    outs = eng.generate(
        [[3, 4, 5], [6]], SamplingParams(temperature=0.8, max_tokens=7, n=4, seed=0)
    )
    comps = [c for o in outs for c in o.outputs]
    prompts = [o.prompt_token_ids for o in outs for _ in o.outputs]
    s = rl.build_samples(prompts, comps, torch.zeros(len(comps)), torch.zeros(len(comps)))
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, s.batch.input_ids, s.batch.labels, 0.8)
    mask = s.batch.labels != IGNORE
    assert float(((logp - s.old_logp).exp() - 1)[mask].abs().max()) < 1e-4
    eng.version = 3
    out = eng.generate([[3]], SamplingParams(temperature=0.0, max_tokens=3))
    assert out[0].outputs[0].policy_versions == [3, 3, 3]


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
def test_rl_train_step_micro_batches_match_one_batch(name: str) -> None:
    """Micro-batch weights computed up front (each backward right after its forward) give the
    gradient of the whole batch at once, for each aggregation (seq_mean, constant, token_mean
    with DAPO's overlong filter)."""
    model = tiny_lm()
    eng = LocalEngine(model, eos_ids=[2])
    outs = eng.generate(
        [[3, 4, 5], [6], [7, 8]], SamplingParams(temperature=0.8, max_tokens=6, n=3, seed=1)
    )
    comps = [c for o in outs for c in o.outputs]
    flat_prompts = [o.prompt_token_ids for o in outs for _ in o.outputs]
    samples = rl.build_samples(
        flat_prompts, comps, torch.randn(len(comps)), torch.zeros(len(comps))
    )
    grads = []
    for mb in (len(comps), 2):
        model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        cfg = rl.StepConfig(rl.algorithm(name), max_tokens=6, micro_batch=mb, max_grad_norm=None,
                            temperature=0.8)  # fmt: skip
        rl.rl_train_step(model, opt, samples, cfg)
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
