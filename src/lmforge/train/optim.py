"""AdamW (decoupled weight decay) as a ``torch.optim.Optimizer`` and global-norm gradient clipping.

Every fast path (foreach, compiled, gated, Triton) is tested against the float64 reference
:func:`lmforge.kernels.adamw_reference_` (``tests/test_optim.py``,
``tests/test_kernels_interp.py``), and the reference against ``torch.optim.AdamW``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmforge.optim.clip import clip_grad_norm, grad_norm_and_clip_coef

if TYPE_CHECKING:
    from lmforge.train.config import TrainConfig

__all__ = ["AdamW", "build_optimizer", "clip_grad_norm", "grad_norm_and_clip_coef", "param_groups"]


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), matching ``torch.optim.AdamW``.

    Per parameter θ with gradient g at step t (m, v start at 0)::

        θ ← θ · (1 − lr·λ)
        m ← β1·m + (1 − β1)·g
        v ← β2·v + (1 − β2)·g²
        θ ← θ − lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε)

    State per parameter: ``step`` (0-d fp32 CPU tensor, as torch keeps it), ``exp_avg`` and
    ``exp_avg_sq`` (shaped like the parameter, in its dtype: fp32 master weights give fp32 state).
    ``foreach=True`` (default): multi-tensor ``torch._foreach_*`` kernels; ``False``: the
    per-tensor reference. ``compiled=True``: the same update through ``torch.compile`` (one fused
    kernel per parameter; hyperparameters travel as a device tensor, so schedule changes never
    recompile). ``fused=True``: one Triton launch per group
    (:func:`lmforge.kernels.adamw_multi_tensor_`, float32 on CUDA), via :meth:`step_if`.
    :meth:`step_if` applies the update only where a device-side flag says so, without the host
    reading it (the trainer's sync-free step). Simplification: no amsgrad, maximize, capturable
    or sparse gradients.

    Master weights: ``copies`` maps some float32 parameters to the lower-precision tensors the
    model computes with (same shape). A master's gradient is read from its copy's ``.grad``
    (upcast exactly), and every applied update rewrites the copy with θ rounded to its dtype.
    :meth:`zero_grad` clears the copies' gradients too; :meth:`state_dict` leaves them out.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        foreach: bool = True,
        compiled: bool = False,
        fused: bool = False,
        copies: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"invalid betas {betas}")
        if eps < 0:
            raise ValueError(f"invalid eps {eps}")
        if weight_decay < 0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.foreach = foreach
        self.compiled = compiled
        self.fused = fused
        self._compiled_update: Callable[..., None] | None = None
        self._compiled_gated: Callable[..., None] | None = None
        self._hp_device: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.copies: dict[torch.Tensor, torch.Tensor] = dict(copies or {})
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        for master, copy in self.copies.items():
            if id(master) not in mine:
                raise ValueError("AdamW copies: a master tensor is not among the parameters")
            if master.shape != copy.shape or master.device != copy.device:
                raise ValueError(
                    f"AdamW copies: master {tuple(master.shape)} on {master.device} and copy "
                    f"{tuple(copy.shape)} on {copy.device} differ"
                )
            if not (master.is_floating_point() and copy.is_floating_point()):
                raise ValueError("AdamW copies: masters and copies must be floating point")

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        # The gradient of p: its copy's, for a master weight.
        copy = self.copies.get(p)
        return p.grad if copy is None else copy.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the parameters and of their copies (master weights)."""
        super().zero_grad(set_to_none=set_to_none)
        for copy in self.copies.values():
            if copy.grad is not None:
                if set_to_none:
                    copy.grad = None
                else:
                    copy.grad.zero_()

    def _with_grads(self, group: dict) -> list[torch.Tensor]:
        # The group's parameters that have a gradient (a sparse one is refused).
        params = [p for p in group["params"] if self._grad(p) is not None]
        if any(self._grad(p).is_sparse for p in params):
            raise RuntimeError("AdamW does not support sparse gradients")
        return params

    def _step_buckets(self, params: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
        # Count each step, bucket by (device, dtype, step); CPU step counts: no device sync.
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            state = self._state_for(p)
            state["step"] += 1
            buckets.setdefault((p.device, p.dtype, state["step"].item()), []).append(p)
        return buckets

    def _state_for(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Apply one update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.fused:
            # on the parameters' device: a CPU flag would cost a synchronising copy every step
            first = next((p for g in self.param_groups for p in g["params"]), None)
            device = first.device if first is not None else None
            self.step_if(torch.ones((), dtype=torch.bool, device=device))
            return loss
        for group in self.param_groups:
            params = self._with_grads(group)
            if not params:
                continue
            if self.compiled:
                self._step_compiled(group, params)
            elif self.foreach:
                self._step_foreach(group, params)
            else:
                self._step_reference(group, params)
            for p in params:  # the copies of the just updated masters, rounded from them
                copy = self.copies.get(p)
                if copy is not None:
                    copy.copy_(p)
        return loss

    @torch.no_grad()
    def step_if(
        self,
        ok: torch.Tensor,
        grad_scale: torch.Tensor | None = None,
        refresh: bool = True,
    ) -> None:
        """One update where the 0-d bool tensor ``ok`` is True; nothing at all where it is False.

        The decision stays on the device: every value is written as ``where(ok, new, old)``, so a
        skipped step (NaN/inf gradients included) leaves it bit-identical and the host never
        waits. Step counts move to the parameters' device (as torch's ``capturable`` AdamW keeps
        them), bias corrections in float64 there. With ``ok`` True the result equals :meth:`step`.

        ``grad_scale`` (0-d device tensor) multiplies every gradient inside the update, as
        clipping would in place (one pass less). ``refresh=False`` uses the device
        hyperparameters as they stand (a CUDA-graph capture must not record the host-to-device
        copy; call :meth:`load_hyperparameters` before each replay instead).
        """
        if refresh:
            self.load_hyperparameters()
        for gi, group in enumerate(self.param_groups):
            params = self._with_grads(group)
            if not params:
                continue
            by_device: dict[tuple[torch.device, bool], list[torch.Tensor]] = {}
            for p in params:
                state = self._state_for(p)
                if state["step"].device != p.device or state["step"].dtype != torch.float64:
                    state["step"] = state["step"].to(p.device, torch.float64)
                # Masters and plain parameters apart: their gradients differ in dtype.
                by_device.setdefault((p.device, p in self.copies), []).append(p)
            for (device, copied), ps in by_device.items():
                hp_t = self._hp_device.get((gi, device))
                if hp_t is None:
                    raise RuntimeError(
                        f"AdamW.step_if(refresh=False) before load_hyperparameters() on {device}"
                    )
                scale = torch.ones((), device=device) if grad_scale is None else grad_scale
                args = (
                    ps,
                    [self._grad(p) for p in ps],
                    [self.state[p]["exp_avg"] for p in ps],
                    [self.state[p]["exp_avg_sq"] for p in ps],
                )
                copies = [self.copies[p] for p in ps] if copied else None
                if self.fused:
                    from lmforge.kernels import adamw_multi_tensor_

                    steps = [self.state[p]["step"] for p in ps]
                    adamw_multi_tensor_(*args, steps, hp_t, ok.to(device), scale.to(device), copies)
                    continue
                update = _adamw_gated_update
                if self.compiled:
                    if self._compiled_gated is None:
                        self._compiled_gated = torch.compile(_adamw_gated_update)
                    update = self._compiled_gated
                update(
                    *args,
                    # (1,) views: compiled, 0-d CPU counts are scalars never written back
                    [self.state[p]["step"].view(1) for p in ps],
                    hp_t,
                    ok.to(device),
                    scale.to(device, torch.float32),
                    copies,
                )

    def load_hyperparameters(self) -> None:
        """Copy each group's (lr, λ, β1, β2, ε) into its persistent float64 device tensor, one per
        device holding its parameters (written in place, so a captured CUDA graph sees them)."""
        for gi, group in enumerate(self.param_groups):
            hp = [group["lr"], group["weight_decay"], *group["betas"], group["eps"]]
            for device in {p.device for p in group["params"]}:
                hp_cpu = torch.tensor(hp, dtype=torch.float64)
                if device.type == "cuda":  # pinned, so the copy does not wait for the stream
                    hp_cpu = hp_cpu.pin_memory()
                dev = self._hp_device.get((gi, device))
                if dev is None:
                    self._hp_device[(gi, device)] = hp_cpu.to(device, non_blocking=True)
                else:
                    dev.copy_(hp_cpu, non_blocking=True)

    def _step_reference(self, group: dict, params: list[torch.Tensor]) -> None:
        # foreach=False: the one readable reference (kernels.adamw_reference_), per tensor.
        from lmforge.kernels import adamw_reference_

        hp = [group["lr"], group["weight_decay"], *group["betas"], group["eps"]]
        states = [self._state_for(p) for p in params]
        adamw_reference_(
            params,
            [self._grad(p) for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            torch.tensor(hp, dtype=torch.float64),
            torch.tensor(True),
            torch.ones(()),
        )

    def _step_foreach(self, group: dict, params: list[torch.Tensor]) -> None:
        # Same math in a few multi-tensor kernels per (device, dtype, step) bucket.
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for (_, _, t), ps in self._step_buckets(params).items():
            grads = [self._grad(p).to(p.dtype) for p in ps]
            ms = [self.state[p]["exp_avg"] for p in ps]
            vs = [self.state[p]["exp_avg_sq"] for p in ps]
            if wd != 0:
                torch._foreach_mul_(ps, 1 - lr * wd)
            torch._foreach_lerp_(ms, grads, 1 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, math.sqrt(1 - beta2**t))
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, ms, denom, value=-lr / (1 - beta1**t))

    def _step_compiled(self, group: dict, params: list[torch.Tensor]) -> None:
        # The foreach math again, compiled: every per-parameter update becomes one fused kernel.
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        if self._compiled_update is None:
            self._compiled_update = torch.compile(_adamw_update)
        for (device, dtype, t), ps in self._step_buckets(params).items():
            hp = [1 - lr * wd, 1 - beta1, beta2, 1 - beta2, math.sqrt(1 - beta2**t), eps]
            hp.append(-lr / (1 - beta1**t))
            # Rounded once from float64 to the bucket's dtype (float64 parameters keep float64).
            hp_t = torch.tensor(hp, dtype=torch.float64).to(dtype)
            hp_t = hp_t.to(device, non_blocking=True)
            grads = [self._grad(p).to(p.dtype) for p in ps]
            ms = [self.state[p]["exp_avg"] for p in ps]
            vs = [self.state[p]["exp_avg_sq"] for p in ps]
            self._compiled_update(ps, grads, ms, vs, hp_t)


def _adamw_update(
    ps: list[torch.Tensor],
    grads: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    hp: torch.Tensor,
) -> None:
    """One AdamW update of every (θ, g, m, v); ``hp`` = [1−lr·λ, 1−β1, β2, 1−β2, √(1−β2ᵗ), ε,
    −lr/(1−β1ᵗ)] as a device tensor (so the compiled graph never specialises on their values)."""
    decay, one_m_b1, b2, one_m_b2, sqrt_bc2, eps, neg_step = hp.unbind(0)
    for p, g, m, v in zip(ps, grads, ms, vs):
        p.mul_(decay)
        m.lerp_(g, one_m_b1)
        v.mul_(b2).add_(g * g * one_m_b2)
        p.add_(m / (v.sqrt() / sqrt_bc2 + eps) * neg_step)


def _adamw_gated_update(
    ps: list[torch.Tensor],
    grads: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hp: torch.Tensor,
    ok: torch.Tensor,
    scale: torch.Tensor,
    copies: list[torch.Tensor] | None = None,
) -> None:
    """AdamW where ``ok`` (0-d bool) holds, else no change; ``hp`` = [lr, λ, β1, β2, ε] float64,
    ``steps`` float64 0-d counts, ``scale`` an fp32 factor on every gradient (clipping), each
    gradient upcast to its parameter's dtype first. ``copies`` (master weights) receive the
    parameters in their own dtype. Same operation order as :func:`_adamw_update`."""
    lr, wd, b1, b2, eps = hp.unbind(0)
    for i, (p, g, m, v, t) in enumerate(zip(ps, grads, ms, vs, steps)):
        g = g.to(p.dtype) * scale.to(p.dtype)
        t_new = t + ok.to(t.dtype)
        # Scalars in float64 (as the host computes them), then rounded once to the state dtype.
        decay = (1 - lr * wd).to(p.dtype)
        neg_step = (-lr / (1 - b1**t_new)).to(p.dtype)
        sqrt_bc2 = torch.sqrt(1 - b2**t_new).to(p.dtype)
        m_new = torch.lerp(m, g, (1 - b1).to(m.dtype))
        v_new = v * b2.to(v.dtype) + g * g * (1 - b2).to(v.dtype)
        p_new = p * decay
        p_new = p_new + m_new / (v_new.sqrt() / sqrt_bc2 + eps.to(p.dtype)) * neg_step
        p.copy_(torch.where(ok, p_new, p))
        m.copy_(torch.where(ok, m_new, m))
        v.copy_(torch.where(ok, v_new, v))
        t.copy_(t_new)
        if copies is not None:
            copies[i].copy_(p)


def param_groups(
    params: Iterable[torch.Tensor],
    weight_decay: float,
    lr_scales: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
    """AdamW groups: matrices (projections, embeddings) decay, gains (norm weights) do not.

    ``lr_scales`` (one per parameter, e.g. muP's width multipliers) splits the groups further;
    a group whose scale is not 1 carries ``lr_scale`` (its lr is the schedule's times that)."""
    params = list(params)
    scales = list(lr_scales) if lr_scales is not None else [1.0] * len(params)
    groups: list[dict[str, Any]] = []
    for decay in (True, False):
        mine = [(p, s) for p, s in zip(params, scales) if (p.ndim >= 2) == decay]
        for scale in sorted({s for _, s in mine}) or ([1.0] if decay else []):
            group = {
                "params": [p for p, s in mine if s == scale],
                "weight_decay": weight_decay if decay else 0.0,
            }
            if scale != 1.0:
                group["lr_scale"] = scale
            groups.append(group)
    return groups


def build_optimizer(
    model: nn.Module | Iterable[torch.Tensor],
    cfg: TrainConfig,
    *,
    adamw: str = "foreach",
    copies: Mapping[torch.Tensor, torch.Tensor] | None = None,
    lr_scales: Sequence[float] | None = None,
) -> AdamW:
    """The run's optimizer: AdamW over ``model``'s trainable parameters (or the given tensors,
    e.g. a sharded strategy's local shards) with ``cfg``'s hyperparameters. ``adamw``: the
    resolved ``FastPath.adamw``; ``copies``: master weights (see :class:`AdamW`); ``lr_scales``:
    per-parameter learning-rate multipliers (muP), since parameter groups are formed only here."""
    if isinstance(model, nn.Module):
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        params = list(model)
    return AdamW(
        param_groups(params, cfg.weight_decay, lr_scales),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        compiled=adamw == "compiled",
        fused=adamw == "triton",
        copies=copies,
    )
