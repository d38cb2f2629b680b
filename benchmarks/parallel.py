"""lmforge's DDP, ZeRO-1 and FSDP against torch DDP and FSDP2 on GPT-2-small, plus planner error.

Run on two GPUs and once on one (the lead's combined session)::

    torchrun --nproc_per_node 2 benchmarks/parallel.py --results benchmarks/RESULTS.md
    torchrun --nproc_per_node 1 benchmarks/parallel.py --results benchmarks/RESULTS.md

(with ``PYTHONPATH=src`` set, or lmforge installed). GPT-2-small shape: 12 layers, d 768, 12
heads, vocab 50304, sequence 1024, bf16 compute (autocast for the DDP variants, bf16 gathered
weights for FSDP), fp32 master weights, AdamW. Per variant: fresh model from the same seed,
warm-up steps, then timed steps with CUDA events; the median step time, tokens/s over all GPUs
and peak allocated memory per GPU are reported.

* correctness first: from identical weights, one optimizer step on the same batch, then the loss
  on a second batch; lmforge's variant must agree with its torch peer (bf16 tolerance);
* ``single``: the plain model on each GPU with no communication (the 1-GPU step time), so the
  scaling efficiency 1 → N GPUs is ``t_single / t_variant`` at the same per-GPU batch;
* ZeRO-1: optimizer-state bytes per GPU and step time next to DDP;
* planner: :func:`lmforge.parallel.planner.predict_step_time` with the H200 defaults next to the
  measured step (error %), the input for calibrating the planner later.

``--tiny`` runs a small model on CPU with gloo (a smoke test; numbers meaningless), e.g.
``PYTHONPATH=src torchrun --nproc_per_node 2 benchmarks/parallel.py --tiny --steps 2``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("single", "torch-ddp", "lmforge-ddp", "lmforge-zero1", "torch-fsdp2", "lmforge-fsdp")
PEERS = {"lmforge-ddp": "torch-ddp", "lmforge-fsdp": "torch-fsdp2", "lmforge-zero1": "torch-ddp"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=16, help="sequences per GPU per step")
    p.add_argument("--seq", type=int, default=1024, help="sequence length")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--tiny", action="store_true", help="small model on CPU/gloo (smoke test)")
    p.add_argument("--results", help="append the table to this markdown file (rank 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lmforge.model import ModelConfig, TransformerLM, accounting
    from lmforge.parallel import DDP, FSDP, ShardedOptimizer
    from lmforge.parallel.planner import predict_step_time

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    backend = "nccl" if cuda else "gloo"
    kw: dict[str, Any] = {"device_id": device} if cuda else {}
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5), **kw
    )
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    if args.tiny:
        cfg = ModelConfig(
            vocab_size=512, context_length=64, d_model=64, n_layers=2, n_heads=4, attention="sdpa"
        )
        args.seq = min(args.seq, 64)
        args.batch = min(args.batch, 4)
    else:
        cfg = ModelConfig(
            vocab_size=50304,
            context_length=args.seq,
            d_model=768,
            n_layers=12,
            n_heads=12,
            attention="sdpa",
        )
    amp = torch.bfloat16
    tokens_per_gpu = args.batch * args.seq
    n_params = accounting.parameter_count(cfg)
    fpt = accounting.flops_per_token(cfg, args.seq)

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        x = x.to(device)
        return x[:, :-1], x[:, 1:]

    def new_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return TransformerLM(cfg, device=device)

    def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
        ctx = torch.autocast(device.type, dtype=amp) if autocast else contextlib.nullcontext()
        with ctx:
            logits = model(x)  # (B, T, V)
        return F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), y.reshape(-1))

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, foreach=True)

    def build(name: str) -> tuple[Any, torch.optim.Optimizer, Callable[[], None], bool]:
        """(module to call, optimizer, finish-sync hook, use autocast)."""
        model = new_model()
        noop: Callable[[], None] = lambda: None
        if name == "single":
            return model, adamw(model.parameters()), noop, True
        if name == "torch-ddp":
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(model, device_ids=[local] if cuda else None)
            return ddp, adamw(ddp.parameters()), noop, True
        if name in ("lmforge-ddp", "lmforge-zero1"):
            ddp = DDP(model, bucket_size_mb=25.0)
            if name == "lmforge-zero1":
                opt = ShardedOptimizer(
                    list(model.parameters()),
                    torch.optim.AdamW,
                    lr=3e-4,
                    weight_decay=0.1,
                    foreach=True,
                )
            else:
                opt = adamw(model.parameters())
            return ddp, opt, ddp.finish_gradient_synchronization, True
        if name == "torch-fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32)
            for block in model.layers:
                fully_shard(block, mp_policy=mp)
            fully_shard(model.token_embeddings, mp_policy=mp)
            fully_shard(model.lm_head, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            return model, adamw(model.parameters()), noop, False
        if name == "lmforge-fsdp":
            fsdp = FSDP(model, compute_dtype=amp)
            return fsdp, adamw(fsdp.parameters()), fsdp.finish_gradient_synchronization, False
        raise ValueError(name)

    def train_step(model: Any, opt: Any, finish: Callable[[], None], ac: bool, step: int) -> float:
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y, ac)
        loss.backward()
        finish()
        opt.step()
        return loss.detach()

    def optimizer_state_bytes(opt: Any) -> int:
        inner = getattr(opt, "_inner", opt)
        total = 0
        for st in inner.state.values():
            for t in st.values():
                if torch.is_tensor(t) and t.dim() > 0:
                    t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 keeps DTensors
                    total += t.numel() * t.element_size()
        return total

    def cleanup() -> None:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
        dist.barrier()

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant '{v}' (choose from {', '.join(VARIANTS)})")

    # -- correctness: one step from identical weights, then the loss on another batch --------
    check: dict[str, float] = {}
    for name in variants:
        if name == "single" and world > 1:
            continue  # each rank would train on its own data: not comparable
        model, opt, finish, ac = build(name)
        train_step(model, opt, finish, ac, step=0)
        with torch.no_grad():
            x, y = batch(1)
            loss = loss_of(model, x, y, ac).detach().float()
        dist.all_reduce(loss)
        check[name] = loss.item() / world
        del model, opt
        cleanup()
    verdicts: dict[str, str] = {}
    for name, peer in PEERS.items():
        if name in check and peer in check:
            diff = abs(check[name] - check[peer])
            verdicts[name] = f"{diff:.1e} {'ok' if diff < 2e-2 else 'MISMATCH'}"
            log(f"check {name} vs {peer}: loss {check[name]:.5f} vs {check[peer]:.5f} ({diff:.2e})")

    # -- timing ----------------------------------------------------------------------------------
    rows: dict[str, dict[str, float]] = {}
    for name in variants:
        log(f"timing {name} …")
        model, opt, finish, ac = build(name)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for s in range(args.warmup):
            train_step(model, opt, finish, ac, step=s)
        times = []
        for s in range(args.steps):
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                train_step(model, opt, finish, ac, step=100 + s)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                train_step(model, opt, finish, ac, step=100 + s)
                times.append(time.perf_counter() - t0)
        # The slowest rank sets the pace: take the max of the per-rank medians.
        med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
        rows[name] = {
            "step_s": med.item(),
            "tok_s": tokens_per_gpu * (1 if name == "single" else world) / med.item(),
            "peak_gb": peak,
            "opt_gb": optimizer_state_bytes(opt) / 1e9,
        }
        del model, opt
        cleanup()

    # -- table -----------------------------------------------------------------------------------
    strategy_of = {
        "single": "single",
        "torch-ddp": "ddp",
        "lmforge-ddp": "ddp",
        "lmforge-zero1": "zero1",
        "torch-fsdp2": "fsdp",
        "lmforge-fsdp": "fsdp",
    }
    lines = [
        "| variant | GPUs | step ms | tokens/s | scaling eff. | peak mem GB/GPU | "
        "opt state GB/GPU | check Δloss vs peer | planner ms | planner err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    t_single = rows.get("single", {}).get("step_s")
    for name in variants:
        r = rows[name]
        g = 1 if name == "single" else world
        gather_bytes = 2.0 if strategy_of[name] == "fsdp" else 4.0
        pred = predict_step_time(
            n_params,
            tokens_per_gpu * g,
            g,
            strategy_of[name],
            gather_bytes=gather_bytes,
            reduce_bytes=4.0,
            flops_per_token=fpt,
            n_units=cfg.n_layers + 2,
        )
        eff = f"{t_single / r['step_s']:.1%}" if t_single and name != "single" else "—"
        err = (pred - r["step_s"]) / r["step_s"]
        lines.append(
            f"| {name} | {g} | {r['step_s'] * 1e3:.1f} | {r['tok_s']:,.0f} | {eff} | "
            f"{r['peak_gb']:.2f} | {r['opt_gb']:.3f} | {verdicts.get(name, '—')} | "
            f"{pred * 1e3:.1f} | {err:+.0%} |"
        )
    table = "\n".join(lines)
    if rank == 0:
        dev = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
        try:
            import triton

            tv = triton.__version__
        except ImportError:
            tv = "n/a"
        head = (
            f"GPT-2-small {'(tiny) ' if args.tiny else ''}shape, batch {args.batch}×{args.seq} "
            f"per GPU, {world} GPU(s), bf16; planner: H200 defaults (989 TFLOP/s, MFU 0.45, "
            f"NVLink 450 GB/s)"
        )
        print(head)
        print(table)
        if args.results:
            cmd = (
                f"torchrun --nproc_per_node {world} benchmarks/parallel.py {' '.join(sys.argv[1:])}"
            )
            entry = (
                f"\n## parallel ({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
                f"{world}× {dev}, torch {torch.__version__}, triton {tv})\n\n`{cmd}`\n\n"
                f"{head}\n\n{table}\n"
            )
            with open(args.results, "a", encoding="utf-8") as f:
                f.write(entry)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
