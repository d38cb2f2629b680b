"""Tokenizer benchmark: BPE training (lmforge vs HF ``tokenizers``) and encode throughput.

Corpus: the Gutenberg .txt files concatenated with ``<|endoftext|>`` between files (temp file).
Training: each trainer runs in its own child process, so its time and peak RSS do not mix with
the other's; lmforge's pre-tokenization workers are reported separately (largest worker).
Encoding: one process, the same text, ids checked equal before timing: tiktoken's real "gpt2"
(built offline from tests/assets/gpt2 through tiktoken's own cache), lmforge's encoder and its
tiktoken export loaded from the same GPT-2 files (the "export ≥ 0.9× tiktoken" criterion), and the
trained tokenizer's own encoder, tiktoken export and HF ``tokenizer.json``. CPU only.

    PYTHONPATH=src python benchmarks/tokenizer.py [--vocab-sizes 10000 32000] \\
        [--results benchmarks/RESULTS.md]
    PYTHONPATH=src python benchmarks/tokenizer.py --quick      # smoke run, under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EOT = "<|endoftext|>"
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "text" / "gutenberg"


def _rss_mb() -> tuple[float, float]:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, kids


def _child(which: str, vocab_size: int, corpus: str, out: str, workers: int | None) -> None:
    """Train in this (child) process and print one JSON line of measurements."""
    t0 = time.perf_counter()
    if which == "lmforge":
        from lmforge.tokenizer import Tokenizer, train_bpe

        vocab, merges = train_bpe(corpus, vocab_size, [EOT], workers=workers)
        seconds = time.perf_counter() - t0
        Tokenizer(vocab, merges, [EOT]).save(out)
        n = len(vocab)
    else:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers, trainers

        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train([corpus], trainer)
        seconds = time.perf_counter() - t0
        n = hf.get_vocab_size()
    own, kids = _rss_mb()
    print(json.dumps({"seconds": seconds, "rss_main_mb": own, "rss_worker_mb": kids, "vocab": n}))


def _run_child(which: str, vocab_size: int, corpus: Path, out: Path, workers: int | None) -> dict:
    cmd = [sys.executable, __file__, "--_child", which, str(vocab_size), str(corpus), str(out)]
    if workers:
        cmd += ["--workers", str(workers)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{which} trainer failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _throughput(fn, text: str, repeat: int) -> float:
    """Best-of-``repeat`` MB/s of ``fn(text)``."""
    mb = len(text.encode("utf-8")) / 1e6
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(text)
        best = min(best, time.perf_counter() - t0)
    return mb / best


GPT2_ASSETS = Path(__file__).resolve().parents[1] / "tests" / "assets" / "gpt2"
# tiktoken caches each file of tiktoken_ext/openai_public.py:gpt2() under sha1(url).
_GPT2_URLS = {
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}


def _gpt2_offline(tmp: Path):
    """tiktoken's real "gpt2" encoding, built offline from tests/assets/gpt2: the two files are
    placed in a private TIKTOKEN_CACHE_DIR under tiktoken's cache names (tiktoken checks their
    pinned SHA-256 itself) and the network is refused while it loads."""
    import hashlib
    import shutil
    import socket

    import tiktoken
    import tiktoken.registry

    cache = tmp / "tiktoken-cache"
    cache.mkdir()
    for asset, url in _GPT2_URLS.items():
        shutil.copyfile(GPT2_ASSETS / asset, cache / hashlib.sha1(url.encode()).hexdigest())
    real = socket.socket.connect

    def refuse(self, address):  # the benchmark must not reach the network
        raise OSError("network disabled in this benchmark")

    socket.socket.connect = refuse
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    try:
        tiktoken.registry.ENCODINGS.pop("gpt2", None)
        return tiktoken.get_encoding("gpt2")
    finally:
        socket.socket.connect = real
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


def _write_corpus(files: list[Path], out: Path, limit_mb: float | None) -> None:
    """Concatenate ``files`` with ``<|endoftext|>`` between them, stopping after ``limit_mb``."""
    limit = None if limit_mb is None else int(limit_mb * 1e6)
    written = 0
    with open(out, "wb") as f:
        for i, p in enumerate(files):
            data = p.read_bytes()
            if limit is not None:
                data = data[: max(0, limit - written)]
                if not data:
                    break
            if i:
                f.write(EOT.encode())
            f.write(data)
            written += len(data)


def _encode_rows(tok_dir: Path, tmp: Path, text: str, gpt2) -> list[tuple[str, float]]:
    """(name, MB/s) of every encoder on ``text``; ids are checked identical before timing."""
    import tokenizers

    from lmforge.tokenizer import Tokenizer, save_hf_tokenizer_json, to_tiktoken

    def files_gpt2() -> Tokenizer:
        return Tokenizer.from_files(GPT2_ASSETS / "encoder.json", GPT2_ASSETS / "vocab.bpe", [EOT])

    # GPT-2's own files: lmforge's encoder and its tiktoken export against tiktoken "gpt2".
    g_own = files_gpt2()
    g_exp = to_tiktoken(g_own)
    ref = gpt2.encode(text, allowed_special="all")
    assert g_own.encode(text) == ref, "lmforge (GPT-2 files) differs from tiktoken gpt2"
    assert g_exp.encode(text, allowed_special="all") == ref, "exported GPT-2 differs"
    # The trained tokenizer: own encoder, tiktoken export, HF tokenizer.json.
    tok = Tokenizer.load(tok_dir)
    enc = to_tiktoken(tok)
    hf_tok = tokenizers.Tokenizer.from_file(str(save_hf_tokenizer_json(tok, tmp / "tok.json")))
    own_ids = tok.encode(text)
    assert enc.encode(text, allowed_special="all") == own_ids, "tiktoken export differs"
    assert hf_tok.encode(text, add_special_tokens=False).ids == own_ids, "HF export differs"
    v = tok.vocab_size
    return [
        (
            "tiktoken `gpt2` (real, offline)",
            _throughput(lambda t: gpt2.encode(t, allowed_special="all"), text, 3),
        ),
        (
            "GPT-2 files: lmforge → tiktoken export",
            _throughput(lambda t: g_exp.encode(t, allowed_special="all"), text, 3),
        ),
        (
            "GPT-2 files: lmforge own encoder (cold cache)",
            _throughput(files_gpt2().encode, text, 1),
        ),
        ("GPT-2 files: lmforge own encoder (warm cache)", _throughput(g_own.encode, text, 2)),
        (
            f"trained {v}: lmforge → tiktoken export",
            _throughput(lambda t: enc.encode(t, allowed_special="all"), text, 3),
        ),
        (
            f"trained {v}: lmforge own encoder (cold cache)",
            _throughput(Tokenizer.load(tok_dir).encode, text, 1),
        ),
        (f"trained {v}: lmforge own encoder (warm cache)", _throughput(tok.encode, text, 2)),
        (
            f"trained {v}: lmforge → HF tokenizer.json (one string)",
            _throughput(lambda t: hf_tok.encode(t, add_special_tokens=False), text, 2),
        ),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="folder of .txt files")
    ap.add_argument("--corpus-mb", type=float, default=None, help="use only this many MB of it")
    ap.add_argument("--vocab-sizes", type=int, nargs="+", default=[10000, 32000])
    ap.add_argument("--encode-mb", type=float, default=8.0, help="MB of text for encode timing")
    ap.add_argument("--workers", type=int, default=None, help="lmforge pre-tokenization workers")
    ap.add_argument("--repeat", type=int, default=1, help="runs per trainer; the best time is kept")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (< 1 min): 3 MB of the corpus, vocab 2000, 0.5 MB encoded",
    )
    ap.add_argument("--results", type=Path, default=None, help="append the table to this file")
    ap.add_argument("--note", default="", help="a line added to the results entry")
    ap.add_argument(
        "--_child", nargs=4, metavar=("WHICH", "V", "CORPUS", "OUT"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args._child:
        which, v, corpus, out = args._child
        _child(which, int(v), corpus, out, args.workers)
        return 0
    if args.quick:
        args.corpus_mb = args.corpus_mb or 3.0
        args.vocab_sizes = [2000]
        args.encode_mb = min(args.encode_mb, 0.5)

    import tiktoken
    import tokenizers

    files = sorted(args.corpus.glob("*.txt"))
    if not files:
        raise SystemExit(f"no .txt files in {args.corpus}")
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="lmforge-tokbench-") as tmp:
        corpus = Path(tmp) / "corpus.txt"
        _write_corpus(files, corpus, args.corpus_mb)
        mb = corpus.stat().st_size / 1e6
        print(f"corpus: {len(files)} files, {mb:.1f} MB, {os.cpu_count()} CPUs", file=sys.stderr)
        rows.append(
            "| vocab | trainer | time (s) | peak RSS main (MB) | peak RSS largest worker (MB) | time / HF |"
        )
        rows.append("|---:|---|---:|---:|---:|---:|")
        tok_dir = None
        for v in args.vocab_sizes:
            out = Path(tmp) / f"tok{v}"
            # Alternate the two trainers and keep each one's best time, so a burst of load from
            # other processes does not land on one trainer only.
            lm: dict = {}
            hf: dict = {}
            for _ in range(args.repeat):
                for name, best in (("lmforge", lm), ("hf", hf)):
                    r = _run_child(
                        name, v, corpus, out if name == "lmforge" else Path(tmp) / "x", args.workers
                    )
                    print(f"vocab {v}: {name} {r}", file=sys.stderr)
                    if not best or r["seconds"] < best["seconds"]:
                        best.update(r)
            ratio = lm["seconds"] / hf["seconds"]
            worker = f"{lm['rss_worker_mb']:.0f}" if lm["rss_worker_mb"] else "– (in-process)"
            rows.append(
                f"| {v} | lmforge `train_bpe` | {lm['seconds']:.1f} | {lm['rss_main_mb']:.0f} | {worker} | {ratio:.2f}× |"
            )
            rows.append(
                f"| {v} | HF `tokenizers` BpeTrainer | {hf['seconds']:.1f} | {hf['rss_main_mb']:.0f} | – (threads) | 1.00× |"
            )
            tok_dir = out

        # Encoding throughput: real GPT-2 (tiktoken and lmforge from the same files) and the
        # largest trained vocabulary, all on the same text.
        text = corpus.read_bytes()[: int(args.encode_mb * 1e6)].decode("utf-8", errors="ignore")
        gpt2 = _gpt2_offline(Path(tmp))
        tput = _encode_rows(tok_dir, Path(tmp), text, gpt2)
        base = tput[0][1]
        rows.append("")
        rows.append(
            f"Encoding {len(text.encode()) / 1e6:.1f} MB of the corpus, one process "
            "(ids checked identical first; target: GPT-2 files' tiktoken export ≥ 0.9× tiktoken gpt2):"
        )
        rows.append("")
        rows.append("| encoder | MB/s | vs tiktoken gpt2 |")
        rows.append("|---|---:|---:|")
        for name, r in tput:
            rows.append(f"| {name} | {r:.2f} | {r / base:.2f}× |")
    table = "\n".join(rows)
    print(table)
    if args.results:
        load = os.getloadavg()
        entry = [
            f"\n## Tokenizer: BPE training and encoding ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n",
            f"- device: CPU, {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
            f"load average at the end {load[0]:.1f}",
            f"- versions: Python {platform.python_version()}, tiktoken {tiktoken.__version__}, "
            f"tokenizers {tokenizers.__version__}",
            f"- corpus: {len(files)} Gutenberg .txt files joined by `<|endoftext|>`, {mb:.1f} MB",
            f"- command: `PYTHONPATH=src python benchmarks/tokenizer.py {shlex.join(sys.argv[1:])}`",
        ]
        if args.note:
            entry.append(f"- note: {args.note}")
        entry += ["", table, ""]
        with open(args.results, "a", encoding="utf-8") as f:
            f.write("\n".join(entry))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
