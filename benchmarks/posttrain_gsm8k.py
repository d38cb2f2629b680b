"""Evidence 2 of issue 23: SmolLM2-135M-Instruct on GSM8K before and after SFT, and after GRPO.

Three stages, each on the train split, each evaluated greedily on the **full test split**
(1,319 problems; ``--limit N`` for fewer) with the standard error of the accuracy:

1. ``before``: the model as it is (the shared Q4_1 GGUF, dequantised to float32);
2. ``sft``: ``lmforge sft`` on the train split, each answer turned into an assistant reply
   (:func:`lmforge.posttrain.tasks.gsm8k_sft_response`: calculator annotations removed, the
   final ``#### N`` kept, so ``lmforge.eval``'s GSM8K checker reads it);
3. ``grpo``: ``lmforge rl --task gsm8k`` from the SFT model, reward = the same checker.

Every stage sees the same prompt: the question plus :data:`~lmforge.posttrain.tasks.GSM8K_INSTRUCTION`
as a user turn under the model's own chat template. Generation goes through
:func:`lmforge.posttrain.rollout.rollout_engine` (the serving engine RL samples on).
Accuracy = the mean of :func:`lmforge.posttrain.tasks.gsm8k_reward`'s answer component (the last
number of the reply against the ``#### N`` gold, ``lmforge.eval.answers`` canonicalisation);
standard error = sqrt(p(1 − p) / n).

Resumable: every stage writes ``--out``/``<stage>.json`` atomically when it finishes and a rerun
skips finished stages (an evaluation also keeps the finished chunks of a stopped run in
``eval_<stage>.partial.jsonl``). Writes ``results.json`` and a PNG of accuracy per stage
(``--figure``). Runs:

    PYTHONPATH=src python benchmarks/posttrain_gsm8k.py --stages before --limit 64   # CPU timing
    PYTHONPATH=src python benchmarks/posttrain_gsm8k.py --device cuda                # everything
    PYTHONPATH=src python benchmarks/posttrain_gsm8k.py --quick --out runs/gsm8k-smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

STAGES = ("before", "sft", "grpo")
SHARED = Path("../shared")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHARED / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--data-dir", default=str(SHARED / "data/eval/gsm8k"),
                    help="folder with GSM8K train.jsonl and test.jsonl")  # fmt: skip
    ap.add_argument("--out", default="runs/posttrain_gsm8k")
    ap.add_argument("--figure", default="benchmarks/figures/posttrain_gsm8k.png")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma list of before,sft,grpo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--limit", type=int, default=None, help="evaluate the first N test problems")
    ap.add_argument("--train-limit", type=int, default=None, help="use the first N train problems")
    ap.add_argument("--max-tokens", type=int, default=256, help="reply budget (eval and GRPO)")
    ap.add_argument("--eval-chunk", type=int, default=None,
                    help="problems per engine call, the unit of resumption (default 64 on the "
                         "CPU, 256 on a GPU: the serve engine batches up to 256 sequences)")  # fmt: skip
    ap.add_argument("--sft-epochs", type=float, default=1.0, help="passes over the train split")
    ap.add_argument("--sft-steps", type=int, default=None, help="overrides --sft-epochs")
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--sft-micro-batch", type=int, default=8)
    ap.add_argument("--sft-lr", type=float, default=2e-5)
    ap.add_argument("--grpo-iterations", type=int, default=50)
    ap.add_argument("--grpo-prompts", type=int, default=32)
    ap.add_argument("--grpo-group", type=int, default=8)
    ap.add_argument("--grpo-lr", type=float, default=2e-6)
    ap.add_argument("--grpo-algo", default="grpo")
    ap.add_argument("--grpo-micro-batch", type=int, default=16,
                    help="sequences per backward (16 × 400 tokens × 49,152 fp32 logits ≈ 1.3 GB)")  # fmt: skip
    ap.add_argument("--grpo-eval-size", type=int, default=64,
                    help="test problems scored inside the RL run for its curve")  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 test / 16 train problems, 2 SFT steps, 1 GRPO iteration, "
                         "32-token replies")  # fmt: skip
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    if args.eval_chunk is None:
        args.eval_chunk = 256 if args.device.startswith("cuda") else 64
    if args.quick:
        args.limit = args.limit or 8
        args.train_limit = args.train_limit or 16
        args.max_tokens = min(args.max_tokens, 32)
        args.sft_steps, args.sft_batch, args.sft_micro_batch = 2, 4, 2
        args.grpo_iterations, args.grpo_prompts, args.grpo_group = 1, 2, 2
        args.grpo_eval_size = 2
    return args


def _write_json(path: Path, obj: Any) -> None:
    from lmforge.utils.io import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def accuracy_stats(correct: list[float]) -> dict[str, float]:
    """Accuracy and its standard error sqrt(p(1 − p) / n) over per-problem 0/1 scores."""
    n = len(correct)
    p = sum(correct) / n if n else 0.0
    return {"n": n, "correct": int(sum(correct)), "accuracy": p,
            "stderr": math.sqrt(p * (1 - p) / n) if n else 0.0}  # fmt: skip


def evaluate(model_path: str, problems: list[dict[str, Any]], args: argparse.Namespace,
             stage: str, out: Path) -> dict[str, Any]:  # fmt: skip
    """Greedy accuracy of the model at ``model_path`` on ``problems`` (resumable by chunk)."""
    import torch
    from tqdm import tqdm

    from lmforge.posttrain.chat import prompt_text
    from lmforge.posttrain.core import decode_ids, encode_text
    from lmforge.posttrain.models import eos_ids, load_model
    from lmforge.posttrain.rollout import rollout_engine
    from lmforge.posttrain.tasks import gsm8k_reward, gsm8k_user_message
    from lmforge.serve import SamplingParams

    model, tok = load_model(model_path, args.device)
    eos = eos_ids(tok)
    engine = rollout_engine(model, eos)
    partial = out / f"eval_{stage}.partial.jsonl"
    done: dict[int, dict[str, Any]] = {}
    if partial.is_file():
        for line in partial.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by a stopped run: redo from there
            done[rec["i"]] = rec
        from lmforge.utils.io import atomic_write_text

        atomic_write_text(partial, "".join(json.dumps(r) + "\n" for r in done.values()))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, stop_token_ids=tuple(eos))
    todo = [i for i in range(len(problems)) if i not in done]
    t0 = time.perf_counter()
    with tqdm(total=len(problems), initial=len(done), desc=f"eval {stage}",
              disable=args.quiet) as bar:  # fmt: skip
        for c in range(0, len(todo), args.eval_chunk):
            idx = todo[c : c + args.eval_chunk]
            prompts = [
                encode_text(
                    tok, prompt_text(tok, gsm8k_user_message(problems[i]["question"]), True)
                )
                for i in idx
            ]
            with torch.no_grad():
                outs = engine.generate(prompts, params)
            lines = []
            for i, o in zip(idx, outs, strict=True):
                ids = [t for t in o.outputs[0].token_ids if t not in set(eos)]
                text = decode_ids(tok, ids)
                ok = gsm8k_reward(problems[i], text).answer
                rec = {"i": i, "correct": ok, "tokens": len(o.outputs[0].token_ids), "reply": text}
                done[i] = rec
                lines.append(json.dumps(rec))
            with open(partial, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
                f.flush()
                os.fsync(f.fileno())
            bar.update(len(idx))
    wall = time.perf_counter() - t0
    del engine, model  # the next stage sizes its own engine's KV cache from the free memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    recs = [done[i] for i in range(len(problems))]
    res = {
        "stage": stage,
        "model": model_path,
        **accuracy_stats([r["correct"] for r in recs]),
        "mean_reply_tokens": sum(r["tokens"] for r in recs) / max(len(recs), 1),
        "truncated": sum(r["tokens"] >= args.max_tokens for r in recs),
        "eval_wall_s": round(wall, 1),
        "eval_problems_timed": len(todo),
        "examples": [
            {
                "question": problems[r["i"]]["question"][:200],
                "reply": r["reply"][:400],
                "correct": r["correct"],
            }
            for r in recs[:3]
        ],
    }
    return res


def sft_records(train: list[dict[str, Any]]) -> list[dict[str, str]]:
    """GSM8K train problems as ``lmforge sft`` prompt/response records (chat-templated there)."""
    from lmforge.posttrain.tasks import gsm8k_sft_response, gsm8k_user_message

    return [{"prompt": gsm8k_user_message(r["question"]), "response": gsm8k_sft_response(r["answer"])}
            for r in train]  # fmt: skip


def run_sft(args: argparse.Namespace, train: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """``lmforge sft`` on the reformatted train split; returns its summary."""
    from lmforge.cli import main as cli

    data = out / "sft_train.jsonl"
    from lmforge.utils.io import atomic_write_text

    atomic_write_text(data, "".join(json.dumps(r) + "\n" for r in sft_records(train)))
    steps = args.sft_steps or max(1, round(args.sft_epochs * len(train) / args.sft_batch))
    argv = ["sft", "--model", args.model, "--data", str(data), "--out", str(out / "sft"),
            "--steps", str(steps), "--batch-size", str(args.sft_batch),
            "--micro-batch", str(args.sft_micro_batch), "--lr", str(args.sft_lr),
            "--max-len", "1024", "--device", args.device]  # fmt: skip
    if args.quiet:
        argv.append("--quiet")
    t0 = time.perf_counter()
    if cli(argv) != 0:
        raise SystemExit("lmforge sft failed (see above)")
    summary = json.loads((out / "sft" / "summary.json").read_text())
    return {**summary, "steps": steps, "train_wall_s": round(time.perf_counter() - t0, 1),
            "command": "lmforge " + " ".join(argv)}  # fmt: skip


def run_grpo(args: argparse.Namespace, train_path: Path, test_path: Path, start: str,
             out: Path) -> dict[str, Any]:  # fmt: skip
    """``lmforge rl --task gsm8k`` from ``start``; returns its summary."""
    from lmforge.cli import main as cli

    argv = ["rl", "--task", "gsm8k", "--model", start, "--data", str(train_path),
            "--eval-data", str(test_path), "--eval-size", str(args.grpo_eval_size),
            "--algo", args.grpo_algo, "--iterations", str(args.grpo_iterations),
            "--prompts-per-step", str(args.grpo_prompts), "--group-size", str(args.grpo_group),
            "--lr", str(args.grpo_lr), "--max-tokens", str(args.max_tokens),
            "--micro-batch", str(args.grpo_micro_batch),
            "--eval-every", str(max(1, args.grpo_iterations // 5)),
            "--out", str(out / "grpo"), "--device", args.device]  # fmt: skip
    if args.quiet:
        argv.append("--quiet")
    t0 = time.perf_counter()
    if cli(argv) != 0:
        raise SystemExit("lmforge rl failed (see above)")
    summary = json.loads((out / "grpo" / "summary.json").read_text())
    return {**summary, "train_wall_s": round(time.perf_counter() - t0, 1),
            "command": "lmforge " + " ".join(argv)}  # fmt: skip


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def plot(path: Path, results: dict[str, dict[str, Any]], out: Path) -> None:
    """Three panels: SFT loss per step, GRPO mean rollout reward (and its in-run test accuracy)
    per rollout sample, and the full-split test accuracy ± standard error per finished stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.8))
    sft = [r for r in _jsonl(out / "sft" / "metrics.jsonl") if r.get("event") == "train"]
    if sft:
        a1.plot([r["step"] for r in sft], [r["loss"] for r in sft], lw=1)
    a1.set(xlabel="SFT step", ylabel="loss (assistant tokens)", title="SFT on the train split")
    recs = _jsonl(out / "grpo" / "metrics.jsonl")
    rl = [r for r in recs if r.get("event") == "train"]
    if rl:
        a2.plot([r["samples"] for r in rl], [r["reward"] for r in rl], lw=1, label="mean reward")
    ev = [r for r in recs if r.get("event") == "eval" and "eval_accuracy" in r]
    if ev and rl:
        per = rl[0]["samples"]  # samples per step (one rollout batch per step)
        a2.plot([r["step"] * per for r in ev], [r["eval_accuracy"] for r in ev], marker="o",
                label="test accuracy (in-run subset)")  # fmt: skip
    a2.set(
        xlabel="GRPO rollout samples", ylabel="reward / accuracy", title="GRPO on the train split"
    )
    a2.legend(fontsize=8)
    names = [s for s in STAGES if s in results]
    labels = {"before": "before", "sft": "after SFT", "grpo": "after GRPO"}
    a3.errorbar(range(len(names)), [results[s]["accuracy"] for s in names],
                yerr=[results[s]["stderr"] for s in names], marker="o", capsize=4)  # fmt: skip
    a3.set_xticks(range(len(names)), [labels[s] for s in names])
    n = results[names[0]]["n"] if names else 0
    a3.set(ylabel="accuracy ± s.e. (greedy)", title=f"GSM8K test, n = {n}")
    for ax in (a2, a3):
        ax.set_ylim(bottom=0)
    for ax in (a1, a2, a3):
        ax.grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M-Instruct on GSM8K (benchmarks/posttrain_gsm8k.py)")
    fig.tight_layout()
    from lmforge.utils.io import atomic_write

    with atomic_write(path) as out:  # temp name, fsync, rename
        fig.savefig(out, format="png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    import torch

    from lmforge.posttrain.tasks import read_jsonl
    from lmforge.utils.errors import LmforgeError

    if args.threads:
        torch.set_num_threads(args.threads)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        print(f"posttrain_gsm8k: unknown stage {bad[0]!r} (before, sft, grpo)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data_dir)
    train_path, test_path = data / "train.jsonl", data / "test.jsonl"
    try:
        train = read_jsonl(train_path, "GSM8K train")[: args.train_limit]
        test = read_jsonl(test_path, "GSM8K test")[: args.limit]
        if not Path(args.model).exists():
            raise LmforgeError(f"model not found: {args.model}")
        if args.train_limit:  # RL reads its own file: give it the same subset
            from lmforge.utils.io import atomic_write_text

            train_path = out / "train_subset.jsonl"
            atomic_write_text(train_path, "".join(json.dumps(r) + "\n" for r in train))
        head = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, device {args.device}, "
                f"torch {torch.__version__}, python {platform.python_version()}, "
                f"threads {torch.get_num_threads()}, loadavg {_loadavg()}")  # fmt: skip
        print(head, flush=True)
        results: dict[str, dict[str, Any]] = {}
        for stage in STAGES:
            f = out / f"{stage}.json"
            if f.is_file():
                results[stage] = json.loads(f.read_text())
                print(f"{stage}: finished earlier ({f}), skipped", flush=True)
                continue
            if stage not in stages:
                continue
            res: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                   "loadavg_start": _loadavg()}  # fmt: skip
            if stage == "before":
                model_path = args.model
            elif stage == "sft":
                res["train"] = run_sft(args, train, out)
                model_path = str(out / "sft" / "model")
            else:
                start = out / "sft" / "model"
                if not start.is_dir():
                    raise LmforgeError(
                        f"grpo starts from the SFT model: run the sft stage ({start})"
                    )
                res["train"] = run_grpo(args, train_path, test_path, str(start), out)
                model_path = str(out / "grpo" / "model")
            res.update(evaluate(model_path, test, args, stage, out))
            res["loadavg_end"] = _loadavg()
            _write_json(f, res)
            (out / f"eval_{stage}.partial.jsonl").unlink(missing_ok=True)
            results[stage] = res
    except LmforgeError as e:
        print(f"posttrain_gsm8k: error: {e}", file=sys.stderr)
        return 2
    print("\n| stage | n | accuracy | ± s.e. | mean reply tokens | eval wall (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for s in STAGES:
        if s in results:
            r = results[s]
            print(f"| {s} | {r['n']} | {r['accuracy']:.4f} | {r['stderr']:.4f} | "
                  f"{r['mean_reply_tokens']:.0f} | {r['eval_wall_s']} |")  # fmt: skip
    if "before" in results:
        base = results["before"]["accuracy"]
        for s in ("sft", "grpo"):
            if s in results and base > 0:
                print(f"{s} / before: {results[s]['accuracy'] / base:.2f}×")
    _write_json(out / "results.json", {"header": head, "stages": results})
    if results and args.figure:
        plot(Path(args.figure), results, out)
    return 0


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
