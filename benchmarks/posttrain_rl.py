"""RL evidence on the CPU arithmetic task: GRPO family side by side, and Pipeline RL vs synchronous
GRPO at the same sample budget.

One warm start (``lmforge rl``'s: a tiny model fitted to a mixture where 60% of the answers drop
every carry) is shared by every run, so each starts from the same held-out accuracy A0. Then:

- ``--algos grpo,dr_grpo,dapo,gspo``: synchronous runs of ``--iterations`` iterations each
  (``--prompts`` prompts × ``--group`` samples), held-out greedy accuracy every ``--eval-every``;
- ``--pipeline``: the same GRPO budget through :func:`lmforge.posttrain.pipeline.run_pipeline`
  (engine and trainer processes, 1 torch thread each), against synchronous GRPO
  (``--sync-threads``, default 1); wall-clock to reach ``--target`` and the staleness histogram.

Prints a table and writes ``--out``/rl_algorithms.png, pipeline_vs_sync.png, results.json.
Run: ``PYTHONPATH=src python benchmarks/posttrain_rl.py --pipeline``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lmforge.posttrain import rl
from lmforge.posttrain.commands import plot_curves
from lmforge.posttrain.pipeline import PipelineConfig, run_pipeline
from lmforge.posttrain.rollout import LocalEngine
from lmforge.posttrain.tasks import ArithmeticTask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algos", default="grpo,dr_grpo,dapo,gspo")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--warmup-steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--pipeline", action="store_true")
    ap.add_argument("--max-lag", type=int, default=4)
    ap.add_argument("--queue", type=int, default=1, help="pipeline: batches in flight")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--sync-threads", type=int, default=1, help="torch threads of synchronous runs")
    ap.add_argument("--out", default="runs/posttrain_rl")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or 'cpu'}, "
          f"torch {torch.__version__}, python {platform.python_version()}", flush=True)  # fmt: skip

    task = ArithmeticTask(digits=args.digits)
    tok = task.tokenizer()
    torch.set_num_threads(1)
    base = rl.arithmetic_model(tok.vocab_size, seed=0)
    wr = random.Random(5)
    t0 = time.perf_counter()
    rl.supervised_warmup(base, tok, rl.random_sampler(task, 0), args.warmup_steps, 64, 3e-3,
                         tok.eos_id, answer_fn=lambda it: task.warmup_answer(it, wr))  # fmt: skip
    base.eval()
    eval_items = task.eval_set(args.eval_size)
    a0 = rl.evaluate_accuracy(LocalEngine(base, eos_ids=[tok.eos_id]), tok, eval_items,
                              task.reward, task.answer_tokens)  # fmt: skip
    print(f"warm start: {args.warmup_steps} steps in {time.perf_counter() - t0:.0f} s, "
          f"held-out A0 = {a0:.3f}", flush=True)  # fmt: skip
    results: dict = {"A0": a0, "runs": {}}

    def sync_run(algo: str, threads: int, stop_at_target: bool) -> dict:
        torch.set_num_threads(threads)
        model = copy.deepcopy(base)
        eng = LocalEngine(model, eos_ids=[tok.eos_id])
        max_tokens, cache = rl.overlong_budget(task.answer_tokens, rl.algorithm(algo))
        cfg = rl.StepConfig(rl.algorithm(algo), max_tokens=max_tokens, micro_batch=256)
        hist = rl.run_iterations(
            model, eng, tok, rl.random_sampler(task, 1), task.reward, cfg,
            iterations=args.iterations, prompts_per_step=args.prompts, group_size=args.group,
            lr=args.lr, eval_fn=lambda: rl.evaluate_accuracy(eng, tok, eval_items, task.reward,
                                                             task.answer_tokens),
            eval_every=args.eval_every, target=args.target if stop_at_target else None,
            overlong_cache=cache,
        )  # fmt: skip
        return _summary(hist, args.target)

    for algo in [a for a in args.algos.split(",") if a]:
        res = sync_run(algo, args.sync_threads, stop_at_target=False)
        results["runs"][algo] = res
        print(f"  {algo}: final {res['final']:.3f}, reached {args.target} at "
              f"{res['time_to_target']} s / {res['samples_to_target']} samples", flush=True)  # fmt: skip
    if results["runs"]:
        plot_curves(out / "rl_algorithms.png",
                    {k: [(0, a0)] + v["curve"] for k, v in results["runs"].items()},
                    "rollout samples", "held-out greedy accuracy",
                    f"{args.digits}-digit addition, A0 = {a0:.2f}")  # fmt: skip

    if args.pipeline:
        sync = sync_run("grpo", args.sync_threads, stop_at_target=True)
        model = copy.deepcopy(base)
        pcfg = PipelineConfig(algo="grpo", iterations=args.iterations,
                              prompts_per_step=args.prompts, group_size=args.group, lr=args.lr,
                              max_tokens=task.answer_tokens, max_lag=args.max_lag,
                              digits=args.digits, eval_every=args.eval_every,
                              eval_size=args.eval_size, target=args.target, threads=1,
                              queue_size=args.queue)  # fmt: skip
        pipe = _summary(run_pipeline(model, pcfg, progress=False), args.target)
        results["pipeline"] = {"sync_grpo": sync, "pipeline_grpo": pipe}
        plot_curves(out / "pipeline_vs_sync.png",
                    {f"synchronous GRPO ({args.sync_threads} thread(s))": [(0, a0)] + sync["curve_time"],
                     "Pipeline RL GRPO (1+1 threads)": [(0, a0)] + pipe["curve_time"]},
                    "wall-clock (s)", "held-out greedy accuracy", "same sample budget")  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")

    print()
    print("| run | final acc | samples to target | time to target (s) | total time (s) |")
    print("|---|---:|---:|---:|---:|")
    for k, v in results["runs"].items():
        print(f"| {k} | {v['final']:.3f} | {v['samples_to_target']} | {v['time_to_target']} | "
              f"{v['total_time']:.0f} |")  # fmt: skip
    if args.pipeline:
        s, p = results["pipeline"]["sync_grpo"], results["pipeline"]["pipeline_grpo"]
        for name, v in (("sync GRPO (to target)", s), ("Pipeline RL GRPO (to target)", p)):
            print(f"| {name} | {v['final']:.3f} | {v['samples_to_target']} | {v['time_to_target']} "
                  f"| {v['total_time']:.0f} |")  # fmt: skip
        if s["time_to_target"] and p["time_to_target"]:
            print(f"\nPipeline RL speed-up to {args.target}: "
                  f"{s['time_to_target'] / p['time_to_target']:.2f}x")  # fmt: skip
        print(f"staleness histogram (token lag: count): {p['staleness']}")


def _summary(hist: list[dict], target: float = 0.8) -> dict:
    evals = [h for h in hist if "eval_accuracy" in h]
    hit = next((h for h in evals if h["eval_accuracy"] >= target), None)
    return {
        "final": evals[-1]["eval_accuracy"] if evals else float("nan"),
        "curve": [(h["samples"], h["eval_accuracy"]) for h in evals],
        "curve_time": [(round(h["time_s"], 1), h["eval_accuracy"]) for h in evals],
        "samples_to_target": hit["samples"] if hit else None,
        "time_to_target": round(hit["time_s"], 1) if hit else None,
        "total_time": hist[-1]["time_s"] if hist else 0.0,
        "staleness": hist[-1].get("staleness_histogram") if hist else None,
    }


if __name__ == "__main__":
    main()
