"""``lmforge sft``, ``lmforge dpo``, ``lmforge rl``, ``lmforge distill``: registered here, run in
:mod:`lmforge.posttrain.commands` (so torch is imported only when a command runs)."""

from __future__ import annotations

import argparse

SFT_EXAMPLES = """examples:
  lmforge sft --model ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --data chats.jsonl --out runs/sft
  lmforge sft --model runs/demo/ckpt --data pairs.jsonl --steps 200 --lr 1e-4 --no-packing

Data: JSONL with {"messages": [{"role": "user"|"assistant"|"system", "content": ...}, ...]}
(rendered with the model's chat template, else ChatML) or {"prompt": ..., "response": ...}.
Loss on assistant tokens only; examples are packed per row without attention between them.
Outputs in --out: model/, metrics.jsonl, summary.json.
"""

DPO_EXAMPLES = """examples:
  lmforge dpo --model runs/sft/model --data ../shared/data/preference/harmless-base_test.jsonl.gz --out runs/dpo
  lmforge dpo --model runs/sft/model --data prefs.jsonl --loss simpo --beta 2.0 --lr 1e-6
  lmforge dpo --model runs/sft/model --data prefs.jsonl --reward-model --out runs/rm   # Bradley-Terry RM

Data: JSONL(.gz) with {"prompt", "chosen", "rejected"} or HH-RLHF {"chosen", "rejected"} dialogues.
The last --eval-fraction of the pairs is held out: the implicit reward's preference accuracy on
it is reported before and after. Outputs in --out: model/, metrics.jsonl, summary.json.
"""

RL_EXAMPLES = """examples:
  lmforge rl --task arithmetic                       # warm start a tiny model, then GRPO (CPU, minutes)
  lmforge rl --task arithmetic --algo dapo --out runs/rl-dapo
  lmforge rl --task arithmetic --pipeline --max-lag 4  # Pipeline RL: engine and trainer processes
  lmforge rl --task gsm8k --model runs/sft/model --algo dr_grpo --max-tokens 256

Algorithms: reinforce, reinforce_baseline, rloo, grpo, dr_grpo, dapo, gspo, maxrl, ppo
(each a combination of baseline/normalizer, importance reweighting and aggregation).
Outputs in --out: metrics.jsonl, curve.png, summary.json, model/.
"""

DISTILL_EXAMPLES = """examples:
  lmforge distill --teacher runs/big/model --student runs/small/model --data corpus.jsonl --out runs/kd
  lmforge distill --teacher runs/big/model --student runs/small/model --data prompts.jsonl --on-policy --loss reverse

Data: JSONL with {"text"} (or SFT records); on-policy uses their prompts and samples the student.
Teacher and student must share the vocabulary. Outputs in --out: model/, metrics.jsonl.
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="output folder (default runs/<command>)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's; rl: 1, tiny models gain nothing)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``sft``, ``dpo``, ``rl`` and ``distill`` subcommands."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("sft", help="supervised fine-tuning on conversations (packed)",
                       description="Supervised fine-tuning, loss on assistant tokens only.",
                       epilog=SFT_EXAMPLES, formatter_class=raw)  # fmt: skip
    p.add_argument("--model", required=True, help="lmforge checkpoint, .gguf file or HF folder")
    p.add_argument("--data", required=True, help="JSONL of conversations or prompt/response pairs")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--no-packing", action="store_true", help="pad each example instead")
    p.add_argument("--no-chat", action="store_true", help="prompt/response pairs without template")
    _common(p)
    p.set_defaults(func=_dispatch("sft"))

    p = sub.add_parser("dpo", help="preference optimisation: DPO, IPO, cDPO, SimPO; reward models",
                       description="Direct preference optimisation and variants; or train a "
                       "Bradley-Terry reward model (--reward-model).",
                       epilog=DPO_EXAMPLES, formatter_class=raw)  # fmt: skip
    p.add_argument("--model", required=True, help="lmforge checkpoint, .gguf file or HF folder")
    p.add_argument("--data", required=True, help="JSONL(.gz) preference pairs")
    p.add_argument("--loss", default="dpo", choices=["dpo", "ipo", "cdpo", "simpo"])
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.1, help="cDPO's ε")
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--limit", type=int, default=None, help="use only the first N pairs")
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--reward-model", action="store_true", help="train a Bradley-Terry reward model")
    _common(p)
    p.set_defaults(func=_dispatch("dpo"))

    p = sub.add_parser("rl", help="RL with verifiable rewards: GRPO family, PPO, Pipeline RL",
                       description="Reinforcement learning with verifiable rewards.",
                       epilog=RL_EXAMPLES, formatter_class=raw)  # fmt: skip
    p.add_argument("--task", default="arithmetic", choices=["arithmetic", "gsm8k", "math"])
    p.add_argument("--algo", default="grpo")
    p.add_argument(
        "--model", default=None, help="policy to start from (arithmetic: warm-started here)"
    )
    p.add_argument("--data", default=None, help="gsm8k/math: JSONL of problems (default ../shared)")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=1, help="optimizer passes per rollout batch")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the initial policy")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--digits", type=int, default=3, help="arithmetic: operand digits")
    p.add_argument("--warmup-steps", type=int, default=1000, help="arithmetic: warm-start steps")
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--target", type=float, default=None, help="stop at this held-out accuracy")
    p.add_argument(
        "--pipeline", action="store_true", help="Pipeline RL: engine + trainer processes"
    )
    p.add_argument("--max-lag", type=int, default=4, help="pipeline: drop samples older than this")
    _common(p)
    p.set_defaults(func=_dispatch("rl"))

    p = sub.add_parser("distill", help="distil a teacher into a student (KL, JSD; on-policy)",
                       description="Logit distillation on a corpus or on-policy.",
                       epilog=DISTILL_EXAMPLES, formatter_class=raw)  # fmt: skip
    p.add_argument("--teacher", required=True)
    p.add_argument("--student", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--loss", default="forward", choices=["forward", "reverse", "jsd"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=0.5, help="JSD mixture weight")
    p.add_argument("--on-policy", action="store_true")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    _common(p)
    p.set_defaults(func=_dispatch("distill"))


def _dispatch(name: str):
    def run(args: argparse.Namespace) -> int:
        from lmforge.posttrain import commands

        return getattr(commands, f"run_{name}")(args)

    return run
