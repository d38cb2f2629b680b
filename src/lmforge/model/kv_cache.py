"""The explicit key/value cache for incremental decoding.

Shape legend: L layers, B batch, K kv-heads, S cache slots, T new tokens, E head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lmforge.model.cla import kv_cache_layers
from lmforge.model.linear_attention import RecurrentState


class KVCache:
    """Keys and values of every layer for a batch of sequences decoded in lockstep.

    Layout:

    - ``k``, ``v``: (L, B, K, S, E) tensors, S = ``max_seq_len`` slots (with cross-layer KV
      sharing every k, L = ceil(n_layers / k): the producing layers', :mod:`lmforge.model.cla`). Slot ``s`` of row ``b``
      holds the key/value of the ``s``-th token that was fed to the model for that row (after
      RoPE for keys). Slots ``[0, length)`` are filled; every row advances together.
    - ``valid``: (B, S) bool, True where the slot holds a real token. Padding slots (left padding
      of a batch of prompts of different lengths, or a finished row's filler tokens) are False
      and no query ever attends to them.
    - ``next_position``: (B,) long, the RoPE position the next real token of each row gets, i.e.
      the number of real tokens that row has seen. Positions therefore ignore padding: a prompt
      gets positions 0, 1, 2, … wherever its first real token sits in the slot layout.

    A forward with a cache: the model calls :meth:`begin` once with the new tokens' validity,
    which reserves slots ``[length, length + T)`` and returns the new tokens' positions and the
    attention mask; each layer then calls :meth:`update`, which writes its new keys/values into
    those slots and returns all filled slots. A query attends to key slot ``j`` iff ``j`` is at
    or before its own slot and valid; a padding query attends to itself only (its output is
    garbage that nothing reads, but it is never NaN).

    Hybrid layer patterns: a sliding-window layer (W) attends with :meth:`window_mask` (the
    mask above, limited to keys whose RoPE position is within ``window`` of the query's, from
    ``positions`` (B, S)); a linear layer (G, M, L) keeps its :class:`RecurrentState` in
    ``states[layer]`` instead of slots (its K/V slots stay unused), advanced over the valid
    tokens only (``new_valid``, the current forward's validity). A DSA layer (S) fills its
    K/V slots as an A layer does and also keeps its indexer keys in ``index_k[layer]``
    (B, S, E_I), one RoPE'd key per slot (:meth:`update_index`); each new token's indexer
    scores them all and it attends to its top-k (:mod:`lmforge.model.sparse_attention`).

    Simplification: one contiguous buffer sized up front (no paging, no eviction). Exercised by
    ``pytest tests/test_model.py -k kv_cache`` and ``pytest tests/test_generate.py``.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        value_dim: int | None = None,
    ) -> None:
        shape = (n_layers, batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        # value_dim 0: keys only (MLA caches one latent per token, lmforge.model.mla)
        v_shape = (*shape[:-1], head_dim if value_dim is None else value_dim)
        self.v = torch.zeros(v_shape, device=device, dtype=dtype)
        self.valid = torch.zeros(batch_size, max_seq_len, device=device, dtype=torch.bool)
        self.next_position = torch.zeros(batch_size, device=device, dtype=torch.long)
        self.positions = torch.zeros(batch_size, max_seq_len, device=device, dtype=torch.long)
        self.states: dict[int, RecurrentState] = {}
        "linear layers' recurrent states (B sequences each), created by their first forward"
        self.index_k: dict[int, torch.Tensor] = {}
        "DSA (S) layers' indexer keys (B, S, E_I), created by their first forward"
        self.new_valid: torch.Tensor | None = None
        "(B, T) bool validity of the current forward's tokens (set by :meth:`begin`)"
        self.length = 0
        self._start = 0
        self._mask: torch.Tensor | None = None

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        batch_size: int,
        max_seq_len: int | None = None,
        dtype: torch.dtype | None = None,
        n_layers: int | None = None,
    ) -> KVCache:
        """An empty cache shaped for ``model`` (a TransformerLM), on its device and dtype;
        ``n_layers`` overrides the number of cache layers (one for an MTP draft step's block)."""
        cfg = model.config
        param = next(model.parameters())
        # CLA (kv_share_every k): the ceil(L / k) KV-producing layers only
        layers = kv_cache_layers(cfg.n_layers, getattr(cfg, "kv_share_every", 1))
        heads, head_dim, value_dim = cfg.kv_heads, int(cfg.head_dim), None
        if getattr(cfg, "attention_type", "gqa") == "mla":
            # MLA: one (C + R)-wide latent per token and KV-producing layer, no values.
            heads, head_dim, value_dim = 1, cfg.mla.latent_dim, 0
        layers = layers if n_layers is None else n_layers
        return cls(
            n_layers=layers,
            batch_size=batch_size,
            n_kv_heads=heads,
            max_seq_len=cfg.context_length if max_seq_len is None else max_seq_len,
            head_dim=head_dim,
            device=param.device,
            dtype=param.dtype if dtype is None else dtype,
            value_dim=value_dim,
        )

    @property
    def batch_size(self) -> int:
        """Rows B."""
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        """Slots S."""
        return self.k.shape[3]

    def begin(
        self, num_new: int, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for ``num_new`` tokens; return their positions (B, T) and mask (B, 1, T, S').

        ``valid`` (B, T) bool marks real tokens (None = all real). S' = ``length`` after the
        call, the number of filled slots the layers attend over.
        """
        start, end = self.length, self.length + num_new
        if end > self.max_seq_len:
            raise ValueError(
                f"KV cache overflow: {end} slots needed, cache holds {self.max_seq_len}"
            )
        device = self.valid.device
        if valid is None:
            valid = torch.ones(self.batch_size, num_new, dtype=torch.bool, device=device)
        valid = valid.to(device=device, dtype=torch.bool)
        counts = valid.long().cumsum(dim=1)  # (B, T) real tokens up to and including each slot
        positions = (self.next_position[:, None] + counts - 1).clamp_min(0)  # (B, T)
        self.next_position = self.next_position + counts[:, -1]
        self.valid[:, start:end] = valid
        self.positions[:, start:end] = positions
        self.new_valid = valid

        q_slot = torch.arange(start, end, device=device)[:, None]  # (T, 1)
        k_slot = torch.arange(end, device=device)[None, :]  # (1, S')
        causal = k_slot <= q_slot  # (T, S')
        own = k_slot == q_slot  # (T, S')
        mask = (causal[None] & self.valid[:, None, :end]) | own[None]  # (B, T, S')
        self._mask = mask[:, None]  # (B, 1, T, S')
        self._start, self.length = start, end
        return positions, self._mask

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``layer``'s new keys/values (B, K, T, E); return all filled (B, K, S', E)."""
        start, end = self._start, self.length
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def keys(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s filled keys (B, K, S', E), written by this forward's producer (a CLA
        consumer reads them)."""
        return self.k[layer, :, :, : self.length]

    def update_index(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Store S layer ``layer``'s new indexer keys (B, T, E_I) in the forward's slots (the
        buffer created at the layer's first call); return all filled (B, S', E_I)."""
        buf = self.index_k.get(layer)
        if buf is None:
            buf = k.new_zeros(self.batch_size, self.max_seq_len, k.shape[-1])  # (B, S, E_I)
            self.index_k[layer] = buf
        buf[:, self._start : self.length] = k
        return buf[:, : self.length]

    @property
    def mask(self) -> torch.Tensor:
        """The attention mask (B, 1, T, S') of the current forward (set by :meth:`begin`)."""
        if self._mask is None:
            raise RuntimeError("KVCache.begin must be called before the layers run")
        return self._mask

    def window_mask(self, window: int) -> torch.Tensor:
        """:attr:`mask` (B, 1, T, S') limited to keys within ``window`` positions of the query
        (sliding-window attention: itself and the window − 1 tokens before it)."""
        start, end = self._start, self.length
        q_pos = self.positions[:, start:end]  # (B, T)
        k_pos = self.positions[:, :end]  # (B, S')
        near = (q_pos[:, :, None] - k_pos[:, None, :]) < window  # (B, T, S')
        own = torch.arange(start, end, device=near.device)[:, None] == torch.arange(
            end, device=near.device
        )  # (T, S') a padding query attends to itself
        return self.mask & (near | own[None])[:, None]  # (B, 1, T, S')


def window_ring(layer_types: Sequence[str]) -> bool:
    """Whether the engine keeps the W layers' keys/values in per-sequence rings: a pattern
    mixing sliding-window (W) layers with A or S layers, which read every page, so the pages
    behind a window cannot go back to the shared pool (``WWWA``; not ``W`` or ``GGGW``, where
    the scheduler gives those blocks back instead)."""
    return "W" in layer_types and any(c in "AS" for c in layer_types)


def paged_kv_layers(layer_types: Sequence[str], upto: int | None = None) -> int:
    """How many blocks among the first ``upto`` (all when None) keep keys/values in the
    engine's paged cache: every layer but the linear ones (G, M, L), which keep a recurrent
    state instead, and the W layers of a :func:`window_ring` pattern, which keep rings. A K/V
    layer's page index is this count over the blocks before it."""
    skip = "GMLW" if window_ring(layer_types) else "GML"
    kinds = layer_types if upto is None else layer_types[:upto]
    return sum(1 for c in kinds if c not in skip)


def paged_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, ctx: Any, window: int
) -> torch.Tensor:
    """Sliding-window attention over an engine step's paged cache (the torch reference path).

    Writes k, v (N, K, E) at ``ctx.slots`` of layer ``layer``'s pages, then each sequence's
    queries q (N, H, E) (RoPE and scales applied) attend to the keys whose position p satisfies
    0 ≤ q_pos − p < ``window`` -> (N, H, E). Sequences are taken one at a time from the
    context's host lists (an eager step); only the table's blocks from the one holding the
    first query's oldest key are read (the engine may have given the blocks before it back:
    their entries point at its scratch block)."""
    k_pages, v_pages = ctx.k_cache[layer], ctx.v_cache[layer]  # (NB, BS, K, E)
    kv, e = k_pages.shape[-2], k_pages.shape[-1]
    k_pages.view(-1, kv, e).index_copy_(0, ctx.slots, k.to(k_pages.dtype))
    v_pages.view(-1, kv, e).index_copy_(0, ctx.slots, v.to(v_pages.dtype))
    ctx_lens = ctx.ctx_lens_list if ctx.ctx_lens_list is not None else ctx.ctx_lens.tolist()
    q_lens = ctx.q_lens if ctx.q_lens is not None else [1] * len(ctx_lens)
    # host lists where the step has them, else the device table (a row slice: no host copy)
    tables = ctx.tables_list if ctx.tables_list is not None else ctx.block_tables
    out = torch.empty_like(q)
    row = 0
    bs = k_pages.shape[1]
    for n, total, table in zip(q_lens, ctx_lens, tables, strict=True):
        first = max(0, total - n - window + 1) // bs  # the block of the first query's oldest key
        blocks = torch.as_tensor(table[first : -(-total // bs)], device=q.device)
        keys = k_pages[blocks].reshape(-1, kv, e)[: total - first * bs]  # (C, K, E)
        vals = v_pages[blocks].reshape(-1, kv, e)[: total - first * bs]  # (C, K, E)
        q_pos = torch.arange(total - n, total, device=q.device)[:, None]  # (n, 1)
        k_pos = torch.arange(first * bs, total, device=q.device)[None, :]  # (1, C)
        d = q_pos - k_pos  # (n, C) query − key position
        mask = (d >= 0) & (d < window)
        o = F.scaled_dot_product_attention(
            q[row : row + n].transpose(0, 1)[None].to(keys.dtype),  # (1, H, n, E)
            keys.transpose(0, 1)[None],  # (1, K, C, E)
            vals.transpose(0, 1)[None],
            attn_mask=mask,
            enable_gqa=q.shape[1] != kv,
        )  # (1, H, n, E)
        out[row : row + n] = o[0].transpose(0, 1).to(q.dtype)  # (n, H, E)
        row += n
    return out


def paged_window_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """Sliding-window decode over paged keys/values, on the device only (no host read: the
    compiled and graph-captured decode steps run it): one query per sequence.

    Writes k, v (S, K, E) at ``slots`` (S,) of one layer's (NB, BS, K, E) pages, then query i
    (position ``ctx_lens[i] − 1``, RoPE and scales applied) attends to the keys at positions p
    with 0 ≤ q_pos − p < ``window``: only the ceil((window − 1) / BS) + 1 table columns that
    can hold them are gathered, whatever the table width -> (S, H, E). Same math as
    :func:`paged_window_attention` (the prefill path)."""
    kv, e = k_pages.shape[-2], k_pages.shape[-1]
    k_pages.view(-1, kv, e).index_copy_(0, slots, k.to(k_pages.dtype))
    v_pages.view(-1, kv, e).index_copy_(0, slots, v.to(v_pages.dtype))
    return window_decode(q, k_pages, v_pages, block_tables, ctx_lens, window)


def window_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """The attention of :func:`paged_window_decode` over pages already written (the torch
    reference of the decode kernel's window): q (S, H, E) -> (S, H, E)."""
    kv, bs = k_pages.shape[-2], k_pages.shape[1]
    n = -(-(window - 1) // bs) + 1  # blocks a window can span
    last = ctx_lens.long() - 1  # (S,) the query's position
    cols = (last // bs)[:, None] - torch.arange(n - 1, -1, -1, device=q.device)  # (S, n)
    blocks = block_tables.long().gather(1, cols.clamp(min=0))  # (S, n), oldest first
    keys = k_pages[blocks].flatten(1, 2)  # (S, n·BS, K, E)
    vals = v_pages[blocks].flatten(1, 2)  # (S, n·BS, K, E)
    pos = (cols[:, :, None] * bs + torch.arange(bs, device=q.device)).flatten(1)  # (S, n·BS)
    d = last[:, None] - pos  # query − key position
    mask = (d >= 0) & (d < window) & (pos >= 0)  # (S, n·BS); pos < 0: a column before 0
    o = F.scaled_dot_product_attention(
        q[:, :, None].to(keys.dtype),  # (S, H, 1, E)
        keys.transpose(1, 2),  # (S, K, n·BS, E)
        vals.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        enable_gqa=q.shape[1] != kv,
    )  # (S, H, 1, E)
    return o[:, :, 0].to(q.dtype)  # (S, H, E)
