"""Expert parallelism: each rank holds N/W of every MoE layer's experts; tokens travel to them.

Applied from outside the single-device model (:func:`apply_expert_parallel`): each MoE layer's
stacked expert weights are cut to the rank's contiguous share (rank r keeps experts
``[r·N/W, (r+1)·N/W)``) and its ``expert_compute`` hook is replaced by the dispatch below. The
router, attention and everything else stay replicated, so EP is data parallelism for those:
every rank routes its own tokens, and

1. sorts its assignments by expert (so by destination rank) and exchanges counts
   (``all_to_all_single`` of the per-expert counts), then the token rows (uneven splits);
2. runs its local experts over the rows it received (re-sorted by local expert; the grouped
   GEMMs of :func:`lmforge.model.moe.expert_rows`);
3. sends the outputs back by the inverse all-to-all and combines them with the gate weights.

The all-to-all is differentiable (its backward is the all-to-all with the splits swapped), so an
expert's gradient sums the contributions of every rank's tokens. :func:`sync_gradients` then
averages the replicated parameters' gradients over the ranks and divides the experts' by W:
each rank's loss is the mean over its own batch, so this is the gradient of the mean over the
global batch, as one process training on all ranks' batches computes it (the gloo tests).

Composed with data parallelism: :func:`expert_parallel_groups` splits the world of W ranks into
W/E expert-parallel groups of E consecutive ranks (each holds all experts once) and E
expert-data-parallel groups (the ranks holding the same shard); :func:`sync_gradients` then
averages expert gradients over their expert-data-parallel group. E = W (the default, the whole
world as one EP group) is DeepSpeed-MoE's default layout.

In the trainer (``--parallel.ep=E`` under torchrun; the strategy is
``lmforge.parallel.strategies.ExpertParallelStrategy``) expert parallelism borrows its ranks
from data parallelism, as DeepSpeed-MoE and torchtitan do. Every rank draws its own batch (the
data-parallel degree stays the world size W), the experts are replicated W/E times (the
expert-data-parallel degree), so W = (W/E) · E. Checkpoints hold the
*gathered* single-device weights (any layout, or one process, can load them for inference,
export or the probe) and one optimizer state per rank (resuming needs the same world size and
``parallel.ep``, which the config check enforces). Refused with one line: a dense model, E not
dividing n_experts or W, and E > 1 with tensor or pipeline parallelism, FSDP, ZeRO-1 or the
hierarchical all-reduce.

Simplifications: counts are read on the host each layer (one sync per all-to-all pair); the Switch
auxiliary loss is computed from each rank's own tokens (the auxiliary-loss-free bias sums the
loads over the group, so it matches one process exactly); gradients are reduced after backward
in two coalesced all-reduces (replicated, expert), not overlapped with it. Checkpoints of a
sharded model need :func:`gather_expert_state`. Exercised by ``pytest -m dist
tests/test_moe_ep.py`` and ``pytest -m "dist or dist_slow" tests/test_moe_ep_trainer.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.model.moe import MoEFFN, Routing, combine, expert_counts, expert_rows, moe_layers
from lmforge.parallel.config import ParallelConfig
from lmforge.utils.errors import LmforgeError


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward swaps the splits."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        gx = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(gx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def _group_size(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _dispatch_compute(group: Any) -> Any:
    def compute(layer: MoEFFN, x: torch.Tensor, r: Routing) -> torch.Tensor:
        _, world = _group_size(group)
        n_local = layer.w1.shape[0]
        n = n_local * world
        dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type) and dtype == torch.float32:
            dtype = torch.get_autocast_dtype(x.device.type)
        order = torch.argsort(r.expert_idx, stable=True)  # (A,) by expert = by destination
        counts = expert_counts(r.expert_idx, n)  # (N,) rows I send per expert
        recv_counts = torch.empty_like(counts)  # (W·n_local,): from each source, per local e
        dist.all_to_all_single(recv_counts, counts, group=group)
        send = counts.view(world, n_local).sum(1).tolist()  # rows to each rank
        recv_matrix = recv_counts.view(world, n_local)  # (W, n_local)
        recv = recv_matrix.sum(1).tolist()  # rows from each rank
        xs = x.to(dtype)[r.token_idx[order]]  # (A, D) sorted by destination rank
        rows = _AllToAll.apply(xs, recv, send, group)  # (R, D): by source, then local expert
        local_e = torch.arange(n_local, device=x.device).repeat(world)  # (W·n_local,)
        ids = torch.repeat_interleave(local_e, recv_matrix.reshape(-1))  # (R,)
        by_e = torch.argsort(ids, stable=True)  # (R,)
        ys = expert_rows(rows[by_e], layer.w1, layer.w2, layer.w3, recv_matrix.sum(0))  # (R, D)
        back = torch.empty_like(ys)
        back[by_e] = ys  # (R, D) in received order
        y_sorted = _AllToAll.apply(back, send, recv, group)  # (A, D) in my sorted order
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted  # (A, D) assignment order
        return combine(y, r, x.shape[0])

    return compute


def expert_parallel_groups(ep_size: int) -> tuple[Any, Any]:
    """(this rank's EP group, its expert-data-parallel group) for EP degree ``ep_size``.

    EP groups are blocks of ``ep_size`` consecutive ranks; the expert-data-parallel group of
    rank r holds the ranks with the same ``r % ep_size`` (the same expert shard). Collective:
    every rank must call it."""
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise LmforgeError(f"expert-parallel size {ep_size} must divide the world size {world}")
    rank = dist.get_rank()
    ep_group = edp_group = None
    for start in range(0, world, ep_size):  # new_group is collective: every rank makes all
        g = dist.new_group(list(range(start, start + ep_size)))
        if start <= rank < start + ep_size:
            ep_group = g
    for shard in range(ep_size):
        g = dist.new_group(list(range(shard, world, ep_size)))
        if rank % ep_size == shard:
            edp_group = g
    return ep_group, edp_group


def apply_expert_parallel(model: nn.Module, group: Any = None) -> nn.Module:
    """Shard every MoE layer's experts over ``group`` (default: the world), in place.

    Needs ``torch.distributed`` initialised and n_experts divisible by the group size; every
    rank must hold the same (replicated) model before the call.
    """
    if not dist.is_initialized():
        raise LmforgeError("expert parallelism needs torch.distributed initialised (torchrun)")
    rank, world = _group_size(group)
    compute = _dispatch_compute(group)
    for layer in moe_layers(model):
        n = layer.w1.shape[0]
        if n % world:
            raise LmforgeError(
                f"model.moe.n_experts ({n}) must be divisible by the expert-parallel size {world}"
            )
        lo, hi = rank * n // world, (rank + 1) * n // world
        for name in ("w1", "w2", "w3"):
            full = getattr(layer, name)
            setattr(layer, name, nn.Parameter(full.detach()[lo:hi].clone()))
        layer.expert_compute = compute
        layer.ep_experts = (lo, hi)  # type: ignore[assignment]
    return model


def is_expert_parameter(name: str) -> bool:
    """Whether a parameter name is a sharded expert weight (``...ffn.w1`` / ``w2`` / ``w3``)."""
    return name.rsplit(".", 1)[-1] in ("w1", "w2", "w3") and ".ffn." in f".{name}"


def sync_gradients(model: nn.Module, expert_dp_group: Any = None) -> None:
    """After backward: average the replicated parameters' gradients over the world; sum each
    expert shard's (already summed over its EP group's tokens) over ``expert_dp_group`` (the
    ranks holding that shard; None = the shard is on this rank only, EP over the whole world),
    then divide by the world size: the gradient of the mean over the global batch.

    Each kind goes through one flat fp32 (float64 for a float64 model) buffer, so a step costs
    two all-reduces, not one per parameter. A parameter without a gradient contributes zeros
    and keeps None when every rank's is zero (as one process would leave it)."""
    world = dist.get_world_size()
    replicated, experts = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (experts if is_expert_parameter(name) else replicated).append(p)
    edp = expert_dp_group
    edp_size = 1 if edp is None else dist.get_world_size(edp)
    _reduce_flat(replicated, None, world, reduce=world > 1)
    _reduce_flat(experts, edp, world, reduce=edp_size > 1)


