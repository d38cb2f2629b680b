"""The decode step through ``torch.compile``: inductor fuses the model's elementwise chains.

The engine's eager decode step runs the model's reference modules, so every RMSNorm, RoPE and
SwiGLU is a chain of small elementwise kernels (~50 per layer); at batch 1 a step is launch
bound even inside a CUDA graph. Here the model's own forward (``TransformerLM.forward`` with a
decode :class:`~lmforge.model.context.Context`: every model switch, as in training) is traced
by dynamo and compiled by inductor, which fuses those chains into a few Triton kernels per
layer around the GEMMs. The kernels below reach the model through the context's ops
(:class:`DecodeOps`). The paged KV write + attention is one opaque custom op
(``lmforge_serve::decode_attention``, mutating the caches): dynamo does not trace into the
Triton kernel or the torch reference, and inductor writes the pages in place (no functional
copy of the cache). Shapes are dynamic (one compile serves every batch bucket; batch
1 gets its own specialisation), and :class:`~lmforge.serve.cuda_graphs.DecodeGraphs` captures
the compiled step per bucket like the eager one.

Cross-layer KV sharing (``kv_share_every`` k > 1) takes the same step: a GQA consumer layer
passes no K/V to ``decode_attention`` (it reads its producer's pages, cache layer i // k,
written earlier in the same step) and stays off the fused RoPE + KV-write op (its q projection
still takes the decode GEMV); the cache tensors hold the producing layers only.

MLA and hybrid models take the same step. An MLA layer's decode (the latent write of a
producing layer, none for a CLA consumer, then the absorbed attention in latent space: the
Triton latent kernel on CUDA) is one mutating custom op over the latent cache,
``lmforge_serve::mla_decode_attention``; its projections, RMSNorm, RoPE and the absorption
einsums are traced. A W layer's sliding-window decode is ``lmforge_serve::window_decode_attention``
(the paged decode kernel with the window: the blocks before it are skipped; off the kernel, the
pages' last ceil((window − 1) / BS) + 1 blocks gathered on the device). A linear layer's
(G, M, L) step reads its sequences' conv states by a traced gather from the state pool at the
step's ``state_slots`` (a device tensor, staged like the block tables, so a CUDA graph replays
it from a static buffer) and writes them back with ``lmforge_serve::write_rows``; the matrix
state's read, recurrence (the fused Triton step kernel on CUDA) and write are one op,
``lmforge_serve::slot_recurrence`` (:class:`CompiledSlotOps`); all mutate the pool in place.
Slots of sequences starting at token 0 are zeroed before the step, outside it. MLA and linear
layers have no q/k/v to pack and stay off the decode GEMV and its fused RoPE kernel (an MLA
block's SwiGLU and the LM head still take them); a linear layer's FFN runs as its module.
DSA (S) layers stay eager (:class:`~lmforge.serve.model_runner.ModelRunner` says why).

Prefill (mixed) steps: the same forward, compiled once more (:func:`mixed_forward`, its own
dynamic graph; :meth:`CompiledDecode.mixed`), so a step that admits a prompt among running
decodes is not ~1,200 eager launches (on the H200, ~27 ms for TinyLlama's shape against a ~2.4
ms decode step at batch 64: every arrival stalled every stream). The paged KV write + varlen
prefill attention is one mutating custom op, ``lmforge_serve::prefill_attention``; the step's
chunk and context lengths and the prefill kernel's tile list reach it as tensors (a CPU int64
``meta``, the tiles on the device), so no host list is a graph constant and one graph serves
every mix of chunk lengths (a lone sequence is padded with a one-token scratch sequence: size 1
would be a graph of its own). Full-attention GQA/MHA models only: W, S, G/M/L and MLA layers read
the step's host lists in prefill, so their mixed steps stay eager; so do steps with image rows.

Packed projections: at batch 1 the small K/V GEMVs cost a launch each, not bandwidth, so each
layer's q/k/v weights (and a SwiGLU's w1/w3) are moved into one contiguous (H·E + 2·K·E, D)
(resp. (2F, D)) tensor and the model's parameters become row views of it: one GEMM where
there were three (two), no second copy of the weights, and
:meth:`~lmforge.serve.engine.Engine.update_weights` (which copies into the parameters) writes
through to the packed tensor. Layers of another kind (an MoE FFN) run their own modules.

Decode GEMVs: at batch <= 8 on CUDA the projections (packed q/k/v, o, packed w1/w3, w2, the LM
head) run the own Triton GEMV (:mod:`lmforge.serve._gemv_triton`) instead of cuBLAS: one more
custom op, ``lmforge_serve::gemv``, returning fp32 split-K partial sums (SPLIT, S, N) that the
traced code adds (``.sum(0)``: inductor unrolls it into the consumer's kernel). Which projection
uses it is decided once per engine (:func:`gemv_plan`: a plain Linear, a half-precision weight,
a shape the kernel's table does not route to cuBLAS) and passed in as constants, so the batches
<= 8 and the larger ones are two compiled graphs; larger batches and the CPU keep cuBLAS/torch.
With the q/k/v GEMV on (and no muP q scale, which the fused kernel does not apply), its partial
sums go straight into ``lmforge_serve::rope_decode_attention``: one kernel adds them, applies QK-norm (Qwen3) and
RoPE to q and k and writes k/v into the pages (:mod:`lmforge.serve._rope_kv_triton`: no
separate RoPE kernel, no ``index_copy``), then the paged decode attention, in the same
mutating op as the unfused path.

Quantized KV caches (fp8/int8 rows with their scale, :mod:`lmforge.serve.attention`) pass
through the same two cache tensors and op schemas (their last dim is E + 4, their dtype says the
format): ``decode_attention`` quantizes in its ``write_kv`` and the decode kernel dequantizes in
registers; the fused RoPE + write op is not taken for them (it stores plain rows only).

Fallback: if compiling or running the compiled step fails, one line on stderr says so and the
engine decodes eagerly from then on; a failure on the decode GEMV's path first drops the GEMV
(one line) and reruns the step on cuBLAS. (Compiling happens at warm-up, on the scratch block
and the scratch state slot; a failure part-way through a real step's run would advance a
hybrid's recurrent states twice, as no step is transactional.)

Shape legend: N tokens (= S sequences in decode), D model dim, H heads, K kv-heads, E head dim,
V vocab, L layers, NB blocks, BS block size, M table width.
Exercised by ``pytest tests/test_serve_compiled.py tests/test_serve_compiled_hybrid.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model import mup
from lmforge.model.attention import CausalSelfAttention
from lmforge.model.context import Context, PagedKVCache, StepOps
from lmforge.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, _bare, _fusable
from lmforge.model.linear_attention import SlotOps, StatePool, StepStates, slot_recurrence
from lmforge.model.mla import PagedLatentCache, write_latent
from lmforge.model.sparse_attention import paged_sparse_attention, paged_sparse_decode
from lmforge.serve.attention import (
    paged_decode,
    paged_prefill,
    paged_window_decode_step,
    prefill_kernel_on,
    prefill_plan,
    write_kv,
)
from lmforge.serve.step import StepBatch, forward_step

__all__ = ["CompiledDecode", "CompiledSlotOps", "decode_forward", "gemv_plan", "pack_weights"]

GEMV_MAX_ROWS = 8  # the decode GEMV's batches (buckets 1, 2, 4, 8); larger ones are GEMMs
GEMV_DTYPES = (torch.bfloat16, torch.float16)  # fp32 runs too (tests), but cuBLAS stays its path


@torch.library.custom_op("lmforge_serve::decode_attention", mutates_args=("k_cache", "v_cache"))
def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    use_triton: int,
) -> torch.Tensor:
    """Write layer ``layer``'s new K/V (S, K, E) at ``slots`` of the (L, NB, BS, K, E) caches
    (None: a CLA consumer, which reads its producer's pages and writes nothing), then decode
    attention for q (S, H, E) -> (S, H, E). ``use_triton``: -1 auto, 0 no, 1 yes."""
    kc, vc = k_cache[layer], v_cache[layer]
    if k is not None and v is not None:
        write_kv(kc, vc, slots, k, v)
    flag = None if use_triton < 0 else bool(use_triton)
    return paged_decode(q, kc, vc, block_tables, ctx_lens, use_triton=flag).contiguous()


@_decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, layer, slots, block_tables, ctx_lens, use_triton):
    return q.new_empty(q.shape)  # contiguous, as the real op returns (inductor checks strides)


@torch.library.custom_op("lmforge_serve::prefill_attention", mutates_args=("k_cache", "v_cache"))
def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    plan_ints: torch.Tensor,
    meta: torch.Tensor,
    use_triton: int,
) -> torch.Tensor:
    """A prefill (mixed) step's attention: write layer ``layer``'s new K/V (N, K, E) at
    ``slots``, then varlen paged prefill for q (N, H, E) -> (N, H, E). The step's host facts
    travel as tensors, so one compiled graph serves every mix of chunk lengths: ``meta`` is a
    CPU int64 tensor ``[n_long, n_short, block_m, q_lens (S), ctx_lens (S)]`` and
    ``plan_ints`` the prefill kernel's tile list on the device (:class:`PrefillPlan`'s
    ``ints``; empty: the torch path). ``k``/``v`` None: a CLA consumer (reads the pages its
    producer wrote earlier in the step). ``use_triton``: -1 auto, 0 no, 1 yes."""
    from lmforge.serve._prefill_triton import PrefillPlan

    kc, vc = k_cache[layer], v_cache[layer]
    if k is not None and v is not None:  # (a CLA consumer reads its producer's pages only)
        write_kv(kc, vc, slots, k, v)
    s = block_tables.shape[0]
    m = meta.tolist()  # a CPU tensor: no device read
    q_lens, ctx = m[3 : 3 + s], m[3 + s :]
    plan = PrefillPlan(plan_ints, s, m[0], m[1], m[2]) if plan_ints.numel() else None
    flag = None if use_triton < 0 else bool(use_triton)
    return paged_prefill(
        q, kc, vc, None, q_lens, ctx, block_table_tensor=block_tables, ctx_lens_tensor=ctx_lens,
        plan=plan, use_triton=flag if plan is not None else False,
    ).contiguous()  # fmt: skip


@_prefill_attention.register_fake
def _(q, k, v, k_cache, v_cache, layer, slots, block_tables, ctx_lens, plan_ints, meta,
      use_triton):  # fmt: skip
    return q.new_empty(q.shape)


@torch.library.custom_op("lmforge_serve::mla_decode_attention", mutates_args=("cache",))
def _mla_decode_attention(
    q_abs: torch.Tensor,
    latent: torch.Tensor | None,
    cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    use_triton: int,
) -> torch.Tensor:
    """MLA decode: write ``latent`` (S, C + R) (None: a CLA consumer writes nothing) at
    ``slots`` of layer ``layer`` of the (L_kv, NB, BS, C + R) latent cache, then absorbed
    attention for q_abs (S, H, C + R) -> (S, H, C) (:func:`lmforge.kernels.mla_decode.mla_decode`:
    the Triton kernel on CUDA). ``use_triton``: -1 auto, 0 no, 1 yes."""
    from lmforge.kernels.mla_decode import mla_decode

    pages = cache[layer]  # (NB, BS, C+R)
    if latent is not None:
        write_latent(pages, slots, latent)
    flag = None if use_triton < 0 else bool(use_triton)
    return mla_decode(q_abs, pages, block_tables, ctx_lens, kv_lora_rank=kv_lora_rank,
                      scale=scale, use_triton=flag).contiguous()  # fmt: skip


@_mla_decode_attention.register_fake
def _(q_abs, latent, cache, layer, slots, block_tables, ctx_lens, kv_lora_rank, scale,
      use_triton):  # fmt: skip
    return q_abs.new_empty((*q_abs.shape[:2], kv_lora_rank))


@torch.library.custom_op(
    "lmforge_serve::window_decode_attention", mutates_args=("k_cache", "v_cache")
)
def _window_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    window: int,
    use_triton: int,
) -> torch.Tensor:
    """A W layer's decode, :func:`~lmforge.serve.attention.paged_window_decode_step`, on layer
    ``layer``'s pages of the (L, NB, BS, K, E) caches -> (S, H, E). ``use_triton``: -1 auto,
    0 no, 1 yes."""
    flag = None if use_triton < 0 else bool(use_triton)
    return paged_window_decode_step(
        q, k, v, k_cache[layer], v_cache[layer], slots, block_tables, ctx_lens, window,
        use_triton=flag,
    ).contiguous()  # fmt: skip


@_window_decode_attention.register_fake
def _(q, k, v, k_cache, v_cache, layer, slots, block_tables, ctx_lens, window, use_triton):
    return q.new_empty(q.shape)


@torch.library.custom_op(
    "lmforge_serve::sparse_decode_attention", mutates_args=("k_cache", "v_cache", "index_cache")
)
def _sparse_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    iq: torch.Tensor,
    ik: torch.Tensor,
    iw: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index_cache: torch.Tensor,
    layer: int,
    index_layer: int,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    topk: int,
    gqa: bool,
) -> torch.Tensor:
    """An S layer's decode: :func:`~lmforge.model.sparse_attention.paged_sparse_decode` on
    layer ``layer``'s K/V pages of the (L, NB, BS, K, E) caches and layer ``index_layer``'s
    indexer-key pages of the (L_S, NB, BS, E_I) cache, written in place -> (S, H, E)."""
    return paged_sparse_decode(
        q, k, v, iq, ik, iw, k_cache[layer], v_cache[layer], index_cache[index_layer], slots,
        block_tables, ctx_lens, topk, gqa,
    ).contiguous()  # fmt: skip


@_sparse_decode_attention.register_fake
def _(q, k, v, iq, ik, iw, k_cache, v_cache, index_cache, layer, index_layer, slots,
      block_tables, ctx_lens, topk, gqa):  # fmt: skip
    return q.new_empty(q.shape)


@torch.library.custom_op("lmforge_serve::slot_recurrence", mutates_args=("pool",))
def _slot_recurrence(
    pool: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """A linear layer's recurrence over its slot states (read, one token, written back in
    place): :func:`~lmforge.model.linear_attention.slot_recurrence` -> o (S, H, V)."""
    return slot_recurrence(pool, slots, q, k, v, g, beta, scale).contiguous()


@_slot_recurrence.register_fake
def _(pool, slots, q, k, v, g, beta, scale):
    return v.new_empty(v.shape)  # o in v's dtype, as the kernels return it


@torch.library.custom_op("lmforge_serve::write_rows", mutates_args=("pool",))
def _write_rows(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[slots] = rows, in place (a linear layer's conv states)."""
    pool.index_copy_(0, slots, rows.to(pool.dtype))


