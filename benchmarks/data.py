"""Data pipeline benchmarks: web-text throughput against datatrove, and MinHash dedup quality.

1. Throughput, documents per second on one core: WARC → HTML text → language ID → Gopher →
   PII on the real WARC files in ../shared/data/web (repeated ``--warc-repeat`` times), lmforge
   and datatrove (0.10, same steps: WarcReader, extractor, LanguageFilter with the same LID-176
   lite model, GopherRepetitionFilter + GopherQualityFilter, PIIFormatter) run alternately in one
   process, ``--rounds`` times, medians reported. datatrove is measured twice: with an extractor
   that calls resiliparse exactly as lmforge does (same work), and with its stock Trafilatura
   extractor. datatrove, warcio, faust-cchardet, python-magic and trafilatura are benchmark-only
   dependencies.
2. MinHash + LSH deduplication on a synthetic corpus with planted near-duplicate pairs (edits,
   insertions, deletions and block reorderings; each pair's true Jaccard measured exactly):
   precision and recall of the pairs at or above the threshold, time and peak memory (max RSS of
   the deduplicating process and of its largest worker; the corpus is generated beforehand in
   another process).

Run: ``PYTHONPATH=src python benchmarks/data.py [--minhash-docs 100000] [--results benchmarks/RESULTS.md]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "web"
WARCS = [
    "dolma/sample-0000.warc.gz",
    "dolma/sample-0001.warc.gz",
    "resiliparse/warcfile.warc.gz",
    "cc_whirlwind/whirlwind.warc.gz",
]


# ----------------------------------------------------------------------------- throughput


def _warc_folder(tmp: Path, repeat: int) -> list[Path]:
    files = []
    for r in range(repeat):
        for name in WARCS:
            src = SHARED / name
            dst = tmp / f"{r:03d}_{src.parent.name}_{src.name}"
            os.symlink(src, dst)
            files.append(dst)
    return files


def _run_lmforge(files: list[Path]) -> tuple[int, int]:
    from lmforge.data import (
        GopherFilter,
        HtmlStep,
        LanguageFilter,
        PiiStep,
        read_documents,
        run_steps,
    )

    def source():
        for f in files:
            yield from read_documents(f, "warc")

    steps = [HtmlStep(), LanguageFilter(), GopherFilter(), PiiStep()]
    n_out = sum(1 for _ in run_steps(source(), steps))
    return steps[0].stats.docs_in, n_out


def _datatrove_steps(folder: Path, extractor: str) -> list:
    from datatrove.pipeline.extractors import Trafilatura
    from datatrove.pipeline.extractors.base import BaseExtractor
    from datatrove.pipeline.filters import (
        GopherQualityFilter,
        GopherRepetitionFilter,
        LanguageFilter,
    )
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.readers import WarcReader
    from datatrove.utils.word_tokenizers import WordTokenizer
    from fasttext.FastText import _FastText

    from lmforge.data.langid import bundled_lid_model_path

    class ResiliparseExtractor(BaseExtractor):
        """datatrove extractor calling resiliparse exactly as lmforge's html step does."""

        name = "resiliparse"

        def __init__(self, timeout: float = 1.0) -> None:
            super().__init__(timeout)

        def extract(self, text: str) -> str:
            from resiliparse.extract.html2text import extract_plain_text

            return extract_plain_text(text).strip()

    # datatrove checks for the distribution "fasttext-numpy2-wheel"; the venv has the same module
    # from "fasttext-numpy2", so skip that name check.
    LanguageFilter._requires_dependencies = ["fasteners"]

    class WhitespaceWords(WordTokenizer):
        """Whitespace word splitting, as lmforge's Gopher rules do (no spaCy needed)."""

        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return [s for s in text.split("\n") if s.strip()]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            raise NotImplementedError

    lang = LanguageFilter(languages=["en"], language_threshold=0.65)
    # datatrove would download lid.176.bin; give it the same offline lite model lmforge uses.
    lang.model._model = _FastText(str(bundled_lid_model_path()))
    ext = (
        ResiliparseExtractor() if extractor == "resiliparse" else Trafilatura(favour_precision=True)
    )
    return [
        WarcReader(str(folder), glob_pattern="*.warc.gz", doc_progress=False),
        ext,
        lang,
        # English defaults to spaCy word splitting in datatrove; whitespace splitting does the same
        # work as lmforge's Gopher rules (and needs no spaCy).
        GopherRepetitionFilter(language=WhitespaceWords()),
        GopherQualityFilter(language=WhitespaceWords()),
        PIIFormatter(),
    ]


def _run_datatrove(folder: Path, extractor: str) -> tuple[int, int]:
    steps = _datatrove_steps(folder, extractor)
    n_in = 0

    def counted(docs):
        nonlocal n_in
        for d in docs:
            n_in += 1
            yield d

    pipe = counted(steps[0].run(None, 0, 1))
    for s in steps[1:]:
        pipe = s.run(pipe, 0, 1)
    n_out = sum(1 for _ in pipe)
    return n_in, n_out


