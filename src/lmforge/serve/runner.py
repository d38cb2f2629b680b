"""The model run over a paged KV cache: one forward for a step's flattened batch.

The engine's forward walks the :class:`~lmforge.model.TransformerLM`'s own modules (embedding,
norms, projections, RoPE tables, SwiGLU, LM head), so any checkpoint or import runs unchanged;
only attention differs from ``TransformerLM.forward``: the step's tokens of all sequences are
one flat (N, D) batch (no padding), their keys/values are written into the pages, and attention
reads each sequence's pages (:mod:`lmforge.serve.attention`). ``lmforge.generate`` stays the
readable reference: the tests check this forward's greedy tokens against it.

Shape legend: N tokens in the step, S sequences, D model dim, H heads, K kv-heads, E head dim,
V vocab, L layers, NB blocks, BS block size.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmforge.serve.attention import (
    paged_decode,
    paged_prefill,
    prefill_kernel_on,
    prefill_plan,
    write_kv,
)

if TYPE_CHECKING:
    from lmforge.serve._prefill_triton import PrefillPlan

__all__ = ["PagedKVCache", "StepBatch", "forward_step"]


class PagedKVCache:
    """Keys and values of every layer in fixed-size blocks.

    Layout: ``k``, ``v`` are (L, NB, BS, K, E) tensors; block b of layer l is ``k[l, b]``, a
    (BS, K, E) tile holding BS consecutive tokens of whichever sequence's block table lists b
    (keys after RoPE). Which blocks a sequence owns is the allocator's business
    (:class:`~lmforge.serve.blocks.BlockAllocator`); this object only holds the memory.
    """

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @staticmethod
    def bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers (K and V)."""
        cfg = model.config
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.n_layers * block_size * cfg.kv_heads * cfg.head_dim * elem


@dataclasses.dataclass
class StepBatch:
    """The inputs of one forward: tokens of S sequences, flattened (decode rows have 1 token)."""

    tokens: torch.Tensor
    "(N,) long token ids"
    positions: torch.Tensor
    "(N,) long RoPE positions"
    slots: torch.Tensor
    "(N,) long flat KV slots (block · BS + offset) the tokens' keys/values go to"
    block_tables: torch.Tensor
    "(S, M) int32 block tables, padded with block 0"
    ctx_lens: torch.Tensor
    "(S,) int32 tokens cached per sequence after this step"
    last_rows: torch.Tensor
    "(S,) long row of each sequence's last token in the step (its logits are returned)"
    q_lens: list[int]
    "tokens per sequence this step"
    ctx_lens_list: list[int]
    "ctx_lens as ints"
    tables_list: list[list[int]]
    "block tables as lists"

    @property
    def decode_only(self) -> bool:
        """Whether every sequence feeds exactly one token (the decode kernel's case)."""
        return all(t == 1 for t in self.q_lens)


def _attention(
    attn: nn.Module,
    h: torch.Tensor,
    batch: StepBatch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    use_triton: bool | None,
    plan: PrefillPlan | None = None,
) -> torch.Tensor:
    """One layer's attention over the pages: (N, D) -> (N, D). ``plan``: the step's prefill
    tile list (the Triton prefill kernel), None for the torch prefill."""
    n = h.shape[0]
    nh, kvh, e = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_proj(h).view(n, nh, e)  # (N, H, E)
    k = attn.k_proj(h).view(n, kvh, e)  # (N, K, E)
    v = attn.v_proj(h).view(n, kvh, e)  # (N, K, E)
    if attn.config.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    # RotaryEmbedding rotates (..., T, E) at positions (T,): heads first, tokens second.
    q = attn.rope(q.transpose(0, 1), batch.positions).transpose(0, 1)  # (N, H, E)
    k = attn.rope(k.transpose(0, 1), batch.positions).transpose(0, 1)  # (N, K, E)
    write_kv(k_cache, v_cache, batch.slots, k, v)
    if batch.decode_only:
        o = paged_decode(
            q, k_cache, v_cache, batch.block_tables, batch.ctx_lens, use_triton=use_triton
        )  # (S, H, E)
    else:
        o = paged_prefill(
            q, k_cache, v_cache, batch.tables_list, batch.q_lens, batch.ctx_lens_list,
            block_table_tensor=batch.block_tables, ctx_lens_tensor=batch.ctx_lens, plan=plan,
            use_triton=use_triton if plan is not None else False,  # None: paged_prefill's rule
        )  # (N, H, E)  # fmt: skip
    return attn.output_proj(o.reshape(n, nh * e))  # (N, D)


def forward_step(
    model: nn.Module,
    cache: PagedKVCache,
    batch: StepBatch,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Run ``model`` on one step's tokens, writing their KV; logits of each sequence's last
    token: (S, V) float32."""
    plan = None
    if not batch.decode_only:  # the prefill kernel's tiles: built once per step, not per layer
        dev = batch.tokens.device
        e = model.layers[0].attn.head_dim
        if use_triton if use_triton is not None else prefill_kernel_on(dev, e):
            plan = prefill_plan(batch.q_lens, batch.ctx_lens_list, dev, head_dim=e)
    x = model.residual_stream(model.token_embeddings(batch.tokens))  # (N, D)
    for i, layer in enumerate(model.layers):
        a = _attention(layer.attn, layer.ln1(x), batch, cache.k[i], cache.v[i], use_triton, plan)
        x = x + a
        x = x + layer.ffn(layer.ln2(x))  # (N, D)
    h = model.ln_final(x[batch.last_rows])  # (S, D)
    return model.logits_from_hidden(h).float()  # (S, V)
