"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): a lightning indexer picks the top-k past tokens
of every query; the attention attends to those only.

Lightning indexer (per layer, its own small heads): from the block's normed input x,
  q^I_{t,j} = x_t W^I_{q,j} (H_I heads of width E_I), one key k^I_s = x_s W^I_k shared by the
  heads, weights w_{t,j} = x_t W^I_w / √H_I; RoPE on q^I and k^I;
  I_{t,s} = Σ_j w_{t,j} · ReLU(q^I_{t,j} · k^I_s / √E_I)           (s ≤ t)
computed in the activation dtype (DeepSeek runs it in FP8; lmforge in fp32/bf16). Each query t
keeps S_t = top-k_s I_{t,s} over s ≤ t (all of them while t < k) and the main attention — the
same GQA/RoPE/QK-norm attention as :class:`~lmforge.model.transformer.CausalSelfAttention` —
is a softmax over S_t only, shared by all heads.

Indexer loss (DeepSeek-V3.2 §2.1): the target p_{t,:} is the main attention's distribution
summed over heads and L1-normalised (detached), and
  L^I = mean_t KL(p_{t,S} ‖ softmax_{s∈S}(I_{t,s}))
with S = S_t in the sparse stage and S = {s ≤ t} in the dense warm-up. The indexer reads
``x.detach()``: its loss trains the indexer only and the LM loss (which cannot reach it through
the top-k) trains the rest. The last training forward's L^I is :meth:`SparseAttention.aux_loss`,
which the Trainer adds to the LM loss for every module that has one — the loss hook.

Warm start from a trained dense model (:func:`add_indexer`): chosen A layers become S layers with
the same weights and a fresh indexer; :func:`set_dsa_stage` ``"dense"`` freezes everything but
the indexers and attends densely (stage 1, the indexer learns the dense attention), then
``"sparse"`` trains the whole model with top-k attention (stage 2).

Paths: ``model.attention = "reference"`` gathers the k selected keys and values per query
(:func:`topk_attention`, memory O(T·k), the readable reference); the other backends run SDPA with
the equivalent (T, T) top-k mask (:func:`topk_mask`). Ties in I go to the earlier key (a
stable sort, :func:`select_topk` / :func:`select_mask`), so every path picks the same keys.

Decoding: an S layer caches its K/V as an A layer does plus its indexer keys k^I (one RoPE'd
E_I-wide key per token): in the reference loop's :class:`~lmforge.model.KVCache`
(``index_k``) and in the engine's pages (``Context.index_cache``, the K/V's blocks and slots,
so a prefix-cache hit serves both). Each new token (decode, a prefill chunk, a speculative
verify) scores all cached keys, keeps its top-k over s ≤ t and attends to those only, which is
the training forward's selection: the logits match it (tests/test_dsa_decode.py).
Simplifications: the selection is per token, not per block of keys; the engine's path is the
readable torch one (:func:`paged_sparse_attention`: a prefill step one sequence at a time, a
decode step's sequences batched on the device only, :func:`paged_sparse_decode`, the selected
keys masked in SDPA, which the engine's compiled step wraps as one in-place custom op and CUDA
graphs capture); no quantized KV cache with S layers.

Shape legend: B batch, T queries, S keys, H heads, K kv heads, E head dim, J indexer heads, k the
top-k. Exercise: ``pytest tests/test_sparse_attention.py tests/test_dsa_decode.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.model import mup
from lmforge.model.attention import CausalSelfAttention, _linear
from lmforge.model.config import ModelConfig
from lmforge.model.context import Context
from lmforge.model.kv_cache import KVCache, paged_kv_layers
from lmforge.model.layers import Linear, RotaryEmbedding
from lmforge.utils.errors import LmforgeError

if TYPE_CHECKING:
    from lmforge.model.transformer import TransformerLM

Stage = Literal["dense", "sparse"]


