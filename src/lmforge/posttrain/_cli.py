"""``lmforge sft``, ``lmforge dpo``, ``lmforge rl``, ``lmforge distill``: registered here, run in
:mod:`lmforge.posttrain.commands` (so torch is imported only when a command runs).

Every command reads the one run-config tree (:class:`lmforge.config.RunConfig`): its own branch
(``[sft]``, ``[dpo]``, ``[rl]``, ``[distill]``) and the Trainer's ``[train]``. Precedence, low
to high: the tree's defaults, :data:`COMMAND_DEFAULTS`, ``--config FILE``, dotted overrides
(``--dpo.reference=online``), the command's short flags (``--lr`` is ``train.lr``; each flag's
help names its key). The resolved tree is written to ``OUT/config.toml``, so
``--config OUT/config.toml`` repeats a run. Presets: ``configs/posttrain/``.
Exercised by ``pytest tests/test_posttrain_config.py``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmforge.config import RunConfig

SFT_EXAMPLES = """examples:
  lmforge sft --model ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --data chats.jsonl --out runs/sft
  lmforge sft --model runs/demo/ckpt --data pairs.jsonl --steps 200 --lr 1e-4 --no-packing
  lmforge sft --config configs/posttrain/sft-smollm2.toml --sft.data=chats.jsonl --train.schedule=cosine

