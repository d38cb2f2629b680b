"""Issue 36: quality of MHA, GQA, MLA and MLA + CLA (or GQA + CLA) at equal tokens and parameters.

Each variant trains through the user's command, ``python -m lmforge train --config FILE
--data.train=… --data.val=… --train.max_steps=N --train.out_dir=…`` (a subprocess; FILE is the
variant's ``[model]`` and ``[train]`` tables, written to ``<out>/<variant>/run.toml`` and
printed), on the same token windows (same seed, batch, context and steps), with the same width,
depth and heads:

  mha      ``n_kv_heads = H``                      multi-head attention (the baseline)
  gqa4     ``n_kv_heads = H / 4``                  grouped-query attention, 4 queries per kv head
  mla      ``attention_type = "mla"``              DeepSeek-V2/V3 latent attention: latent C = 4E,
           decoupled RoPE R = E/2, no-position q/k dims N = E, value dims E, full-rank queries
  mla_cla  ``mla`` + ``kv_share_every = 2``        cross-layer attention: every second layer
           reuses the latent of the layer before it
  gqa4_cla ``gqa4`` + ``kv_share_every = 2``       cross-layer attention on GQA-4: every second
           layer reuses the keys/values of the layer before it (opt-in: ``--variants``)
  mla_quarter  ``mla`` with C + R = H·E/8          a latent a quarter of GQA-4's cache (issue 36's
           KV target; R = E/4, C the rest): what the target costs at a few heads (opt-in)

(E = d_model / H.) Each variant's ``d_ff`` is set so that its parameter count
(:func:`lmforge.model.accounting.parameter_count`, exact) matches MHA's to within one step of
``d_ff`` (8), which is far below 1% at these widths. The validation-loss curve is read from the
run's ``metrics.jsonl`` (``event = eval``: fixed sequential validation windows, the trainer's
own evaluation). KV-cache bytes per token in bf16 come from
:func:`lmforge.model.accounting.kv_cache_bytes_per_token`. All curves go into one PNG
(``<out>/attention_quality.png``); the table is printed last: final validation loss, Δ% vs MHA,
parameters, KV bytes per token. ``<out>/attention_quality.json`` holds everything.

``--data DIR`` holds ``train.bin`` and ``val.bin`` (``lmforge tokenizer encode`` shards). The
defaults are sized for one H200 (d_model 512, 8 layers, 8 heads, T 1024, batch 16, 800 steps =
13.1M tokens per variant, bf16; estimated at about 1 minute per variant, not yet measured there);
``--minutes`` (6) is split into a cap per run (``train.max_minutes``) so the call fits one
8-minute device call even on a slower GPU: a capped run has fewer tokens, and the table's token
column says so. Simplification: the MLA shape is derived from E as above (``--kv-lora-rank``,
``--rope-dim`` override it); no low-rank queries.

    PYTHONPATH=src python benchmarks/attention_quality.py --data .carry/mq/shards --out runs/aq
    PYTHONPATH=src python benchmarks/attention_quality.py --data runs/data/shards --device cpu \
        --d-model 128 --layers 4 --seq 128 --steps 400 --lr 2e-3 --out runs/aq_cpu
    PYTHONPATH=src python benchmarks/attention_quality.py --quick --out /tmp/aq   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # runs without install

VARIANTS = ("mha", "gqa4", "mla", "mla_cla")  # the default set
OPTIONAL = ("gqa4_cla", "mla_quarter")  # by name in --variants


def _parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=doc[: doc.index("    PYTHONPATH")].rstrip(),
        epilog="examples:\n" + doc[doc.index("    PYTHONPATH") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", type=Path, help="directory with train.bin and val.bin shards")
    p.add_argument("--out", type=Path, default=Path("runs/attention_quality"))
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024, help="context length T")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=800, help="optimizer steps per run")
    p.add_argument("--lr", type=float, default=2e-3, help="peak LR (cosine to lr/10)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=10)
    p.add_argument("--minutes", type=float, default=6.0,
                   help="wall-clock budget of the whole call, split over its runs")  # fmt: skip
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: a tiny model, synthetic shards unless --data (numbers mean nothing)")  # fmt: skip
    return p


def add_quality_args(p: argparse.ArgumentParser) -> None:
    """This script's own options (MLA shape, variant subset)."""
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset (also: {', '.join(OPTIONAL)})")  # fmt: skip
    p.add_argument("--kv-lora-rank", type=int, default=0, help="MLA latent C (0: 4·E)")
    p.add_argument("--rope-dim", type=int, default=0, help="MLA decoupled RoPE dims R (0: E/2)")


