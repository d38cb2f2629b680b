"""Attention over a paged KV cache: a Triton decode kernel (GQA-aware) and torch references.

Layout (one layer): ``k_cache``, ``v_cache`` are (NB, BS, K, E): NB blocks of BS token slots,
K kv-heads, E head dim. Slot ``b·BS + i`` is offset i of block b. A sequence's block table lists
its blocks in order, so its token j lives in block ``table[j // BS]`` at offset ``j % BS``.

Math (per query head h of sequence s, kv-head ``h // (H/K)``, context length n):
``out = softmax(q·Kᵀ / sqrt(E)) V`` over the sequence's n cached keys; for a chunk of several
queries (prefill), query i sits at position ``n − T + i`` and sees keys ``0 .. n − T + i``.

The decode kernel (:mod:`lmforge.serve._attention_triton`) handles the H/K query heads of a
kv-head group together, so each K/V tile is read once per group (the point of GQA), with an
online softmax over the sequence's blocks (FlashAttention's rescaling), and splits long
contexts over several programs (flash-decoding: partial softmax states combined by a second
kernel) so that batch 1 still fills the GPU. Prefill (chunks of several queries, decode rows
mixed in) runs the varlen paged prefill kernel (:mod:`lmforge.serve._prefill_triton`): one launch
per layer over the query tiles of all the step's sequences, keys read from the pages. Its torch
reference runs one SDPA per sequence, without a dense mask (causal, or causal aligned to the
bottom right after a cached prefix).

Quantized caches (``kv_cache_dtype`` fp8 / int8): a row of a quantized cache is the head's E
values (float8 e4m3 or symmetric int8) followed by its float32 scale in the row's last 4 bytes,
so the cache tensor is (NB, BS, K, E + 4) of ``torch.float8_e4m3fn`` / ``torch.int8`` and
``x ≈ value · scale``. The scale is per token and kv-head (amax of the row / 448 or / 127): a
block's amax would change as tokens are appended to it (rescaling the values already written),
a per-token scale never does, and keeping it beside its values (instead of a separate scale
tensor) lets every op, custom-op schema and CUDA graph keep passing the same two cache tensors.
Writes quantize (:func:`quantize_kv`); the kernels load values and scales and dequantize in
registers (K's scale multiplies the scores, V's the softmax weights); the torch references
dequantize explicitly (:func:`dequantize_kv`).

Shape legend: N tokens in the step, S sequences, H heads, K kv-heads, E head dim, T queries.
Exercised by ``pytest tests/test_serve_attention.py tests/test_serve_prefill.py`` (kernels under
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmforge.model.context import Context, StepOps
from lmforge.model.kv_cache import window_decode as window_decode_reference

if TYPE_CHECKING:
    from lmforge.serve._prefill_triton import PrefillPlan

__all__ = [
    "KV_CACHE_DTYPES",
    "PagedOps",
    "dequantize_kv",
    "kv_cache_dtype",
    "kv_head_dim",
    "kv_quantized",
    "paged_attention_float64",
    "paged_decode",
    "paged_decode_reference",
    "paged_prefill",
    "paged_prefill_reference",
    "prefill_kernel_on",
    "prefill_plan",
    "quantize_kv",
    "write_kv",
]

# --kv-cache-dtype names: the quantized caches' storage dtypes (None: the model's dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}
_QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}  # largest finite value of each format
SCALE_BYTES = 4  # the float32 scale at the end of each quantized row
_MIN_SCALE = 1e-30  # an all-zero row gets this scale (its values are 0 whatever the scale)


def kv_cache_dtype(name: str) -> torch.dtype | None:
    """The storage dtype of ``--kv-cache-dtype name`` (None: the model's); one line if unknown."""
    if name not in KV_CACHE_DTYPES:
        from lmforge.utils.errors import LmforgeError

        raise LmforgeError(
            f"unknown kv cache dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}"
        )
    return KV_CACHE_DTYPES[name]


def kv_quantized(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds quantized rows (values + a float32 scale, see the module doc)."""
    return cache.dtype in _QMAX


def kv_head_dim(cache: torch.Tensor) -> int:
    """The head dim E of a cache (..., E) or a quantized cache (..., E + 4)."""
    return cache.shape[-1] - (SCALE_BYTES if kv_quantized(cache) else 0)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows (..., E) -> quantized rows (..., E + 4) of ``dtype`` (fp8 e4m3 or int8): the values
    ``x / scale`` (int8 rounded to nearest) and the row's float32 ``scale = amax / qmax``."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / _QMAX[dtype]).clamp_min(_MIN_SCALE)  # (..., 1)
    y = xf / scale
    if dtype == torch.int8:
        vals = y.round().clamp(-127, 127).to(torch.int8)
    else:  # e4m3 has no inf: clamp first so rounding never produces NaN
        vals = y.clamp(-448.0, 448.0).to(dtype)
    raw = torch.cat([vals.view(torch.uint8), scale.view(torch.uint8)], dim=-1)  # (..., E + 4)
    return raw.view(dtype)


def dequantize_kv(cache: torch.Tensor) -> torch.Tensor:
    """Quantized rows (..., E + 4) -> float32 (..., E): value · scale (the readable reference
    of the kernels' in-register dequantization)."""
    e = kv_head_dim(cache)
    scale = cache[..., e:].contiguous().view(torch.float32)  # (..., 1)
    return cache[..., :e].float() * scale


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store new keys/values (N, K, E) at flat ``slots`` (N,) of (NB, BS, K, E) caches, or
    quantized (:func:`quantize_kv`) into (NB, BS, K, E + 4) quantized caches."""
    kv_heads, row = k_cache.shape[-2:]
    if kv_quantized(k_cache):  # index_copy_ on bytes: float8 has no CPU index_copy_
        for cache, x in ((k_cache, k), (v_cache, v)):
            q8 = quantize_kv(x, cache.dtype).view(torch.uint8)  # (N, K, E + 4)
            cache.view(torch.uint8).view(-1, kv_heads, row).index_copy_(0, slots, q8)
        return
    k_cache.view(-1, kv_heads, row).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, row).index_copy_(0, slots, v.to(v_cache.dtype))


def _dequant(pages: torch.Tensor) -> torch.Tensor:
    """Gathered pages as they are, or dequantized to float32 if quantized."""
    return dequantize_kv(pages) if kv_quantized(pages) else pages


def _gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` (blocks along dim 0); fp8 pages are gathered as bytes (not every
    device's index kernels take float8)."""
    if cache.dtype == torch.float8_e4m3fn:
        return _gather(cache.view(torch.uint8), index).view(cache.dtype)
    return cache.index_select(0, index) if index.dim() == 1 else cache[index]


def paged_attention_float64(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: Sequence[int],
    ctx_len: int,
) -> torch.Tensor:
    """The plain-math reference for one sequence, in float64: q (T, H, E) -> (T, H, E)."""
    bs, kv_heads = k_cache.shape[1:3]
    e = q.shape[-1]
    h, t = q.shape[1], q.shape[0]
    blocks = torch.tensor(list(block_table)[: math.ceil(ctx_len / bs)], dtype=torch.long)
    k, v = _dequant(_gather(k_cache, blocks)), _dequant(_gather(v_cache, blocks))
    k = k.reshape(-1, kv_heads, e)[:ctx_len].double()  # (n, K, E)
    v = v.reshape(-1, kv_heads, e)[:ctx_len].double()
    k = k.repeat_interleave(h // kv_heads, dim=1)  # (n, H, E)
    v = v.repeat_interleave(h // kv_heads, dim=1)
    scores = torch.einsum("the,nhe->htn", q.double(), k) / math.sqrt(e)  # (H, T, n)
    qpos = torch.arange(ctx_len - t, ctx_len)[:, None]
    allowed = torch.arange(ctx_len)[None, :] <= qpos  # (T, n)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("htn,nhe->the", scores.softmax(-1), v)  # (T, H, E)


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
) -> torch.Tensor:
    """One query per sequence: q (S, H, E), block_tables (S, M) int, ctx_lens (S,) -> (S, H, E).

    Gathers every sequence's M blocks (padding entries may hold any valid block id; slots at or
    past ``ctx_lens`` are masked) and runs torch SDPA. The torch path of decode (CPU, and the
    reference the Triton kernel is tested against).
    """
    s, h, e = q.shape
    _bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    k = _dequant(_gather(k_cache, block_tables)).reshape(s, -1, kv_heads, e)  # (S, M·BS, K, E)
    v = _dequant(_gather(v_cache, block_tables)).reshape(s, -1, kv_heads, e)
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < ctx_lens[:, None]  # (S, M·BS)
    # GQA inside SDPA: repeating the kv-heads first copied the gathered cache G times (on the
    # CPU that copy cost more than the attention itself: 2.5-4x slower at batch 64)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :].to(k.dtype),
        k.transpose(1, 2),  # (S, K, M·BS, E)
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        enable_gqa=h != kv_heads,
    )  # (S, H, 1, E)
    return out[:, :, 0].to(q.dtype)


def paged_prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: Sequence[Sequence[int]] | None,
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    *,
    block_table_tensor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunks of queries (prefill, or decode mixed in): q (N, H, E) -> (N, H, E).

    Sequence i owns the next ``q_lens[i]`` rows of q; its keys are its first ``ctx_lens[i]``
    cached tokens (this chunk's included, already written; ``block_tables`` may be None when
    ``block_table_tensor`` is given). One SDPA call per sequence without
    a dense mask: a chunk that is the whole context (no cached prefix) is plain causal
    attention (``is_causal``, GQA in the kernel: FlashAttention on the GPU); a chunk after a
    cached prefix is causal aligned to the bottom right (``causal_lower_right``: query j sees
    keys up to ``ctx − T + j``). ``block_table_tensor`` (S, M) on q's device, if given, is
    sliced for the block ids instead of copying each list to the device. The torch path of
    :func:`paged_prefill` (CPU) and the reference its Triton kernel is tested against.
    """
    from torch.nn.attention.bias import causal_lower_right

    _n, h, e = q.shape
    bs, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    if block_tables is None:
        assert block_table_tensor is not None, "block tables as lists or as a tensor"
        block_tables = [()] * len(q_lens)  # the ids are sliced from the tensor
    for i, (table, t, ctx) in enumerate(zip(block_tables, q_lens, ctx_lens, strict=True)):
        nb = math.ceil(ctx / bs)
        if block_table_tensor is not None:
            blocks = block_table_tensor[i, :nb]
        else:
            blocks = torch.tensor(list(table[:nb]), dtype=torch.long, device=q.device)
        k = _dequant(_gather(k_cache, blocks)).reshape(-1, kv_heads, e)[:ctx]  # (n, K, E)
        v = _dequant(_gather(v_cache, blocks)).reshape(-1, kv_heads, e)[:ctx]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # (K, n, E)
        qs = q[start : start + t].transpose(0, 1).to(k.dtype)  # (H, T, E); k, v (K, n, E)
        if t == ctx:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=h != kv_heads)
        else:  # repeat the kv-heads: the lower-right kernels take equal head counts
            k = k.repeat_interleave(h // kv_heads, dim=0)  # (H, n, E)
            v = v.repeat_interleave(h // kv_heads, dim=0)
            o = F.scaled_dot_product_attention(
                qs[None], k[None], v[None], attn_mask=causal_lower_right(t, ctx)
            )[0]  # (H, T, E)
        out[start : start + t] = o.transpose(0, 1).to(q.dtype)
        start += t
    return out


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: Sequence[Sequence[int]] | None,
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    *,
    block_table_tensor: torch.Tensor | None = None,
    ctx_lens_tensor: torch.Tensor | None = None,
    plan: PrefillPlan | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Prefill attention (chunks of queries, decode rows mixed in): q (N, H, E) -> (N, H, E).

    The Triton varlen kernel where it runs (``use_triton`` None: on CUDA), else
    :func:`paged_prefill_reference`. The kernel reads the (S, M) int32 ``block_table_tensor`` and
    (S,) int32 ``ctx_lens_tensor`` on q's device (built from the lists when absent) and the step's
    tile list ``plan`` (:func:`prefill_plan`; build it once per step and pass it to every layer).
    """
    global _PREFILL_FAILED
    if use_triton is None:
        use_triton = prefill_kernel_on(q.device, q.shape[-1])
    if not use_triton:
        return paged_prefill_reference(
            q, k_cache, v_cache, block_tables, q_lens, ctx_lens,
            block_table_tensor=block_table_tensor,
        )  # fmt: skip
    from lmforge.serve._prefill_triton import paged_prefill_triton

    if block_table_tensor is None:
        assert block_tables is not None, "block tables as lists or as a tensor"
        width = max(len(t) for t in block_tables)
        rows = [list(t) + [0] * (width - len(t)) for t in block_tables]
        block_table_tensor = torch.tensor(rows, dtype=torch.int32, device=q.device)
    if ctx_lens_tensor is None:
        ctx_lens_tensor = torch.tensor(list(ctx_lens), dtype=torch.int32, device=q.device)
    if plan is None:
        plan = prefill_plan(q_lens, ctx_lens, q.device, head_dim=q.shape[-1])
    try:
        return paged_prefill_triton(q, k_cache, v_cache, block_table_tensor, ctx_lens_tensor, plan)
    except _triton_build_errors() as e:  # a kernel Triton cannot build here: the torch path
        _PREFILL_FAILED = True
        print(f"lmforge.serve: the Triton prefill kernel failed to build ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); prefill runs the torch path",
              file=sys.stderr)  # fmt: skip
        return paged_prefill_reference(
            q, k_cache, v_cache, block_tables, q_lens, ctx_lens,
            block_table_tensor=block_table_tensor,
        )  # fmt: skip


_PREFILL_FAILED = False  # set once the kernel failed to build: later calls skip it
PREFILL_MAX_HEAD_DIM = 256  # the prefill kernel's widest head (larger: the torch path)


def prefill_kernel_on(device: torch.device, head_dim: int) -> bool:
    """Whether :func:`paged_prefill` takes the Triton kernel by default (``use_triton`` None):
    on CUDA with Triton, a head dim it supports, and not after the kernel failed to build."""
    return (
        device.type == "cuda"
        and head_dim <= PREFILL_MAX_HEAD_DIM
        and not _PREFILL_FAILED
        and triton_decode_available(device)
    )


def _triton_build_errors() -> tuple[type[BaseException], ...]:
    """Triton's compile and resource errors (raised at a kernel's first launch), not others."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return (CompilationError, OutOfResources)


def prefill_plan(
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    device: torch.device,
    *,
    head_dim: int = 128,
    block_m: int | None = None,
) -> PrefillPlan:
    """The prefill kernel's tile list for one step (host work + one copy; reuse it per layer).
    ``block_m`` query rows per tile (None: the default for ``head_dim``)."""
    from lmforge.serve._prefill_triton import prefill_plan as build

    return build(q_lens, ctx_lens, device, block_m, head_dim=head_dim)


def triton_decode_available(device: torch.device) -> bool:
    """Whether the Triton kernel can run here (CUDA + triton, or TRITON_INTERPRET=1 + triton)."""
    from lmforge.kernels._common import interpreting, triton_available

    return triton_available() and (device.type == "cuda" or interpreting())


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    *,
    use_triton: bool | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Decode attention (one query per sequence): the Triton kernel where it runs, else torch.
    ``window`` > 0: each query sees its last ``window`` positions only (a W layer)."""
    if use_triton is None:
        use_triton = q.is_cuda and triton_decode_available(q.device)
    if use_triton:
        from lmforge.serve._attention_triton import paged_decode_triton

        return paged_decode_triton(q, k_cache, v_cache, block_tables, ctx_lens, window=window)
    if window:
        return window_decode_reference(q, k_cache, v_cache, block_tables, ctx_lens, window)
    return paged_decode_reference(q, k_cache, v_cache, block_tables, ctx_lens)


def paged_window_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    window: int,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """A W layer's decode step on one layer's (NB, BS, K, E) pages: write k, v (S, K, E) at
    ``slots``, then :func:`paged_decode` with the window (the kernel where it runs, the torch
    reference of :mod:`lmforge.model.kv_cache` else) -> (S, H, E). The eager step and the
    compiled step's custom op both call it."""
    write_kv(k_cache, v_cache, slots, k, v)
    return paged_decode(
        q, k_cache, v_cache, block_tables, ctx_lens, use_triton=use_triton, window=window
    )


class PagedOps(StepOps):
    """The kernels a model's paged forward calls in an eager engine step: write the new keys
    and values into the layer's pages, then the decode kernel (one token per sequence) or the
    varlen prefill kernel (with the step's tile list ``ctx.plan``; None: torch), each with its
    torch fallback. ``use_triton`` None: the kernels where they run (see
    :func:`paged_decode` and :func:`prefill_kernel_on`)."""

    def __init__(self, use_triton: bool | None = None) -> None:
        self.use_triton = use_triton

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        ctx: Context,
    ) -> torch.Tensor:
        """q (N, H, E), k/v (N, K, E) (None: a CLA consumer, which only reads the pages)
        -> (N, H, E); see :meth:`StepOps.attend`."""
        kc, vc = ctx.k_cache[layer], ctx.v_cache[layer]
        if k is not None and v is not None:
            write_kv(kc, vc, ctx.slots, k, v)
        if ctx.decode:
            return paged_decode(
                q, kc, vc, ctx.block_tables, ctx.ctx_lens, use_triton=self.use_triton
            )  # (S, H, E)
        assert ctx.tables_list is not None and ctx.q_lens is not None
        assert ctx.ctx_lens_list is not None
        return paged_prefill(
            q, kc, vc, ctx.tables_list, ctx.q_lens, ctx.ctx_lens_list,
            block_table_tensor=ctx.block_tables, ctx_lens_tensor=ctx.ctx_lens, plan=ctx.plan,
            use_triton=self.use_triton if ctx.plan is not None else False,
        )  # (N, H, E)  # fmt: skip

    def attend_window(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: Context,
        window: int,
    ) -> torch.Tensor:
        """A W layer through the kernels with its window (the blocks before the window are not
        read): decode steps :func:`paged_window_decode_step`, other steps the varlen prefill
        kernel where the step has its tile list, else :meth:`StepOps.attend_window`."""
        kc, vc = ctx.k_cache[layer], ctx.v_cache[layer]
        if ctx.decode:
            return paged_window_decode_step(
                q, k, v, kc, vc, ctx.slots, ctx.block_tables, ctx.ctx_lens, window,
                use_triton=self.use_triton,
            )  # (S, H, E)  # fmt: skip
        if ctx.plan is None:
            return super().attend_window(layer, q, k, v, ctx, window)
        write_kv(kc, vc, ctx.slots, k, v)
        from lmforge.serve._prefill_triton import paged_prefill_triton

        try:
            return paged_prefill_triton(
                q, kc, vc, ctx.block_tables, ctx.ctx_lens, ctx.plan, window=window
            )  # (N, H, E)
        except _triton_build_errors():  # the torch path (it writes the same keys again)
            return super().attend_window(layer, q, k, v, ctx, window)
