"""The quantized matmuls as torch custom ops (``torch.ops.lmforge_quant.*``).

A custom op is one opaque node for ``torch.compile``: Dynamo and Inductor see its output through
the fake implementation and never trace into Triton, so a compiled decode step (and the CUDA
graph captured from it) keeps the quantized linears without a graph break. Each op picks the
dequant-fused GEMV (:mod:`lmforge.quant._gemv_triton`) for M ≤ 8 rows and the dequant-fused GEMM
(:mod:`lmforge.quant._gemm_triton`) above; both return a fresh contiguous (M, N) tensor in x's
dtype. The ops are registered when this module is first imported (no Triton import until the
first call). Inference only: the ops have no autograd.

In a compiled decode step of ≤ 8 rows the engine calls the module's ``decode_gemv`` instead:
the GEMV's split-K partial sums come out of their own op (``*_gemv_partials``) and their sum and
cast are torch ops, which inductor folds into the consumer's kernel, as it does for the bf16
decode GEMV. Through the module's op they would be two more kernels per linear (three instead of
one; 308 more launches per step of a 22-layer model).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmforge.kernels._common import interpreting, triton_available

__all__ = ["int4_matmul", "int8_matmul", "quant_matmul_supported"]

_NS = "lmforge_quant"
_GEMV_ROWS = 8


def _int4_impl(
    x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor | None, group_size: int
) -> Tensor:
    if x.shape[0] <= _GEMV_ROWS:
        from lmforge.quant._gemv_triton import int4_gemv_partials

        return int4_gemv_partials(x, qweight, scales, offsets, group_size).sum(0).to(x.dtype)
    from lmforge.quant._gemm_triton import int4_gemm

    return int4_gemm(x, qweight, scales, offsets, group_size)


def _int4_fake(
    x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor | None, group_size: int
) -> Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _int8_impl(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    group_size = x.shape[1] // scales.shape[1]
    if x.shape[0] <= _GEMV_ROWS:
        from lmforge.quant._gemv_triton import int8_gemv_partials

        return int8_gemv_partials(x, qweight, scales, group_size).sum(0).to(x.dtype)
    from lmforge.quant._gemm_triton import int8_gemm

    return int8_gemm(x, qweight, scales, group_size)


def _int8_fake(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _int4_partials(
    x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor | None, group_size: int
) -> Tensor:
    from lmforge.quant._gemv_triton import int4_gemv_partials

    return int4_gemv_partials(x, qweight, scales, offsets, group_size)


def _int4_partials_fake(
    x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor | None, group_size: int
) -> Tensor:
    from lmforge.quant._gemv_triton import int4_split

    n, k = qweight.shape[0], x.shape[1]
    split = int4_split(n, k, group_size, x.device)
    return x.new_empty((split, x.shape[0], n), dtype=torch.float32)


def _int8_partials(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    from lmforge.quant._gemv_triton import int8_gemv_partials

    return int8_gemv_partials(x, qweight, scales, x.shape[1] // scales.shape[1])


def _int8_partials_fake(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    from lmforge.quant._gemv_triton import int8_split

    n, k = qweight.shape[0], x.shape[1]
    split = int8_split(n, k, k // scales.shape[1], x.device)
    return x.new_empty((split, x.shape[0], n), dtype=torch.float32)


def _fp8_partials(x: Tensor, qweight: Tensor, scales: Tensor, x_scale: Tensor | None) -> Tensor:
    from lmforge.quant._gemv_triton import fp8_gemv_partials

    return fp8_gemv_partials(x, qweight, scales, x_scale)


def _fp8_partials_fake(
    x: Tensor, qweight: Tensor, scales: Tensor, x_scale: Tensor | None
) -> Tensor:
    from lmforge.quant._gemv_triton import fp8_split

    n, k = qweight.shape
    return x.new_empty((fp8_split(n, k, x.device), x.shape[0], n), dtype=torch.float32)


_OPS = {
    "int4_matmul": (_int4_impl, _int4_fake),
    "int8_matmul": (_int8_impl, _int8_fake),
    "int4_gemv_partials": (_int4_partials, _int4_partials_fake),
    "int8_gemv_partials": (_int8_partials, _int8_partials_fake),
    "fp8_gemv_partials": (_fp8_partials, _fp8_partials_fake),
}


def _define() -> None:
    """Register the ops once per process (a reload reuses them)."""
    ns = getattr(torch.ops, _NS)
    for name, (impl, fake) in _OPS.items():
        if not hasattr(ns, name):
            op = torch.library.custom_op(f"{_NS}::{name}", impl, mutates_args=())
            op.register_fake(fake)


_define()


def int4_matmul(
    x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor | None, group_size: int
) -> Tensor:
    """x (M, K) @ W(int4)ᵀ -> (M, N) in x's dtype through the Triton kernels."""
    return torch.ops.lmforge_quant.int4_matmul(x, qweight, scales, offsets, group_size)


def int8_matmul(x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
    """x (M, K) @ W(int8)ᵀ -> (M, N) in x's dtype through the Triton kernels."""
    return torch.ops.lmforge_quant.int8_matmul(x, qweight, scales)


def quant_matmul_supported(x: Tensor, module: torch.nn.Module) -> bool:
    """Whether the Triton path takes ``module`` (an Int4/Int8/Fp8Linear) on input ``x``: CUDA
    (or the CPU interpreter), bf16/fp16 input (fp32 too under the interpreter, for tests), no
    autocast cast pending, a group the kernels tile (int4: G/2 a power of two ≥ 16; int8: G a
    multiple of 16) and no autograd."""
    if not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) and not (
        interpreting() and x.dtype == torch.float32
    ):
        return False
    if torch.is_autocast_enabled(x.device.type) or (torch.is_grad_enabled() and x.requires_grad):
        return False
    if x.shape[-1] != module.d_in or x.numel() == 0 or not triton_available():
        return False
    g = getattr(module, "group_size", None)
    if g is None:  # fp8: the row kernel's K chunks
        return module.d_in % 16 == 0
    if hasattr(module, "symmetric"):  # int4
        half = g // 2
        return half >= 16 and (half & (half - 1)) == 0
    return g % 16 == 0
