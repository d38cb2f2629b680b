"""The distributed strategies the trainer drives, and :func:`build_strategy` that picks one.

Parallelism is applied from outside the single-device model in one fixed order:
tensor parallel (shard the blocks' projections) → pipeline (cut into stages) → data parallel
(DDP, ZeRO-1 or FSDP over the data-parallel group). Composition supported: DP×TP, FSDP×TP,
DP×PP (also ZeRO-1 on top of DP), and expert parallelism within DP (``parallel.ep``,
:mod:`lmforge.parallel.ep`). Not supported: FSDP×PP, TP×PP, EP with TP/PP/FSDP/ZeRO-1 (refused
at start).

Launch (one node, 8 GPUs)::

    torchrun --nproc_per_node 8 -m lmforge train --config configs/gpt2.toml \\
        --parallel.dp=4 --parallel.tp=2 --parallel.fsdp=true

Multi-node: run the same command on every node with torchrun's rendezvous, e.g.
``torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST0:29500
--rdzv_id job1 -m lmforge train ...``; torchrun sets RANK/LOCAL_RANK/WORLD_SIZE and
MASTER_ADDR/MASTER_PORT, :class:`lmforge.utils.Runtime` reads them, and the ``env://``
rendezvous below joins the group. Tensor parallelism should stay within a node (tp ≤ GPUs per
node): the rank layout puts tp innermost so its ranks are consecutive.

A bad layout (dp·tp·pp ≠ world size, pp not dividing the layers, tp not dividing the heads)
raises :class:`~lmforge.utils.LmforgeError` on every rank before any collective, so the job
stops with one line instead of hanging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.parallel import ep
from lmforge.parallel._dist import Mesh, build_mesh, init_process_group, resolve_layout
from lmforge.parallel.config import ParallelConfig
from lmforge.parallel.ddp import DDP
from lmforge.parallel.fsdp import FSDP
from lmforge.parallel.hierarchical import HierarchicalGroups
from lmforge.parallel.pipeline import PipelineRunner, PipelineStage
from lmforge.parallel.strategy import LossFn, OptimizerFactory, Strategy
from lmforge.parallel.tensor import (
    apply_tensor_parallel,
    gather_tensor_parallel_state,
    load_tensor_parallel_state,
)
from lmforge.parallel.zero import ShardedOptimizer
from lmforge.utils.errors import LmforgeError

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class DistributedStrategy(Strategy):
    """Shared plumbing: ranks, the mesh, loss averaging over the data-parallel group."""

    def __init__(self, model: nn.Module, unwrapped: nn.Module, mesh: Mesh) -> None:
        super().__init__(model)
        self.unwrapped = unwrapped
        self.mesh = mesh

    @property
    def rank(self) -> int:
        """Global rank."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """All processes of the job."""
        return dist.get_world_size()

    @property
    def dp_size(self) -> int:
        """Data-parallel degree (number of model replicas): the number of distinct data streams."""
        return self.mesh.layout.dp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index. Ranks with the same index (the tensor-parallel and
        pipeline peers of one replica) must be fed the same micro-batches: seed the sampler with
        this, not with the global rank."""
        return self.mesh.coords[0]

    @property
    def per_rank_optimizer_state(self) -> bool:
        """True when ranks hold different optimizer states (save one file per rank).

        False for DDP and ZeRO-1 without tensor parallelism (ZeRO-1's ``state_dict`` gathers
        the full state); True for FSDP, pipeline stages and any tensor-parallel layout.
        """
        return self.mesh.layout.tp > 1

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a scalar over the data-parallel group (fp32)."""
        if self.dp_size == 1:
            return value
        buf = value.detach().float().clone()
        dist.all_reduce(buf, group=self.mesh.dp_group)
        return buf / self.dp_size

    def barrier(self) -> None:
        """Wait for every process."""
        dist.barrier()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full single-device state on every rank (tensor-parallel shards gathered)."""
        return gather_tensor_parallel_state(self.unwrapped)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a single-device state (each tensor-parallel rank keeps its slice)."""
        load_tensor_parallel_state(self.unwrapped, state)


class DDPStrategy(DistributedStrategy):
    """Replicated model, bucketed overlapped gradient all-reduce (optionally hierarchical)."""

    def __init__(
        self, unwrapped: nn.Module, mesh: Mesh, pcfg: ParallelConfig, hierarchy: Any = None
    ) -> None:
        ddp = DDP(
            unwrapped,
            bucket_size_mb=pcfg.bucket_size_mb,
            process_group=mesh.dp_group,
            hierarchy=hierarchy,
        )
        super().__init__(ddp, unwrapped, mesh)
        self.ddp = ddp

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no all-reduce)."""
        with self.ddp.no_sync():
            yield

    def finish_gradient_synchronization(self) -> None:
        """Wait for the buckets' all-reduces."""
        self.ddp.finish_gradient_synchronization()


