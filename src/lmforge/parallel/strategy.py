"""The contract between the trainer and a parallelism strategy, and the single-device strategy.

The trainer never knows how the model is distributed. It builds the single-device model, hands it
to a :class:`Strategy` (chosen from ``cfg.parallel`` by :func:`lmforge.parallel.build_strategy`)
and then only calls the methods below. The single-device strategy is the reference that every
sharded strategy must reproduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""(model, x, y) -> scalar loss for one micro-batch."""

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Strategy:
    """How one optimizer step's forward and backward run; the single-device reference.

    Subclasses override what they distribute. ``model`` is the module to call (possibly wrapped);
    ``unwrapped`` is the plain single-device model whose parameter names checkpoints use.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.unwrapped = model

    @property
    def rank(self) -> int:
        """Global rank (0 for single device)."""
        return 0

    @property
    def world_size(self) -> int:
        """Number of processes (1 for single device)."""
        return 1

    @property
    def is_main(self) -> bool:
        """True on the process that logs and writes checkpoints."""
        return self.rank == 0

    def make_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """Build the optimizer over this process's trainable parameters."""
        return factory([p for p in self.model.parameters() if p.requires_grad])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context in which backward does not synchronise gradients (accumulation)."""
        yield

    def finish_gradient_synchronization(self) -> None:
        """Block until every gradient of this step is reduced; call before clipping/stepping."""

    def forward_backward(
        self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn
    ) -> torch.Tensor:
        """Run forward and backward over the micro-batches of one step; return the mean loss.

        Gradients accumulate as the mean over micro-batches. The returned loss is detached and,
        in distributed strategies, averaged over the data-parallel group.
        """
        n = len(micro_batches)
        total = torch.zeros((), device=micro_batches[0][0].device)
        for i, (x, y) in enumerate(micro_batches):
            ctx = self.no_sync() if i < n - 1 else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(self.model, x, y)
                (loss / n).backward()
            total += loss.detach().float()
        self.finish_gradient_synchronization()
        return self.reduce_mean(total / n)

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a scalar tensor over the data-parallel group (identity on one device)."""
        return value

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip gradients to a global L2 norm of ``max_norm``; return the norm before clipping."""
        from lmforge.optim.clip import clip_grad_norm

        return clip_grad_norm(self.model.parameters(), max_norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) model state keyed by the single-device model's parameter names."""
        return self.unwrapped.state_dict()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full model state produced by :meth:`full_state_dict`."""
        self.unwrapped.load_state_dict(state)

    def barrier(self) -> None:
        """Wait for every process (no-op on one device)."""
