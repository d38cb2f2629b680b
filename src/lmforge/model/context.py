"""The per-step context a forward reads when it runs over a paged KV cache (an engine step).

``TransformerLM.forward(idx, context=ctx)`` is the one forward of lmforge: training calls it
without a context, the readable reference loop (``lmforge.generate``) with a contiguous
:class:`~lmforge.model.KVCache`, and the serving engine with a :class:`Context` describing
one step of its paged cache, the way nano-vllm's model reads its step context. The attention
module owns how the cache is read and written; the context only says where: positions, the
flat slots the new keys/values go to, the block tables, the per-sequence query and context
lengths (prefill chunks and decode rows mixed in one flat batch).

Why kernels come in through :attr:`Context.ops`: the paged-attention and decode-GEMV kernels
are the serving engine's (``lmforge.serve.attention``) and ``lmforge.model`` must not import
``lmforge.serve`` (imports flow one way). So the engine hands the model a :class:`StepOps`
(its kernels, with their torch fallbacks); the model decides *what* to compute (projections,
QK-norm, RoPE, muP, soft-cap, MoE: every switch) and calls the ops for the paged parts only.

Shape legend: N tokens in the step (all sequences, flattened), S sequences, L layers,
NB blocks, BS block size, K kv-heads, H heads, E head dim, M block-table width, D model dim.
Exercised by ``pytest tests/test_engine_switches.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lmforge.model.kv_cache import paged_window_attention, paged_window_decode

__all__ = ["Context", "PagedKVCache", "StepOps"]

_QUANTIZED = (torch.float8_e4m3fn, torch.int8)  # cache dtypes stored as values + a row scale
_SCALE_BYTES = 4  # the float32 scale at the end of each quantized row


class PagedKVCache:
    """Keys and values of every layer in fixed-size blocks.

    Layout: ``k``, ``v`` are (L, NB, BS, K, E) tensors (L: the layers that keep K/V: no linear
    layer, and with cross-layer sharing every k only the ceil(L / k) producing ones, each
    consumer reading its producer's pages); block b of layer l is ``k[l, b]``, a
    (BS, K, E) tile holding BS consecutive tokens of whichever sequence's block table lists b
    (keys after RoPE). Slot ``b·BS + i`` is offset i of block b. Which blocks a sequence owns
    is the allocator's business (``lmforge.serve.blocks``); this object only holds the memory.

    Quantized (``dtype`` ``torch.float8_e4m3fn`` or ``torch.int8``): the last dim is E + 4, each
    (slot, kv-head) row holding its E values and then its float32 scale (x ≈ value · scale; one
    scale per token and head, so appending to a block never rescales what it holds; see
    :mod:`lmforge.serve.attention`). ``head_dim`` is E either way.

    DSA (S layers): ``index_k`` (L_S, NB, BS, E_I) holds each S layer's indexer keys in the
    same blocks and slots as its K/V (so a cached prefix block carries both); empty (0, …)
    for a model without S layers.
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
        index_layers: int = 0,
        index_dim: int = 0,
    ) -> None:
        row = head_dim + (_SCALE_BYTES if dtype in _QUANTIZED else 0)
        if dtype in _QUANTIZED and head_dim % 4:  # the float32 scale must sit 4-byte aligned
            raise ValueError(f"a quantized KV cache needs head_dim % 4 == 0, got {head_dim}")
        shape = (n_layers, num_blocks, block_size, n_kv_heads, row)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        index_shape = (index_layers, num_blocks, block_size, index_dim)
        self.index_k = torch.zeros(index_shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.head_dim = head_dim

    @staticmethod
    def bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers (K and V; a quantized row's scale included)."""
        cfg = model.config
        elem = torch.empty((), dtype=dtype).element_size()
        row = int(cfg.head_dim) * elem + (_SCALE_BYTES if dtype in _QUANTIZED else 0)
        return 2 * cfg.n_layers * block_size * cfg.kv_heads * row


class StepOps:
    """The kernels a paged forward calls; the engine subclasses this with its own.

    Only :meth:`attend` is required. The other hooks return None where they do not apply, and
    the model then computes that part itself with its own modules (the reference math).
    """

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        ctx: Context,
    ) -> torch.Tensor:
        """Write k, v (N, K, E) at ``ctx.slots`` of layer ``layer``'s pages, then attend:
        q (N, H, E) (RoPE and every scale applied) -> (N, H, E). k, v None: a cross-layer
        sharing consumer (:mod:`lmforge.model.cla`), which reads the pages its producer wrote
        earlier in the same step and writes nothing."""
        raise NotImplementedError

    def packed(
        self, layer: int
    ) -> tuple[torch.Tensor | nn.Module | None, torch.Tensor | nn.Module | None]:
        """Layer ``layer``'s q/k/v weights as one (H·E + 2·K·E, D) tensor and its SwiGLU's w1/w3
        as one (2F, D) tensor (views the parameters share) — or, for quantized linears, one
        module computing the concatenated outputs (buffers the modules share) — or None:
        separate projections."""
        return None, None

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        """``x @ wᵀ`` on a kernel of the step's own (the decode GEMV), or None: torch's."""
        return None

    def module_matmul(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``m(x)`` for a linear that is not a plain :class:`~lmforge.model.layers.Linear` (a
        quantized one, applied from outside the model) on a kernel of the step's own, or None:
        call the module. Only asked for modules without hooks."""
        return None

    def fused_attention(
        self, attn: nn.Module, h: torch.Tensor, ctx: Context
    ) -> torch.Tensor | None:
        """The whole attention core of ``attn`` from its input h (N, D) in one fused kernel
        (q/k/v, QK-norm, RoPE, KV write, attention) -> (N, H, E), or None where it does not
        compute exactly what the module does."""
        return None

    def attend_latent(
        self,
        layer: int,
        q_abs: torch.Tensor,
        latent: torch.Tensor | None,
        ctx: Context,
        *,
        kv_lora_rank: int,
        scale: float,
    ) -> torch.Tensor:
        """MLA decode: write ``latent`` (S, C + R), the step's new cache rows (None for a
        cross-layer-sharing consumer, which writes nothing), at ``ctx.slots`` of layer
        ``layer``'s pages of ``ctx.latent_cache``, then attend in latent space: q_abs
        (S, H, C + R) (one query per sequence, absorbed form) -> (S, H, C). As :meth:`attend`,
        the write is the op's so a compiled step can make both one mutating custom op. The
        default: ``index_copy_``, then :func:`lmforge.kernels.mla_decode.mla_decode` (the
        Triton kernel where it runs, its torch reference elsewhere)."""
        from lmforge.kernels.mla_decode import mla_decode

        assert ctx.latent_cache is not None
        pages = ctx.latent_cache[layer]  # (NB, BS, C+R)
        if latent is not None:
            pages.view(-1, pages.shape[-1]).index_copy_(0, ctx.slots, latent.to(pages.dtype))
        return mla_decode(
            q_abs, pages, ctx.block_tables, ctx.ctx_lens, kv_lora_rank=kv_lora_rank, scale=scale
        )

    def attend_sparse(
        self,
        attn: nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        iq: torch.Tensor,
        ik: torch.Tensor,
        iw: torch.Tensor,
        ctx: Context,
    ) -> torch.Tensor:
        """DeepSeek sparse attention (S layers): write k, v (N, K, E) and the indexer keys ik
        (N, E_I) at ``ctx.slots`` of ``attn``'s K/V and indexer-key pages, then each query
        attends to its top-k keys by indexer score -> (N, H, E). The default:
        :func:`lmforge.model.sparse_attention.paged_sparse_attention` (decode steps on the
        device only, others sequence by sequence); a compiled step makes a decode one mutating
        custom op (its writes in place, not a functional copy of the pages)."""
        return attn.paged(q, k, v, iq, ik, iw, ctx)  # type: ignore[operator]

    def attend_window(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: Context,
        window: int,
    ) -> torch.Tensor:
        """Sliding-window attention (W layers): write k, v (N, K, E) at ``ctx.slots`` of layer
        ``layer``'s pages, then each query attends to the keys of its last ``window`` positions
        -> (N, H, E). The default: decode steps on the device only
        (:func:`lmforge.model.kv_cache.paged_window_decode`: no host read, so a compiled or
        graph-captured step can run it), other steps sequence by sequence from the host lists
        (:func:`lmforge.model.kv_cache.paged_window_attention`)."""
        if ctx.decode:
            return paged_window_decode(
                q, k, v, ctx.k_cache[layer], ctx.v_cache[layer], ctx.slots, ctx.block_tables,
                ctx.ctx_lens, window,
            )  # fmt: skip
        return paged_window_attention(q, k, v, layer, ctx, window)


@dataclasses.dataclass
class Context:
    """One step over a paged KV cache: N tokens of S sequences, flattened (no padding).

    Sequence i owns the next ``q_lens[i]`` rows of the step; after the step it has
    ``ctx_lens[i]`` tokens cached (this step's included). Decode steps (one token per sequence,
    the compiled and CUDA-graph case) leave the host-side lists None.
    """

    positions: torch.Tensor
    "(N,) long RoPE positions"
    slots: torch.Tensor
    "(N,) long flat KV slots (block · BS + offset) the tokens' keys/values go to"
    block_tables: torch.Tensor
    "(S, M) int32 block tables, padded with any valid block"
    ctx_lens: torch.Tensor
    "(S,) int32 tokens cached per sequence after this step"
    k_cache: torch.Tensor
    "(L, NB, BS, K, E) keys (L: the K/V-keeping layers, CLA producers only)"
    v_cache: torch.Tensor
    "(L, NB, BS, K, E) values"
    ops: StepOps
    "the kernels (see StepOps)"
    last_rows: torch.Tensor | None = None
    "(S,) long: logits only for these rows (each sequence's last token); None: every row"
    decode: bool = False
    "every sequence feeds exactly one token"
    q_lens: Sequence[int] | None = None
    "tokens per sequence this step (host ints; None in decode steps)"
    ctx_lens_list: Sequence[int] | None = None
    "ctx_lens as host ints (None in decode steps)"
    tables_list: Sequence[Sequence[int]] | None = None
    "block tables as host lists (None in decode steps)"
    plan: Any = None
    "the step's prefill tile list for a varlen kernel, built once per step (ops-specific)"
    latent_cache: torch.Tensor | None = None
    "(L_kv, NB, BS, C + R) MLA latents (:class:`~lmforge.model.mla.PagedLatentCache`; L_kv the"
    " KV-producing layers under CLA); k_cache/v_cache are then empty"
    states: Any = None
    "the step's recurrent-state slots (:class:`~lmforge.model.linear_attention.StepStates`) for"
    " linear layers (G, M, L); None for a model without them"
    index_cache: torch.Tensor | None = None
    "(L_S, NB, BS, E_I) indexer keys of the DSA (S) layers, in the K/V's blocks and slots;"
    " None for a model without S layers"
    ring: Context | None = None
    "the W layers' view of the step where W layers sit beside A/S layers: the same step over"
    " their per-sequence rings (:meth:`~lmforge.model.linear_attention.StatePool.ring_context`:"
    " cyclic block tables, ring slots, the rings as k_cache/v_cache); None otherwise"
