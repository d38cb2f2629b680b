"""RL evidence on the CPU arithmetic task: GRPO family side by side, and Pipeline RL vs synchronous
GRPO at the same sample budget.

One warm start (``lmforge rl``'s: a tiny model fitted to a mixture where 60% of the answers drop
every carry) is shared by every run, so each starts from the same held-out accuracy A0
(``--warm-start FILE`` caches it). Then:

- ``--algos grpo,dr_grpo,dapo,gspo``: synchronous runs of ``--iterations`` iterations each
  (``--prompts`` prompts × ``--group`` samples), held-out greedy accuracy every ``--eval-every``;
- ``--pipeline``: GRPO through :func:`lmforge.posttrain.pipeline.run_pipeline` (engine and
  trainer processes; ``--pipe-threads`` trainer+engine torch threads, ``--queue`` batches the
  engine may hold ahead) against synchronous GRPO (``--sync-threads``: one run per thread
  count), alternated per seed (``--seeds``), each with the same sample budget and no evaluation
  inside its timed loop (weights snapshotted with the clock stopped, evaluated afterwards);
  wall-clock to ``--target``, the per-process time breakdown, load averages and the staleness
  histogram. ``--task scratchpad`` gives worked 30-token answers
  (:mod:`lmforge.posttrain.scratchpad`), where generation is a real share of an iteration.

Prints a table and writes ``--out``/rl_algorithms.png, pipeline_vs_sync.png, results.json.
Run: ``PYTHONPATH=src python benchmarks/posttrain_rl.py --pipeline``.

``--task gsm8k`` (or ``math``) ``--model FILE --data DIR``: the same comparison on a real model and
task (SmolLM2-135M-Instruct on GSM8K: ``--max-tokens`` 256 replies through the serve engine, a
train step over 256 sequences of ~400 tokens), where generation and training take comparable
time. No warm start and no held-out evaluation: synchronous GRPO and Pipeline RL start from the
same weights, draw the same prompt stream (``random.Random(seed).sample`` of the train split,
``lmforge rl``'s) and spend the same sample budget (``--iterations`` × ``--prompts`` ×
``--group``); both engines are warmed up before their clocks start. Printed: mean reward and
seconds per iteration of both, the speed-up (all iterations and without the first), the time
breakdown (generation; trainer wait, scoring, forward, backward, optimizer, broadcast; engine
decode, weight receive, idle; the serve engine's decode-only / prefill-carrying step seconds),
the staleness histogram and the correctness checks (``sync_check``: |π_θ/μ − 1| on the lag-0
tokens, which the first batch is made of; ``weight_check``: the engine's weights against the
trainer's at the version it recorded, every ``--check-every`` batches). This mode lives here rather
than in ``posttrain_gsm8k.py`` (the before/SFT/GRPO accuracy stages with full test-split
evaluations) because it is this file's measurement — pipeline vs synchronous at one sample
budget — on another task. One H200, both processes sharing it::

    PYTHONPATH=src python benchmarks/posttrain_rl.py --device cuda --task gsm8k \
        --model SmolLM2-135M-Instruct.Q4_1.gguf --data ../shared/data/eval/gsm8k --iterations 4
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lmforge.posttrain import rl
from lmforge.posttrain.commands import plot_curves
from lmforge.posttrain.pipeline import PipelineConfig, run_pipeline
from lmforge.posttrain.rollout import rollout_engine
from lmforge.posttrain.scratchpad import ScratchpadAdditionTask
from lmforge.posttrain.tasks import ArithmeticTask

_TRANSPORTS = ("broadcast", "shared")  # PipelineConfig.transport's values


def _transports(text: str) -> str:
    """``--transport``: a comma-separated list, each one of :data:`_TRANSPORTS` (argparse's
    ``choices`` checks one value, not a list)."""
    bad = [t for t in text.split(",") if t and t not in _TRANSPORTS]
    if bad or not text.strip(","):
        raise argparse.ArgumentTypeError(
            f"invalid choice: {(bad or [text])[0]!r} (choose from {', '.join(_TRANSPORTS)}; "
            "comma-separated for one pipeline run each)"
        )
    return text


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
    ap.add_argument("--queue", default="0",
                    help="pipeline: finished batches the engine may hold unconsumed (0: lag <= 1); "
                         "comma-separated: one pipeline run per value")  # fmt: skip
    ap.add_argument(
        "--lr", type=float, default=None, help="default 1e-3 (toy), 2e-6 (gsm8k / math)"
    )
    ap.add_argument("--sync-threads", default="1",
                    help="torch threads of synchronous runs; --pipeline runs each listed count")  # fmt: skip
    ap.add_argument("--task", choices=["arithmetic", "scratchpad", "gsm8k", "math"],
                    default="arithmetic",
                    help="scratchpad: worked 30-token answers (generation ~35%% of an iteration); "
                         "gsm8k / math: --model on --data, Pipeline RL vs synchronous GRPO")  # fmt: skip
    ap.add_argument("--seeds", default="0", help="--pipeline: comma-separated run seeds")
    ap.add_argument("--pipe-threads", default="1+1",
                    help="--pipeline: trainer+engine torch threads, comma-separated; T+E runs "
                         "every --queue value, T+E:Q only queue Q")  # fmt: skip
    ap.add_argument("--warm-start", default=None,
                    help="safetensors file: load the warm start from it, or write it there")  # fmt: skip
    ap.add_argument("--figure", default=None, help="--pipeline: also write the figure here")
    ap.add_argument("--device", default="cpu",
                    help="cpu | cuda: every model on it (the pipeline's two processes share it)")  # fmt: skip
    ap.add_argument("--model", default=None,
                    help="gsm8k / math: the policy (lmforge checkpoint, .gguf, HF import)")  # fmt: skip
    ap.add_argument("--data", default=None,
                    help="gsm8k / math: folder with train.jsonl, or a JSONL file of problems")  # fmt: skip
    ap.add_argument("--train-limit", type=int, default=None, help="gsm8k / math: first N problems")
    ap.add_argument("--max-tokens", type=int, default=256, help="gsm8k / math: reply budget")
    ap.add_argument("--micro-batch", type=int, default=16,
                    help="gsm8k / math: sequences per forward/backward (fp32 logits are "
                         "sequences x tokens x vocab)")  # fmt: skip
    ap.add_argument("--engine-device", default=None,
                    help="gsm8k / math: the pipeline engine's device (default: the trainer's; "
                         "cuda:1 with --backend nccl puts it on a second GPU; untested)")  # fmt: skip
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                    help="gsm8k / math: the pipeline's weight broadcast (gloo: CPU buckets, one "
                         "shared device; nccl: one GPU per process)")  # fmt: skip
    ap.add_argument("--transport", default="broadcast", type=_transports,
                    help="gsm8k / math: the pipeline's weight transfer, comma-separated (one "
                         "pipeline run each): broadcast (gloo / NCCL buckets) | shared (buckets "
                         "shared with the engine on the same device: CUDA IPC / shared memory)")  # fmt: skip
    ap.add_argument("--check-every", type=int, default=2,
                    help="gsm8k / math: the pipeline's weight check every N batches (and the first)")  # fmt: skip
    ap.add_argument("--d-model", type=int, default=128, help="width of the task model")
    ap.add_argument("--layers", type=int, default=2, help="layers of the task model")
    ap.add_argument("--out", default="runs/posttrain_rl")
    args = ap.parse_args()
    real = args.task in ("gsm8k", "math")
    args.lr = args.lr if args.lr is not None else (2e-6 if real else 1e-3)
    args.engine = "serve"  # the one engine (lmforge.serve.Engine) behind every run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or 'cpu'}, "
          f"torch {torch.__version__}, python {platform.python_version()}", flush=True)  # fmt: skip
    if real:
        from lmforge.utils.errors import LmforgeError

        try:
            res = _real_task(args)
        except LmforgeError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        _print_real(res)
        return

    task = (ScratchpadAdditionTask if args.task == "scratchpad" else ArithmeticTask)(args.digits)
    tok = task.tokenizer()
    torch.set_num_threads(1)
    ctx = 16 * ((3 * args.digits + 3 + task.answer_tokens) // 16 + 1)
    base = rl.arithmetic_model(tok.vocab_size, seed=0, d_model=args.d_model,
                               n_layers=args.layers, context_length=max(32, ctx))  # fmt: skip
    base.to(args.device)
    t0 = time.perf_counter()
    ws = Path(args.warm_start) if args.warm_start else None
    if ws is not None and ws.is_file():
        from safetensors.torch import load_file

        base.load_state_dict(load_file(str(ws), device=str(args.device)))
        print(f"warm start loaded from {ws}", flush=True)
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            rl.warm_start(base, task, args.warmup_steps, d, seed=0, device=str(args.device))
        if ws is not None:
            from safetensors.torch import save

            from lmforge.utils.io import atomic_write_bytes

            state = {k: v.detach().cpu().contiguous() for k, v in base.state_dict().items()}
            atomic_write_bytes(ws, save(state))  # temp name, fsync, rename
    base.eval()
    eval_items = task.eval_set(args.eval_size)
    a0 = rl.evaluate_accuracy(rollout_engine(base, [tok.eos_id]), tok, eval_items,
                              task.reward, task.answer_tokens, eos_ids=[tok.eos_id])  # fmt: skip
    print(f"warm start: {args.warmup_steps} steps in {time.perf_counter() - t0:.0f} s, "
          f"held-out A0 = {a0:.3f}", flush=True)  # fmt: skip
    results: dict = {"A0": a0, "runs": {}}

    def sync_run(algo: str, threads: int, stop_at_target: bool) -> dict:
        torch.set_num_threads(threads)
        model = copy.deepcopy(base)
        max_tokens, cache = rl.overlong_budget(task.answer_tokens, rl.algorithm(algo))
        hist = rl.train_grpo(
            model, tok, lambda n, rng: task.sample(n, rng), task.reward, algo,
            out_dir=str(out / f"sync-{algo}"), iterations=args.iterations,
            prompts_per_step=args.prompts, group_size=args.group, lr=args.lr,
            max_tokens=max_tokens, overlong_cache=cache, eval_items=eval_items,
            eval_every=args.eval_every, device=str(args.device),
        )  # fmt: skip
        del stop_at_target  # the whole budget: curves to compare
        return _summary(hist, args.target)

    for algo in [a for a in args.algos.split(",") if a]:
        res = sync_run(algo, int(args.sync_threads.split(",")[0]), stop_at_target=False)
        results["runs"][algo] = res
        print(f"  {algo}: final {res['final']:.3f}, reached {args.target} at "
              f"{res['time_to_target']} s / {res['samples_to_target']} samples", flush=True)  # fmt: skip
    if results["runs"]:
        plot_curves(out / "rl_algorithms.png",
                    {k: [(0, a0)] + v["curve"] for k, v in results["runs"].items()},
                    "rollout samples", "held-out greedy accuracy",
                    f"{args.digits}-digit addition, A0 = {a0:.2f}")  # fmt: skip

    if args.pipeline:
        results["pipeline"] = _pipeline_vs_sync(args, task, tok, base, a0, eval_items, out)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")

    if results["runs"]:
        print()
        print("| run | final acc | samples to target | time to target (s) | total time (s) |")
        print("|---|---:|---:|---:|---:|")
    for k, v in results["runs"].items():
        print(f"| {k} | {v['final']:.3f} | {v['samples_to_target']} | {v['time_to_target']} | "
              f"{v['total_time']:.0f} |")  # fmt: skip
    if args.pipeline:
        _print_pipeline(results["pipeline"], args.target)


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


# ---------------------------------------------------------------------------------------------
# Pipeline RL vs synchronous GRPO

_PARTS = {
    "sync": ["gen_s", "score_s"],
    "trainer": ["wait_s", "score_s", "broadcast_s"],
    "engine": ["engine_gen_s", "engine_recv_s", "engine_idle_s"],
}


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def _pipeline_vs_sync(args, task, tok, base, a0, eval_items, out: Path) -> dict:
    """Each seed: synchronous GRPO at every ``--sync-threads`` count, then Pipeline RL (1+1
    threads), interleaved so they see the same machine load. Every run takes the same sample
    budget (``--iterations`` × prompts × group) with no evaluation inside its timed loop: the
    weights are snapshotted after every iteration (clock stopped) and evaluated after the run."""
    max_tokens = task.answer_tokens
    runs: list[dict] = []

    def snapshotter(snaps: list) -> object:
        def on_step(rec: dict, model: torch.nn.Module) -> None:
            if rec["iteration"] % args.eval_every == 0 or rec["iteration"] == args.iterations:
                snaps.append((rec["iteration"], rec["samples"], rec["time_s"],
                              {k: v.detach().clone() for k, v in model.state_dict().items()}))  # fmt: skip

        return on_step

    def run_sync(seed: int, threads: int) -> None:
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        model = copy.deepcopy(base)
        snaps: list = []
        load0 = _loadavg()
        # the prompt stream of the pipeline's engine (random.Random(seed + 1)): same prompts, in order
        hist = rl.train_grpo(
            model, tok, lambda n, rng: task.sample(n, rng), task.reward, "grpo",
            out_dir=str(out / f"sync-{seed}-{threads}"), iterations=args.iterations,
            prompts_per_step=args.prompts, group_size=args.group, lr=args.lr,
            max_tokens=max_tokens, seed=seed, device=str(args.device),
            on_step=snapshotter(snaps),
        )  # fmt: skip
        runs.append({"mode": f"sync {threads}t", "seed": seed, "hist": hist, "snaps": snaps,
                     "load": [load0, _loadavg()]})  # fmt: skip
        print(f"  seed {seed} sync {threads} thread(s): {hist[-1]['time_s']:.1f} s, "
              f"load {load0} -> {_loadavg()}", flush=True)  # fmt: skip

    def run_pipe(seed: int, tt: int, et: int, q: int) -> None:
        torch.set_num_threads(tt)
        model = copy.deepcopy(base)
        pcfg = PipelineConfig(algo="grpo", iterations=args.iterations,
                              prompts_per_step=args.prompts, group_size=args.group,
                              lr=args.lr, max_tokens=max_tokens, max_lag=args.max_lag,
                              digits=args.digits, task=task, seed=seed, eval_every=10**9,
                              eval_size=1, threads=tt, engine_threads=et,
                              queue_size=q)  # fmt: skip
        snaps: list = []
        load0 = _loadavg()
        torch.manual_seed(seed)
        hist = run_pipeline(model, pcfg, progress=False, on_step=snapshotter(snaps))
        runs.append({"mode": f"pipeline {tt}+{et}t q{q}", "seed": seed, "hist": hist,
                     "snaps": snaps, "load": [load0, _loadavg()]})  # fmt: skip
        print(f"  seed {seed} pipeline {tt}+{et} threads, queue {q}: {hist[-1]['time_s']:.1f} s, "
              f"load {load0} -> {_loadavg()}", flush=True)  # fmt: skip

    syncs = [int(x) for x in args.sync_threads.split(",") if x]
    pipes = []  # (trainer threads, engine threads, queue size); "T+E:Q" pins the queue size
    for spec in [x for x in args.pipe_threads.split(",") if x]:
        th, _, q = spec.partition(":")
        tt, et = (int(x) for x in th.split("+"))
        pipes += [(tt, et, int(qq)) for qq in (q.split() if q else args.queue.split(",")) if qq]
    for seed in [int(x) for x in args.seeds.split(",") if x]:
        # alternate synchronous and pipeline runs so that both see the same drift in load
        for i in range(max(len(syncs), len(pipes))):
            if i < len(syncs):
                run_sync(seed, syncs[i])
            if i < len(pipes):
                run_pipe(seed, *pipes[i])

    # evaluation of every snapshot, after all timed runs (identical for every mode)
    torch.set_num_threads(1)
    probe = copy.deepcopy(base)
    eng = rollout_engine(probe, [tok.eos_id])
    for r in runs:
        curve = [(0, 0, 0.0, a0)]
        for it, samples, t, state in r.pop("snaps"):
            probe.load_state_dict(state)
            eng.update_weights({}, it)  # the module's weights changed: drop the prefix cache
            acc = rl.evaluate_accuracy(eng, tok, eval_items, task.reward, max_tokens,
                                       eos_ids=[tok.eos_id])  # fmt: skip
            curve.append((it, samples, round(t, 2), acc))
        r["curve"] = curve
        hit = next((c for c in curve if c[3] >= args.target), None)
        r["samples_to_target"] = hit[1] if hit else None
        r["time_to_target"] = hit[2] if hit else None
        hist = r.pop("hist")
        r["total_time"] = round(hist[-1]["time_s"], 2)
        keys = (
            _PARTS["sync"] if r["mode"].startswith("sync") else _PARTS["trainer"] + _PARTS["engine"]
        )
        r["per_iteration_s"] = {k: round(sum(h.get(k, 0.0) for h in hist) / len(hist), 4)
                                for k in keys}  # fmt: skip
        r["per_iteration_s"]["wall"] = round(hist[-1]["time_s"] / len(hist), 4)
        if not r["mode"].startswith("sync"):
            r["staleness"] = hist[-1].get("staleness_histogram")
            r["kept"] = sum(h["kept"] for h in hist)
            r["mixed_version_rollouts"] = sum(h["mixed_version_rollouts"] for h in hist)
            r["clip_fraction"] = round(sum(h.get("clip_fraction", 0) for h in hist) / len(hist), 4)
    res = {"task": args.task, "digits": args.digits, "A0": a0, "target": args.target,
           "threads_note": "sync: torch threads of its one process; pipeline: 1 per process",
           "runs": runs}  # fmt: skip
    _plot_pipeline(res, out / "pipeline_vs_sync.png")
    if args.figure:
        _plot_pipeline(res, Path(args.figure))
    return res


def _plot_pipeline(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {}
    for r in res["runs"]:
        c = colors.setdefault(r["mode"], f"C{len(colors)}")
        ls = ["-", "--", ":", "-."][r["seed"] % 4]
        label = f"{r['mode']} seed {r['seed']}"
        axes[0].plot([p[2] for p in r["curve"]], [p[3] for p in r["curve"]], ls, color=c,
                     marker="o", ms=2, label=label)  # fmt: skip
        axes[1].plot([p[1] for p in r["curve"]], [p[3] for p in r["curve"]], ls, color=c,
                     marker="o", ms=2, label=label)  # fmt: skip
    for ax, xl in zip(axes[:2], ["wall-clock (s), evaluation excluded", "rollout samples"]):
        ax.axhline(res["target"], color="grey", lw=0.8)
        ax.set_xlabel(xl)
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    pipes = [r for r in res["runs"] if r.get("staleness")]
    for i, r in enumerate(pipes):
        h = {int(k): v for k, v in r["staleness"].items()}
        tot = sum(h.values())
        xs = sorted(h)
        axes[2].bar([x + 0.8 * i / len(pipes) for x in xs], [h[x] / tot for x in xs],
                    width=0.8 / len(pipes), label=f"{r['mode']} seed {r['seed']}")  # fmt: skip
    axes[2].set_xlabel("token lag (trainer version − sampling version)")
    axes[2].set_ylabel("fraction of tokens")
    axes[2].set_title("Pipeline RL staleness")
    if pipes:
        axes[2].legend(fontsize=7)
    fig.suptitle(f"GRPO, {res['task']} ({res['digits']} digits), same sample budget, A0 = "
                 f"{res['A0']:.2f}")  # fmt: skip
    fig.tight_layout()
    from lmforge.utils.io import atomic_write

    with atomic_write(path) as out:  # temp name, fsync, rename
        fig.savefig(out, format="png", dpi=110)
    plt.close(fig)


def _print_pipeline(res: dict, target: float) -> None:
    print(
        f"\nPipeline RL vs synchronous GRPO, {res['task']} task, target {target}, A0 {res['A0']:.3f}"
    )
    print("| run | seed | samples to target | time to target (s) | final acc | total (s) | "
          "load before → after |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in res["runs"]:
        print(f"| {r['mode']} | {r['seed']} | {r['samples_to_target']} | {r['time_to_target']} | "
              f"{r['curve'][-1][3]:.3f} | {r['total_time']:.1f} | {r['load'][0]} → {r['load'][1]} |")  # fmt: skip
    for seed in sorted({r["seed"] for r in res["runs"]}):
        mine = {r["mode"]: r for r in res["runs"] if r["seed"] == seed}
        for pm, p in mine.items():
            for m, r in mine.items():
                if not (m.startswith("sync") and pm.startswith("pipeline")):
                    continue
                to = (f"{r['time_to_target'] / p['time_to_target']:.2f}x"
                      if p["time_to_target"] and r["time_to_target"] else "n/a")  # fmt: skip
                it = r["per_iteration_s"]["wall"] / p["per_iteration_s"]["wall"]
                print(f"seed {seed}: {pm} vs {m}: {to} to {target}; {it:.2f}x per iteration")
    cols = ["wall", "gen_s", "wait_s", "score_s", "broadcast_s",
            "engine_gen_s", "engine_idle_s", "engine_recv_s"]  # fmt: skip
    print("\nmean seconds per iteration (sync: generation in the loop; pipeline: the trainer's "
          "wait for a batch, and the engine's own time per batch):")  # fmt: skip
    print("| run | seed | " + " | ".join(c.removesuffix("_s") for c in cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for r in res["runs"]:
        t = r["per_iteration_s"]
        cells = [f"{t[c]:.3f}" if c in t else "–" for c in cols]
        print(f"| {r['mode']} | {r['seed']} | " + " | ".join(cells) + " |")
    for r in res["runs"]:
        if r.get("staleness"):
            print(f"  staleness seed {r['seed']} (token lag: count): {r['staleness']}, kept "
                  f"{r['kept']} rollouts, {r['mixed_version_rollouts']} mixed-version, "
                  f"clip fraction {r['clip_fraction']}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Pipeline RL vs synchronous GRPO on a real model and task (gsm8k / math)

_REAL_PARTS = {
    "sync": ["gen_s", "serve_decode_s", "serve_mixed_s", "score_s"],
    "trainer": ["wait_s", "score_s", "broadcast_s"],
    "engine": ["engine_gen_s", "engine_serve_decode_s", "engine_serve_mixed_s", "engine_recv_s",
               "engine_idle_s"],
}  # fmt: skip


def _real_items(args, tok) -> list[dict]:
    """The train problems as ``lmforge rl --task gsm8k|math`` builds them (chat-templated prompt)."""
    from lmforge.posttrain.commands import math_items
    from lmforge.posttrain.tasks import read_jsonl
    from lmforge.utils.errors import LmforgeError

    if not args.data:
        raise LmforgeError(
            f"--task {args.task} needs --data (a folder with train.jsonl, or a file)"
        )
    data = Path(args.data)
    recs = read_jsonl(data / "train.jsonl" if data.is_dir() else data, "--data")
    return math_items(args.task, tok, recs[: args.train_limit] if args.train_limit else recs)


def _serve_stats(eng) -> dict:
    stats = getattr(getattr(eng, "engine", None), "stats", None) or {}
    return {f"serve_{k}": float(stats[k]) for k in ("decode_s", "mixed_s") if k in stats}


def _recording(reward, key: str):
    """``reward`` that also notes the problems it scores, in order (one entry per group)."""
    seen: list[str] = []

    def fn(item: dict, text: str):
        if not seen or seen[-1] != item[key]:
            seen.append(item[key])
        return reward(item, text)

    return fn, seen


def _real_task(args) -> dict:
    """Synchronous GRPO and Pipeline RL from the same weights on the same prompt stream and
    sample budget, per seed, alternated; no evaluation anywhere (reward per iteration instead)."""
    from lmforge.posttrain.core import is_lmforge_model
    from lmforge.posttrain.models import eos_ids, load_model
    from lmforge.posttrain.pipeline import ListPrompts, item_stream
    from lmforge.posttrain.tasks import gsm8k_reward, math_reward
    from lmforge.utils.errors import LmforgeError

    if not args.model:
        raise LmforgeError(f"--task {args.task} needs --model")
    base, tok = load_model(args.model, args.device)
    if tok is None or not is_lmforge_model(base):
        raise LmforgeError(f"{args.model}: need an lmforge model with its tokenizer")
    base.eval()
    eos = eos_ids(tok)
    items = _real_items(args, tok)
    reward = gsm8k_reward if args.task == "gsm8k" else math_reward
    key = "question" if args.task == "gsm8k" else "problem"
    n_params = sum(p.numel() for p in base.parameters())
    print(f"{args.model}: {n_params / 1e6:.1f} M parameters on {args.device}, {len(items)} "
          f"problems, {args.iterations} iterations x {args.prompts} prompts x {args.group} "
          f"samples, {args.max_tokens}-token replies, engine {args.engine}, lr {args.lr}",
          flush=True)  # fmt: skip
    runs: list[dict] = []
    out = Path(args.out)

    def result() -> dict:
        return {"task": args.task, "model": str(args.model), "device": args.device,
                "engine": args.engine, "iterations": args.iterations, "prompts": args.prompts,
                "group": args.group, "max_tokens": args.max_tokens, "lr": args.lr,
                "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "runs": runs}  # fmt: skip

    def save() -> None:  # after every run: a run cut short by a time limit keeps the finished ones
        from lmforge.utils.io import atomic_write_text

        atomic_write_text(out / "results.json", json.dumps(result(), indent=2) + "\n")

    def free() -> None:
        # the next run's engine sizes its KV cache from the free memory: release this one's
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def run_sync(seed: int, threads: int) -> None:
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        model = copy.deepcopy(base)
        load0 = _loadavg()
        scored, seen = _recording(reward, key)
        stream = item_stream(ListPrompts(items, seed))  # the pipeline engine's prompt stream
        hist = rl.train_grpo(
            model, tok, lambda n, rng: stream(n), scored, "grpo",
            out_dir=str(out / f"sync-{seed}-{threads}"), iterations=args.iterations,
            prompts_per_step=args.prompts, group_size=args.group, lr=args.lr,
            max_tokens=args.max_tokens, micro_batch=args.micro_batch, seed=seed,
            device=str(args.device),
        )  # fmt: skip
        runs.append(_real_record(f"sync {threads}t", seed, hist, "sync", [load0, _loadavg()],
                                 seen))  # fmt: skip
        print(f"  seed {seed} sync {threads} thread(s): {hist[-1]['time_s']:.1f} s", flush=True)
        del model
        free()

    def run_pipe(seed: int, tt: int, et: int, q: int, transport: str) -> None:
        torch.set_num_threads(tt)
        model = copy.deepcopy(base)
        pcfg = PipelineConfig(algo="grpo", iterations=args.iterations,
                              prompts_per_step=args.prompts, group_size=args.group, lr=args.lr,
                              max_tokens=args.max_tokens, max_lag=args.max_lag, seed=seed,
                              eval_every=args.check_every, threads=tt, engine_threads=et,
                              queue_size=q, micro_batch=args.micro_batch,
                              backend=args.backend, engine_device=args.engine_device,
                              transport=transport)  # fmt: skip
        load0 = _loadavg()
        torch.manual_seed(seed)
        scored, seen = _recording(reward, key)
        hist = run_pipeline(model, pcfg, progress=False, reward_fn=scored,
                            prompts=ListPrompts(items, seed), tokenizer=tok, eos_ids=eos)  # fmt: skip
        mode = f"pipeline {tt}+{et}t q{q}" + (f" {transport}" if transport != "broadcast" else "")
        runs.append(_real_record(mode, seed, hist, "pipeline", [load0, _loadavg()], seen))
        print(f"  seed {seed} pipeline {tt}+{et} threads, queue {q}, {transport}: "
              f"{hist[-1]['time_s']:.1f} s", flush=True)  # fmt: skip
        del model
        free()

    syncs = [int(x) for x in args.sync_threads.split(",") if x]
    pipes = []
    for spec in [x for x in args.pipe_threads.split(",") if x]:
        th, _, q = spec.partition(":")
        tt, et = (int(x) for x in th.split("+"))
        pipes += [(tt, et, int(qq), tr) for qq in (q.split() if q else args.queue.split(",")) if qq
                  for tr in args.transport.split(",") if tr]  # fmt: skip
    for seed in [int(x) for x in args.seeds.split(",") if x]:
        for i in range(max(len(syncs), len(pipes))):  # alternated: both see the same load drift
            if i < len(syncs):
                _guarded(runs, f"sync {syncs[i]}t", seed, run_sync, seed, syncs[i])
                save()
            if i < len(pipes):
                _guarded(runs, f"pipeline {pipes[i]}", seed, run_pipe, seed, *pipes[i])
                save()
                free()
    return result()


def _guarded(runs: list, mode: str, seed: int, fn, *args) -> None:
    """``fn(*args)``; a failure is recorded as that run's result and the next run goes ahead (one
    GPU session: a failing transport must not cost the other runs their figures)."""
    from lmforge.utils.errors import LmforgeError

    try:
        fn(*args)
    except (LmforgeError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"  seed {seed} {mode}: FAILED: {msg}", flush=True)
        runs.append({"mode": mode, "seed": seed, "error": msg})


def _real_record(mode: str, seed: int, hist: list[dict], kind: str, load: list[str],
                 seen: list[str]) -> dict:  # fmt: skip
    import hashlib

    keys = _REAL_PARTS["sync"] if kind == "sync" else _REAL_PARTS["trainer"] + _REAL_PARTS["engine"]
    times = [h["time_s"] for h in hist]
    per_it = [b - a for a, b in zip([0.0, *times], times)]
    rest = per_it[1:] or per_it

    def mean(k: str, rows: list[dict]) -> float:
        return round(sum(h.get(k, 0.0) for h in rows) / max(len(rows), 1), 4)

    rec = {"mode": mode, "seed": seed, "load": load, "total_s": round(times[-1], 2),
           "prompt_stream": hashlib.sha1("\n".join(seen).encode()).hexdigest()[:12],
           "problems_scored": len(seen),
           "s_per_iteration": round(times[-1] / len(hist), 3),
           "s_per_iteration_after_first": round(sum(rest) / len(rest), 3),
           "iteration_s": [round(t, 3) for t in per_it],
           "reward": [round(h["reward"], 4) for h in hist],
           "response_len": [round(h["response_len"], 1) for h in hist],
           "per_iteration_s": {k: mean(k, hist) for k in keys},
           "per_iteration_s_after_first": {k: mean(k, hist[1:] or hist) for k in keys}}  # fmt: skip
    if kind == "pipeline":
        rec["staleness"] = hist[-1].get("staleness_histogram")
        rec["kept"] = sum(h["kept"] for h in hist)
        rec["mixed_version_rollouts"] = sum(h["mixed_version_rollouts"] for h in hist)
        rec["sync_check"] = [(h["iteration"], h["sync_check"], h["sync_check_tokens"])
                             for h in hist if "sync_check" in h]  # fmt: skip
        rec["weight_check"] = [(h["iteration"], h["weight_check_version"], h["weight_check"])
                               for h in hist if "weight_check" in h]  # fmt: skip
        rec["mean_lag"] = [round(h["mean_lag"], 3) for h in hist]
        rec["clip_fraction"] = round(sum(h.get("clip_fraction", 0) for h in hist) / len(hist), 4)
    return rec


def _print_real(res: dict) -> None:
    failed = [r for r in res["runs"] if "error" in r]
    res = {**res, "runs": [r for r in res["runs"] if "error" not in r]}
    for r in failed:
        print(f"FAILED: {r['mode']} seed {r['seed']}: {r['error']}")
    print(f"\nPipeline RL vs synchronous GRPO, {res['task']}, {res['model']}, {res['device']}"
          f" ({res['gpu'] or 'CPU'}), torch {res['torch']}, engine {res['engine']}, "
          f"{res['iterations']} x {res['prompts']} x {res['group']} samples, "
          f"{res['max_tokens']}-token replies")  # fmt: skip
    print("| run | seed | s / iteration | after the 1st | total (s) | mean reward | load |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in res["runs"]:
        print(f"| {r['mode']} | {r['seed']} | {r['s_per_iteration']:.3f} | "
              f"{r['s_per_iteration_after_first']:.3f} | {r['total_s']:.1f} | "
              f"{sum(r['reward']) / len(r['reward']):.4f} | {r['load'][0]} → {r['load'][1]} |")  # fmt: skip
    for seed in sorted({r["seed"] for r in res["runs"]}):
        mine = [r for r in res["runs"] if r["seed"] == seed]
        for p in [r for r in mine if r["mode"].startswith("pipeline")]:
            for s in [r for r in mine if r["mode"].startswith("sync")]:
                a = s["s_per_iteration"] / p["s_per_iteration"]
                b = s["s_per_iteration_after_first"] / p["s_per_iteration_after_first"]
                same = "same" if p["prompt_stream"] == s["prompt_stream"] else "DIFFERENT"
                print(f"seed {seed}: {p['mode']} vs {s['mode']}: speed-up {a:.2f}x per "
                      f"iteration ({b:.2f}x after the first); {same} prompt stream "
                      f"({p['problems_scored']} / {s['problems_scored']} problems)")  # fmt: skip
    print("\nper iteration (s; reward):")
    for r in res["runs"]:
        cells = " ".join(f"{t:.2f};{w:.3f}" for t, w in zip(r["iteration_s"], r["reward"]))
        print(f"  {r['mode']} seed {r['seed']}: {cells}")
    cols = ["gen_s", "serve_decode_s", "serve_mixed_s", "wait_s", "score_s", "broadcast_s", "engine_gen_s", "engine_serve_decode_s",
            "engine_serve_mixed_s", "engine_recv_s", "engine_idle_s"]  # fmt: skip
    print("\nmean seconds per iteration after the first (sync: generation in the loop; pipeline: "
          "the trainer's parts, then the engine's own time per batch; serve_decode / "
          "serve_mixed: the serve engine's decode-only / prefill-carrying steps):")  # fmt: skip
    print("| run | seed | " + " | ".join(c.removesuffix("_s") for c in cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for r in res["runs"]:
        t = r["per_iteration_s_after_first"]
        print(f"| {r['mode']} | {r['seed']} | "
              + " | ".join(f"{t[c]:.3f}" if c in t else "–" for c in cols) + " |")  # fmt: skip
    for r in res["runs"]:
        if r["mode"].startswith("pipeline"):
            print(f"  {r['mode']} seed {r['seed']}: staleness (token lag: count) {r['staleness']}, "
                  f"mean lag per batch {r['mean_lag']}, kept {r['kept']} rollouts, "
                  f"{r['mixed_version_rollouts']} mixed-version, clip fraction "
                  f"{r['clip_fraction']}")  # fmt: skip
            print(f"    sync_check (iteration, max |ratio - 1| on lag-0 tokens, tokens): "
                  f"{r['sync_check']}; weight_check (iteration, engine version, mismatch): "
                  f"{r['weight_check']}")  # fmt: skip


if __name__ == "__main__":
    main()
