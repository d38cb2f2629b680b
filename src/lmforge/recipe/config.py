"""The recipe's config tree: one frozen dataclass per stage, loaded from a TOML file in
``configs/recipes/`` plus dotted overrides (``--pretrain.steps=200``).

Each stage sees only its own branch; the branch (with the recipe-wide keys it uses) is what its
completion marker hashes, so changing a key re-runs that stage and the ones after it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from lmforge.utils.config import ConfigError, load_config, read_toml

STAGES: tuple[str, ...] = ("data", "tokenizer", "pretrain", "sft", "rl", "eval", "report")
"the recipe's stages, in order; --from/--until take these names"


@dataclasses.dataclass(frozen=True)
class RecipeSection:
    """Recipe-wide settings."""

    out: str = "runs/recipe"
    "folder of every stage's outputs and of report.md"
    device: str = "cpu"
    "cpu, cuda or cuda:N: where training, RL and evaluation run"
    seed: int = 0
    "seed passed to every stage"
    threads: int = 0
    "CPU threads per stage (0: chosen from the cores this process may use and the load)"
    launcher: str = "subprocess"
    "'subprocess' (each command in a fresh `python -m lmforge`) or 'inprocess' (lmforge.cli.main)"


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Web pipelines → dedup → mixture with books and code → train/validation text."""

    pipelines: tuple[str, ...] = ("configs/pipelines/web.toml", "configs/pipelines/quality.toml")
    "`lmforge data run` pipeline files (extraction, language ID, quality filters, PII)"
    extra_web: tuple[str, ...] = ("examples/web/cc_en_head-0174.jsonl",)
    "JSONL web documents deduplicated together with the pipelines' outputs"
    contamination: tuple[str, ...] = ("examples/eval/gsm8k", "examples/eval/mmlu")
    "eval sets whose 13-gram overlaps are removed from the web text"
    books: tuple[str, ...] = ("examples/text",)
    "plain-text book/article sources of the mixture"
    code_mb: float = 12.0
    "MB of the embedded default corpus (the Python standard library's sources) in the mixture"
    files: tuple[str, ...] = ()
    "text files/folders/globs taking the standard library's place as the code source"
    shared: tuple[str, ...] = ()
    "extra sources as NAME=PATH[:WEIGHT[:MAX_EPOCHS]] (e.g. a shared corpus folder)"
    web_weight: float = 3.0
    "mixture weight of the deduplicated web text"
    books_weight: float = 2.0
    "mixture weight of the books"
    code_weight: float = 5.0
    "mixture weight of the code"
    max_epochs: float = 4.0
    "most times a source is repeated in the mixture (UniMax cap)"
    tokens: float = 1.5e7
    "mixture size in bytes (`lmforge data mix --tokenizer bytes`)"
    val_every: int = 50
    "one mixture document in this many goes to validation"
    tokens_train: str = ""
    "use this token shard for pretraining instead of the mixture (e.g. a shared corpus's)"
    tokens_val: str = ""
    "validation shard paired with tokens_train"
    tokenizer_dir: str = ""
    "the tokenizer of tokens_train/tokens_val (the tokenizer stage then copies it)"


@dataclasses.dataclass(frozen=True)
class TokenizerSection:
    """`lmforge tokenizer train` on the mixture, then `tokenizer encode` of both splits."""

    vocab_size: int = 4096
    "256 bytes + merges + special tokens"
    train_mb: float = 6.0
    "MB of training text the merges are learned on"
    special_tokens: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>")
    "special tokens: end of text (also the end of a chat turn) and the chat turn header"
    workers: int = 1
    "pre-tokenization and encoding processes"


@dataclasses.dataclass(frozen=True)
class PretrainSection:
    """`lmforge train` from a model config on the tokenizer stage's shards."""

    config: str = "configs/demo.toml"
    "model config (its [model] table; vocab_size is set from the tokenizer)"
    steps: int = 1000
    "optimizer steps (a step budget: the same model on any machine)"
    batch_size: int = 16
    "sequences per step"
    lr: float = 2e-3
    "peak learning rate (cosine to a tenth)"
    eval_every: int = 250
    "validate every N steps"
    eval_batches: int = 20
    "validation batches per evaluation"
    save_every: int = 100
    "checkpoint every N steps: a killed stage resumes from the latest"
    overrides: tuple[str, ...] = ()
    'extra `lmforge train` overrides, e.g. ["train.precision=bf16"]'


@dataclasses.dataclass(frozen=True)
class SftSection:
    """`lmforge sft` of the pretrained model on chat data."""

    enabled: bool = True
    "run this stage (off: RL and eval start from the pretrained model)"
    data: str = "examples/chat/sft.jsonl"
    "JSONL conversations"
    gsm8k: str = ""
    "GSM8K-format JSONL {question, answer} added to the chats as worked-solution turns (empty: none)"
    gsm8k_limit: int = 0
    "at most this many of those problems (0: all)"
    chat_template: str = "configs/recipes/chat_template.jinja"
    "Jinja chat template given to the pretrained model (empty: lmforge's ChatML default, whose turns end in <|im_end|>, not a stop token of the model)"
    steps: int = 200
    "optimizer steps"
    batch_size: int = 16
    "sequences per step"
    micro_batch: int = 8
    "sequences per forward/backward"
    lr: float = 1e-3
    "learning rate"
    max_len: int = 256
    "longest packed row (at most the model's context)"


