"""Multi-token prediction (DeepSeek-V3 §2.2): D sequential modules predicting t+2, t+3, …

Module k (1-based) at position i combines the previous depth's representation h^{k-1}_i (depth
0: the main model's last hidden state) with the embedding of token t_{i+k}, and predicts
t_{i+k+1}:

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})) ; RMSNorm(h^{k-1}_i)]      (2D -> D, ``proj``)
    h^k_{0..T-k-1} = TRM_k(h'^k_{0..T-k-1})                         (one causal block)
    P^k_{i+k+1} = OutHead(RMSNorm(h^k_i))                           (the main model's head)

The embedding and the output head are the main model's, passed in as callables (shared, as in
the paper); each module owns its two input norms, its projection, its block (built by a factory,
so it is lmforge's :class:`~lmforge.model.TransformerBlock` or any ``block(x, positions)``) and
its output norm. The concatenation order is [embedding ; hidden], the order of DeepSeek-V3's
released weights (``eh_proj``; the paper writes the two the other way round, which is the same
model with the projection's columns swapped), so :mod:`lmforge.hf` maps them without a permute.

Loss: ``L_MTP = λ / D · Σ_k CE(P^k, t_{·+k+1})`` (:func:`mtp_loss`), added to the main loss;
gradients reach the main model through h^0 and the shared embedding/head.

Drafting (:func:`mtp_draft`, :class:`MTPDraft`): after the main model's forward over n tokens
(hidden states h^0_{0..n-1}) and its sampled next token t_n, depth j's output at position n−1
predicts t_{n+j}: the drafter runs the modules in order, feeding each greedy draft as the next
depth's input token. Simplification: each draft step recomputes its module over all n
positions (no per-module KV cache), the readable reference an engine proposer with its own
cache is to be tested against; beyond D drafts the last module is applied again to its own
output (as vLLM runs DeepSeek-V3's single MTP module for k > 1).

Shape legend: B batch, T/n sequence, D model dim, V vocab; k depth.
In the model: ``ModelConfig.mtp_depth`` > 0 builds them as ``TransformerLM.mtp``; the LM loss
(``lmforge.train.loss``) adds :func:`mtp_loss`; the engine drafts with :class:`MTPDraft`.
Exercised by ``pytest tests/test_mtp.py tests/test_mtp_train.py tests/test_mtp_serve.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.layers import Linear, RMSNorm
from lmforge.utils.errors import LmforgeError

__all__ = ["MTPDraft", "MTPModule", "MultiTokenPrediction", "mtp_draft", "mtp_loss"]

Block = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MTPModule(nn.Module):
    """One MTP depth: input norms, the (2D -> D) projection, a block, the output norm."""

    def __init__(self, d_model: int, block: nn.Module, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.enorm = RMSNorm(d_model, norm_eps)
        self.hnorm = RMSNorm(d_model, norm_eps)
        self.proj = Linear(2 * d_model, d_model)
        self.block = block
        self.norm_out = RMSNorm(d_model, norm_eps)

    def forward(
        self, h_prev: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """h^{k-1} (B, T, D) and Emb(t_{i+k}) (B, T, D) at ``positions`` (T,) -> h^k (B, T, D)
        (before ``norm_out``)."""
        x = self.proj(torch.cat([self.enorm(emb), self.hnorm(h_prev)], dim=-1))  # (B, T, D)
        return self.block(x, positions)  # (B, T, D)


class MultiTokenPrediction(nn.Module):
    """D sequential MTP modules; ``block_factory(k)`` builds depth k's block (k = 0..D-1)."""

    def __init__(
        self,
        d_model: int,
        depth: int,
        block_factory: Callable[[int], nn.Module],
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        if not isinstance(depth, int) or depth < 1:
            raise LmforgeError(f"MTP depth must be an integer >= 1, got {depth!r}")
        self.depth = depth
        self.layers = nn.ModuleList(
            MTPModule(d_model, block_factory(k), norm_eps) for k in range(depth)
        )

    def hidden_states(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """The main model's hidden states (B, T, D) over input ``tokens`` (B, T) -> each depth
        k = 1..D's output-head input ``norm_out(h^k)``, (B, T-k, D): row i predicts t_{i+k+1}
        (the labels ``y[:, k:]`` when y is ``tokens`` shifted by one). Depths with T-k < 1 are
        left out."""
        t = tokens.shape[1]
        out: list[torch.Tensor] = []
        h = hidden
        for k, module in enumerate(self.layers, start=1):
            n = t - k
            if n < 1:
                break
            positions = torch.arange(n, device=hidden.device)  # (T-k,)
            h = module(h[:, :n], embed(tokens[:, k:]), positions)  # (B, T-k, D)
            out.append(module.norm_out(h))  # (B, T-k, D)
        return out

    def forward(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """Logits of each depth, (B, T-k, V): ``head`` of :meth:`hidden_states`."""
        return [head(h) for h in self.hidden_states(hidden, tokens, embed)]


def mtp_loss(
    mtp: MultiTokenPrediction,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
    weight: float,
    ignore_index: int = -100,
    ce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(λ / D · Σ_k CE_k, [CE_1, …, CE_D])`` for inputs ``tokens`` (B, T) with next-token
    ``labels`` (B, T) (the main loss's targets; ``ignore_index`` entries skipped) and the main
    model's ``hidden`` (B, T, D). Depth k's row i is scored against ``labels[:, i + k]``; each
    CE_k is a mean over its scored tokens, in fp32.

    ``ce(h (N, D), targets (N,)) -> mean loss`` replaces ``head`` + cross-entropy (the trainer's
    fused linear + cross-entropy kernel, so no (N, V) logits are materialised)."""
    per_depth = []
    for k, h in enumerate(mtp.hidden_states(hidden, tokens, embed), start=1):
        target = labels[:, k:].flatten()  # (B·(T-k),)
        h = h.flatten(0, 1)  # (B·(T-k), D)
        if ce is not None:
            per_depth.append(ce(h, target))
        else:
            logits = head(h).float()  # (B·(T-k), V)
            per_depth.append(F.cross_entropy(logits, target, ignore_index=ignore_index))
    if not per_depth:
        raise LmforgeError(f"MTP needs sequences longer than 1 token, got {tokens.shape[1]}")
    return weight * torch.stack(per_depth).mean(), per_depth


@torch.no_grad()
def mtp_draft(
    mtp: MultiTokenPrediction,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    k: int,
    embed: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """k greedy drafts (B, k) after ``tokens`` (B, n + 1): the main model's hidden states
    (B, n, D) cover ``tokens[:, :n]``, and ``tokens[:, n]`` is the token it just sampled."""
    n = hidden.shape[1]
    if tokens.shape[1] != n + 1:
        raise ValueError(f"mtp_draft: tokens must be one longer than hidden ({n}), got"
                         f" {tokens.shape[1]}")  # fmt: skip
    positions = torch.arange(n, device=hidden.device)  # (n,)
    seq, h, drafts = tokens, hidden, []
    for j in range(1, k + 1):
        module = mtp.layers[min(j, mtp.depth) - 1]
        h = module(h, embed(seq[:, j : j + n]), positions)  # (B, n, D)
        nxt = head(module.norm_out(h[:, -1])).argmax(-1)  # (B,)
        drafts.append(nxt)
        seq = torch.cat([seq, nxt[:, None]], dim=1)  # (B, n+1+j)
    return torch.stack(drafts, dim=1)  # (B, k)


class MTPDraft:
    """A speculative-decoding proposer from the target's own MTP modules (greedy drafts).

    Like :class:`lmforge.serve.speculative.NgramDraft`, ``propose`` returns up to k token ids
    whose draft distribution is one-hot (so exact rejection sampling accepts draft x with
    probability p(x)); unlike it, it needs the target's hidden states of the sequence, which
    the engine's forwards produce (``lmforge.serve.speculative``, ``--speculative mtp``).
    """

    def __init__(
        self,
        mtp: MultiTokenPrediction,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.mtp, self.embed, self.head = mtp, embed, head

    def propose(self, hidden: torch.Tensor, tokens: Sequence[int], k: int) -> list[int]:
        """k drafts after ``tokens`` (n + 1 ids) given the target's hidden states (n, D) of
        ``tokens[:n]``."""
        if k < 1:
            return []
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=hidden.device)  # (1, n+1)
        return mtp_draft(self.mtp, hidden[None], ids, k, self.embed, self.head)[0].tolist()
