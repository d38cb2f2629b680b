"""The recipe's stages. Each one drives lmforge through its command line (``lmforge data run``,
``tokenizer train``, ``train``, ``sft``, ``rl``, ``eval``), so the recipe runs exactly what a user
would type; the recipe's own code only moves files between them (the code corpus, the
train/validation split of the mixture) and reads their outputs back for the report card.

A stage is a :class:`Stage`: the folders it owns under the recipe's ``out``, whether a killed
attempt resumes in place, its settings (hashed into its marker), its input files, and ``run``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmforge.recipe.config import RecipeConfig
from lmforge.utils.config import config_to_dict
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write, atomic_write_text


@dataclasses.dataclass
class Context:
    """What a stage runs with: the config, the output folder, threads and the command launcher."""

    cfg: RecipeConfig
    out: Path
    threads: int
    launch: Callable[[Sequence[str]], int]
    "runs one lmforge command line (without the leading 'lmforge'), returns its exit status"

    def lmforge(self, *args: str) -> None:
        """Run ``lmforge ARGS``; a non-zero exit is one line naming the command."""
        shown = " ".join(args)
        print(f"[recipe] $ lmforge {shown}", file=sys.stderr, flush=True)
        status = self.launch(list(args))
        if status != 0:
            raise LmforgeError(f"`lmforge {shown}` failed (exit status {status}); see above")

    def path(self, *parts: str) -> Path:
        """A path under the recipe's output folder."""
        return self.out.joinpath(*parts)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the recipe."""

    name: str
    dirs: tuple[str, ...]
    "folders under out the stage owns (the first holds its markers); cleared on a restart"
    resumable: bool
    "a killed attempt under the same key continues in place (the stage's own resume)"
    settings: Callable[[RecipeConfig], Any]
    inputs: Callable[[RecipeConfig], list[str]]
    run: Callable[[Context], dict[str, Any]]
    enabled: Callable[[RecipeConfig], bool] = lambda cfg: True


# ---------------------------------------------------------------------------------------------
# helpers


def _read_jsonl_gz(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _write_jsonl_gz(path: Path, records: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for r in records:
            f.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line torn by a kill
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _device_flags(ctx: Context) -> list[str]:
    return ["--device", ctx.cfg.recipe.device, "--seed", str(ctx.cfg.recipe.seed)]


def split_documents(
    docs: Sequence[dict[str, Any]], val_every: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Deterministic train/validation split by a hash of each document's text, so the copies a
    mixture repeats land on the same side (no validation text is trained on)."""
    train, val = [], []
    for d in docs:
        h = int(hashlib.sha1(d["text"].encode("utf-8")).hexdigest()[:8], 16)
        (val if h % val_every == 0 else train).append(d)
    if not val and train:
        val.append(train.pop())
    if not train:
        raise LmforgeError("the mixture has too few documents for a train/validation split")
    return train, val


# ---------------------------------------------------------------------------------------------
# data


def _data_settings(cfg: RecipeConfig) -> Any:
    return {**config_to_dict(cfg.data), "seed": cfg.recipe.seed}


def _data_inputs(cfg: RecipeConfig) -> list[str]:
    d = cfg.data
    paths = [*d.pipelines, *d.extra_web, *d.contamination, *d.books, *d.files]
    for p in d.pipelines:  # the pipelines' own inputs
        try:
            import tomllib

            paths += list(tomllib.loads(Path(p).read_text()).get("input", {}).get("paths", []))
        except (OSError, ValueError):
            pass
    return paths


