"""Tokenizer benchmark: BPE training (lmforge vs HF ``tokenizers``) and encode throughput.

Corpus: the Gutenberg .txt files concatenated with ``<|endoftext|>`` between files (temp file).
Training: each trainer runs in its own child process, so its time and peak RSS do not mix with
the other's; lmforge's pre-tokenization workers are reported separately (largest worker).
Encoding: one process, the same text, ids checked equal before timing: lmforge's own encoder,
its tiktoken export, the exported HF ``tokenizer.json``, and tiktoken "gpt2" when its files are
available offline. CPU only.

    PYTHONPATH=src python benchmarks/tokenizer.py [--vocab-sizes 10000 32000] \\
        [--results benchmarks/RESULTS.md]
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


def _gpt2_offline():
    """tiktoken's gpt2 encoding if its files are cached locally; never touches the network."""
    import socket

    real = socket.socket.connect

    def refuse(self, address):  # the benchmark must not reach the network
        raise OSError("network disabled in this benchmark")

    socket.socket.connect = refuse
    try:
        import tiktoken

        return tiktoken.get_encoding("gpt2")
    except Exception:  # tiktoken raises various errors when the download fails
        return None
    finally:
        socket.socket.connect = real


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="folder of .txt files")
    ap.add_argument("--vocab-sizes", type=int, nargs="+", default=[10000, 32000])
    ap.add_argument("--encode-mb", type=float, default=8.0, help="MB of text for encode timing")
    ap.add_argument("--workers", type=int, default=None, help="lmforge pre-tokenization workers")
    ap.add_argument("--repeat", type=int, default=1, help="runs per trainer; the best time is kept")
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

    import tiktoken
    import tokenizers

    from lmforge.tokenizer import Tokenizer, save_hf_tokenizer_json, to_tiktoken

    files = sorted(args.corpus.glob("*.txt"))
    if not files:
        raise SystemExit(f"no .txt files in {args.corpus}")
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="lmforge-tokbench-") as tmp:
        corpus = Path(tmp) / "corpus.txt"
        with open(corpus, "wb") as f:
            for i, p in enumerate(files):
                if i:
                    f.write(EOT.encode())
                f.write(p.read_bytes())
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

        # Encoding throughput with the largest trained vocabulary.
        tok = Tokenizer.load(tok_dir)
        text = corpus.read_bytes()[: int(args.encode_mb * 1e6)].decode("utf-8", errors="ignore")
        enc = to_tiktoken(tok)
        hf_path = save_hf_tokenizer_json(tok, Path(tmp) / "tokenizer.json")
        hf_tok = tokenizers.Tokenizer.from_file(str(hf_path))
        own_ids = tok.encode(text)
        assert enc.encode(text, allowed_special="all") == own_ids, "tiktoken export differs"
        assert hf_tok.encode(text, add_special_tokens=False).ids == own_ids, "HF export differs"
        tput = [
            (
                "lmforge own encoder (cold cache)",
                _throughput(Tokenizer.load(tok_dir).encode, text, 1),
            ),
            ("lmforge own encoder (warm cache)", _throughput(tok.encode, text, 2)),
            (
                "lmforge → tiktoken export",
                _throughput(lambda t: enc.encode(t, allowed_special="all"), text, 3),
            ),
            (
                "lmforge → HF tokenizer.json (one string)",
                _throughput(lambda t: hf_tok.encode(t, add_special_tokens=False), text, 2),
            ),
        ]
        gpt2 = _gpt2_offline()
        if gpt2 is not None:
            tput.append(
                (
                    "tiktoken gpt2",
                    _throughput(lambda t: gpt2.encode(t, allowed_special="all"), text, 3),
                )
            )
        exported = tput[2][1]
        rows.append("")
        rows.append(
            f"Encoding {len(text.encode()) / 1e6:.1f} MB, one process, vocab {tok.vocab_size} (ids checked identical first):"
        )
        rows.append("")
        rows.append("| encoder | MB/s | vs exported tiktoken |")
        rows.append("|---|---:|---:|")
        for name, r in tput:
            rows.append(f"| {name} | {r:.2f} | {r / exported:.2f}× |")
        if gpt2 is None:
            rows.append("| tiktoken gpt2 | n/a: its BPE files are not available offline here | |")
    table = "\n".join(rows)
    print(table)
    if args.results:
        load = os.getloadavg()
        entry = [
            f"\n## Tokenizer: BPE training and encoding ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n",
            f"- device: CPU, {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
            f"load average at the end {load[0]:.1f} (other processes shared the cores)",
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
