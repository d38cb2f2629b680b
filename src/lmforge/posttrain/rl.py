"""RL with verifiable rewards: rollouts in groups, advantages, and the GRPO family's objective.

One rollout batch: sample ``group_size`` completions per prompt on the serving engine
(:func:`~lmforge.posttrain.rollout.rollout_engine`, recording each token's log-prob and policy
version), score them, compute group advantages (:func:`score_groups`), then ``epochs`` optimizer
steps of the one Trainer over that batch (off-policy after the first: the recorded log-probs
are the importance-sampling denominators). The loss is the per-token policy loss of
:mod:`lmforge.posttrain.losses` with the chosen reweighting, aggregated as chosen, plus an
optional k3 KL to a frozen reference model (:class:`GRPOObjective`).

The arithmetic command (``lmforge rl --task arithmetic``) first warm-starts a tiny model on the
task's format (the SFT objective, a short run that leaves it well below the target accuracy),
then runs RL; both runs and the held-out accuracy curve are logged.

Shape legend: B batch (sequences), T tokens, V vocab.
Exercised by ``pytest tests/test_posttrain_rl.py tests/test_posttrain_resume.py``.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lmforge.config import RunConfig
from lmforge.posttrain.config import SFTConfig
from lmforge.posttrain.core import (
    IGNORE,
    Batch,
    collate,
    decode_ids,
    encode_text,
    prompt_response_example,
    sequence_logprobs,
    set_random_state,
)
from lmforge.posttrain.losses import (
    ALGORITHMS,
    Algorithm,
    aggregate,
    dynamic_sampling_keep,
    group_advantages,
    k3_kl,
    overlong_penalty,
    policy_token_loss,
)
from lmforge.posttrain.rollout import rollout_engine, sample
from lmforge.posttrain.sft import SFTObjective
from lmforge.posttrain.tasks import Reward
from lmforge.serve import SamplingParams
from lmforge.train.config import TrainConfig
from lmforge.train.metrics import read_metrics
from lmforge.utils.errors import LmforgeError


@dataclasses.dataclass
class Samples:
    """A batch of scored completions ready for the loss: ``batch`` holds prompt+completion
    inputs and labels (IGNORE outside the completion); ``old_logp`` (B, T) the engine's
    log-probs at the label positions; ``versions`` (B, T) the policy version of each completion
    token (−1 elsewhere); ``advantages`` (B,); ``weights`` (B,) per-sequence loss weights
    (staleness down-weighting; 1 by default); ``rewards`` (B,); ``lengths`` (B,); ``truncated``
    (B,) bool (ended by the length limit)."""

    batch: Batch
    old_logp: torch.Tensor
    versions: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    lengths: torch.Tensor
    truncated: torch.Tensor
    weights: torch.Tensor

    def __len__(self) -> int:
        return self.batch.input_ids.shape[0]

    def select(self, idx: torch.Tensor | Sequence[int]) -> Samples:
        idx = torch.as_tensor(idx, dtype=torch.long)
        return _samples_from({k: v[idx] for k, v in _samples_state(self).items()})


def build_samples(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Any],
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    pad_id: int = 0,
) -> Samples:
    """:class:`Samples` from prompts and their :class:`~lmforge.posttrain.rollout.CompletionOutput`."""
    examples = []
    for p, c in zip(prompts, completions):
        toks = c.token_ids if c.token_ids else [pad_id]
        examples.append(prompt_response_example(p, toks))
    batch = collate(examples, pad_id)
    b, t = batch.input_ids.shape
    old = torch.zeros(b, t)
    ver = torch.full((b, t), -1, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        start = len(p) - 1
        n = len(c.token_ids)
        old[row, start : start + n] = torch.tensor(c.logprobs, dtype=torch.float32)
        ver[row, start : start + n] = torch.tensor(c.policy_versions, dtype=torch.long)
        if n == 0:
            batch.labels[row] = IGNORE
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long)
    trunc = torch.tensor([c.finish_reason == "length" for c in completions])
    return Samples(batch, old, ver, advantages.float(), rewards.float(), lengths, trunc,
                   torch.ones(b))  # fmt: skip


def score_groups(
    items: Sequence[dict[str, Any]],
    outputs: Sequence[Any],
    tokenizer: Any,
    reward_fn: Callable[[dict[str, Any], str], Reward],
    algo: Algorithm,
    max_tokens: int,
    overlong_cache: int = 0,
    eos_ids: Sequence[int] = (),
    std: str = "sample",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rewards (G, N), advantages (G, N) and reward statistics of grouped outputs (``std``:
    the group std that normalises, see :func:`~lmforge.posttrain.losses.group_advantages`)."""
    stops = set(eos_ids)
    rewards, answers, formats, lengths = [], [], [], []
    for item, out in zip(items, outputs):
        row = []
        for c in out.outputs:
            toks = [t for t in c.token_ids if t not in stops]
            r = reward_fn(item, decode_ids(tokenizer, toks))
            row.append(r.total)
            answers.append(r.answer)
            formats.append(r.format)
            lengths.append(len(c.token_ids))
        rewards.append(row)
    r = torch.tensor(rewards, dtype=torch.float32)  # (G, N)
    shaped = r
    if overlong_cache > 0:
        lens = torch.tensor(lengths, dtype=torch.float32).view_as(r)
        shaped = r + overlong_penalty(lens, max_tokens, overlong_cache)
    adv = group_advantages(shaped, algo.baseline, algo.normalizer, std=std)  # type: ignore[arg-type]
    stats = {
        "reward": float(r.mean()),
        "reward_answer": sum(answers) / len(answers),
        "reward_format": sum(formats) / len(formats),
        "reward_std_in_group": float(r.std(-1, unbiased=False).mean()),
        "response_len": sum(lengths) / len(lengths),
    }
    return r, adv, stats


