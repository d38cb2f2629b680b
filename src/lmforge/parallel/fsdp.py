"""Fully sharded data parallelism (ZeRO-3), written from torch.distributed primitives.

Each *unit* (by default every Transformer block, the token embeddings and the LM head) keeps its
parameters as one flat fp32 vector split evenly across the data-parallel group: rank r holds
elements ``[r·S, (r+1)·S)`` as an ``nn.Parameter`` (the master shard the optimizer updates).
Around each unit:

* forward pre-hook: wait for the unit's all-gather (casting the shard to ``compute_dtype``
  first), point the module's weights at views of the gathered buffer, and launch the *next*
  unit's all-gather. Weights do not depend on earlier layers' results, so that prefetch overlaps
  this unit's compute.
* forward post-hook: free the gathered buffer (``untyped_storage().resize_(0)``) and hook the
  unit's outputs so that, when backward reaches them, the buffer is gathered again (refilling the
  same storage the saved views point to) and the previous unit's gather is prefetched.
* after the gathered buffer's gradient is complete: cast it to fp32, reduce-scatter it (each
  rank receives the sum of its slice), free buffer and gradient.

So each step moves 3× the parameter bytes (gather, gather, reduce-scatter), against 2× for DDP's
all-reduce: 1.5× the traffic for 1/N of the memory. Parameters outside every unit (or shared
between units, like tied embeddings) stay replicated and their gradients are all-reduced.

Numerics: gradients are reduced in fp32 (also under bf16/fp16 compute) and divided by the group
size after the sum. With fp32 compute, results equal single-process training except for the order
of the gradient sum: a rank's gradient is a sum over its own batch slice, then the ranks' sums are
added, while one process sums over the whole batch at once; fp32 addition is not associative, so
the last bits can differ (tests assert the tightest tolerance that honestly holds).

Simplifications: no gradient accumulation without communication (``no_sync`` still
reduce-scatters each micro-batch, accumulating into the fp32 shard gradient); units must be
called at most once per forward; every rank must run the same graph (same units used).

Exercise: ``pytest tests/test_parallel_dist.py -k fsdp``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.parallel._dist import all_gather_single, reduce_scatter_single
from lmforge.utils.errors import LmforgeError
from lmforge.utils.io import atomic_write

WrapPolicy = Callable[[str, nn.Module], bool] | Sequence[type[nn.Module]] | None

_DEFAULT_UNIT_NAMES = re.compile(r"^(layers\.\d+|token_embeddings|lm_head)$")


def default_wrap(name: str, module: nn.Module) -> bool:
    """Default units: each ``layers.i`` block, ``token_embeddings`` and ``lm_head``."""
    return bool(_DEFAULT_UNIT_NAMES.match(name))


@dataclasses.dataclass
class _ParamSlot:
    targets: list[tuple[nn.Module, str]]
    "every (submodule, attribute) that refers to the parameter"
    names: list[str]
    "every fully qualified name of the parameter in the unwrapped model (ties included)"
    shape: torch.Size
    "original shape"
    offset: int
    "start in the unit's flat vector"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class _Unit:
    """One sharded module: its flat master shard, gathered buffer and pending communication."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        slots: list[_ParamSlot],
        numel: int,
        group: dist.ProcessGroup | None,
        compute_dtype: torch.dtype,
        device: torch.device,
        matrix: bool,
    ) -> None:
        self.name = name
        self.matrix = matrix
        self.module = module
        self.slots = slots
        self.numel = numel
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.padded = -(-numel // self.world) * self.world
        self.shard_numel = self.padded // self.world
        self.compute_dtype = compute_dtype
        # Matrices and vectors get separate flat shards; the matrix shard is kept 2-D, (S, 1),
        # so optimizers that choose weight decay by ndim (as lmforge's trainer does) still work.
        shape = (self.shard_numel, 1) if matrix else (self.shard_numel,)
        self.shard = nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=device))
        # The gathered buffer is a persistent leaf: views of it are the module's weights, its
        # .grad collects their gradients, and its storage is freed whenever it is not needed.
        self.full = torch.zeros(self.padded, dtype=compute_dtype, device=device, requires_grad=True)
        self._free_storage()
        self.gather_work: dist.Work | None = None
        self.gathered = False
        self.in_backward = False
        self.pending: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []
        self.full.register_post_accumulate_grad_hook(self._on_full_grad)

    # -- storage ------------------------------------------------------------------------------
    def _free_storage(self) -> None:
        self.full.untyped_storage().resize_(0)

    def _alloc_storage(self) -> None:
        nbytes = self.padded * self.full.element_size()
        if self.full.untyped_storage().nbytes() != nbytes:
            self.full.untyped_storage().resize_(nbytes)

    # -- all-gather ---------------------------------------------------------------------------
    def start_gather(self) -> None:
        """Launch the asynchronous all-gather of the full parameters (no-op if under way)."""
        if self.gathered or self.gather_work is not None:
            return
        self._alloc_storage()
        src = self.shard.detach().reshape(-1).to(self.compute_dtype)
        # .data: writing through an alias with its own version counter keeps autograd from
        # flagging the refill as an in-place change of tensors saved for backward.
        self.gather_work = all_gather_single(self.full.data, src, group=self.group, async_op=True)
        self._gather_src = src

    def wait_gather(self) -> None:
        """Make sure the full parameters are present."""
        if self.gathered:
            return
        if self.gather_work is None:
            self.start_gather()
        assert self.gather_work is not None
        self.gather_work.wait()
        self.gather_work = None
        self._gather_src = None
        self.gathered = True

    def reshard(self) -> None:
        """Free the gathered parameters."""
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None
        self._free_storage()
        self.gathered = False

    def bind_views(self) -> None:
        """Point every module attribute at its view of the gathered buffer."""
        for s in self.slots:
            view = self.full[s.offset : s.offset + s.numel].view(s.shape)
            for m, a in s.targets:
                setattr(m, a, view)

    # -- reduce-scatter -----------------------------------------------------------------------
    def _on_full_grad(self, full: torch.Tensor) -> None:
        assert full.grad is not None
        # fp32 on the wire and in the sum, whatever the compute dtype.
        g = full.grad.detach().float().contiguous()
        out = torch.empty(self.shard_numel, dtype=torch.float32, device=g.device)
        work = reduce_scatter_single(out, g, group=self.group, async_op=True)
        self.pending.append((work, out, g))  # g stays referenced until the collective is done
        full.grad = None
        self.in_backward = False
        self.reshard()

    def finish(self) -> None:
        """Wait for the reduce-scatters and add the averaged slice to the shard's gradient."""
        for work, out, _ in self.pending:
            work.wait()
            out.div_(self.world)
            out = out.view_as(self.shard)
            if self.shard.grad is None:
                self.shard.grad = out
            else:
                self.shard.grad.add_(out)
        self.pending.clear()


