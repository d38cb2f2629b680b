"""Test helpers: run a function on N gloo processes on 127.0.0.1 and a tiny model config.

Used by ``tests/test_parallel*.py``; kept in the package so spawned workers can import it.
Every worker joins the default group with a timeout and always destroys it; the parent joins
with a timeout and kills stragglers, so a broken collective fails a test instead of hanging CI.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any], rank: int, world: int, port: int, out: Any, args: tuple, timeout: float
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world, *args)
        out.put((rank, "ok", result))
    except BaseException as e:  # report every failure to the parent, whatever it is
        out.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo processes; return the results.

    Raises RuntimeError with the first worker's traceback if any fails or times out.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, out, args, timeout), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            try:
                rank, status, value = out.get(timeout=timeout + 30)
            except queue.Empty:
                errors.append(f"timed out after {timeout + 30:.0f} s")
                break
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise RuntimeError(errors[0])
    return [results[r] for r in range(world)]


def tiny_model_config(**overrides: Any) -> Any:
    """A tiny ModelConfig for CPU tests (vocab 64, D 32, 4 layers, 4 heads, 2 kv-heads)."""
    from lmforge.model import ModelConfig

    kw: dict[str, Any] = dict(
        vocab_size=64,
        context_length=16,
        d_model=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        attention="sdpa",
    )
    kw.update(overrides)
    return ModelConfig(**kw)
