"""Post-training: SFT, DPO and variants, reward models and PPO, the GRPO family with verifiable
rewards, Pipeline RL with in-flight weight updates, and distillation — each an objective of the
one :class:`lmforge.train.Trainer`, rollouts on :class:`lmforge.serve.Engine`. The public API
(everything else is internal); commands ``lmforge sft | dpo | rl | distill``.
"""

from __future__ import annotations

from lmforge.utils.lazy import lazy_exports

# fmt: off
_MODULES = {
    "core": ("collate", "masked_mean", "masked_sum_normalize", "prompt_response_example",
             "sequence_logprobs", "token_entropy", "token_logprobs"),
    "losses": ("ALGORITHMS", "aggregate", "bradley_terry_loss", "distill_token_loss", "dpo_loss",
               "gae", "group_advantages", "k3_kl", "policy_token_loss", "simpo_loss",
               "value_loss"),
    "sft": ("SFTObjective",), "dpo": ("DPOObjective", "RewardModelObjective"),
    "distill": ("DistillObjective",), "rl": ("GRPOObjective",), "ppo": ("PPOObjective",),
    "pipeline": ("PipelineObjective",), "tasks": ("ArithmeticTask",),
    "chat": ("chat_example", "render_chat"), "packing": ("pack",),
    "rollout": ("rollout_engine",),
}
# fmt: on
"the public names, by the submodule that defines them"
_EXPORTS = {name: mod for mod, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