def _chunks(text: str, size: int = 32_000) -> list[str]:
    """``text`` cut at line ends into pieces of about ``size`` characters, so one large file
    can still give both a training and a validation part."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def _code_corpus(ctx: Context, limit_mb: float) -> tuple[Path, int]:
    """The embedded default corpus (stdlib sources, sorted) up to ``limit_mb`` as one JSONL."""
    from lmforge.utils.corpus import default_corpus_files, expand_inputs

    files = expand_inputs(ctx.cfg.data.files) if ctx.cfg.data.files else default_corpus_files()
    docs, total = [], 0
    for f in files:
        if total >= limit_mb * 1e6:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for j, piece in enumerate(_chunks(text)):
            docs.append({"id": f"{f.name}#{j}", "text": piece})
        total += len(text.encode("utf-8"))
    path = ctx.path("data", "code", "stdlib.jsonl.gz")
    _write_jsonl_gz(path, docs)
    return path, total


def _run_data(ctx: Context) -> dict[str, Any]:
    d = ctx.cfg.data
    root = ctx.path("data")
    metrics: dict[str, Any] = {}
    web_files: list[str] = []
    for pipeline in d.pipelines:
        name = Path(pipeline).stem
        ctx.lmforge("data", "run", pipeline, "--no-progress", f"--output.dir={root / name}")
        shards = sorted(str(p) for p in (root / name).glob("shard-*.jsonl.gz"))
        metrics[f"{name}_documents"] = sum(len(_read_jsonl_gz(Path(s))) for s in shards)
        web_files += shards
    web_files += list(d.extra_web)
    if web_files:
        # one dedup pass over every web source: contamination, exact, line and MinHash dedup
        steps = []
        if d.contamination:
            steps.append({"type": "contamination", "eval_paths": list(d.contamination), "n": 13,
                          "action": "remove"})  # fmt: skip
        steps += [{"type": "exact_dedup"}, {"type": "line_dedup"},
                  {"type": "minhash_dedup", "num_hashes": 120, "num_bands": 20, "ngrams": 5,
                   "jaccard_threshold": 0.8}]  # fmt: skip
        toml = ['executor = "local"', "workers = 1", "", "[input]",
                f"paths = {json.dumps(web_files)}", 'format = "jsonl"', "", "[output]",
                f"dir = {json.dumps(str(root / 'dedup'))}"]  # fmt: skip
        for s in steps:
            toml += ["", "[[steps]]"] + [f"{k} = {json.dumps(v)}" for k, v in s.items()]
        dedup_toml = root / "dedup.toml"
        dedup_toml.parent.mkdir(parents=True, exist_ok=True)
        dedup_toml.write_text("\n".join(toml) + "\n", encoding="utf-8")
        ctx.lmforge("data", "run", str(dedup_toml), "--no-progress")
        dedup_shards = sorted((root / "dedup").glob("shard-*.jsonl.gz"))
        metrics["web_documents_after_dedup"] = sum(len(_read_jsonl_gz(p)) for p in dedup_shards)

    code_path, code_bytes = _code_corpus(ctx, d.code_mb)
    metrics["code_mb"] = round(code_bytes / 1e6, 2)
    sources = [f"web={root / 'dedup' / 'shard-*.jsonl.gz'}:{d.web_weight}"] if web_files else []
    sources += [f"books={d.books[i]}:{d.books_weight}" if i == 0 else
                f"books{i + 1}={d.books[i]}:{d.books_weight}" for i in range(len(d.books))]  # fmt: skip
    if d.code_mb > 0 and code_bytes:
        sources.append(f"code={code_path}:{d.code_weight}")
    sources += list(d.shared)
    mix_args = ["data", "mix", "--tokens", str(d.tokens), "--max-epochs", str(d.max_epochs),
                "--tokenizer", "bytes", "--out", str(root / "mix"), "--seed",
                str(ctx.cfg.recipe.seed)]  # fmt: skip
    for s in sources:
        mix_args += ["--source", s]
    ctx.lmforge(*mix_args)
    docs: list[dict[str, Any]] = []
    for p in sorted((root / "mix").glob("*.jsonl.gz")):
        part = _read_jsonl_gz(p)
        metrics[f"mix_{p.name.split('.')[0]}_mb"] = round(
            sum(len(r["text"].encode("utf-8")) for r in part) / 1e6, 2
        )
        docs += part
    train, val = split_documents(docs, d.val_every)
    _write_jsonl_gz(root / "train.jsonl.gz", train)
    _write_jsonl_gz(root / "val.jsonl.gz", val)
    metrics["train_documents"], metrics["val_documents"] = len(train), len(val)
    metrics["train_mb"] = round(sum(len(r["text"].encode()) for r in train) / 1e6, 2)
    return metrics


# ---------------------------------------------------------------------------------------------
# tokenizer


def _run_tokenizer(ctx: Context) -> dict[str, Any]:
    t, d = ctx.cfg.tokenizer, ctx.cfg.data
    tok_dir, shards = ctx.path("tokenizer"), ctx.path("tokens")
    shards.mkdir(parents=True, exist_ok=True)
    if d.tokens_train:  # pretraining on given shards (a shared corpus): use their tokenizer
        shutil.copytree(d.tokenizer_dir, tok_dir, dirs_exist_ok=True)
        metrics = {"tokenizer": d.tokenizer_dir}
        for split, src in (("train", d.tokens_train), ("val", d.tokens_val)):
            side = _read_json(Path(src + ".json"))
            metrics[f"{split}_tokens"] = side.get("count")
            metrics[f"{split}_shard"] = src
        return metrics
    docs = _read_jsonl_gz(ctx.path("data", "train.jsonl.gz"))
    sample, total = [], 0
    for r in docs:  # the merges are learned on the first train_mb of the training split
        if total >= t.train_mb * 1e6:
            break
        sample.append(r)
        total += len(r["text"].encode("utf-8"))
    _write_jsonl_gz(shards / "tokenizer-sample.jsonl.gz", sample)
    specials = [a for s in t.special_tokens for a in ("--special-token", s)]
    ctx.lmforge("tokenizer", "train", "--input", str(shards / "tokenizer-sample.jsonl.gz"),
                "--vocab-size", str(t.vocab_size), *specials, "--out", str(tok_dir),
                "--workers", str(t.workers))  # fmt: skip
    metrics: dict[str, Any] = {"tokenizer_train_mb": round(total / 1e6, 2)}
    for split in ("train", "val"):
        ctx.lmforge("tokenizer", "encode", "--tokenizer", str(tok_dir), "--input",
                    str(ctx.path("data", f"{split}.jsonl.gz")), "--out",
                    str(shards / f"{split}.bin"), "--workers", str(t.workers))  # fmt: skip
        side = _read_json(shards / f"{split}.bin.json")
        metrics[f"{split}_tokens"] = side.get("count")
        if side.get("bytes") and side.get("count"):
            metrics[f"{split}_bytes_per_token"] = round(side["bytes"] / side["count"], 3)
    return metrics


def token_paths(ctx_or_cfg: Context | RecipeConfig, out: Path | None = None) -> tuple[str, str]:
    """The pretraining shards: the tokenizer stage's, or the configured shared ones."""
    cfg = ctx_or_cfg.cfg if isinstance(ctx_or_cfg, Context) else ctx_or_cfg
    root = ctx_or_cfg.out if isinstance(ctx_or_cfg, Context) else out
    if cfg.data.tokens_train:
        return cfg.data.tokens_train, cfg.data.tokens_val
    assert root is not None
    return str(root / "tokens" / "train.bin"), str(root / "tokens" / "val.bin")