def quick(args: argparse.Namespace) -> None:
    """Shrink everything for a CPU smoke run; synthetic shards when no --data is given."""
    args.d_model, args.layers, args.heads, args.seq, args.batch = 32, 2, 4, 32, 4
    args.steps, args.eval_every, args.eval_batches, args.device = 6, 3, 2, "cpu"
    if args.data is None:
        import numpy as np

        from lmforge.train.data import write_shard

        args.data = args.out / "synthetic"
        rng = np.random.default_rng(0)
        runs = rng.integers(0, 61, (800, 8))  # a copy task: runs of 8 tokens, each repeated once
        toks = np.concatenate([np.concatenate([r, r]) for r in runs])
        args.data.mkdir(parents=True, exist_ok=True)
        write_shard(args.data / "train.bin", toks[:10000], 64)
        write_shard(args.data / "val.bin", toks[10000:], 64)


def resolve(args: argparse.Namespace) -> tuple[Path, Path, int]:
    """(train shard, val shard, vocabulary size); one LmforgeError line when they are wrong.
    Resolves ``--device auto``."""
    import torch

    from lmforge.train.data import open_shard
    from lmforge.utils.errors import LmforgeError

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.data is None:
        raise LmforgeError("--data DIR (with train.bin and val.bin) is required without --quick")
    train, val = (args.data / "train.bin").resolve(), (args.data / "val.bin").resolve()
    for shard in (train, val):
        if not shard.is_file():
            raise LmforgeError(f"token shard {shard} not found (lmforge tokenizer encode)")
    vocab = open_shard(train).vocab_size
    if open_shard(val).vocab_size != vocab:
        raise LmforgeError(f"{train} and {val} come from different vocabularies")
    return train, val, vocab