@torch.no_grad()
def evaluate_accuracy(
    engine: Any,
    tokenizer: Any,
    items: Sequence[dict[str, Any]],
    reward_fn: Callable[[dict[str, Any], str], Reward],
    max_tokens: int,
    batch_size: int = 256,
    eos_ids: Sequence[int] | None = None,
) -> float:
    """Greedy held-out accuracy (mean answer reward)."""
    total = 0.0
    eos = set(getattr(engine, "eos_ids", ()) if eos_ids is None else eos_ids)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=tuple(eos))
    for i in range(0, len(items), batch_size):
        chunk = items[i : i + batch_size]
        outs = engine.generate([encode_text(tokenizer, it["prompt"]) for it in chunk], params)
        for it, o in zip(chunk, outs):
            toks = [t for t in o.outputs[0].token_ids if t not in eos]
            total += reward_fn(it, decode_ids(tokenizer, toks)).answer
    return total / max(len(items), 1)


def overlong_budget(answer_tokens: int, algo: Algorithm) -> tuple[int, int]:
    """``(max_tokens, overlong_cache)`` for good answers of ``answer_tokens``: the answer length
    plus DAPO's penalty ramp (a full-length good answer is never penalised); algorithms without
    the overlong terms get the answer length and no cache."""
    if not algo.overlong_filter:
        return answer_tokens, 0
    cache = max(2, answer_tokens // 4)
    return answer_tokens + cache, cache


def algorithm(name: str) -> Algorithm:
    """The named combination of :data:`~lmforge.posttrain.losses.ALGORITHMS`."""
    if name not in ALGORITHMS:
        known = ", ".join([*ALGORITHMS, "ppo"])
        raise LmforgeError(f"unknown RL algorithm {name!r} (known: {known})")
    return ALGORITHMS[name]


def arithmetic_model(
    vocab_size: int, seed: int = 0, d_model: int = 128, n_layers: int = 2, context_length: int = 32
) -> nn.Module:
    """The tiny lmforge model of the arithmetic task (2 layers, d=128, reference backends);
    ``context_length`` 48 fits the 3-digit scratchpad task (8-token prompt, 30-token answer)."""
    from lmforge.model import ModelConfig, TransformerLM

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab_size, context_length=context_length, d_model=d_model,
                      n_layers=n_layers, n_heads=4, attention="sdpa")  # fmt: skip
    return TransformerLM(cfg)


def _samples_state(s: Samples) -> dict[str, torch.Tensor]:
    # Samples as flat named tensors (checkpoints, benchmarks): the batch's two, then the rest
    rest = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)[1:]}
    return {"input_ids": s.batch.input_ids, "labels": s.batch.labels, **rest}


def _samples_from(d: dict[str, torch.Tensor]) -> Samples:
    rest = (d[f.name] for f in dataclasses.fields(Samples)[1:])
    return Samples(Batch(d["input_ids"], d["labels"]), *rest)


