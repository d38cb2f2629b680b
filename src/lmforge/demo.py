"""``lmforge demo``: the whole stack end to end on one machine.

Corpus (default: the Python standard library's own sources) → byte-level BPE tokenizer →
train/validation token shards → a small Transformer LM trained for a fixed step budget →
validation loss, perplexity and bits per byte beside a unigram baseline → checkpoint → samples.

Simplification: the tokenizer is trained on at most ``--tokenizer-mb`` of the training split so
the demo stays within a few minutes on 2 CPU cores; every byte is still encoded with it. The
training length is a step budget, never a time budget, so the result is the same on a busy machine.
Exercise it with ``./run demo`` (or ``lmforge demo --help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lmforge.utils import (
    LmforgeError,
    Runtime,
    atomic_write_text,
    default_corpus_files,
    expand_inputs,
)

SAMPLE_PROMPTS = ("def ", "import os\n", "class ", "    for i in range(")


def _log(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def split_files(files: list[Path], val_every: int = 50) -> tuple[list[Path], list[Path]]:
    """Deterministic file-level split: a file goes to validation when its path hash says so.

    Hashing the path (not the position) keeps the split stable when files are added or removed.
    """
    train, val = [], []
    for f in files:
        h = int(hashlib.sha1(str(f).encode()).hexdigest()[:8], 16)
        (val if h % val_every == 0 else train).append(f)
    if not val:
        val.append(train.pop())
    if not train:
        raise LmforgeError("need at least two input files to make a train/validation split")
    return train, val


def _take_bytes(files: list[Path], limit: int) -> list[Path]:
    out, total = [], 0
    for f in files:
        if total >= limit:
            break
        out.append(f)
        total += f.stat().st_size
    return out


def unigram_baseline(
    train_tokens: Sequence[int], val_tokens: Sequence[int], vocab_size: int
) -> float:
    """Cross-entropy (nats/token) of an add-one-smoothed unigram model fitted on the train split."""
    import numpy as np

    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(val_tokens, dtype=np.int64)].mean())


def _set_aside_previous_run(train_dir: Path) -> None:
    # Each demo trains from scratch on freshly built tokenizer and shards: an earlier demo's run
    # folder (the trainer refuses to overwrite checkpoints) moves to train.previous, replacing
    # an older one, so rerunning the README's first command just works.
    if not train_dir.is_dir() or not any(train_dir.iterdir()):
        return
    previous = train_dir.with_name(train_dir.name + ".previous")
    if previous.exists():
        shutil.rmtree(previous)
    train_dir.rename(previous)
    _log(f"an earlier demo run was in {train_dir}; moved it to {previous}")


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo from parsed CLI arguments; returns the exit status."""
    from lmforge.config import RunConfig
    from lmforge.generate import generate
    from lmforge.model import load_preset
    from lmforge.tokenizer import Tokenizer, encode_files, read_token_shard, train_bpe
    from lmforge.train import DataConfig, TrainConfig, load_for_inference, train

    t_start = time.perf_counter()
    runtime = Runtime.from_env(args.device, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = expand_inputs(args.data) if args.data else default_corpus_files()
    _set_aside_previous_run(out / "train")
    train_files, val_files = split_files(files)
    n_bytes = sum(f.stat().st_size for f in files)
    _log(
        f"corpus: {len(files)} files, {n_bytes / 1e6:.1f} MB "
        f"({'stdlib sources' if not args.data else 'user data'}); "
        f"split {len(train_files)} train / {len(val_files)} validation files"
    )

    # 1. Tokenizer.
    tok_dir = out / "tokenizer"
    tok_files = _take_bytes(train_files, int(args.tokenizer_mb * 1e6))
    t0 = time.perf_counter()
    vocab, merges = train_bpe(tok_files, args.vocab_size, ["<|endoftext|>"])
    tokenizer = Tokenizer(vocab, merges, special_tokens=["<|endoftext|>"])
    tokenizer.save(tok_dir)
    t_tok = time.perf_counter() - t0
    _log(
        f"tokenizer: vocab {tokenizer.vocab_size} trained on {len(tok_files)} files in {t_tok:.1f} s"
    )

    # 2. Token shards.
    shard_dir = out / "tokens"
    t0 = time.perf_counter()
    train_info = encode_files(tokenizer, train_files, shard_dir / "train.bin")
    val_info = encode_files(tokenizer, val_files, shard_dir / "val.bin")
    t_enc = time.perf_counter() - t0
    bpt_val = val_info["bytes"] / val_info["count"]
    _log(
        f"encoded: {train_info['count']:,} train / {val_info['count']:,} validation tokens in "
        f"{t_enc:.1f} s; compression {bpt_val:.2f} bytes/token on validation"
    )

    # 3. Model + training.
    model_cfg = dataclasses.replace(load_preset(args.preset), vocab_size=tokenizer.vocab_size)
    cfg = RunConfig(
        model=model_cfg,
        train=TrainConfig(
            out_dir=str(out / "train"),
            device=runtime.device,
            seed=args.seed,
            max_minutes=args.max_minutes,
            max_steps=args.max_steps,
            batch_size=args.batch_size,
            lr=args.lr,
            min_lr=args.lr / 10,
            warmup_steps=min(100, max(1, args.max_steps // 20)),
            precision="bf16" if runtime.device.startswith("cuda") else "fp32",
            eval_every=args.eval_every,
            eval_batches=args.eval_batches,
            save_every=0,
            resume=False,
        ),
        data=DataConfig(
            train=(str(shard_dir / "train.bin"),),
            val=(str(shard_dir / "val.bin"),),
            tokenizer=str(tok_dir),
        ),
    )
    metrics = train(cfg, runtime)

    # 4. Report beside a unigram baseline.
    uni = unigram_baseline(
        read_token_shard(shard_dir / "train.bin"),
        read_token_shard(shard_dir / "val.bin"),
        tokenizer.vocab_size,
    )
    val_loss = float(metrics["val_loss"])
    bpb = val_loss / math.log(2) / bpt_val
    uni_bpb = uni / math.log(2) / bpt_val
    report = {
        "corpus_files": len(files),
        "corpus_mb": round(n_bytes / 1e6, 2),
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_train_s": round(t_tok, 1),
        "bytes_per_token_val": round(bpt_val, 3),
        "train_tokens": int(train_info["count"]),
        "val_tokens": int(val_info["count"]),
        "steps": int(metrics.get("iteration", 0)),
        "tokens_seen": int(metrics.get("tokens_seen", 0)),
        "val_loss": round(val_loss, 4),
        "val_ppl": round(math.exp(val_loss), 2),
        "val_bits_per_byte": round(bpb, 4),
        "unigram_val_loss": round(uni, 4),
        "unigram_ppl": round(math.exp(uni), 2),
        "unigram_bits_per_byte": round(uni_bpb, 4),
        "checkpoint": str(metrics.get("checkpoint", "")),
    }

    # 5. Samples from the saved checkpoint (proves the checkpoint round-trips).
    model, tok = load_for_inference(out / "train", device=runtime.device)
    tok = tok or tokenizer
    prompts = [tok.encode(p) for p in SAMPLE_PROMPTS]
    stops = [tok.eot_id] if tok.eot_id is not None else []
    outs = generate(
        model,
        prompts,
        max_new_tokens=args.sample_tokens,
        temperature=0.8,
        top_k=50,
        stop_tokens=stops,
        seed=args.seed,
    )
    samples = [p + tok.decode(o) for p, o in zip(SAMPLE_PROMPTS, outs)]
    report["samples"] = samples
    report["total_minutes"] = round((time.perf_counter() - t_start) / 60, 2)
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")

    print("\nlmforge demo — results (validation split, measured in this run)")
    print(f"{'':28}{'model':>12}{'unigram':>12}")
    print(f"{'loss (nats/token)':28}{val_loss:>12.4f}{uni:>12.4f}")
    print(f"{'perplexity':28}{math.exp(val_loss):>12.2f}{math.exp(uni):>12.2f}")
    print(f"{'bits per byte':28}{bpb:>12.4f}{uni_bpb:>12.4f}")
    print(
        f"tokenizer: {tokenizer.vocab_size} tokens, {bpt_val:.2f} bytes/token; trained "
        f"{report['steps']} steps on {report['tokens_seen']:,} tokens; "
        f"total {report['total_minutes']} min"
    )
    print(f"checkpoint: {report['checkpoint']}\nreport: {out / 'report.json'}\n")
    for s in samples:
        print("--- sample ---")
        print(s)
    return 0
