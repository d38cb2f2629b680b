"""Where pipeline work runs: one shard task, one corpus stage, and the local and Ray executors.

* A streaming stage runs per shard: shard ``i`` reads input files ``i, i + shards, …``, applies
  the steps and writes ``shard-0000i.jsonl.gz`` (or ``.bin`` for tokenize) atomically, then a
  completion marker ``.done/shard-0000i.json`` holding its counters and the stage fingerprint.
  A rerun skips shards whose marker carries the same fingerprint, so a killed run resumes
  without redoing or duplicating finished shards.
* A corpus stage (exact_dedup, line_dedup, minhash_dedup) runs its MapReduce passes with the
  driver's local worker processes under both executors (simplification: no Ray dedup) and is
  marked done as a whole (``.done/stage.json``): a run killed inside one redoes that stage only.
* :func:`prepare_stage` compares a stage folder's recorded fingerprint with the new one; on a
  change it removes that stage's outputs and markers (so shards of two settings never mix) and
  says which keys changed.

Pool workers exit when the driver dies (:func:`lmforge.utils.procs.exit_with_parent`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gzip
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmforge.data.core import Document, StepStats, run_steps
from lmforge.data.readers import ReadStats, document_to_json, read_documents
from lmforge.data.schema import STEP_TYPES, PipelineConfig, StepSpec, build_steps, describe_change
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write, atomic_write_text
from lmforge.utils.procs import exit_with_parent

# Beside (not inside) .done/: the stage's fingerprint and the settings it hashes.
STAGE_RECORD = ".stage.json"


def shard_name(i: int) -> str:
    """``shard-0000i``: the stem of shard ``i``'s output, marker and exclusions."""
    return f"shard-{i:05d}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # missing, or cut off by a crash of an older, non-atomic writer


def clear_stage(out: Path) -> None:
    """Remove a stage's outputs, exclusions, markers and scratch (never other stages' folders)."""
    done = out / ".done"
    record = _read_json(done / "stage.json") or {}
    for f in record.get("outputs", []):
        Path(f).unlink(missing_ok=True)
    for pattern in ("shard-*", ".shard-*.tmp"):
        for f in out.glob(pattern):
            if f.is_file():
                f.unlink()
    for folder in (done, out / "excluded"):
        shutil.rmtree(folder, ignore_errors=True)
    for stale in out.glob(".dedup-*"):
        shutil.rmtree(stale, ignore_errors=True)


def prepare_stage(out: Path, name: str, fp: str, signature: dict[str, Any]) -> str | None:
    """Make ``out`` hold only outputs of the stage with fingerprint ``fp``.

    Returns a one-line note when earlier outputs were removed because the stage changed.
    """
    done = out / ".done"
    record = _read_json(out / STAGE_RECORD)
    note = None
    if record is not None and record.get("fingerprint") == fp:
        return None
    if record is not None:
        change = describe_change(record.get("signature", {}), signature)
        note = f"{name}: changed since the last run ({change}); redoing it"
        clear_stage(out)
    elif done.is_dir() and any(done.iterdir()):
        # Markers from before fingerprints existed: nothing says which settings made them.
        note = f"{name}: completion markers without a fingerprint (older run); redoing it"
        clear_stage(out)
    atomic_write_text(
        out / STAGE_RECORD,
        json.dumps({"fingerprint": fp, "signature": signature}, indent=1, sort_keys=True) + "\n",
    )
    return note


def _disk_full(e: OSError, out: Path, kept: str) -> LmforgeError:
    return LmforgeError(f"no space left on the device holding {out} ({kept}); free space and rerun")


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
    fp: str = "",
) -> dict[str, Any]:
    """Run shard ``shard`` of ``world_size`` end to end (read → steps → write → marker).

    Returns its counters; returns the stored counters without work when the shard's marker
    already exists with fingerprint ``fp``.
    """
    out = Path(out_dir)
    marker = out / ".done" / f"{shard_name(shard)}.json"
    previous = _read_json(marker) if marker.is_file() else None
    if previous is not None and previous.get("fingerprint", "") == fp:
        return previous
    # Temporary files of an attempt that was killed mid-write: never renamed, so never valid.
    for folder in (out, out / "excluded"):
        for stale in folder.glob(f".{shard_name(shard)}.*.tmp"):
            stale.unlink(missing_ok=True)
    try:
        result = _run_shard(shard, files, fmt, text_key, id_key, specs, out, exclusions, world_size)
        result["fingerprint"] = fp
        atomic_write_text(marker, json.dumps(result) + "\n")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _disk_full(
                e, out, f"shard {shard} not written; finished shards are kept and marked done"
            ) from None
        raise
    return result


