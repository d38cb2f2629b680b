"""One optimizer step, given a loss function and the skip rule: forward/backward, clip, update.

:class:`StepRunner` runs the loop's steps and keeps the skip statistics. The skip rule
(:func:`bad_step_reason`): a NaN/inf loss or gradient norm, or a loss above ``spike_factor ×
running mean`` once 10 good steps are in, skips the update.

The sync-free step (``FastPath.sync_free``) never waits for the device: the skip decision, the
running mean and the update are computed on the device (``AdamW.step_if``), the step's record
travels to pinned host memory behind a CUDA event, and the loop reads it one step later. (A host
sync per step idles the GPU while the host prepares the next step: ~6 ms of a 65 ms GPT-2-small
step on an H200.) With ``FastPath.clip_in_update`` AdamW scales each gradient by the clip factor
as it reads it (one pass less; bf16 gradients are never scaled in place). Otherwise the
synchronous step reads loss and norm once and decides on the host.

``FastPath.cuda_graph``: after three warm-up steps on a side stream the whole step is captured
once as a CUDA graph and replayed, the batch copied into fixed input buffers and the learning
rate into AdamW's device hyperparameters before each replay.
Exercised by ``pytest tests/test_train_e2e.py -k sync_free`` and ``pytest -m gpu
tests/test_train_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmforge.optim.clip import grad_norm_and_clip_coef

if TYPE_CHECKING:
    from lmforge.parallel import Strategy
    from lmforge.train.optim import AdamW

Batch = tuple[torch.Tensor, torch.Tensor]
_GRAPH_WARMUP_STEPS = 3
_SPIKE_MIN_GOOD_STEPS = 10
_EMA = 0.95


def bad_step_reason(
    loss: float, norm: float, spike_factor: float, loss_ema: float | None, good_steps: int
) -> str | None:
    """Why a step with this loss and gradient norm is skipped (None = it is applied)."""
    if not math.isfinite(loss):
        return f"non-finite loss {loss}"
    if not math.isfinite(norm):
        return f"non-finite gradient norm {norm}"
    f = spike_factor
    if (
        f > 0
        and loss_ema is not None
        and good_steps >= _SPIKE_MIN_GOOD_STEPS
        and loss > f * loss_ema
    ):
        return f"loss spike {loss:.4f} > {f} × running mean {loss_ema:.4f}"
    return None


@dataclasses.dataclass
class Pending:
    """A launched step whose loss and norm may still be on their way to the host."""

    iteration: int  # the trainer's iteration after this step
    lr: float
    values: torch.Tensor  # (loss, norm, ok, running mean before, running mean after, good before)
    event: Any = None  # torch.cuda.Event recorded after the copy (CUDA only)
    reason: str | None = None  # the host's skip reason (synchronous steps only)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # the objective's metrics


@dataclasses.dataclass
class _StepGraph:
    """A captured training step: replaying ``graph`` reads ``inputs`` and writes ``values``."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[Batch]  # fixed (x, y) buffers per micro-batch
    values: torch.Tensor  # the step's record, as _gated_update returns it


