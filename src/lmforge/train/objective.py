"""What the Trainer trains: an objective is a batch source plus a loss, with optional hooks.

Every training phase (pretraining's :class:`LMObjective`, the :mod:`lmforge.posttrain` ones) is
an :class:`Objective` of the one :class:`~lmforge.train.Trainer` loop, so all of them share the
fast AdamW, schedules, clipping, accumulation, parallel wrapping, metrics and exact resume.

The contract (members marked optional are looked up with ``getattr``):

* ``name``: shown in logs.
* ``next_batch()``: the next micro-batch; the objective owns its data order.
* ``loss(model, batch) -> (loss_sum, weight)``: the *sum* of the per-unit losses of the
  micro-batch and how many units (tokens, pairs, sequences) it holds. A step minimises
  Σ loss_sum / Σ weight over its micro-batches, so the gradient is the whole batch's however
  it is split (a mean of micro-batch means would over-weight small micro-batches).
* ``state_dict()`` / ``load_state_dict(state)``: data position and RNG streams, for exact
  resume (``objective.pt``, read back with ``torch.load(weights_only=True)``: tensors, numbers,
  strings and containers only).
* optional ``before_step(trainer, step)``: runs before each step's batches are drawn (rollouts).
* optional ``metrics() -> dict[str, float]``: logged with the step's ``train`` record.
* optional ``evaluate(model) -> dict[str, float]``: at ``train.eval_every`` and at the end.
* optional ``batch_weight(batch) -> float``: the weight ``loss`` will return, known without a
  forward; then each backward runs right after its forward with its final scale and frees its
  graph (otherwise all micro-batch graphs are kept until the total weight is known).
* optional ``should_stop``: read after each step (e.g. an RL target reached): the run ends
  there with its final evaluation and checkpoint.
* optional ``micro_batches() -> int``: micro-batches of the next step (default
  ``train.grad_accum``), for objectives whose batch size varies (RL with dynamic sampling).

Exercised by ``pytest tests/test_posttrain_core.py -k accumulation``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from lmforge.parallel import Strategy


@runtime_checkable
class Objective(Protocol):
    """A batch source plus ``loss(model, batch) -> (loss_sum, weight)`` (module docstring)."""

    name: str

    def next_batch(self) -> Any:
        """The next micro-batch."""
        ...

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss_sum, weight) of one micro-batch."""
        ...

    def state_dict(self) -> dict:
        """Data position and RNG streams."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


class LMObjective:
    """Pretraining: next-token loss on windows of token shards (``sampler``: the trainer's
    :class:`~lmforge.train.data.MixtureSampler`, ``loss_fn(model, x, y)``: its mean next-token
    loss). Every micro-batch has the same number of tokens, so ``loss`` returns the micro-batch
    mean with weight 1 and the trainer keeps its (x, y) fast paths (CUDA graph, pipelining)."""

    name = "lm"

    def __init__(
        self,
        sampler: Any,
        batch_size: int,
        device: str,
        loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.device = device
        self.loss_fn = loss_fn

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (B, T) on the device."""
        return self.sampler.next_batch(self.batch_size, self.device)

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss of the micro-batch, 1)."""
        x, y = batch
        loss = self.loss_fn(model, x, y)
        return loss, torch.ones((), device=loss.device)

    def batch_weight(self, batch: Any) -> float:
        """Every micro-batch weighs the same."""
        return 1.0

    def state_dict(self) -> dict:
        """The sampler's position (the trainer also saves it per data-parallel rank)."""
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])


def forward_backward(
    strategy: Strategy, micro: Sequence[Any], objective: Any
) -> tuple[torch.Tensor, float]:
    """Forward and backward of one step's micro-batches under ``objective``: gradients of
    Σ loss_sum / Σ weight (see ``batch_weight`` in the module docstring); returns (that loss,
    detached and averaged over the data-parallel group, and Σ weight)."""
    model = strategy.model
    weigh = getattr(objective, "batch_weight", None)
    n = len(micro)
    total: float | None = None
    if weigh is not None:
        total = float(sum(float(weigh(b)) for b in micro))
    loss_total: torch.Tensor | None = None
    weight_total = 0.0
    pending: list[torch.Tensor] = []
    for i, batch in enumerate(micro):
        ctx = strategy.no_sync() if i < n - 1 else contextlib.nullcontext()
        with ctx:
            loss_sum, weight = objective.loss(model, batch)
            weight_total += float(weight)
            if total is not None:
                if total > 0:
                    (loss_sum / total).backward()
            elif i < n - 1:
                pending.append(loss_sum)
            else:
                # the kept graphs go backward in the synchronising context (DDP reduces once)
                pending.append(loss_sum)
                if weight_total > 0:
                    torch.autograd.backward([ls / weight_total for ls in pending])
        d = loss_sum.detach().float()
        loss_total = d if loss_total is None else loss_total + d
    strategy.finish_gradient_synchronization()
    assert loss_total is not None
    mean = loss_total / max(weight_total, 1e-12)
    return strategy.reduce_mean(mean), weight_total
