"""The pipeline file's schema: [input], [output], executor, [[steps]]; validation; fingerprints.

Every step type and option is checked against a dataclass (``lmforge.utils.config.from_dict``)
before any work, and a mistake stops the run with one line naming it. Each step's options
dataclass lives beside its logic (``HtmlOptions`` in ``extract.py``, ``GopherConfig`` in
``quality.py``, …); :data:`STEP_TYPES` only maps a type name to them.

A stage's *fingerprint* hashes what its outputs depend on: its steps' options, the files an
option names (a tokenizer, a classifier, evaluation sets: path, size and mtime), its shard
layout, and the previous stage's fingerprint (for the first stage: the input files' paths, sizes
and mtimes, the reader format and keys). ``workers`` and ``executor`` change where the work runs,
not what it produces, and are left out. Completion markers carry it, so a rerun after a config
change redoes what changed instead of keeping stale shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lmforge.data.classifier import ClassifierFilter, ClassifierOptions
from lmforge.data.contamination import ContaminationFilter, ContaminationOptions
from lmforge.data.core import Step
from lmforge.data.dedup import DedupOptions, MinhashOptions
from lmforge.data.extract import HtmlOptions, HtmlStep
from lmforge.data.langid import LanguageFilter, LanguageOptions
from lmforge.data.pii import PiiOptions, PiiStep
from lmforge.data.quality import C4Config, C4Step, GopherConfig, GopherFilter
from lmforge.data.shards import TokenizeOptions
from lmforge.utils.config import ConfigError, config_to_dict, from_dict, read_toml
from lmforge.utils.errors import LmforgeError


@dataclass(frozen=True)
class _StepType:
    options: type
    kind: Literal["stream", "corpus", "sink"]
    build: Callable[..., Step] | None


STEP_TYPES: dict[str, _StepType] = {
    "html": _StepType(HtmlOptions, "stream", HtmlStep),
    "language": _StepType(LanguageOptions, "stream", LanguageFilter),
    "gopher": _StepType(GopherConfig, "stream", GopherFilter),
    "c4": _StepType(C4Config, "stream", C4Step),
    "pii": _StepType(PiiOptions, "stream", PiiStep),
    "classifier": _StepType(ClassifierOptions, "stream", ClassifierFilter),
    "contamination": _StepType(ContaminationOptions, "stream", ContaminationFilter),
    "exact_dedup": _StepType(DedupOptions, "corpus", None),
    "line_dedup": _StepType(DedupOptions, "corpus", None),
    "minhash_dedup": _StepType(MinhashOptions, "corpus", None),
    "tokenize": _StepType(TokenizeOptions, "sink", None),
}

# Options that name files whose content the outputs depend on (checked by size and mtime).
_PATH_OPTIONS = {
    "tokenize": ("tokenizer",),
    "classifier": ("model",),
    "contamination": ("eval_paths",),
}

# ----------------------------------------------------------------------------- pipeline config


@dataclass(frozen=True)
class InputConfig:
    """Where documents come from."""

    paths: tuple[str, ...]
    "files, folders (searched recursively) or globs"
    format: Literal["auto", "warc", "wet", "jsonl", "parquet", "text"] = "auto"
    "reader; auto guesses from each file name"
    text_key: str = "text"
    "JSONL/Parquet field holding the text"
    id_key: str = "id"
    "JSONL/Parquet field holding the document id"


@dataclass(frozen=True)
class OutputConfig:
    """Where results go."""

    dir: str
    "output folder (shards, completion markers, exclusions)"
    shards: int = 0
    "output shards of the first stage; 0 = one per input file"
    exclusions: bool = False
    "write dropped documents with step and reason to DIR/excluded/"


@dataclass(frozen=True)
class StepSpec:
    """A validated step: its type name and its options dataclass."""

    type: str
    "the step type (a key of STEP_TYPES)"
    options: Any
    "the step's options dataclass"


@dataclass(frozen=True)
class PipelineConfig:
    """A whole pipeline file."""

    input: InputConfig
    "the [input] table"
    output: OutputConfig
    "the [output] table"
    executor: Literal["local", "ray"] = "local"
    "local multiprocessing or Ray tasks"
    workers: int = 1
    "parallel shard tasks (local processes or concurrent Ray tasks)"
    ray_address: str = ""
    "Ray cluster address; empty starts or joins a local Ray instance"
    steps: tuple[StepSpec, ...] = ()
    "the [[steps]] list"


def parse_pipeline(data: dict[str, Any], source: str = "<pipeline>") -> PipelineConfig:
    """Validate a pipeline mapping; raises :class:`LmforgeError` naming the bad key or value."""
    data = dict(data)
    raw_steps = data.pop("steps", [])
    try:
        if not isinstance(raw_steps, list):
            raise ConfigError("'steps' must be an array of tables ([[steps]])")
        base = from_dict(PipelineConfig, data)
        steps = []
        for i, raw in enumerate(raw_steps):
            where = f"steps[{i}]"
            if not isinstance(raw, dict) or "type" not in raw:
                raise ConfigError(f"{where} needs a 'type' (known: {', '.join(STEP_TYPES)})")
            kind = raw["type"]
            if kind not in STEP_TYPES:
                raise ConfigError(
                    f"{where}: unknown step type {kind!r} (known: {', '.join(STEP_TYPES)})"
                )
            opts = from_dict(
                STEP_TYPES[kind].options,
                {k: v for k, v in raw.items() if k != "type"},
                prefix=f"{where}({kind})",
            )
            check_step_values(kind, opts, f"{where}({kind})")
            steps.append(StepSpec(kind, opts))
        for i, s in enumerate(steps):
            if STEP_TYPES[s.type].kind == "sink" and i != len(steps) - 1:
                raise ConfigError(f"steps[{i}]: '{s.type}' must be the last step")
        if base.input.format == "warc" and (not steps or steps[0].type != "html"):
            raise ConfigError("input.format 'warc' needs an 'html' step first")
        if base.workers < 1:
            raise ConfigError(f"config key 'workers': must be >= 1, got {base.workers}")
        if base.output.shards < 0:
            raise ConfigError(f"config key 'output.shards': must be >= 0, got {base.output.shards}")
        if not base.output.dir.strip():
            raise ConfigError("config key 'output.dir': must name a folder, got ''")
        if not base.input.paths:
            raise ConfigError("config key 'input.paths': must list at least one file or folder")
    except ConfigError as e:
        raise LmforgeError(f"{source}: {e}") from None
    return dataclasses.replace(base, steps=tuple(steps))


# Fields that are fractions or probabilities: in [0, 1].
_UNIT = ("threshold", "ratio", "fraction")
# Counts that must be at least 1 to mean anything.
_POSITIVE = (
    "num_buckets",
    "num_hashes",
    "num_bands",
    "ngrams",
    "num_partitions",
    "n",
    "min_matches",
)


def check_step_values(kind: str, opts: Any, where: str) -> None:
    """Refuse option values outside their meaning (negative counts, fractions above 1, …)."""

    def bad(key: str, why: str, value: Any) -> ConfigError:
        return ConfigError(f"config key '{where}.{key}': {why}, got {value!r}")

    for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        values = value if isinstance(value, tuple) else (value,)
        nums = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if not nums or f.name == "seed":
            continue
        if any(v < 0 for v in nums):
            raise bad(f.name, "must be >= 0", value)
        if any(part in f.name for part in _UNIT) and any(v > 1 for v in nums):
            raise bad(f.name, "is a fraction, must be in [0, 1]", value)
        if f.name in _POSITIVE and any(v < 1 for v in nums):
            raise bad(f.name, "must be >= 1", value)
    if kind == "gopher":
        if opts.min_words > opts.max_words:
            raise bad("min_words", f"must be <= max_words ({opts.max_words})", opts.min_words)
        if opts.min_mean_word_length > opts.max_mean_word_length:
            raise bad(
                "min_mean_word_length",
                f"must be <= max_mean_word_length ({opts.max_mean_word_length})",
                opts.min_mean_word_length,
            )
    if kind == "minhash_dedup" and opts.num_hashes % opts.num_bands:
        raise bad(
            "num_hashes", f"must be a multiple of num_bands ({opts.num_bands})", opts.num_hashes
        )
    if kind == "classifier" and opts.pareto_alpha <= 0:
        raise bad("pareto_alpha", "must be > 0", opts.pareto_alpha)
    if kind == "language" and not opts.languages:
        raise bad("languages", "must list at least one language", opts.languages)


def load_pipeline(
    path: str | os.PathLike, overrides: dict[str, Any] | None = None
) -> PipelineConfig:
    """Read and validate a pipeline TOML file (``overrides`` merge over its top-level tables)."""
    p = Path(path)
    data = read_toml(p, "pipeline file")
    for k, v in (overrides or {}).items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return parse_pipeline(data, str(p))


def build_steps(specs: tuple[StepSpec, ...], exclusion: Any = None) -> list[Step]:
    """Instantiate streaming steps from validated specs (sinks and corpus steps excluded)."""
    out = []
    for s in specs:
        t = STEP_TYPES[s.type]
        if t.kind == "stream" and t.build is not None:
            out.append(t.build(s.options, exclusion=exclusion))
    return out


# ----------------------------------------------------------------------------- stages


@dataclass(frozen=True)
class Stage:
    """Consecutive streaming steps (run per shard), or one corpus step (run over all shards)."""

    kind: Literal["stream", "corpus"]
    "stream or corpus"
    specs: tuple[StepSpec, ...]
    "its steps, in order"


def split_stages(specs: tuple[StepSpec, ...]) -> list[Stage]:
    """Cut the step list at each corpus step: those need the whole corpus before going on."""
    stages: list[Stage] = []
    cur: list[StepSpec] = []
    for s in specs:
        if STEP_TYPES[s.type].kind == "corpus":
            if cur:
                stages.append(Stage("stream", tuple(cur)))
                cur = []
            stages.append(Stage("corpus", (s,)))
        else:
            cur.append(s)
    if cur or not stages:
        stages.append(Stage("stream", tuple(cur)))
    return stages


# ----------------------------------------------------------------------------- fingerprints


def _file_signature(path: str | os.PathLike) -> list[Any]:
    """[path, size, mtime_ns] of a file, of every file under a folder, or [path, None]."""
    p = Path(path)
    if p.is_dir():
        return [_file_signature(f) for f in sorted(p.rglob("*")) if f.is_file()]
    try:
        st = p.stat()
    except OSError:
        return [str(p), None]
    return [str(p), st.st_size, st.st_mtime_ns]


def input_signature(files: list[str], fmt: str, text_key: str, id_key: str) -> dict[str, Any]:
    """What the first stage reads: its files (path, size, mtime) and how it reads them."""
    return {
        "files": [_file_signature(f) for f in files],
        "format": fmt,
        "text_key": text_key,
        "id_key": id_key,
    }


def stage_signature(
    index: int, stage: Stage, upstream: str, shards: int, exclusions: bool
) -> dict[str, Any]:
    """What a stage's outputs depend on, as a plain mapping (hashed by :func:`fingerprint`)."""
    steps = []
    for i, s in enumerate(stage.specs):
        entry: dict[str, Any] = {"type": s.type, **config_to_dict(s.options)}
        for key in _PATH_OPTIONS.get(s.type, ()):
            value = getattr(s.options, key)
            names = value if isinstance(value, tuple | list) else (value,)
            if names != ("bytes",):
                entry[f"{key}@files"] = [_file_signature(n) for n in names]
        steps.append({"position": i, **entry})
    return {
        "stage": index,
        "kind": stage.kind,
        "steps": steps,
        "shards": shards,
        "exclusions": exclusions,
        "upstream": upstream,
    }


def fingerprint(signature: dict[str, Any]) -> str:
    """A short stable hash of a signature mapping."""
    blob = json.dumps(signature, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        out = {}
        for i, v in enumerate(obj):
            name = v.get("type", i) if isinstance(v, dict) else i
            out.update(_flatten(v, f"{prefix}[{i}]({name})" if name != i else f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def describe_change(old: dict[str, Any], new: dict[str, Any], limit: int = 3) -> str:
    """The keys that differ between two signatures, as one short phrase."""
    a, b = _flatten(old), _flatten(new)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        if key == "upstream":
            first = new.get("stage", 0) == 0
            diffs.append("input files changed" if first else "an earlier stage changed")
        elif "@files" in key:
            diffs.append(key.split("@files")[0] + " files changed")
        else:
            diffs.append(f"{key} {a.get(key, '(unset)')!r} → {b.get(key, '(unset)')!r}")
    diffs = list(dict.fromkeys(diffs))
    more = f" and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return ", ".join(diffs[:limit]) + more or "no visible change"