def _matches(wrap: WrapPolicy, name: str, module: nn.Module) -> bool:
    if wrap is None:
        return default_wrap(name, module)
    if callable(wrap) and not isinstance(wrap, (list, tuple)):
        return bool(wrap(name, module))
    return isinstance(module, tuple(wrap))


class FSDP(nn.Module):
    """Shard ``module``'s units over ``process_group`` (default: the world).

    ``wrap``: a sequence of module classes or a predicate ``(qualified_name, module) -> bool``
    choosing the units (outermost match wins; default :func:`default_wrap`). ``compute_dtype``
    (e.g. ``torch.bfloat16``) is the dtype of gathered weights; master shards stay fp32.
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        wrap: WrapPolicy = None,
        process_group: dist.ProcessGroup | None = None,
        prefetch: bool = True,
    ) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.prefetch = prefetch
        self._broadcast_from_first_rank()
        params = list(module.parameters())
        device = params[0].device if params else torch.device("cpu")
        self.compute_dtype = compute_dtype or (params[0].dtype if params else torch.float32)

        unit_names: list[str] = []
        for name, sub in module.named_modules():
            if name and not any(name.startswith(u + ".") for u in unit_names):
                if _matches(wrap, name, sub):
                    unit_names.append(name)
        # Where each parameter appears: every (owning submodule name, attribute) pair.
        where: dict[int, list[tuple[str, str]]] = {}
        for mod_name, sub in module.named_modules(remove_duplicate=False):
            for attr, p in sub.named_parameters(recurse=False):
                where.setdefault(id(p), []).append((mod_name, attr))
        by_id = {id(p): p for p in module.parameters()}
        mods = dict(module.named_modules(remove_duplicate=False))

        def unit_of(mod_name: str) -> str | None:
            for u in unit_names:
                if mod_name == u or mod_name.startswith(u + "."):
                    return u
            return None

        self._units: list[_Unit] = []
        self._blocks: list[list[_Unit]] = []  # the units of each wrapped module, forward order
        self.shards = nn.ParameterList()
        assigned: set[int] = set()
        for u in unit_names:
            kinds: dict[bool, list[_ParamSlot]] = {True: [], False: []}
            offsets = {True: 0, False: 0}
            for pid, occ in where.items():
                p = by_id[pid]
                if not p.requires_grad or not p.is_floating_point():
                    continue
                if {unit_of(m) for m, _ in occ} != {u}:
                    continue  # outside this unit, or shared with something outside it
                names = [f"{m}.{a}" if m else a for m, a in occ]
                targets = [(mods[m], a) for m, a in occ]
                kind = p.ndim >= 2
                kinds[kind].append(_ParamSlot(targets, names, p.shape, offsets[kind]))
                offsets[kind] += p.numel()
            block: list[_Unit] = []
            for kind in (True, False):
                slots = kinds[kind]
                if not slots:
                    continue
                unit = _Unit(
                    u,
                    mods[u],
                    slots,
                    offsets[kind],
                    process_group,
                    self.compute_dtype,
                    device,
                    kind,
                )
                with torch.no_grad():
                    full = torch.zeros(unit.padded, dtype=torch.float32, device=device)
                    for s in slots:
                        m0, a0 = s.targets[0]
                        full[s.offset : s.offset + s.numel].copy_(m0._parameters[a0].reshape(-1))
                    lo = unit.rank * unit.shard_numel
                    unit.shard.view(-1).copy_(full[lo : lo + unit.shard_numel])
                for s in slots:
                    m0, a0 = s.targets[0]
                    assigned.add(id(m0._parameters[a0]))
                    for m, a in s.targets:
                        del m._parameters[a]
                self._units.append(unit)
                self.shards.append(unit.shard)
                block.append(unit)
            if block:
                self._blocks.append(block)
        for i, block in enumerate(self._blocks):
            block[0].module.register_forward_pre_hook(self._make_pre_forward(i))
            block[0].module.register_forward_hook(self._make_post_forward(i))

        # Replicated parameters: everything not in a unit. Under a lower compute dtype they are
        # held here as fp32 masters and cast on each forward.
        self._replicated: list[tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]] = []
        self.replicated = nn.ParameterList()
        for pid, occ in where.items():
            if pid in assigned:
                continue
            p = by_id[pid]
            names = [f"{m}.{a}" if m else a for m, a in occ]
            targets = [(mods[m], a) for m, a in occ]
            cast = (
                p.requires_grad
                and p.is_floating_point()
                and compute_dtype is not None
                and p.dtype != compute_dtype
            )
            if cast:
                for m, a in occ:
                    del mods[m]._parameters[a]
                self.replicated.append(p)
                self._replicated.append((p, targets, names))
            else:
                self._replicated.append((p, [], names))
        self._zero_sized_slots_check()

    def _zero_sized_slots_check(self) -> None:
        for unit in self._units:
            for s in unit.slots:
                if s.numel == 0:
                    raise LmforgeError(f"FSDP unit {unit.name}: empty parameter {s.names[0]}")

    def _broadcast_from_first_rank(self) -> None:
        src = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t.data, src=src, group=self.process_group)

    # -- hooks --------------------------------------------------------------------------------
    def _make_pre_forward(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            for unit in self._blocks[i]:
                unit.start_gather()
            if self.prefetch and i + 1 < len(self._blocks):
                for unit in self._blocks[i + 1]:
                    unit.start_gather()
            for unit in self._blocks[i]:
                unit.wait_gather()
                unit.bind_views()

        return hook

    def _make_post_forward(self, i: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            block = self._blocks[i]
            if any(u.in_backward for u in block):
                return output  # recomputation inside backward (activation checkpointing)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._make_pre_backward(i))
            for unit in block:
                unit.reshard()
            return output

        return hook

    def _make_pre_backward(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            block = self._blocks[i]
            if all(u.in_backward for u in block):
                return
            for unit in block:
                unit.in_backward = True
                unit.start_gather()
            if self.prefetch and i > 0:
                for unit in self._blocks[i - 1]:
                    unit.start_gather()
            for unit in block:
                unit.wait_gather()

        return hook

    # -- public -------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; replicated low-precision copies are made here."""
        for p, targets, _ in self._replicated:
            if targets:
                low = p.to(self.compute_dtype)
                for m, a in targets:
                    setattr(m, a, low)
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter; all-reduce (fp32) the replicated parameters' grads."""
        for unit in self._units:
            unit.finish()
            unit.in_backward = False
        reps = [p for p, _, _ in self._replicated if p.requires_grad]
        if not reps or self.world_size == 1:
            return
        grads = [
            p.grad.reshape(-1).float()
            if p.grad is not None
            else torch.zeros(p.numel(), device=p.device)
            for p in reps
        ]
        flat = torch.cat(grads)
        dist.all_reduce(flat, group=self.process_group)
        flat.div_(self.world_size)
        off = 0
        with torch.no_grad():
            for p in reps:
                chunk = flat[off : off + p.numel()].view_as(p)
                off += p.numel()
                if p.grad is None:
                    if bool(chunk.ne(0).any()):
                        p.grad = chunk.to(p.dtype).clone()
                else:
                    p.grad.copy_(chunk)

    def clip_grad_norm(
        self, max_norm: float, tp_group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """Clip to the global L2 norm over all shards (fp32); return the norm before clipping.

        With tensor parallelism (``tp_group``), squares of tensor-parallel slices (modules with
        a ``tp_dim``) are summed over the tp group too; replicated ones are counted once.
        """
        device = self.shards[0].device if len(self.shards) else torch.device("cpu")
        sq = torch.zeros(2, dtype=torch.float32, device=device)  # [tp-sliced, replicated]
        for unit in self._units:
            g = unit.shard.grad
            if g is None:
                continue
            g = g.reshape(-1).float()
            lo = unit.rank * unit.shard_numel
            for s in unit.slots:
                a, b = max(s.offset, lo), min(s.offset + s.numel, lo + unit.shard_numel)
                if a < b:
                    sliced = tp_group is not None and hasattr(s.targets[0][0], "tp_dim")
                    sq[0 if sliced else 1] += g[a - lo : b - lo].pow(2).sum()
        dist.all_reduce(sq, group=self.process_group)
        if tp_group is not None:
            sliced_sq = sq[0:1].clone()
            dist.all_reduce(sliced_sq, group=tp_group)
            sq[0] = sliced_sq[0]
        total = sq.sum()
        for p, _, _ in self._replicated:
            if p.grad is not None:
                total = total + p.grad.float().pow(2).sum()  # identical on every rank: once
        norm = total.sqrt()
        if max_norm > 0:
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale.to(p.grad.dtype))
        return norm

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Full fp32 tensors keyed by the unwrapped model's parameter names (on every rank)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self._units:
            full = torch.empty(unit.padded, dtype=torch.float32, device=unit.shard.device)
            all_gather_single(full, unit.shard.detach().reshape(-1), group=unit.group)
            for s in unit.slots:
                t = full[s.offset : s.offset + s.numel].view(s.shape).clone()
                for n in s.names:
                    out[n] = t
        for p, _, names in self._replicated:
            for n in names:
                out[n] = p.detach()
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters (gathered) plus the wrapped module's buffers, single-device names."""
        state = {k: v for k, v in self.module.state_dict().items()}
        state.update(self.gather_full_params())
        return state

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full single-device state: each rank keeps its slice of every unit."""
        for unit in self._units:
            full = torch.zeros(unit.padded, dtype=torch.float32, device=unit.shard.device)
            for s in unit.slots:
                if s.names[0] not in state:
                    raise LmforgeError(f"state dict lacks parameter '{s.names[0]}'")
                full[s.offset : s.offset + s.numel].copy_(state[s.names[0]].reshape(-1))
            lo = unit.rank * unit.shard_numel
            unit.shard.view(-1).copy_(full[lo : lo + unit.shard_numel])
        for p, _, names in self._replicated:
            if names[0] not in state:
                raise LmforgeError(f"state dict lacks parameter '{names[0]}'")
            p.copy_(state[names[0]])
        buffers = {n for n, _ in self.module.named_buffers()}
        rest = {k: v for k, v in state.items() if k in buffers}
        if rest:
            self.module.load_state_dict(rest, strict=False)

    # -- sharded checkpoints ------------------------------------------------------------------
    def _layout(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "units": [[u.name, u.matrix, u.numel] for u in self._units],
        }

    def save_sharded(self, folder: str | os.PathLike, optimizer: Any = None) -> None:
        """Write this rank's shards (and optimizer state) to ``folder/shard-RRRRR-of-WWWWW.pt``."""
        folder = Path(folder)
        rank = dist.get_rank(self.process_group)
        state: dict[str, Any] = {
            "layout": json.dumps(self._layout()),
            "shards": [u.shard.detach().cpu() for u in self._units],
            "replicated": [p.detach().cpu() for p, _, _ in self._replicated],
            "buffers": {k: v.cpu() for k, v in self.module.state_dict().items()},
        }
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        with atomic_write(folder / _shard_name(rank, self.world_size)) as f:
            torch.save(state, f)

    @torch.no_grad()
    def load_sharded(self, folder: str | os.PathLike, optimizer: Any = None) -> None:
        """Resume from :meth:`save_sharded`; a layout mismatch raises one line on every rank.

        Every rank checks the same files (all ranks' shards present, same world size and unit
        sizes) before reading anything, so all of them stop with the same message.
        """
        folder = Path(folder)
        files = sorted(folder.glob("shard-*-of-*.pt"))
        if not files:
            raise LmforgeError(f"no sharded checkpoint (shard-*-of-*.pt) in {folder}")
        saved_world = int(files[0].name.split("-of-")[1].split(".")[0])
        if saved_world != self.world_size:
            raise LmforgeError(
                f"sharded checkpoint {folder} was written by {saved_world} data-parallel ranks; "
                f"this job shards over {self.world_size} (load the full checkpoint instead)"
            )
        for r in range(saved_world):
            if not (folder / _shard_name(r, saved_world)).exists():
                raise LmforgeError(
                    f"sharded checkpoint {folder} lacks {_shard_name(r, saved_world)}"
                )
        rank = dist.get_rank(self.process_group)
        state = torch.load(folder / _shard_name(rank, saved_world), weights_only=True)
        if json.loads(state["layout"]) != self._layout():
            raise LmforgeError(
                f"sharded checkpoint {folder} has a different unit layout than this model "
                "(other model shape or wrap policy)"
            )
        for u, t in zip(self._units, state["shards"]):
            u.shard.copy_(t)
        for (p, _, _), t in zip(self._replicated, state["replicated"]):
            p.copy_(t)
        if state["buffers"]:
            self.module.load_state_dict(state["buffers"], strict=False)
        if optimizer is not None and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])


def _shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.pt"


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