def throughput(repeat: int, rounds: int) -> list[tuple[str, float, int, int]]:
    import logging

    from datatrove.utils.logging import logger

    logger.remove()
    logging.disable(logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-bench-"))
    try:
        files = _warc_folder(tmp, repeat)
        runners = {
            "lmforge (resiliparse)": lambda: _run_lmforge(files),
            "datatrove (resiliparse extractor)": lambda: _run_datatrove(tmp, "resiliparse"),
            "datatrove (stock Trafilatura)": lambda: _run_datatrove(tmp, "trafilatura"),
        }
        # Warm-up on one pass: model loads and imports are not steady-state throughput.
        warm = tmp / "warm"
        warm.mkdir()
        warm_files = _warc_folder(warm, 1)
        _run_lmforge(warm_files)
        _run_datatrove(warm, "resiliparse")
        _run_datatrove(warm, "trafilatura")
        times: dict[str, list[float]] = {k: [] for k in runners}
        counts: dict[str, tuple[int, int]] = {}
        for _ in range(rounds):
            for name, fn in runners.items():
                t0 = time.perf_counter()
                counts[name] = fn()
                times[name].append(time.perf_counter() - t0)
        rows = []
        for name in runners:
            med = statistics.median(times[name])
            n_in, n_out = counts[name]
            rows.append((name, n_in / med, n_in, n_out))
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- MinHash


def _edit(words: list[str], rng: random.Random, vocab: list[str], edits: int) -> list[str]:
    w = list(words)
    for _ in range(edits):
        op = rng.random()
        if op < 0.4 and w:
            w[rng.randrange(len(w))] = rng.choice(vocab)  # substitution
        elif op < 0.7:
            w.insert(rng.randrange(len(w) + 1), rng.choice(vocab))  # insertion
        elif op < 0.85 and len(w) > 10:
            del w[rng.randrange(len(w))]  # deletion
        elif len(w) > 20:
            i = rng.randrange(len(w) - 12)  # reorder: move a block elsewhere
            block = w[i : i + rng.randint(3, 12)]
            del w[i : i + len(block)]
            k = rng.randrange(len(w) + 1)
            w[k:k] = block
    return w


def make_planted_corpus(out: Path, n_docs: int, dup_fraction: float, seed: int, ngrams: int,
                        n_files: int = 10) -> list[tuple[str, str, float]]:  # fmt: skip
    """Write ``n_docs`` JSONL docs (shuffled into ``n_files``) including planted pairs.

    Returns the planted pairs (id, id, true Jaccard). Base documents draw from a 50k-word
    vocabulary, so unplanted pairs share essentially no 5-grams.
    """
    from lmforge.data import jaccard

    rng = random.Random(seed)
    vocab = [f"{chr(97 + i % 26)}{chr(97 + (i // 26) % 26)}w{i}" for i in range(50_000)]
    n_pairs = int(n_docs * dup_fraction / 2)
    docs: list[tuple[str, str]] = []
    pairs = []
    for i in range(n_docs - n_pairs):
        words = [rng.choice(vocab) for _ in range(rng.randint(80, 300))]
        docs.append((f"d{i}", " ".join(words)))
        if i < n_pairs:
            edits = rng.choice([0, 1, 2, 4, 6, 8, 12, 16, 24, 32, 48])
            var = " ".join(_edit(words, rng, vocab, edits))
            docs.append((f"d{i}v", var))
            pairs.append((f"d{i}", f"d{i}v", jaccard(docs[-2][1], var, ngrams)))
    rng.shuffle(docs)
    out.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        with open(out / f"part{f:02d}.jsonl", "w") as fh:
            for did, text in docs[f::n_files]:
                fh.write(json.dumps({"id": did, "text": text}) + "\n")
    return pairs


def _minhash_generate(args: argparse.Namespace) -> None:
    tmp = Path(args.minhash_child)
    pairs = make_planted_corpus(tmp / "in", args.minhash_docs, 0.2, 0, args.ngrams)
    (tmp / "pairs.json").write_text(json.dumps(pairs))


def _minhash_child(args: argparse.Namespace) -> None:
    # A fresh process that only deduplicates, so its peak RSS is the dedup's alone.
    import gzip

    from lmforge.data import minhash_deduplication

    tmp = Path(args.minhash_child)
    pairs = json.loads((tmp / "pairs.json").read_text())
    files = sorted((tmp / "in").glob("*.jsonl"))
    t0 = time.perf_counter()
    st = minhash_deduplication(
        files, args.num_hashes, args.num_bands, args.ngrams, args.threshold, tmp / "out",
        workers=args.workers,
    )  # fmt: skip
    secs = time.perf_counter() - t0
    rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    kept = set()
    for p in (tmp / "out").glob("*.jsonl.gz"):
        for line in gzip.decompress(p.read_bytes()).splitlines():
            kept.add(json.loads(line)["id"])
    removed_total = st.docs_in - st.docs_out
    truth = [(a, b) for a, b, j in pairs if j >= args.threshold]
    detected = sum((a in kept) != (b in kept) for a, b in truth)
    print(
        json.dumps(
            {
                "docs": st.docs_in,
                "planted_pairs": len(pairs),
                "pairs_at_or_above": len(truth),
                "removed": removed_total,
                "detected": detected,
                "precision": detected / removed_total if removed_total else 1.0,
                "recall": detected / len(truth) if truth else 1.0,
                "seconds": secs,
                "peak_rss_mib": rss_self / 1024,
                "peak_worker_rss_mib": rss_child / 1024,
                "candidates": st.candidate_pairs,
                "jaccard_hist": _hist([j for _, _, j in pairs]),
            }
        )
    )


def _hist(js: list[float]) -> dict[str, int]:
    bins = {"<0.5": 0, "0.5-0.7": 0, "0.7-0.8": 0, "0.8-0.9": 0, ">=0.9": 0}
    for j in js:
        k = (
            "<0.5"
            if j < 0.5
            else "0.5-0.7"
            if j < 0.7
            else "0.7-0.8"
            if j < 0.8
            else "0.8-0.9"
            if j < 0.9
            else ">=0.9"
        )
        bins[k] += 1
    return bins


def minhash(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-minhash-"))
    try:
        base = [sys.executable, __file__, "--minhash-child", str(tmp), "--minhash-docs",
                str(args.minhash_docs), "--num-hashes", str(args.num_hashes), "--num-bands",
                str(args.num_bands), "--ngrams", str(args.ngrams), "--threshold",
                str(args.threshold), "--workers", str(args.workers)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        subprocess.run([*base, "--minhash-phase", "generate"], env=env, check=True)
        out = subprocess.run(base, capture_output=True, text=True, env=env, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--warc-repeat", type=int, default=10, help="passes over the real WARC files")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per system")
    ap.add_argument(
        "--minhash-docs", type=int, default=20_000, help="documents in the dedup corpus"
    )
    ap.add_argument("--num-hashes", type=int, default=120)
    ap.add_argument("--num-bands", type=int, default=20)
    ap.add_argument("--ngrams", type=int, default=5)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--workers", type=int, default=1, help="processes for the dedup passes")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-minhash", action="store_true")
    ap.add_argument("--results", help="append the tables to this markdown file")
    ap.add_argument("--minhash-child", help=argparse.SUPPRESS)
    ap.add_argument("--minhash-phase", default="dedup", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.minhash_child:
        (_minhash_generate if args.minhash_phase == "generate" else _minhash_child)(args)
        return
    lines = []
    if not args.skip_throughput:
        if not SHARED.is_dir():
            sys.exit(f"real WARC files not found under {SHARED}")
        rows = throughput(args.warc_repeat, args.rounds)
        base = rows[1][1]
        lines += [
            f"WARC → text → language ID → Gopher → PII, one process, {args.warc_repeat}× "
            f"{len(WARCS)} real WARC files, median of {args.rounds} alternating rounds",
            "",
            "| pipeline | docs/s (1 core) | vs datatrove (same extractor) | docs in | docs out |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, rate, n_in, n_out in rows:
            lines.append(f"| {name} | {rate:,.1f} | {rate / base:.2f}× | {n_in:,} | {n_out:,} |")
        lines.append("")
    if not args.skip_minhash:
        m = minhash(args)
        lines += [
            f"MinHash + LSH dedup: {m['docs']:,} docs, {m['planted_pairs']:,} planted pairs "
            f"(true Jaccard histogram {m['jaccard_hist']}), num_hashes {args.num_hashes}, "
            f"bands {args.num_bands}, {args.ngrams}-grams, threshold {args.threshold}, "
            f"workers {args.workers}",
            "",
            "| pairs ≥ threshold | removed | precision | recall | candidates | seconds "
            "| peak RSS (driver / largest worker) |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            f"| {m['pairs_at_or_above']:,} | {m['removed']:,} | {m['precision']:.4f} | "
            f"{m['recall']:.4f} | {m['candidates']:,} | {m['seconds']:.1f} | "
            f"{m['peak_rss_mib']:.0f} MiB / {m['peak_worker_rss_mib']:.0f} MiB |",
            "",
        ]
    table = "\n".join(lines)
    print(table)
    if args.results:
        from importlib import metadata

        import numpy

        try:
            dt = metadata.version("datatrove")
        except metadata.PackageNotFoundError:
            dt = "absent"
        head = (
            f"\n## data pipeline (benchmarks/data.py) — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n\n"
            f"Device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores shared "
            f"with other jobs; load average {os.getloadavg()[0]:.1f} at the end). Python "
            f"{platform.python_version()}, numpy {numpy.__version__}, datatrove {dt}.\n"
            f"Command: `PYTHONPATH=src python benchmarks/data.py {' '.join(sys.argv[1:])}`\n\n"
        )
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(head + table + "\n")


if __name__ == "__main__":
    main()
