"""``lmforge probe causality``: registered here so torch is imported only when the command runs."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  lmforge probe causality --config configs/tiny.toml                      # dense: exit 0
  lmforge probe causality --config configs/tiny.toml --model.moe.n_experts=8 --model.moe.top_k=2
  lmforge probe causality --config configs/tiny.toml --model.moe.n_experts=8 \\
      --model.moe.top_k=2 --model.moe.routing=expert_choice                # exit 1: leaks
  lmforge probe causality --config configs/moe-tiny.toml --model.moe.routing=token_choice_capacity
  lmforge probe causality --checkpoint runs/moe/ --json

Checks: future (tokens after --position replaced: positions <= t must not change), other_rows
(rows 1.. replaced: row 0 must not change), incremental (full forward vs KV-cache decoding).
Exit status: 0 causal, 1 causality broken, 2 usage error.
"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``probe`` command and its ``causality`` subcommand."""
    from lmforge.cli import add_config_arguments

    p = sub.add_parser(
        "probe",
        help="probe a model: causality of MoE routing and of KV-cache decoding",
        description="Probe a model's behaviour on random token batches.",
    )
    probes = p.add_subparsers(dest="probe", metavar="PROBE")
    c = probes.add_parser(
        "causality",
        help="does any position depend on later tokens, other rows, or decode differently?",
        description=(
            "Perturb the tokens after position t (and, separately, the other rows of the batch), "
            "run the model again, and report every position <= t (of row 0) whose block output, "
            "logits or expert assignments changed, per layer, with the largest change; also "
            "compare the full-sequence logits with token-by-token KV-cache decoding. "
            "Expert-choice routing and capacity dropping leak; dropless token choice does not."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(c, "TOML run config whose [model] is probed (randomly initialised)")
    c.add_argument("--checkpoint", metavar="DIR", help="probe a trained checkpoint instead")
    c.add_argument("--batch", type=int, default=4, help="rows per batch (default 4)")
    c.add_argument("--seq-len", type=int, default=32, help="tokens per row (default 32)")
    c.add_argument("--position", type=int, help="t (default seq_len // 2 - 1)")
    c.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokens")
    c.add_argument("--atol", type=float, default=1e-4, help="relative change counted (1e-4)")
    c.add_argument("--device", default="cpu", help="cpu (default), cuda, auto")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(func=_run_causality)
    p.set_defaults(func=lambda args: p.error("choose a probe: causality"))


def _run_causality(args: argparse.Namespace) -> int:
    import json

    import torch

    from lmforge.probe.causality import probe_causality
    from lmforge.utils.errors import LmforgeError

    if args.checkpoint:
        if args.config or args.overrides:
            raise LmforgeError("give either --checkpoint or --config/overrides, not both")
        from lmforge.train import load_for_inference

        model, _ = load_for_inference(args.checkpoint, device=args.device)
    else:
        from lmforge.config import load_run_config
        from lmforge.model import TransformerLM
        from lmforge.utils.runtime import resolve_device

        cfg = load_run_config(args.config, args.overrides)
        torch.manual_seed(args.seed)
        model = TransformerLM(cfg.model, device=resolve_device(args.device))
    report = probe_causality(
        model,
        batch=args.batch,
        seq_len=args.seq_len,
        position=args.position,
        seed=args.seed,
        atol=args.atol,
    )
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(
            f"causality probe: routing {report.routing}, batch {report.batch} × "
            f"{report.seq_len} tokens, t = {report.position}"
        )
        print(report.table())
        leaks = report.first_leaks()
        if not leaks:
            print("causal: no position depends on later tokens or other rows; KV decoding agrees")
        for check, c in leaks.items():
            print(
                f"BROKEN ({check}): first in {c.layer}, {c.changed} positions changed, "
                f"{c.assignments_changed or 0} expert assignments, largest at {c.where} "
                f"({c.max_change:.2e} of the layer's max)"
            )
            shown = ", ".join(f"{r}:{t}" for r, t in c.positions[:12])
            more = f" and {len(c.positions) - 12} more" if len(c.positions) > 12 else ""
            print(f"  (row:position) changed in {c.layer}: {shown}{more}")
    return 0 if report.causal else 1