@_write_rows.register_fake
def _(pool, slots, rows):
    return None


class CompiledSlotOps(SlotOps):
    """:class:`~lmforge.model.linear_attention.SlotOps` as opaque mutating custom ops: the
    state pool is updated in place inside the compiled step (a traced ``index_copy_`` on it
    would be functionalised into a copy of the whole pool)."""

    def recur(
        self,
        pool: torch.Tensor,
        slots: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None,
        beta: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        return torch.ops.lmforge_serve.slot_recurrence(pool, slots, q, k, v, g, beta, scale)

    def write_rows(self, pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        torch.ops.lmforge_serve.write_rows(pool, slots, rows)


@torch.library.custom_op("lmforge_serve::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, w: torch.Tensor, split: int) -> torch.Tensor:
    """x (S, D_in) @ w (D_out, D_in)ᵀ by the Triton decode GEMV: fp32 partial sums
    (split, S, D_out), a fresh contiguous buffer (tiles from the kernel's table for w's shape;
    the split is an argument, so the traced shape and the launch always agree)."""
    from lmforge.serve._gemv_triton import gemv_partials

    return gemv_partials(x, w, split=split)


@_gemv_op.register_fake
def _(x, w, split):
    return x.new_empty((split, x.shape[0], w.shape[0]), dtype=torch.float32)


@torch.library.custom_op(
    "lmforge_serve::rope_decode_attention", mutates_args=("k_cache", "v_cache")
)
def _rope_decode_attention(
    qkv_partials: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    n_heads: int,
    use_triton: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """decode_attention from the packed q/k/v GEMV's partial sums (SPLIT, S, (H + 2K)·E): one
    kernel adds them, applies QK-norm (gains ``q_norm``/``k_norm``, or None) and RoPE to q and
    k and writes k and v at ``slots`` of layer ``layer``'s pages
    (:mod:`lmforge.serve._rope_kv_triton`), then paged decode attention -> (S, H, E)."""
    from lmforge.serve._rope_kv_triton import rope_write_kv

    kc, vc = k_cache[layer], v_cache[layer]
    q = rope_write_kv(qkv_partials, cos, sin, positions, slots, kc, vc, n_heads, kc.dtype,
                      q_norm, k_norm, eps)  # fmt: skip
    flag = None if use_triton < 0 else bool(use_triton)
    return paged_decode(q, kc, vc, block_tables, ctx_lens, use_triton=flag).contiguous()


@_rope_decode_attention.register_fake
def _(qkv_partials, cos, sin, positions, k_cache, v_cache, layer, slots, block_tables, ctx_lens,
      n_heads, use_triton, q_norm, k_norm, eps):  # fmt: skip
    s, e = qkv_partials.shape[1], k_cache.shape[-1]
    return qkv_partials.new_empty((s, n_heads, e), dtype=k_cache.dtype)


def gemv(x: torch.Tensor, w: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """x (S, D_in) @ wᵀ -> (S, D_out) in x's dtype through ``lmforge_serve::gemv`` (fp32
    accumulation, the partial sums added here: inside torch.compile, in the consumer's kernel).
    ``split`` None: the table's for w's shape."""
    if split is None:
        from lmforge.serve._gemv_triton import gemv_config

        cfg = gemv_config(w.shape[0], w.shape[1], w.device)
        assert cfg is not None, f"no decode GEMV for a {tuple(w.shape)} weight"
        split = cfg.split
    return torch.ops.lmforge_serve.gemv(x, w, split).sum(0).to(x.dtype)


# first Linear of a packed group -> the packed tensor (another engine on the model reuses it)
_PACKED: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()
# first quantized linear of a stacked group -> the stacked module (reused likewise)
_STACKED: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()

# a layer's packed q/k/v or w1/w3: one weight tensor (plain Linears) or one stacked quantized
# linear (the quantized formats' ``stack_rows``), None where the modules do not pack
Packed = torch.Tensor | nn.Module | None


def _pack_rows(linears: list[nn.Module]) -> torch.Tensor:
    """Move the weights of ``linears`` (same D, same dtype/device) into one (ΣN, D) tensor and
    make each ``weight`` a row view of it; returns the packed tensor (the existing one if a
    previous engine on this model packed them already, so both see the same weights)."""
    prev = _PACKED.get(linears[0])
    if prev is not None and all(
        lin.weight.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
        for lin in linears
    ):
        return prev
    with torch.no_grad():
        packed = torch.cat([lin.weight for lin in linears])  # (ΣN, D)
        start = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight.data = packed[start : start + rows]
            start += rows
    _PACKED[linears[0]] = packed
    return packed


def _stack_quantized(mods: list[nn.Module]) -> nn.Module | None:
    """The quantized linears ``mods`` stacked into one module (the formats' ``stack_rows``: its
    buffers hold the rows once, each module's are views of them), or None: not all one
    quantized format with the same settings, or one has hooks (calling the stack would skip
    them). A previous engine's stack is reused while the modules still view it."""
    stack = getattr(type(mods[0]), "stack_rows", None)
    if stack is None or not all(_bare(m) for m in mods):
        return None
    prev = _STACKED.get(mods[0])
    if prev is not None and all(
        m.qweight.untyped_storage().data_ptr() == prev.qweight.untyped_storage().data_ptr()
        for m in mods
    ):
        return prev
    out = stack(mods)
    if out is not None:
        _STACKED[mods[0]] = out
    return out


def _pack(mods: list[nn.Module]) -> Packed:
    if _fusable(*mods):
        return _pack_rows(mods)
    return _stack_quantized(mods)


def pack_weights(model: nn.Module) -> list[tuple[Packed, Packed]]:
    """Per layer (packed q/k/v, packed w1/w3): a weight tensor for plain Linears, a stacked
    module for quantized ones, None where the layer has no such modules or they do not pack."""
    out: list[tuple[Packed, Packed]] = []
    for layer in model.layers:
        attn, ffn = layer.attn, layer.ffn
        if getattr(layer, "recurrent", False):  # a linear mixer's block: its FFN runs unpacked
            out.append((None, None))
            continue
        # plain Linears pack into one weight, quantized ones of one format into one module (a
        # hooked module runs as itself, unpacked); MLA projects through its own modules (no
        # q/k/v to pack), a CLA consumer has q only
        qkv = None
        if isinstance(attn, CausalSelfAttention) and attn.produces_kv:
            qkv = _pack([attn.q_proj, attn.k_proj, attn.v_proj])
        w13 = _pack([ffn.w1, ffn.w3]) if isinstance(ffn, SwiGLU) else None
        out.append((qkv, w13))
    return out


# per layer (q/k/v, o, w1/w3, w2: the decode GEMV's split-K, 0 = not on the GEMV; RoPE + KV
# write fused after q/k/v) and the LM head's split. The splits are graph constants: an engine
# made under another table traces its own graph.
GemvPlan = tuple[tuple[tuple[int, int, int, int, bool], ...], int]


def gemv_plan(
    model: nn.Module,
    packed: list[tuple[Packed, Packed]] | None,
    dtypes: tuple[torch.dtype, ...] = GEMV_DTYPES,
) -> GemvPlan:
    """Which projections of ``model`` the decode GEMV may compute (their split, else 0): a
    packed q/k/v or w1/w3 tensor, or a plain Linear (no hooks or subclass:
    :func:`~lmforge.model.layers._fusable`), whose weight is in ``dtypes`` and whose shape the
    kernel's table does not give to cuBLAS.
    The fifth flag: q/k/v on the GEMV, the model's own interleaved RoPE and no QK-norm or a
    plain RMSNorm one, so the partial sums go straight into
    ``lmforge_serve::rope_decode_attention``."""
    from lmforge.serve._gemv_triton import gemv_config

    def ok(w: Packed) -> int:
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in dtypes:
            return 0
        cfg = gemv_config(w.shape[0], w.shape[1], w.device)
        return cfg.split if cfg is not None else 0

    def lin(m: nn.Module) -> int:
        return ok(m.weight) if _fusable(m) else 0

    layers = []
    for i, layer in enumerate(model.layers):
        qkv_w, w13 = packed[i] if packed is not None else (None, None)
        ffn = layer.ffn
        w2 = lin(ffn.w2) if w13 is not None else 0
        attn = layer.attn
        if not isinstance(attn, CausalSelfAttention):  # MLA and linear mixers: own modules
            layers.append((0, 0, ok(w13), w2, False))
            continue
        if not attn.produces_kv:  # a CLA consumer: q alone (no K/V to write: never fused)
            layers.append((lin(attn.q_proj), lin(attn.output_proj), ok(w13), w2, False))
            continue
        fuse = (
            (ok(qkv_w) > 0 or _has_gemv(qkv_w))
            and (not attn.config.qk_norm or _plain_qk_norm(attn))
            and (not attn.config.mup or mup.q_scale(attn.config) == 1.0)  # no q scale inside
            and type(attn.rope) is RotaryEmbedding
            and attn.rope.cos.dtype == torch.float32
        )
        layers.append((ok(qkv_w), lin(attn.output_proj), ok(w13), w2, fuse))
    return tuple(layers), lin(model.lm_head)


def _has_gemv(p: Packed) -> bool:
    """Whether a stacked quantized q/k/v has a dequant-fused decode GEMV whose partial sums can
    go to ``rope_decode_attention`` (int4/int8)."""
    return isinstance(p, nn.Module) and getattr(p, "_gemv_partials", None) is not None


def _plain_qk_norm(attn: nn.Module) -> bool:
    """QK-norm the fused kernel computes: RMSNorm modules (the model's, any backend: the same
    math) without hooks, one eps for both."""
    norms = (attn.q_norm, attn.k_norm)
    return (
        all(
            isinstance(m, RMSNorm) and not (m._forward_hooks or m._forward_pre_hooks) for m in norms
        )
        and attn.q_norm.eps == attn.k_norm.eps
    )


class DecodeOps(StepOps):
    """The kernels the model's forward calls in a compiled decode step: the paged KV write +
    decode attention as one mutating custom op, the packed q/k/v and w1/w3 weights, and (with
    a GEMV plan) the decode GEMV for every planned projection and the fused QK-norm + RoPE +
    KV write + attention from the q/k/v partial sums. ``use_triton``: -1 auto, 0 no, 1 yes."""

    def __init__(
        self,
        model: nn.Module,
        use_triton: int,
        packed: list[tuple[Packed, Packed]] | None,
        plan: GemvPlan | None,
    ) -> None:
        self.use_triton = use_triton
        self._packed = packed
        self.plan = plan
        # the decode GEMV's split by weight (shape, dtype), from the plan: the split depends on
        # the shape only, and a Linear the plan kept off for a hook the model never hands to
        # matmul (lmforge.model.layers._fusable)
        self._splits: dict[tuple[int, int, torch.dtype], int] = {}
        if plan is not None:
            for w, split in _plan_weights(model, packed, plan):  # splits > 0 only
                self._splits[(w.shape[0], w.shape[1], w.dtype)] = split

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        ctx: Context,
    ) -> torch.Tensor:
        return torch.ops.lmforge_serve.decode_attention(
            q, k, v, ctx.k_cache, ctx.v_cache, layer, ctx.slots, ctx.block_tables, ctx.ctx_lens,
            self.use_triton,
        )  # (S, H, E)  # fmt: skip

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
        assert ctx.latent_cache is not None
        return torch.ops.lmforge_serve.mla_decode_attention(
            q_abs, latent, ctx.latent_cache, layer, ctx.slots, ctx.block_tables, ctx.ctx_lens,
            kv_lora_rank, scale, self.use_triton,
        )  # (S, H, C)  # fmt: skip

    def attend_window(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: Context,
        window: int,
    ) -> torch.Tensor:
        return torch.ops.lmforge_serve.window_decode_attention(
            q, k, v, ctx.k_cache, ctx.v_cache, layer, ctx.slots, ctx.block_tables, ctx.ctx_lens,
            window, self.use_triton,
        )  # (S, H, E)  # fmt: skip

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
        if not ctx.decode:  # (the compiled step only decodes)
            return paged_sparse_attention(attn, q, k, v, iq, ik, iw, ctx)
        assert ctx.index_cache is not None
        return torch.ops.lmforge_serve.sparse_decode_attention(
            q, k, v, iq, ik, iw, ctx.k_cache, ctx.v_cache, ctx.index_cache, attn.cache_index,
            attn.index_index, ctx.slots, ctx.block_tables, ctx.ctx_lens,
            0 if attn.dense_warmup else attn.topk, attn.n_heads != attn.n_kv_heads,
        )  # (S, H, E)  # fmt: skip

    def packed(self, layer: int) -> tuple[Packed, Packed]:
        return self._packed[layer] if self._packed is not None else (None, None)

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        split = self._splits.get((w.shape[0], w.shape[1], w.dtype), 0)
        if not split:
            return None
        y = gemv(x.reshape(-1, x.shape[-1]), w, split)  # (S, D_out)
        return y.view(*x.shape[:-1], w.shape[0])

    def module_matmul(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """An int4/int8 linear in a GEMV step (≤ 8 rows): its dequant-fused GEMV's split-K
        partials, added and cast in the consumer's kernel (the module's ``decode_gemv``)
        instead of two more kernels in its module's op."""
        fn = getattr(m, "decode_gemv", None)
        return None if self.plan is None or fn is None else fn(x)

    def fused_attention(
        self, attn: nn.Module, h: torch.Tensor, ctx: Context
    ) -> torch.Tensor | None:
        if self.plan is None or self._packed is None:
            return None
        layer = attn.layer_idx
        g_qkv, _, _, _, fuse = self.plan[0][layer]
        # a quantized cache (fp8/int8, or any dtype not the model's) takes the unfused op: its
        # write_kv quantizes in torch; the fused kernel stores plain rows only
        if not fuse or ctx.k_cache.dtype != h.dtype:
            return None
        qkv = self._packed[layer][0]
        if isinstance(qkv, torch.Tensor):
            parts = torch.ops.lmforge_serve.gemv(h, qkv, g_qkv)  # (SPLIT, S, (H+2K)·E)
        else:  # a stacked quantized q/k/v: its dequant-fused GEMV's partials
            parts = qkv.decode_partials(h)
            if parts is None:
                return None
        qn = (attn.q_norm.weight, attn.k_norm.weight) if attn.config.qk_norm else (None, None)
        eps = attn.q_norm.eps if attn.config.qk_norm else 0.0
        return torch.ops.lmforge_serve.rope_decode_attention(
            parts, attn.rope.cos,
            attn.rope.sin, ctx.positions, ctx.k_cache, ctx.v_cache, attn.cache_index, ctx.slots,
            ctx.block_tables, ctx.ctx_lens, attn.n_heads, self.use_triton, *qn, eps,
        )  # (S, H, E)  # fmt: skip


class MixedOps(DecodeOps):
    """The kernels of a compiled prefill (mixed) step: :class:`DecodeOps`' packed q/k/v and
    w1/w3 weights (cuBLAS GEMMs: no decode GEMV, no fused RoPE kernel), and the paged KV write +
    varlen prefill attention as one mutating custom op, ``lmforge_serve::prefill_attention``,
    whose host facts (chunk and context lengths, the kernel's tiles) come in as tensors on the
    context (``ctx.plan`` = (plan_ints, meta)). Full-attention GQA/MHA layers only, CLA
    consumers included (:meth:`CompiledDecode.mixed_ok`); built without a GEMV plan."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        ctx: Context,
    ) -> torch.Tensor:
        plan_ints, meta = ctx.plan
        return torch.ops.lmforge_serve.prefill_attention(
            q, k, v, ctx.k_cache, ctx.v_cache, layer, ctx.slots, ctx.block_tables, ctx.ctx_lens,
            plan_ints, meta, self.use_triton,
        )  # (N, H, E)  # fmt: skip


def _plan_weights(
    model: nn.Module,
    packed: list[tuple[Packed, Packed]] | None,
    plan: GemvPlan,
) -> list[tuple[torch.Tensor, int]]:
    """(weight, split) of every projection the plan puts on the decode GEMV (q/k/v, o, w1/w3,
    w2 per layer, head); a projection off the GEMV (split 0: a quantized or hooked module, which
    may have no ``weight``) is left out."""
    out: list[tuple[torch.Tensor, int]] = []
    for i, (g_qkv, g_o, g_13, g_2, _) in enumerate(plan[0]):
        qkv_w, w13 = packed[i] if packed is not None else (None, None)
        layer = model.layers[i]
        out += [(w, g) for w, g in ((qkv_w, g_qkv), (w13, g_13)) if w is not None and g]
        if isinstance(layer.attn, CausalSelfAttention) and not layer.attn.produces_kv and g_qkv:
            out.append((layer.attn.q_proj.weight, g_qkv))  # a CLA consumer's q projection
        if isinstance(layer.attn, CausalSelfAttention) and g_o:
            out.append((layer.attn.output_proj.weight, g_o))
        if w13 is not None and g_2:
            out.append((layer.ffn.w2.weight, g_2))
    if plan[1]:
        out.append((model.lm_head.weight, plan[1]))
    return out


def decode_forward(
    model: nn.Module,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    ops: DecodeOps,
    latent_cache: torch.Tensor | None = None,
    states: StatePool | None = None,
    state_slots: torch.Tensor | None = None,
    index_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step (one token per sequence, so row i is sequence i's last token) through
    the model's own forward with ``ops``' kernels: logits (S, V) float32. An MLA model passes
    its ``latent_cache`` (L_kv, NB, BS, C + R) (k_cache/v_cache then empty); a hybrid its
    :class:`~lmforge.model.linear_attention.StatePool` and the step's ``state_slots`` (S,),
    reached through :class:`CompiledSlotOps`; a DSA model its indexer-key pages
    ``index_cache`` (L_S, NB, BS, E_I), which the S layers' batched decode selection reads
    (:func:`lmforge.model.sparse_attention.paged_sparse_attention`, tensors only). This is what
    :class:`CompiledDecode` compiles."""
    ctx = Context(positions, slots, block_tables, ctx_lens, k_cache, v_cache, ops, decode=True,
                  latent_cache=latent_cache, index_cache=index_cache)  # fmt: skip
    if states is not None:
        assert state_slots is not None
        ctx.states = StepStates(states, state_slots, CompiledSlotOps())
        if states.ring_k is not None:  # W layers beside A/S layers: their per-sequence rings
            ctx.ring = states.ring_context(ctx, state_slots)
    return model(tokens[None], context=ctx)[0].float()  # (1, S) -> (S, V)


def mixed_forward(
    model: nn.Module,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    last_rows: torch.Tensor,
    plan_ints: torch.Tensor,
    meta: torch.Tensor,
    ops: MixedOps,
) -> torch.Tensor:
    """One prefill (mixed) step, N tokens of S sequences flattened, through the model's own
    forward with ``ops``' kernels: logits (S, V) float32 of the rows ``last_rows``. Every
    host fact of the step is a tensor (``plan_ints`` on the device, ``meta`` on the CPU: see
    ``lmforge_serve::prefill_attention``), so one dynamic graph serves every step. This is
    what :meth:`CompiledDecode.mixed` compiles."""
    ctx = Context(positions, slots, block_tables, ctx_lens, k_cache, v_cache, ops,
                  last_rows=last_rows, plan=(plan_ints, meta))  # fmt: skip
    return model(tokens[None], context=ctx)[0].float()  # (1, S) -> (S, V)


def _first_line(e: BaseException) -> str:
    """``Type: first line of the message``: what the one-line fallback notices print."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


# inductor unrolls a sum of fewer terms than this into its consumer's kernel (its default, 8,
# would leave a split of 8 as one more kernel): above the GEMV's MAX_SPLIT
SUM_UNROLL = 9


def _gemv_dtypes(device: torch.device) -> tuple[torch.dtype, ...] | None:
    """The weight dtypes the decode GEMV takes by default on ``device``: bf16/fp16 on CUDA with
    Triton, none elsewhere (the CPU keeps torch's matmul)."""
    from lmforge.kernels._common import triton_available

    return GEMV_DTYPES if device.type == "cuda" and triton_available() else None


@contextlib.contextmanager
def _trace_settings() -> Iterator[None]:
    """How dynamo traces the step. No duck sizing: a batch that happens to equal another size
    at compile time (the layer count, the table width) must not tie the two together. Int
    arguments specialised: under ``dynamic=True`` the GEMV plan's splits would otherwise become
    symbols, the partials' leading dim unknown, and inductor could not unroll their ``.sum(0)``
    into the consumer (on the H200: 22 more kernels per TinyLlama step)."""
    from torch.fx.experimental import _config

    with _config.patch(use_duck_shape=False), torch._dynamo.config.patch(specialize_int=True):
        yield


def _cache_tensors(
    cache: PagedKVCache | PagedLatentCache,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(k_cache, v_cache, latent_cache) of an engine cache: a latent cache's K/V are empty."""
    if isinstance(cache, PagedLatentCache):
        empty = cache.latent.new_empty(0)
        return empty, empty, cache.latent
    return cache.k, cache.v, None


def engine_copy(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own, for one engine to compile.

    Dynamo keeps its compiled graphs on the code object and stops compiling one after
    ``recompile_limit`` (8) graphs, running it eagerly from then on, silently. Each engine adds
    2–3 graphs of :func:`decode_forward` (batch 1, batches ≥ 2, with and without the GEMV), so
    the third engine built in one process (a benchmark's rows, an evaluation's models, tests)
    used to decode eagerly, 60× slower. A copy per engine keeps each engine's graphs apart, and
    frees them with the engine."""
    copy = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__qualname__, copy.__doc__, copy.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


class CompiledDecode:
    """``batch -> logits`` for decode-only steps: compiled :func:`decode_forward`, or the eager
    :func:`~lmforge.serve.model_runner.forward_step` once compiling has failed.

    ``cache``: the runner's paged K/V cache, or an MLA model's latent cache; ``states``: a
    hybrid model's recurrent-state pool (its slots' reset for sequences starting at token 0
    runs before the compiled step, outside it). ``gemv``: run batches <= GEMV_MAX_ROWS through
    the Triton decode GEMV (None: on CUDA for bf16/fp16 weights; True forces it, fp32
    included: tests, under TRITON_INTERPRET=1 on CPU). ``mixed``: prefill (mixed) steps of
    full-attention models through the compiled :func:`mixed_forward` too (:meth:`mixed`)."""

    def __init__(
        self,
        model: nn.Module,
        cache: PagedKVCache | PagedLatentCache,
        use_triton: bool | None,
        pack: bool = True,
        gemv: bool | None = None,
        states: StatePool | None = None,
        mixed: bool = True,
    ) -> None:
        self.model = model
        self.states = states
        self.packed = pack_weights(model) if pack else None
        for pair in self.packed or []:
            for t in pair:
                if isinstance(t, torch.Tensor):  # the GEMV's launch config: by weight shape
                    torch._dynamo.mark_static(t)
        dev = _cache_tensors(cache)[0].device
        dtypes = _gemv_dtypes(dev) if gemv is None else (*GEMV_DTYPES, torch.float32)
        use = dtypes is not None and gemv is not False
        self.gemv: GemvPlan | None = gemv_plan(model, self.packed, dtypes) if use else None
        self.cache = cache
        self.use_triton = use_triton
        flag = -1 if use_triton is None else int(use_triton)
        self._ops = DecodeOps(model, flag, self.packed, None)  # batches past the GEMV's
        self._gemv_ops = DecodeOps(model, flag, self.packed, self.gemv) if self.gemv else None
        self.failed: str | None = None
        unroll = {"unroll_reductions_threshold": SUM_UNROLL}
        self._fn = torch.compile(engine_copy(decode_forward), dynamic=True, options=unroll)
        # prefill (mixed) steps: full-attention GQA/MHA models without recurrent states
        cfg = model.config
        self.mixed_on = (
            mixed
            and isinstance(cache, PagedKVCache)
            and states is None
            and set(cfg.layer_types) == {"A"}
        )
        self.mixed_failed: str | None = None
        self._mixed_ops = MixedOps(model, flag, self.packed, None)
        self._mixed_fn = torch.compile(engine_copy(mixed_forward), dynamic=True)

    def warmup(self, scratch_block: int, block_size: int) -> None:
        """Compile now (batch 2: the dynamic graph; batch 1: its specialisation) on a dummy
        sequence whose KV goes to ``scratch_block`` (never handed out) and whose recurrent
        state is the pool's scratch slot, so the first request does not wait for the compiler."""
        dev = _cache_tensors(self.cache)[0].device
        with torch.inference_mode():
            for b in (2, 1):
                batch = StepBatch(
                    tokens=torch.zeros(b, dtype=torch.long, device=dev),
                    positions=torch.zeros(b, dtype=torch.long, device=dev),
                    slots=torch.full((b,), scratch_block * block_size, device=dev),
                    block_tables=torch.full((b, 2), scratch_block, dtype=torch.int32, device=dev),
                    ctx_lens=torch.ones(b, dtype=torch.int32, device=dev),
                    last_rows=torch.arange(b, device=dev),
                    q_lens=[1] * b,
                    ctx_lens_list=[1] * b,
                    tables_list=[[scratch_block]] * b,
                )
                if self.states is not None:
                    scratch = self.states.scratch_slot
                    batch.state_slots = torch.full((b,), scratch, dtype=torch.long, device=dev)
                self(batch)

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        if self.states is not None and batch.state_fresh is not None:
            self.states.reset(batch.state_fresh)  # a 1-token prompt's first step: zeroed slots
            batch = dataclasses.replace(batch, state_fresh=None)  # (the fallback must not redo it)
        k_cache, v_cache, latent = _cache_tensors(self.cache)
        while self.failed is None:
            tables = batch.block_tables
            if tables.shape[1] < 2:  # a width of 1 would be one more specialised compile
                tables = F.pad(tables, (0, 1))  # block 0, past ctx_lens: never read
            small = self.gemv is not None and len(batch.q_lens) <= GEMV_MAX_ROWS
            try:
                with _trace_settings():
                    return self._fn(
                        self.model,
                        k_cache,
                        v_cache,
                        batch.tokens,
                        batch.positions,
                        batch.slots,
                        tables,
                        batch.ctx_lens,
                        self._gemv_ops if small else self._ops,
                        latent,
                        self.states,
                        batch.state_slots,
                        getattr(self.cache, "index_k", None),
                    )
            except Exception as e:  # any compile/run failure: said once, then a fallback
                why = _first_line(e)
                if small:  # first the decode GEMV goes (the step is rerun on cuBLAS: the
                    # pages it may have written get the same values again)
                    self.gemv = self._gemv_ops = None
                    print(f"lmforge serve: the decode GEMV failed, using cuBLAS ({why[:300]})",
                          file=sys.stderr)  # fmt: skip
                    continue
                self.failed = why  # then the compiled step: eager from now on
                print(
                    f"lmforge serve: torch.compile of the decode step failed, decoding eagerly "
                    f"({self.failed[:300]})",
                    file=sys.stderr,
                )
        return forward_step(
            self.model, self.cache, batch, use_triton=self.use_triton, states=self.states
        )

    def mixed_ok(self, batch: StepBatch) -> bool:
        """Whether a prefill (mixed) step takes :meth:`mixed`: a full-attention GQA/MHA model
        (CLA included; no MLA, windowed, sparse or linear layers), a compiled prefill step that
        has not failed, and a batch without image rows."""
        return (
            self.mixed_on
            and self.mixed_failed is None
            and batch.image_rows is None
            and batch.mrope_positions is None
        )

    def warmup_mixed(self, scratch_block: int, block_size: int) -> None:
        """Compile the prefill step now (the dynamic graph every mixed step takes) on two dummy
        sequences in ``scratch_block``, so the first prompt does not wait for the compiler."""
        if not self.mixed_on:
            return
        dev = self.cache.k.device
        sb = scratch_block * block_size
        other = sb + min(2, block_size - 1)
        with torch.inference_mode():  # as the engine's steps build their tensors (dynamo guards it)
            batch = StepBatch(
                tokens=torch.zeros(3, dtype=torch.long, device=dev),
                positions=torch.tensor([0, 1, 0], device=dev),
                slots=torch.tensor([sb, sb + min(1, block_size - 1), other], device=dev),
                block_tables=torch.full((2, 2), scratch_block, dtype=torch.int32, device=dev),
                ctx_lens=torch.tensor([2, 1], dtype=torch.int32, device=dev),
                last_rows=torch.tensor([1, 2], device=dev),
                q_lens=[2, 1],
                ctx_lens_list=[2, 1],
                tables_list=[[scratch_block]] * 2,
            )
            self.mixed(batch)

    def mixed(self, batch: StepBatch) -> torch.Tensor:
        """Logits (S, V) of a prefill (mixed) step through the compiled :func:`mixed_forward`, or
        the eager :func:`~lmforge.serve.step.forward_step` once compiling it has failed.

        A step of one sequence gets a one-token sequence in the scratch block beside it (its
        logits dropped), so batch 1 is not a graph of its own; tables narrower than 2 blocks
        are padded as in decode. Dynamo specialises sizes 0 and 1: with these, every mixed
        step after the warm-up reuses its one graph."""
        cache = self.cache
        assert isinstance(cache, PagedKVCache)
        s = len(batch.q_lens)
        tokens, positions, slots = batch.tokens, batch.positions, batch.slots
        tables, ctx_lens, last_rows = batch.block_tables, batch.ctx_lens, batch.last_rows
        q_lens, ctx_list = list(batch.q_lens), list(batch.ctx_lens_list)
        if s == 1:
            scratch, n = cache.num_blocks - 1, tokens.shape[0]
            tokens, positions = F.pad(tokens, (0, 1)), F.pad(positions, (0, 1))
            slots = torch.cat([slots, slots.new_full((1,), scratch * cache.block_size)])
            tables = torch.cat([tables, tables.new_full((1, tables.shape[1]), scratch)])
            ctx_lens = torch.cat([ctx_lens, ctx_lens.new_ones(1)])
            last_rows = torch.cat([last_rows, last_rows.new_full((1,), n)])
            q_lens.append(1)
            ctx_list.append(1)
        if tables.shape[1] < 2:
            tables = F.pad(tables, (0, 1))  # block 0, past ctx_lens: never read
        dev, e = tokens.device, cache.head_dim
        if self.use_triton if self.use_triton is not None else prefill_kernel_on(dev, e):
            plan = prefill_plan(q_lens, ctx_list, dev, head_dim=e)
            plan_ints, head = plan.ints, [plan.n_long, plan.n_short, plan.block_m]
        else:  # the torch path (CPU): no tiles
            plan_ints, head = torch.empty(0, dtype=torch.int32, device=dev), [0, 0, 0]
        meta = torch.tensor(head + q_lens + ctx_list, dtype=torch.long)  # host facts, on the CPU
        try:
            with _trace_settings():
                logits = self._mixed_fn(
                    self.model, cache.k, cache.v, tokens, positions, slots, tables, ctx_lens,
                    last_rows, plan_ints, meta, self._mixed_ops,
                )  # fmt: skip
            return logits[:s]
        except Exception as e:  # said once; the step is rerun eagerly (the same K/V rewritten)
            why = self.mixed_failed = _first_line(e)
            print(
                f"lmforge serve: torch.compile of the prefill step failed, prefilling eagerly "
                f"({why[:300]})",
                file=sys.stderr,
            )
        return forward_step(
            self.model, self.cache, batch, use_triton=self.use_triton, states=self.states
        )
