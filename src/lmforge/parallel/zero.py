"""ZeRO-1: shard optimizer state across the data-parallel group.

Each rank owns a share of the parameters (assigned greedily by size so shares are balanced),
keeps optimizer state only for that share, updates it, and broadcasts the updated values to the
other ranks. Gradients must already be averaged (DDP). With Adam the state is 8 bytes per
parameter in fp32; sharding divides it by the group size. Results equal the unsharded optimizer
because each parameter's update depends only on its own gradient and state.

Simplification: the unit of sharding is a whole parameter tensor (not a flat slice), so shares
are only as balanced as the tensor sizes allow. ``state_dict()`` gathers the full state in
torch's standard format (a collective), so checkpoints look like single-process ones.

Exercise: ``pytest tests/test_parallel_dist.py -k zero``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer_cls(**kwargs)`` so each rank holds state only for its parameter share."""

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_cls: type[torch.optim.Optimizer] | Callable[..., torch.optim.Optimizer],
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.group_rank = dist.get_rank(process_group)
        self._owner: dict[int, int] = {}
        self._load = [0] * self.world_size
        self._inner: torch.optim.Optimizer | None = None
        self._kwargs = kwargs
        # A template over all parameters fixes the group structure and every hyperparameter
        # (optimizers allocate state lazily, so this costs nothing). ``optimizer_cls`` may also be
        # a factory such as ``lambda ps: AdamW(groups_by_ndim(ps), lr=...)``.
        template = optimizer_cls(params, **kwargs)
        self._optimizer_cls = type(template)
        groups = [dict(g) for g in template.param_groups]
        super().__init__(groups, defaults=dict(template.defaults))
        del template
        self._build_inner()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its parameters are assigned to owners immediately."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda t: -t.numel()):
            if id(p) not in self._owner:
                r = min(range(self.world_size), key=lambda i: self._load[i])
                self._owner[id(p)] = r
                self._load[r] += p.numel()
        if self._inner is not None:
            self._inner.add_param_group(self._local_group(group))

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in group["params"] if self._owner[id(p)] == self.group_rank]
        return local

    def _build_inner(self) -> None:
        groups = [self._local_group(g) for g in self.param_groups]
        # Optimizers reject an empty parameter list; a placeholder keeps group indices aligned.
        placeholder = torch.zeros(1, requires_grad=True)
        for g in groups:
            if not g["params"]:
                g["params"] = [placeholder]
        self._inner = self._optimizer_cls(groups)

    def _global_src(self, owner: int) -> int:
        if self.process_group is None:
            return owner
        return dist.get_global_rank(self.process_group, owner)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """Update this rank's share with the wrapped optimizer, then broadcast every share."""
        assert self._inner is not None
        loss = closure() if closure is not None else None
        # The trainer changes lr etc. on our groups; mirror every hyperparameter into the shard.
        for outer, inner in zip(self.param_groups, self._inner.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v
        self._inner.step()
        works = []
        for group in self.param_groups:
            for p in group["params"]:
                src = self._global_src(self._owner[id(p)])
                works.append(
                    dist.broadcast(p.data, src=src, group=self.process_group, async_op=True)
                )
        for w in works:
            w.wait()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter (all shares)."""
        super().zero_grad(set_to_none=set_to_none)

    def local_state_numel(self) -> int:
        """Number of optimizer-state elements held by this rank (for memory accounting)."""
        assert self._inner is not None
        return sum(
            t.numel()
            for s in self._inner.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state in torch's standard format, gathered on every rank.

        Indices number the parameters across groups in order, as a single-process optimizer
        over the same groups would, so checkpoints are interchangeable with unsharded runs.
        Collective: every rank of the group must call it.
        """
        assert self._inner is not None
        params = self._all_params()
        # Metadata (keys, shapes, small scalars) travels as objects; big tensors by broadcast.
        meta: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(params):
            if self._owner[id(p)] != self.group_rank or p not in self._inner.state:
                continue
            entry: dict[str, Any] = {}
            for k, v in self._inner.state[p].items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    entry[k] = ("tensor", tuple(v.shape), str(v.dtype).removeprefix("torch."))
                elif isinstance(v, torch.Tensor):
                    entry[k] = ("scalar", v.item(), str(v.dtype).removeprefix("torch."))
                else:
                    entry[k] = ("value", v, None)
            meta[i] = entry
        metas: list[Any] = [None] * self.world_size
        dist.all_gather_object(metas, meta, group=self.process_group)
        state: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(params):
            owner = self._owner[id(p)]
            entry = metas[owner].get(i)
            if entry is None:
                continue
            st: dict[str, Any] = {}
            for k, (kind, a, dtype) in entry.items():
                if kind == "tensor":
                    if owner == self.group_rank:
                        t = self._inner.state[p][k].detach().clone()
                    else:
                        t = torch.empty(a, dtype=getattr(torch, dtype), device=p.device)
                    dist.broadcast(t, src=self._global_src(owner), group=self.process_group)
                    st[k] = t
                elif kind == "scalar":
                    st[k] = torch.tensor(a, dtype=getattr(torch, dtype))
                else:
                    st[k] = a
            state[i] = st
        groups = []
        start = 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(d)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a standard (full) optimizer state; each rank keeps its share."""
        from lmforge.utils.errors import LmforgeError

        assert self._inner is not None
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(o["params"]) for g, o in zip(groups, self.param_groups)
        ):
            raise LmforgeError("optimizer state does not match this model's parameter groups")
        for outer, inner, saved in zip(self.param_groups, self._inner.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    outer[k] = v
                    inner[k] = v
        for i, p in enumerate(self._all_params()):
            if self._owner[id(p)] != self.group_rank:
                continue
            st = state_dict["state"].get(i, state_dict["state"].get(str(i)))
            if st is None:
                continue
            self._inner.state[p] = {
                k: (v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                for k, v in st.items()
            }
