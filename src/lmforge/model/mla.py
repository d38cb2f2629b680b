"""Multi-head latent attention (MLA, DeepSeek-V2/V3) with a latent KV cache.

MLA caches one compressed latent per token instead of per-head keys and values. For input x_t:

    c_t     = RMSNorm(W_DKV x_t)            (C = kv_lora_rank)          the shared latent
    k^R_t   = RoPE(W_KR x_t)                (R = qk_rope_head_dim)      one rope key, all heads
    k_h,t   = [W_UK,h c_t ; k^R_t]          (N = qk_nope_head_dim, + R)
    v_h,t   = W_UV,h c_t                    (Ev = v_head_dim)
    q_h,t   = [q^C_h,t ; RoPE(q^R_h,t)]     from W_Q x_t, or W_UQ RMSNorm(W_DQ x_t) (q_lora_rank)
    o_h,t   = softmax_j(q_h,t · k_h,j / sqrt(N + R)) v_h,j,     y_t = W_O [o_1,t; …; o_H,t]

``W_DKV`` and ``W_KR`` are one projection (``kv_a_proj``, D -> C + R), ``W_UK``/``W_UV`` one
up-projection (``kv_b_proj``, C -> H·(N + Ev), rows per head ``[k_nope (N); v (Ev)]``), as in
DeepSeek's checkpoints. The cache entry of a token is ``[c_t ; k^R_t]`` (C + R values; 576 for
C = 512, R = 64, against 2·H·E for MHA).

Two forms of the same function:

- **explicit** (:meth:`MultiHeadLatentAttention.forward`, training and prefill): up-project every
  cached latent to per-head K and V and run ordinary causal attention (q·k over N + R dims).
- **absorbed** (:meth:`~MultiHeadLatentAttention.decode_absorbed`, decode): since
  ``q^C_h · W_UK,h c_j = (W_UK,hᵀ q^C_h) · c_j`` the query is folded into latent space
  (``q̃_h = [W_UK,hᵀ q^C_h ; q^R_h]``, C + R dims) and scores are taken against the cached
  entries directly; and since ``Σ_j p_j W_UV,h c_j = W_UV,h Σ_j p_j c_j`` the attention output
  stays in latent space (``õ_h = Σ_j p_j c_j``, C dims) until W_UV and W_O are applied. All H
  heads then read the same (C + R)-wide cache row: the paged kernel
  (:func:`lmforge.kernels.mla_decode.mla_decode`) loads each block once for every head.

Softmax scale 1/sqrt(N + R) in both forms. RoPE is lmforge's :class:`RotaryEmbedding`: consecutive
pairs ``(x[2i], x[2i+1])`` rotated, which is DeepSeek's own reference layout (complex pairs) and
transformers' ``rope_interleave=True``; :mod:`lmforge.hf.deepseek` maps either HF flag onto it.
Simplification: no RoPE frequency scaling, so DeepSeek-V3's YaRN (and the ``mscale²`` it folds
into the softmax scale) is not supported here; the HF mapping refuses such configs in one line.

Shape legend (as in :mod:`lmforge.model.layers`): B batch, T queries, S cached tokens, D model
dim, H heads, C kv_lora_rank, R rope dim, N nope dim, Ev v head dim, Q q_lora_rank, NB blocks,
BS block size, L layers.
Exercised by ``pytest tests/test_mla.py``.

In the model
------------
``ModelConfig(attention_type="mla")`` builds this module for every full-attention block
(:class:`lmforge.model.TransformerBlock`); :meth:`MultiHeadLatentAttention.forward` takes the
block's keywords: no cache (training: explicit form), a contiguous
:class:`~lmforge.model.KVCache` (``lmforge.generate``:
:meth:`~MultiHeadLatentAttention.attend_cached`, absorbed form) or an engine step's :class:`~lmforge.model.context.Context`
(:meth:`~MultiHeadLatentAttention.attend_paged`: decode rows through ``ctx.ops.attend_latent``,
prefill chunks through :meth:`~MultiHeadLatentAttention.prefill_paged`). With cross-layer
sharing (``kv_share_every`` > 1, :mod:`lmforge.model.cla`) a consumer layer has no
``kv_a_proj``/``kv_a_norm``: it reads the producing layer's latents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.layers import Linear, RMSNorm, RotaryEmbedding, softmax
from lmforge.model.mla_config import MLAConfig
from lmforge.utils.errors import LmforgeError

if TYPE_CHECKING:
    from lmforge.model.context import Context
    from lmforge.model.kv_cache import KVCache

__all__ = ["MLAConfig", "MultiHeadLatentAttention", "PagedLatentCache"]


class PagedLatentCache:
    """The latents of every MLA layer in fixed-size blocks (the engine's cache for MLA).

    Layout: ``latent`` is (L, NB, BS, C + R); block b of layer l is ``latent[l, b]``, a
    (BS, C + R) tile holding BS consecutive tokens of whichever sequence's block table lists b:
    each row is ``[RMSNorm(c_t) (C) ; RoPE(k^R_t) (R)]``. Slot ``b·BS + i`` is offset i of block
    b, as in :class:`~lmforge.model.context.PagedKVCache`, so the engine's block allocator,
    prefix cache and slot mapping are unchanged. With cross-layer sharing L is the number of
    KV-producing layers (:func:`lmforge.model.cla.kv_cache_layers`).
    """

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        latent_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        shape = (n_layers, num_blocks, block_size, latent_dim)
        self.latent = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @staticmethod
    def bytes_per_block(n_layers: int, block_size: int, latent_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across ``n_layers`` layers."""
        elem = torch.empty((), dtype=dtype).element_size()
        return n_layers * block_size * latent_dim * elem

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        """Store latents (N, C + R) at flat ``slots`` (N,) of layer ``layer``."""
        write_latent(self.latent[layer], slots, latent)


def write_latent(cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
    """Store latents (N, C + R) at flat ``slots`` (N,) of one layer's (NB, BS, C + R) pages."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slots, latent.to(cache.dtype))


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention; see the module docstring for the math.

    Parameters (names follow DeepSeek's checkpoints): ``q_proj`` (D -> H·(N+R)) or ``q_a_proj``
    (D -> Q) + ``q_a_norm`` + ``q_b_proj`` (Q -> H·(N+R)); ``kv_a_proj`` (D -> C+R); ``kv_a_norm``
    (C); ``kv_b_proj`` (C -> H·(N+Ev)); ``output_proj`` (H·Ev -> D). Query rows per head are
    ``[nope (N); rope (R)]``.
    """

    def __init__(
        self,
        config: MLAConfig,
        layer_idx: int = 0,
        *,
        produces_kv: bool = True,
        cache_index: int | None = None,
    ) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.layer_idx = layer_idx
        # CLA: a consumer reads the latents of cache layer ``cache_index`` and writes none.
        self.produces_kv = produces_kv
        self.cache_index = layer_idx if cache_index is None else cache_index
        d, h = config.d_model, config.n_heads
        c, r = config.kv_lora_rank, config.qk_rope_head_dim
        self.n_heads = h
        if config.q_lora_rank:
            self.q_a_proj = Linear(d, config.q_lora_rank)
            self.q_a_norm = RMSNorm(config.q_lora_rank, config.norm_eps)
            self.q_b_proj = Linear(config.q_lora_rank, h * config.qk_head_dim)
        else:
            self.q_proj = Linear(d, h * config.qk_head_dim)
        if produces_kv:
            self.kv_a_proj = Linear(d, c + r)
            self.kv_a_norm = RMSNorm(c, config.norm_eps)
        self.kv_b_proj = Linear(c, h * (config.qk_nope_head_dim + config.v_head_dim))
        self.output_proj = Linear(h * config.v_head_dim, d)
        self.rope = RotaryEmbedding(config.rope_theta, r, config.max_seq_len)

    # ---- the pieces both forms share -------------------------------------------------------

    def _positions(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """(T,) or (B, T) positions; default 0..T-1."""
        if positions is None:
            return torch.arange(x.shape[1], device=x.device)  # (T,)
        return positions

    def project_q(
        self, x: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> (q_nope (B, H, T, N), q_rope (B, H, T, R)), RoPE applied."""
        b, t, _ = x.shape
        cfg = self.config
        if cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))  # (B, T, Q) -> (B, T, H·(N+R))
        else:
            q = self.q_proj(x)  # (B, T, H·(N+R))
        q = q.view(b, t, self.n_heads, cfg.qk_head_dim).transpose(1, 2)  # (B, H, T, N+R)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        pos = self._positions(x, positions)
        if pos.dim() == 2:
            pos = pos[:, None, :]  # (B, 1, T) broadcasts over heads
        return q_nope, self.rope(q_rope, pos)

    def compress_kv(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, D) -> the cache entries (B, T, C + R): ``[RMSNorm(c) ; RoPE(k^R)]``."""
        c, k_rope = self.kv_a_proj(x).split(
            [self.config.kv_lora_rank, self.config.qk_rope_head_dim], dim=-1
        )  # (B, T, C), (B, T, R)
        pos = self._positions(x, positions)
        return torch.cat([self.kv_a_norm(c), self.rope(k_rope, pos)], dim=-1)  # (B, T, C+R)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK (H, N, C) and W_UV (H, Ev, C)."""
        cfg = self.config
        w = self.kv_b_proj.weight.view(
            self.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
        )  # (H, N+Ev, C)
        return w.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)

    # ---- explicit form (training, prefill) -------------------------------------------------

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        past_latent: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        context: Context | None = None,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D), the explicit form: latents up-projected to per-head K and V.

        ``positions`` (T,) or (B, T) default to 0..T-1 (or P..P+T-1 after a ``past_latent``).
        ``past_latent`` (B, P, C + R): cache entries of P earlier tokens (a prefill chunk after a
        cached prefix); query i then sees keys 0..P+i (causal, aligned to the bottom right).
        With a ``kv_cache`` (:meth:`attend_cached`) or an engine ``context``
        (:meth:`attend_paged`, x (1, N, D)) the cache is read and written instead.
        """
        if context is not None:
            return self.attend_paged(x, context)
        if kv_cache is not None:
            return self.attend_cached(x, positions, kv_cache)
        if positions is None and past_latent is not None:
            p = past_latent.shape[1]
            positions = torch.arange(p, p + x.shape[1], device=x.device)  # (T,)
        latent = self.compress_kv(x, positions)  # (B, T, C+R)
        if past_latent is not None:
            latent = torch.cat([past_latent.to(latent.dtype), latent], dim=1)  # (B, S, C+R)
        return self.attend_explicit(x, positions, latent)

    def attend_explicit(
        self, x: torch.Tensor, positions: torch.Tensor | None, latent: torch.Tensor
    ) -> torch.Tensor:
        """Queries from x (B, T, D) over ``latent`` (B, S, C + R) whose last T rows are x's own
        (causal, bottom-right aligned), explicit form -> (B, T, D)."""
        b, t, _ = x.shape
        cfg = self.config
        s = latent.shape[1]
        q_nope, q_rope = self.project_q(x, positions)  # (B, H, T, N), (B, H, T, R)
        c, k_rope = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c).view(b, s, self.n_heads, -1).transpose(1, 2)  # (B, H, S, N+Ev)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_rope = k_rope[:, None].expand(b, self.n_heads, s, cfg.qk_rope_head_dim)  # (B, H, S, R)
        q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, T, N+R)
        k = torch.cat([k_nope, k_rope], dim=-1)  # (B, H, S, N+R)
        if cfg.backend == "sdpa":
            # A chunk after cached rows (T < S: the engine's chunked prefill) is causal from
            # the bottom right: SDPA's lower-right causal bias instead of a dense (T, S) mask,
            # and on CUDA V zero-padded to the query/key width (N + R), since SDPA's flash
            # backend takes one head dim. With the dense mask and unequal dims the engine took
            # 226 s to prefill 64 × 16k prompts on an H100 (GQA-4: 15.5 s); that those kept the
            # fused kernels out is inferred, not profiled. Training (T = S) is unchanged.
            from torch.nn.attention.bias import causal_lower_right

            causal = t == s
            mask = None if causal else causal_lower_right(t, s)
            ev, pad = v.shape[-1], q.shape[-1] - v.shape[-1]
            if q.is_cuda and pad > 0 and not causal:
                v = F.pad(v, (0, pad))  # (B, H, S, N+R): zero columns, sliced off below
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=cfg.softmax_scale
            )[..., :ev]  # (B, H, T, Ev)
        else:
            scores = (q @ k.transpose(-2, -1)) * cfg.softmax_scale  # (B, H, T, S)
            scores = scores.masked_fill(~_bottom_right_mask(t, s, x.device), float("-inf"))
            out = softmax(scores.float(), dim=-1).to(v.dtype) @ v  # (B, H, T, Ev)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * cfg.v_head_dim)  # (B, T, H·Ev)
        return self.output_proj(out)  # (B, T, D)

    # ---- absorbed form (decode) ------------------------------------------------------------

    def absorbed_query(
        self, x: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (B, T, D) -> the latent-space queries (B, T, H, C + R): ``[W_UKᵀ q^C ; q^R]``."""
        q_nope, q_rope = self.project_q(x, positions)  # (B, H, T, N), (B, H, T, R)
        w_uk, _ = self._w_uk_uv()  # (H, N, C)
        q_lat = torch.einsum("bhtn,hnc->bthc", q_nope, w_uk)  # (B, T, H, C)
        return torch.cat([q_lat, q_rope.transpose(1, 2)], dim=-1)  # (B, T, H, C+R)

    def absorbed_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Latent-space attention output (B, T, H, C) -> (B, T, D): W_UV per head, then W_O."""
        _, w_uv = self._w_uk_uv()  # (H, Ev, C)
        o = torch.einsum("bthc,hvc->bthv", o_lat, w_uv.to(o_lat.dtype))  # (B, T, H, Ev)
        return self.output_proj(o.flatten(2))  # (B, T, H·Ev) -> (B, T, D)

    def decode_absorbed(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        past_latent: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed form over a contiguous cache: x (B, T, D) after ``past_latent``
        (B, P, C + R) or none -> (output (B, T, D), x's new cache entries (B, T, C + R)).

        Same function as :meth:`forward` with the same arguments (``tests/test_mla.py``); the
        attention runs in latent space, one (C + R)-wide key per cached token for every head.
        """
        p = 0 if past_latent is None else past_latent.shape[1]
        if positions is None:
            positions = torch.arange(p, p + x.shape[1], device=x.device)  # (T,)
        new = self.compress_kv(x, positions)  # (B, T, C+R)
        latent = new if past_latent is None else torch.cat([past_latent.to(new.dtype), new], 1)
        q_abs = self.absorbed_query(x, positions)  # (B, T, H, C+R)
        mask = _bottom_right_mask(x.shape[1], latent.shape[1], x.device)  # (T, S)
        return self.absorbed_output(self._absorbed_attention(q_abs, latent, mask)), new

    def _absorbed_attention(
        self, q_abs: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Latent-space attention: q_abs (B, T, H, C + R) over ``latent`` (B, S, C + R) where
        ``mask`` ((T, S) or (B, 1, T, S) bool) allows -> o_lat (B, T, H, C)."""
        scores = torch.einsum("bthl,bsl->bhts", q_abs, latent.to(q_abs.dtype))  # (B, H, T, S)
        scores = (scores * self.config.softmax_scale).masked_fill(~mask, float("-inf"))
        probs = softmax(scores.float(), dim=-1).to(q_abs.dtype)  # (B, H, T, S)
        c = latent[..., : self.config.kv_lora_rank].to(q_abs.dtype)  # (B, S, C): values = latents
        return torch.einsum("bhts,bsc->bthc", probs, c)  # (B, T, H, C)

    def attend_cached(
        self, x: torch.Tensor, positions: torch.Tensor | None, kv_cache: KVCache
    ) -> torch.Tensor:
        """x (B, T, D) with a contiguous :class:`~lmforge.model.KVCache` (the reference
        generation loop) -> (B, T, D), absorbed form.

        The cache holds one "kv-head" of C + R values per token (``KVCache.for_model`` sizes it
        so for MLA; its values are empty): a producing layer writes x's latents at the slots
        ``kv_cache.begin`` reserved, a CLA consumer reads its producer's. The mask is the
        cache's (left padding, finished rows)."""
        b, t, _ = x.shape
        if positions is None:
            positions = torch.arange(kv_cache.length - t, kv_cache.length, device=x.device)
        idx = self.cache_index
        if self.produces_kv:
            new = self.compress_kv(x, positions)  # (B, T, C+R)
            empty = new.new_zeros(b, 1, t, 0)  # (B, 1, T, 0): MLA caches no values
            latent, _ = kv_cache.update(idx, new[:, None], empty)  # (B, 1, S', C+R)
        else:
            latent = kv_cache.keys(idx)  # (B, 1, S', C+R)
        q_abs = self.absorbed_query(x, positions)  # (B, T, H, C+R)
        o_lat = self._absorbed_attention(q_abs, latent[:, 0], kv_cache.mask)  # (B, T, H, C)
        return self.absorbed_output(o_lat)

    def attend_paged(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """An engine step's flat tokens x (1, N, D) over the paged latent cache
        ``ctx.latent_cache`` (L_kv, NB, BS, C + R) -> (1, N, D).

        Decode steps: absorbed form, the latent write and the attention through
        ``ctx.ops.attend_latent`` (the paged kernel). Steps with prefill chunks: each
        sequence's rows through :meth:`prefill_paged` (explicit form over its gathered pages,
        so chunked prefill and prefix-cache hits read what the decode kernel reads); decode
        rows inside such a step take the same path."""
        if ctx.latent_cache is None:
            raise LmforgeError("an MLA model needs an engine step with a latent cache")
        pages = ctx.latent_cache[self.cache_index]  # (NB, BS, C+R)
        h = x[0]  # (N, D)
        if ctx.decode:
            xb, pos = h[:, None], ctx.positions[:, None]  # (S, 1, D), (S, 1)
            new = self.compress_kv(xb, pos)[:, 0] if self.produces_kv else None  # (S, C+R)
            q_abs = self.absorbed_query(xb, pos)[:, 0]  # (S, H, C+R)
            o_lat = ctx.ops.attend_latent(
                self.cache_index,
                q_abs,
                new,
                ctx,
                kv_lora_rank=self.config.kv_lora_rank,
                scale=self.config.softmax_scale,
            )  # (S, H, C)
            return self.absorbed_output(o_lat[:, None])[:, 0][None]  # (1, S, D)
        if ctx.q_lens is None or ctx.ctx_lens_list is None:
            raise LmforgeError("an MLA prefill step needs the context's host-side lengths")
        if self.produces_kv:  # every row's latent first: a sequence reads its own chunk back
            write_latent(pages, ctx.slots, self.compress_kv(h[None], ctx.positions)[0])
        outs, start = [], 0
        for i, (q_len, ctx_len) in enumerate(zip(ctx.q_lens, ctx.ctx_lens_list, strict=True)):
            rows = slice(start, start + q_len)
            x_i, pos_i, slots_i = h[rows], ctx.positions[rows], ctx.slots[rows]
            table = ctx.block_tables[i]
            out = self.prefill_paged(x_i, pos_i, pages, slots_i, table, ctx_len, write=False)
            outs.append(out)  # (q_len, D)
            start += q_len
        return torch.cat(outs)[None]  # (1, N, D)

    def prefill_paged(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        latent_pages: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        ctx_len: int,
        *,
        write: bool = True,
    ) -> torch.Tensor:
        """A prefill chunk of one sequence over a paged latent cache: x (T, D) -> (T, D).

        Writes the chunk's cache entries at ``slots`` (T,) (unless ``write`` is False: already
        written, or a CLA consumer's), then gathers the sequence's
        ``ctx_len`` cached rows (the chunk's included, last) through ``block_table`` (M,) and
        attends in the explicit form (bottom-right causal): chunked prefill and a cached
        prefix (prefix caching) read the same pages the decode kernel does.
        """
        if write:
            write_latent(latent_pages, slots, self.compress_kv(x[None], positions)[0])
        bs = latent_pages.shape[1]
        n_blocks = -(-ctx_len // bs)
        rows = latent_pages[block_table[:n_blocks].long()].flatten(0, 1)[:ctx_len]  # (S, C+R)
        return self.attend_explicit(x[None], positions, rows[None])[0]  # (T, D)

    def decode_paged(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        latent_pages: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        *,
        use_triton: bool | None = None,
    ) -> torch.Tensor:
        """One decode token per sequence over a paged latent cache: x (S, D) -> (S, D).

        Writes x's cache entries at ``slots`` (S,) of ``latent_pages`` (NB, BS, C + R), then
        attends over each sequence's ``ctx_lens`` (S,) tokens listed by ``block_tables`` (S, M)
        with :func:`lmforge.kernels.mla_decode.mla_decode` (Triton where it runs, else torch).
        This is what an engine's ``StepOps.attend_latent`` does for decode rows.
        """
        from lmforge.kernels.mla_decode import mla_decode

        xb = x[:, None]  # (S, 1, D): each sequence is a batch row of one token
        pos = positions[:, None]  # (S, 1)
        write_latent(latent_pages, slots, self.compress_kv(xb, pos)[:, 0])
        q_abs = self.absorbed_query(xb, pos)[:, 0]  # (S, H, C+R)
        o_lat = mla_decode(
            q_abs,
            latent_pages,
            block_tables,
            ctx_lens,
            kv_lora_rank=self.config.kv_lora_rank,
            scale=self.config.softmax_scale,
            use_triton=use_triton,
        )  # (S, H, C)
        return self.absorbed_output(o_lat[:, None])[:, 0]  # (S, D)


def _bottom_right_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """(T, S) bool: query i (at cache position S − T + i) sees keys 0..S − T + i."""
    q_pos = torch.arange(s - t, s, device=device)[:, None]  # (T, 1)
    return torch.arange(s, device=device)[None, :] <= q_pos  # (T, S)
