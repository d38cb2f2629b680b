"""Process groups, layout validation and fp32 reductions shared by every strategy.

Rank layout: ``rank = (dp_index · pp + pp_index) · tp + tp_index``. Tensor parallelism is the
innermost dimension (consecutive ranks, so it stays inside one host's NVLink domain), then the
pipeline, then data parallelism outermost, as Megatron-LM and torchtitan order them.
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from lmforge.utils.errors import LmforgeError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Resolved parallel degrees for one job; ``dp · tp · pp == world_size``."""

    dp: int
    "data-parallel degree"
    tp: int
    "tensor-parallel degree"
    pp: int
    "pipeline-parallel degree"

    @property
    def world_size(self) -> int:
        """Processes the layout needs."""
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_index, pp_index, tp_index) of a global rank."""
        tp_i = rank % self.tp
        pp_i = (rank // self.tp) % self.pp
        dp_i = rank // (self.tp * self.pp)
        return dp_i, pp_i, tp_i

    def rank_of(self, dp_i: int, pp_i: int, tp_i: int) -> int:
        """Global rank at the given coordinates."""
        return (dp_i * self.pp + pp_i) * self.tp + tp_i


def resolve_layout(
    world_size: int,
    dp: int = 0,
    tp: int = 1,
    pp: int = 1,
    n_layers: int | None = None,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    d_ff: int | None = None,
    fsdp: bool = False,
) -> Layout:
    """Check the requested degrees against the world size and the model; raise one clear line.

    Pure and collective-free, so every rank reaches the same verdict on its own and a bad launch
    stops at start on every rank instead of hanging in the first collective.
    """
    if tp < 1 or pp < 1 or dp < 0:
        raise LmforgeError(f"parallel degrees must be positive: dp={dp} tp={tp} pp={pp}")
    if dp == 0:
        if world_size % (tp * pp):
            raise LmforgeError(
                f"world size {world_size} is not divisible by tp·pp = {tp}·{pp} = {tp * pp}"
            )
        dp = world_size // (tp * pp)
    if dp * tp * pp != world_size:
        raise LmforgeError(
            f"parallel.dp × parallel.tp × parallel.pp = {dp}×{tp}×{pp} = {dp * tp * pp} "
            f"but the world size is {world_size} (torchrun --nproc_per_node × nodes)"
        )
    if n_layers is not None and pp > 1 and n_layers % pp:
        raise LmforgeError(
            f"parallel.pp={pp} stages do not divide model.n_layers={n_layers} evenly"
        )
    if n_layers is not None and pp > n_layers:
        raise LmforgeError(f"parallel.pp={pp} is larger than model.n_layers={n_layers}")
    if tp > 1:
        for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("d_ff", d_ff)):
            if value is not None and value % tp:
                raise LmforgeError(f"parallel.tp={tp} does not divide model.{name}={value}")
    if fsdp and pp > 1:
        raise LmforgeError("parallel.fsdp=true cannot be combined with parallel.pp>1; use dp×pp")
    return Layout(dp=dp, tp=tp, pp=pp)


def pick_backend(device: str, backend: str = "auto") -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise, unless ``backend`` names one."""
    if backend != "auto":
        return backend
    return "nccl" if device.startswith("cuda") else "gloo"


def init_process_group(
    device: str,
    rank: int,
    world_size: int,
    backend: str = "auto",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Join the job's default process group (no-op when already joined).

    The rendezvous is torchrun's ``env://`` (MASTER_ADDR, MASTER_PORT, set by torchrun on every
    node, also for multi-node ``--rdzv_backend c10d --rdzv_endpoint HOST:PORT`` launches).
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise LmforgeError(
                f"process group has {dist.get_world_size()} ranks, runtime says {world_size}"
            )
        return
    be = pick_backend(device, backend)
    if be == "nccl":
        if not device.startswith("cuda"):
            raise LmforgeError(f"parallel.backend=nccl needs a CUDA device, got '{device}'")
        torch.cuda.set_device(torch.device(device))
    kwargs = {}
    if be == "nccl":
        # Binding the device lets NCCL create the communicator eagerly, with no guessing.
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(be, rank=rank, world_size=world_size, timeout=timeout, **kwargs)


@dataclasses.dataclass
class Mesh:
    """The process groups of a (dp, pp, tp) layout, as seen from one rank."""

    layout: Layout
    "resolved degrees"
    rank: int
    "this process's global rank"
    dp_group: dist.ProcessGroup | None
    "ranks sharing pp and tp indices (gradient reduction, sharding)"
    tp_group: dist.ProcessGroup | None
    "ranks sharing dp and pp indices (tensor-parallel all-reduces)"
    pp_group: dist.ProcessGroup | None
    "ranks sharing dp and tp indices (the pipeline)"
    pp_ranks: tuple[int, ...]
    "global ranks of this rank's pipeline, stage order"

    @property
    def coords(self) -> tuple[int, int, int]:
        """(dp_index, pp_index, tp_index) of this rank."""
        return self.layout.coords(self.rank)


def build_mesh(layout: Layout, rank: int) -> Mesh:
    """Create the dp, tp and pp sub-groups; every rank must call it, in the same order."""
    dp, tp, pp = layout.dp, layout.tp, layout.pp
    my_dp, my_pp, my_tp = layout.coords(rank)
    groups: dict[str, dist.ProcessGroup | None] = {"dp": None, "tp": None, "pp": None}
    pp_ranks: tuple[int, ...] = (rank,)
    # new_group is itself collective: all ranks create every group, keep the ones they belong to.
    for p in range(pp):
        for t in range(tp):
            ranks = [layout.rank_of(d, p, t) for d in range(dp)]
            g = dist.new_group(ranks)
            if (p, t) == (my_pp, my_tp):
                groups["dp"] = g
    for d in range(dp):
        for p in range(pp):
            ranks = [layout.rank_of(d, p, t) for t in range(tp)]
            g = dist.new_group(ranks)
            if (d, p) == (my_dp, my_pp):
                groups["tp"] = g
    for d in range(dp):
        for t in range(tp):
            ranks = [layout.rank_of(d, p, t) for p in range(pp)]
            g = dist.new_group(ranks)
            if (d, t) == (my_dp, my_tp):
                groups["pp"] = g
                pp_ranks = tuple(ranks)
    return Mesh(layout, rank, groups["dp"], groups["tp"], groups["pp"], pp_ranks)


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group`` (the default group when None)."""
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(group)


def all_reduce_mean_fp32(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Average ``tensor`` over ``group`` in place, summing in fp32 whatever its dtype.

    Low-precision sums are biased: fp16 adding 1.0 repeatedly stalls at 2048 because the spacing
    of fp16 there is 2. Every gradient reduction in lmforge goes through an fp32 buffer instead.
    """
    n = group_size(group)
    if n == 1:
        return
    buf = tensor if tensor.dtype == torch.float32 else tensor.float()
    dist.all_reduce(buf, group=group)
    buf.div_(n)
    if buf is not tensor:
        tensor.copy_(buf)


def all_gather_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """``all_gather_single`` where torch has it (≥ 2.13), else ``all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Sum ``input`` over ``group`` and keep this rank's slice (new or old torch name)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)
