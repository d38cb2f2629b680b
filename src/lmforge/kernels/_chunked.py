"""What the chunked linear-attention ops share, written once: the gated delta rule
(``gated_delta.py``) and decayed linear attention / Mamba-2 SSD (``ssd.py``).

Input checks and backend choice, the per-sequence loop of the torch paths over a batch or packed
(``cu_seqlens``) sequences, the packing of a call for the Triton kernels (one token axis, offsets,
autocast's matmul dtype, float32 gates and states) and the autograd of their custom ops (save the
inputs, recompute in the backward op). Imports no Triton; the kernels' own shared launch
bookkeeping is ``_chunked_triton.py``. Exercise: ``pytest tests/test_kernels_gated_delta.py
tests/test_kernels_ssd.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor

from lmforge.kernels._common import KernelUnsupportedError, autocast_dtype, check_triton_tensors

BACKENDS = ("auto", "triton", "torch", "reference")


def acc_dtype(x: Tensor) -> torch.dtype:
    """The torch paths' accumulation dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def segments(cu_seqlens: Tensor | None, batch: int, length: int) -> list[tuple[int, int]]:
    """[start, end) of every sequence on the flattened token axis."""
    if cu_seqlens is None:
        return [(i * length, (i + 1) * length) for i in range(batch)]
    return list(itertools.pairwise(cu_seqlens.tolist()))


def flatten(x: Tensor) -> Tensor:
    """(B, T, H, ...) → (B·T, H, ...): packed sequences are one token axis."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    beta: Tensor | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
) -> int:
    """Validate shapes of a chunked call; returns the number of sequences N. One clear
    ValueError naming the mismatch otherwise."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(
            f"q and k must both be (B, T, H, K), got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    B, T, H, _ = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be (B, T, H, V) = ({B}, {T}, {H}, V), got {tuple(v.shape)}")
    for name, t in (("g", g), ("beta", beta)):
        if t is not None and t.shape != (B, T, H):
            raise ValueError(f"{name} must be (B, T, H) = ({B}, {T}, {H}), got {tuple(t.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be 1 (packed), got B = {B}")
        # The values are read back from the device, so not while torch.compile traces.
        bad = cu_seqlens.dim() != 1 or (
            not torch.compiler.is_compiling()
            and (cu_seqlens[0].item() != 0 or cu_seqlens[-1].item() != T)
        )
        if bad:
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at T = {T}")
        n = cu_seqlens.numel() - 1
    else:
        n = B
    if initial_state is not None and initial_state.shape != (n, H, q.shape[-1], v.shape[-1]):
        raise ValueError(
            f"initial_state must be (N, H, K, V) = ({n}, {H}, {q.shape[-1]}, {v.shape[-1]}), "
            f"got {tuple(initial_state.shape)}"
        )
    return n


def check_chunk_size(chunk_size: int) -> None:
    """The kernels' chunk: a power of two ≥ 16 (a tensor-core tile edge)."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two ≥ 16, got {chunk_size}")


def resolve_backend(backend: str, *tensors: Tensor) -> str:
    """``auto`` → ``triton`` where the Triton kernels can run these tensors (CUDA, or the CPU
    interpreter), else ``torch``; other names are checked and returned."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "auto":
        return backend
    try:
        check_triton_tensors("chunked linear attention", *tensors)
    except KernelUnsupportedError:
        return "torch"
    return "triton"


