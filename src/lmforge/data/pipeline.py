"""Pipelines from TOML: validated steps, sharded idempotent outputs, local and Ray executors.

A pipeline file names its input, its output, an executor and a list of ``[[steps]]``. Every step
type and option is checked against a dataclass (``lmforge.utils.config.from_dict``) before any
work, and a mistake stops the run with one line naming it. Steps are of two kinds:

* streaming steps (html, language, gopher, c4, pii, classifier, contamination, tokenize) run per
  shard: shard ``i`` reads input files ``i, i + shards, …``, applies the steps and writes
  ``shard-0000i.jsonl.gz`` (or ``.bin`` for tokenize) atomically, then a completion marker
  ``.done/shard-0000i.json`` holding its counters. A rerun skips shards with a marker, so a killed
  run resumes without redoing or duplicating finished shards.
* corpus steps (exact_dedup, line_dedup, minhash_dedup) need the whole corpus; they split the
  pipeline into stages. Each stage writes to ``OUT/_stageK/`` (the last stage to ``OUT/``), and
  a corpus stage is marked done as a whole: a run killed inside one redoes that stage only.
  Corpus stages run their MapReduce passes with the driver's local worker processes under both
  executors (simplification: no Ray dedup).

Dropped documents go to ``OUT/excluded/shard-*.jsonl.gz`` with ``excluded_by``/``excluded_reason``
metadata when ``[output] exclusions = true`` (streaming steps; dedup drops are counted only).

Exercised by ``lmforge data run configs/pipelines/web.toml`` and ``tests/test_data_pipeline.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os
import shutil
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lmforge.data.core import Document, Filter, Mapper, Step, StepStats, run_steps
from lmforge.data.quality import C4Config, GopherConfig
from lmforge.data.readers import FORMATS, ReadStats, document_to_json, read_documents
from lmforge.utils.config import ConfigError, config_to_dict, from_dict
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write, atomic_write_text

# ----------------------------------------------------------------------------- step options


@dataclass(frozen=True)
class HtmlOptions:
    """``html``: extract text from the raw HTML a WARC reader parked in ``html_bytes``."""

    backend: Literal["resiliparse", "trafilatura"] = "resiliparse"
    "text extractor"


@dataclass(frozen=True)
class LanguageOptions:
    """``language``: keep documents whose fastText LID-176 language is listed, above a score."""

    languages: tuple[str, ...] = ("en",)
    "ISO 639 codes to keep"
    threshold: float = 0.65
    "minimum language probability"


@dataclass(frozen=True)
class PiiOptions:
    """``pii``: mask e-mail addresses, phone numbers and IPv4 addresses."""

    emails: bool = True
    "mask e-mail addresses"
    phones: bool = True
    "mask US phone numbers"
    ips: bool = True
    "mask IPv4 addresses"


@dataclass(frozen=True)
class ClassifierOptions:
    """``classifier``: score with a fastText model; keep by threshold or Pareto sampling."""

    model: str
    "path of a fastText .bin/.ftz model"
    label: str
    "the label whose probability is the keep score (e.g. hq, non-nsfw)"
    threshold: float = 0.5
    "keep when the score is at least this (mode threshold)"
    mode: Literal["threshold", "pareto"] = "threshold"
    "threshold, or GPT-3 Pareto sampling (keep when pareto(alpha) > 1 - score)"
    pareto_alpha: float = 9.0
    "shape of the Pareto draw"
    seed: int = 0
    "seed of the per-document Pareto draw"


@dataclass(frozen=True)
class ContaminationOptions:
    """``contamination``: n-gram overlap with evaluation sets, reported and optionally removed."""

    eval_paths: tuple[str, ...]
    "evaluation files or folders (.jsonl/.json/.csv/.txt)"
    n: int = 13
    "n-gram length in words"
    min_matches: int = 1
    "shared n-grams that make a document contaminated"
    action: Literal["report", "remove"] = "remove"
    "report only (metadata + counters) or also drop"


@dataclass(frozen=True)
class DedupOptions:
    """``exact_dedup`` / ``line_dedup``: exact document or line deduplication over the corpus."""

    num_buckets: int = 16
    "hash buckets on disk (reduce tasks)"


@dataclass(frozen=True)
class MinhashOptions:
    """``minhash_dedup``: MinHash + LSH near-duplicate removal over the corpus."""

    num_hashes: int = 120
    "MinHash permutations"
    num_bands: int = 20
    "LSH bands (num_hashes must be a multiple); 20 × 6 rows catch J = 0.8 pairs 99.8% of the time"
    ngrams: int = 5
    "word n-gram shingle length"
    jaccard_threshold: float = 0.8
    "true Jaccard similarity at or above which two documents are duplicates"
    seed: int = 0
    "seed of the permutations"
    num_partitions: int = 8
    "LSH bucket partitions on disk (reduce tasks)"


@dataclass(frozen=True)
class TokenizeOptions:
    """``tokenize`` (last step only): write token shards instead of JSONL."""

    tokenizer: str
    "folder of a saved lmforge tokenizer, or 'bytes' for the byte-level stand-in"


# ----------------------------------------------------------------------------- steps


class HtmlStep(Mapper):
    """Extract text from ``metadata['html_bytes']``; pages with no text are dropped."""

    name = "html"

    def __init__(self, opts: HtmlOptions = HtmlOptions(), **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts

    def map(self, doc: Document) -> Document | str:
        from lmforge.data.extract import extract_text_from_html_bytes

        raw = doc.metadata.pop("html_bytes", None)
        if raw is None:
            return doc if doc.text else "no_html"
        text = extract_text_from_html_bytes(raw, self.opts.backend)
        if not text:
            return "no_text"
        doc.text = text
        return doc


class LanguageFilter(Filter):
    """Keep documents in the wanted languages; records ``language``/``language_score``."""

    name = "language"

    def __init__(self, opts: LanguageOptions = LanguageOptions(), **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        from lmforge.data.langid import identify_language

        label, score = identify_language(doc.text)
        doc.metadata["language"], doc.metadata["language_score"] = label, round(score, 4)
        if label not in self.opts.languages:
            return False, "language_other"
        if score < self.opts.threshold:
            return False, "language_low_score"
        return True


class GopherFilter(Filter):
    """Gopher quality and repetition rules; each drop names the rule."""

    name = "gopher"

    def __init__(self, opts: GopherConfig | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts or GopherConfig()

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        from lmforge.data.quality import gopher_reason

        reason = gopher_reason(doc.text, self.opts)
        return True if reason is None else (False, reason)


class C4Step(Mapper):
    """C4 line cleaning then document rules."""

    name = "c4"

    def __init__(self, opts: C4Config | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts or C4Config()

    def map(self, doc: Document) -> Document | str:
        from lmforge.data.quality import c4_clean

        text, reason = c4_clean(doc.text, self.opts)
        if text is None:
            return reason
        doc.text = text
        return doc


class PiiStep(Mapper):
    """Mask PII; counts of masked items go to the step's ``notes`` counter."""

    name = "pii"

    def __init__(self, opts: PiiOptions = PiiOptions(), **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts

    def map(self, doc: Document) -> Document | str:
        from lmforge.data import pii

        text = doc.text
        for on, fn, key in (
            (self.opts.emails, pii.mask_emails, "emails"),
            (self.opts.phones, pii.mask_phone_numbers, "phones"),
            (self.opts.ips, pii.mask_ips, "ips"),
        ):
            if on:
                text, n = fn(text)
                if n:
                    self.stats.notes[f"masked_{key}"] += n
        doc.text = text
        return doc


class ClassifierFilter(Filter):
    """Keep by a fastText label probability: threshold or GPT-3 Pareto sampling."""

    name = "classifier"

    def __init__(self, opts: ClassifierOptions, **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        from lmforge.data.classifier import label_probability, pareto_keep

        score = label_probability(doc.text, self.opts.model, self.opts.label)
        doc.metadata[f"score_{self.opts.label}"] = round(score, 4)
        if self.opts.mode == "pareto":
            keep = pareto_keep(score, doc.id, self.opts.pareto_alpha, self.opts.seed)
            return True if keep else (False, "classifier_pareto")
        return True if score >= self.opts.threshold else (False, "classifier_below_threshold")


class ContaminationFilter(Filter):
    """Count (and optionally drop) documents sharing n-grams with evaluation sets."""

    name = "contamination"

    def __init__(self, opts: ContaminationOptions, **kw: Any) -> None:
        super().__init__(**kw)
        self.opts = opts
        self.index = _contamination_index(opts.eval_paths, opts.n)

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        m = self.index.matches(doc.text)
        if m >= self.opts.min_matches:
            doc.metadata["contaminated_ngrams"] = m
            self.stats.notes["contaminated_docs"] += 1
            if self.opts.action == "remove":
                return False, "contaminated"
        return True


@functools.cache
def _contamination_index(paths: tuple[str, ...], n: int) -> Any:
    # Built once per process: every shard a worker runs shares it.
    from lmforge.data.contamination import ContaminationIndex

    return ContaminationIndex.from_paths(paths, n)


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
    options: Any


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
    except ConfigError as e:
        raise LmforgeError(f"{source}: {e}") from None
    return dataclasses.replace(base, steps=tuple(steps))


def load_pipeline(
    path: str | os.PathLike, overrides: dict[str, Any] | None = None
) -> PipelineConfig:
    """Read and validate a pipeline TOML file (``overrides`` merge over its top-level tables)."""
    p = Path(path)
    if not p.is_file():
        raise LmforgeError(f"pipeline file not found: {p}")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise LmforgeError(f"{p}: not valid TOML: {e}") from None
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


# ----------------------------------------------------------------------------- execution

_INPUT_SUFFIXES = (
    ".warc",
    ".arc",
    ".wet",
    ".gz",
    ".lz4",
    ".zst",
    ".jsonl",
    ".json",
    ".parquet",
    ".txt",
    ".jsonl.gz",
    ".jsonl.zst",
)


@dataclass(frozen=True)
class _Stage:
    kind: Literal["stream", "corpus"]
    specs: tuple[StepSpec, ...]


def _stages(specs: tuple[StepSpec, ...]) -> list[_Stage]:
    stages: list[_Stage] = []
    cur: list[StepSpec] = []
    for s in specs:
        if STEP_TYPES[s.type].kind == "corpus":
            if cur:
                stages.append(_Stage("stream", tuple(cur)))
                cur = []
            stages.append(_Stage("corpus", (s,)))
        else:
            cur.append(s)
    if cur or not stages:
        stages.append(_Stage("stream", tuple(cur)))
    return stages


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def run_shard(
    shard: int,
    files: list[str],
    fmt: str,
    text_key: str,
    id_key: str,
    specs: tuple[StepSpec, ...],
    out_dir: str,
    exclusions: bool,
    world_size: int = 1,
) -> dict[str, Any]:
    """Run shard ``shard`` of ``world_size`` end to end (read → steps → write → marker).

    Returns its counters.

    Does nothing but return the stored counters when the shard's marker already exists.
    """
    out = Path(out_dir)
    marker = out / ".done" / f"{_shard_name(shard)}.json"
    if marker.is_file():
        return json.loads(marker.read_text(encoding="utf-8"))
    # Temporary files of an attempt that was killed mid-write: never renamed, so never valid.
    for folder in (out, out / "excluded"):
        for stale in folder.glob(f".{_shard_name(shard)}.*.tmp"):
            stale.unlink(missing_ok=True)
    t0 = time.perf_counter()
    read = ReadStats()
    sink = next((s for s in specs if STEP_TYPES[s.type].kind == "sink"), None)
    excl_path = out / "excluded" / f"{_shard_name(shard)}.jsonl.gz"
    with atomic_write(excl_path, "wb") if exclusions else _nullctx() as excl_raw:
        excl_gz = (
            gzip.GzipFile(fileobj=excl_raw, mode="wb", mtime=0) if excl_raw is not None else None
        )

        def exclude(doc: Document, step: str, reason: str) -> None:
            if excl_gz is not None:
                doc.metadata["excluded_by"], doc.metadata["excluded_reason"] = step, reason
                excl_gz.write(document_to_json(doc).encode("utf-8") + b"\n")

        steps = build_steps(specs, exclusion=exclude)

        def source() -> Iterator[Document]:
            for f in files:
                yield from read_documents(f, fmt, text_key=text_key, id_key=id_key, stats=read)

        docs = run_steps(source(), steps, rank=shard, world_size=world_size)
        if sink is not None:
            from lmforge.data.shards import write_token_shard

            sink_stats = StepStats("tokenize")
            meta = write_token_shard(
                docs,
                out / f"{_shard_name(shard)}.bin",
                _encoder(sink.options.tokenizer),
                source_files=files,
            )
            sink_stats.docs_in = sink_stats.docs_out = meta["documents"]
            sink_stats.notes["tokens"] = meta["count"]
            # Reading and encoding: what the shard took beyond the streaming steps.
            sink_stats.seconds = time.perf_counter() - t0 - sum(x.stats.seconds for x in steps)
        else:
            from lmforge.data.dedup import write_documents

            write_documents(out / f"{_shard_name(shard)}.jsonl.gz", docs, as_text=False)
        if excl_gz is not None:
            excl_gz.close()
    result = {
        "shard": shard,
        "files": files,
        "read": {
            "files": read.files,
            "records": read.records,
            "malformed": dict(read.malformed),
            "bad_files": read.bad_files,
        },
        "steps": [s.stats.to_dict() for s in steps]
        + ([sink_stats.to_dict()] if sink is not None else []),
        "seconds": time.perf_counter() - t0,
    }
    atomic_write_text(marker, json.dumps(result) + "\n")
    return result


@functools.cache
def _encoder(spec: str) -> Any:
    from lmforge.data.shards import load_encoder

    return load_encoder(spec)


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _run_shard_star(args: tuple) -> dict[str, Any]:
    return run_shard(*args)


@dataclass
class PipelineReport:
    """Totals of a run: per-step counters, reader counters, shards run and skipped."""

    steps: list[StepStats]
    records: int = 0
    malformed: dict[str, int] = dataclasses.field(default_factory=dict)
    bad_files: list[str] = dataclasses.field(default_factory=list)
    shards_run: int = 0
    shards_skipped: int = 0
    seconds: float = 0.0
    outputs: list[Path] = dataclasses.field(default_factory=list)

    def table(self) -> str:
        """A markdown table: one row per step with in/out, drops by reason and time."""
        rows = [
            "| step | docs in | docs out | dropped (by reason) | bytes in | bytes out | seconds |",
            "|---|---:|---:|---|---:|---:|---:|",
        ]
        for s in self.steps:
            drops = ", ".join(f"{k} {v}" for k, v in s.dropped.most_common()) or "-"
            notes = ", ".join(f"{k} {v}" for k, v in s.notes.most_common())
            if notes:
                drops += f" ({notes})"
            rows.append(
                f"| {s.name} | {s.docs_in:,} | {s.docs_out:,} | {drops} | {s.bytes_in:,} | "
                f"{s.bytes_out:,} | {s.seconds:.2f} |"
            )
        mal = ", ".join(f"{k} {v}" for k, v in sorted(self.malformed.items())) or "none"
        rows.append(
            f"\nread {self.records:,} records; skipped malformed: {mal}; "
            f"unreadable files: {len(self.bad_files)}; shards run {self.shards_run}, "
            f"already done {self.shards_skipped}; {self.seconds:.1f} s"
        )
        return "\n".join(rows)


def _execute_local(tasks: list[tuple], workers: int, progress: bool) -> list[dict[str, Any]]:
    from tqdm import tqdm

    bar = tqdm(total=len(tasks), desc="shards", unit="shard", disable=not progress)
    results = []
    try:
        if workers <= 1 or len(tasks) <= 1:
            for t in tasks:
                results.append(_run_shard_star(t))
                bar.update(1)
        else:
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(min(workers, len(tasks))) as pool:
                for r in pool.imap_unordered(_run_shard_star, tasks):
                    results.append(r)
                    bar.update(1)
    finally:
        bar.close()
    return results


def _execute_ray(tasks: list[tuple], cfg: PipelineConfig, progress: bool) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise LmforgeError(
            "executor 'ray' needs the ray package (pip install 'ray[data]')"
        ) from None
    from tqdm import tqdm

    started = False
    if not ray.is_initialized():
        ray.init(
            address=cfg.ray_address or None,
            num_cpus=None if cfg.ray_address else cfg.workers,
            include_dashboard=False,
            log_to_driver=False,
        )
        started = True
    try:
        remote = ray.remote(num_cpus=1)(run_shard)
        pending = [remote.remote(*t) for t in tasks]
        results = []
        with tqdm(total=len(tasks), desc="shards (ray)", unit="shard", disable=not progress) as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                results.extend(ray.get(done))
                bar.update(len(done))
        return results
    finally:
        if started:
            ray.shutdown()


def _run_corpus_stage(
    spec: StepSpec, files: list[str], fmt: str, out: Path, workers: int
) -> dict[str, Any]:
    from lmforge.data import dedup

    marker = out / ".done" / "stage.json"
    if marker.is_file():
        return json.loads(marker.read_text(encoding="utf-8"))
    # A killed attempt leaves its scratch folder behind; the stage restarts from scratch.
    for stale in out.glob(".dedup-*"):
        shutil.rmtree(stale, ignore_errors=True)
    t0 = time.perf_counter()
    o = spec.options
    if spec.type == "exact_dedup":
        st = dedup.exact_document_deduplication(
            files, out, fmt=fmt, workers=workers, num_buckets=o.num_buckets
        )
    elif spec.type == "line_dedup":
        st = dedup.exact_line_deduplication(
            files, out, fmt=fmt, workers=workers, num_buckets=o.num_buckets
        )
    else:
        st = dedup.minhash_deduplication(
            files,
            o.num_hashes,
            o.num_bands,
            o.ngrams,
            o.jaccard_threshold,
            out,
            fmt=fmt,
            workers=workers,
            seed=o.seed,
            num_partitions=o.num_partitions,
        )
    stats = StepStats(spec.type, docs_in=st.docs_in, docs_out=st.docs_out)
    if spec.type == "line_dedup":
        stats.notes["lines_in"], stats.notes["lines_removed"] = (
            st.lines_in,
            st.lines_in - st.lines_out,
        )
    if st.docs_in and st.docs_out < st.docs_in:
        stats.dropped["duplicate" if spec.type != "line_dedup" else "empty_after_lines"] = (
            st.docs_in - st.docs_out
        )
    stats.seconds = time.perf_counter() - t0
    result = {"steps": [stats.to_dict()], "outputs": [str(p) for p in st.outputs]}
    atomic_write_text(marker, json.dumps(result) + "\n")
    return result


def run_pipeline(cfg: PipelineConfig, *, progress: bool = True) -> PipelineReport:
    """Run a validated pipeline; finished shards (by marker) are skipped. Returns the totals."""
    from lmforge.utils.corpus import expand_inputs

    t0 = time.perf_counter()
    files = [str(p) for p in expand_inputs(list(cfg.input.paths), _INPUT_SUFFIXES)]
    fmt = cfg.input.format
    if fmt not in FORMATS:
        raise LmforgeError(f"unknown input format {fmt!r}")
    stages = _stages(cfg.steps)
    root = Path(cfg.output.dir)
    # The resolved pipeline (defaults filled in) is kept beside its outputs.
    resolved = json.dumps(config_to_dict(cfg), indent=1, sort_keys=True) + "\n"
    if not (root / "pipeline.json").is_file() or (root / "pipeline.json").read_text() != resolved:
        atomic_write_text(root / "pipeline.json", resolved)
    merged: dict[str, StepStats] = {}
    order: list[str] = []
    report = PipelineReport(steps=[])

    def merge(step_dicts: list[dict[str, Any]]) -> None:
        for d in step_dicts:
            s = StepStats.from_dict(d)
            if s.name not in merged:
                merged[s.name] = StepStats(s.name)
                order.append(s.name)
            merged[s.name].merge(s)

    for k, stage in enumerate(stages):
        last = k == len(stages) - 1
        out = root if last else root / f"_stage{k}"
        if stage.kind == "corpus":
            res = _run_corpus_stage(stage.specs[0], files, fmt, out, cfg.workers)
            merge(res["steps"])
            files = res["outputs"]
        else:
            n = (cfg.output.shards or len(files)) if k == 0 else len(files)
            n = max(n, 1)
            tasks = [
                (
                    i,
                    files[i::n],
                    fmt,
                    cfg.input.text_key,
                    cfg.input.id_key,
                    stage.specs,
                    str(out),
                    cfg.output.exclusions,
                    n,
                )
                for i in range(n)
            ]
            done_before = sum(
                (out / ".done" / f"{_shard_name(i)}.json").is_file() for i in range(n)
            )
            if cfg.executor == "ray":
                results = _execute_ray(tasks, cfg, progress)
            else:
                results = _execute_local(tasks, cfg.workers, progress)
            results.sort(key=lambda r: r["shard"])
            report.shards_run += n - done_before
            report.shards_skipped += done_before
            for r in results:
                merge(r["steps"])
                if k == 0:
                    report.records += r["read"]["records"]
                    for key, v in r["read"]["malformed"].items():
                        report.malformed[key] = report.malformed.get(key, 0) + v
                    report.bad_files.extend(r["read"]["bad_files"])
            sink = any(STEP_TYPES[s.type].kind == "sink" for s in stage.specs)
            ext = ".bin" if sink else ".jsonl.gz"
            files = [str(out / f"{_shard_name(i)}{ext}") for i in range(n)]
        fmt = "jsonl"
    report.steps = [merged[n] for n in order]
    report.outputs = [Path(f) for f in files]
    report.seconds = time.perf_counter() - t0
    return report
