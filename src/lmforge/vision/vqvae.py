"""A small VQ-VAE (van den Oord et al. 2017) for discrete image tokens, with EMA codebook updates.

Encoder: three stride-2 convolutions (S → S/8) to D-dim vectors; each is replaced by its nearest
of K codebook entries; the decoder (transposed convolutions) reconstructs the image. Gradients
pass the quantiser unchanged (straight-through: ``z + (z_q − z).detach()``); the commitment loss
``β·‖z − sg(z_q)‖²`` keeps encoder outputs near their codes; the codebook itself is not trained
by gradient but moves to the running mean of the vectors assigned to each code (EMA, the
paper's appendix / VQ-VAE-2), and a code unused for a while is restarted at a random encoder
output so the codebook stays in use (the codes start as encoder outputs of the first batch).
The EMA step runs between optimizer steps: a training forward records which vectors went to
which code, and :meth:`EMACodebook.update` (the Trainer callback :class:`CodebookUpdate`)
applies it after the step, so a checkpoint never holds a half-applied update.

Shape legend: B batch, D code dim, K codebook size, h×w code grid (S/8 × S/8), M = B·h·w.
Exercised by ``pytest tests/test_vision_vqvae.py``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class VQConfig:
    """Shape and training constants of the VQ-VAE (``[vq]`` model keys)."""

    channels: int = 64
    "convolution width"
    code_dim: int = 32
    "D: width of a code vector"
    codebook_size: int = 256
    "K: number of codes"
    beta: float = 0.25
    "commitment-loss weight"
    decay: float = 0.99
    "EMA decay of the codebook statistics"
    restart_below: float = 0.03
    "a code whose EMA usage count falls below this is restarted at a random encoder output"


class EMACodebook(nn.Module):
    """Nearest-neighbour quantiser whose codes track the mean of their assigned vectors (EMA)."""

    embed: torch.Tensor
    cluster_size: torch.Tensor
    embed_sum: torch.Tensor

    def __init__(self, k: int, d: int, decay: float = 0.99, restart_below: float = 0.03) -> None:
        super().__init__()
        self.decay, self.restart_below, self.eps = decay, restart_below, 1e-5
        init = torch.randn(k, d) * 0.1
        self.register_buffer("embed", init.clone())
        self.register_buffer("cluster_size", torch.ones(k))
        self.register_buffer("embed_sum", init.clone())
        # 0 until the first training batch, whose encoder outputs seed the codes (a random
        # init far from the data's scale sends every vector to one code: collapse)
        self.register_buffer("initialized", torch.zeros(()))
        # (vectors, codes) of the training forwards since the last update (not in the state:
        # the update runs before any checkpoint is written)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def quantize(self, flat: torch.Tensor) -> torch.Tensor:
        """(M, D) -> (M,) index of the nearest code (squared Euclidean distance)."""
        dist = (
            flat.pow(2).sum(1, keepdim=True)
            - 2 * flat @ self.embed.t()
            + self.embed.pow(2).sum(1)[None]
        )  # (M, K)
        return dist.argmin(1)

    @torch.no_grad()
    def _init_from(self, flat: torch.Tensor) -> None:
        pick = torch.randint(0, flat.shape[0], (self.embed.shape[0],), device=flat.device)
        self.embed.copy_(flat[pick])
        self.embed_sum.copy_(flat[pick])
        self.cluster_size.fill_(1.0)
        self.initialized.fill_(1.0)

    @torch.no_grad()
    def ema_update(self, flat: torch.Tensor, idx: torch.Tensor) -> None:
        """One EMA step of the counts and sums, then codes = sums / Laplace-smoothed counts."""
        k = self.embed.shape[0]
        onehot = F.one_hot(idx, k).type(flat.dtype)  # (M, K)
        self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
        self.embed_sum.mul_(self.decay).add_(onehot.t() @ flat, alpha=1 - self.decay)
        n = self.cluster_size.sum()
        smoothed = (self.cluster_size + self.eps) / (n + k * self.eps) * n  # (K,)
        self.embed.copy_(self.embed_sum / smoothed[:, None])
        dead = self.cluster_size < self.restart_below
        if dead.any():
            pick = torch.randint(0, flat.shape[0], (int(dead.sum()),), device=flat.device)
            self.embed[dead] = flat[pick]
            self.embed_sum[dead] = flat[pick]
            self.cluster_size[dead] = 1.0

    def forward(
        self, z: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """z (B, D, h, w) -> (straight-through z_q (B, D, h, w), codes (B, h, w), commitment
        MSE, perplexity of this batch's code usage). In training mode records the assignment
        for :meth:`update`."""
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)  # (M, D)
        if self.training and not self.initialized:
            self._init_from(flat.detach().float())
        idx = self.quantize(flat.detach())  # (M,)
        # the codes as they were when chosen (indexing copies), then the EMA step moves them
        zq = self.embed[idx].view(b, h, w, d).permute(0, 3, 1, 2)  # (B, D, h, w)
        if self.training:
            self.pending.append((flat.detach().float(), idx))
        commit = F.mse_loss(z, zq.detach())
        usage = torch.bincount(idx, minlength=self.embed.shape[0]).float() / idx.numel()  # (K,)
        perplexity = torch.exp(-(usage * torch.log(usage + 1e-10)).sum())
        return z + (zq - z).detach(), idx.view(b, h, w), commit, perplexity

    def update(self, apply: bool = True) -> None:
        """One EMA step over every vector recorded since the last call (all micro-batches of
        the optimizer step); ``apply=False`` drops them (a skipped step)."""
        pending, self.pending = self.pending, []
        if apply and pending:
            self.ema_update(torch.cat([f for f, _ in pending]), torch.cat([i for _, i in pending]))

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, h, w) code ids -> (B, D, h, w) code vectors."""
        return self.embed[codes].permute(0, 3, 1, 2)


def _conv_stack(cin: int, cout: int, c: int, up: bool) -> nn.Sequential:
    conv = nn.ConvTranspose2d if up else nn.Conv2d
    layers: list[nn.Module] = [] if up else [conv(cin, c, 4, 2, 1), nn.ReLU()]
    if up:
        layers += [nn.Conv2d(cin, c, 3, 1, 1), nn.ReLU()]
    layers += [conv(c, c, 4, 2, 1), nn.ReLU(), conv(c, c, 4, 2, 1), nn.ReLU()]
    if up:
        layers += [conv(c, cout, 4, 2, 1)]
    else:
        layers += [nn.Conv2d(c, cout, 1)]
    return nn.Sequential(*layers)


class VQVAE(nn.Module):
    """Conv encoder (S → S/8) → EMA codebook → transposed-conv decoder (S/8 → S)."""

    def __init__(self, config: VQConfig) -> None:
        super().__init__()
        self.config = config
        c, d = config.channels, config.code_dim
        self.encoder = _conv_stack(3, d, c, up=False)
        self.codebook = EMACodebook(config.codebook_size, d, config.decay, config.restart_below)
        self.decoder = _conv_stack(d, 3, c, up=True)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, 3, S, S) normalised pixels -> recon (B, 3, S, S), codes (B, S/8, S/8), losses."""
        zq, codes, commit, perplexity = self.codebook(self.encoder(images))
        recon = self.decoder(zq)
        mse = F.mse_loss(recon, images)
        loss = mse + self.config.beta * commit
        return {"recon": recon, "codes": codes, "loss": loss, "mse": mse, "perplexity": perplexity}

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> (B, S/8, S/8) code ids."""
        z = self.encoder(images)
        b, d, h, w = z.shape
        return self.codebook.quantize(z.permute(0, 2, 3, 1).reshape(-1, d)).view(b, h, w)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, h, w) code ids -> (B, 3, 8h, 8w) normalised pixels."""
        return self.decoder(self.codebook.lookup(codes))


class CodebookUpdate:
    """Trainer callback (``cb(trainer, step, metrics)``): the EMA codebook step of ``vq`` after
    each optimizer step, dropped when the step was skipped. Runs on every rank (each updates
    its own copy from its own batches)."""

    all_ranks = True

    def __init__(self, vq: VQVAE) -> None:
        self.vq = vq

    def __call__(self, trainer: object, step: int, metrics: dict) -> None:
        """Apply (or drop) the step's recorded assignments."""
        self.vq.codebook.update(apply=not metrics.get("skipped", False))