def per_sequence(
    one: Callable[..., tuple[Tensor, Tensor]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: list[Tensor],
    *,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """The torch paths' driver: ``one(q, k, v, *gates, S) -> (o, S)`` on each sequence's tokens
    (T_n, H, ·) from its initial state S (H, K, V) (zeros when none is given), in the inputs'
    accumulation dtype. Returns (o (B, T, H, V) in v's dtype, final states (N, H, K, V) or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = acc_dtype(q)
    flat = [flatten(x).to(acc) for x in (q, k, v, *gates)]  # (B·T, H, ·) and (B·T, H)
    outs, finals = [], []
    for i, (start, end) in enumerate(segments(cu_seqlens, B, T)):
        S = (
            initial_state[i].to(acc)
            if initial_state is not None
            else torch.zeros(H, K, V, dtype=acc, device=q.device)
        )  # (H, K, V)
        o, S = one(*(x[start:end] for x in flat), S)
        outs.append(o)
        finals.append(S)
    o = torch.cat(outs).reshape(B, T, H, V).to(v.dtype)
    return o, torch.stack(finals) if output_final_state else None


def triton_operands(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gates: list[Tensor],
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
) -> tuple[list[Tensor], Tensor | None, Tensor, int]:
    """A call packed for the kernels: ([q, k (B·T, H, K), v (B·T, H, V) in autocast's matmul
    dtype (else q's), gates (B·T, H) float32], h0 float32 or None, cu (N + 1,) int32, seq_len:
    T for a batch of equal lengths (chunk tables built on the device, no host sync), else 0)."""
    check_triton_tensors("chunked linear attention", q, k, v)
    B, T = q.shape[:2]
    if cu_seqlens is None:
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)  # (B + 1,)
    else:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    dt = autocast_dtype(q.device.type) or q.dtype  # the kernels' matmul dtype, as autocast's
    mats = [flatten(x).to(dt).contiguous() for x in (q, k, v)]  # (B·T, H, ·)
    mats += [flatten(x).float().contiguous() for x in gates]  # (B·T, H)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    return mats, h0, cu, T if cu_seqlens is None else 0


def none_as_empty(x: Tensor | None, like: Tensor) -> Tensor:
    """A custom op cannot return None: an absent state is a (0,) float32 tensor."""
    return x if x is not None else like.new_empty(0, dtype=torch.float32)


def forward_fake(q: Tensor, v: Tensor, cu: Tensor, store_ht: bool) -> tuple[Tensor, Tensor]:
    """A forward op's fake (meta) outputs: o like v (N_tok, H, V), ht (N, H, K, V) float32 when
    stored, else (0,)."""
    shape = (cu.shape[0] - 1, q.shape[1], q.shape[2], v.shape[2]) if store_ht else (0,)
    return torch.empty_like(v), q.new_empty(shape, dtype=torch.float32)


def backward_fake(tensors: list[Tensor], h0: Tensor | None) -> tuple[Tensor, ...]:
    """A backward op's fake outputs: a gradient like each of ``tensors``, then dh0 like h0
    (float32 (0,) without one)."""
    dh0 = torch.empty_like(h0) if h0 is not None else none_as_empty(None, tensors[0])
    return (*(torch.empty_like(t) for t in tensors), dh0)


def chunked_autograd(
    backward_op: Callable[[], Callable[..., tuple[Tensor, ...]]],
) -> tuple[Callable[..., None], Callable[..., tuple[Tensor | None, ...]]]:
    """(setup_context, backward) for a forward op called as ``fwd(*tensors, h0, cu, scale,
    chunk_size, store_ht, seq_len) -> (o, ht)``: it saves the inputs (the backward op recomputes
    the chunk states from them) and calls ``backward_op()(*tensors, h0, cu, scale, chunk_size,
    seq_len, do, dht) -> (*d tensors, dh0)`` — passed as a thunk, since that op is defined
    after the forward's registration refers to it."""

    def setup(ctx, inputs, output) -> None:
        *tensors, scale, chunk_size, _store_ht, seq_len = inputs
        ctx.save_for_backward(*tensors)  # ..., h0 (or None), cu
        ctx.args = (scale, chunk_size, seq_len)
        ctx.set_materialize_grads(False)

    def backward(ctx, do, dht):
        *tensors, h0, cu = ctx.saved_tensors
        do = torch.zeros_like(tensors[2]) if do is None else do.to(tensors[0].dtype)
        dht = None if dht is None or dht.numel() == 0 else dht.float()
        *grads, dh0 = backward_op()(*tensors, h0, cu, *ctx.args, do, dht)
        # cu, scale, chunk_size, store_ht and seq_len take no gradient.
        return (*grads, dh0 if h0 is not None else None, None, None, None, None, None)

    return setup, backward