# ---------------------------------------------------------------------------------------------
# pretraining


def _vocab_size(tok_dir: Path) -> int:
    from lmforge.tokenizer import Tokenizer

    return Tokenizer.load(tok_dir).vocab_size


def _run_pretrain(ctx: Context) -> dict[str, Any]:
    p, r = ctx.cfg.pretrain, ctx.cfg.recipe
    train_bin, val_bin = token_paths(ctx)
    cuda = r.device.startswith("cuda")
    args = [
        "train", "--config", p.config,
        f"--model.vocab_size={_vocab_size(ctx.path('tokenizer'))}",
        f"--data.train={train_bin}", f"--data.val={val_bin}",
        f"--data.tokenizer={ctx.path('tokenizer')}",
        f"--train.out_dir={ctx.path('train')}", f"--train.device={r.device}",
        f"--train.seed={r.seed}", f"--train.max_steps={p.steps}",
        f"--train.batch_size={p.batch_size}", f"--train.lr={p.lr}", f"--train.min_lr={p.lr / 10}",
        f"--train.warmup_steps={min(100, max(1, p.steps // 20))}",
        f"--train.precision={'bf16' if cuda else 'fp32'}",
        f"--train.eval_every={p.eval_every}", f"--train.eval_batches={p.eval_batches}",
        f"--train.save_every={p.save_every}", "--train.resume=true",
    ]  # fmt: skip
    ctx.lmforge(*args, *[f"--{o.removeprefix('--')}" for o in p.overrides])
    rows = _read_jsonl(ctx.path("train", "metrics.jsonl"))
    # the steps taken: fewer than pretrain.steps when a train.max_minutes override stopped it
    steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
    metrics: dict[str, Any] = {"steps": max(steps) if steps else p.steps}
    for row in rows:
        for k in ("val_loss", "val_bpb", "val_bits_per_byte", "tokens_seen", "loss"):
            if k in row and isinstance(row[k], int | float):
                metrics[k] = row[k]
    if "val_loss" in metrics:
        metrics["val_ppl"] = round(math.exp(metrics["val_loss"]), 3)
    return metrics