Data: JSONL with {"messages": [{"role": "user"|"assistant"|"system", "content": ...}, ...]}
(rendered with the model's chat template, else ChatML) or {"prompt": ..., "response": ...}.
Loss on assistant tokens only; examples are packed per row without attention between them.
Outputs in --out: model/, metrics.jsonl, summary.json, config.toml, checkpoints/ (a rerun of the
same command resumes from the latest one, e.g. after a kill).
"""

DPO_EXAMPLES = """examples:
  lmforge dpo --model runs/sft/model --data ../shared/data/preference/harmless-base_test.jsonl.gz --out runs/dpo
  lmforge dpo --model runs/sft/model --data prefs.jsonl --loss simpo --beta 2.0 --lr 1e-6
  lmforge dpo --model runs/sft/model --data prefs.jsonl --reward-model --out runs/rm   # Bradley-Terry RM
  lmforge dpo --config configs/posttrain/dpo-hh-smollm2.toml                  # the RESULTS run

Data: JSONL(.gz) with {"prompt", "chosen", "rejected"} or HH-RLHF {"chosen", "rejected"} dialogues.
The last --eval-fraction of the pairs is held out: the implicit reward's preference accuracy on
it is reported before and after. Outputs in --out: model/, metrics.jsonl, summary.json,
config.toml, checkpoints/ (a rerun resumes).
"""

RL_EXAMPLES = """examples:
  lmforge rl --task arithmetic                       # warm start a tiny model, then GRPO (CPU, minutes)
  lmforge rl --task arithmetic --algo dapo --out runs/rl-dapo
  lmforge rl --task arithmetic --pipeline --max-lag 4  # Pipeline RL: engine and trainer processes
  lmforge rl --task gsm8k --model runs/sft/model --algo dr_grpo --max-tokens 256
  lmforge rl --config configs/posttrain/rl-arithmetic.toml --algo gspo --rl.std=population

Algorithms: reinforce, reinforce_baseline, rloo, grpo, dr_grpo, dapo, gspo, maxrl, ppo
(each a combination of baseline/normalizer, importance reweighting and aggregation). Rollouts
are sampled by the serving engine (lmforge.serve.Engine), which shares the trained weights.
Outputs in --out: metrics.jsonl, curve.png, summary.json, model/, config.toml, checkpoints/
(a rerun resumes, prompts, sampling seeds and rollouts included; --pipeline resumes the learner,
its versions and the prompt stream exactly, and samples the batches lost in flight again).
"""

DISTILL_EXAMPLES = """examples:
  lmforge distill --teacher runs/big/model --student runs/small/model --data corpus.jsonl --out runs/kd
  lmforge distill --teacher runs/big/model --student runs/small/model --data prompts.jsonl --on-policy --loss reverse

Data: JSONL with {"text"} (or SFT records); on-policy uses their prompts and samples the student.
Teacher and student must share the vocabulary. Outputs in --out: model/, metrics.jsonl.
"""

_POST = {"device": "cpu", "precision": "fp32", "weight_decay": 0.0, "min_lr": 0.0,
         "schedule": "constant", "warmup_steps": 0, "grad_accum": 1, "log_every": 1,
         "eval_every": 0, "plot": False}  # fmt: skip
COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {
    "sft": {"train": {**_POST, "out_dir": "runs/sft", "lr": 2e-5, "beta2": 0.999,
                      "warmup_steps": 10, "max_steps": 100, "batch_size": 4, "grad_accum": 4,
                      "save_every": 50}},
    "dpo": {"train": {**_POST, "out_dir": "runs/dpo", "lr": 5e-6, "beta2": 0.999,
                      "batch_size": 8, "save_every": 50}},
    "rl": {"train": {**_POST, "out_dir": "runs/rl", "lr": 1e-3, "beta2": 0.99,
                     "batch_size": 64, "eval_every": 5, "save_every": 10}},
    "distill": {"train": {**_POST, "out_dir": "runs/distill", "lr": 1e-4, "beta2": 0.999,
                          "batch_size": 8, "max_steps": 100, "save_every": 50}},
}  # fmt: skip
"""The ``[train]`` values each command starts from, under the config file, overrides and flags:
small learning rates without weight decay, fp32 on the CPU; β2 0.999 (torch's default) for
SFT/DPO/distillation, 0.99 for RL."""


def _flag(p: argparse.ArgumentParser, flag: str, key: str, help: str = "", **kw: Any) -> None:
    # recorded only when given (SUPPRESS): file and overrides sit between it and the defaults
    kw.setdefault("default", argparse.SUPPRESS)
    if "choices" not in kw:
        kw.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
    text = f"{help} [{key}]" if help else f"[{key}]"
    p.add_argument(flag, dest=f"cfg:{key}", help=text, **kw)


def _switch(p: argparse.ArgumentParser, flag: str, key: str, value: bool, help: str) -> None:
    p.add_argument(flag, dest=f"cfg:{key}", action="store_const", const=value,
                   default=argparse.SUPPRESS, help=f"{help} [{key}={str(value).lower()}]")  # fmt: skip


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML run config ([train] and the command's table, e.g. configs/posttrain/); "
        "dotted overrides (--train.lr=1e-5) and the flags here override it",
    )
    _flag(p, "--out", "train.out_dir", "output folder (a rerun resumes from its checkpoints)")
    _flag(p, "--device", "train.device", "cpu, cuda, cuda:N or auto")
    _flag(p, "--seed", "train.seed", type=int)
    _flag(p, "--lr", "train.lr", "peak AdamW learning rate", type=float)
    _switch(p, "--quiet", "train.progress", False, "no progress bars")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's; rl on a toy task: 1, tiny models gain nothing)",
    )
    p.set_defaults(accepts_overrides=True)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``sft``, ``dpo``, ``rl`` and ``distill`` subcommands."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("sft", help="supervised fine-tuning on conversations (packed)",
                       description="Supervised fine-tuning, loss on assistant tokens only.",
                       epilog=SFT_EXAMPLES, formatter_class=raw)  # fmt: skip
    _flag(p, "--model", "sft.model", "lmforge checkpoint, .gguf file or HF folder")
    _flag(p, "--data", "sft.data", "JSONL of conversations or prompt/response pairs")
    _flag(p, "--steps", "train.max_steps", "optimizer steps", type=int)
    p.add_argument("--batch-size", type=int, default=None,
                   help="examples per optimizer step (sets train.grad_accum = this / "
                   "train.batch_size, rounded up)")  # fmt: skip
    _flag(p, "--micro-batch", "train.batch_size", "examples per forward/backward", type=int)
    _flag(p, "--max-len", "sft.max_len", "longest (packed) sequence", type=int)
    _switch(p, "--no-packing", "sft.packing", False, "pad each example instead")
    _switch(p, "--no-chat", "sft.chat", False, "prompt/response pairs without template")
    _common(p)
    p.set_defaults(func=_dispatch("sft"))

    p = sub.add_parser("dpo", help="preference optimisation: DPO, IPO, cDPO, SimPO; reward models",
                       description="Direct preference optimisation and variants; or train a "
                       "Bradley-Terry reward model (--reward-model).",
                       epilog=DPO_EXAMPLES, formatter_class=raw)  # fmt: skip
    _flag(p, "--model", "dpo.model", "lmforge checkpoint, .gguf file or HF folder")
    _flag(p, "--data", "dpo.data", "JSONL(.gz) preference pairs")
    _flag(p, "--loss", "dpo.loss", choices=["dpo", "ipo", "cdpo", "simpo"])
    _flag(p, "--beta", "dpo.beta", type=float)
    _flag(p, "--label-smoothing", "dpo.label_smoothing", "cDPO's ε", type=float)
    _flag(p, "--epochs", "dpo.epochs", type=int)
    _flag(p, "--batch-size", "train.batch_size", "pairs per micro-batch", type=int)
    _flag(p, "--max-len", "dpo.max_len", type=int)
    _flag(p, "--limit", "dpo.limit", "use only the first N pairs (0 = all)", type=int)
    _flag(p, "--eval-fraction", "dpo.eval_fraction", type=float)
    _switch(p, "--reward-model", "dpo.reward_model", True, "train a Bradley-Terry reward model")
    _common(p)
    p.set_defaults(func=_dispatch("dpo"))

    p = sub.add_parser("rl", help="RL with verifiable rewards: GRPO family, PPO, Pipeline RL",
                       description="Reinforcement learning with verifiable rewards.",
                       epilog=RL_EXAMPLES, formatter_class=raw)  # fmt: skip
    _flag(p, "--task", "rl.task", choices=["arithmetic", "scratchpad", "gsm8k", "math"])
    _flag(p, "--algo", "rl.algo")
    _flag(p, "--model", "rl.model", "policy to start from (arithmetic: warm-started here)")
    _flag(p, "--data", "rl.data", "gsm8k/math: JSONL of problems")
    _flag(p, "--eval-data", "rl.eval_data", "gsm8k/math: JSONL of held-out problems")
    _flag(p, "--iterations", "rl.iterations", "rollout batches", type=int)
    _flag(p, "--prompts-per-step", "rl.prompts_per_step", type=int)
    _flag(p, "--group-size", "rl.group_size", type=int)
    _flag(p, "--epochs", "rl.epochs", "optimizer steps per rollout batch", type=int)
    _flag(p, "--micro-batch", "train.batch_size", "sequences per forward/backward", type=int)
    _flag(p, "--kl-coef", "rl.kl_coef", "k3 KL to the initial policy", type=float)
    _flag(p, "--max-tokens", "rl.max_tokens", type=int)
    _flag(p, "--temperature", "rl.temperature", type=float)
    _flag(p, "--digits", "rl.digits", "arithmetic: operand digits", type=int)
    _flag(p, "--warmup-steps", "rl.warmup_steps", "arithmetic: warm-start steps", type=int)
    _flag(p, "--eval-size", "rl.eval_size", type=int)
    _flag(p, "--eval-every", "train.eval_every", "evaluate every N steps", type=int)
    _flag(p, "--target", "rl.target", "stop at this held-out accuracy", type=float)
    _switch(p, "--pipeline", "rl.pipeline", True, "Pipeline RL: engine + trainer processes")
    _flag(p, "--max-lag", "rl.max_lag", "pipeline: drop samples older than this", type=int)
    _flag(p, "--queue-size", "rl.queue_size", "pipeline: batches held unconsumed", type=int)
    _flag(p, "--engine-threads", "rl.engine_threads", "pipeline: engine threads", type=int)
    _flag(p, "--weight-transport", "rl.weight_transport", choices=["broadcast", "shared"])
    _common(p)
    p.set_defaults(func=_dispatch("rl"))

    p = sub.add_parser("distill", help="distil a teacher into a student (KL, JSD; on-policy)",
                       description="Logit distillation on a corpus or on-policy.",
                       epilog=DISTILL_EXAMPLES, formatter_class=raw)  # fmt: skip
    _flag(p, "--teacher", "distill.teacher")
    _flag(p, "--student", "distill.student")
    _flag(p, "--data", "distill.data")
    _flag(p, "--loss", "distill.loss", choices=["forward", "reverse", "jsd"])
    _flag(p, "--temperature", "distill.temperature", type=float)
    _flag(p, "--beta", "distill.beta", "JSD mixture weight", type=float)
    _switch(p, "--on-policy", "distill.on_policy", True, "sample the student")
    _flag(p, "--steps", "train.max_steps", type=int)
    _flag(p, "--batch-size", "train.batch_size", type=int)
    _flag(p, "--max-len", "distill.max_len", type=int)
    _flag(p, "--max-tokens", "distill.max_tokens", type=int)
    _common(p)
    p.set_defaults(func=_dispatch("distill"))


_REQUIRED = {"sft": ("sft.model", "sft.data"), "dpo": ("dpo.model", "dpo.data"),
             "distill": ("distill.teacher", "distill.student", "distill.data")}  # fmt: skip


def resolve_config(
    command: str,
    config: str | None = None,
    overrides: Sequence[str] = (),
    flags: dict[str, Any] | None = None,
    examples_per_step: int | None = None,
) -> RunConfig:
    """The run config of ``lmforge COMMAND``: defaults < command defaults < file < dotted
    overrides < flags (``{"train.lr": 1e-5}``); every value checked, required keys present.
    ``examples_per_step`` (sft's ``--batch-size``) sets ``train.grad_accum``."""
    from lmforge.config import RunConfig
    from lmforge.utils.config import load_config
    from lmforge.utils.errors import LmforgeError

    top: dict[str, Any] = {}
    for key, value in (flags or {}).items():  # {"train.lr": 1e-5} -> {"train": {"lr": 1e-5}}
        node = top
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    cfg = load_config(RunConfig, config, overrides, base=COMMAND_DEFAULTS[command], top=top)
    if examples_per_step is not None:
        if examples_per_step < 1:
            raise LmforgeError(f"--batch-size must be at least 1, got {examples_per_step}")
        accum = math.ceil(examples_per_step / cfg.train.batch_size)
        top.setdefault("train", {})["grad_accum"] = accum
        cfg = load_config(RunConfig, config, overrides, base=COMMAND_DEFAULTS[command], top=top)
    for key in _REQUIRED.get(command, ()):
        branch, name = key.split(".")
        if not getattr(getattr(cfg, branch), name):
            flag = "--" + name.replace("_", "-")
            raise LmforgeError(f"`lmforge {command}` needs {flag} (or {key} in the config)")
    return cfg


def _dispatch(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from lmforge.posttrain import commands

        flags = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:")}
        cfg = resolve_config(name, args.config, getattr(args, "overrides", ()), flags,
                             getattr(args, "batch_size", None) if name == "sft" else None)  # fmt: skip
        return getattr(commands, f"run_{name}")(cfg, threads=args.threads)

    return run
