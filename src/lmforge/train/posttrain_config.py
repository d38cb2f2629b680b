"""The post-training branches of the run config: ``[sft]``, ``[dpo]``, ``[rl]`` and ``[distill]``.

Optimisation lives in ``[train]``, shared with pretraining; these branches hold what only the
objective reads: its data, model and loss. Every value is checked when the config loads, so a
mistake is one line before any model is read. Pure data (no torch): importing it costs nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from lmforge.train.config import check

ALGORITHM_NAMES = ("reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "dapo", "gspo",
                   "maxrl", "ppo")  # fmt: skip
"the RL algorithms (lmforge.posttrain.losses.ALGORITHMS, plus PPO)"

_NO_GROUP = ("reinforce", "ppo")  # algorithms that need no group of samples per prompt


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning: loss on assistant tokens only (``lmforge sft``)."""

    model: str = ""
    "policy to fine-tune: lmforge checkpoint, .gguf file or transformers folder"
    data: str = ""
    "JSONL of conversations ({'messages': [...]}) or {'prompt', 'response'} pairs"
    max_len: int = 1024
    "longest (packed) sequence in tokens"
    packing: bool = True
    "pack several examples per row without attention between them"
    chat: bool = True
    "render prompt/response pairs through the chat template"

    def __post_init__(self) -> None:
        check([(self.max_len >= 2, f"sft.max_len must be at least 2, got {self.max_len}")])


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """Preference optimisation (DPO, IPO, cDPO, SimPO) or a Bradley–Terry reward model."""

    model: str = ""
    "policy to optimise: lmforge checkpoint, .gguf file or transformers folder"
    data: str = ""
    "JSONL(.gz) preference pairs: {'prompt', 'chosen', 'rejected'} or HH-RLHF dialogues"
    loss: Literal["dpo", "ipo", "cdpo", "simpo"] = "dpo"
    "preference loss"
    beta: float = 0.1
    "inverse temperature β, in (0, 1) (SimPO: its β > 0, typically 2)"
    label_smoothing: float = 0.1
    "cDPO's label-flip probability ε, in [0, 0.5)"
    simpo_gamma: float = 0.5
    "SimPO's target margin γ"
    reference: Literal["cached", "online"] = "cached"
    "reference log-probs computed once before training (cached) or by a frozen copy per batch"
    epochs: int = 1
    "passes over the training pairs (train.max_steps follows from it)"
    max_len: int = 512
    "longest prompt + response in tokens"
    limit: int = 0
    "use only the first N pairs (0 = all)"
    eval_fraction: float = 0.1
    "the last fraction of pairs held out for the preference accuracy"
    reward_model: bool = False
    "train a Bradley–Terry reward model (a scalar head on the LM) instead"

    def __post_init__(self) -> None:
        simpo = self.loss == "simpo"
        check([
            (self.beta > 0 if simpo else 0 < self.beta < 1,
             f"dpo.beta must lie in {'(0, inf)' if simpo else '(0, 1)'}, got {self.beta}"),
            (0 <= self.label_smoothing < 0.5,
             f"dpo.label_smoothing must lie in [0, 0.5), got {self.label_smoothing}"),
            (self.epochs >= 1, f"dpo.epochs must be at least 1, got {self.epochs}"),
            (self.max_len >= 4, f"dpo.max_len must be at least 4, got {self.max_len}"),
            (self.limit >= 0, f"dpo.limit must be 0 (all) or more, got {self.limit}"),
            (0 <= self.eval_fraction < 1,
             f"dpo.eval_fraction must lie in [0, 1), got {self.eval_fraction}"),
        ])  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """RL with verifiable rewards: the GRPO family and PPO (``lmforge rl``)."""

    task: Literal["arithmetic", "scratchpad", "gsm8k", "math"] = "arithmetic"
    "arithmetic / scratchpad (a tiny model warm-started here) or gsm8k / math (needs rl.model)"
    algo: str = "grpo"
    "reinforce, reinforce_baseline, rloo, grpo, dr_grpo, dapo, gspo, maxrl or ppo"
    model: str = ""
    "policy to start from (arithmetic: warm-started here when empty)"
    data: str = ""
    "gsm8k/math: JSONL of training problems (default: the shared data's train split)"
    eval_data: str = ""
    "gsm8k/math: JSONL of held-out problems (default: the shared data's test split)"
    iterations: int = 60
    "rollout batches (train.max_steps = iterations × epochs)"
    prompts_per_step: int = 32
    "prompts per rollout batch"
    group_size: int = 8
    "samples per prompt (at least 2 for a group baseline)"
    epochs: int = 1
    "optimizer steps per rollout batch (off-policy after the first)"
    kl_coef: float = 0.0
    "k3 KL penalty to the initial policy (0 = off)"
    max_tokens: int = 0
    "longest completion (0 = the task's default)"
    temperature: float = 1.0
    "sampling temperature (> 0)"
    std: Literal["sample", "population"] = "sample"
    "group std that normalises advantages: sample (unbiased, as TRL, verl, CS336) or population"
    digits: int = 3
    "arithmetic: operand digits"
    warmup_steps: int = 1000
    "arithmetic: supervised warm-start steps"
    eval_size: int = 200
    "held-out problems per evaluation (greedy)"
    target: float = 0.0
    "stop once the held-out accuracy reaches this (0 = off)"
    pipeline: bool = False
    "Pipeline RL: engine and trainer processes with in-flight weight updates"
    max_lag: int = 4
    "pipeline: drop samples older than this many policy versions"
    queue_size: int = 0
    "pipeline: finished batches the engine may hold unconsumed"
    engine_threads: int = 0
    "pipeline: torch threads of the engine process (0 = torch's)"
    weight_transport: Literal["broadcast", "shared"] = "broadcast"
    "pipeline: how new weights reach the engine process"

    def __post_init__(self) -> None:
        check([
            (self.algo in ALGORITHM_NAMES,
             f"rl.algo {self.algo!r} is unknown (known: {', '.join(ALGORITHM_NAMES)})"),
            *[(getattr(self, k) >= 1, f"rl.{k} must be at least 1, got {getattr(self, k)}")
              for k in ("iterations", "prompts_per_step", "epochs", "eval_size")],
            *[(getattr(self, k) >= 0, f"rl.{k} must be 0 or more, got {getattr(self, k)}")
              for k in ("kl_coef", "warmup_steps", "max_lag", "queue_size")],
            (self.group_size >= (1 if self.algo in _NO_GROUP else 2),
             f"rl.group_size must be at least 2 for {self.algo} (its baseline compares the "
             f"samples of a group), got {self.group_size}"),
            (self.max_tokens >= 0, f"rl.max_tokens must be 0 (default) or more, got {self.max_tokens}"),
            (self.temperature > 0, f"rl.temperature must be positive, got {self.temperature}"),
            (1 <= self.digits <= 9, f"rl.digits must lie in [1, 9], got {self.digits}"),
            (0 <= self.target <= 1, f"rl.target must lie in [0, 1], got {self.target}"),
            (self.engine_threads >= 0,
             f"rl.engine_threads must be 0 (torch's) or more, got {self.engine_threads}"),
            (not (self.pipeline and self.algo == "ppo"),
             "rl.pipeline runs the GRPO family (rl.algo grpo, dapo, ...), not ppo"),
        ])  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Logit distillation of a teacher into a student (``lmforge distill``)."""

    teacher: str = ""
    "teacher model: lmforge checkpoint, .gguf file or transformers folder"
    student: str = ""
    "student model (same vocabulary as the teacher)"
    data: str = ""
    "JSONL with {'text'} records (or SFT records); on-policy uses their prompts"
    loss: Literal["forward", "reverse", "jsd"] = "forward"
    "forward KL, reverse KL or generalised JSD"
    temperature: float = 1.0
    "softmax temperature of both models (> 0)"
    beta: float = 0.5
    "JSD mixture weight, in [0, 1]"
    on_policy: bool = False
    "train on the student's own samples of the data's prompts"
    max_len: int = 512
    "longest sequence (or prompt, on-policy) in tokens"
    max_tokens: int = 64
    "on-policy: longest sampled completion"

    def __post_init__(self) -> None:
        check([
            (self.temperature > 0,
             f"distill.temperature must be positive, got {self.temperature}"),
            (0 <= self.beta <= 1, f"distill.beta must lie in [0, 1], got {self.beta}"),
            (self.max_len >= 2, f"distill.max_len must be at least 2, got {self.max_len}"),
            (self.max_tokens >= 1, f"distill.max_tokens must be at least 1, got {self.max_tokens}"),
        ])  # fmt: skip
