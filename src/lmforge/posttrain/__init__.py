"""Post-training: SFT, DPO and variants, reward models and PPO, the GRPO family with verifiable
rewards, Pipeline RL with in-flight weight updates, and distillation — each an objective of the
one :class:`lmforge.train.Trainer`, rollouts on :class:`lmforge.serve.Engine`.

This is the public API of ``lmforge.posttrain``; everything else is internal. Commands:
``lmforge sft``, ``lmforge dpo``, ``lmforge rl``, ``lmforge distill``.
"""

from __future__ import annotations

from lmforge.utils.lazy import lazy_exports

__all__ = [
    "ALGORITHMS",
    "ArithmeticTask",
    "DPOObjective",
    "DistillObjective",
    "GRPOObjective",
    "PPOObjective",
    "PipelineObjective",
    "RewardModelObjective",
    "SFTObjective",
    "aggregate",
    "bradley_terry_loss",
    "chat_example",
    "collate",
    "distill_token_loss",
    "dpo_loss",
    "gae",
    "group_advantages",
    "k3_kl",
    "masked_mean",
    "masked_sum_normalize",
    "pack",
    "policy_token_loss",
    "prompt_response_example",
    "render_chat",
    "rollout_engine",
    "sequence_logprobs",
    "simpo_loss",
    "token_entropy",
    "token_logprobs",
    "value_loss",
]

_EXPORTS = {
    "ALGORITHMS": "losses",
    "ArithmeticTask": "tasks",
    "DPOObjective": "dpo",
    "DistillObjective": "distill",
    "GRPOObjective": "rl",
    "PPOObjective": "ppo",
    "PipelineObjective": "pipeline",
    "RewardModelObjective": "dpo",
    "SFTObjective": "sft",
    "aggregate": "losses",
    "bradley_terry_loss": "losses",
    "chat_example": "chat",
    "collate": "core",
    "distill_token_loss": "losses",
    "dpo_loss": "losses",
    "gae": "losses",
    "group_advantages": "losses",
    "k3_kl": "losses",
    "masked_mean": "core",
    "masked_sum_normalize": "core",
    "pack": "packing",
    "policy_token_loss": "losses",
    "prompt_response_example": "core",
    "render_chat": "chat",
    "rollout_engine": "rollout",
    "sequence_logprobs": "core",
    "simpo_loss": "losses",
    "token_entropy": "core",
    "token_logprobs": "core",
    "value_loss": "losses",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
