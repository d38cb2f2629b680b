"""Pipelines from TOML: validated steps, sharded idempotent outputs, local and Ray executors.

A pipeline file names its input, its output, an executor and a list of ``[[steps]]``; the schema
and its validation are in :mod:`lmforge.data.schema`, each step's class and options beside its
logic (``extract``, ``langid``, ``quality``, ``pii``, ``classifier``, ``contamination``,
``dedup``, ``shards``), and where the work runs in :mod:`lmforge.data.executors`. This module
only strings the stages together and totals their counters.

Streaming steps (html, language, gopher, c4, pii, classifier, contamination, tokenize) run per
shard; corpus steps (exact_dedup, line_dedup, minhash_dedup) need the whole corpus and split the
pipeline into stages. Each stage writes to ``OUT/_stageK/`` (the last stage to ``OUT/``). Every
completion marker carries its stage's fingerprint (options, inputs, shard layout): a rerun skips
what is done and unchanged, and redoes, saying which keys changed, a stage whose settings or
inputs changed, with every stage after it. ``OUT/pipeline.json`` (the resolved file) is written
when the run completes and removed when a changed run starts, so it never describes outputs that
another setting produced.

Dropped documents go to ``OUT/excluded/shard-*.jsonl.gz`` with ``excluded_by``/``excluded_reason``
metadata when ``[output] exclusions = true`` (streaming steps; dedup drops are counted only).

Exercised by ``lmforge data run configs/pipelines/web.toml`` and ``tests/test_data_pipeline.py``.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.data.classifier import ClassifierFilter, ClassifierOptions
from lmforge.data.contamination import ContaminationFilter, ContaminationOptions
from lmforge.data.core import StepStats
from lmforge.data.dedup import DedupOptions, MinhashOptions
from lmforge.data.executors import (
    execute_local,
    execute_ray,
    prepare_stage,
    run_corpus_stage,
    run_shard,
    shard_name,
)
from lmforge.data.extract import HtmlOptions, HtmlStep
from lmforge.data.langid import LanguageFilter, LanguageOptions
from lmforge.data.pii import PiiOptions, PiiStep
from lmforge.data.quality import C4Step, GopherFilter
from lmforge.data.readers import FORMATS
from lmforge.data.schema import (
    STEP_TYPES,
    InputConfig,
    OutputConfig,
    PipelineConfig,
    StepSpec,
    build_steps,
    fingerprint,
    input_signature,
    load_pipeline,
    parse_pipeline,
    split_stages,
    stage_signature,
)
from lmforge.data.shards import TokenizeOptions
from lmforge.utils.config import config_to_dict
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write_text

__all__ = [
    "STEP_TYPES",
    "C4Step",
    "ClassifierFilter",
    "ClassifierOptions",
    "ContaminationFilter",
    "ContaminationOptions",
    "DedupOptions",
    "GopherFilter",
    "HtmlOptions",
    "HtmlStep",
    "InputConfig",
    "LanguageFilter",
    "LanguageOptions",
    "MinhashOptions",
    "OutputConfig",
    "PiiOptions",
    "PiiStep",
    "PipelineConfig",
    "PipelineReport",
    "StepSpec",
    "TokenizeOptions",
    "build_steps",
    "load_pipeline",
    "parse_pipeline",
    "run_pipeline",
    "run_shard",
]

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


@dataclass
class PipelineReport:
    """Totals of a run: per-step counters, reader counters, shards run and skipped."""

    steps: list[StepStats]
    records: int = 0
    malformed: dict[str, int] = dataclasses.field(default_factory=dict)
    bad_files: list[str] = dataclasses.field(default_factory=list)
    invalid_utf8_bytes: int = 0
    invalid_utf8_records: int = 0
    decoded: dict[str, int] = dataclasses.field(default_factory=dict)
    shards_run: int = 0
    shards_skipped: int = 0
    seconds: float = 0.0
    outputs: list[Path] = dataclasses.field(default_factory=list)
    changes: list[str] = dataclasses.field(default_factory=list)

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
        dec = ", ".join(f"{k} {v}" for k, v in sorted(self.decoded.items()))
        rows.append(
            f"\nread {self.records:,} records; skipped malformed: {mal}; "
            f"unreadable files: {len(self.bad_files)}; "
            f"invalid UTF-8: {self.invalid_utf8_bytes:,} bytes replaced in "
            f"{self.invalid_utf8_records:,} records; "
            + (f"HTTP bodies decoded: {dec}; " if dec else "")
            + f"shards run {self.shards_run}, already done {self.shards_skipped}; "
            f"{self.seconds:.1f} s"
        )
        return "\n".join(rows)


def _say(msg: str) -> None:
    print(f"lmforge data run: {msg}", file=sys.stderr, flush=True)


def _stage_name(k: int, specs: tuple[StepSpec, ...]) -> str:
    return f"stage {k} ({', '.join(s.type for s in specs) or 'copy'})"


def run_pipeline(
    cfg: PipelineConfig, *, progress: bool = True, log: Callable[[str], None] | None = _say
) -> PipelineReport:
    """Run a validated pipeline; finished, unchanged shards are skipped. Returns the totals.

    ``log`` receives one line per stage redone because its settings or inputs changed.
    """
    from lmforge.utils.corpus import expand_inputs

    t0 = time.perf_counter()
    files = [str(p) for p in expand_inputs(list(cfg.input.paths), _INPUT_SUFFIXES)]
    fmt = cfg.input.format
    if fmt not in FORMATS:
        raise LmforgeError(f"unknown input format {fmt!r}")
    stages = split_stages(cfg.steps)
    root = Path(cfg.output.dir)
    resolved = json.dumps(config_to_dict(cfg), indent=1, sort_keys=True) + "\n"
    record = root / "pipeline.json"
    try:
        if record.is_file() and record.read_text(encoding="utf-8") != resolved:
            record.unlink()  # its outputs may be redone below: it must not vouch for them
    except OSError:
        pass
    merged: dict[str, StepStats] = {}
    order: list[str] = []
    report = PipelineReport(steps=[])
    upstream = fingerprint(input_signature(files, fmt, cfg.input.text_key, cfg.input.id_key))

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
            n = 0
        else:
            n = max((cfg.output.shards or len(files)) if k == 0 else len(files), 1)
        signature = stage_signature(k, stage, upstream, n, cfg.output.exclusions)
        fp = fingerprint(signature)
        note = _prepared(out, _stage_name(k, stage.specs), fp, signature)
        if note:
            report.changes.append(note)
            if log is not None:
                log(note)
        if stage.kind == "corpus":
            res = run_corpus_stage(stage.specs[0], files, fmt, out, cfg.workers, fp)
            merge(res["steps"])
            files = res["outputs"]
        else:
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
                    fp,
                )
                for i in range(n)
            ]
            done_before = sum(
                _marked(out / ".done" / f"{shard_name(i)}.json", fp) for i in range(n)
            )
            if cfg.executor == "ray":
                results = execute_ray(tasks, cfg, progress)
            else:
                results = execute_local(tasks, cfg.workers, progress)
            results.sort(key=lambda r: r["shard"])
            report.shards_run += n - done_before
            report.shards_skipped += done_before
            for r in results:
                merge(r["steps"])
                if k == 0:
                    _add_read(report, r["read"])
            sink = any(STEP_TYPES[s.type].kind == "sink" for s in stage.specs)
            ext = ".bin" if sink else ".jsonl.gz"
            files = [str(out / f"{shard_name(i)}{ext}") for i in range(n)]
        fmt = "jsonl"
        upstream = fp
    report.steps = [merged[n] for n in order]
    report.outputs = [Path(f) for f in files]
    report.seconds = time.perf_counter() - t0
    # Written last: it describes outputs that are all there and all made by this setting.
    try:
        atomic_write_text(record, resolved)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise LmforgeError(
            f"no space left on the device holding {root} (every stage is done and marked; "
            "only pipeline.json is missing); free space and rerun"
        ) from None
    return report


def _prepared(out: Path, name: str, fp: str, signature: dict[str, Any]) -> str | None:
    try:
        return prepare_stage(out, name, fp, signature)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise LmforgeError(
                f"no space left on the device holding {out} (nothing of {name} written; "
                "earlier stages are kept and marked done); free space and rerun"
            ) from None
        raise


def _marked(marker: Path, fp: str) -> bool:
    try:
        return json.loads(marker.read_text(encoding="utf-8")).get("fingerprint", "") == fp
    except (OSError, ValueError):
        return False


def _add_read(report: PipelineReport, read: dict[str, Any]) -> None:
    report.records += read["records"]
    for key, v in read["malformed"].items():
        report.malformed[key] = report.malformed.get(key, 0) + v
    report.bad_files.extend(read["bad_files"])
    report.invalid_utf8_bytes += read.get("invalid_utf8_bytes", 0)
    report.invalid_utf8_records += read.get("invalid_utf8_records", 0)
    for key, v in read.get("decoded", {}).items():
        report.decoded[key] = report.decoded.get(key, 0) + v
