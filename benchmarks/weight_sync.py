"""Weight sync from a trainer to a rollout engine for a 1B-shaped model on one GPU.

Both sides hold a bf16 copy of ``configs/1b.toml``'s TransformerLM (1.04 B parameters, 2.08 GB).
Measured in the same run, medians of CUDA-event (in-process) or wall-clock (cross-process) times:

- ``memcpy ceiling``: one flat device-to-device copy of the same bytes;
- ``per-tensor copy``: ``dst.copy_(src)`` for each of the model's tensors (one call each);
- ``bucketed copy``: pack into ~256 MiB flat buckets (one ``cat`` each), copy each bucket once,
  copy slices into the destination (what a message-based transfer costs on the sender and the
  receiver; in-process it is two extra passes over memory);
- ``IPC bucketed`` / ``IPC per-tensor``: the engine in a second process on the same GPU
  (torch.multiprocessing CUDA IPC, handles exchanged once): per sync the trainer packs its
  weights into shared buckets (or the engine reads the trainer's shared parameters directly,
  one copy per tensor) and the engine copies them into its own model; timed round trip.

Correctness first: after each method the engine's weights equal the trainer's bit for bit.
Run: ``python benchmarks/weight_sync.py`` (GPU); ``--small`` for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lmforge.model import ModelConfig, TransformerLM, load_preset
from lmforge.posttrain.weight_sync import (
    bucket_layout,
    copy_into,
    pack_buckets,
    unpack_buckets,
)


def _config(small: bool) -> ModelConfig:
    if small:
        return ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, context_length=64,
                           attention="sdpa")  # fmt: skip
    return load_preset("1b")


def _timed(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _engine(cfg, device, cmd, reply, shared_buckets, shared_params, layout) -> None:
    torch.manual_seed(123)
    model = TransformerLM(cfg, device=device, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    reply.put("ready")
    while True:
        msg = cmd.get()
        if msg == "stop":
            break
        if msg == "bucketed":
            copy_into(params, unpack_buckets(layout, shared_buckets))
        elif msg == "per_tensor":
            copy_into(params, shared_params.items())
        elif msg == "check":
            reply.put({n: p.float().sum().item() for n, p in params.items()})
            continue
        if device.type == "cuda":
            torch.cuda.synchronize()
        reply.put("done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model (CPU smoke run)")
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    cfg = _config(args.small)
    torch.manual_seed(0)
    trainer = TransformerLM(cfg, device=device, dtype=torch.bfloat16)
    torch.manual_seed(1)
    engine = TransformerLM(cfg, device=device, dtype=torch.bfloat16)
    src = dict(trainer.named_parameters())
    dst = dict(engine.named_parameters())
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    layout = bucket_layout(src.items(), args.bucket_mib << 20)
    buckets = layout.empty_buckets(device)
    recv = layout.empty_buckets(device)
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}; {len(src)} tensors, {nbytes / 1e9:.3f} GB bf16, "
          f"{layout.num_buckets} buckets of ≤{args.bucket_mib} MiB", flush=True)  # fmt: skip

    def same() -> bool:
        return all(torch.equal(src[n], dst[n]) for n in src)

    flat_a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    flat_b = torch.empty_like(flat_a)

    def memcpy() -> None:
        flat_b.copy_(flat_a)

    def per_tensor() -> None:
        copy_into(dst, src.items())

    def bucketed() -> None:
        pack_buckets(layout, src, buckets)
        for a, b in zip(buckets, recv):
            b.copy_(a)
        copy_into(dst, unpack_buckets(layout, recv))

    rows = []
    for name, fn in (("memcpy ceiling", memcpy), ("per-tensor copy", per_tensor),
                     ("bucketed copy", bucketed)):  # fmt: skip
        with torch.no_grad():
            if name != "memcpy ceiling":
                torch.manual_seed(2)
                for p in dst.values():
                    p.normal_()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                assert same(), f"{name}: engine weights differ from the trainer's"
            t = _timed(fn, device, args.reps)
        rows.append((name, t))
        print(f"  {name}: {t * 1e3:.1f} ms", flush=True)

    # Cross-process on the same device: CUDA IPC handles are exchanged once at start.
    ctx = mp.get_context("spawn")
    cmd, reply = ctx.Queue(), ctx.Queue()
    shared_params = {n: p.detach() for n, p in src.items()}
    proc = ctx.Process(
        target=_engine, args=(cfg, device, cmd, reply, buckets, shared_params, layout)
    )
    proc.start()
    assert reply.get(timeout=300) == "ready"
    ref = {n: p.float().sum().item() for n, p in src.items()}
    for mode in ("bucketed", "per_tensor"):

        def once(mode: str = mode) -> None:
            if mode == "bucketed":
                with torch.no_grad():
                    pack_buckets(layout, src, buckets)
            if device.type == "cuda":
                torch.cuda.synchronize()
            cmd.put(mode)
            assert reply.get(timeout=120) == "done"

        once()
        cmd.put("check")
        got = reply.get(timeout=120)
        assert all(got[n] == ref[n] for n in ref), f"IPC {mode}: engine weights differ"
        times = []
        for i in range(args.reps + 2):
            t0 = time.perf_counter()
            once()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        rows.append((f"IPC {mode.replace('_', '-')}", t))
        print(f"  IPC {mode}: {t * 1e3:.1f} ms", flush=True)
    cmd.put("stop")
    proc.join(timeout=60)

    base = dict(rows)["per-tensor copy"]
    print()
    print("| method | time (ms) | GB/s | vs per-tensor copy |")
    print("|---|---:|---:|---:|")
    for name, t in rows:
        print(f"| {name} | {t * 1e3:.1f} | {nbytes / t / 1e9:.0f} | {base / t:.2f}× |")


if __name__ == "__main__":
    main()