class ZeRO1Strategy(DDPStrategy):
    """DDP gradients plus an optimizer whose state is sharded over the data-parallel group."""

    def make_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """Wrap the trainer's optimizer factory in a :class:`ShardedOptimizer`."""
        params = [p for p in self.unwrapped.parameters() if p.requires_grad]
        return ShardedOptimizer(params, factory, process_group=self.mesh.dp_group)


class FSDPStrategy(DistributedStrategy):
    """ZeRO-3: flat parameter shards, gathered per unit, gradients reduce-scattered."""

    @property
    def per_rank_optimizer_state(self) -> bool:
        """Always: each rank's optimizer covers only its own shard or stage."""
        return True

    def __init__(self, unwrapped: nn.Module, mesh: Mesh, pcfg: ParallelConfig) -> None:
        fsdp = FSDP(unwrapped, compute_dtype=_DTYPES[pcfg.fsdp_dtype], process_group=mesh.dp_group)
        super().__init__(fsdp, unwrapped, mesh)
        self.fsdp = fsdp

    def make_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer over this rank's flat shards (and replicated parameters)."""
        return factory([p for p in self.fsdp.parameters() if p.requires_grad])

    def finish_gradient_synchronization(self) -> None:
        """Wait for the reduce-scatters and the replicated parameters' all-reduce."""
        self.fsdp.finish_gradient_synchronization()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm over all shards (and tensor-parallel ranks); clip."""
        tp_group = self.mesh.tp_group if self.mesh.layout.tp > 1 else None
        return self.fsdp.clip_grad_norm(max_norm, tp_group=tp_group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Gathered fp32 parameters and buffers, single-device names, on every rank."""
        state = self.fsdp.full_state_dict()
        if self.mesh.layout.tp > 1:
            from lmforge.parallel.tensor import gather_tp_tensors

            state = gather_tp_tensors(self.unwrapped, state)
        return state

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Each rank keeps its slice of every unit."""
        if self.mesh.layout.tp > 1:
            from lmforge.parallel.tensor import slice_tp_tensors

            state = slice_tp_tensors(self.unwrapped, state)
        self.fsdp.load_full_state_dict(state)

    def save_sharded(self, folder: str, optimizer: Any = None) -> None:
        """Per-rank shard files (see :meth:`FSDP.save_sharded`)."""
        self.fsdp.save_sharded(folder, optimizer)

    def load_sharded(self, folder: str, optimizer: Any = None) -> None:
        """Resume from per-rank shard files; a layout mismatch stops every rank with one line."""
        self.fsdp.load_sharded(folder, optimizer)


class PipelineStrategy(DistributedStrategy):
    """Stages over the pipeline group; data parallel (DDP) across pipelines when dp > 1."""

    @property
    def per_rank_optimizer_state(self) -> bool:
        """Always: each rank's optimizer covers only its own shard or stage."""
        return True

    def __init__(self, unwrapped: nn.Module, mesh: Mesh, pcfg: ParallelConfig) -> None:
        _, pp_i, _ = mesh.coords
        stage = PipelineStage(unwrapped, pp_i, mesh.layout.pp)
        self.ddp = (
            DDP(stage, bucket_size_mb=pcfg.bucket_size_mb, process_group=mesh.dp_group)
            if mesh.layout.dp > 1
            else None
        )
        module = self.ddp if self.ddp is not None else stage
        super().__init__(module, unwrapped, mesh)
        self.stage = stage
        self.runner = PipelineRunner(
            stage,
            mesh.pp_ranks,
            mesh.pp_group,
            unwrapped.config.d_model,
            schedule=pcfg.schedule,
            module=module,
        )

    def make_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer over this stage's parameters only."""
        return factory([p for p in self.stage.parameters() if p.requires_grad])

    def forward_backward(
        self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn
    ) -> torch.Tensor:
        """Run the pipeline schedule over the micro-batches; mean loss on every rank."""
        ctx = self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()
        with ctx:
            loss = self.runner.run(micro_batches, loss_fn)
        if self.ddp is not None:
            self.ddp.finish_gradient_synchronization()  # reduces the accumulated gradients
        return self.reduce_mean(loss)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm: squares summed over stages (each parameter lives on one stage)."""
        grads = [p.grad.float() for p in self.stage.parameters() if p.grad is not None]
        device = next(self.stage.parameters()).device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            sq += g.pow(2).sum()
        dist.all_reduce(sq, group=self.mesh.pp_group)
        norm = sq.sqrt()
        if max_norm > 0 and max_norm != float("inf"):
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in self.stage.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale.to(p.grad.dtype))
        return norm

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter broadcast from the stage that owns (and updates) it."""
        owned = {id(p) for p in self.stage.parameters()}
        owners = torch.zeros(len(list(self.unwrapped.parameters())), dtype=torch.long)
        params = list(self.unwrapped.parameters())
        for i, p in enumerate(params):
            if id(p) in owned:
                owners[i] = self.mesh.coords[1]
        dev = params[0].device
        owners_d = owners.to(dev)
        dist.all_reduce(owners_d, group=self.mesh.pp_group)  # only the owner wrote its index
        for p, o in zip(params, owners_d.tolist()):
            dist.broadcast(p.data, src=self.mesh.pp_ranks[o], group=self.mesh.pp_group)
        return self.unwrapped.state_dict()