# ---------------------------------------------------------------------------------------------
# SFT and RL


def model_path(cfg: RecipeConfig, out: Path, stage: str) -> Path:
    """Where stage ``stage``'s model is (``rl`` without RL falls back to SFT, then pretrain)."""
    if stage == "rl" and cfg.rl.enabled:
        return out / "rl" / "model"
    if stage in ("rl", "sft") and cfg.sft.enabled:
        return out / "sft" / "model"
    return out / "train"


def _threads(ctx: Context) -> list[str]:
    return ["--threads", str(ctx.threads)]


def gsm8k_chats(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """GSM8K ``{question, answer}`` records as chats: the question with lmforge's GSM8K
    instruction, the worked solution ending in ``#### N`` (what ``lmforge rl --task gsm8k``
    prompts with and rewards)."""
    from lmforge.posttrain.tasks import gsm8k_sft_response, gsm8k_user_message

    out = []
    for r in records:
        if "question" not in r or "answer" not in r:
            raise LmforgeError("sft.gsm8k: a record lacks 'question' or 'answer'")
        out.append({"messages": [
            {"role": "user", "content": gsm8k_user_message(str(r["question"]))},
            {"role": "assistant", "content": gsm8k_sft_response(str(r["answer"]))},
        ]})  # fmt: skip
    return out


def _sft_data(ctx: Context) -> str:
    """The SFT data file: ``sft.data``, or it plus ``sft.gsm8k``'s problems as chats."""
    s = ctx.cfg.sft
    if not s.gsm8k:
        return s.data
    from lmforge.utils.io import iter_jsonl

    chats = [rec for _, rec in iter_jsonl(s.data, "sft.data")]
    problems = [rec for _, rec in iter_jsonl(s.gsm8k, "sft.gsm8k")]
    chats += gsm8k_chats(problems[: s.gsm8k_limit] if s.gsm8k_limit else problems)
    path = ctx.path("sft", "data.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "w") as f:
        for rec in chats:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return str(path)


def _run_sft(ctx: Context) -> dict[str, Any]:
    s = ctx.cfg.sft
    if s.chat_template:
        # the chat format travels with the model (sft, rl, chat and serve read it from there)
        shutil.copyfile(s.chat_template, ctx.path("train", "chat_template.jinja"))
    data = _sft_data(ctx)
    ctx.lmforge("sft", "--model", str(ctx.path("train")), "--data", data,
                "--steps", str(s.steps), "--batch-size", str(s.batch_size),
                "--micro-batch", str(s.micro_batch), "--lr", str(s.lr),
                "--max-len", str(s.max_len), "--out", str(ctx.path("sft")),
                *_device_flags(ctx), *_threads(ctx))  # fmt: skip
    return {k: v for k, v in _read_json(ctx.path("sft", "summary.json")).items()
            if isinstance(v, int | float | str)}  # fmt: skip


def _run_rl(ctx: Context) -> dict[str, Any]:
    r = ctx.cfg.rl
    start = model_path(ctx.cfg, ctx.out, "sft")
    ctx.lmforge("rl", "--task", r.task, "--model", str(start), "--data", r.data,
                "--eval-data", r.eval_data, "--algo", r.algo,
                "--iterations", str(r.iterations), "--prompts-per-step", str(r.prompts_per_step),
                "--group-size", str(r.group_size), "--lr", str(r.lr),
                "--max-tokens", str(r.max_tokens), "--micro-batch", str(r.micro_batch),
                "--eval-size", str(r.eval_size), "--eval-every", str(r.eval_every),
                "--out", str(ctx.path("rl")), *_device_flags(ctx), *_threads(ctx),
                *r.extra)  # fmt: skip
    return {k: v for k, v in _read_json(ctx.path("rl", "summary.json")).items()
            if isinstance(v, int | float | str)}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# evaluation

# chance accuracy of the multiple-choice tasks (4 options); generation tasks have 0
CHANCE = {"mmlu": 0.25, "arc": 0.25, "hellaswag": 0.25, "mmlu_gen": 0.25}


def centered_accuracy(accuracy: float, chance: float) -> float:
    """Accuracy rescaled so chance is 0 and perfect is 1 (DCLM's CORE centering)."""
    return (accuracy - chance) / (1.0 - chance)


def core_score(accuracies: dict[str, float]) -> float | None:
    """The CORE-like aggregate: centered accuracy averaged over the tasks given (None if none)."""
    if not accuracies:
        return None
    vals = [centered_accuracy(a, CHANCE.get(t, 0.0)) for t, a in accuracies.items()]
    return sum(vals) / len(vals)


def task_accuracies(report: dict[str, Any]) -> dict[str, float]:
    """``{task: accuracy}`` from an ``lmforge eval`` JSON report (multiple choice: acc;
    generation: pass@1)."""
    tasks = report.get("results", {})
    out: dict[str, float] = {}
    if not isinstance(tasks, dict):
        return out
    for name, res in tasks.items():
        if name == "ppl" or not isinstance(res, dict):
            continue
        for k in ("acc", "pass@1"):
            if isinstance(res.get(k), int | float):
                out[name] = float(res[k])
                break
    return out


def bits_per_byte(report: dict[str, Any]) -> float | None:
    """The ppl task's bits per byte from an ``lmforge eval`` report, when it ran."""
    tasks = report.get("results", {})
    res = tasks.get("ppl") if isinstance(tasks, dict) else None
    if isinstance(res, dict):
        for k in ("bits_per_byte", "bpb"):
            if isinstance(res.get(k), int | float):
                return float(res[k])
    return None


def eval_targets(cfg: RecipeConfig, out: Path) -> list[tuple[str, str]]:
    """``(row name, model path)`` of every model the eval stage scores, anchors last."""
    rows = []
    for name in cfg.eval.models:
        if (name == "sft" and not cfg.sft.enabled) or (name == "rl" and not cfg.rl.enabled):
            continue
        rows.append((name, str(model_path(cfg, out, name))))
    for spec in cfg.eval.anchors:
        name, path = spec.split("=", 1)
        rows.append((name, path))
    return rows


def benchmark_files(cfg: RecipeConfig) -> dict[str, Path]:
    """``{task/name: path}`` of the benchmark files (or folders) the eval tasks read."""
    from lmforge.eval.tasks import task_files

    e = cfg.eval
    out: dict[str, Path] = {}
    for task in (t.strip() for t in e.tasks.split(",") if t.strip()):
        if task == "ppl":
            out["ppl"] = Path(e.data_dir).parent / "text" / "wikitext2" / "test.txt"
            continue
        try:
            files = task_files(e.data_dir, task)
        except (KeyError, ValueError):
            continue  # lmforge eval names an unknown task itself
        for role, path in files.items():
            out[f"{task}/{role}"] = Path(path)
    return out


def _content_digest(paths: dict[str, Path]) -> str:
    """One hash of the files' contents, by their names under the task (not where they are), so
    a copy of the benchmarks elsewhere (a device machine) gives the same digest."""
    h = hashlib.sha256()
    for name, p in sorted(paths.items()):
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        for f in files:
            rel = f.relative_to(p).as_posix() if p.is_dir() else ""
            h.update(f"{name}/{rel}\0".encode())
            h.update(f.read_bytes() if f.is_file() else b"missing")
    return h.hexdigest()[:16]


def model_identity(cfg: RecipeConfig, out: Path, name: str, path: str) -> str:
    """What an eval row's model is: the completion key of the stage that trained it (a recipe
    model), or the anchor's name, file name and import context (an anchor)."""
    from lmforge.recipe.markers import DONE, read_marker

    if name in ("pretrain", "sft", "rl") and not path.endswith(".gguf"):
        folder = {"pretrain": "train", "sft": "sft", "rl": "rl"}[name]
        if name == "rl" and not cfg.rl.enabled:
            folder = "sft" if cfg.sft.enabled else "train"
        elif name == "sft" and not cfg.sft.enabled:
            folder = "train"
        marker = read_marker(out / folder / DONE)
        if marker is None:
            raise LmforgeError(f"eval row {name!r}: stage folder {out / folder} has not finished")
        return f"{folder}:{marker.get('key')}"
    return f"anchor:{name}:{Path(path).name}:context={cfg.eval.anchor_context}"


def eval_cache_path(cfg: RecipeConfig, out: Path, name: str, path: str) -> Path:
    """Where row ``name``'s ``lmforge eval`` report is kept: ``out/evals/NAME-HASH.json``, the
    hash over the model's identity, the eval settings and the benchmark files' contents (not
    the device, nor where the files are): a row scored once (on any machine) is reused."""
    e = cfg.eval
    ident = {"model": model_identity(cfg, out, name, path), "tasks": e.tasks, "limit": e.limit,
             "max_new_tokens": e.max_new_tokens, "batch_size": e.batch_size,
             "seed": cfg.recipe.seed, "benchmarks": _content_digest(benchmark_files(cfg))}  # fmt: skip
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    return out / "evals" / f"{safe}-{digest}.json"


def where(device: str) -> str:
    """The machine a stage runs on, in words: the device, with the GPU's name or the CPU count,
    and the host name."""
    import os
    import platform
    import subprocess

    if device.startswith("cuda"):
        gpu = ""
        try:
            gpu = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
            gpu = gpu.strip().splitlines()[0] if gpu.strip() else ""
        except (OSError, subprocess.SubprocessError):
            pass
        what = f"{device} ({gpu})" if gpu else device
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        what = f"{device} ({cores} cores)"
    return f"{what} on {platform.node() or 'an unnamed host'}"


def evaluate_row(ctx: Context, name: str, path: str) -> dict[str, Any]:
    """Row ``name`` of the eval table: from the cache (:func:`eval_cache_path`), else by
    ``lmforge eval`` on the recipe's device (a GGUF anchor imported first); the report is also
    copied to ``out/eval/NAME.json``."""
    e = ctx.cfg.eval
    cached = eval_cache_path(ctx.cfg, ctx.out, name, path)
    sidecar = cached.with_suffix(".where.json")
    if not cached.is_file():
        if path.endswith(".gguf"):
            # lmforge eval reads checkpoints and HF folders: a GGUF anchor is imported first
            imported = ctx.path("evals", "anchors", name)
            if not (imported / "config.toml").is_file():
                if not Path(path).is_file():
                    raise LmforgeError(
                        f"eval anchor {name}: {path} not found and its row is not in "
                        f"{cached.parent} (score it where the file is: lmforge recipe eval)"
                    )
                ctx.lmforge("hf", "import", "--gguf", path, "--out", str(imported),
                            "--context-length", str(e.anchor_context))  # fmt: skip
            path = str(imported)
        cached.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        ctx.lmforge("eval", "--checkpoint", path, "--tasks", e.tasks, "--data-dir", e.data_dir,
                    "--max-new-tokens", str(e.max_new_tokens), "--batch-size",
                    str(e.batch_size), "--out", str(cached), "--no-progress",
                    *(["--limit", str(e.limit)] if e.limit else []),
                    *_device_flags(ctx))  # fmt: skip
        atomic_write_text(sidecar, json.dumps({"where": where(ctx.cfg.recipe.device),
                                               "seconds": round(time.time() - t0, 1)}))  # fmt: skip
    report = _read_json(cached)
    ctx.path("eval").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached, ctx.path("eval", f"{name}.json"))
    accs = task_accuracies(report)
    row: dict[str, Any] = {"model": path, **{t: round(a, 4) for t, a in accs.items()}}
    bpb = bits_per_byte(report)
    if bpb is not None:
        row["bits_per_byte"] = round(bpb, 4)
    core = core_score(accs)
    if core is not None:
        row["core"] = round(core, 4)
    side = _read_json(sidecar)
    if side.get("where"):
        row["ran_on"] = side["where"]
    if side.get("seconds") is not None:
        row["seconds"] = side["seconds"]  # the row's own eval time, where it ran
    return row


def _run_eval(ctx: Context) -> dict[str, Any]:
    return {name: evaluate_row(ctx, name, path) for name, path in eval_targets(ctx.cfg, ctx.out)}


# ---------------------------------------------------------------------------------------------


def _report_stage(ctx: Context) -> dict[str, Any]:
    from lmforge.recipe.report import write_report

    # the stage list and model paths go in as arguments: report.py does not import this module
    return {"report": str(write_report(ctx.cfg, ctx.out, STAGE_LIST, model_path))}


def _section(name: str) -> Callable[[RecipeConfig], Any]:
    return lambda cfg: {**config_to_dict(getattr(cfg, name)), "device": cfg.recipe.device,
                        "seed": cfg.recipe.seed}  # fmt: skip


STAGE_LIST: tuple[Stage, ...] = (
    # data resumes in place: `lmforge data run` skips the shards it finished (its own markers)
    Stage("data", ("data",), True, _data_settings, _data_inputs, _run_data),
    Stage("tokenizer", ("tokenizer", "tokens"), False,
          lambda cfg: {**config_to_dict(cfg.tokenizer),
                       **{k: getattr(cfg.data, k)
                          for k in ("tokens_train", "tokens_val", "tokenizer_dir")}},
          lambda cfg: [cfg.data.tokenizer_dir] if cfg.data.tokenizer_dir else [],
          _run_tokenizer),
    Stage("pretrain", ("train",), True, _section("pretrain"),
          lambda cfg: [cfg.pretrain.config], _run_pretrain),
    Stage("sft", ("sft",), False, _section("sft"),
          lambda cfg: [p for p in (cfg.sft.data, cfg.sft.chat_template, cfg.sft.gsm8k) if p],
          _run_sft,
          enabled=lambda cfg: cfg.sft.enabled),
    Stage("rl", ("rl",), False, _section("rl"), lambda cfg: [cfg.rl.data, cfg.rl.eval_data],
          _run_rl, enabled=lambda cfg: cfg.rl.enabled),
    Stage("eval", ("eval",), True, _section("eval"),
          # the anchors are identified by name and file name (eval.anchors, in the settings), not
          # by their files, so the key is the same on a machine without them (see handoff)
          lambda cfg: [cfg.eval.data_dir], _run_eval),
    Stage("report", ("report",), False, lambda cfg: {}, lambda cfg: [], _report_stage),
)  # fmt: skip
