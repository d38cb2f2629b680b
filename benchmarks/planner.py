"""Simulate FSDP scaling from 8 to 16,384 GPUs and plot where communication overtakes compute.

For 7B-, 70B- and 405B-class dense models (and a sparse variant) with H200 defaults, compute per
step (6·N_active·tokens / (GPUs · peak · MFU)) falls as 1/GPUs while ZeRO-3 traffic per GPU
(3× the parameter bytes, hierarchical over 8-GPU NVLink domains) does not: the curves cross. The
plot shows the crossover, the batch-size floor (one sequence per GPU) and how a 4× batch, MoE
sparsity and a 64-GPU domain (TPU-like) move the crossover. Pure arithmetic, runs on CPU.

Global batch per model: 7B and 70B 1024 × 4096 tokens (4M, Llama-2-like), 405B 4096 × 4096 (16M,
Llama-3-like). With these formulas a dense model's crossover depends on tokens per step, not on
its size (compute and bytes both scale with N); size matters through the batch it trains with,
the latency term and memory.

    PYTHONPATH=src python benchmarks/planner.py [--out benchmarks/planner_crossover.png]
    PYTHONPATH=src python benchmarks/planner.py --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import platform
import sys

from lmforge.parallel.planner import MODELS, Hardware, fsdp_crossover, fsdp_times
from lmforge.utils.io import atomic_write_bytes

SEQ = 4096
CASES = [("7b", 1024), ("70b", 1024), ("405b", 4096)]
GPUS = [2**i for i in range(3, 15)]  # 8 … 16384


def _scenarios(name: str, batch: int) -> list[tuple[str, object, Hardware, int]]:
    model = MODELS[name]
    hw = Hardware()
    return [
        ("as given", model, hw, batch),
        ("4× batch", model, hw, 4 * batch),
        (
            "MoE: active = total/4",
            dataclasses.replace(model, active_params=model.active / 4),
            hw,
            batch,
        ),
        ("domain 64 (TPU-like)", model, dataclasses.replace(hw, domain_size=64), batch),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="benchmarks/planner_crossover.png", help="PNG to write")
    p.add_argument("--results", help="append the table to this markdown file")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CASES), figsize=(5.2 * len(CASES), 4.4), sharey=False)
    rows = [
        "| model | scenario | global batch (seqs) | crossover GPUs | batch floor (max GPUs) |",
        "|---|---|---|---|---|",
    ]
    for ax, (name, batch) in zip(axes, CASES):
        base_model, base_hw = MODELS[name], Hardware()
        # Comm depends on total bytes and the domain only; compute on active params and batch.
        for hw, style, label in ((base_hw, "k--", "ZeRO-3 comm, domain 8"),):
            comm = [fsdp_times(base_model, hw, n, batch, SEQ)[1] for n in GPUS]
            ax.loglog(GPUS, comm, style, label=label)
        hw64 = dataclasses.replace(base_hw, domain_size=64)
        comm64 = [fsdp_times(base_model, hw64, n, batch, SEQ)[1] for n in GPUS]
        ax.loglog(GPUS, comm64, "--", color="C3", label="ZeRO-3 comm, domain 64 (TPU-like)")
        for (label, model, hw, gb), color in zip(_scenarios(name, batch), ["C0", "C1", "C2", "C3"]):
            x = fsdp_crossover(model, hw, gb, SEQ)
            rows.append(
                f"| {name} | {label} | {gb} | {'never' if x is None else f'{x:.0f}'} | {gb} |"
            )
            if label.startswith("domain"):
                comp_color = "C0"  # same compute as "as given"; only the comm curve moves
            else:
                comp = [fsdp_times(model, hw, n, gb, SEQ)[0] for n in GPUS]
                ax.loglog(GPUS, comp, "-", color=color, label=f"compute, {label}")
                comp_color = color
            if x is not None:
                y = fsdp_times(model, hw, int(x), gb, SEQ)[0]
                ax.plot([x], [y], "o", color=comp_color, markeredgecolor=color, markersize=7)
                ax.annotate(
                    f"{x:.0f}", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=7
                )
        ax.axvline(batch, color="gray", linewidth=2, alpha=0.5, label="batch floor (1 seq/GPU)")
        ax.set_title(f"{name}: FSDP, {batch}×{SEQ} tokens/step")
        ax.set_xlabel("GPUs (H200)")
        ax.set_ylabel("seconds per step")
        ax.grid(True, which="both", alpha=0.2)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(
        "FSDP crossover: solid = compute per step, dashed = ZeRO-3 communication, dots = crossover"
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    atomic_write_bytes(args.out, buf.getvalue())
    table = "\n".join(rows)
    print(f"wrote {args.out}\n")
    print(table)
    if args.results:
        entry = (
            f"\n## planner crossover ({datetime.date.today()}, CPU arithmetic, "
            f"python {platform.python_version()})\n\n"
            f"`PYTHONPATH=src python {' '.join(['benchmarks/planner.py', *sys.argv[1:]])}`\n\n"
            f"{table}\n"
        )
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(entry)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