class ExpertParallelStrategy(DistributedStrategy):
    """Experts sharded over EP groups of ``ep`` consecutive ranks; everything else replicated
    and data-parallel over the world (:mod:`lmforge.parallel.ep` has the reductions)."""

    def __init__(self, model: nn.Module, mesh: Mesh, ep_size: int) -> None:
        with torch.no_grad():  # rank 0's weights everywhere, before each rank keeps its shard
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, src=0)
        self.ep_group, self.edp_group = ep.expert_parallel_groups(ep_size)
        ep.apply_expert_parallel(model, self.ep_group)
        super().__init__(model, model, mesh)
        self.ep_size = ep_size
        named = list(model.named_parameters())
        self._experts = [p for n, p in named if ep.is_expert_parameter(n)]
        self._replicated = [p for n, p in named if not ep.is_expert_parameter(n)]

    @property
    def per_rank_optimizer_state(self) -> bool:
        """Always: each rank's optimizer holds the state of its own expert shards."""
        return True

    def finish_gradient_synchronization(self) -> None:
        """Average the replicated gradients over the world, the experts' over their holders."""
        edp = self.edp_group if self.world_size > self.ep_size else None
        ep.sync_gradients(self.unwrapped, edp)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm: the replicated gradients once, plus the expert shards' squares summed
        over the EP group (each expert lives on one rank of it); clip every gradient."""
        rep = [p.grad for p in self._replicated if p.grad is not None]
        exp = [p.grad for p in self._experts if p.grad is not None]
        dev = next(iter(self.unwrapped.parameters())).device
        sq = [ep.sum_of_squares(rep, dev), ep.sum_of_squares(exp, dev)]
        dist.all_reduce(sq[1], group=self.ep_group)
        norm = (sq[0] + sq[1]).sqrt()
        if max_norm > 0 and max_norm != float("inf"):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in rep + exp:
                g.mul_(coef.to(g.dtype))
        return norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device state on every rank (expert shards all-gathered: a collective)."""
        return ep.gather_expert_state(self.unwrapped, self.ep_group)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a single-device state; each rank keeps its experts."""
        ep.load_expert_state(self.unwrapped, state)


def build_strategy(model: nn.Module, pcfg: ParallelConfig, runtime: Any) -> Strategy:
    """Join the process group, validate the layout, and wrap ``model`` accordingly.

    ``runtime`` is a :class:`lmforge.utils.Runtime` (device, rank, world size). With one process
    and no parallelism asked for, returns the single-device :class:`Strategy`. All ranks must
    hold the same initial weights or not: DDP/FSDP broadcast rank 0's (per data-parallel group);
    tensor and pipeline parallelism assume equal weights (seed before building the model).
    """
    cfg = getattr(model, "config", None)
    layout = resolve_layout(
        runtime.world_size,
        dp=pcfg.dp,
        tp=pcfg.tp,
        pp=pcfg.pp,
        n_layers=getattr(cfg, "n_layers", None),
        n_heads=getattr(cfg, "n_heads", None),
        n_kv_heads=getattr(cfg, "kv_heads", None),
        d_ff=getattr(cfg, "ffn_dim", None),
        fsdp=pcfg.fsdp,
    )
    if layout.tp > 1 and layout.pp > 1:
        raise LmforgeError("parallel.tp>1 together with parallel.pp>1 is not supported")
    if layout.pp > 1 and getattr(cfg, "tie_embeddings", False):
        raise LmforgeError("parallel.pp>1 needs model.tie_embeddings=false")
    if (layout.tp > 1 or layout.pp > 1) and getattr(cfg, "kv_share_every", 1) > 1:
        raise LmforgeError(
            "parallel.tp>1 or parallel.pp>1 does not support cross-layer KV sharing"
            " (model.kv_share_every > 1): use data parallelism (DDP, ZeRO-1, FSDP)"
        )
    if pcfg.domain_size and (layout.tp > 1 or layout.pp > 1 or pcfg.fsdp):
        raise LmforgeError("parallel.domain_size (hierarchical all-reduce) needs plain DP/ZeRO-1")
    if pcfg.domain_size and runtime.world_size % pcfg.domain_size:
        raise LmforgeError(
            f"parallel.domain_size={pcfg.domain_size} does not divide world size "
            f"{runtime.world_size}"
        )
    if pcfg.ep != 1:  # expert parallelism: refused here, before any collective, if it can't work
        ep.check_expert_layout(pcfg, runtime.world_size)
        ep.check_expert_model(pcfg.ep, model)
    if runtime.world_size == 1 and not dist.is_initialized():
        return Strategy(model)
    init_process_group(runtime.device, runtime.rank, runtime.world_size, pcfg.backend)
    mesh = build_mesh(layout, dist.get_rank())
    if pcfg.ep > 1:
        return ExpertParallelStrategy(model, mesh, pcfg.ep)
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh.tp_group)
    if layout.pp > 1:
        return PipelineStrategy(model, mesh, pcfg)
    if pcfg.fsdp:
        return FSDPStrategy(model, mesh, pcfg)
    hierarchy = HierarchicalGroups(pcfg.domain_size) if pcfg.domain_size else None
    if pcfg.zero1:
        return ZeRO1Strategy(model, mesh, pcfg, hierarchy)
    return DDPStrategy(model, mesh, pcfg, hierarchy)