class _RolloutObjective:
    """What :class:`GRPOObjective` and PPO's share: the greedy held-out evaluation (ending the run
    at ``target``) and the rollout loop's resume state (RNG, passes left, samples, stats)."""

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Greedy held-out accuracy (mean answer reward) on the engine."""
        if not self.eval_items:
            return {}
        acc = evaluate_accuracy(self.engine, self.tokenizer, self.eval_items, self.reward_fn,
                                self.eval_max_tokens, eos_ids=self.eos)  # fmt: skip
        self.should_stop = bool(self.target) and acc >= self.target
        return {"eval_accuracy": acc}

    def _sample(
        self, version: int, n: int, temperature: float, max_tokens: int
    ) -> tuple[list[dict[str, Any]], list[list[int]], list[Any], float]:
        # (items, prompt ids, n completions of each under ``version``, seconds spent sampling)
        items = self.draw(self.prompts_per_step, self.rng)
        prompts = [encode_text(self.tokenizer, it["prompt"]) for it in items]
        t = time.perf_counter()
        outs = sample(self.engine, prompts, self.rng, version, n=n, temperature=temperature,
                      max_tokens=max_tokens, eos_ids=self.eos)  # fmt: skip
        return items, prompts, outs, time.perf_counter() - t

    def _loop_state(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "passes_left": self.passes_left,
                "samples_seen": self.samples_seen, "stats": dict(self._stats)}  # fmt: skip

    def _load_loop_state(self, state: dict) -> None:
        set_random_state(self.rng, state["rng"])
        self.passes_left, self.samples_seen = int(state["passes_left"]), int(state["samples_seen"])
        self._stats = dict(state["stats"])


class GRPOObjective(_RolloutObjective):
    """The GRPO family (REINFORCE, RLOO, GRPO, Dr. GRPO, DAPO, GSPO, MaxRL) as a
    :class:`~lmforge.train.Objective` (the module docstring gives the loop and the loss).

    The serving engine shares the trained module (its policy version is bumped to the step count
    before sampling); each step takes one pass over the rollout batch in micro-batches of
    ``micro_batch`` sequences. ``draw(n, rng)`` gives n training items; ``eval_items`` are scored
    greedily by :meth:`evaluate`. Exact resume: the state holds the RNG that picks prompts and
    per-request sampling seeds, the current rollout batch and the pass within it.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        draw: Callable[[int, random.Random], list[dict[str, Any]]],
        reward_fn: Callable[[dict[str, Any], str], Reward],
        algo_name: str,
        *,
        prompts_per_step: int,
        group_size: int,
        epochs: int,
        micro_batch: int,
        max_tokens: int,
        temperature: float = 1.0,
        kl_coef: float = 0.0,
        std: str = "sample",
        overlong_cache: int = 0,
        eos_ids: Sequence[int] = (),
        eval_items: Sequence[dict[str, Any]] = (),
        eval_max_tokens: int | None = None,
        ref_model: nn.Module | None = None,
        seed: int = 0,
        target: float = 0.0,
    ) -> None:
        self.name = algo_name
        self.target = target  # stop once an evaluation reaches it (0 = off)
        self.should_stop = False
        self.algo = algorithm(algo_name)
        self.engine, self.tokenizer, self.draw, self.reward_fn = engine, tokenizer, draw, reward_fn
        self.prompts_per_step, self.group_size, self.epochs = prompts_per_step, group_size, epochs
        self.micro_batch, self.max_tokens, self.temperature = micro_batch, max_tokens, temperature
        self.kl_coef, self.std, self.overlong_cache = kl_coef, std, overlong_cache
        self.eos = list(eos_ids)
        self.eval_items = list(eval_items)
        self.eval_max_tokens = eval_max_tokens or max_tokens
        if kl_coef > 0 and ref_model is None:
            raise LmforgeError("rl.kl_coef > 0 needs a reference model")
        self.ref_model = ref_model
        self.rng = random.Random(seed)
        self.samples: Samples | None = None
        self.passes_left = 0
        self.samples_seen = 0
        self.queue: list[Samples] = []
        self._stats: dict[str, float] = {}
        self._clip: list[float] = []

    # -- rollouts

    def _rollout(self, version: int) -> tuple[Samples, dict[str, float]]:
        items, prompts, outs, gen_s = self._sample(
            version, self.group_size, self.temperature, self.max_tokens
        )
        r, adv, stats = score_groups(items, outs, self.tokenizer, self.reward_fn, self.algo,
                                     self.max_tokens, self.overlong_cache, self.eos,
                                     self.std)  # fmt: skip
        stats["gen_s"] = gen_s
        keep = (dynamic_sampling_keep(r) if self.algo.dynamic_sampling
                else torch.ones(len(items), dtype=torch.bool))  # fmt: skip
        stats["groups_kept"] = float(keep.float().mean())
        self.samples_seen += len(items) * self.group_size
        rows = [
            (prompts[g], c, float(adv[g, j]), float(r[g, j]))
            for g, out in enumerate(outs)
            if keep[g]
            for j, c in enumerate(out.outputs)
        ]
        if not rows:  # every group had equal rewards: no gradient to take (an empty batch)
            one = build_samples(prompts[:1], outs[0].outputs[:1], adv[0, :1], r[0, :1])
            return one.select([]), stats
        p, c, a, rw = zip(*rows)
        return build_samples(p, c, torch.tensor(a), torch.tensor(rw)), stats

    def before_step(self, trainer: Any, step: int) -> None:
        """A new rollout batch every ``epochs`` steps; this step's micro-batches."""
        if self.passes_left == 0:
            for _ in range(8):  # DAPO's dynamic sampling may drop a whole batch: sample again
                self.samples, self._stats = self._rollout(step - 1)
                if len(self.samples):
                    break
            self.passes_left = self.epochs
            self._stats["samples"] = float(self.samples_seen)
        self.passes_left -= 1
        self._split()

    def _split(self) -> None:
        # this step's pass over the rollout batch, in micro-batches
        s, m = self.samples, self.micro_batch
        assert s is not None
        self.queue = [s.select(range(i, min(i + m, len(s)))) for i in range(0, len(s), m)] or [s]

    def micro_batches(self) -> int:
        """Micro-batches of this step's pass over the rollout batch."""
        return len(self.queue)

    def next_batch(self) -> Samples:
        """The next micro-batch of this step's pass."""
        return self.queue.pop(0)

    # -- loss

    def _mask(self, labels: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        # completion tokens, minus truncated rows under DAPO's overlong filter
        mask = labels != IGNORE
        if self.algo.overlong_filter:
            mask = mask & ~truncated[:, None]
        return mask

    def batch_weight(self, s: Samples) -> float:
        """What :func:`~lmforge.posttrain.losses.aggregate` returns as the weight, without a
        forward: sequences, or masked tokens for ``token_mean``."""
        if self.algo.aggregation != "token_mean":
            return float(len(s))
        return float(self._mask(s.batch.labels, s.truncated).sum())

    def loss(self, model: nn.Module, s: Samples) -> tuple[torch.Tensor, torch.Tensor]:
        """(aggregated policy loss of the micro-batch, its weight)."""
        device = next(model.parameters()).device
        if len(s) == 0:  # nothing kept (dynamic sampling, staleness): no gradient this step
            return torch.zeros((), device=device, requires_grad=True), torch.zeros(())
        ids, labels = s.batch.input_ids.to(device), s.batch.labels.to(device)
        mask = self._mask(labels, s.truncated.to(device))
        logp, _ = sequence_logprobs(model, ids, labels, self.temperature)
        algo = self.algo
        token_loss, clipped = policy_token_loss(
            logp, s.old_logp.to(device), s.advantages.to(device), mask,
            algo.reweight, algo.eps_low, algo.eps_high,
        )  # fmt: skip
        if self.ref_model is not None and self.kl_coef > 0:
            with torch.no_grad():
                ref, _ = sequence_logprobs(self.ref_model, ids, labels, self.temperature)
            token_loss = token_loss + self.kl_coef * k3_kl(logp, ref) * mask
        token_loss = token_loss * s.weights.to(device)[:, None]
        self._clip.append(float(clipped.sum()) / max(float(mask.sum()), 1.0))
        loss_sum, weight = aggregate(token_loss, mask, algo.aggregation, float(self.max_tokens))
        return loss_sum, torch.as_tensor(float(weight))

    def metrics(self) -> dict[str, float]:
        """Reward statistics of the rollout batch and the step's clip fraction."""
        out = dict(self._stats)
        if self._clip:
            out["clip_fraction"] = sum(self._clip) / len(self._clip)
        self._clip = []
        return out

    # -- resume

    def state_dict(self) -> dict:
        """Prompt/seed RNG, the rollout batch, the passes left over it, samples seen."""
        out = self._loop_state()
        if self.samples is not None:
            out["samples"] = _samples_state(self.samples)
        return out

    def load_state_dict(self, state: dict) -> None:
        self._load_loop_state(state)
        self.samples = _samples_from(state["samples"]) if "samples" in state else None


def warm_start(
    model: nn.Module, task: Any, steps: int, out_dir: str, seed: int = 0, batch: int = 64,
    device: str = "cpu", progress: bool = False,
) -> None:  # fmt: skip
    """The arithmetic tasks' supervised warm start (SFT in the Trainer): ``steps`` AdamW steps of
    ``batch`` items answered by ``task.warmup_answer``, in a run folder of its own (resumable; a
    rerun of a finished one does nothing)."""
    from lmforge.train import Trainer

    tok = task.tokenizer()
    items = task.sample(batch * steps, random.Random(seed))
    wr = random.Random(seed + 5)
    exs = [prompt_response_example(encode_text(tok, it["prompt"]),
                                   encode_text(tok, task.warmup_answer(it, wr)), tok.eos_id)
           for it in items]  # fmt: skip
    ctx = model.config.context_length
    tc = TrainConfig(out_dir=out_dir, device=device, seed=seed, precision="fp32", lr=3e-3,
                     min_lr=0.0, beta2=0.999, weight_decay=0.0, schedule="constant",
                     warmup_steps=0, max_steps=steps, batch_size=batch, grad_clip=0.0,
                     eval_every=0, save_every=max(steps // 4, 1), log_every=10, plot=False,
                     progress=progress)  # fmt: skip
    obj = SFTObjective(exs, SFTConfig(max_len=ctx, packing=False), batch, device, seed=seed)
    Trainer(RunConfig(train=tc), model=model, objective=obj).run()
    model.eval()


def train_grpo(
    model: nn.Module,
    tokenizer: Any,
    draw: Callable[[int, random.Random], list[dict[str, Any]]],
    reward_fn: Callable[[dict[str, Any], str], Reward],
    algo_name: str,
    *,
    out_dir: str,
    iterations: int,
    prompts_per_step: int,
    group_size: int,
    lr: float,
    max_tokens: int,
    micro_batch: int = 256,
    overlong_cache: int = 0,
    eval_items: Sequence[dict[str, Any]] = (),
    eval_every: int = 0,
    seed: int = 0,
    device: str = "cpu",
    on_step: Callable[[dict[str, Any], nn.Module], None] | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Synchronous GRPO-family RL of ``model`` (:class:`GRPOObjective` in the Trainer, into
    ``out_dir``) for benchmarks and tests; one record per iteration (its ``train`` record, with
    ``time_s`` that leaves out ``on_step(record, model)``, and ``eval_accuracy`` where one ran)."""
    from lmforge.train import Trainer

    eos = [tokenizer.eos_id] if getattr(tokenizer, "eos_id", None) is not None else []
    obj = GRPOObjective(rollout_engine(model, eos, seed=seed), tokenizer, draw, reward_fn,
                        algo_name, prompts_per_step=prompts_per_step, group_size=group_size,
                        epochs=1, micro_batch=micro_batch, max_tokens=max_tokens,
                        overlong_cache=overlong_cache, eos_ids=eos, eval_items=eval_items,
                        seed=seed + 1)  # fmt: skip
    tc = TrainConfig(out_dir=out_dir, device=device, seed=seed, precision="fp32", lr=lr,
                     min_lr=0.0, beta2=0.99, weight_decay=0.0, schedule="constant",
                     warmup_steps=0, max_steps=iterations, batch_size=micro_batch,
                     eval_every=eval_every, save_every=0, log_every=1, plot=False,
                     progress=progress)  # fmt: skip
    history: list[dict[str, Any]] = []
    paused = [0.0]
    t0 = [0.0]

    def record(trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        rec = {"iteration": step, **{k: v for k, v in metrics.items() if k != "skipped"}}
        rec["samples"] = int(metrics.get("samples", step * prompts_per_step * group_size))
        rec["time_s"] = time.perf_counter() - t0[0] - paused[0]
        if on_step is not None:
            t = time.perf_counter()
            on_step(rec, model)
            paused[0] += time.perf_counter() - t
        history.append(rec)

    trainer = Trainer(RunConfig(train=tc), model=model, objective=obj, callbacks=[record])
    t0[0] = time.perf_counter()
    trainer.run()
    return add_eval_accuracy(history, out_dir, "iteration")


def add_eval_accuracy(
    history: list[dict[str, Any]], out_dir: str, key: str
) -> list[dict[str, Any]]:
    """``history`` (records of steps ``rec[key]``) with ``eval_accuracy`` where an evaluation
    ran at that step: the ``eval`` records of ``out_dir``'s metrics.jsonl."""
    evals = {r["step"]: r["eval_accuracy"] for r in read_metrics(f"{out_dir}/metrics.jsonl")
             if r.get("event") == "eval" and "eval_accuracy" in r}  # fmt: skip
    for rec in history:
        if rec.get(key) in evals:
            rec["eval_accuracy"] = evals[rec[key]]
    return history
