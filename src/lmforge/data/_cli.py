"""``lmforge data …``: download corpora, run pipelines, train classifiers, dedup, plan mixtures.

Imports nothing heavy at module level; each handler imports what it needs.
"""

from __future__ import annotations

import argparse
import textwrap

from lmforge.utils.errors import LmforgeError

_RAW = argparse.RawDescriptionHelpFormatter
_READABLE = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".txt", ".parquet", ".gz", ".warc", ".wet")


def _wrap(text: str) -> str:
    # RawDescriptionHelpFormatter keeps the examples' layout but would not wrap prose either.
    return textwrap.fill(text, 88)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``data`` and its subcommands to the top-level parser."""
    p = sub.add_parser(
        "data",
        help="download corpora; run WARC → text → filter → dedup → mix pipelines",
        description=_wrap("Data: downloads and streaming pipelines (lmforge.data)."),
        epilog="examples:\n"
        "  lmforge data run configs/pipelines/web.toml\n"
        "  lmforge data dedup minhash 'examples/web/*.jsonl' --out runs/dedup/\n"
        "  lmforge data download tinystories-valid --out data/     # needs the network\n"
        "\ninputs under examples/ ship with the repository (examples/README.md).\n",
        formatter_class=_RAW,
    )
    ds = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: (p.print_help(), 0)[1])

    d = ds.add_parser(
        "download",
        help="download a public corpus (resumable, checksummed)",
        description=_wrap(
            "Download a registry dataset over HTTP into --out. Transfers resume from "
            "FILE.part with HTTP Range requests; sizes are checked and SHA-256 verified. Where the "
            "registry has no checksum (the Hugging Face files here), the first complete download "
            "records it in FILE.sha256 and later runs verify against that sidecar "
            "(trust on first use). A mismatch deletes the partial file and fails with one line."
        ),
        epilog="examples:\n"
        "  lmforge data download --list\n"
        "  lmforge data download tinystories-valid --out data/\n"
        "  lmforge data download fineweb-edu-sample --out data/ --url https://mirror/f.parquet\n"
        "\nall but --list need the network.\n",
        formatter_class=_RAW,
    )
    d.add_argument("name", nargs="?", help="dataset name (see --list)")
    d.add_argument("--out", default="data", metavar="DIR", help="output folder (default: data)")
    d.add_argument("--url", help="mirror: the file URL (one-file datasets) or a base URL")
    d.add_argument("--retries", type=int, default=3, help="resume attempts within this run")
    d.add_argument("--list", action="store_true", help="list the known datasets and exit")
    d.set_defaults(func=_download)

    r = ds.add_parser(
        "run",
        help="run a pipeline TOML file",
        description=_wrap(
            "Run a pipeline file: [input], [output], executor, workers and [[steps]]. "
            "Every step type and option is validated before any work. Output shards are written "
            "atomically with completion markers; rerunning skips finished shards. Dotted overrides "
            "(--output.dir=x, --input.format=wet) apply over the file."
        ),
        epilog="examples:\n"
        "  lmforge data run configs/pipelines/web.toml\n"
        "  lmforge data run configs/pipelines/web.toml --workers 2 --output.dir=runs/data/web2\n"
        "  lmforge data run configs/pipelines/web.toml --executor ray\n"
        "step types: html, language, gopher, c4, pii, classifier, contamination,\n"
        "  exact_dedup, line_dedup, minhash_dedup, tokenize (last)\n",
        formatter_class=_RAW,
    )
    r.add_argument("pipeline", metavar="PIPELINE.toml")
    r.add_argument("--workers", type=int, help="override the file's workers")
    r.add_argument("--executor", choices=("local", "ray"), help="override the file's executor")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=_run, accepts_overrides=True)

    t = ds.add_parser(
        "train-classifier",
        help="train a fastText classifier (quality, toxicity, NSFW)",
        description=_wrap(
            "Train a fastText classifier from labelled JSONL ({label, text}) or from "
            "--positive/--negative files of any readable format (balanced). For quality: positives "
            "are a high-quality reference set, negatives raw crawl. Apply it with a [[steps]] "
            "type = 'classifier' entry. Dolma's Jigsaw hate/NSFW fastText .bin models plug into the "
            "same step (label 'non-hate' / 'non-nsfw')."
        ),
        epilog="examples:\n"
        "  lmforge data train-classifier --positive examples/text/wikitext2 "
        "--negative examples/web/cc_en_head-0091.jsonl --out models/quality.bin\n"
        "  lmforge data train-classifier --input labelled.jsonl --out models/tox.bin"
        '   # lines {"label", "text"}\n',
        formatter_class=_RAW,
    )
    t.add_argument("--input", nargs="*", default=[], help="labelled JSONL files")
    t.add_argument("--positive", nargs="*", default=[], help="positive-class files")
    t.add_argument("--negative", nargs="*", default=[], help="negative-class files")
    t.add_argument("--positive-label", default="hq")
    t.add_argument("--negative-label", default="cc")
    t.add_argument("--out", required=True, metavar="MODEL.bin")
    t.add_argument("--epoch", type=int, default=5)
    t.add_argument("--lr", type=float, default=0.5)
    t.add_argument("--word-ngrams", type=int, default=2)
    t.add_argument("--dim", type=int, default=64, help="embedding size")
    t.add_argument("--bucket", type=int, default=200_000, help="hashed n-gram rows")
    t.set_defaults(func=_train_classifier)

    dd = ds.add_parser(
        "dedup",
        help="deduplicate files: exact documents, exact lines, or MinHash near-duplicates",
        description=_wrap(
            "Corpus-scale deduplication with hashes on disk, parallel over files. "
            "Writes one output per input into --out."
        ),
        epilog="examples:\n"
        "  lmforge data dedup lines 'examples/text/*/*.txt' --out runs/dedup-lines/\n"
        "  lmforge data dedup minhash examples/web/ --out runs/dedup/ --num-hashes 120 "
        "--num-bands 20\n",
        formatter_class=_RAW,
    )
    dd.add_argument("method", choices=("exact", "lines", "minhash"))
    dd.add_argument("inputs", nargs="+")
    dd.add_argument("--out", required=True, metavar="DIR")
    dd.add_argument("--workers", type=int, default=1)
    dd.add_argument("--num-hashes", type=int, default=120)
    dd.add_argument("--num-bands", type=int, default=20)
    dd.add_argument("--ngrams", type=int, default=5)
    dd.add_argument("--jaccard-threshold", type=float, default=0.8)
    dd.set_defaults(func=_dedup)

    m = ds.add_parser(
        "mix",
        help="plan a mixture: weights, epoch caps (UniMax), effective epochs",
        description=_wrap(
            "Split a token budget over sources by weight with a per-source epoch cap "
            "(UniMax water-filling) and print each source's effective epochs."
        ),
        epilog="examples:\n"
        "  lmforge data mix --source web=9e9 --source code=1e9:2 --source wiki=3e8 "
        "--tokens 2e10 --max-epochs 4\n"
        "  lmforge data mix --source web=examples/web/:3 --source books=examples/text/ "
        "--tokens 3e5 --tokenizer runs/demo/tokenizer --out runs/mixed/\n",
        formatter_class=_RAW,
    )
    m.add_argument(
        "--source",
        action="append",
        required=True,
        metavar="NAME=TOKENS|PATH[:WEIGHT[:MAX_EPOCHS]]",
        help="a source by token count, or by files (tokens counted with --tokenizer)",
    )
    m.add_argument("--tokens", type=float, required=True, help="token budget")
    m.add_argument("--max-epochs", type=float, default=4.0, help="default epoch cap")
    m.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer folder")
    m.add_argument("--out", metavar="DIR", help="write the mixture: DIR/NAME.jsonl.gz per source")
    m.add_argument("--seed", type=int, default=0, help="seed of the fractional-epoch sampling")
    m.set_defaults(func=_mix)


def _download(args: argparse.Namespace) -> int:
    from lmforge.data.download import DATASETS, download_dataset

    if args.list or not args.name:
        for name, (desc, files) in DATASETS.items():
            print(f"{name:20s} {desc}")
            for f in files:
                print(f"{'':20s}   {f.url}")
        return 0
    paths = download_dataset(args.name, args.out, url=args.url, retries=args.retries)
    for p in paths:
        print(p)
    return 0


def _run(args: argparse.Namespace) -> int:
    from lmforge.data.pipeline import load_pipeline, run_pipeline
    from lmforge.utils.config import parse_overrides

    extra = parse_overrides(getattr(args, "overrides", []) or [])
    if args.workers is not None:
        extra["workers"] = args.workers
    if args.executor is not None:
        extra["executor"] = args.executor
    cfg = load_pipeline(args.pipeline, extra)
    report = run_pipeline(cfg, progress=not args.no_progress)
    print(report.table())
    return 0


def _train_classifier(args: argparse.Namespace) -> int:
    from lmforge.data.classifier import (
        labelled_from_jsonl,
        labelled_from_sources,
        train_classifier,
    )
    from lmforge.utils.corpus import expand_inputs

    suffixes = _READABLE
    labelled = []
    if args.input:
        labelled += labelled_from_jsonl(expand_inputs(args.input, suffixes))
    if args.positive or args.negative:
        if not (args.positive and args.negative):
            raise LmforgeError("--positive and --negative must be given together")
        labelled += labelled_from_sources(
            expand_inputs(args.positive, suffixes),
            expand_inputs(args.negative, suffixes),
            args.positive_label,
            args.negative_label,
        )
    if not labelled:
        raise LmforgeError("no labelled examples: give --input FILE.jsonl or --positive/--negative")
    try:
        res = train_classifier(
            labelled,
            args.out,
            epoch=args.epoch,
            lr=args.lr,
            word_ngrams=args.word_ngrams,
            dim=args.dim,
            bucket=args.bucket,
        )
    except ValueError as e:
        raise LmforgeError(str(e)) from None
    print(
        f"saved {args.out}: {res['train']} train / {res['valid']} held out, "
        f"precision@1 {res['precision@1']:.3f}"
    )
    return 0


def _dedup(args: argparse.Namespace) -> int:
    from lmforge.data import dedup
    from lmforge.utils.corpus import expand_inputs

    files = expand_inputs(args.inputs, _READABLE)
    try:
        if args.method == "exact":
            st = dedup.exact_document_deduplication(files, args.out, workers=args.workers)
        elif args.method == "lines":
            st = dedup.exact_line_deduplication(files, args.out, workers=args.workers)
        else:
            st = dedup.minhash_deduplication(
                files,
                args.num_hashes,
                args.num_bands,
                args.ngrams,
                args.jaccard_threshold,
                args.out,
                workers=args.workers,
            )
    except ValueError as e:
        raise LmforgeError(str(e)) from None
    if args.method == "lines":
        print(f"lines: {st.lines_in:,} in, {st.lines_out:,} kept; {len(st.outputs)} files")
    else:
        print(f"documents: {st.docs_in:,} in, {st.docs_out:,} kept; {len(st.outputs)} files")
    return 0


def _mix(args: argparse.Namespace) -> int:
    from lmforge.data.mixing import (
        MixSource,
        count_tokens,
        format_mix_table,
        mix_plan,
        write_mixture,
    )
    from lmforge.utils.corpus import expand_inputs

    sources = []
    files: dict[str, list] = {}
    for spec in args.source:
        name, sep, rest = spec.partition("=")
        parts = rest.split(":")
        try:
            if not sep or not name or not 1 <= len(parts) <= 3:
                raise ValueError
            weight = float(parts[1]) if len(parts) > 1 else 1.0
            cap = float(parts[2]) if len(parts) > 2 else args.max_epochs
        except ValueError:
            raise LmforgeError(
                f"--source {spec!r}: expected NAME=TOKENS|PATH[:WEIGHT[:MAX_EPOCHS]]"
            ) from None
        try:
            tokens = int(float(parts[0]))
        except ValueError:
            files[name] = expand_inputs([parts[0]], _READABLE)
            tokens = count_tokens(files[name], args.tokenizer)
        sources.append(MixSource(name, tokens, weight, cap))
    try:
        rows, shortfall = mix_plan(sources, int(args.tokens))
    except ValueError as e:
        raise LmforgeError(str(e)) from None
    print(format_mix_table(rows, shortfall))
    if args.out:
        missing = [s.name for s in sources if s.name not in files]
        if missing:
            raise LmforgeError(f"--out needs file sources; given as token counts: {missing}")
        written = write_mixture(rows, files, args.out, seed=args.seed)
        print(f"wrote {sum(written.values()):,} documents to {args.out}")
    return 0 if shortfall == 0 else 1