def _run_shard(
    shard: int,
    files: list[str],
    fmt: str,
    text_key: str,
    id_key: str,
    specs: tuple[StepSpec, ...],
    out: Path,
    exclusions: bool,
    world_size: int,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    read = ReadStats()
    sink = next((s for s in specs if STEP_TYPES[s.type].kind == "sink"), None)
    excl_path = out / "excluded" / f"{shard_name(shard)}.jsonl.gz"
    with atomic_write(excl_path, "wb") if exclusions else contextlib.nullcontext() as excl_raw:
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
                out / f"{shard_name(shard)}.bin",
                _encoder(sink.options.tokenizer),
                source_files=files,
            )
            sink_stats.docs_in = sink_stats.docs_out = meta["documents"]
            sink_stats.notes["tokens"] = meta["count"]
            # Reading and encoding: what the shard took beyond the streaming steps.
            sink_stats.seconds = time.perf_counter() - t0 - sum(x.stats.seconds for x in steps)
        else:
            from lmforge.data.dedup import write_documents

            write_documents(out / f"{shard_name(shard)}.jsonl.gz", docs, as_text=False)
        if excl_gz is not None:
            excl_gz.close()
    return {
        "shard": shard,
        "files": files,
        "read": {
            "files": read.files,
            "records": read.records,
            "malformed": dict(read.malformed),
            "bad_files": read.bad_files,
            "invalid_utf8_bytes": read.invalid_utf8_bytes,
            "invalid_utf8_records": read.invalid_utf8_records,
            "decoded": dict(read.decoded),
        },
        "steps": [s.stats.to_dict() for s in steps]
        + ([sink_stats.to_dict()] if sink is not None else []),
        "seconds": time.perf_counter() - t0,
    }


@functools.cache
def _encoder(spec: str) -> Any:
    from lmforge.data.shards import load_encoder

    return load_encoder(spec)


def _run_shard_star(args: tuple) -> dict[str, Any]:
    return run_shard(*args)


def execute_local(tasks: list[tuple], workers: int, progress: bool) -> list[dict[str, Any]]:
    """Run shard tasks in this process, or in a spawn pool of ``workers`` processes."""
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

            n = min(workers, len(tasks))
            ctx = mp.get_context("spawn")
            with ctx.Pool(n, initializer=exit_with_parent, initargs=(os.getpid(),)) as pool:
                for r in pool.imap_unordered(_run_shard_star, tasks):
                    results.append(r)
                    bar.update(1)
    finally:
        bar.close()
    return results


def execute_ray(tasks: list[tuple], cfg: PipelineConfig, progress: bool) -> list[dict[str, Any]]:
    """Run shard tasks as Ray tasks (``cfg.workers`` CPUs when Ray is started here)."""
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


def run_corpus_stage(
    spec: StepSpec, files: list[str], fmt: str, out: Path, workers: int, fp: str = ""
) -> dict[str, Any]:
    """Run one corpus step (exact, line or MinHash dedup) over ``files`` into ``out``."""
    marker = out / ".done" / "stage.json"
    previous = _read_json(marker) if marker.is_file() else None
    if previous is not None and previous.get("fingerprint", "") == fp:
        return previous
    # A killed attempt leaves its scratch folder behind; the stage restarts from scratch.
    for stale in out.glob(".dedup-*"):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        result = _run_corpus(spec, files, fmt, out, workers)
        result["fingerprint"] = fp
        atomic_write_text(marker, json.dumps(result) + "\n")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _disk_full(
                e, out, f"{spec.type} not finished; earlier stages are kept and marked done"
            ) from None
        raise
    return result


def _run_corpus(spec: StepSpec, files: list[str], fmt: str, out: Path, workers: int) -> dict:
    from lmforge.data import dedup

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
    return {"steps": [stats.to_dict()], "outputs": [str(p) for p in st.outputs]}
