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
depth's input token. :func:`mtp_draft` recomputes each draft step over all n positions: the
readable reference. :class:`MTPDraft` with a per-sequence ``key`` (the engine's proposer) keeps
one contiguous KV cache and one output buffer per draft step instead: step j's positions
i <= n - j read only committed tokens, so they are final and reused by the next proposal, and
each proposal computes only the positions after them (the newly committed ones and the j - 1
that read drafts), O(accepted + k) rows per step instead of O(n); tested draft-for-draft
against the reference. Beyond D drafts the last module is applied again to its own output (as
vLLM runs DeepSeek-V3's single MTP module for k > 1).

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

from lmforge.model.kv_cache import KVCache
from lmforge.model.layers import Linear, RMSNorm
from lmforge.utils.errors import LmforgeError

__all__ = ["MTPDraft", "MTPModule", "MultiTokenPrediction", "mtp_draft", "mtp_loss", "step_cache"]

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


def step_cache(model: nn.Module, slots: int) -> KVCache:
    """One MTP draft step's cache for ``model`` (a TransformerLM): its KV layout (GQA or MLA
    latents), one layer, ``slots`` positions."""
    return _StepCache.for_model(model, 1, slots, n_layers=1)


class _StepCache(KVCache):
    """A contiguous cache for one draft step's block, whatever its layer index (the MTP block
    is numbered after the main layers), that can be cut back to the step's final positions."""

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return super().update(0, k, v)

    def truncate(self, n: int) -> None:
        """Keep slots [0, n) (batch 1, every slot real)."""
        self.length = n
        self.next_position.fill_(n)


class MTPDraft:
    """A speculative-decoding proposer from the target's own MTP modules (greedy drafts).

    Like :class:`lmforge.serve.speculative.NgramDraft`, ``propose`` returns up to k token ids
    whose draft distribution is one-hot (so exact rejection sampling accepts draft x with
    probability p(x)); unlike it, it needs the target's hidden states of the sequence, which
    the engine's forwards produce (``lmforge.serve.speculative``, ``--speculative mtp``).

    With ``new_cache`` (makes one draft step's cache: :func:`step_cache`, which
    :func:`lmforge.serve.speculative.mtp_draft_for` passes) and a ``key`` per call naming the
    sequence, each draft step keeps its KV cache and outputs across proposals of that sequence
    (module docstring); without either, every call is :func:`mtp_draft`.
    """

    def __init__(
        self,
        mtp: MultiTokenPrediction,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
        new_cache: Callable[[], KVCache] | None = None,
    ) -> None:
        self.mtp, self.embed, self.head = mtp, embed, head
        self.new_cache = new_cache
        self._key: object = None
        self._steps: list[tuple[_StepCache, torch.Tensor]] = []  # per step: cache, (S, D) outputs
        self._final: list[int] = []  # per step: leading positions computed from committed tokens
        self.rows_computed = 0
        "draft-step rows run so far (the cost the cache saves: n per step without it)"

    def propose(
        self, hidden: torch.Tensor, tokens: Sequence[int], k: int, key: object = None
    ) -> list[int]:
        """k drafts after ``tokens`` (n + 1 ids) given the target's hidden states (n, D) of
        ``tokens[:n]``; ``key`` (any object naming the sequence) turns on the step caches."""
        if k < 1:
            return []
        if key is None or self.new_cache is None:
            n = hidden.shape[0]
            self.rows_computed += k * n
            ids = torch.tensor([list(tokens)], dtype=torch.long, device=hidden.device)
            return mtp_draft(self.mtp, hidden[None], ids, k, self.embed, self.head)[0].tolist()
        return self._propose_cached(hidden, list(tokens), k, key)

    @torch.no_grad()
    def _propose_cached(
        self, hidden: torch.Tensor, seq: list[int], k: int, key: object
    ) -> list[int]:
        n = hidden.shape[0]
        if len(seq) != n + 1:
            raise ValueError(f"MTPDraft: tokens must be one longer than hidden ({n}), got"
                             f" {len(seq)}")  # fmt: skip
        if key is not self._key:
            self._key, self._final = key, [0] * len(self._final)
        while len(self._steps) < k:  # the step caches, made on first use
            cache = self.new_cache()  # type: ignore[misc]
            self._steps.append((cache, hidden.new_zeros(cache.max_seq_len, hidden.shape[1])))
            self._final.append(0)
        if n + k > self._steps[0][0].max_seq_len:  # longer than the caches: the reference
            return self.propose(hidden, seq, k)
        prev, drafts = hidden, []  # prev: step j - 1's outputs at positions [0, n)
        for j in range(1, k + 1):
            module = self.mtp.layers[min(j, self.mtp.depth) - 1]
            cache, out = self._steps[j - 1]
            s = min(self._final[j - 1], n)
            ids = torch.tensor([seq[s + j : n + j]], dtype=torch.long, device=hidden.device)
            x = module.proj(torch.cat([module.enorm(self.embed(ids)),
                                       module.hnorm(prev[None, s:n])], dim=-1))  # fmt: skip
            cache.truncate(s)
            positions, _ = cache.begin(n - s)  # (1, n - s)
            out[s:n] = module.block(x, positions, kv_cache=cache)[0]  # (n - s, D)
            self.rows_computed += n - s
            self._final[j - 1] = max(n - j + 1, 0)
            nxt = int(self.head(module.norm_out(out[n - 1])).argmax(-1))
            drafts.append(nxt)
            seq.append(nxt)
            prev = out
        return drafts
