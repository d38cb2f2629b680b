"""``lmforge sft``, ``lmforge dpo``, ``lmforge rl``, ``lmforge distill``: registered here, run in
:mod:`lmforge.posttrain.commands` (so torch is imported only when a command runs).

Config files: ``--config FILE`` reads a TOML file holding one table named after the command
(``[sft]``, ``[dpo]``, ``[rl]``, ``[distill]``) whose keys are the command's long options with
``_`` for ``-`` (``batch_size = 16``, ``no_packing = true``). Precedence: a flag given on the
command line, then the file, then the built-in default. Unknown keys, other tables and values of
the wrong type (or outside an option's choices) are one-line errors naming the file and key.
The resolved options are written to ``config.toml`` in the run's output folder, so
``--config OUT/config.toml`` repeats a run. Files for the README examples: ``configs/posttrain/``.
Exercised by ``pytest tests/test_posttrain_config.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

SFT_EXAMPLES = """examples:
  lmforge sft --model ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --data chats.jsonl --out runs/sft
  lmforge sft --model runs/demo/ckpt --data pairs.jsonl --steps 200 --lr 1e-4 --no-packing
  lmforge sft --config configs/posttrain/sft-smollm2.toml --data chats.jsonl   # flags override the file

Data: JSONL with {"messages": [{"role": "user"|"assistant"|"system", "content": ...}, ...]}
(rendered with the model's chat template, else ChatML) or {"prompt": ..., "response": ...}.
Loss on assistant tokens only; examples are packed per row without attention between them.
Outputs in --out: model/, metrics.jsonl, summary.json.
"""

DPO_EXAMPLES = """examples:
  lmforge dpo --model runs/sft/model --data ../shared/data/preference/harmless-base_test.jsonl.gz --out runs/dpo
  lmforge dpo --model runs/sft/model --data prefs.jsonl --loss simpo --beta 2.0 --lr 1e-6
  lmforge dpo --model runs/sft/model --data prefs.jsonl --reward-model --out runs/rm   # Bradley-Terry RM
  lmforge dpo --config configs/posttrain/dpo-hh-smollm2.toml                  # the RESULTS run

Data: JSONL(.gz) with {"prompt", "chosen", "rejected"} or HH-RLHF {"chosen", "rejected"} dialogues.
The last --eval-fraction of the pairs is held out: the implicit reward's preference accuracy on
it is reported before and after. Outputs in --out: model/, metrics.jsonl, summary.json.
"""

RL_EXAMPLES = """examples:
  lmforge rl --task arithmetic                       # warm start a tiny model, then GRPO (CPU, minutes)
  lmforge rl --task arithmetic --algo dapo --out runs/rl-dapo
  lmforge rl --task arithmetic --pipeline --max-lag 4  # Pipeline RL: engine and trainer processes
  lmforge rl --task scratchpad --pipeline --lr 1e-4 --target 0.95   # worked answers: generation ~35%
  lmforge rl --task gsm8k --model runs/sft/model --algo dr_grpo --max-tokens 256
  lmforge rl --task gsm8k --pipeline --model SmolLM2.gguf --data train.jsonl --lr 2e-6 --micro-batch 16
  lmforge rl --config configs/posttrain/rl-arithmetic.toml --algo gspo   # a config file, one flag overridden

Algorithms: reinforce, reinforce_baseline, rloo, grpo, dr_grpo, dapo, gspo, maxrl, ppo
(each a combination of baseline/normalizer, importance reweighting and aggregation).
--pipeline runs any task on any lmforge model (checkpoint, GGUF or HF import; not PPO): the
engine process rebuilds the model and draws the same prompts a synchronous run of the seed would.
Outputs in --out: metrics.jsonl, curve.png, summary.json, model/, config.toml (the resolved
options: --config OUT/config.toml repeats the run; every command writes one).
"""

DISTILL_EXAMPLES = """examples:
  lmforge distill --teacher runs/big/model --student runs/small/model --data corpus.jsonl --out runs/kd
  lmforge distill --teacher runs/big/model --student runs/small/model --data prompts.jsonl --on-policy --loss reverse

Data: JSONL with {"text"} (or SFT records); on-policy uses their prompts and samples the student.
Teacher and student must share the vocabulary. Outputs in --out: model/, metrics.jsonl.
"""


class IntAtLeast:
    """An argparse ``type``: an integer ≥ ``low``. A bad value is argparse's usage error naming
    the flag; a config file's value is checked against it too (:func:`_check_value`), so neither
    reaches the command as a zero divisor or an empty micro-batch."""

    def __init__(self, low: int) -> None:
        self.low = low
        self.__name__ = f"integer >= {low}"  # argparse and _type_label name the type with it

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < self.low:
            raise argparse.ArgumentTypeError(f"must be >= {self.low}, got {value}")
        return value


POSITIVE_INT, NONNEGATIVE_INT = IntAtLeast(1), IntAtLeast(0)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML file with a table named after the command holding these options (keys: the "
        "long flags with _ for -); flags given here override it",
    )
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
    _defer_defaults(p, "sft")
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
    _defer_defaults(p, "dpo")
    p.set_defaults(func=_dispatch("dpo"))

    p = sub.add_parser("rl", help="RL with verifiable rewards: GRPO family, PPO, Pipeline RL",
                       description="Reinforcement learning with verifiable rewards.",
                       epilog=RL_EXAMPLES, formatter_class=raw)  # fmt: skip
    p.add_argument(
        "--task",
        default="arithmetic",
        choices=["arithmetic", "scratchpad", "gsm8k", "math"],
        help="scratchpad: the arithmetic task with worked column-by-column answers (~30 tokens)",
    )
    p.add_argument("--algo", default="grpo")
    p.add_argument(
        "--model", default=None, help="policy to start from (arithmetic: warm-started here)"
    )
    p.add_argument("--data", default=None, help="gsm8k/math: JSONL of problems (default ../shared)")
    p.add_argument(
        "--eval-data",
        default=None,
        help="gsm8k/math: JSONL of held-out problems (default: the test split in ../shared)",
    )
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--prompts-per-step", type=POSITIVE_INT, default=32)
    p.add_argument("--group-size", type=POSITIVE_INT, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=1, help="optimizer passes per rollout batch")
    p.add_argument(
        "--micro-batch",
        type=POSITIVE_INT,
        default=64,
        help="sequences per forward/backward of a train step (GRPO family; lower it for "
        "long replies on a large vocabulary: the logits are sequences × tokens × vocab)",
    )
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the initial policy")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--digits", type=int, default=3, help="arithmetic: operand digits")
    p.add_argument("--warmup-steps", type=int, default=1000, help="arithmetic: warm-start steps")
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--eval-every", type=POSITIVE_INT, default=5)
    p.add_argument("--target", type=float, default=None, help="stop at this held-out accuracy")
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="Pipeline RL: engine + trainer processes (any task; an lmforge model)",
    )
    p.add_argument("--max-lag", type=int, default=4, help="pipeline: drop samples older than this")
    p.add_argument(
        "--queue-size",
        type=NONNEGATIVE_INT,
        default=0,
        help="pipeline: finished batches the engine may hold unconsumed (0: token lag <= 1)",
    )
    p.add_argument(
        "--engine-threads", type=int, default=None, help="pipeline: torch threads of the engine"
    )
    p.add_argument(
        "--weight-transport",
        choices=["broadcast", "shared"],
        default="broadcast",
        help="pipeline: how new weights reach the engine process: a bucketed broadcast (gloo/"
        "NCCL), or buffers both processes map (CUDA IPC / shared memory; one device only)",
    )
    p.add_argument(
        "--rollout-engine",
        choices=["auto", "local", "serve"],
        default="auto",
        help="what samples rollouts: local (lockstep), serve (the batched serve engine, CUDA "
        "graphs on a GPU), auto (local for the arithmetic tasks, serve for the others)",
    )
    _common(p)
    _defer_defaults(p, "rl")
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
    _defer_defaults(p, "distill")
    p.set_defaults(func=_dispatch("distill"))


# ---------------------------------------------------------------------------------------------
# Config files


_SKIP = ("help", "config")


def option_spec(p: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    """The options of a command's parser: dest → {flag, default, type, choices, required}.

    ``type`` is ``bool`` for switches, else the argument's type (``str`` when none is given).
    """
    spec: dict[str, dict[str, Any]] = {}
    for a in p._actions:
        if a.dest in _SKIP or not a.option_strings:
            continue
        switch = isinstance(a, argparse._StoreTrueAction)
        spec[a.dest] = {
            "flag": max(a.option_strings, key=len),
            "default": False if switch else a.default,
            "type": bool if switch else (a.type or str),
            "choices": a.choices,
            "required": a.required,
        }
    return spec


def _defer_defaults(p: argparse.ArgumentParser, command: str) -> None:
    """Make argparse record only the flags actually given, so a config file can sit between
    them and the defaults (resolved by :func:`resolve_options` when the command runs)."""
    spec = option_spec(p)
    for a in p._actions:
        if a.dest in spec:
            shown = a.default is not None and a.default is not False
            shown = shown and "default" not in (a.help or "")
            if shown:  # argparse no longer knows the default: say it in the help
                a.help = f"{a.help} (default {a.default})" if a.help else f"default {a.default}"
            if a.required:
                a.help = f"{a.help or ''} (required: flag or config key)".strip()
            a.default = argparse.SUPPRESS
            a.required = False
    p.set_defaults(posttrain_command=command, posttrain_spec=spec)


def _type_label(tp: Any) -> str:
    if isinstance(tp, IntAtLeast):
        return f"an {tp.__name__}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _check_value(where: str, key: str, value: Any, opt: dict[str, Any]) -> Any:
    tp = opt["type"]
    whole = isinstance(value, int) and not isinstance(value, bool)
    ok = (
        (tp is bool and isinstance(value, bool))
        or (tp is int and whole)
        or (isinstance(tp, IntAtLeast) and whole and value >= tp.low)
        or (tp is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (tp is str and isinstance(value, str))
    )
    if not ok:
        from lmforge.utils.errors import LmforgeError

        raise LmforgeError(
            f"{where}: key '{key}' must be {_type_label(tp)}, got {type(value).__name__} {value!r}"
        )
    if tp is float:
        value = float(value)
    if opt["choices"] is not None and value not in opt["choices"]:
        from lmforge.utils.errors import LmforgeError

        raise LmforgeError(
            f"{where}: key '{key}' is {value!r}, expected one of {', '.join(map(str, opt['choices']))}"
        )
    return value


def read_config(path: str | Path, command: str, spec: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The checked ``[command]`` table of a TOML config file (see the module docstring)."""
    from lmforge.utils.config import read_toml
    from lmforge.utils.errors import LmforgeError

    p = Path(path)
    data = read_toml(p)
    for key, value in data.items():
        if key != command:
            what = f"table [{key}]" if isinstance(value, dict) else f"top-level key '{key}'"
            raise LmforgeError(
                f"{p}: {what} does not belong to `lmforge {command}` "
                f"(put its options under [{command}])"
            )
    table = data.get(command)
    if not isinstance(table, dict):
        raise LmforgeError(f"{p}: no [{command}] table")
    where = f"{p} [{command}]"
    out = {}
    for key, value in table.items():
        opt = spec.get(key)
        if opt is None:
            hint = f" (did you mean '{key.replace('-', '_')}'?)" if "-" in key else ""
            raise LmforgeError(
                f"{where}: unknown key '{key}'{hint}; known keys: {', '.join(sorted(spec))}"
            )
        out[key] = _check_value(where, key, value, opt)
    return out


def resolve_options(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every option filled: flags given, then ``--config``'s table, then defaults.

    Also sets ``args.posttrain_options`` (the resolved options, saved beside the outputs).
    A required option given neither way is a one-line error.
    """
    from lmforge.utils.errors import LmforgeError

    command, spec = args.posttrain_command, args.posttrain_spec
    given = {k: v for k, v in vars(args).items() if k in spec}
    config = getattr(args, "config", None)
    from_file = read_config(config, command, spec) if config else {}
    resolved = {k: opt["default"] for k, opt in spec.items()} | from_file | given
    for k, opt in spec.items():
        if opt["required"] and resolved[k] is None:
            raise LmforgeError(
                f"`lmforge {command}` needs {opt['flag']} (or '{k}' in the --config file)"
            )
    for k, v in resolved.items():
        setattr(args, k, v)
    args.posttrain_options = resolved
    return args


def _dispatch(name: str):
    def run(args: argparse.Namespace) -> int:
        from lmforge.posttrain import commands

        return getattr(commands, f"run_{name}")(resolve_options(args))

    return run