@dataclasses.dataclass(frozen=True)
class RlSection:
    """`lmforge rl` with a verifiable reward on the SFT model."""

    enabled: bool = True
    "run this stage"
    task: str = "gsm8k"
    "reward: gsm8k (the last number after '####'; synthetic addition on CPU) or math"
    data: str = "examples/chat/arithmetic-train.jsonl"
    "JSONL problems {question, answer '... #### N'}"
    eval_data: str = "examples/chat/arithmetic-test.jsonl"
    "held-out problems"
    algo: str = "grpo"
    "GRPO-family algorithm (lmforge rl --help)"
    iterations: int = 20
    "policy updates"
    prompts_per_step: int = 16
    "problems per update"
    group_size: int = 8
    "samples per problem"
    lr: float = 3e-4
    "learning rate"
    max_tokens: int = 24
    "longest reply"
    micro_batch: int = 64
    "sequences per forward/backward"
    eval_size: int = 100
    "held-out problems scored"
    eval_every: int = 5
    "score the held-out set every N iterations"
    extra: tuple[str, ...] = ()
    'extra `lmforge rl` flags, e.g. ["--pipeline"]'


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """`lmforge eval` of every model of the recipe and of the anchors."""

    tasks: str = "ppl,mmlu,arc,gsm8k"
    "comma-separated `lmforge eval` tasks"
    data_dir: str = "examples/eval"
    "benchmark folder (examples/eval's layout)"
    limit: int = 0
    "at most N examples per task (0: all)"
    max_new_tokens: int = 64
    "generation budget of GSM8K"
    batch_size: int = 8
    "sequences per forward"
    models: tuple[str, ...] = ("pretrain", "sft", "rl")
    "the recipe's models to evaluate (stages that ran); the last is the recipe's result"
    anchors: tuple[str, ...] = ()
    "reference models evaluated by the same eval, as NAME=PATH (checkpoint, HF folder or .gguf)"
    anchor_context: int = 2048
    "context length a .gguf anchor is imported with"


@dataclasses.dataclass(frozen=True)
class RecipeConfig:
    """A whole recipe: data → tokenizer → pretrain → SFT → RL → eval → report."""

    recipe: RecipeSection = RecipeSection()
    "recipe-wide settings"
    data: DataSection = DataSection()
    "the data stage"
    tokenizer: TokenizerSection = TokenizerSection()
    "the tokenizer stage"
    pretrain: PretrainSection = PretrainSection()
    "the pretraining stage"
    sft: SftSection = SftSection()
    "the SFT stage"
    rl: RlSection = RlSection()
    "the RL stage"
    eval: EvalSection = EvalSection()
    "the evaluation stage"


def load_recipe(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> RecipeConfig:
    """The recipe in TOML file ``path`` (None: the defaults) with dotted ``overrides`` applied;
    an unknown key, a wrong type, an empty file or a bad value is one :class:`ConfigError` line."""
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"recipe {p} is a directory, expected a TOML file")
        if not read_toml(p, "recipe"):
            raise ConfigError(f"recipe {p} is empty: start from configs/recipes/tiny-cpu.toml")
    cfg = load_config(RecipeConfig, path, overrides)
    check(cfg)
    return cfg


def check(cfg: RecipeConfig) -> None:
    """Values a stage would only reject minutes later, checked before any work."""
    if cfg.recipe.launcher not in ("subprocess", "inprocess"):
        raise ConfigError(
            f"recipe.launcher: expected 'subprocess' or 'inprocess', got {cfg.recipe.launcher!r}"
        )
    for key, value in (
        ("pretrain.steps", cfg.pretrain.steps),
        ("pretrain.batch_size", cfg.pretrain.batch_size),
        ("sft.steps", cfg.sft.steps),
        ("rl.iterations", cfg.rl.iterations),
        ("tokenizer.vocab_size", cfg.tokenizer.vocab_size),
        ("data.val_every", cfg.data.val_every),
    ):
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if cfg.recipe.threads < 0:
        raise ConfigError(f"recipe.threads must be >= 0 (0: auto), got {cfg.recipe.threads}")
    if bool(cfg.data.tokens_train) != bool(cfg.data.tokens_val):
        raise ConfigError("data.tokens_train and data.tokens_val go together")
    if cfg.data.tokens_train and not cfg.data.tokenizer_dir:
        raise ConfigError("data.tokens_train needs data.tokenizer_dir (the shards' tokenizer)")
    for name in cfg.eval.models:
        if name not in ("pretrain", "sft", "rl"):
            raise ConfigError(f"eval.models: {name!r} is not one of pretrain, sft, rl")
    for spec in cfg.eval.anchors:
        if "=" not in spec:
            raise ConfigError(f"eval.anchors: {spec!r} is not NAME=PATH")


def stage_index(name: str, flag: str) -> int:
    """Position of stage ``name`` in :data:`STAGES`; an unknown name is one line naming ``flag``."""
    if name not in STAGES:
        raise ConfigError(f"{flag}: unknown stage {name!r}, expected one of {', '.join(STAGES)}")
    return STAGES.index(name)