@torch.no_grad()
def _reduce_flat(params: list[nn.Parameter], group: Any, world: int, reduce: bool) -> None:
    if not params:
        return
    grads = [p.grad for p in params]
    wide = any(g is not None and g.dtype == torch.float64 for g in grads)
    dt = torch.float64 if wide else torch.float32
    dev = next((g.device for g in grads if g is not None), params[0].device)
    flat = torch.cat(
        [
            (
                g.reshape(-1).to(dt)
                if g is not None
                else torch.zeros(p.numel(), dtype=dt, device=dev)
            )
            for p, g in zip(params, grads)
        ]
    )
    if reduce:
        dist.all_reduce(flat, group=group)
    flat.div_(world)
    off = 0
    for p, g in zip(params, grads):
        part = flat[off : off + p.numel()].view_as(p)
        off += p.numel()
        if g is not None:
            g.copy_(part)
        elif bool(part.ne(0).any()):  # rare: a parameter unused here but used elsewhere
            p.grad = part.to(p.dtype).clone()


def gather_expert_state(model: nn.Module, group: Any = None) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on every rank: expert shards all-gathered in rank order."""
    _, world = _group_size(group)
    state = {}
    for name, t in model.state_dict().items():
        if is_expert_parameter(name):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts)
        state[name] = t
    return state


def load_expert_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full single-device state into a sharded model: each MoE layer keeps its experts
    ``ep_experts`` = [lo, hi) of every stacked expert weight."""
    local = dict(state)
    for prefix, m in model.named_modules():
        lo_hi = getattr(m, "ep_experts", None)
        if isinstance(m, MoEFFN) and lo_hi is not None:
            for w in ("w1", "w2", "w3"):
                key = f"{prefix}.{w}" if prefix else w
                if key in local:
                    local[key] = local[key][lo_hi[0] : lo_hi[1]]
    model.load_state_dict(local)