def base_model(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The ``[model]`` keys every variant shares."""
    return {"vocab_size": vocab, "context_length": args.seq, "d_model": args.d_model,
            "n_layers": args.layers, "n_heads": args.heads}  # fmt: skip


def variant_models(args: argparse.Namespace, vocab: int) -> dict[str, dict[str, Any]]:
    """Each variant's ``[model]`` keys, ``d_ff`` matched to MHA's parameter count."""
    from lmforge.model import ModelConfig, accounting
    from lmforge.utils.errors import LmforgeError

    if args.d_model % args.heads or args.heads % 4:
        raise LmforgeError(f"--heads ({args.heads}) must divide --d-model and be a multiple of 4")
    e = args.d_model // args.heads
    mla = {"attention_type": "mla", "kv_lora_rank": args.kv_lora_rank or 4 * e,
           "qk_rope_head_dim": args.rope_dim or max(2, e // 2), "qk_nope_head_dim": e,
           "v_head_dim": e, "q_lora_rank": 0}  # fmt: skip
    extra = {"mha": {}, "gqa4": {"n_kv_heads": args.heads // 4}, "mla": mla,
             "mla_cla": {**mla, "kv_share_every": 2},
             "gqa4_cla": {"n_kv_heads": args.heads // 4, "kv_share_every": 2}}  # fmt: skip
    # a quarter of GQA-4's 2 · (H/4) · E cached values per layer: C + R = H·E/8
    rope = max(2, e // 4 // 2 * 2)
    extra["mla_quarter"] = {**mla, "qk_rope_head_dim": rope,
                            "kv_lora_rank": args.heads * e // 8 - rope}  # fmt: skip
    base = base_model(args, vocab)
    target = accounting.parameter_count(ModelConfig(**base))
    out = {}
    for name in args.variants.split(","):
        if name not in extra:
            known = ", ".join(VARIANTS + OPTIONAL)
            raise LmforgeError(f"--variants: unknown {name!r} (one of {known})")
        keys = {**base, **extra[name]}
        cfg = ModelConfig(**keys)
        per_ffn = 3 * cfg.d_model * cfg.n_layers  # parameters per unit of d_ff (SwiGLU: 3 mats)
        rest = accounting.parameter_count(cfg) - per_ffn * cfg.ffn_dim
        keys["d_ff"] = max(8, 8 * round((target - rest) / per_ffn / 8))
        out[name] = keys
    return out


def train_table(args: argparse.Namespace, budget_min: float) -> dict[str, Any]:
    """The ``[train]`` keys every run shares (the trainer's defaults otherwise)."""
    table = {"device": args.device, "seed": 0, "batch_size": args.batch, "lr": args.lr,
             "min_lr": args.lr / 10, "warmup_steps": max(1, args.steps // 20),
             "eval_every": args.eval_every, "eval_batches": args.eval_batches,
             "save_every": 0, "save_every_minutes": 0.0, "keep_last": 1, "resume": False,
             "plot": False, "max_minutes": budget_min}  # fmt: skip
    if args.device == "cpu":
        table["precision"] = "fp32"  # bf16 autocast on a CPU is slower, not faster
    return table


def run_train(
    args: argparse.Namespace, name: str, model: dict[str, Any], train: dict[str, Any],
    data: tuple[Path, Path, int],
) -> Path:  # fmt: skip
    """``python -m lmforge train`` for one run into ``<out>/<name>``; returns that folder."""
    import shutil

    from lmforge.utils.errors import LmforgeError
    from lmforge.utils.io import atomic_write_text

    run = (args.out / name).resolve()
    shutil.rmtree(run, ignore_errors=True)  # this script's own run: always from step 0
    run.mkdir(parents=True)
    toml = run / "run.toml"
    atomic_write_text(toml, to_toml({"model": model, "train": train}))
    cmd = [sys.executable, "-m", "lmforge", "train", "--config", str(toml),
           f"--data.train={data[0]}", f"--data.val={data[1]}",
           f"--train.max_steps={args.steps}", f"--train.out_dir={run / 'train'}"]  # fmt: skip
    print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    rc = subprocess.run(cmd, env=env, cwd=REPO).returncode
    if rc != 0:
        raise LmforgeError(f"lmforge train for {name} exited with status {rc}")
    print(f"== {name}: {time.monotonic() - start:.0f} s", flush=True)
    return run / "train"


def to_toml(tables: dict[str, dict[str, Any]]) -> str:
    """``{section: {key: scalar}}`` as TOML tables (a run config is pure data)."""
    lines = []
    for section, keys in tables.items():
        lines.append(f"[{section}]")
        for k, v in keys.items():
            lines.append(f"{k} = {json.dumps(v)}")  # JSON scalars are TOML scalars
        lines.append("")
    return "\n".join(lines)


def curve(run: Path) -> list[tuple[int, float]]:
    """(step, val_loss) of every evaluation in ``run/metrics.jsonl`` (one point per step)."""
    from lmforge.train.metrics import read_metrics

    recs = read_metrics(run / "metrics.jsonl")
    pts = {int(r["step"]): float(r["val_loss"]) for r in recs
           if r.get("event") == "eval" and "val_loss" in r}  # fmt: skip
    return sorted(pts.items())


def final_record(run: Path) -> dict[str, Any]:
    """The run's ``event = final`` record (steps, tokens, val loss, checkpoint)."""
    from lmforge.train.metrics import read_metrics

    recs = [r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == "final"]
    return recs[-1] if recs else {}


def figure(series: dict[str, list[tuple[int, float]]], path: Path, title: str) -> None:
    """All curves in one PNG (written atomically)."""
    from lmforge.train.metrics import plot_curves

    plot_curves(path, series, "step (equal tokens per step)", "validation loss", title)


def environment(device: str) -> str:
    """One line: date, device, torch and python versions."""
    import platform

    import torch

    cpu = f"{platform.machine()}, {os.cpu_count()} cores"
    dev = torch.cuda.get_device_name() if device.startswith("cuda") else cpu
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {device} ({dev}),"
            f" torch {torch.__version__}, python {platform.python_version()}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from lmforge.model import ModelConfig, accounting
    from lmforge.utils.io import atomic_write_text

    p = _parser(__doc__)
    add_quality_args(p)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        quick(args)
    data = resolve(args)
    models = variant_models(args, data[2])
    train = train_table(args, 0.0 if args.quick else args.minutes / len(models))
    for name, keys in models.items():
        cfg = ModelConfig(**keys)
        print(f"{name:8s} params {accounting.parameter_count(cfg):,} (d_ff {cfg.ffn_dim}),"
              f" KV {accounting.kv_cache_bytes_per_token(cfg)} B/token (bf16)")  # fmt: skip
    results = []
    for name, keys in models.items():
        run = run_train(args, name, keys, train, data)
        cfg = ModelConfig(**keys)
        fin = final_record(run)
        results.append({
            "variant": name, "model": keys, "params": accounting.parameter_count(cfg),
            "kv_bytes_per_token": accounting.kv_cache_bytes_per_token(cfg),
            "steps": fin.get("iteration"), "tokens": fin.get("tokens"), "curve": curve(run),
            "flops_per_token": accounting.flops_per_token(cfg, args.seq),
        })  # fmt: skip
    env = environment(args.device)
    png = args.out / "attention_quality.png"
    figure({r["variant"]: r["curve"] for r in results}, png,
           f"MHA / GQA / MLA / MLA+CLA at equal parameters and tokens\n(d={args.d_model},"
           f" L={args.layers}, T={args.seq})")  # fmt: skip
    report = {"env": env, "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    atomic_write_text(args.out / "attention_quality.json", json.dumps(report, indent=1))
    print(f"\n{env}\nfigure: {png}\n")
    print(table(results))
    return 0


def table(results: list[dict[str, Any]]) -> str:
    """Final val loss, Δ% vs MHA, parameters, KV bytes per token, tokens."""
    last = {r["variant"]: (r["curve"][-1][1] if r["curve"] else math.nan) for r in results}
    ref = last.get("mha", math.nan)
    mha_params = next((r["params"] for r in results if r["variant"] == "mha"), None)
    rows = ["| variant | final val loss | Δ vs MHA | params | Δ params | KV bytes/token (bf16) |"
            " d_ff | tokens |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        dp = f"{100 * (r['params'] / mha_params - 1):+.2f}%" if mha_params else "-"
        tok = f"{r['tokens'] / 1e6:.2f}M" if r["tokens"] else "-"
        rows.append(f"| {r['variant']} | {last[r['variant']]:.4f} |"
                    f" {100 * (last[r['variant']] / ref - 1):+.2f}% | {r['params']:,} | {dp} |"
                    f" {r['kv_bytes_per_token']:,} | {r['model']['d_ff']} | {tok} |")  # fmt: skip
    if "mla" in last and "mha" in last:
        gap = 100 * (last["mla"] / ref - 1)
        rows.append(f"\nMLA vs MHA final validation loss: {gap:+.2f}% (issue 36's target: within"
                    f" 1%: {'met' if abs(gap) <= 1 else 'NOT met'})")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    from lmforge.utils.errors import LmforgeError

    try:
        sys.exit(main())
    except LmforgeError as err:
        sys.exit(f"attention_quality: {err}")
