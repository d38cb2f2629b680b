"""Data parallelism with bucketed, overlapped gradient all-reduce (lmforge's own DDP).

Every rank holds the whole model and a different slice of the batch. Wrapping broadcasts rank
0's parameters and buffers so all replicas start equal. During backward a post-accumulate hook
on each parameter copies its gradient into an fp32 bucket; when a bucket is complete its
all-reduce is launched asynchronously, so communication overlaps the rest of backward.
``finish_gradient_synchronization()`` waits for the buckets, divides by the world size and
writes the averaged gradients back. Per step each rank sends and receives about 2× the
parameter bytes (ring all-reduce = reduce-scatter + all-gather).

Simplifications: buckets are formed once, in reverse registration order (the order backward
usually produces gradients) and are launched strictly in that order on every rank, so collective
order is identical across ranks even if hooks fire in a different order; parameters that got no
gradient on this step contribute zeros.

Exercise: ``pytest tests/test_parallel_dist.py -k ddp``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.parallel.hierarchical import HierarchicalGroups, hierarchical_all_reduce


class _Bucket:
    """A group of parameters whose gradients are reduced together through one fp32 buffer."""

    def __init__(self, params: list[nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        # Reductions always accumulate in fp32, even when gradients are bf16/fp16.
        self.buffer = torch.zeros(n, dtype=torch.float32, device=device)
        self.ready: set[int] = set()
        self.work: dist.Work | None = None
        self.filled: list[bool] = [False] * len(params)

    def reset(self) -> None:
        self.ready.clear()
        self.work = None
        self.filled = [False] * len(self.params)


class DDP(nn.Module):
    """Wrap ``module`` for data-parallel training over ``process_group`` (default: the world).

    ``bucket_size_mb`` sets how many megabytes of fp32 gradients are reduced per collective:
    smaller buckets start communicating earlier, larger ones pay less per-call latency.
    Tied parameters (one tensor under two names) are reduced once; frozen ones not at all.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float = 25.0,
        process_group: dist.ProcessGroup | None = None,
        hierarchy: HierarchicalGroups | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        # With a hierarchy (world group only) buckets are reduced in three phases in
        # finish_gradient_synchronization instead of by one asynchronous flat all-reduce.
        self.hierarchy = hierarchy
        self.world_size = dist.get_world_size(process_group)
        self._sync = True
        self._broadcast_from_first_rank()
        params = [p for p in module.parameters() if p.requires_grad]  # deduplicates tied
        limit = max(1, int(bucket_size_mb * 2**20 / 4))
        self._buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        device = params[0].device if params else torch.device("cpu")
        for p in reversed(params):
            current.append(p)
            size += p.numel()
            if size >= limit:
                self._buckets.append(_Bucket(current, device))
                current, size = [], 0
        if current:
            self._buckets.append(_Bucket(current, device))
        self._where: dict[int, tuple[int, int]] = {}
        self._hooks = []
        for b_i, bucket in enumerate(self._buckets):
            for p_i, p in enumerate(bucket.params):
                self._where[id(p)] = (b_i, p_i)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        self._next_to_launch = 0

    def _broadcast_from_first_rank(self) -> None:
        src = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t.data, src=src, group=self.process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module unchanged."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside this context only accumulates local gradients (no communication)."""
        prev = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = prev

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync or self.world_size == 1:
            return
        b_i, p_i = self._where[id(p)]
        bucket = self._buckets[b_i]
        off = bucket.offsets[p_i]
        with torch.no_grad():
            bucket.buffer[off : off + p.numel()].copy_(p.grad.reshape(-1))
        bucket.filled[p_i] = True
        bucket.ready.add(p_i)
        if len(bucket.ready) == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch in bucket order only: every rank must issue the same collectives in the same order.
        while self._next_to_launch < len(self._buckets):
            bucket = self._buckets[self._next_to_launch]
            if len(bucket.ready) < len(bucket.params) or self.hierarchy is not None:
                return
            bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
            self._next_to_launch += 1

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the averaged gradients back."""
        if self.world_size == 1:
            return
        for bucket in self._buckets:
            if bucket.work is None:
                # Parameters unused this step: contribute zeros so every rank still joins.
                for p_i, p in enumerate(bucket.params):
                    if p_i not in bucket.ready:
                        off = bucket.offsets[p_i]
                        if p.grad is None:
                            bucket.buffer[off : off + p.numel()].zero_()
                        else:
                            bucket.buffer[off : off + p.numel()].copy_(p.grad.reshape(-1))
                            bucket.filled[p_i] = True
                        bucket.ready.add(p_i)
        self._launch_ready()
        with torch.no_grad():
            for bucket in self._buckets:
                if self.hierarchy is not None:
                    hierarchical_all_reduce(bucket.buffer, self.hierarchy)
                else:
                    assert bucket.work is not None
                    bucket.work.wait()
                bucket.buffer.div_(self.world_size)
                for p_i, p in enumerate(bucket.params):
                    off = bucket.offsets[p_i]
                    avg = bucket.buffer[off : off + p.numel()].view_as(p)
                    if p.grad is None:
                        # No rank produced a gradient: leave it None, as one process would.
                        if bool(avg.ne(0).any()):
                            p.grad = avg.to(p.dtype).clone()
                    else:
                        p.grad.copy_(avg)
                bucket.reset()
        self._next_to_launch = 0
