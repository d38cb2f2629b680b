"""One GRPO iteration's training step on GSM8K: the Trainer (fast AdamW) vs the old hand loop.

The same rollout batch (SmolLM2-135M-Instruct, ``--prompts`` × ``--group`` samples of up to
``--max-tokens`` tokens on GSM8K train prompts, sampled once by ``lmforge.serve.Engine`` through
:func:`lmforge.posttrain.rollout.rollout_engine` and saved) is trained on by

* **new**: :class:`lmforge.posttrain.rl.GRPOObjective` in :class:`lmforge.train.Trainer`
  (``train.adamw=auto``: lmforge's one-launch Triton AdamW on CUDA; fp32, micro-batches of
  ``--micro-batch`` sequences weighted as the algorithm aggregates), the path ``lmforge rl``
  runs;
* **old**: the hand-written loop this replaced (``rl.rl_train_step`` + ``torch.optim.AdamW``,
  β = (0.9, 0.99), no weight decay), imported in a subprocess from ``--old-src`` (the ``src``
  folder of a checkout or ``git worktree`` of the commit before the change).

Correctness first: both sides start from the same weights and batch, so the first step's loss
must agree (relative 1e-4) and the first update of every watched parameter must agree with the
torch AdamW reference: |Δw_new − Δw_old| ≤ 1e-3 × max |Δw_old| + 2 ulp(w) element by element
(:func:`update_agreement`). The ulp term is the rounding of ``w + Δw`` to fp32: at lr 2e-6 an
update is ~2e-6 while one ulp of a weight of 0.3 is 3e-8, so two AdamW kernels that round their
last operation differently disagree by 1.5% of the update on the elements where they do.
Then ``--steps`` timed steps after ``--warmup`` untimed ones (CUDA events; medians). The table
is printed last; ``--out`` keeps the batch and JSON.

Run on a GPU host (torch 2.11, triton 3.6):

    git worktree add /tmp/lmforge-old <commit-before> && \\
    python benchmarks/posttrain_grpo_step.py --device cuda --old-src /tmp/lmforge-old/src

Shape legend: B sequences, T tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
WATCH = ("lm_head.weight", "layers.0.attn.q_proj.weight", "layers.29.ffn.w2.weight")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(SHARED / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--data", default=str(SHARED / "data/eval/gsm8k/train.jsonl"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--old-src", default=None, help="src/ of the pre-Trainer checkout (old side)")
    ap.add_argument("--new-src", default=str(REPO / "src"), help="src/ of the new side")
    ap.add_argument("--side", choices=["both", "new", "old"], default="both")
    ap.add_argument("--batch", default=None, help="(internal) the saved rollout batch")
    ap.add_argument("--out", default=None, help="folder for batch.pt and results.json")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The rollout batch (new code only)


def make_batch(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Sample and score one GRPO batch on the serving engine; save its tensors to ``path``."""
    import random

    from lmforge.posttrain import rl
    from lmforge.posttrain.commands import math_items
    from lmforge.posttrain.models import eos_ids, load_model
    from lmforge.posttrain.rollout import rollout_engine
    from lmforge.posttrain.tasks import gsm8k_reward, read_jsonl

    model, tok = load_model(args.model, args.device)
    items = math_items("gsm8k", tok, read_jsonl(args.data)[:2000])
    eos = eos_ids(tok)
    obj = rl.GRPOObjective(rollout_engine(model, eos, seed=0), tok,
                           lambda n, rng: rng.sample(items, n), gsm8k_reward, "grpo",
                           prompts_per_step=args.prompts, group_size=args.group, epochs=1,
                           micro_batch=args.micro_batch, max_tokens=args.max_tokens,
                           eos_ids=eos, seed=1)  # fmt: skip
    obj.rng = random.Random(1)
    t = time.perf_counter()
    samples, stats = obj._rollout(0)
    gen_s = time.perf_counter() - t
    torch.save(rl._samples_state(samples), path)
    return {
        "rollout_s": gen_s,
        "sequences": len(samples),
        "tokens": int(samples.batch.mask.sum()),
        "reward": stats["reward"],
    }


# ---------------------------------------------------------------------------------------------
# The two sides (each run in its own process: the old side imports another lmforge)