# ----------------------------------------------------------------------------- the pure math
def indexer_scores(q: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """I_{t,s} = Σ_j w_{t,j} ReLU(q_{t,j} · k_s): q (B, T, J, E_I) (already scaled), k (B, S, E_I),
    w (B, T, J) → (B, T, S). Future keys are not masked here."""
    scores = torch.zeros(*q.shape[:2], k.shape[1], dtype=q.dtype, device=q.device)  # (B, T, S)
    for j in range(q.shape[2]):  # one head at a time: never a (B, T, J, S) tensor
        scores = scores + w[:, :, j, None] * torch.relu(q[:, :, j] @ k.transpose(1, 2))
    return scores


def causal_mask(t: int, device: torch.device | None = None) -> Tensor:
    """(T, T) bool, True where query i may see key j ≤ i."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


def _order(masked: Tensor, kk: int) -> Tensor:
    """The first ``kk`` keys of each row of ``masked`` (…, S) by descending score, ties to the
    earlier key (a stable sort): the full forward, the KV-cache decode and the engine score
    rows of different lengths, and exact ties (ReLU zeros every head's term of I_{t,s}) must
    break the same way in all three."""
    return masked.sort(dim=-1, descending=True, stable=True).indices[..., :kk]


def select_topk(scores: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """The top-k past keys of each query: scores (B, T, T) → (idx (B, T, k'), valid (B, T, k')),
    k' = min(topk, T). Query t has only t + 1 past keys: while t + 1 < k' its extra picks are
    future keys and marked invalid. Ties go to the earlier key."""
    t = scores.shape[-1]
    kk = min(topk, t)
    masked = scores.float().masked_fill(~causal_mask(t, scores.device), float("-inf"))
    idx = _order(masked, kk)  # (B, T, k')
    valid = idx <= torch.arange(t, device=scores.device)[:, None]  # (B, T, k')
    return idx, valid


def select_mask(scores: Tensor, allowed: Tensor, topk: int) -> Tensor:
    """The decode form of :func:`select_topk`: scores (…, T, S) of T queries over S cached keys,
    ``allowed`` (…, T, S) bool the keys each query may see (its past, real tokens) → (…, T, S)
    bool, True at the top-k allowed keys of each query (all of them while it has ≤ k); ties to
    the earlier key, as in training."""
    masked = scores.float().masked_fill(~allowed, float("-inf"))  # (…, T, S)
    idx = _order(masked, min(topk, scores.shape[-1]))  # (…, T, k')
    picked = torch.zeros(masked.shape, dtype=torch.bool, device=masked.device)  # (…, T, S)
    return picked.scatter(-1, idx, True) & allowed


def topk_mask(idx: Tensor, valid: Tensor, t: int) -> Tensor:
    """(B, T, T) bool: True at each query's valid selected keys."""
    mask = torch.zeros(*idx.shape[:2], t, dtype=torch.bool, device=idx.device)  # (B, T, T)
    return mask.scatter(-1, idx, valid)


def topk_attention(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, valid: Tensor) -> Tensor:
    """Softmax attention of each query over its selected keys only, by gathering them.

    q (B, H, T, E), k, v (B, K, S, E) (query head h reads kv head h // (H/K)), idx/valid
    (B, T, k) from :func:`select_topk` → (B, H, T, E). Scale 1/√E, as SDPA's default. Memory
    O(T·k·E) per kv head instead of the T×S score matrix."""
    b, h, t, e = q.shape
    kv, kk = k.shape[1], idx.shape[-1]
    gather = idx.reshape(b, 1, t * kk, 1).expand(b, kv, t * kk, e)  # (B, K, T·k, E)
    ks = k.gather(2, gather).view(b, kv, 1, t, kk, e)  # (B, K, 1, T, k, E)
    vs = v.gather(2, gather).view(b, kv, 1, t, kk, e)
    qg = q.view(b, kv, h // kv, t, 1, e)  # (B, K, H/K, T, 1, E): the heads of one kv group
    scores = (qg * ks).sum(-1) / math.sqrt(e)  # (B, K, H/K, T, k)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # fp32 softmax or wider
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)  # (B, K, H/K, T, k)
    out = (probs[..., None] * vs).sum(-2)  # (B, K, H/K, T, E)
    return out.reshape(b, h, t, e)


def attention_target(q: Tensor, k: Tensor, mask: Tensor) -> Tensor:
    """The indexer's target: the main attention's probabilities summed over heads, L1-normalised
    per query. q (B, H, T, E), k (B, K, S, E), mask broadcastable to (B, T, S) → (B, T, S) fp32."""
    h, kv = q.shape[1], k.shape[1]
    total = torch.zeros(q.shape[0], q.shape[2], k.shape[2], device=q.device)  # (B, T, S)
    for i in range(h):  # head by head: never the (B, H, T, S) probabilities at once
        s = (q[:, i] @ k[:, i // (h // kv)].transpose(1, 2)).float() / math.sqrt(q.shape[-1])
        total = total + s.masked_fill(~mask, float("-inf")).softmax(-1)  # (B, T, S)
    return total / h


def indexer_kl(target: Tensor, scores: Tensor, mask: Tensor) -> Tensor:
    """Mean over queries of KL(target ‖ softmax(scores)), both restricted to ``mask``:
    target (B, T, S) (rows sum to 1 over the mask), scores (B, T, S), mask (B, T, S) bool → ()."""
    logq = scores.float().masked_fill(~mask, float("-inf")).log_softmax(-1)  # (B, T, S)
    logq = logq.masked_fill(~mask, 0.0)  # 0·(−∞) would be NaN where the target is 0
    kl = torch.xlogy(target, target) - target * logq  # (B, T, S)
    return kl.sum(-1).mean()


# -------------------------------------------------------------------------------- the modules
class LightningIndexer(nn.Module):
    """DSA's lightning indexer: J query heads and one shared key of width E_I, per-head weights,
    RoPE; ``forward(x, positions) -> I`` (B, T, T) (future keys unmasked)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads, self.head_dim = config.dsa_index_heads, config.dsa_index_dim
        self.q_proj = Linear(d, self.n_heads * self.head_dim)
        self.k_proj = Linear(d, self.head_dim)
        self.w_proj = Linear(d, self.n_heads)
        self.rope = RotaryEmbedding(config.rope_theta, self.head_dim, config.context_length)

    def project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D), positions (T,) or (B, T) → q (B, T, J, E_I) (RoPE and 1/√E_I applied),
        the keys k^I (B, T, E_I) (RoPE applied: what a cache keeps) and w (B, T, J) (1/√J
        applied)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, J, T, E_I)
        k = self.k_proj(x)[:, None]  # (B, 1, T, E_I)
        pos = positions[:, None] if positions.dim() == 2 else positions  # (B, 1, T) or (T,)
        q = self.rope(q, pos).transpose(1, 2) / math.sqrt(self.head_dim)  # (B, T, J, E_I)
        k = self.rope(k, pos)[:, 0]  # (B, T, E_I)
        w = self.w_proj(x) / math.sqrt(self.n_heads)  # (B, T, J)
        return q, k, w

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, T, D), positions (T,) or (B, T) → I (B, T, T)."""
        return indexer_scores(*self.project(x, positions))


class SparseAttention(CausalSelfAttention):
    """Causal attention over the top-k keys a :class:`LightningIndexer` picks (DSA).

    Called like :class:`CausalSelfAttention`: ``(x (B, T, D), token_positions) -> (B, T, D)``;
    the projections, QK-norm, RoPE and muP scale are the parent's. ``dense_warmup`` (set by
    :func:`set_dsa_stage`) attends to every past key and trains the indexer toward that dense
    attention. While training, each forward leaves the indexer loss in :meth:`aux_loss`.
    """

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        self.topk = config.dsa_topk
        self.indexer = LightningIndexer(config)
        # the engine's pages: K/V among the K/V layers (linear ones have none), indexer keys
        # among the S layers
        self.cache_index = paged_kv_layers(config.layer_types, layer_idx)
        self.index_index = config.layer_types[:layer_idx].count("S")
        self.dense_warmup = False
        self._aux: Tensor | None = None

    def paged(
        self, q: Tensor, k: Tensor, v: Tensor, iq: Tensor, ik: Tensor, iw: Tensor, ctx: Context
    ) -> Tensor:
        """The default of :meth:`lmforge.model.context.StepOps.attend_sparse` for this layer:
        :func:`paged_sparse_attention` (reached through the module, so ``context`` imports no
        attention module)."""
        return paged_sparse_attention(self, q, k, v, iq, ik, iw, ctx)

    def aux_loss(self) -> Tensor | None:
        """The indexer loss L^I of the last training forward (None in eval or without grad)."""
        return self._aux

    def forward(
        self,
        x: Tensor,
        token_positions: Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        context: Context | None = None,
    ) -> Tensor:
        """(B, T, D) -> (B, T, D); ``token_positions`` (T,) or (B, T), default 0..T-1 (with a
        ``kv_cache``, the cache's positions). With a ``kv_cache`` the layer stores its K/V and
        indexer keys there and each new token selects over every cached key; with a paged
        ``context`` (an engine step, B = 1, T = the step's N flat tokens) the same selection
        runs over the engine's pages (:func:`paged_sparse_attention`)."""
        b, t, _ = x.shape
        h, kv, e = self.n_heads, self.n_kv_heads, self.head_dim
        if context is not None:
            token_positions = context.positions
        pos = torch.arange(t, device=x.device) if token_positions is None else token_positions
        q, k, v = self._qkv(x, context)
        q = q.view(b, t, h, e)  # (B, T, H, E)
        k = k.view(b, t, kv, e)  # (B, T, K, E)
        v = v.view(b, t, kv, e).transpose(1, 2)  # (B, K, T, E)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rope_pos = pos[:, None, :] if pos.dim() == 2 else pos  # (B, 1, T) broadcasts over heads
        q = self.rope(q.transpose(1, 2), rope_pos)  # (B, H, T, E)
        k = self.rope(k.transpose(1, 2), rope_pos)  # (B, K, T, E)
        if self.config.mup:
            q = q * mup.q_scale(self.config)
        if context is not None or kv_cache is not None:
            iq, ik, iw = self.indexer.project(x.detach(), pos)  # (B, T, J, E_I), …, (B, T, J)
            if context is not None:  # the step's ops: a compiled step's is one custom op
                out = context.ops.attend_sparse(
                    self, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                    iq[0], ik[0], iw[0], context,
                )  # (N, H, E)  # fmt: skip
                out = out.reshape(b, t, h * e)  # (1, N, H·E)
                return _linear(self.output_proj, out, context)  # (1, N, D)
            k_all, v_all = kv_cache.update(self.layer_idx, k, v)  # (B, K, S', E)
            ik_all = kv_cache.update_index(self.layer_idx, ik)  # (B, S', E_I)
            allowed = kv_cache.mask[:, 0]  # (B, T, S'): past, real keys (a pad query: itself)
            if not self.dense_warmup:
                allowed = select_mask(indexer_scores(iq, ik_all, iw), allowed, self.topk)
            out = self._masked(q, k_all, v_all, allowed[:, None])  # (B, H, T, E)
            out = out.transpose(1, 2).reshape(b, t, h * e)  # (B, T, H·E)
            return self.output_proj(out)  # (B, T, D)
        # The indexer sees a detached input: its loss must not move the main model.
        scores = self.indexer(x.detach(), pos)  # (B, T, T)
        if self.dense_warmup or self.topk >= t:
            # Stage 1, or a context no longer than k (every past key is picked): dense attention.
            mask = causal_mask(t, x.device).expand(b, t, t)  # (B, T, T)
            out = self._causal(q, k, v)  # (B, H, T, E)
        else:
            idx, valid = select_topk(scores.detach(), self.topk)  # (B, T, k) each
            mask = topk_mask(idx, valid, t)  # (B, T, T)
            if self.backend == "reference":
                out = topk_attention(q, k, v, idx, valid)
            else:
                out = self._masked(q, k, v, mask[:, None])  # (B, H, T, E)
        self._aux = None
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                target = attention_target(q.detach(), k.detach(), mask)  # (B, T, T)
            self._aux = indexer_kl(target, scores, mask)
        out = out.transpose(1, 2).reshape(b, t, h * e)  # (B, T, H·E)
        return self.output_proj(out)  # (B, T, D)


def paged_sparse_attention(
    attn: SparseAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    iq: Tensor,
    ik: Tensor,
    iw: Tensor,
    ctx: Context,
) -> Tensor:
    """DSA over an engine step's paged cache (the readable torch path).

    Writes k, v (N, K, E) and the indexer keys ik (N, E_I) at ``ctx.slots`` of the layer's K/V
    pages (``attn.cache_index``) and indexer-key pages (``ctx.index_cache[attn.index_index]``:
    the same blocks and slots, so a block holds both for its tokens). Then, one sequence at a
    time (the context's host lists: an eager step), its n queries score all C cached indexer
    keys (iq (N, J, E_I), iw (N, J), :func:`indexer_scores`), each keeps its top-k over the keys
    at or before its position (:func:`select_mask`; every key in the dense warm-up) and
    attends to those only: q (N, H, E) (RoPE and scales applied) -> (N, H, E). A prefill chunk's
    queries see the earlier chunks' keys through the pages, as a decode step does. A decode
    step (one query per sequence) runs the same math for all sequences at once
    (:func:`_paged_sparse_decode`; 1.7x faster decode than this loop on the CPU at batch 32)."""
    if ctx.index_cache is None:
        raise LmforgeError("sparse-attention (S) layers need the engine's indexer-key pages")
    k_pages, v_pages = ctx.k_cache[attn.cache_index], ctx.v_cache[attn.cache_index]
    i_pages = ctx.index_cache[attn.index_index]  # (NB, BS, E_I)
    if ctx.decode:
        return paged_sparse_decode(
            q, k, v, iq, ik, iw, k_pages, v_pages, i_pages, ctx.slots, ctx.block_tables,
            ctx.ctx_lens, 0 if attn.dense_warmup else attn.topk,
            attn.n_heads != attn.n_kv_heads,
        )  # fmt: skip
    _write_pages(k, v, ik, k_pages, v_pages, i_pages, ctx.slots)
    kv, e, ei = k_pages.shape[-2], k_pages.shape[-1], i_pages.shape[-1]
    ctx_lens = ctx.ctx_lens_list if ctx.ctx_lens_list is not None else ctx.ctx_lens.tolist()
    q_lens = ctx.q_lens if ctx.q_lens is not None else [1] * len(ctx_lens)
    tables = ctx.tables_list if ctx.tables_list is not None else ctx.block_tables.tolist()
    out = torch.empty_like(q)
    row = 0
    for n, total, table in zip(q_lens, ctx_lens, tables, strict=True):
        blocks = torch.as_tensor(table, device=q.device)
        keys = k_pages[blocks].reshape(-1, kv, e)[:total]  # (C, K, E)
        vals = v_pages[blocks].reshape(-1, kv, e)[:total]  # (C, K, E)
        ikeys = i_pages[blocks].reshape(-1, ei)[:total]  # (C, E_I)
        q_pos = torch.arange(total - n, total, device=q.device)[:, None]  # (n, 1)
        allowed = torch.arange(total, device=q.device)[None, :] <= q_pos  # (n, C)
        if not attn.dense_warmup:
            rows = slice(row, row + n)
            scores = indexer_scores(iq[None, rows], ikeys[None].to(iq.dtype), iw[None, rows])
            allowed = select_mask(scores[0], allowed, attn.topk)  # (n, C)
        o = F.scaled_dot_product_attention(
            q[row : row + n].transpose(0, 1)[None].to(keys.dtype),  # (1, H, n, E)
            keys.transpose(0, 1)[None],  # (1, K, C, E)
            vals.transpose(0, 1)[None],
            attn_mask=allowed,
            enable_gqa=attn.n_heads != attn.n_kv_heads,  # Python ints: static under compile
        )  # (1, H, n, E)
        out[row : row + n] = o[0].transpose(0, 1).to(q.dtype)  # (n, H, E)
        row += n
    return out


def _write_pages(
    k: Tensor,
    v: Tensor,
    ik: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    i_pages: Tensor,
    slots: Tensor,
) -> None:
    """k, v (N, K, E) and the indexer keys ik (N, E_I) into one layer's pages at ``slots``."""
    kv, e, ei = k_pages.shape[-2], k_pages.shape[-1], i_pages.shape[-1]
    k_pages.view(-1, kv, e).index_copy_(0, slots, k.to(k_pages.dtype))
    v_pages.view(-1, kv, e).index_copy_(0, slots, v.to(v_pages.dtype))
    i_pages.view(-1, ei).index_copy_(0, slots, ik.to(i_pages.dtype))


def paged_sparse_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    iq: Tensor,
    ik: Tensor,
    iw: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    i_pages: Tensor,
    slots: Tensor,
    block_tables: Tensor,
    ctx_lens: Tensor,
    topk: int,
    gqa: bool,
) -> Tensor:
    """A decode step of one S layer (one query per sequence), all sequences at once and on the
    device only (no host list: a compiled or graph-captured step can run it): write k, v and
    ik at ``slots`` of the layer's pages, gather each sequence's M blocks (S, M·BS, …) with the
    slots at or past its context length masked, as ``paged_decode_reference`` does, keep the
    ``topk`` best keys by indexer score (``topk`` 0: all of them, the dense warm-up) and
    attend. q (S, H, E), k, v (S, K, E), iq (S, J, E_I), ik (S, E_I), iw (S, J) -> (S, H, E)."""
    _write_pages(k, v, ik, k_pages, v_pages, i_pages, slots)
    n_seq, kv, e = q.shape[0], k_pages.shape[-2], k_pages.shape[-1]
    tables = block_tables.long()  # (S, M)
    keys = k_pages[tables].reshape(n_seq, -1, kv, e).transpose(1, 2)  # (S, K, M·BS, E)
    vals = v_pages[tables].reshape(n_seq, -1, kv, e).transpose(1, 2)  # (S, K, M·BS, E)
    cols = torch.arange(keys.shape[2], device=q.device)  # (M·BS,)
    allowed = (cols[None, :] < ctx_lens[:, None])[:, None]  # (S, 1, M·BS)
    if topk:
        ikeys = i_pages[tables].reshape(n_seq, -1, i_pages.shape[-1])  # (S, M·BS, E_I)
        scores = indexer_scores(iq[:, None], ikeys.to(iq.dtype), iw[:, None])  # (S, 1, M·BS)
        allowed = select_mask(scores, allowed, topk)  # (S, 1, M·BS)
    out = F.scaled_dot_product_attention(
        q[:, :, None].to(keys.dtype),  # (S, H, 1, E)
        keys,
        vals,
        attn_mask=allowed[:, None],  # (S, 1, 1, M·BS)
        enable_gqa=gqa,
    )  # (S, H, 1, E)
    return out[:, :, 0].to(q.dtype)


# --------------------------------------------------------------------------------- warm start
def sparse_layers(model: nn.Module) -> list[SparseAttention]:
    """The model's :class:`SparseAttention` modules, in order."""
    return [m for m in model.modules() if isinstance(m, SparseAttention)]


def indexer_loss(model: nn.Module) -> Tensor | None:
    """Σ over S layers of the last training forward's indexer loss (None when there is none)."""
    losses = [a for m in sparse_layers(model) if (a := m.aux_loss()) is not None]
    return torch.stack([a.float() for a in losses]).sum() if losses else None


def set_dsa_stage(model: nn.Module, stage: Stage) -> None:
    """DSA's two training stages. ``"dense"``: every S layer attends densely and only the
    indexers train (the rest frozen); ``"sparse"``: top-k attention and everything trains."""
    if stage not in ("dense", "sparse"):
        raise LmforgeError(f"DSA stage must be dense or sparse, got {stage!r}")
    layers = sparse_layers(model)
    if not layers:
        raise LmforgeError("the model has no sparse-attention (S) layer; see add_indexer")
    indexer = {id(p) for m in layers for p in m.indexer.parameters()}
    for p in model.parameters():
        p.requires_grad_(stage == "sparse" or id(p) in indexer)
    for m in layers:
        m.dense_warmup = stage == "dense"


def add_indexer(
    model: TransformerLM,
    topk: int,
    index_heads: int = 4,
    index_dim: int = 64,
    layers: str | None = None,
    seed: int = 0,
) -> TransformerLM:
    """A copy of a trained dense model whose attention layers become DSA layers (warm start).

    ``layers`` is the new pattern, one letter per block (default: every A becomes S); a block
    may only change from A to S. The copy keeps every trained weight, gets fresh indexers
    (initialised under ``seed``) and starts in the ``"dense"`` stage (:func:`set_dsa_stage`).
    """
    cfg = model.config
    old = "".join(cfg.layer_types)
    new = old.replace("A", "S") if layers is None else layers
    if len(new) != len(old) or any(a != b and (a, b) != ("A", "S") for a, b in zip(old, new)):
        raise LmforgeError(
            f"add_indexer: layers {new!r} must be {old!r} with some A (full attention) turned S"
        )
    try:
        new_cfg = dataclasses.replace(
            cfg, layers=new, dsa_topk=topk, dsa_index_heads=index_heads, dsa_index_dim=index_dim
        )
    except ValueError as err:
        raise LmforgeError(f"add_indexer: {err}") from None
    param = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # the model's own class: this module sits below lmforge.model.transformer
        sparse = type(model)(new_cfg, device=param.device, dtype=param.dtype)
    missing, unexpected = sparse.load_state_dict(model.state_dict(), strict=False)
    if unexpected or any(".indexer." not in name for name in missing):
        raise LmforgeError(f"add_indexer: weights do not match ({unexpected or missing})")
    set_dsa_stage(sparse, "dense")
    return sparse


def attention_flop_fraction(cfg: ModelConfig, seq_len: int) -> float:
    """Attention-core FLOPs (scores, values and the indexer) of the model's S layers over those
    of full attention in their place, at ``seq_len`` (:mod:`lmforge.model.accounting`)."""
    from lmforge.model.accounting import mixer_flops

    n_s = cfg.layer_types.count("S")
    if not n_s:
        raise LmforgeError("the config has no sparse-attention (S) layer")
    core = ("attn_scores", "attn_values", "indexer")
    sparse = sum(mixer_flops(cfg, "S", seq_len).get(c, 0.0) for c in core)
    dense = sum(mixer_flops(cfg, "A", seq_len).get(c, 0.0) for c in core)
    return sparse / dense


__all__ = [
    "LightningIndexer",
    "SparseAttention",
    "add_indexer",
    "attention_flop_fraction",
    "attention_target",
    "indexer_kl",
    "indexer_loss",
    "indexer_scores",
    "paged_sparse_attention",
    "select_mask",
    "select_topk",
    "set_dsa_stage",
    "sparse_layers",
    "topk_attention",
    "topk_mask",
]