class StepRunner:
    """Runs steps of ``strategy`` with ``optimizer``; holds the skip statistics. ``sync_free``,
    ``clip_in_update`` and ``cuda_graph`` come from the :class:`~lmforge.train.FastPath`;
    ``sync_free`` may be changed between steps (tests compare both paths on a CPU)."""

    def __init__(
        self,
        strategy: Strategy,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        grad_clip: float,
        spike_factor: float,
        sync_free: bool,
        clip_in_update: bool,
        cuda_graph: bool,
        device: str,
        forward_backward: Callable[[Sequence[Any]], torch.Tensor] | None = None,
    ) -> None:
        self.strategy = strategy
        # objective.forward_backward (weighted micro-batches); None = the strategy's (x, y) path
        self.forward_backward = forward_backward
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.max_norm = grad_clip if grad_clip > 0 else math.inf
        self.spike_factor = spike_factor
        self.sync_free = sync_free
        self.clip_in_update = clip_in_update
        self.cuda_graph = cuda_graph
        self.device = device
        self.loss_ema: float | None = None
        self.good_steps = 0
        self.bad_steps = 0
        self.dev_stats: tuple[torch.Tensor, torch.Tensor] | None = None  # (ema, good) on device
        self.graph: _StepGraph | None = None
        self.graph_off = False  # a capture failed: eager steps from then on
        self._graph_warmups = 0
        self._graph_stream: torch.cuda.Stream | None = None

    # -- launching

    def launch(self, micro: list[Any], iteration: int, lr: float) -> Pending:
        """Launch one step on ``micro`` without waiting for it (``iteration`` = after it)."""
        if self.cuda_graph and self.sync_free and not self.graph_off:
            values, reason = self._graph_step(micro), None
        else:
            values, reason = self._body(micro)
        pending = Pending(iteration, lr, values, reason=reason)
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            pending.values = host.copy_(values, non_blocking=True)
            pending.event = torch.cuda.Event()
            pending.event.record()
        return pending

    def _body(
        self, micro: Sequence[Any], capturing: bool = False
    ) -> tuple[torch.Tensor, str | None]:
        # (record, host skip reason); a CUDA graph captures this: no host reads when sync-free
        if self.forward_backward is not None:
            loss = self.forward_backward(micro)
        else:
            loss = self.strategy.forward_backward(micro, self.loss_fn)
        reason = None
        if self.sync_free:
            scale = None
            if self.clip_in_update:  # replicated gradients: clip inside the update
                params = self.strategy.unwrapped.parameters()
                norm, scale = grad_norm_and_clip_coef(params, self.max_norm)
            else:
                norm = self.strategy.clip_grad_norm(self.max_norm)
            values = self._gated_update(
                loss.float(), norm.float().to(loss.device), scale, refresh=not capturing
            )
        else:
            norm = self.strategy.clip_grad_norm(self.max_norm)
            # The one host sync of a step: loss and norm decide whether the update is applied.
            values = torch.stack([loss.float(), norm.float().to(loss.device)])
            reason = bad_step_reason(
                *values.tolist(), self.spike_factor, self.loss_ema, self.good_steps
            )
            if reason is None:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return values, reason

    def _gated_update(
        self,
        loss: torch.Tensor,
        norm: torch.Tensor,
        grad_scale: torch.Tensor | None = None,
        refresh: bool = True,
    ) -> torch.Tensor:
        """Decide on the device whether the step is good, update only then; return the record
        (loss, norm, ok, mean before, mean after, good steps before) as a device tensor.
        The running statistics are updated in place (a captured graph keeps their addresses)."""
        if self.dev_stats is None:  # from the host mirrors (fresh run or resumed checkpoint)
            ema0 = math.nan if self.loss_ema is None else self.loss_ema
            self.dev_stats = (
                torch.tensor(ema0, dtype=torch.float32, device=loss.device),
                torch.tensor(float(self.good_steps), dtype=torch.float32, device=loss.device),
            )
        ema, good = self.dev_stats
        ok = torch.isfinite(loss) & torch.isfinite(norm)
        f = self.spike_factor
        if f > 0:  # NaN mean (no good step yet) compares False: no spike
            ok = ok & ~((good >= _SPIKE_MIN_GOOD_STEPS) & (loss > f * ema))
        optimizer: AdamW = self.optimizer  # type: ignore[assignment]
        optimizer.step_if(ok, grad_scale=grad_scale, refresh=refresh)
        new_ema = torch.where(
            ok, torch.where(torch.isnan(ema), loss, _EMA * ema + (1 - _EMA) * loss), ema
        )
        record = torch.stack([loss, norm, ok.float(), ema, new_ema, good])
        ema.copy_(new_ema)
        good.add_(ok.float())
        return record

    # -- CUDA graph of the whole step

    def _graph_step(self, micro: list[Batch]) -> torch.Tensor:
        """One step through the captured graph (capturing it first, after the warm-up steps)."""
        g = self.graph
        if g is None:
            stream = self._graph_stream
            if stream is None:
                stream = self._graph_stream = torch.cuda.Stream(device=self.device)
            cur = torch.cuda.current_stream(self.device)
            stream.wait_stream(cur)
            optimizer: AdamW = self.optimizer  # type: ignore[assignment]
            if self._graph_warmups < _GRAPH_WARMUP_STEPS:
                # compilation, autotuning, lazy set-up and optimizer state: outside the capture
                with torch.cuda.stream(stream):
                    values, _ = self._body(micro)
                cur.wait_stream(stream)
                self._graph_warmups += 1
                return values
            static = [(x.clone(), y.clone()) for x, y in micro]
            optimizer.load_hyperparameters()
            cur.synchronize()
            # the graph gets its own memory pool: free the warm-up's cached blocks first
            torch.cuda.empty_cache()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=stream):
                    values, _ = self._body(static, capturing=True)
            except Exception as e:  # e.g. an op that cannot be captured: stay eager
                self.graph_off = True
                self.optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                first = str(e).splitlines()[0] if str(e) else ""
                print(
                    f"lmforge train: CUDA graph capture failed ({type(e).__name__}: {first}); "
                    "continuing without it",
                    file=sys.stderr,
                )
                return self._body(micro)[0]
            g = self.graph = _StepGraph(graph, static, values)
        for (sx, sy), (x, y) in zip(g.inputs, micro):
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
        self.optimizer.load_hyperparameters()  # type: ignore[attr-defined]
        g.graph.replay()
        return g.values

    # -- reading a finished step

    def finish(self, pending: Pending) -> tuple[float, float, str | None]:
        """Wait for a launched step's record and update the host counters (finish steps in launch
        order); (loss, norm, reason)."""
        if pending.event is not None:
            pending.event.synchronize()
        vals = pending.values.tolist()
        loss_v, norm_v = vals[0], vals[1]
        if len(vals) == 2:  # a synchronous step: decided on the host in launch
            reason = pending.reason
            if reason is None:
                self.loss_ema = (
                    loss_v if self.loss_ema is None else _EMA * self.loss_ema + (1 - _EMA) * loss_v
                )
        else:
            ok, ema_before, ema_after, good_before = vals[2:]
            reason = None
            if not ok:  # the device's decision, explained with the same rule
                before = None if math.isnan(ema_before) else ema_before
                reason = (
                    bad_step_reason(loss_v, norm_v, self.spike_factor, before, int(good_before))
                    or "skipped on the device"
                )
            # The device's fp32 mean, exactly: a resume starts the device from this value.
            self.loss_ema = None if math.isnan(ema_after) else ema_after
        if reason is None:
            self.bad_steps = 0
            self.good_steps += 1
        else:
            self.bad_steps += 1
        return loss_v, norm_v, reason

    def restore(self, loss_ema: float | None, good_steps: int, bad_steps: int) -> None:
        """Set the skip statistics (from a checkpoint); the device copy is rebuilt next step."""
        self.loss_ema, self.good_steps, self.bad_steps = loss_ema, good_steps, bad_steps
        self.dev_stats = None