def check_expert_layout(pcfg: ParallelConfig, world_size: int) -> None:
    """Refuse, with one line, a ``parallel.ep`` that cannot work for this layout (pure and
    collective-free: every rank stops at start with the same message)."""
    ep = pcfg.ep
    if ep < 1:
        raise LmforgeError(f"parallel.ep must be >= 1, got {ep}")
    if ep == 1:
        return
    for bad, what in (
        (pcfg.tp > 1, f"parallel.tp={pcfg.tp}"),
        (pcfg.pp > 1, f"parallel.pp={pcfg.pp}"),
        (pcfg.fsdp, "parallel.fsdp=true"),
        (pcfg.zero1, "parallel.zero1=true"),
        (pcfg.domain_size > 0, f"parallel.domain_size={pcfg.domain_size}"),
    ):
        if bad:
            raise LmforgeError(
                f"parallel.ep={ep} cannot be combined with {what}: expert parallelism composes "
                "with plain data parallelism only"
            )
    dp = pcfg.dp or world_size
    if dp != world_size:
        raise LmforgeError(
            f"parallel.dp={pcfg.dp} with parallel.ep={ep}: expert parallelism borrows its ranks "
            f"from data parallelism, so dp is the world size ({world_size}); leave parallel.dp=0"
        )
    if world_size % ep:
        raise LmforgeError(
            f"parallel.ep={ep} must divide the world size {world_size} "
            f"(torchrun --nproc_per_node a multiple of {ep})"
        )


def check_expert_model(ep: int, model: nn.Module) -> None:
    """Refuse ``parallel.ep`` > 1 on a dense model or with n_experts not divisible by ep."""
    if ep <= 1:
        return
    layers = list(moe_layers(model))
    if not layers:
        raise LmforgeError(
            f"parallel.ep={ep} needs a mixture-of-experts model (model.moe.n_experts > 0); "
            "this model is dense"
        )
    n = layers[0].n_experts
    if n % ep:
        raise LmforgeError(f"parallel.ep={ep} must divide model.moe.n_experts={n}")


def sum_of_squares(grads: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """Σ g² over ``grads`` in fp32 (float64 for float64 gradients; zero when empty)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=dev)
    wide = any(g.dtype == torch.float64 for g in grads)
    acc = torch.float64 if wide else torch.float32
    return torch.stack([g.to(acc).pow(2).sum() for g in grads]).sum()
