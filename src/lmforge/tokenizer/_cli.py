"""``lmforge tokenizer train|encode``: argument parsing only; the work is in the library."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TRAIN_EXAMPLES = """examples:
  lmforge tokenizer train --input examples/text/tinyshakespeare/input.txt --vocab-size 4096 \\
      --special-token '<|endoftext|>' --out runs/tok/
  lmforge tokenizer train --input 'examples/text/*/*.txt' --vocab-size 4096 --out runs/tok/ --workers 2
"""

ENCODE_EXAMPLES = """examples:
  lmforge tokenizer encode --tokenizer runs/demo/tokenizer --input examples/text/ --out runs/tokens/text.bin
  lmforge tokenizer encode --tokenizer runs/demo/tokenizer --input examples/web/cc_en_head-0091.jsonl \\
      --text-key text --out runs/tokens/web.bin
"""

_NOTE = """
inputs under examples/ ship with the repository; runs/demo/tokenizer is what ./run demo trains.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``tokenizer`` with its ``train`` and ``encode`` subcommands."""
    p = sub.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer, encode text into token shards",
        description="Byte-level BPE (GPT-2 style): train a vocabulary, encode text to shards.",
        epilog=TRAIN_EXAMPLES + ENCODE_EXAMPLES.replace("examples:\n", "") + _NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda args: _no_subcommand(p))

    t = tsub.add_parser(
        "train",
        help="train a BPE vocabulary on text files",
        description=(
            "Train byte-level BPE merges on files, folders or globs (.txt/.py/.md are used "
            "as-is). Prints time, peak memory and compression (bytes/token) on held-out text."
        ),
        epilog=TRAIN_EXAMPLES + _NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="files/folders/globs of .txt/.py/.md, .jsonl[.gz|.zst] or .parquet",
    )
    t.add_argument("--text-key", default="text", help="JSONL/Parquet text field (default text)")
    t.add_argument("--vocab-size", type=int, required=True, help="256 bytes + merges + specials")
    t.add_argument(
        "--special-token",
        action="append",
        dest="special_tokens",
        metavar="TEXT",
        help="special token, repeatable (default: <|endoftext|>)",
    )
    t.add_argument("--out", required=True, metavar="DIR", help="folder for the tokenizer files")
    t.add_argument("--workers", type=int, default=None, help="pre-tokenization processes")
    t.add_argument(
        "--holdout-files",
        type=float,
        default=0.02,
        metavar="FRAC",
        help="fraction of input files held out to measure compression (default 0.02, ≥1 file "
        "when there are several)",
    )
    t.add_argument(
        "--export",
        action="store_true",
        help="also write an HF tokenizer.json into --out",
    )
    t.set_defaults(func=_train)

    e = tsub.add_parser(
        "encode",
        help="encode text into a token shard (NAME.bin + NAME.bin.json)",
        description=(
            "Encode every document of the inputs into one shard: uint16 ids when the vocabulary "
            "fits, else uint32, eot after each document, plus a JSON sidecar."
        ),
        epilog=ENCODE_EXAMPLES + _NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("--tokenizer", required=True, metavar="DIR", help="folder from 'train'")
    e.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files/folders/globs")
    e.add_argument("--out", required=True, metavar="FILE", help="shard path, e.g. train.bin")
    e.add_argument("--workers", type=int, default=None, help="encoding processes (per file)")
    e.add_argument("--text-key", default="text", help="JSONL/Parquet text field (default text)")
    e.set_defaults(func=_encode)


def _no_subcommand(p: argparse.ArgumentParser) -> int:
    p.print_help()
    return 0


def _peak_rss_mb() -> tuple[float, float]:
    import resource

    # ru_maxrss is in KiB on Linux; RUSAGE_CHILDREN reports the largest finished child.
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, kids


def _train(args: argparse.Namespace) -> int:
    import tempfile

    from lmforge.utils.corpus import expand_inputs, looks_binary
    from lmforge.utils.errors import LmforgeError
    from lmforge.utils.io import ensure_writable_dir

    if args.workers is not None and args.workers < 1:
        raise LmforgeError(f"--workers must be at least 1, got {args.workers}")
    if not 0 <= args.holdout_files < 1:
        raise LmforgeError(f"--holdout-files must be in [0, 1), got {args.holdout_files}")
    specials = args.special_tokens if args.special_tokens is not None else ["<|endoftext|>"]
    files = expand_inputs(args.input)
    # a file in --out's place or a read-only folder is one line now, not after the training
    ensure_writable_dir(args.out, "--out")
    for f in files:
        why = looks_binary(f)
        if why:
            print(
                f"lmforge tokenizer train: warning: {f} does not look like text ({why}); "
                "training on it anyway",
                file=sys.stderr,
            )
    with tempfile.TemporaryDirectory(prefix="lmforge-tok-") as tmp:
        files = _as_plain_text(files, specials, Path(tmp), args.text_key)
        return _train_files(args, files, specials)


def _as_plain_text(files: list[Path], specials: list[str], tmp: Path, text_key: str) -> list[Path]:
    """Plain files pass through; each JSONL/Parquet file is streamed into a temporary .txt whose
    documents are joined by the first special token, so no merge crosses a document boundary."""
    from lmforge.utils.corpus import iter_texts

    sep = specials[0] if specials else "\n\n"
    out: list[Path] = []
    for i, f in enumerate(files):
        name = f.name.lower()
        if not (".jsonl" in name or name.endswith((".json.gz", ".json.zst", ".parquet"))):
            out.append(f)
            continue
        dest = tmp / f"{i:05d}-{f.stem}.txt"
        with open(dest, "w", encoding="utf-8") as w:
            for j, text in enumerate(iter_texts(f, text_key=text_key)):
                if j:
                    w.write(sep)
                w.write(text)
        out.append(dest)
    return out


def _train_files(args: argparse.Namespace, files: list[Path], specials: list[str]) -> int:
    import time

    from lmforge.tokenizer.export import save_hf_tokenizer_json
    from lmforge.tokenizer.tokenizer import Tokenizer
    from lmforge.tokenizer.train import train_bpe
    from lmforge.utils.corpus import iter_texts
    from lmforge.utils.errors import LmforgeError

    held: list[Path] = []
    if len(files) > 1 and args.holdout_files > 0:
        # Every k-th file, deterministic, so the held-out text is spread over the corpus.
        k = max(2, round(1 / min(args.holdout_files, 0.5)))
        held = files[k - 1 :: k] or files[-1:]
        files = [f for f in files if f not in held]
    t0 = time.perf_counter()
    stats: dict[str, int] = {}
    vocab, merges = train_bpe(
        files, args.vocab_size, specials, workers=args.workers, progress=True, stats=stats
    )
    seconds = time.perf_counter() - t0
    tok = Tokenizer(vocab, merges, specials)
    out = tok.save(args.out)
    if args.export:
        save_hf_tokenizer_json(tok, out / "tokenizer.json")
    own, kids = _peak_rss_mb()
    mb = sum(f.stat().st_size for f in files) / 1e6
    print(
        f"trained {len(merges)} merges, vocab {tok.vocab_size}, on {mb:.1f} MB in {seconds:.1f} s"
    )
    workers = f"{kids:.0f} MB largest worker" if kids else "no worker processes"
    print(f"peak RSS: {own:.0f} MB main process, {workers}")
    if stats.get("invalid_utf8_bytes"):
        print(
            f"lmforge tokenizer train: warning: {stats['invalid_utf8_bytes']:,} bytes of the "
            "training text were not valid UTF-8; each was read as U+FFFD",
            file=sys.stderr,
        )
    # Compression on up to 4 MB of held-out text (or of training text when only one file).
    eval_files, label = (held, "held-out") if held else (files, "training (no file held out)")
    texts: list[str] = []
    size = 0
    for f in eval_files:
        for t in iter_texts(f):
            texts.append(t[: 4_000_000 - size])
            size += len(texts[-1])
            if size >= 4_000_000:
                break
        if size >= 4_000_000:
            break
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    ntok = sum(len(tok.encode(t)) for t in texts)
    if ntok == 0:
        raise LmforgeError(f"no text to measure compression on in {eval_files[0]}")
    print(f"compression: {nbytes / ntok:.3f} bytes/token on {nbytes / 1e6:.2f} MB of {label} text")
    print(f"saved to {out} (sha256 {tok.sha256[:16]})")
    return 0


def _encode(args: argparse.Namespace) -> int:
    import time

    from lmforge.tokenizer.shards import encode_files
    from lmforge.utils.errors import LmforgeError
    from lmforge.utils.io import ensure_writable_dir

    if args.workers is not None and args.workers < 1:
        raise LmforgeError(f"--workers must be at least 1, got {args.workers}")
    if Path(args.out).is_dir():
        raise LmforgeError(
            f"--out {args.out} is a directory, expected a shard file (e.g. train.bin)"
        )
    ensure_writable_dir(Path(args.out).parent or ".", "--out's folder")
    t0 = time.perf_counter()
    meta = encode_files(
        args.tokenizer,
        args.input,
        args.out,
        workers=args.workers,
        text_key=args.text_key,
        progress=True,
    )
    seconds = time.perf_counter() - t0
    rate = meta["bytes"] / 1e6 / max(seconds, 1e-9)
    print(
        f"wrote {meta['count']:,} {meta['dtype']} tokens from {meta['documents']:,} documents "
        f"({len(meta['source_files'])} files) to {args.out} in {seconds:.1f} s ({rate:.1f} MB/s); "
        f"{meta['bytes'] / max(meta['count'], 1):.3f} bytes/token",
        file=sys.stdout,
    )
    if meta.get("invalid_utf8_bytes"):
        print(
            f"lmforge tokenizer encode: warning: {meta['invalid_utf8_bytes']:,} bytes of the "
            "input were not valid UTF-8; each was encoded as U+FFFD",
            file=sys.stderr,
        )
    return 0
