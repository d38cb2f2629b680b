"""Pipeline parallelism: the model cut into stages, micro-batches, GPipe and 1F1B schedules.

Stage s of p holds ``n_layers / p`` consecutive blocks; stage 0 also the token embeddings, the
last stage also the final norm and the LM head (and computes the loss). Activations (B, T, D)
flow forward by point-to-point sends, their gradients flow back.

* GPipe: all m forwards, then all m backwards. Every stage stores m micro-batches' activations.
* 1F1B: stage s runs ``p − s − 1`` warm-up forwards, then alternates one forward and one
  backward, then drains. Same bubble, but at most ``p − s`` micro-batches in flight.

Either way each stage idles while the pipeline fills and drains: the bubble is ``(p − 1)`` slots
against ``m`` slots of work, i.e. idle/busy ≈ (p − 1)/m. :class:`PipelineRunner` measures it per
step (``last_bubble``) so it can be reported beside the formula.

Simultaneous send+receive with the same neighbour go through one ``batch_isend_irecv`` (as in
Megatron-LM), which avoids the deadlock two blocking sends would cause on NCCL.

Simplifications: layers split evenly (n_layers divisible by p); tied embeddings are refused
(the shared matrix would live on two stages); the loss function receives the last stage as the
"model" and the stage input as "x", so it must compute ``model(x)`` (the trainer's reference
loss path does; a fused LM-head loss that reaches into ``model.lm_head`` does not).

Exercise: ``pytest tests/test_parallel_tp_pp.py -k pp``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lmforge.utils.errors import LmforgeError


class PipelineStage(nn.Module):
    """Stage ``stage`` of ``n_stages`` of a :class:`~lmforge.model.TransformerLM`."""

    def __init__(self, model: nn.Module, stage: int, n_stages: int) -> None:
        super().__init__()
        n_layers = len(model.layers)
        if n_layers % n_stages:
            raise LmforgeError(
                f"parallel.pp={n_stages} stages do not divide model.n_layers={n_layers} evenly"
            )
        if getattr(getattr(model, "config", None), "tie_embeddings", False) and n_stages > 1:
            raise LmforgeError("pipeline parallelism needs model.tie_embeddings=false")
        per = n_layers // n_stages
        self.stage, self.n_stages = stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.layers = nn.ModuleList(model.layers[stage * per : (stage + 1) * per])
        self.token_embeddings = model.token_embeddings if self.is_first else None
        self.ln_final = model.ln_final if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self._logits = model.logits_from_hidden if self.is_last else None
        self._residual = getattr(model, "residual_stream", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on stage 0, else activations (B, T, D) -> (B, T, D) or logits."""
        h = self.token_embeddings(x) if self.token_embeddings is not None else x  # (B, T, D)
        if self._residual is not None:  # received activations travel as fp32
            h = self._residual(h)
        for layer in self.layers:
            h = layer(h, None)  # (B, T, D)
        if self.is_last:
            return self._logits(self.ln_final(h))  # (B, T, V)
        return h


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineRunner:
    """Runs one step's micro-batches through this rank's stage with a GPipe or 1F1B schedule."""

    def __init__(
        self,
        stage: PipelineStage,
        ranks: Sequence[int],
        group: dist.ProcessGroup | None,
        d_model: int,
        schedule: str = "1f1b",
        module: nn.Module | None = None,
    ) -> None:
        if schedule not in ("gpipe", "1f1b"):
            raise LmforgeError(f"parallel.schedule must be 'gpipe' or '1f1b', got '{schedule}'")
        self.stage = stage
        self.module = module if module is not None else stage  # e.g. a DDP wrapper of the stage
        self.ranks = list(ranks)
        self.group = group
        self.d_model = d_model
        self.schedule = schedule
        s = stage.stage
        self.prev = self.ranks[s - 1] if s > 0 else None
        self.next = self.ranks[s + 1] if s + 1 < len(self.ranks) else None
        self.last_bubble: dict[str, float] = {}
        self._sends: list[dist.Work] = []

    # -- point-to-point -----------------------------------------------------------------------
    def _p2p(self, ops: list[tuple[str, torch.Tensor, int]]) -> None:
        if not ops:
            return
        p2p = [
            dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, self.group)
            for kind, t, peer in ops
        ]
        works = dist.batch_isend_irecv(p2p)
        for (kind, _, _), w in zip(ops, works):
            if kind == "send":
                self._sends.append(w)
            else:
                w.wait()

    def _buf(self) -> torch.Tensor:
        return torch.empty(self._shape, dtype=torch.float32, device=self._device)

    # -- one step -----------------------------------------------------------------------------
    def run(
        self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn
    ) -> torch.Tensor:
        """Forward and backward over all micro-batches; return the mean loss (every stage)."""
        m = len(micro_batches)
        x0 = micro_batches[0][0]
        self._shape = (*x0.shape, self.d_model)  # (B, T, D)
        self._device = x0.device
        param = next(self.stage.parameters())
        self._act_dtype = param.dtype
        p, s = self.stage.n_stages, self.stage.stage
        total = torch.zeros((), dtype=torch.float32, device=x0.device)
        busy = 0.0
        inputs: collections.deque = collections.deque()
        outputs: collections.deque = collections.deque()
        t_start = time.perf_counter()

        def forward(i: int, recv: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
            nonlocal busy, total
            t = time.perf_counter()
            x, y = micro_batches[i]
            inp = None
            if recv is not None:
                inp = recv.to(self._act_dtype).requires_grad_(True)
            if self.stage.is_last:
                loss = loss_fn(self.module, inp if inp is not None else x, y)
                total += loss.detach().float()
                out = loss / m
            else:
                out = self.module(inp if inp is not None else x)  # (B, T, D)
            busy += time.perf_counter() - t
            return inp, out

        def backward(inp: torch.Tensor | None, out: torch.Tensor, grad: torch.Tensor | None):
            nonlocal busy
            t = time.perf_counter()
            if grad is None:
                out.backward()
            else:
                torch.autograd.backward(out, grad.to(out.dtype))
            busy += time.perf_counter() - t
            return None if inp is None else inp.grad.float()

        def recv_forward() -> torch.Tensor | None:
            if self.prev is None:
                return None
            buf = self._buf()
            self._p2p([("recv", buf, self.prev)])
            return buf

        def send_forward(out: torch.Tensor) -> None:
            if self.next is not None:
                self._p2p([("send", out.detach().float().contiguous(), self.next)])

        def recv_backward() -> torch.Tensor | None:
            if self.next is None:
                return None
            buf = self._buf()
            self._p2p([("recv", buf, self.next)])
            return buf

        def send_backward(g: torch.Tensor | None) -> None:
            if self.prev is not None and g is not None:
                self._p2p([("send", g.contiguous(), self.prev)])

        def send_forward_recv_backward(out: torch.Tensor) -> torch.Tensor | None:
            if self.next is None:
                return None
            buf = self._buf()
            self._p2p(
                [("send", out.detach().float().contiguous(), self.next), ("recv", buf, self.next)]
            )
            return buf

        def send_backward_recv_forward(g: torch.Tensor | None) -> torch.Tensor | None:
            if self.prev is None:
                return None
            buf = self._buf()
            assert g is not None
            self._p2p([("send", g.contiguous(), self.prev), ("recv", buf, self.prev)])
            return buf

        if self.schedule == "gpipe":
            for i in range(m):
                inp, out = forward(i, recv_forward())
                send_forward(out)
                inputs.append(inp)
                outputs.append(out)
            for _ in range(m):
                g = recv_backward()
                send_backward(backward(inputs.popleft(), outputs.popleft(), g))
        else:
            warmup = min(p - s - 1, m)
            remaining = m - warmup
            for i in range(warmup):
                inp, out = forward(i, recv_forward())
                send_forward(out)
                inputs.append(inp)
                outputs.append(out)
            recv = recv_forward() if remaining > 0 else None
            for i in range(remaining):
                inp, out = forward(warmup + i, recv)
                g = send_forward_recv_backward(out)
                inputs.append(inp)
                outputs.append(out)
                dx = backward(inputs.popleft(), outputs.popleft(), g)
                if i == remaining - 1:
                    send_backward(dx)
                else:
                    recv = send_backward_recv_forward(dx)
            for _ in range(warmup):
                g = recv_backward()
                send_backward(backward(inputs.popleft(), outputs.popleft(), g))
        for w in self._sends:
            w.wait()
        self._sends.clear()
        wall = time.perf_counter() - t_start
        idle = max(wall - busy, 0.0)
        self.last_bubble = {
            "measured_idle_over_busy": idle / busy if busy > 0 else 0.0,
            "measured_idle_fraction": idle / wall if wall > 0 else 0.0,
            "theory_idle_over_busy": (p - 1) / m,
            "theory_idle_fraction": (p - 1) / (m + p - 1),
        }
        # The last stage knows the loss; every stage returns the same mean.
        mean = total / m
        dist.broadcast(mean, src=self.ranks[-1], group=self.group)
        return mean
