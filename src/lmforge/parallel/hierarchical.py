"""Hierarchical all-reduce: reduce-scatter inside a fast domain, all-reduce across, all-gather.

With ``n`` ranks in domains of ``k`` consecutive ranks (one NVLink island, one host):

1. reduce-scatter inside the domain: each rank gets the domain's sum of 1/k of the tensor;
2. all-reduce that 1/k slice across domains (ranks with the same position in every domain);
3. all-gather inside the domain.

The slow inter-domain links carry only 1/k of the tensor per rank (2·(P/k)·(D−1)/D bytes for D
domains) instead of the 2·P·(n−1)/n a flat ring sends, which is why bigger domains help.
Sums are in fp32 whatever the tensor's dtype.

Exercise: ``pytest tests/test_parallel_tp_pp.py -k hierarchical``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lmforge.parallel._dist import all_gather_single, reduce_scatter_single
from lmforge.utils.errors import LmforgeError


class HierarchicalGroups:
    """The intra-domain and inter-domain sub-groups of the world (collective: every rank calls)."""

    def __init__(self, domain_size: int) -> None:
        world = dist.get_world_size()
        rank = dist.get_rank()
        if domain_size < 1 or world % domain_size:
            raise LmforgeError(
                f"parallel.domain_size={domain_size} must divide the world size {world}"
            )
        self.domain_size = domain_size
        self.n_domains = world // domain_size
        self.intra: dist.ProcessGroup | None = None
        self.inter: dist.ProcessGroup | None = None
        for d in range(self.n_domains):
            g = dist.new_group(list(range(d * domain_size, (d + 1) * domain_size)))
            if rank // domain_size == d:
                self.intra = g
        for j in range(domain_size):
            g = dist.new_group(list(range(j, world, domain_size)))
            if rank % domain_size == j:
                self.inter = g


def hierarchical_all_reduce(
    tensor: torch.Tensor, groups: HierarchicalGroups, average: bool = False
) -> None:
    """Sum (or average) ``tensor`` over the world in place, in three hierarchical phases."""
    k = groups.domain_size
    n = k * groups.n_domains
    flat = tensor.reshape(-1).float()  # fp32 sums (a copy for other dtypes)
    padded = -(-flat.numel() // k) * k
    buf = torch.zeros(padded, dtype=torch.float32, device=tensor.device)
    buf[: flat.numel()] = flat
    piece = torch.empty(padded // k, dtype=torch.float32, device=tensor.device)
    reduce_scatter_single(piece, buf, group=groups.intra)
    if groups.n_domains > 1:
        dist.all_reduce(piece, group=groups.inter)
    all_gather_single(buf, piece, group=groups.intra)
    out = buf[: flat.numel()]
    if average:
        out = out / n
    tensor.copy_(out.view_as(tensor))


def _ring_sum(chunks: list[torch.Tensor], accumulate: torch.dtype) -> torch.Tensor:
    """Reference for a ring reduction: each hop adds the next rank's value in ``accumulate``.

    With ``accumulate=float16`` this shows the bias of low-precision reductions (adding 1.0
    repeatedly stalls at 2048); lmforge's reductions use float32.
    """
    total = chunks[0].to(accumulate)
    for c in chunks[1:]:
        total = total + c.to(accumulate)
    return total
