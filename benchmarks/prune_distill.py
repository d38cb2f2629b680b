"""Prune-then-distill on SmolLM2-135M-Instruct: width and depth variants at ~100M parameters.

The teacher is the shipped SmolLM2-135M-Instruct GGUF (its Q4_1 weights imported as floats).
For each variant, the library path ``lmforge prune`` runs (:func:`lmforge.prune.activation_importance`
on calibration windows of the training books, :func:`~lmforge.prune.plan_width` /
:func:`~lmforge.prune.plan_depth` to the parameter target, :func:`~lmforge.prune.prune_width` /
:func:`~lmforge.prune.prune_depth`), then recovery is the post-training distillation objective
(:class:`lmforge.posttrain.DistillObjective`, forward-KL logit KD from the unpruned teacher — what
``lmforge distill --teacher GGUF --student PRUNED`` runs) in :class:`lmforge.train.Trainer` for a
fixed token budget. The baseline trains the same pruned config from a fresh initialisation on the
very same token stream (the distillation objective's sampler, with the LM cross-entropy loss in
place of the KL), with its own, larger learning rate.

Bits per byte on a held-out Gutenberg book (not among the training books): before pruning, after
pruning, after KD recovery, after training from scratch. Data: windows of ``--seq-len`` + 1 tokens
from the training books (each book from 5% in, past the Gutenberg header).

    python benchmarks/prune_distill.py --device cpu --out bench_out/prune_distill
    # a larger budget on a GPU (books and GGUF carried beside the checkout):
    python benchmarks/prune_distill.py --device cuda --gguf .carry/smol.gguf --gutenberg \
        .carry/gutenberg --steps 400 --batch 16 --seq-len 256 --eval-tokens 65536 --out OUT

The CPU default (32 steps × 4 × 64 = 8,192 tokens per recovery run, 16,384 eval tokens) took
~40 minutes per variant on two CPU cores shared with other jobs (~19 s per step, ~7 minutes per
evaluation); it shows the direction, not a converged recovery.

The user-facing path is the same two commands (see ``lmforge prune --help``):

    lmforge prune --gguf SmolLM2-135M-Instruct.Q4_1.gguf --target-params 100e6 --mode width \\
        --calib book.txt --out runs/smol-100m-width
    lmforge distill --teacher SmolLM2-135M-Instruct.Q4_1.gguf --student runs/smol-100m-width \\
        --data corpus.jsonl --out runs/smol-100m-kd
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lmforge.config import RunConfig  # noqa: E402
from lmforge.eval.scoring import perplexity  # noqa: E402
from lmforge.model import TransformerLM  # noqa: E402
from lmforge.posttrain import DistillObjective  # noqa: E402
from lmforge.posttrain.config import DistillConfig  # noqa: E402
from lmforge.posttrain.core import IGNORE, Example, model_logits  # noqa: E402
from lmforge.prune import (  # noqa: E402
    activation_importance,
    count_parameters,
    plan_depth,
    plan_width,
    prune_depth,
    prune_width,
)
from lmforge.train import TrainConfig, Trainer  # noqa: E402
from lmforge.train.metrics import read_metrics  # noqa: E402

SHARED = ROOT.parent / "shared"
GUTENBERG = SHARED / "data/text/gutenberg"
TRAIN_BOOKS = (
    "Austen_Emma.txt",
    "Stoker_Dracula.txt",
    "Melville_Moby_Dick_Or_The_Whale.txt",
    "Bront_Jane_Eyre_An_Autobiography.txt",
    "Shelley_The_Last_Man.txt",
    "Swift_Gulliver_s_Travels_into_Several_Remote_Nations_of_the_World.txt",
)
EVAL_BOOK = "Thoreau_Walden_and_On_The_Duty_Of_Civil_Disobedience.txt"


class ScratchObjective(DistillObjective):
    """The distillation objective's batches (same sampler, same seed: the same token stream)
    scored by the LM cross-entropy against the next token instead of the teacher's logits."""

    name = "scratch"

    def loss(self, model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed next-token NLL over the labelled positions, their count)."""
        logits = model_logits(model, batch.input_ids).float()  # (B, T, V)
        nll = F.cross_entropy(
            logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        return nll, (batch.labels != IGNORE).sum().float()


def training_windows(tok, n: int, seq_len: int, books: Path) -> list[list[int]]:
    """``n`` windows of ``seq_len`` + 1 tokens, taken in turn from each training book."""
    per_book = -(-n // len(TRAIN_BOOKS))
    need_chars = per_book * (seq_len + 1) * 6  # ~4 bytes per token, with headroom
    out: list[list[int]] = []
    for name in TRAIN_BOOKS:
        text = (books / name).read_text(encoding="utf-8")
        start = len(text) // 20
        ids = tok.encode(text[start : start + need_chars])
        windows = [ids[i : i + seq_len + 1] for i in range(0, len(ids) - seq_len, seq_len + 1)]
        if len(windows) < per_book:
            raise SystemExit(f"{name}: {len(windows)} windows, need {per_book}")
        out += windows[:per_book]
    return out[:n]


def bpb(model, tok, text: str, args: argparse.Namespace) -> float:
    """Bits per byte of the first ``--eval-tokens`` tokens of the held-out book."""
    model.eval()
    with torch.no_grad():
        r = perplexity(model, tok, [text], batch_size=args.eval_batch, max_tokens=args.eval_tokens)
    return r.bits_per_byte


def train(student, objective, out: Path, lr: float, args: argparse.Namespace) -> list[float]:
    """``--steps`` Trainer steps of ``objective``; the per-step training losses."""
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, not a resume of an older one
    tc = TrainConfig(
        out_dir=str(out), device=args.device, precision=args.precision, seed=args.seed,
        batch_size=args.batch, max_steps=args.steps, lr=lr, min_lr=lr / 10,
        warmup_steps=max(1, args.steps // 10), schedule="cosine", weight_decay=0.0,
        grad_clip=1.0, eval_every=0, save_every=0, save_every_minutes=0.0, log_every=1,
        plot=False, progress=True, keep_last=1,
    )  # fmt: skip
    Trainer(RunConfig(train=tc), model=student, objective=objective).run()
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["event"] == "train"]
    for ck in out.glob("checkpoint*"):  # the final checkpoint (~1.2 GB with AdamW state)
        shutil.rmtree(ck, ignore_errors=True)
    return losses


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gguf", default=str(SHARED / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--gutenberg", default=str(GUTENBERG), help="folder with the books")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default=None, help="fp32 on CPU, bf16 on CUDA by default")
    p.add_argument("--target-params", type=float, default=100e6)
    p.add_argument("--modes", nargs="+", default=["width", "depth"])
    p.add_argument("--calib-samples", type=int, default=32, help="importance windows")
    p.add_argument("--steps", type=int, default=32, help="optimizer steps per recovery run")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--kd-lr", type=float, default=3e-4)
    p.add_argument("--scratch-lr", type=float, default=2e-3)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--eval-batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/prune_distill")
    args = p.parse_args()
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from lmforge.hf.gguf import import_gguf

    t0 = time.time()
    teacher, tok, _ = import_gguf(args.gguf, context_length=512)
    teacher = teacher.to(args.device).eval().requires_grad_(False)
    books = Path(args.gutenberg)
    eval_text = (books / EVAL_BOOK).read_text(encoding="utf-8")
    eval_text = eval_text[len(eval_text) // 20 :]  # past the Gutenberg header
    n_seq = args.steps * args.batch
    windows = training_windows(tok, n_seq + args.calib_samples, args.seq_len, books)
    # importance on windows the recovery runs do not train on (Minitron's calibration set)
    calib = torch.tensor(windows[n_seq:], dtype=torch.long)[:, : args.seq_len]  # (N, T)
    corpus = [Example(w, [True] * len(w)) for w in windows[:n_seq]]
    tokens_budget = n_seq * args.seq_len
    print(f"budget: {args.steps} steps × {args.batch} × {args.seq_len} = {tokens_budget:,} "
          f"training tokens per run; eval {args.eval_tokens:,} tokens of {EVAL_BOOK}")  # fmt: skip
    rows = [{"model": "teacher (SmolLM2-135M, unpruned)", "params_M": teacher.num_parameters() / 1e6,
             "bpb": bpb(teacher, tok, eval_text, args)}]  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)
    imp = activation_importance(teacher, calib.to(args.device), batch_size=8, progress=True)
    target = int(args.target_params)
    for mode in args.modes:
        if mode == "depth":
            pruned = prune_depth(teacher, imp, plan_depth(teacher.config, imp, target))
            shape = f"{pruned.config.n_layers} layers"
        else:
            d, f = plan_width(teacher.config, target)
            pruned = prune_width(teacher, imp, d_model=d, d_ff=f)
            shape = f"d_model {d}, d_ff {f}"
        pruned = pruned.requires_grad_(True)
        params = count_parameters(pruned.config) / 1e6
        rows.append({"model": f"{mode}-pruned ({shape})", "params_M": params,
                     "bpb": bpb(pruned, tok, eval_text, args)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        kd_cfg = DistillConfig(loss="forward", temperature=1.0)
        kd = DistillObjective(teacher, kd_cfg, args.batch, corpus=corpus, seed=args.seed)
        hist = train(pruned, kd, out / f"{mode}_kd", args.kd_lr, args)
        rows.append({"model": f"{mode}-pruned + KD", "params_M": params,
                     "bpb": bpb(pruned, tok, eval_text, args), "first_loss": hist[0],
                     "last_loss": hist[-1]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        small_cfg = pruned.config
        del pruned
        torch.manual_seed(args.seed)
        fresh = TransformerLM(small_cfg).to(args.device)
        scratch = ScratchObjective(teacher, kd_cfg, args.batch, corpus=corpus, seed=args.seed)
        hist = train(fresh, scratch, out / f"{mode}_scratch", args.scratch_lr, args)
        rows.append({"model": f"{mode} config from scratch", "params_M": params,
                     "bpb": bpb(fresh, tok, eval_text, args), "first_loss": hist[0],
                     "last_loss": hist[-1]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del fresh
    ref = rows[0]["bpb"]
    for r in rows:
        r["vs_teacher_%"] = 100 * (r["bpb"] / ref - 1)
    summary = {"rows": rows, "train_tokens_per_run": tokens_budget, "steps": args.steps,
               "batch": args.batch, "seq_len": args.seq_len, "kd_lr": args.kd_lr,
               "scratch_lr": args.scratch_lr, "eval_book": EVAL_BOOK,
               "eval_tokens": args.eval_tokens, "train_books": list(TRAIN_BOOKS),
               "device": args.device, "precision": args.precision, "torch": torch.__version__,
               "minutes": (time.time() - t0) / 60}  # fmt: skip
    (out / "prune_distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\ntorch {torch.__version__}, {args.device} {args.precision}, "
          f"{summary['minutes']:.1f} min; recovery budget {tokens_budget:,} tokens "
          f"({args.steps} steps × {args.batch} × {args.seq_len}) per run; held-out: {EVAL_BOOK}, "
          f"{args.eval_tokens:,} tokens; KD lr {args.kd_lr:g}, scratch lr {args.scratch_lr:g}")  # fmt: skip
    print("\n| model | params (M) | bits/byte | vs teacher |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params_M']:.1f} | {r['bpb']:.4f} | {r['vs_teacher_%']:+.1f}% |"
        )


if __name__ == "__main__":
    main()
