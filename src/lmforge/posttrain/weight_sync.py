"""Bucketed weight transfer from a trainer to a rollout engine.

One message per tensor costs one launch, collective or IPC round trip per tensor (hundreds for
a 1B model). Here the named tensors are laid out once into a few flat buckets of about
``bucket_bytes`` (one dtype each); a sync packs them (one ``torch.cat`` per bucket), moves each
bucket as one message (a device copy, a ``dist.broadcast``, or a copy from a CUDA-IPC-shared
buffer), and the receiver copies slices of it into its parameters.
Exercised by ``pytest tests/test_posttrain_pipeline.py -k bucket`` and
``python benchmarks/weight_sync.py`` (one GPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch


@dataclasses.dataclass
class BucketLayout:
    """Where each named tensor sits in which flat bucket: ``entries[b]`` lists
    ``(name, offset, numel, shape)`` of bucket ``b``; ``dtypes[b]`` and ``sizes[b]`` (elements)."""

    entries: list[list[tuple[str, int, int, torch.Size]]]
    dtypes: list[torch.dtype]
    sizes: list[int]

    @property
    def num_buckets(self) -> int:
        return len(self.sizes)

    def empty_buckets(self, device: torch.device | str) -> list[torch.Tensor]:
        """Flat buffers for the buckets on ``device``."""
        return [torch.empty(n, dtype=dt, device=device) for n, dt in zip(self.sizes, self.dtypes)]


def bucket_layout(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 256 << 20
) -> BucketLayout:
    """Greedy layout in the given order: a new bucket starts when the dtype changes or the next
    tensor would overflow ``bucket_bytes`` (a tensor larger than a bucket gets its own)."""
    entries: list[list[tuple[str, int, int, torch.Size]]] = []
    dtypes: list[torch.dtype] = []
    sizes: list[int] = []
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if (not sizes or dtypes[-1] != t.dtype
                or (sizes[-1] * t.element_size() + nbytes > bucket_bytes and sizes[-1] > 0)):  # fmt: skip
            entries.append([])
            dtypes.append(t.dtype)
            sizes.append(0)
        entries[-1].append((name, sizes[-1], t.numel(), t.shape))
        sizes[-1] += t.numel()
    return BucketLayout(entries, dtypes, sizes)


def pack_buckets(
    layout: BucketLayout, tensors: dict[str, torch.Tensor], out: Sequence[torch.Tensor]
) -> None:
    """Copy the named tensors into the flat bucket buffers ``out`` (one ``cat`` per bucket; a
    bucket on another device than the tensors, e.g. CPU staging for gloo, gets one copy more)."""
    for b, entries in enumerate(layout.entries):
        parts = [tensors[name].reshape(-1) for name, _, _, _ in entries]
        if parts[0].device == out[b].device:
            torch.cat(parts, out=out[b])
        else:
            out[b].copy_(torch.cat(parts))


def unpack_buckets(
    layout: BucketLayout, buckets: Sequence[torch.Tensor]
) -> Iterable[tuple[str, torch.Tensor]]:
    """``(name, view)`` pairs of every tensor inside the buckets (views, no copy)."""
    for b, entries in enumerate(layout.entries):
        for name, off, n, shape in entries:
            yield name, buckets[b][off : off + n].view(shape)


@torch.no_grad()
def copy_into(params: dict[str, torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """``params[name].copy_(value)`` for every pair (the receiver's side)."""
    for name, value in named:
        params[name].copy_(value)


@torch.no_grad()
def broadcast_model(
    model: torch.nn.Module,
    layout: BucketLayout,
    buckets: Sequence[torch.Tensor],
    src: int,
    group: object | None = None,
) -> None:
    """Broadcast ``model``'s parameters from rank ``src`` to every rank's ``model`` in buckets
    (``layout``: ``bucket_layout(model.named_parameters())`` on every rank). The buckets may live
    on another device than the model (CPU buffers for gloo when both processes share one GPU)."""
    import torch.distributed as dist

    params = dict(model.named_parameters())  # tied weights once (the layout's names)
    rank = dist.get_rank()
    if rank == src:
        pack_buckets(layout, params, buckets)
    for buf in buckets:
        dist.broadcast(buf, src=src, group=group)
    if rank != src:
        copy_into(params, unpack_buckets(layout, buckets))