def _time_steps(step: Any, args: argparse.Namespace) -> tuple[float, list[float]]:
    """(first step's loss, timed ms per step) of ``step() -> loss``."""
    first = float(step())
    for _ in range(args.warmup - 1):
        step()
    times = []
    cuda = args.device.startswith("cuda")
    for _ in range(args.steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t))
    return first, times


def _watched(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = dict(model.named_parameters())
    return {k: sd[k].detach().float().cpu().clone() for k in WATCH if k in sd}


def _ulp(w: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each fp32 element (its spacing to the next larger |w|)."""
    a = w.float().abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a


def update_agreement(
    new: dict[str, torch.Tensor],
    old: dict[str, torch.Tensor],
    ulp: dict[str, torch.Tensor],
    rel: float = 1e-3,
) -> dict[str, float]:
    """How far the new side's first update is from the old side's, per watched parameter:
    ``worst`` = max over elements of |Δnew − Δold| / (rel × max |Δold| + 2 ulp(w)) (≤ 1 passes),
    ``rel_diff`` = max |Δnew − Δold| / max |Δold| (the bare relative figure), ``differ`` = the
    fraction of elements not bit-equal."""
    worst = rel_diff = 0.0
    differ = total = 0
    for k, d_old in old.items():
        diff = (new[k] - d_old).abs()
        scale = d_old.abs().max().clamp_min(1e-30)
        worst = max(worst, float((diff / (rel * scale + 2 * ulp[k])).max()))
        rel_diff = max(rel_diff, float(diff.max() / scale))
        differ += int((diff > 0).sum())
        total += diff.numel()
    return {"worst": worst, "rel_diff": rel_diff, "differ": differ / max(total, 1)}


def run_new(args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer with GRPOObjective on the saved batch (its rollout replaced by the batch)."""
    from lmforge.config import RunConfig
    from lmforge.posttrain import rl
    from lmforge.posttrain.models import load_model
    from lmforge.train import TrainConfig, Trainer

    model, tok = load_model(args.model, args.device)
    fixed = rl._samples_from(torch.load(args.batch, weights_only=True))

    class FixedBatch(rl.GRPOObjective):
        def _rollout(self, version: int) -> tuple[Any, dict[str, float]]:
            return fixed, {}

    obj = FixedBatch(None, tok, None, None, "grpo", prompts_per_step=args.prompts,  # type: ignore[arg-type]
                     group_size=args.group, epochs=1, micro_batch=args.micro_batch,
                     max_tokens=args.max_tokens)  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tc = TrainConfig(out_dir=d, device=args.device, precision="fp32", lr=args.lr, min_lr=0.0,
                         beta2=0.99, weight_decay=0.0, schedule="constant", warmup_steps=0,
                         max_steps=10**6, batch_size=args.micro_batch, grad_clip=1.0,
                         eval_every=0, save_every=0, progress=False, plot=False)  # fmt: skip
        trainer = Trainer(RunConfig(train=tc), model=model, objective=obj)
        before = _watched(model)
        first_update: dict[str, torch.Tensor] = {}
        ulps: dict[str, torch.Tensor] = {}

        def step() -> float:
            loss, _, reason = trainer.train_step()
            if reason is not None:
                raise SystemExit(f"the new side skipped a step: {reason}")
            if not first_update:
                after = _watched(model)
                first_update.update({k: v - before[k] for k, v in after.items()})
                ulps.update({k: _ulp(v) for k, v in after.items()})
            return loss

        loss, times = _time_steps(step, args)
        mem = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else 0
        return {
            "side": "new",
            "adamw": trainer.fast.adamw,
            "loss": loss,
            "ms": times,
            "peak_gib": mem,
            "update": first_update,
            "ulp": ulps,
        }


def run_old(args: argparse.Namespace) -> dict[str, Any]:
    """The old loop: rl.rl_train_step with torch AdamW, as rl.run_iterations built it."""
    from lmforge.posttrain import rl  # the old checkout's (PYTHONPATH=--old-src)
    from lmforge.posttrain.core import Batch
    from lmforge.posttrain.models import load_model

    model, _ = load_model(args.model, args.device)
    d = torch.load(args.batch, weights_only=True)
    samples = rl.Samples(Batch(d["input_ids"], d["labels"]), d["old_logp"], d["versions"],
                         d["advantages"], d["rewards"], d["lengths"], d["truncated"],
                         d["weights"])  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    cfg = rl.StepConfig(rl.algorithm("grpo"), max_tokens=args.max_tokens,
                        micro_batch=args.micro_batch)  # fmt: skip
    model.train()
    before = _watched(model)
    first_update: dict[str, torch.Tensor] = {}
    ulps: dict[str, torch.Tensor] = {}

    def step() -> float:
        stats = rl.rl_train_step(model, opt, samples, cfg)
        if not first_update:
            after = _watched(model)
            first_update.update({k: v - before[k] for k, v in after.items()})
            ulps.update({k: _ulp(v) for k, v in after.items()})
        return stats["loss"]

    loss, times = _time_steps(step, args)
    mem = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else 0
    return {
        "side": "old",
        "adamw": "torch.optim.AdamW (foreach)",
        "loss": loss,
        "ms": times,
        "peak_gib": mem,
        "update": first_update,
        "ulp": ulps,
    }


def _child(args: argparse.Namespace, side: str, src: str, out: Path) -> dict[str, Any]:
    res_file = out / f"{side}.pt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--batch",
           str(out / "batch.pt"), "--out", str(out), "--device", args.device,
           "--model", args.model, "--prompts", str(args.prompts), "--group", str(args.group),
           "--max-tokens", str(args.max_tokens), "--micro-batch", str(args.micro_batch),
           "--lr", str(args.lr), "--warmup", str(args.warmup), "--steps", str(args.steps)]  # fmt: skip
    rest = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and not Path(p, "lmforge").is_dir()
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, *rest])}  # keep e.g. the gguf reader
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the {side} side failed (exit {done.returncode})")
    return torch.load(res_file, weights_only=True)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="grpo-step-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.side != "both":  # a child: one side, results to OUT/SIDE.pt
        res = run_new(args) if args.side == "new" else run_old(args)
        torch.save(res, out / f"{args.side}.pt")
        return 0
    if not args.old_src:
        raise SystemExit("--old-src is required (the src/ of a checkout before the Trainer change)")
    batch = make_batch(args, out / "batch.pt")
    print(
        f"batch: {batch['sequences']} sequences, {batch['tokens']} completion tokens, "
        f"reward {batch['reward']:.3f}, sampled in {batch['rollout_s']:.1f} s",
        flush=True,
    )
    new = _child(args, "new", str(Path(args.new_src).resolve()), out)
    old = _child(args, "old", str(Path(args.old_src).resolve()), out)
    # correctness: the same first loss, the same first update as torch's AdamW
    rel = abs(new["loss"] - old["loss"]) / max(abs(old["loss"]), 1e-12)
    ulp = {k: torch.maximum(new["ulp"][k], old["ulp"][k]) for k in old["ulp"]}
    agree = update_agreement(new["update"], old["update"], ulp)
    ok = rel <= 1e-4 and agree["worst"] <= 1.0
    summary = {"batch": batch, "loss_rel_diff": rel, "update_rel_diff": agree["rel_diff"],
               "update_worst_vs_tolerance": agree["worst"], "update_elements_differing":
               agree["differ"], "ok": ok,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__}  # fmt: skip
    rows = []
    for r in (new, old):
        med = statistics.median(r["ms"])
        rows.append((r["side"], r["adamw"], med, min(r["ms"]), r["peak_gib"], r["loss"]))
        summary[r["side"]] = {"ms_median": med, "ms": r["ms"], "peak_gib": r["peak_gib"],
                              "loss": r["loss"], "adamw": r["adamw"]}  # fmt: skip
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"check: first-step loss rel diff {rel:.2e} (<= 1e-4); first update: max |dnew - dold| "
          f"{agree['rel_diff']:.2e} of max |dold|, {100 * agree['differ']:.3f}% of elements not "
          f"bit-equal, worst {agree['worst']:.2f} of the tolerance 1e-3 max |dold| + 2 ulp(w) "
          f"(<= 1): {'ok' if ok else 'FAILED'}")  # fmt: skip
    speed = rows[1][2] / rows[0][2]
    print()
    print("| path | AdamW | ms/step (median) | ms/step (min) | peak GiB | first loss |")
    print("|---|---|---:|---:|---:|---:|")
    for side, adamw, med, low, mem, loss in rows:
        print(f"| {side} | {adamw} | {med:.1f} | {low:.1f} | {mem:.2f} | {loss:.6f} |")
    print(f"\nnew / old step time: {1 / speed:.3f} ({speed:.2f}x faster)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
